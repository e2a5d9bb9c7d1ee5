"""The model writes its order once (`Block`, `Attention`, `MoE.parts`); the runner issues it.

* Under a debug capture the block computes the MoE's sum and the post-mix apart (the taps read the MoE's
  output); otherwise they are one op (`moe_combine_post`). Same values, bit for bit: prefill (whole and
  chunked) and decode, both numerics.
* A fork leaves the current stream only inside a runner's `Lanes.issuing` (the streams are the runner's).
* On CUDA: a decode through the runner (its lanes on side streams) gives the bits of `model.decode` on one
  stream.
"""

import pytest
import torch

from backend_device import device_for
from deepinfer.capture import capturing
from deepinfer.engine.loader import load_model
from deepinfer.model import branch


def _steps(model, ids, chunks=None, n=5, decode=None):
    """Prefill ids [1, T] (in `chunks`), then n greedy decode steps -> stacked last-token logits."""
    T = ids.size(1)
    model.allocate(2, T + n + 1)
    rows = torch.tensor([1], device=model.device)
    s0, logits = 0, None
    for c in chunks or [T]:
        logits, _ = model.prefill(ids[:, s0:s0 + c].to(model.device), rows=rows, start=s0)
        s0 += c
    out = [logits[:, -1]]
    step = decode or (lambda nxt, pos, rows: model.decode(nxt, pos, rows)[:, -1])
    for k in range(n):
        nxt = out[-1].argmax(-1, keepdim=True)
        out.append(step(nxt, torch.tensor([T + k], device=model.device), rows))
    return torch.stack(out)


@pytest.mark.parametrize("numerics,dtype", [("official", "bfloat16"), ("exact", "float32")])
@pytest.mark.parametrize("chunks", [None, [20, 25]])
def test_fused_combine_gives_the_taps_values(numerics, dtype, chunks, tiny_dir):
    lm = load_model(None, numerics, dtype, "cpu", progress=False)
    ids = torch.randint(2, 129280, (1, 45), generator=torch.Generator().manual_seed(5))
    fused = _steps(lm.model, ids, chunks)
    with capturing(include=r"\.ffn\.out$") as cap:  # taps on: the sum and the post-mix apart
        apart = _steps(lm.model, ids, chunks)
    n_layers = lm.cfg.n_layers
    assert len(cap.records) == n_layers * (len(chunks or [1]) + 5), "every block taps its MoE output"
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, apart)


def _counted_official_steps(backend: str, seed: int) -> tuple:
    """deepinfer-tiny, official numerics, bf16 on `backend`: a 12-token prompt (seeded) prefilled and decoded 2 steps
    with the registry ops counted -> (loaded model, ids, `_steps`' logits, {op: calls})."""
    from deepinfer.ops import ops

    if backend == "triton":
        pytest.importorskip("triton")
    ops.configure(backend)
    lm = load_model(None, "official", "bfloat16", device_for(backend), progress=False)
    ids = torch.randint(2, 129280, (1, 12), generator=torch.Generator().manual_seed(seed))
    ops.count_calls(True)
    try:
        logits = _steps(lm.model, ids, n=2)
    finally:
        counts = ops.count_calls(False)
    return lm, ids, logits, counts


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_decode_attention_norms_q_itself_with_the_taps_values(backend, tiny_dir):
    """Official numerics' FP8 cache: a decode step hands wq_b's output to the attention op, which norms and rotates
    q as it loads it (`q_norm_sparse_attn_fp8`, one op per layer, no q `rms_norm_rope`); under a capture (the q
    taps) the two ops run. Same tokens' logits, bit for bit (Triton: its interpreter)."""
    lm, ids, fused, counts = _counted_official_steps(backend, 6)
    n_layers = lm.cfg.n_layers
    assert counts.get("q_norm_sparse_attn_fp8") == 2 * n_layers, counts
    with capturing(include=r"\.attn\.q$") as cap:  # q tapped: normed apart
        apart = _steps(lm.model, ids, n=2)
    assert len(cap.records) == n_layers * 3
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, apart)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_post_mixes_in_the_next_launch_give_the_plain_bits(backend, tiny_dir):
    """FP8 projections: the attention's post-mix runs inside the MoE's pre-mix op, and each block's MoE post-mix
    inside the next block's attention pre-mix op (the last block's inside the hc head's): one op per boundary.
    With sites recorded (bisect, graft: every op at its own layer) each runs as its own op. Same logits, bit for
    bit, prefill and decode (Triton: its interpreter)."""
    from deepinfer.ops import ops

    lm, ids, fused, counts = _counted_official_steps(backend, 8)
    L = lm.cfg.n_layers
    assert counts.get("hc_post_pre_quant") == 3 * L and counts.get("moe_combine_post_head") == 2, counts
    assert counts.get("moe_combine_post_pre_quant") == 3 * (L - 1) and "hc_post" not in counts, counts
    ops.record_sites(True)
    try:
        apart = _steps(lm.model, ids, n=2)
    finally:
        seen = ops.record_sites(False)
    assert ("moe_combine_post", L - 1) in seen and ("hc_post_pre_quant", 0) in seen
    assert not any(op in ("moe_combine_post_pre_quant", "moe_combine_post_head") for op, _ in seen)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, apart)


def test_fork_needs_the_runners_lanes(monkeypatch):
    """An enabled fork outside `Lanes.issuing` stays on the current stream; inside, it takes the lane's stream
    (stream creation faked: no CUDA here)."""
    class FakeCuda(torch.Tensor):
        is_cuda = True

    x = torch.randn(2).as_subclass(FakeCuda)
    monkeypatch.setenv(branch.ENV, "1")
    monkeypatch.setattr(branch, "_same_device", lambda a, b: True)
    assert branch.enabled(x) and branch.fork(x).stream is None
    lanes = branch.Lanes(torch.device("cpu"))
    made = []
    monkeypatch.setattr(lanes, "stream", lambda name: made.append(name) or f"stream:{name}")
    with lanes.issuing():
        assert branch.fork(x, lane="hc").stream == "stream:hc"
        assert branch.fork(x, lane="shared_expert").stream == "stream:side"
        assert branch.fork(x, on=False).stream is None
    assert branch.fork(x).stream is None and made == ["hc", "side"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_lanes_give_the_models_bits(monkeypatch):
    """On CUDA the runner forks side streams (decode): still the one-stream bits (Triton backend)."""
    from deepinfer.engine.runner import DecodeRunner
    from deepinfer.ops import ops

    monkeypatch.setenv(branch.ENV, "1")
    ops.configure(backend="triton")
    try:
        lm = load_model(None, "official", "bfloat16", "cuda", progress=False)
        ids = torch.randint(2, 129280, (1, 45), generator=torch.Generator().manual_seed(6))
        plain = _steps(lm.model, ids)
        runner = DecodeRunner(lm.model, 1)
        lanes = _steps(lm.model, ids, decode=lambda nxt, pos, rows: runner.decode(nxt, pos, rows))
        assert set(runner.lanes._streams) == {"hc", "side"}, "the runner's side streams ran the forks"
    finally:
        ops.configure(backend="torch")
    assert torch.equal(lanes, plain)
