"""A prefill's position and index tables are made once a step per ratio and layer shape (`StepContext.memo`), not
by every layer and compressor, and a fresh prompt's compressors neither reset nor read their rows' old state.

Both are launch counts on a GPU (each torch op between registry ops is a kernel, and on an eager prefill a host
issue of its own); the values are the same expressions', so the logits are checked bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepinfer.bench.glue import counting
from deepinfer.engine.loader import load_model
from deepinfer.ops import ops


def _model(backend="torch", numerics="official", dtype="bfloat16"):
    ops.configure(backend)
    return load_model(None, numerics, dtype, "cpu", progress=False).model


def _counted_prefill(m, ids, row):
    with counting() as n:
        logits, _ = m.prefill(ids, torch.tensor([row]), all_logits=True)
    return logits, n.ops, n.glue


def test_prefill_tables_once_a_step(tiny_dir):
    """deepinfer-tiny (layers swa, csa 4, hca 16, csa 4; 5 compressors of 2 ratios), a 40-token prefill: one
    `arange` per table kind (the positions, the window's two, the ring's, HCA's visible entries, each ratio's
    window starts), where every layer and compressor made its own (24), and at most 60 torch launches between
    the registry ops: 208 when each made its own tables, 127 when each compressor still assembled its windows
    and carried state from ~17 torch ops (one `compress_prefill` now)."""
    m = _model()
    m.allocate(1, 48)
    ids = torch.randint(2, m.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    logits, counts, glue = _counted_prefill(m, ids, 0)
    assert torch.isfinite(logits).all()
    aranges = sum(n for k, n in glue.by_site().items() if k.endswith(" arange"))
    assert aranges == 7, glue.by_site()
    assert glue.total <= 60, (glue.total, glue.by_site())
    # the compressors': each one's cache write, each ratio's window starts (arange, mul, add)
    assert sum(n for k, n in glue.by_site().items() if "compressor.py" in k) <= 5 + 2 * 3, glue.by_site()
    assert sum(counts.values()) > 100  # the registry ops themselves are still all there


@pytest.mark.parametrize("numerics,dtype", [("official", "bfloat16"), ("exact", "float32")])
def test_fresh_prefill_ignores_the_rows_old_state(numerics, dtype, tiny_dir):
    """A prompt prefilled into a row whose compressor state holds NaN (what a finished sequence or garbage could
    leave) gives the logits, carried state and cache entries of the same prompt in a row never used: the fresh
    path writes the state without reading it. Then a chunk that continues it (start > 0) does read it."""
    m = _model(numerics=numerics, dtype=dtype)
    m.allocate(2, 64)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, m.cfg.vocab_size, (1, 27), generator=g)
    more = torch.randint(2, m.cfg.vocab_size, (1, 6), generator=g)
    comps = [c for layer in m.layers for c in _compressors(layer)]
    assert len(comps) == 5
    for c in comps:
        c.kv_state[1].fill_(float("nan"))
        c.score_state[1].fill_(float("nan"))
    clean, _ = m.prefill(ids, torch.tensor([0]), all_logits=True)
    dirty, _ = m.prefill(ids, torch.tensor([1]), all_logits=True)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean, dirty)
    for c in comps:
        assert torch.equal(c.kv_state[0], c.kv_state[1]) and torch.equal(c.score_state[0], c.score_state[1])
        assert torch.equal(c.cache[0], c.cache[1])
    a, _ = m.prefill(more, torch.tensor([0]), start=27)
    b, _ = m.prefill(more, torch.tensor([1]), start=27)
    assert torch.isfinite(b).all() and torch.equal(a, b)


def _compressors(layer):
    attn = layer.attn
    out = [attn.compressor] if attn.compressor is not None else []
    return out + ([attn.indexer.compressor] if attn.indexer is not None else [])
