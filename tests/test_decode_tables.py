"""A decode step's position tables in one op (`ops.decode_tables`), made up front by `StepContext.seed_decode_tables`
instead of a few torch launches each on the layer that first asks; and the count of those torch launches
(`bench.glue`), which the registry's op count does not see.

The op is gathers and integer arithmetic: the Triton kernel (interpreted on CPU) gives the reference's bits, and a
model's decode steps give the same logits with the tables seeded or made layer by layer
(DEEPINFER_DECODE_FUSIONS=-decode_tables).
"""

from __future__ import annotations

import pytest
import torch

from backend_device import device_for
from deepinfer.bench.glue import TorchGlue, launches
from deepinfer.engine.loader import load_model
from deepinfer.ops import REGISTRY, ops


def _tables(g, max_pos, half):
    return torch.randn(max_pos, 2, half, generator=g), torch.randn(max_pos, 2, half, generator=g)


def _positions(g, B, ratios, max_pos):
    pos = torch.randint(0, max_pos, (B,), generator=g)
    edges = [0, 1] + [e for r in ratios for e in (r - 2, r - 1, r, 2 * r - 1)]  # before and at each window's end
    for i, e in enumerate(e for e in edges if 0 <= e < max_pos):
        if i < B:
            pos[i] = e
    return pos


