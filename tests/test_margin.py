"""deepinfer margin: spec parsing, the per-position measures by hand, and the tiny model end to end
(identical configurations agree exactly; official vs exact is measured and printed)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.debug.dumper import run_dump, save
from deepinfer.debug.fingerprint import run_fingerprint
from deepinfer.debug.margin import (from_dumps, measure, parse_spec, plot, run_margin, signed_margin, sparkline)
from deepinfer.engine.loader import load_model
from deepinfer_cli.app import app

IDS = [0, 5, 17, 300, 4242, 99, 7, 1234, 8, 77]
STEPS = 8


def test_parse_spec():
    s = parse_spec("backend=torch,numerics=exact,dtype=float32,device=cpu")
    assert s == {"backend": "torch", "numerics": "exact", "dtype": "float32", "device": "cpu", "kv": None, "ops": {}}
    assert parse_spec("dtype=float32")["numerics"] == "official"
    for bad in ("dtype", "color=red", "dtype="):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_measure_by_hand():
    ref = [torch.tensor([3.0, 1.0, 0.0]), torch.tensor([1.0, 1.1, 0.0]), torch.tensor([0.0, 5.0, 1.0])]
    test = [torch.tensor([3.5, 1.0, 0.0]), torch.tensor([1.2, 1.0, 0.0]), torch.tensor([0.0, 5.0, 1.0])]
    r = measure(ref, test, k=2.0)
    p0, p1, p2 = r.positions
    assert (p0.ref_token, p0.test_token, p0.ref_margin, p0.test_margin, p0.delta) == (0, 0, 2.0, 2.5, 0.5)
    # position 1 flips: ref picks 1 by 0.1; the test has token 1 0.2 below its best -> Δ = -0.2 - 0.1
    assert (p1.ref_token, p1.test_token, p1.agree) == (1, 0, False)
    assert p1.test_margin == pytest.approx(0.2) and p1.delta == pytest.approx(-0.3)
    assert p2.delta == 0 and p2.logits_rel_err == 0
    assert r.agreement == pytest.approx(2 / 3) and r.first_disagreement == 1
    assert r.delta_mean == pytest.approx(0.2 / 3)
    std = torch.tensor([0.5, -0.3, 0.0], dtype=torch.float64).std().item()
    assert r.delta_std == pytest.approx(std)
    # the band is never the test's own std(Δmargin): here the logits' bf16 rounding, 2·√2·2^-8·5 = 0.055
    assert r.band == pytest.approx(2 * 2 ** 0.5 * 2 ** -8 * 5) and r.band != 2 * r.delta_std
    assert p1.label == "divergence" and r.verdict == "divergent"  # ref margin 0.1 > 0.055
    s = measure(ref, test, band=0.2).summary()  # a user band of 0.2 logits covers the 0.1 flip
    assert s["divergences"] == 0 and s["near_ties"] == 1 and s["verdict"] == "near-ties"
    assert signed_margin(torch.tensor([1.0, 3.0, 2.0]), 2) == -1.0
    line = sparkline([p.delta for p in r.positions], [not p.agree for p in r.positions])
    assert len(line) == 3 and line[1] == "✗"


@functools.lru_cache(maxsize=2)
def _loaded(numerics: str, dtype: str):
    return load_model(None, numerics, dtype, "cpu", progress=False)


def _load(spec):
    # run_margin re-allocates the caches per side, so one loaded model per configuration is reusable
    return _loaded(spec["numerics"], spec["dtype"]).model


def test_identical_configurations_agree_exactly():
    spec = parse_spec("backend=torch,numerics=official,dtype=bfloat16,device=cpu")
    res, toks = run_margin(IDS, STEPS, spec, dict(spec), _load)
    assert res.n == STEPS and len(toks) == STEPS
    assert res.agreement == 1.0 and res.first_disagreement is None
    assert all(p.delta == 0.0 and p.logits_rel_err == 0.0 for p in res.positions)
    assert res.delta_std == 0.0


def test_official_vs_exact_on_tiny(tmp_path, capsys):
    res, toks = run_margin(IDS, STEPS, parse_spec("numerics=exact,dtype=float32"),
                           parse_spec("numerics=official,dtype=bfloat16"), _load)
    s = res.summary()
    with capsys.disabled():
        print(f"\n[margin tiny, {STEPS} positions] official/bf16 vs exact/f32: agreement {s['agreement']:.1%}, "
              f"first disagreement {s['first_disagreement']}, Δmargin mean {s['delta_mean']:+.3f} "
              f"std {s['delta_std']:.3f}, near-ties {s['near_ties']}, divergences {s['divergences']}; "
              f"ref margins {[round(p.ref_margin, 3) for p in res.positions]}")
    assert res.n == STEPS and 0.0 <= res.agreement <= 1.0
    assert res.delta_std > 0  # the two numerics really differ
    png = tmp_path / "m.png"
    plot(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    json.dumps(res.to_dict())


def test_from_dumps_and_cli(tmp_path):
    lm = _loaded("official", "bfloat16")
    attrs = run_fingerprint(device="cpu", backend="torch", numerics="official", dtype="bfloat16", model_path="",
                            model_name="t", config_fingerprint=lm.cfg.fingerprint(), prompt="p", seed=0)
    run = run_dump(lm.model, IDS, steps=3, layers=[0])
    save(run, tmp_path / "a.h5", attrs)
    save(run_dump(lm.model, IDS, steps=3, layers=[0]), tmp_path / "b.h5", attrs)
    res, toks = from_dumps(str(tmp_path / "a.h5"), str(tmp_path / "b.h5"))
    assert res.n == 4 and res.agreement == 1.0 and toks == run.tokens and all(p.forced for p in res.positions)
    r = CliRunner().invoke(app, ["margin", "--from-dumps", str(tmp_path / "a.h5"), str(tmp_path / "b.h5"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["agreement"] == 1.0
    r = CliRunner().invoke(app, ["margin", "北京是", "--steps", "2", "--ref", "dtype=float32,numerics=exact",
                                 "--test", "dtype=float32,numerics=exact", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    assert "agreement 100.0%" in r.output and (tmp_path / "p.png").exists()
    r = CliRunner().invoke(app, ["margin", "x", "--ref", "colour=red"])
    assert r.exit_code == 2 and "--ref" in r.output
