"""The FP8 KV cache layout in the model (official numerics, release 60d8d707's KV QAT): what is stored where, and that attending
from it gives exactly the logits of the float cache holding the same QAT values (tiny model, CPU).

The prompt is long enough (45 tokens: 11 CSA entries against the tiny indexer's top-4) that the indexer's
choice matters, so a corrupted key cache shows in the logits.
"""

import pytest
import torch

from deepinfer.engine.loader import load_model
from deepinfer.ops import ops
from deepinfer.quant.kv_layout import kv_packed_width


@pytest.fixture(scope="module")
def lm():
    # official numerics (release 60d8d707): the KV QAT, the cache in its FP8 layout
    return load_model(None, numerics="official", dtype="float32", progress=False, device="cpu")


def _use_fp8_layout(model, on: bool) -> None:
    model.set_kv_layout("fp8" if on else "float")


def _run(model, chunks):
    """Prefill a fixed 45-token prompt (in `chunks`), then 4 greedy decode steps -> stacked logits."""
    ids = torch.randint(2, 1000, (1, 45), generator=torch.Generator().manual_seed(0))
    model.allocate(2, 64)
    rows = torch.tensor([1])
    s0 = 0
    for c in chunks:
        logits, _ = model.prefill(ids[:, s0:s0 + c], rows=rows, start=s0)
        s0 += c
    out = [logits[:, -1]]
    for step in range(4):
        nxt = out[-1].argmax(-1, keepdim=True)
        out.append(model.decode(nxt, torch.tensor([45 + step]), rows)[:, -1])
    return torch.stack(out)


def test_official_caches_layouts(lm):
    m = lm.model
    m.allocate(2, 64)
    kinds = set()
    for a in m.attentions():
        assert a.kv_cache.dtype == torch.uint8 and a.kv_cache.size(-1) == kv_packed_width(a.hd, a.rd, torch.float32)
        if a.indexer is not None:  # the indexer keeps float keys (its own FP4 QAT), never the packed bytes
            assert a.indexer.compressor.cache.dtype == torch.float32
            kinds.add("csa")
    assert "csa" in kinds


@pytest.mark.parametrize("chunks", [[45], [20, 25], [13, 1, 31]])
def test_fp8_layout_gives_the_float_cache_logits(lm, chunks):
    """Packing is the cache's QAT (values = fp8_fake_quant), so prefill (whole and chunked: earlier rows read
    back from the cache) and decode (read in place) give the float cache's logits."""
    m = lm.model
    try:
        _use_fp8_layout(m, False)
        ref = _run(m, chunks)
        _use_fp8_layout(m, True)
        got = _run(m, chunks)
    finally:
        _use_fp8_layout(m, True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_kv_layout_option(lm):
    """The float layout under official numerics is an explicit option; exact numerics have no FP8 layout."""
    import pytest

    a = lm.model.attentions()[0]
    with pytest.raises(ValueError, match="fp8 | float"):
        a.set_kv_layout("bf16")
    ex = load_model(None, numerics="exact", dtype="float32", progress=False, device="cpu").model
    with pytest.raises(ValueError, match="official"):
        ex.set_kv_layout("fp8")
    assert not any(x.fp8_kv for x in ex.attentions())


def test_packed_cache_holds_the_fake_quant_values(lm):
    """After a prefill, the packed window rows decode to the fp8_fake_quant of their no-RoPE dims."""
    m = lm.model
    _run(m, [45])
    a = m.attentions()[0]
    rows = ops.kv_unpack(a.kv_cache[1, :a.win], a.hd, a.rd, torch.float32)
    nope = rows[..., :-a.rd]
    assert (nope != 0).any()
    assert torch.equal(ops.fp8_fake_quant(nope, 64), nope)  # already on the FP8 grid: requantising is exact