@pytest.mark.parametrize("ratios", [(4, 128), (), (3,), (2, 5, 7, 16)])
@pytest.mark.parametrize("B", [1, 9])
def test_triton_decode_tables_equal_the_reference_bitwise(ratios, B):
    pytest.importorskip("triton")
    ops.configure("triton")  # loads the backend
    g = torch.Generator().manual_seed(B * 31 + len(ratios))
    dev = device_for("triton")
    main, comp = (t.to(dev) for t in _tables(g, 300, 8))
    pos = _positions(g, B, ratios, 300).to(dev)
    win = 7
    got = REGISTRY["decode_tables"].impls["triton"](pos, main, comp, ratios, win)
    want = REGISTRY["decode_tables"].ref(pos, main, comp, ratios, win)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
    cs, idx = want
    nr = len(ratios)
    assert cs.shape == (2 + nr, B, 1, 2, 8) and idx.shape == (1 + 2 * nr, B)
    for k, r in enumerate(ratios):  # what the compressors and the indexer would have made themselves
        first = (pos - (r - 1)).clamp_min(0)
        assert torch.equal(cs[2 + k, :, 0], comp[first])
        assert torch.equal(idx[1 + k], pos // r) and torch.equal(idx[1 + nr + k], (pos + 1) // r)
    assert torch.equal(idx[0], pos % win) and torch.equal(cs[0, :, 0], main[pos]) and torch.equal(cs[1, :, 0], comp[pos])


def test_triton_decode_tables_refuses_more_than_four_ratios():
    pytest.importorskip("triton")
    ops.configure("triton")
    main, comp = _tables(torch.Generator().manual_seed(0), 16, 4)
    with pytest.raises(ValueError, match="up to four ratios"):
        REGISTRY["decode_tables"].impls["triton"](torch.tensor([3]), main, comp, (2, 3, 4, 5, 6), 4)


def _decode(backend, monkeypatch, fusions, numerics="official", dtype="bfloat16", B=2, steps=2):
    """deepinfer-tiny: B rows prefilled with seeded prompts of different lengths, then `steps` decode steps of
    seeded tokens (the same in every call) -> (stacked logits, {op: calls} of the last step, its TorchGlue)."""
    monkeypatch.setenv("DEEPINFER_DECODE_FUSIONS", fusions)
    ops.configure(backend)
    m = load_model(None, numerics, dtype, device_for(backend), progress=False).model
    g = torch.Generator().manual_seed(3)
    lens = [13, 6][:B]  # row 0 past the tiny model's window (8) and a ratio-16 entry boundary, row 1 before them
    m.allocate(B, max(lens) + steps + 2)
    for r, n in enumerate(lens):
        m.prefill(torch.randint(2, m.cfg.vocab_size, (1, n), generator=g), torch.tensor([r]))
    toks = torch.randint(2, m.cfg.vocab_size, (steps, B, 1), generator=g)
    out, rows = [], torch.arange(B)
    for s in range(steps):
        pos = torch.tensor(lens) + s
        if s == steps - 1:
            ops.count_calls(True)
            try:
                with TorchGlue() as glue:
                    out.append(m.decode(toks[s], pos, rows))
            finally:
                counts = ops.count_calls(False)
        else:
            out.append(m.decode(toks[s], pos, rows))
    return torch.stack(out), counts, glue


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_seeded_tables_give_the_layers_own_logits(backend, monkeypatch, tiny_dir):
    """Decode steps with the tables seeded up front give the logits of the layers making them on first use, bit
    for bit (rows at different positions, across a window's end); the seeded step calls decode_tables once and
    launches no torch op of the layers' tables between the registry ops, where the layers' own took 13."""
    if backend == "triton":
        pytest.importorskip("triton")
    seeded, c_on, g_on = _decode(backend, monkeypatch, "on")
    own, c_off, g_off = _decode(backend, monkeypatch, "-decode_tables")
    assert torch.isfinite(seeded).all()
    assert torch.equal(seeded, own)
    assert c_on.get("decode_tables") == 1 and "decode_tables" not in c_off
    tables = ("model/rope.py", "model/compressor.py", "model/attention.py")  # where the layers made them
    assert not [k for k in g_on.by_site() if k.startswith(tables)], g_on.by_site()
    assert sum(n for k, n in g_off.by_site().items() if k.startswith(tables)) == 13, g_off.by_site()


def test_seeded_tables_exact_numerics(monkeypatch, tiny_dir):
    seeded = _decode("torch", monkeypatch, "on", "exact", "float32", B=1)[0]
    own = _decode("torch", monkeypatch, "-decode_tables", "exact", "float32", B=1)[0]
    assert torch.equal(seeded, own)


def test_glue_counts_launches_not_views():
    """`bench.glue.launches`: a kernel-running ATen op counts (arithmetic, a gather, an in-place write, a fill),
    a view, a no-op conversion or a bare allocation does not."""
    x = torch.randn(4, 6)
    ops.count_calls(True)
    try:
        with TorchGlue() as glue:
            x.view(24)
            x.t()
            x[1:]
            x.to(torch.float32)
            torch.empty(3)
            y = x + 1  # 1
            x[torch.tensor([0, 2])]  # 2
            y.clamp_min_(0)  # 3
            torch.zeros(5)  # 4
            x.to(torch.bfloat16)  # 5
    finally:
        ops.count_calls(False)
    assert glue.total == 5, glue.by_site()
    with torch.inference_mode():  # no-op conversions are dispatched there: still not launches
        with TorchGlue() as g2:
            x.to(torch.float32)
    assert g2.total == 0, g2.by_site()
    assert not launches(torch.ops.aten.empty.memory_format, ([2],), {}, torch.empty(2))


def test_glue_skips_what_runs_inside_registry_ops():
    """Only ops between registry ops count: an op's own torch work (the reference's arithmetic) is its launch."""
    x, w = torch.randn(2, 1, 64), torch.ones(64)
    ops.configure("torch")
    ops.count_calls(True)
    try:
        with TorchGlue() as glue:
            ops.rms_norm(x, w, 1e-6)
            x * 2
    finally:
        counts = ops.count_calls(False)
    assert counts == {"rms_norm": 1} and glue.total == 1, glue.by_site()


def test_verify_makes_each_table_once_a_step(tiny_dir):
    """A speculative verify step and its commit build the compressors' per-token tables (window-start rope rows,
    entry slots) once per ratio for all the step's tokens, each window / HCA index table once per layer shape, and
    the commit's rows and ring slots once (`ctx.memo`), where every compressor, token and layer made its own: on
    deepinfer-tiny (2 ratios, 5 compressors) S = 3 tokens take 2 clamps, not 30 (the step's and the commit's), and
    the torch launches between registry ops 100, not 238."""
    ops.configure("torch")
    m = load_model(None, "official", "bfloat16", "cpu", progress=False).model
    m.allocate(3, 64)
    g = torch.Generator().manual_seed(4)
    m.prefill(torch.randint(2, m.cfg.vocab_size, (1, 20), generator=g), torch.tensor([0]))
    ids = torch.randint(2, m.cfg.vocab_size, (1, 3), generator=g)
    ops.count_calls(True)
    try:
        with TorchGlue() as glue:
            _, _, ctx = m.verify(ids, torch.tensor([20]), torch.tensor([0]))
            m.commit(ctx, torch.tensor([2]))
    finally:
        ops.count_calls(False)
    ratios = {r for r in m.cfg.compress_ratios if r}
    clamps = sum(n for k, n in glue.by_site().items() if k.endswith(" clamp_min"))
    assert clamps == len(ratios), glue.by_site()
    assert glue.total <= 100, (glue.total, glue.by_site())  # 238 before the memos, 126 with them per token
