"""`swiglu_grouped_gemm`: the routed experts' w2 on their w1|w3 output, the SwiGLU and its act_quant computed by
the w2 kernel as it loads each A step at batch-1 decode sizes (Triton, interpreter on CPU).

The fused form must give the bits of the two ops it replaces (Triton's swiglu_quant, then grouped_gemm): the
activation, its rounding to the output dtype and the per-128 act_quant are one expression in both
(`_common.swiglu_f32`, `quant_e4m3_rows`), and the GEMM's operands are then the same values."""

from __future__ import annotations

import os

COMPILED = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer.ops import REGISTRY  # noqa: E402
from deepinfer.quant.formats import e8m0_to_float, float_to_e8m0, quant_fp4, quant_fp8_block  # noqa: E402
from tc_bounds import TC_REL, abs_products  # noqa: E402

DEV = "cuda" if COMPILED else "cpu"


def _triton():
    pytest.importorskip("triton")
    import deepinfer_kernels.triton as tk  # noqa: F401  (registers the implementations)
    from deepinfer_kernels.triton import moe_grouped

    return moe_grouped


def _w2(g, fmt, E, N, I):
    if fmt == "fp8":
        ws = [quant_fp8_block(torch.randn(N, I, generator=g) * 0.05) for _ in range(E)]
        return torch.stack([w for w, _ in ws]), torch.stack([e8m0_to_float(s) for _, s in ws])
    ws = [quant_fp4(torch.randn(N, I, generator=g) * 0.05) for _ in range(E)]
    return torch.stack([w for w, _ in ws]), float_to_e8m0(torch.stack([e8m0_to_float(s) for _, s in ws]))


