"""The FP4 -> per-128 FP8 requantisation (`deepinfer.quant.requant`, the step DeepGEMM's SM90 path needs): exact
where a block's group scales allow it, and otherwise its error measured, never hidden."""

import pytest
import torch

from deepinfer.quant.formats import dequant_fp4, dequant_fp8_block, fp4_pack, quant_fp4
from deepinfer.quant.requant import requant_fp4


def _codes(g, shape):
    """Random e2m1 codes as packed bytes [..., N, K/2] (every one of the 16 codes occurs)."""
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    v = vals[torch.randint(0, 8, shape, generator=g)] * (1 - 2 * torch.randint(0, 2, shape, generator=g))
    return fp4_pack(v)


def _scales(g, shape, lo, hi):
    """ue8m0 bytes with exponents drawn from [lo, hi]."""
    return (127 + torch.randint(lo, hi + 1, shape, generator=g)).to(torch.uint8)


def test_exact_where_the_block_scales_allow_it():
    g = torch.Generator().manual_seed(0)
    N, K = 256, 512
    packed, scale = _codes(g, (N, K)), _scales(g, (N, K // 32), -20, -7)  # a span of 2^13 at most
    w, s, rep = requant_fp4(packed, scale, "w1")
    assert w.dtype == torch.float8_e4m3fn and w.shape == (N, K) and s.dtype == torch.float32 and s.shape == (2, 4)
    assert torch.equal(dequant_fp8_block(w, s), dequant_fp4(packed, scale))  # bit for bit
    assert rep.lossless and rep.lossy_values == 0 and rep.rel_err == 0.0 and rep.blocks == 8
    assert rep.max_span_log2 <= 13 and rep.to_dict()["lossless"] is True
    # fp32 block scales are powers of two: the largest group scale / 2^6
    assert torch.equal(torch.log2(s), torch.log2(s).round())


def test_a_trained_like_weight_is_lossless():
    """quant_fp4 of a Gaussian weight (the release's form) gives group scales within a few powers of two."""
    g = torch.Generator().manual_seed(1)
    packed, scale = quant_fp4(torch.randn(384, 256, generator=g) * 0.02)
    _, _, rep = requant_fp4(packed, scale)
    assert rep.lossless and rep.max_span_log2 < 8


def test_beyond_the_span_is_measured_not_hidden():
    """One 128 x 128 block whose group scales span 2^20: the small groups' smallest values fall below e4m3's
    subnormals at the block's scale. The step still returns the FP8 form and reports what changed."""
    g = torch.Generator().manual_seed(2)
    N, K = 128, 256
    packed, scale = _codes(g, (N, K)), _scales(g, (N, K // 32), -10, -10)
    scale[5, 1] = 127 - 30  # one group 2^20 below the block's others
    w, s, rep = requant_fp4(packed, scale, "w2")
    before, after = dequant_fp4(packed, scale), dequant_fp8_block(w, s)
    changed = (after != before)
    assert not rep.lossless and rep.lossy_values == int(changed.sum()) > 0 and rep.lossy_blocks == 1
    assert changed[5, 32:64].any()  # the changed values are in that group
    assert not changed[:, 128:].any() and not changed[torch.arange(N) != 5].any()  # only that group
    assert rep.max_span_log2 == 20
    assert rep.max_abs_err == pytest.approx(float((after - before).abs().max()))
    assert 0 < rep.rel_err < 1e-6  # tiny next to the block's other values
    # the error is bounded by half e4m3's subnormal step at the block scale (2^-10 x block scale)
    assert rep.max_abs_err <= 2.0 ** -10 * float(s[0, 0])


def test_stacked_experts_and_bad_input():
    g = torch.Generator().manual_seed(3)
    E, N, K = 3, 200, 256  # N not a multiple of 128: a partial last block per expert
    packed, scale = _codes(g, (E, N, K)), _scales(g, (E, N, K // 32), -12, -8)
    w, s, rep = requant_fp4(packed, scale, "experts")
    assert w.shape == (E, N, K) and s.shape == (E, 2, 2) and rep.shape == (E, N, K) and rep.blocks == E * 4
    for e in range(E):  # each expert on its own: no block mixes two experts
        assert torch.equal(dequant_fp8_block(w[e], s[e]), dequant_fp4(packed[e], scale[e]))
    bad = scale.clone()
    bad[0, 0, 0] = 255
    with pytest.raises(ValueError, match="255"):
        requant_fp4(packed, bad)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        requant_fp4(packed[..., :48], scale[..., :3])


def test_decoded_scales_and_the_probe():
    """The loader holds scales decoded to float32: the step takes them as the bytes. `probe requant` reports every
    FP4 expert tensor of deepinfer-tiny (lossless: quant_fp4 of smooth weights)."""
    import json

    from typer.testing import CliRunner

    from deepinfer.config import tiny_config
    from deepinfer.quant.formats import scale_f32
    from deepinfer_cli.app import app

    g = torch.Generator().manual_seed(4)
    packed, scale = _codes(g, (128, 256)), _scales(g, (128, 8), -9, -4)
    a, b = requant_fp4(packed, scale)[:2], requant_fp4(packed, scale_f32(scale))[:2]
    assert all(torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                           y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="not powers of two"):
        requant_fp4(packed, scale_f32(scale) * 3)
    r = CliRunner().invoke(app, ["probe", "requant", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    cfg = tiny_config()
    assert len(d["tensors"]) == 3 * (cfg.n_layers + cfg.n_mtp_layers) and d["lossless"] and d["lossy_tensors"] == 0
    assert all(t["experts"] == cfg.n_routed_experts and t["lossy_values"] == 0 for t in d["tensors"])


def test_the_model_with_requantised_experts():
    """experts=fp8 (a SPEC key, `load_model(experts=)`): the model holds its routed experts as per-128 FP8. On
    deepinfer-tiny the requantisation is lossless, so the reference computes the same logits bit for bit; a planted
    wide scale span is reported for that tensor alone."""
    from typer.testing import CliRunner

    from deepinfer.debug.margin import parse_spec
    from deepinfer.engine.loader import load_checkpoint, load_model
    from deepinfer.ops import ops
    from deepinfer.quant.requant import requant_experts
    from deepinfer_cli.app import app

    ops.configure("torch", strict=False, op_map={})
    a = load_model(None, "official", "float32", "cpu", progress=False)
    b = load_model(None, "official", "float32", "cpu", progress=False, experts="fp8")
    moe = b.model.layers[0].ffn.experts
    assert moe.input_fmt == "fp8" and moe.w2.fmt == "fp8" and a.model.layers[0].ffn.experts.input_fmt == "fp4"
    ids = torch.tensor([[0, 6127, 389, 1234, 55]])
    for m in (a.model, b.model):
        m.allocate(1, 16)
    la, lb = a.model.prefill(ids)[0], b.model.prefill(ids)[0]
    assert torch.equal(la, lb)
    cfg, state, _, _ = load_checkpoint(None, torch.device("cpu"), False)
    name = next(n for n in state if ".experts.3.w2.weight" in n and n.startswith("layers.1."))
    sname = name[:-len("weight")] + "scale"
    state[sname][5, 1] = state[sname][5, 0] * 2.0 ** -20  # one group far below its block's others
    reps = requant_experts(state)
    assert [r.name for r in reps if not r.lossless] == [name] and state[name].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="experts=fp9: choose fp4 or fp8"):
        parse_spec("experts=fp9")
    r = CliRunner().invoke(app, ["bisect", "x", "--ref", "backend=torch", "--test", "backend=triton,experts=fp8"])
    assert r.exit_code == 2 and "differ in experts and backend: bisect one axis at a time" in r.output
