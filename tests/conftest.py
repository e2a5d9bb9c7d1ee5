"""Shared fixtures: the tiny model (created once per cache), CUDA skips."""

import os

# MKL's strict reproducibility mode, set before torch's first BLAS call: without it MKL computes a float32 GEMM of
# fewer than 16 rows by another kernel (gemv) than the same rows inside a larger one on AVX-512 machines, a few ulp
# apart, and official numerics' FP8 requantization turns such ulps into sporadic 1e-5..1e-3 differences between a
# decode step and the full forward (seen on a 2-core Xeon with AMX, 2026-12-03). The tests that compare decode with
# prefill, padded with unpadded batches and speculative with plain decode test the engine's caches, not MKL.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("DEEPINFER_BACKEND", "torch")  # tests pick backends explicitly
# Triton reads TRITON_INTERPRET when it is imported: on a CPU machine every test that touches Triton runs
# kernels in the interpreter, so set it before any test module imports triton.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir():
    from deepinfer.tiny import ensure_tiny_model

    return ensure_tiny_model(progress=False)


@pytest.fixture(autouse=True)
def _torch_backend():
    from deepinfer.ops import ops

    ops.configure("torch", strict=False)
    yield