def _h(g, P, I, dtype):
    """w1|w3 outputs [P, 2I] with 128-blocks whose magnitudes span 2^-8 .. 2^8 (per-block scales that differ),
    values past the clamp (|x| > limit) and one block of tiny values (the act_quant's amax floor)."""
    h = torch.randn(P, 2 * I, generator=g) * torch.exp2(torch.randint(-8, 9, (P, 2 * I // 128, 1), generator=g)
                                                         .float()).repeat_interleave(128, 1).view(P, 2 * I)
    h[:, 3] = 25.0  # gate past the clamp of 10
    h[:, I + 5] = -30.0  # up past it, below
    h[0, :128] = 1e-7
    return h.to(dtype)


# (fmt, P rows, experts, N, I, h dtype / out dtype, limit, weighted)
CASES = [("fp4", 6, 8, 128, 512, torch.float32, 10.0, True),   # batch-1 decode: one token's 6 pairs, split K
         ("fp4", 1, 4, 256, 256, torch.float16, 10.0, True),
         ("fp4", 6, 8, 128, 256, torch.bfloat16, 10.0, True),  # the model's dtype
         ("fp8", 6, 8, 128, 256, torch.bfloat16, 10.0, True),
         ("fp4", 8, 8, 64, 384, torch.float32, 0.0, False),     # no clamp, no routing weight
         ("fp8", 6, 8, 256, 512, torch.float32, 10.0, True),
         ("fp8", 3, 4, 128, 256, torch.float16, 7.5, True)]


@pytest.mark.parametrize("fmt,P,E,N,I,dt,limit,weighted", CASES)
def test_fused_w2_is_swiglu_quant_then_grouped_gemm_bitwise(fmt, P, E, N, I, dt, limit, weighted, monkeypatch):
    """At <= IDENT_MAX_P rows the fused kernel runs (no swiglu_quant launch) and gives the bits of Triton's
    swiglu_quant then grouped_gemm; rows routed to -1 or past E are 0; the GEMM within the reference's bound."""
    mg = _triton()
    g = torch.Generator().manual_seed(P * 100 + N)
    h = _h(g, P, I, dt)
    w, w_s = _w2(g, fmt, E, N, I)
    e = torch.randint(0, E, (P,), generator=g)
    if P > 2:
        e[1], e[2] = -1, E + 1  # padding, another rank's expert
    wt = torch.rand(P, generator=g) + 0.1 if weighted else None
    h, w, w_s, e = (t.to(DEV) for t in (h, w, w_s, e))
    wt = wt.to(DEV) if wt is not None else None
    d = REGISTRY["swiglu_grouped_gemm"]
    fp4 = fmt == "fp4"
    sq, gg = REGISTRY["swiglu_quant"].impls["triton"], REGISTRY["grouped_gemm"].impls["triton"]
    a = sq(h[:, :I], h[:, I:], limit, weight=wt, out_dtype=dt, split=fp4)
    two = gg(a[0], a[1], e, w, w_s, out_dtype=dt, a_split=a[2] if fp4 else None)
    monkeypatch.setattr(mg, "_swiglu_quant", lambda *a, **k: pytest.fail("the fused path runs no swiglu_quant"))
    got = d.impls["triton"](h, limit, wt, e, w, w_s, out_dtype=dt)
    assert got.dtype == dt and got.shape == (P, N) and torch.isfinite(got).all()
    assert torch.equal(got, two), f"{(got.float() - two.float()).abs().max().item():.3e} from the two ops"
    dead = (e < 0) | (e >= E)
    assert (got[dead] == 0).all() and (got[~dead] != 0).any()
    # the GEMM against the reference's on the same quantised A (Triton's swiglu_quant against its reference, one
    # e4m3 step, is tests/test_triton_kernels.py's): the fp32 sum order's bound (Σ|a w| per element, `tc_bounds`)
    # and the outputs' roundings
    live = torch.where(dead, -1, e)
    ref = REGISTRY["grouped_gemm"].ref(a[0], a[1], live, w, w_s, out_dtype=dt).double()
    mag = abs_products("grouped_gemm", a[0], a[1], live, w, w_s, out_dtype=torch.float32).double()
    out_ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}.get(dt, 0.0)  # both outputs' roundings
    bound = TC_REL * mag + out_ulp * ref.abs() + 1e-30
    excess = ((got.double() - ref).abs() / bound).max().item()
    assert excess <= 1.0, f"{excess:.2f}x the bound from the reference"


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_more_rows_run_the_two_ops(fmt):
    """Past IDENT_MAX_P rows (sorted blocks) the op is swiglu_quant then grouped_gemm: their A is converted once,
    not in every N-tile program. The same bits as the two, within the fp32 sum order of the reference."""
    mg = _triton()
    g = torch.Generator().manual_seed(5)
    P, E, N, I = mg.IDENT_MAX_P + 4, 4, 128, 256
    h = _h(g, P, I, torch.float32)
    w, w_s = _w2(g, fmt, E, N, I)
    e = torch.randint(0, E, (P,), generator=g)
    wt = torch.rand(P, generator=g)
    h, w, w_s, e, wt = (t.to(DEV) for t in (h, w, w_s, e, wt))
    d = REGISTRY["swiglu_grouped_gemm"]
    got = d.impls["triton"](h, 10.0, wt, e, w, w_s, out_dtype=torch.float32)
    fp4 = fmt == "fp4"
    a = REGISTRY["swiglu_quant"].impls["triton"](h[:, :I], h[:, I:], 10.0, weight=wt, out_dtype=torch.float32,
                                                  split=fp4)
    two = REGISTRY["grouped_gemm"].impls["triton"](a[0], a[1], e, w, w_s, out_dtype=torch.float32,
                                                   a_split=a[2] if fp4 else None)
    assert torch.equal(got, two) and torch.isfinite(got).all() and (got != 0).any()
    ref = REGISTRY["grouped_gemm"].ref(a[0], a[1], e, w, w_s, out_dtype=torch.float32).double()
    mag = abs_products("grouped_gemm", a[0], a[1], e, w, w_s, out_dtype=torch.float32).double()
    assert ((got.double() - ref).abs() <= TC_REL * mag + 1e-30).all()


def test_float_w2_is_refused():
    """A float w2 has no act_quant to fuse: the op says so (the model calls swiglu, then grouped_gemm)."""
    _triton()
    h = torch.randn(2, 256, device=DEV)
    w = torch.randn(2, 64, 128, device=DEV)
    for impl in (REGISTRY["swiglu_grouped_gemm"].ref, REGISTRY["swiglu_grouped_gemm"].impls["triton"]):
        with pytest.raises(ValueError, match="FP8 or FP4"):
            impl(h, 10.0, None, torch.zeros(2, dtype=torch.long, device=DEV), w, None)


FUSION_PARTS = {"swiglu_grouped_gemm": "_swiglu_quant", "hc_post_pre_quant": "hc_post",
                "moe_combine_post_pre_quant": "moe_combine_post", "rms_norm_rope_store": "rms_norm_rope"}
"""Fused decode op -> the function of its first part that its Triton implementation calls when it does not fuse."""


def _run_fused_ops(monkeypatch, value: str) -> list[str]:
    """Each fused decode op's Triton implementation once under DEEPINFER_DECODE_FUSIONS=value -> the names of the
    first-part functions that ran (a fused kernel calls none)."""
    mg = _triton()
    from deepinfer_kernels.triton import mhc, norm

    called = []

    def spy(mod, name):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: called.append(name) or real(*a, **k))

    spy(mg, "_swiglu_quant")
    spy(mhc, "hc_post")
    spy(mhc, "moe_combine_post")
    spy(norm, "rms_norm_rope")
    monkeypatch.setenv("DEEPINFER_DECODE_FUSIONS", value)
    g = torch.Generator().manual_seed(1)
    P, E, N, I = 6, 8, 128, 256
    w, w_s = _w2(g, "fp4", E, N, I)
    REGISTRY["swiglu_grouped_gemm"].impls["triton"](_h(g, P, I, torch.float32).to(DEV), 10.0, None,
                                                    torch.arange(P).to(DEV), w.to(DEV), w_s.to(DEV),
                                                    out_dtype=torch.float32)
    hc, D = 4, 256
    x, res = torch.randn(1, 1, D, device=DEV), torch.randn(1, 1, hc, D, device=DEV)
    post, comb = torch.rand(1, 1, hc, device=DEV), torch.rand(1, 1, hc, hc, device=DEV)
    fn, scale = torch.randn(24, hc * D, device=DEV) * 0.03, torch.rand(3, device=DEV) + 0.5
    base = torch.randn(24, device=DEV)
    rest = (fn, scale, base, 1e-6, 1e-6, 20, None, 1e-6)
    REGISTRY["hc_post_pre_quant"].impls["triton"](x, res, post, comb, *rest)
    REGISTRY["moe_combine_post_pre_quant"].impls["triton"](x.view(1, 1, D), x.view(1, D), res, post, comb, *rest)
    from deepinfer.quant.kv_layout import kv_packed_width

    cache = torch.zeros(2, 4, kv_packed_width(512, 64, torch.float32), dtype=torch.uint8, device=DEV)
    ang = torch.rand(1, 1, 32, device=DEV)
    REGISTRY["rms_norm_rope_store"].impls["triton"](torch.randn(1, 1, 512, device=DEV), torch.ones(512, device=DEV),
                                                    1e-6, ang.cos(), ang.sin(), 64, cache,
                                                    torch.tensor([1], device=DEV), torch.tensor([2], device=DEV), True)
    return called


