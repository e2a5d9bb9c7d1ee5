"""deepinfer compare: metrics against hand-computed values, set overlap, tolerances, exit codes, and the
first divergence on deepinfer-tiny with one layer deliberately perturbed."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.debug.compare import (Tol, Tolerances, compare_dumps, compare_tensors, max_ulp, set_overlap)
from deepinfer.debug.dumper import run_dump, save
from deepinfer.debug.fingerprint import run_fingerprint
from deepinfer.debug.h5schema import write_dump
from deepinfer.engine.loader import load_model
from deepinfer_cli.app import app

TOL = Tol(rtol=1e-2, atol=1e-3)


def test_float_metrics_by_hand():
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 5.0])
    r = compare_tensors("x", a, b, TOL)
    assert r.max_abs == 1.0 and r.mean_abs == 0.25
    assert r.rel_err == pytest.approx(1 / math.sqrt(39))
    assert r.cosine == pytest.approx(34 / math.sqrt(30 * 39))
    assert r.dissim == pytest.approx(1 - 68 / 69)
    assert r.worst_index == [3] and (r.worst_a, r.worst_b) == (4.0, 5.0)
    assert r.fail_frac == 0.25 and r.status == "fail" and r.kind == "float"
    assert compare_tensors("x", b.clone(), b, TOL).status == "pass"


def test_fails_only_beyond_both_atol_and_rtol():
    b = torch.tensor([100.0, 0.0, 1.0])
    a = b + torch.tensor([0.5, 0.0005, 0.02])  # 0.5 < 1% of 100; 0.0005 < atol; 0.02 > both
    r = compare_tensors("x", a, b, TOL)
    assert r.fail_frac == pytest.approx(1 / 3) and r.worst_index == [0]
    assert compare_tensors("x", a, b, Tol(rtol=0.05, atol=1e-3)).status == "pass"


def test_nan_inf_and_zero_reference():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([1.0, nan, inf, -inf, 2.0, nan])
    b = torch.tensor([1.0, 1.0, inf, inf, 2.0, nan])
    r = compare_tensors("x", a, b, TOL)
    assert (r.nan_a, r.nan_b, r.inf_a, r.inf_b) == (2, 1, 2, 2)
    # NaN fails (even against NaN), +inf vs +inf passes, -inf vs +inf fails: 3 of 6
    assert r.fail_frac == pytest.approx(3 / 6) and r.status == "fail"
    assert r.worst_index == [1] and math.isnan(r.worst_a)
    assert r.max_abs == 0.0 and r.rel_err == 0.0  # continuous metrics over the finite pairs
    # masked scores: -inf on both sides is equal, not a failure
    m = torch.tensor([0.5, -inf])
    assert compare_tensors("s", m.clone(), m, TOL).status == "pass"
    z = torch.zeros(3)
    r = compare_tensors("z", torch.tensor([0.0, 1.0, 0.0]), z, TOL)
    assert r.rel_err == math.inf and r.cosine == 0.0 and r.dissim == 1.0 and r.status == "fail"
    r = compare_tensors("z", z.clone(), z, TOL)
    assert r.rel_err == 0.0 and r.cosine == 1.0 and r.dissim == 0.0 and r.status == "pass"


def test_ulp_in_the_coarser_dtype():
    one = torch.tensor([1.0])
    nxt = torch.nextafter(one, torch.tensor([2.0]))
    fin = torch.tensor([True])
    assert max_ulp(nxt, one, fin) == (1, "float32")
    assert max_ulp(-one, -torch.nextafter(one, torch.tensor([2.0])) * 1, fin)[0] == 1
    # across zero: +min_subnormal vs -min_subnormal is 2 steps
    tiny = torch.tensor([1e-45])
    assert max_ulp(tiny, -tiny, fin)[0] == 2
    # bf16 vs fp32: counted in bf16; 1 + 2^-7 is the next bf16 after 1
    r = compare_tensors("x", torch.tensor([1.0 + 2**-7]).bfloat16(), one, TOL)
    assert (r.max_ulp, r.ulp_dtype) == (1, "bfloat16")
    r = compare_tensors("x", torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn), torch.tensor([1.125, 2.0]), TOL)
    assert (r.max_ulp, r.ulp_dtype) == (1, "float8_e4m3fn")


def test_shape_mismatch_and_tokens():
    r = compare_tensors("x", torch.zeros(2, 3), torch.zeros(3, 2), TOL)
    assert r.status == "shape" and r.failed and "shape [2, 3] vs [3, 2]" in r.summary()
    r = compare_tensors("input_ids", torch.tensor([1, 2, 3]), torch.tensor([1, 9, 3]), TOL)
    assert r.kind == "int" and r.fail_frac == pytest.approx(1 / 3) and r.worst_index == [1] and r.failed
    assert compare_tensors("input_ids", torch.tensor([1, 2]), torch.tensor([1, 2]), TOL).status == "pass"


def test_index_tensors_compare_as_sets():
    a = torch.tensor([[1, 2], [3, 4], [-1, -1], [5, -1]])
    b = torch.tensor([[2, 1], [3, 5], [-1, -1], [5, -1]])
    assert set_overlap(a, b).tolist() == [1.0, 0.5, 1.0, 1.0]
    r = compare_tensors("layers.3.attn.indexer.topk", a, b, TOL)
    assert r.kind == "index" and r.overlap == pytest.approx(0.875) and r.min_overlap == 0.5
    assert r.status == "fail" and r.worst_index == [1] and "overlap 0.88" in r.summary()
    assert compare_tensors("l.ffn.router.experts", a, b, Tol(min_overlap=0.5)).status == "pass"
    perm = torch.tensor([[2, 1], [5, 3]])
    assert compare_tensors("l.ffn.router.experts", perm, torch.tensor([[1, 2], [3, 5]]), TOL).status == "pass"
    # a plain int tensor with the same values permuted is NOT a set: element-wise
    assert compare_tensors("x.ids", perm, torch.tensor([[1, 2], [3, 5]]), TOL).status == "fail"


def test_stat_modes():
    b = torch.ones(100)
    a = b.clone()
    a[0] = 2.0  # one outlier: max |Δ| = 1, mean 0.01, median 0
    assert compare_tensors("x", a, b, Tol(stat="max", rtol=0.5, atol=0)).status == "fail"
    r = compare_tensors("x", a, b, Tol(stat="mean", rtol=0.02, atol=0))
    assert r.status == "pass" and r.stat_value == pytest.approx(0.01) and r.stat_bound == pytest.approx(0.02)
    assert compare_tensors("x", a, b, Tol(stat="median", rtol=0, atol=0)).status == "pass"
    assert compare_tensors("x", a, b, Tol(stat="quantile", quantile=0.995, rtol=0.1, atol=0)).status == "fail"


def test_tolerance_files(tmp_path):
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"rules": [{"match": r"indexer\.topk$", "min_overlap": 0.75},
                                       {"match": "logits", "rtol": 0.05, "stat": "mean"}]}))
    t = Tolerances.load(str(j), Tol())
    assert t.for_name("layers.1.attn.indexer.topk").min_overlap == 0.75
    assert t.for_name("step1.logits").rtol == 0.05 and t.for_name("step1.logits").stat == "mean"
    assert t.for_name("layers.0.attn.q") == Tol()
    txt = tmp_path / "t.txt"
    txt.write_text("# comment\n^layers\\.0\\.  rtol=0.1 atol=0.01\nrouter skip=true  # trailing\n.* rtol=0.5\n")
    t = Tolerances.load(str(txt), Tol())
    assert (t.for_name("layers.0.attn.q").rtol, t.for_name("layers.0.attn.q").atol) == (0.1, 0.01)
    assert t.for_name("layers.1.ffn.router.scores").skip and t.for_name("logits").rtol == 0.5
    txt.write_text("x rtool=1\n")
    with pytest.raises(ValueError, match="unknown key"):
        Tolerances.load(str(txt), Tol())


# ------------------------------------------------------------------------------------ whole dumps
def _attrs(**kw):
    base = dict(device="cpu", backend="torch", numerics="exact", dtype="float32", model_path="",
                model_name="m", config_fingerprint="cfg1", prompt="p", seed=0)
    return run_fingerprint(**{**base, **kw})


def _write(path, tensors, **kw):
    write_dump(path, tensors, _attrs(**kw))
    return str(path)


def test_one_sided_and_fingerprint_diff(tmp_path):
    ids = torch.tensor([1, 2, 3])
    a = _write(tmp_path / "a.h5", {"input_ids": ids, "x": torch.ones(3), "only_a": torch.ones(1)}, backend="triton")
    b = _write(tmp_path / "b.h5", {"input_ids": ids, "x": torch.ones(3), "only_b": torch.ones(1)})
    rep = compare_dumps(a, b)
    assert rep.only_a == ["only_a"] and rep.only_b == ["only_b"] and rep.passed
    assert rep.fingerprint_diff["backend"] == ("triton", "torch")
    assert not compare_dumps(a, b, require_all=True).passed


def test_cli_exit_codes(tmp_path):
    run = CliRunner()
    ids = torch.tensor([1, 2, 3])
    ref = _write(tmp_path / "ref.h5", {"input_ids": ids, "x": torch.tensor([1.0, 2.0])})
    same = _write(tmp_path / "same.h5", {"input_ids": ids, "x": torch.tensor([1.0, 2.0])})
    bad = _write(tmp_path / "bad.h5", {"input_ids": ids, "x": torch.tensor([1.0, 3.0])})
    r = run.invoke(app, ["compare", same, ref])
    assert r.exit_code == 0, r.output
    r = run.invoke(app, ["compare", bad, ref, "--json"])
    assert r.exit_code == 1
    data = json.loads(r.output)
    assert data["first_divergence"]["name"] == "x" and data["n_failed"] == 1
    r = run.invoke(app, ["compare", bad, ref, "--rtol", "0.5"])
    assert r.exit_code == 0
    rep = tmp_path / "rep.json"
    assert run.invoke(app, ["compare", bad, ref, "--report", str(rep)]).exit_code == 1 and json.loads(rep.read_text())
    (tmp_path / "text.h5").write_text("hello")
    for args in ([str(tmp_path / "text.h5"), ref], [ref, str(tmp_path / "missing.h5")]):
        r = run.invoke(app, ["compare", *args])
        assert r.exit_code == 2 and r.output.count("\n") == 1 and r.output.startswith("error:"), r.output
    other_prompt = _write(tmp_path / "op.h5", {"input_ids": ids}, prompt="q")
    r = run.invoke(app, ["compare", other_prompt, ref])
    assert r.exit_code == 2 and "different prompts" in r.output
    other_model = _write(tmp_path / "om.h5", {"input_ids": ids}, config_fingerprint="cfg2")
    r = run.invoke(app, ["compare", other_model, ref])
    assert r.exit_code == 2 and "different models" in r.output
    assert run.invoke(app, ["compare", same, ref, "--stat", "bogus"]).exit_code == 2


def test_first_divergence_on_perturbed_layer(tmp_path):
    """Dump deepinfer-tiny, perturb layer 2's attention norm, dump again: the first failing tensor must be
    in layers.2 (its attn.in, the norm's output), and every earlier tensor must match exactly."""
    lm = load_model(None, "exact", "float32", "cpu", progress=False)
    ids = [0, 5, 17, 300, 4242, 99, 7, 1234, 8, 77]
    attrs = _attrs(config_fingerprint=lm.cfg.fingerprint())
    save(run_dump(lm.model, ids, steps=2), tmp_path / "ref.h5", attrs)
    norm = lm.model.layers[2].attn_norm
    saved = norm.clone()
    try:
        norm.mul_(1.05)
        save(run_dump(lm.model, ids, steps=2), tmp_path / "bad.h5", attrs)
    finally:
        norm.copy_(saved)
    rep = compare_dumps(str(tmp_path / "bad.h5"), str(tmp_path / "ref.h5"))
    first = rep.first_divergence
    print("\n" + rep.first_line())
    assert first is not None and first.name == "layers.2.attn.in"
    before = rep.rows[:rep.rows.index(first)]
    assert before and all(r.status == "pass" and (r.max_abs or 0) == 0 for r in before)
    assert any(r.name == "layers.1.hc_ffn.out" for r in before)
    assert rep.rows[-1].name == "generated_ids"
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "bad.h5"), str(tmp_path / "ref.h5"), "--failures-only"])
    assert r.exit_code == 1 and "first divergence: layers.2.attn.in" in r.output.replace("\n", " ")
