"""`deepinfer bisect`: delta debugging over (op, layer) sites names a planted divergence, and nothing on
identical configurations."""

import json

import pytest
from typer.testing import CliRunner

from deepinfer.debug.bisect import bisect, ddmin, parse_metric
from deepinfer.engine.loader import load_model
from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY
from deepinfer_cli.app import app

PROMPT = [0] + list(range(300, 330))


def test_ddmin_finds_a_minimal_set():
    runs = []

    def fails(s):
        runs.append(len(s))
        return {3, 11} <= set(s)

    assert sorted(ddmin(list(range(40)), fails)) == [3, 11]
    assert ddmin(list(range(40)), lambda s: 7 in s) == [7]
    assert len(runs) < 60


def test_metric_parsing():
    assert parse_metric("tokens") == ("tokens", 1e-3)
    assert parse_metric("logits:0.01") == ("logits", 0.01)
    for bad in ("tokens:1", "logit", "logits:x", "logits:-1", "logits:nan"):
        with pytest.raises(ValueError, match="--metric"):
            parse_metric(bad)


@pytest.fixture(scope="module")
def tiny():
    ops.configure("torch")
    return load_model(None, "official", "float32", "cpu", progress=False).model


def _planted(op_name: str, layer: int, factor: float):
    """The reference everywhere, but op `op_name` scaled by `factor` at `layer`: a divergence born there."""
    def impl(op):
        ref = REGISTRY[op].ref
        if op != op_name:
            return ref

        def perturbed(*a, **k):
            out = ref(*a, **k)
            return out * factor if ops.layer == layer else out
        return perturbed
    return impl


@pytest.mark.parametrize("metric", ["tokens", "logits:1e-3"])
def test_bisect_names_the_planted_site(tiny, metric):
    # layer 2's MoE post-mix (its attention's goes into the MoE pre-mix op, `hc_post_pre_quant`)
    res = bisect(tiny, PROMPT, 6, metric, _planted("moe_combine_post", 2, 1.5), "ref", "planted", "float32")
    assert not res.agree
    assert [(c.op, c.layer) for c in res.culprits] == [("moe_combine_post", 2)], res.culprits
    c = res.culprits[0]
    assert c.position is not None and c.logits_rel_err > 1e-3
    assert res.runs > 2 and res.sites > 20


def test_bisect_agrees_on_identical_configurations(tiny):
    res = bisect(tiny, PROMPT, 4, "logits:1e-6", lambda op: REGISTRY[op].ref, "ref", "ref", "float32")
    assert res.agree and res.culprits == [] and res.runs == 2


def test_cli(tiny_dir):
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "backend=torch,dtype=float32",
                                 "--test", "backend=torch,dtype=float32", "--steps", "3", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["agree"] and d["culprits"] == [] and d["sites"] > 20
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "dtype=float32", "--test", "dtype=bfloat16"])
    assert r.exit_code == 2 and "differ in dtype" in r.output
    r = CliRunner().invoke(app, ["bisect", "北京是", "--metric", "bits"])
    assert r.exit_code == 2 and "--metric" in r.output


def test_bisect_numerics_names_the_switched_layer(tiny):
    """Layer sites: a test model that differs from the exact reference only in layer 2's numerics (its block
    from the official model) is named at ("numerics", 2) and nowhere else."""
    from deepinfer.debug.bisect import bisect_numerics, hybrid

    exact = load_model(None, "exact", "float32", "cpu", progress=False).model
    test = hybrid(exact, tiny, {2})  # `tiny` is the official float32 model
    res = bisect_numerics(exact, test, PROMPT, 4, "logits:1e-3", "exact", "exact+official L2", "float32")
    assert not res.agree and [(c.op, c.layer) for c in res.culprits] == [("numerics", 2)], res.culprits
    same = bisect_numerics(exact, exact, PROMPT, 3, "logits:1e-6", dtype="float32")
    assert same.agree and same.runs == 2


def test_cli_numerics_sites(tiny_dir):
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "numerics=exact,dtype=float32",
                                 "--test", "numerics=official,dtype=float32", "--steps", "3",
                                 "--metric", "logits:1e-3", "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["sites"] == 4 and d["culprits"] and all(c["op"] == "numerics" for c in d["culprits"])
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "numerics=exact,backend=torch",
                                 "--test", "numerics=official,backend=triton"])
    assert r.exit_code == 2 and "one axis" in r.output


def _planted_many(sites: dict):
    """The reference, but op o scaled by sites[(o, layer)] at that layer."""
    def impl(op):
        ref = REGISTRY[op].ref
        if op not in {o for o, _ in sites}:
            return ref

        def perturbed(*a, **k):
            out = ref(*a, **k)
            return out * sites.get((op, ops.layer), 1.0)
        return perturbed
    return impl


