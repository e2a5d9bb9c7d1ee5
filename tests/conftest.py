"""Shared fixtures: the tiny model (created once per cache), CUDA skips."""

import os

import pytest
import torch

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
