"""DeepInfer's kernel backends (triton/, tilelang/, flaggems/), imported as `deepinfer_kernels`.

The folder carries its import name: a folder named `kernels` at the repository root was importable as top-level
`kernels` wherever the root is on sys.path (`python -m deepinfer` from it, PYTHONPATH=$PWD), and there it hid
Hugging Face's `kernels` package, which transformers imports as it builds a model (tests/test_kernels_name.py).
"""
