"""The device a test runs a backend on.

tests/conftest.py sets TRITON_INTERPRET only where there is no CUDA: there Triton's kernels run in the interpreter on
CPU tensors; on a CUDA host they compile, and a CPU tensor handed to one is an error. A test that runs the Triton
backend outside the `gpu` mark takes its device from here, so it runs on either machine; the torch reference stays
on the CPU.
"""

from __future__ import annotations

import os


def device_for(backend: str) -> str:
    """"cuda" for a kernel backend where Triton compiles (a CUDA host), else "cpu"."""
    compiled = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    return "cuda" if backend != "torch" and compiled else "cpu"
