"""DeepInfer's kernel backends (triton/, tilelang/, flaggems/), installed under the import name `deepinfer_kernels`.

Found under the name `kernels` instead -- the repository root on sys.path, as `python -m` run from it puts it --
this folder would hide Hugging Face's `kernels` package, which transformers (5.25 on) imports as it builds a model.
It then loads that package in its own place, so `import kernels` gives what transformers expects; with none
installed, the import fails as it would without this folder.
"""
import sys as _sys

if __name__ == "kernels":
    import os as _os
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _os.path.abspath(p or ".") != _root])
    if _spec is None:
        raise ImportError("no `kernels` package is installed: this folder is DeepInfer's, imported as deepinfer_kernels",
                          name="kernels")
    _hf = _module_from_spec(_spec)
    _sys.modules["kernels"] = _hf  # the import statement returns what sys.modules holds once this file has run
    _spec.loader.exec_module(_hf)