def test_decode_fusions_off_runs_each_fused_op_as_its_two_ops(monkeypatch):
    """DEEPINFER_DECODE_FUSIONS=off (read per call: a `bench --against` entry): every fused decode op's Triton
    implementation runs its two ops instead of its fused kernel; on: none does."""
    assert _run_fused_ops(monkeypatch, "off") == list(FUSION_PARTS.values())
    assert _run_fused_ops(monkeypatch, "on") == []


def test_decode_fusions_turned_off_one_by_one(monkeypatch):
    """-OP[+OP]: exactly the named fused ops run their two ops (a per-fusion A/B: `bench --against
    triton:DEEPINFER_DECODE_FUSIONS=-hc_post_pre_quant`)."""
    assert _run_fused_ops(monkeypatch, "-hc_post_pre_quant+rms_norm_rope_store") == ["hc_post", "rms_norm_rope"]
    assert _run_fused_ops(monkeypatch, " -HC_POST_PRE_QUANT + rms_norm_rope_store ") == ["hc_post", "rms_norm_rope"]
    for op, part in FUSION_PARTS.items():
        assert _run_fused_ops(monkeypatch, "-" + op) == [part], op


@pytest.mark.parametrize("value", ["-", "-nope", "-hc_post_pre_quant+", "hc_post_pre_quant", "maybe", "", " "])
def test_decode_fusions_bad_value_names_the_fused_ops(monkeypatch, value):
    from deepinfer import settings

    monkeypatch.setenv("DEEPINFER_DECODE_FUSIONS", value)
    with pytest.raises(ValueError, match="DEEPINFER_DECODE_FUSIONS=.*q_norm_sparse_attn_fp8"):
        settings.fusion("hc_post_pre_quant")
