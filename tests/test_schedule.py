"""The engine's plan (`deepinfer.engine.schedule`) issues the model's sub-steps with side streams and
fusions; the model runs them in order. Same values, bit for bit: prefill (whole and chunked) and decode."""

import pytest
import torch

from deepinfer.engine.loader import load_model
from deepinfer.engine.schedule import Schedule


def _steps(model, ids, chunks=None, n=5):
    """Prefill ids [1, T] (in `chunks`), then n greedy decode steps -> stacked last-token logits."""
    T = ids.size(1)
    model.allocate(2, T + n + 1)
    rows = torch.tensor([1], device=model.device)
    s0, logits = 0, None
    for c in chunks or [T]:
        logits, _ = model.prefill(ids[:, s0:s0 + c].to(model.device), rows=rows, start=s0)
        s0 += c
    out = [logits[:, -1]]
    for k in range(n):
        nxt = out[-1].argmax(-1, keepdim=True)
        out.append(model.decode(nxt, torch.tensor([T + k], device=model.device), rows)[:, -1])
    return torch.stack(out)


def _both(model, ids, chunks=None):
    assert isinstance(model.schedule, Schedule), "the loader sets the engine's plan"
    planned = _steps(model, ids, chunks)
    plan, model.schedule = model.schedule, None
    try:
        plain = _steps(model, ids, chunks)
    finally:
        model.schedule = plan
    return planned, plain


@pytest.mark.parametrize("numerics,dtype", [("official", "bfloat16"), ("exact", "float32")])
@pytest.mark.parametrize("chunks", [None, [20, 25]])
def test_plan_gives_the_models_values(numerics, dtype, chunks, tiny_dir):
    lm = load_model(None, numerics, dtype, "cpu", progress=False)
    ids = torch.randint(2, 129280, (1, 45), generator=torch.Generator().manual_seed(5))
    planned, plain = _both(lm.model, ids, chunks)
    assert torch.isfinite(planned).all()
    assert torch.equal(planned, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plan_on_streams_gives_the_models_values(monkeypatch):
    """On CUDA the plan forks side streams (decode): still the sequential bits (Triton backend)."""
    from deepinfer.ops import ops

    monkeypatch.setenv("DEEPINFER_BRANCHES", "1")
    ops.configure(backend="triton")
    try:
        lm = load_model(None, "official", "bfloat16", "cuda", progress=False)
        ids = torch.randint(2, 129280, (1, 45), generator=torch.Generator().manual_seed(6))
        planned, plain = _both(lm.model, ids)
    finally:
        ops.configure(backend="torch")
    assert torch.equal(planned, plain)


def test_bench_builds_with_the_plan():
    """`deepinfer bench` times the model as the engine runs it (a plan-less model would time no streams)."""
    from deepinfer.engine.bench import BenchOptions, build
    from deepinfer.model.weights import Numerics

    _, model, *_ = build(BenchOptions(preset="tiny", progress=False), torch.device("cpu"),
                         Numerics("official", torch.bfloat16))
    assert isinstance(model.schedule, Schedule)
