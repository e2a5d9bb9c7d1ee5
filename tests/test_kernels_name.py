"""Nothing in the repository is importable as top-level `kernels`: with the repository root on sys.path (`python -m`
from it, PYTHONPATH=$PWD on a GPU machine), a folder of that name hid Hugging Face's `kernels` package, which
transformers imports as it builds a model, and `bench --peer transformers` failed where that package is not
installed. The backends' folder is `deepinfer_kernels/`, its import name."""
import importlib.metadata
import importlib.machinery
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_repository_root_holds_no_kernels_module():
    """The cause, with or without Hugging Face's package installed: the root alone offers no `kernels`."""
    assert importlib.machinery.PathFinder.find_spec("kernels", [ROOT]) is None
    assert not os.path.exists(os.path.join(ROOT, "kernels.py"))


def test_kernels_from_the_repository_root_is_hugging_faces_or_absent():
    code = "import kernels; print(kernels.__file__)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:  # Hugging Face's, from where its distribution installed it
        assert p.returncode == 0, p.stderr[-2000:]
        assert os.path.samefile(p.stdout.strip(), dist.locate_file("kernels/__init__.py")), p.stdout
    else:
        assert p.returncode != 0 and "ModuleNotFoundError: No module named 'kernels'" in p.stderr, p.stderr[-2000:]


def test_without_hugging_faces_package_transformers_finds_none(tmp_path):
    """As on the GPU machines (transformers without Hugging Face's `kernels`): a finder hides the installed package,
    the repository root is on sys.path, and transformers' own check finds no `kernels` (it found the folder)."""
    code = f"""
import importlib.abc, importlib.machinery, sys
sys.path.insert(0, {ROOT!r})
class NoInstalledKernels(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "kernels":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and "-packages" in (spec.origin or str(spec.submodule_search_locations)):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return spec
sys.meta_path.insert(0, NoInstalledKernels())
import importlib.util
print(importlib.util.find_spec("kernels"))
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "None" or "No module named 'kernels'" in p.stderr, (p.stdout, p.stderr[-2000:])


def test_deepinfer_kernels_is_the_folder_and_loads_nothing_else(tmp_path):
    """Under its own name the folder is itself and leaves the name `kernels` alone (run outside the repository, so
    its root is not on sys.path)."""
    code = "import sys, deepinfer_kernels; print(deepinfer_kernels.__file__); print('kernels' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    where, loaded = p.stdout.split()
    assert os.path.samefile(os.path.dirname(where), os.path.join(ROOT, "deepinfer_kernels")), where
    assert loaded == "False"