def test_bisect_reports_a_set_that_diverges_only_together(tiny):
    """Two sites each within the logits tolerance alone, beyond it together: both are culprits, and the result
    carries the error they make together (each alone is within the metric, so its own error says little)."""
    from deepinfer.debug.bisect import Bisector, op_runner
    from deepinfer.debug.comparators import rel_norm

    a, b = ("linear", None), ("rms_norm", None)  # the head's norm and LM head: each scales the logits by 1.002
    impl = _planted_many({a: 1.002, b: 1.002})
    probe = Bisector(op_runner(tiny, PROMPT, 3, impl), 3, "logits:1e-9", "float32")

    def err(sites):
        logits, _ = probe._run(sites)
        return max(rel_norm(x, y) for x, y in zip(logits, probe.ref_logits))

    one = {s: err([s]) for s in (a, b)}
    err_both = err([a, b])
    assert err_both > max(one.values()) * 1.5, (one, err_both)
    rtol = (max(one.values()) + err_both) / 2
    res = bisect(tiny, PROMPT, 3, f"logits:{rtol}", impl, "ref", "p", "float32")
    assert not res.agree
    assert sorted((c.op, c.layer) for c in res.culprits) == [a, b], res.culprits
    assert all(c.logits_rel_err <= rtol for c in res.culprits)
    assert res.joint_logits_rel_err > rtol and res.joint_position is not None
    assert "together" in res.note and f"{res.joint_logits_rel_err:.2e}" in res.note


def test_bisect_kv_format_names_the_switched_layer(tiny):
    """KV-format sites: official numerics with a bf16 cache (kv=bf16, the initial release's form) whose layer 1
    alone holds its cache with the FP8 QAT (the default's form) is named at ("kv_format", 1) and nowhere else."""
    from deepinfer.debug.bisect import bisect_numerics, hybrid

    fp8 = tiny
    bf16 = load_model(None, "official", "float32", "cpu", progress=False, kv="bf16").model
    assert all(a.fp8_kv for a in fp8.attentions()) and not any(a.fp8_kv for a in bf16.attentions())
    test = hybrid(bf16, fp8, {1})
    res = bisect_numerics(bf16, test, PROMPT, 4, "logits:1e-4", "bf16 kv", "fp8 kv at L1", "float32",
                          site="kv_format")
    assert not res.agree and [(c.op, c.layer) for c in res.culprits] == [("kv_format", 1)], res.culprits
    exact = load_model(None, "exact", "float32", "cpu", progress=False).model
    with pytest.raises(ValueError, match="official"):
        exact.set_kv_qat(True)


def test_cli_kv_sites(tiny_dir):
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "kv=bf16,dtype=float32", "--test", "kv=fp8,dtype=float32",
                                 "--steps", "3", "--metric", "logits:1e-5", "--json"])
    assert r.exit_code == 1, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["sites"] == 4 and d["culprits"] and all(c["op"] == "kv_format" for c in d["culprits"])
    assert "kv=fp8" in d["test"]
    for bad, msg in ((["--test", "kv=fp16"], "kv=fp16"), (["--test", "kv=fp8,numerics=exact"], "official"),
                     (["--test", "kv=bf16,backend=triton"], "one axis")):
        r = CliRunner().invoke(app, ["bisect", "北京是", *bad])
        assert r.exit_code == 2 and msg in r.output, r.output


def test_bisect_experts_names_the_lossy_layer():
    """Experts sites: the FP4 routed experts requantised per 128 (DeepGEMM's form) are lossless on the tiny model
    except where group scales are planted 2^20 below their blocks' largest (every expert's w2 in layer 2): only
    ("experts", 2) is named. What such a requantisation drops is 2^-20 of its block's values, so the logits move
    by ~1e-7 relative: a tolerance of 1e-12 sees it, since the lossless layers give the same bits."""
    import torch

    from deepinfer.debug.bisect import bisect_numerics
    from deepinfer.engine.loader import build_model, load_checkpoint, resolve_numerics
    from deepinfer.quant.requant import requant_experts

    cfg, state, _, _ = load_checkpoint(None, torch.device("cpu"), False)
    planted = [n for n in state if n.startswith("layers.2.ffn.experts.") and n.endswith(".w2.weight")]
    for name in planted:
        sname = name[:-len("weight")] + "scale"
        scales = state[sname].clone()
        scales[:, 1::4] = scales[:, 0::4] * 2.0 ** -20  # a quarter of the groups far below their blocks' largest
        state[sname] = scales
    num = resolve_numerics("official", "float32")
    fp4 = build_model(cfg, dict(state), num, "cpu")
    st8 = dict(state)
    assert sorted(r.name for r in requant_experts(st8) if not r.lossless) == sorted(planted)
    fp8 = build_model(cfg, st8, num, "cpu")
    res = bisect_numerics(fp4, fp8, PROMPT, 3, "logits:1e-12", "experts=fp4", "experts=fp8", "float32",
                          site="experts")
    assert not res.agree and [(c.op, c.layer) for c in res.culprits] == [("experts", 2)], res.culprits
    assert res.culprits[0].logits_rel_err < 1e-4  # dropped values this small barely move the logits


def test_cli_experts_sites_agree_where_lossless(tiny_dir):
    """The tiny checkpoint's experts requantise losslessly: every layer's switch keeps the logits bit for bit."""
    r = CliRunner().invoke(app, ["bisect", "北京是", "--ref", "dtype=float32", "--test", "dtype=float32,experts=fp8",
                                 "--steps", "3", "--metric", "logits:1e-7", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["agree"] and d["sites"] == 4 and "experts=fp8" in d["test"]
