"""`deepinfer verify --against transformers` and transformers dumps under our tap names."""

import json
import types

import pytest
from typer.testing import CliRunner

pytest.importorskip("transformers")

from deepinfer.debug.verify import known_differences, verify  # noqa: E402
from deepinfer.ops import ops  # noqa: E402
from deepinfer.ops.registry import REGISTRY  # noqa: E402
from deepinfer_cli.app import app  # noqa: E402

runner = CliRunner()
IDS = [0] + list(range(300, 330))


def test_verify_agrees_on_the_tiny_model(tmp_path, tiny_dir):
    r = runner.invoke(app, ["verify", "--steps", "3", "--out-dir", str(tmp_path / "v"), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output.strip().splitlines()[-1])
    assert d["passed"] and d["margin_verdict"] == "agree" and d["max_logits_rel_err"] < 1e-5
    from deepinfer.debug.h5schema import DumpReader

    with DumpReader(d["theirs"]) as h:
        names = set(h.names())
    for L in range(4):  # the block taps transformers has seams for
        for t in ("hc_attn.in", "attn.in", "attn.out", "hc_attn.out", "ffn.in", "ffn.out", "hc_ffn.out"):
            assert f"layers.{L}.{t}" in names and f"step3.layers.{L}.{t}" in names
    assert "logits" in names and "step3.logits" in names


def test_verify_names_a_planted_divergence(tmp_path, tiny_dir):
    ref = REGISTRY["hc_post"].ref
    ops.override_sites({("hc_post", 2): lambda *a, **k: ref(*a, **k) * 1.01})
    try:
        res = verify(None, IDS, 2, str(tmp_path / "v"))
    finally:
        ops.override_sites(None)
    assert not res.passed
    assert res.first_divergence.startswith("layers.2."), res.first_divergence


def test_known_differences():
    cfg = types.SimpleNamespace(rope_parameters={"main": {"rope_type": "default"},
                                                 "compress": {"rope_type": "yarn", "factor": 16.0}})
    notes = known_differences(cfg)
    assert len(notes) == 1 and "1.277" in notes[0]
    cfg.rope_parameters["compress"]["attention_factor"] = 1.0
    assert known_differences(cfg) == []


def test_bad_input():
    r = runner.invoke(app, ["verify", "--against", "vllm"])
    assert r.exit_code == 2 and "--against" in r.output


@pytest.mark.parametrize("argv, says", [
    (["verify", "--backend", "triton"], "--backend with --against transformers"),
    (["verify", "--op", "bogus=nope"], "--op with --against transformers"),
    (["dump", "x", "--engine", "transformers", "--backend", "triton", "--op", "rms_norm=torch"],
     "--backend, --op with --engine transformers"),
    (["dump", "x", "--engine", "transformers", "--numerics", "official@efc85512"],
     "--numerics official@efc85512 with --engine transformers"),
])
def test_options_the_transformers_side_would_ignore_are_refused(argv, says):
    """Kernel options on a run of transformers' modules were ignored and the verdict or dump reported as if they
    applied (sweep of 2026-12-08): one line, exit 2, before any model work."""
    r = runner.invoke(app, argv)
    assert r.exit_code == 2 and says in r.output, r.output
    assert len([ln for ln in r.output.strip().splitlines() if ln.strip()]) == 1


def test_dump_engine_transformers_compares_with_ours(tmp_path, tiny_dir):
    """`dump --engine transformers` writes our schema: `compare` pairs it with our exact float32 dump."""
    from deepinfer.debug.compare import compare_dumps

    common = ["北京是", "--steps", "2", "--dtype", "float32", "--device", "cpu"]
    a, b = str(tmp_path / "ours.h5"), str(tmp_path / "hf.h5")
    r = runner.invoke(app, ["dump", *common, "--numerics", "exact", "--backend", "torch", "-o", a])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["dump", *common, "--engine", "transformers", "-o", b])
    assert r.exit_code == 0, r.output
    rep = compare_dumps(a, b)
    assert rep.passed and len(rep.compared) > 100, rep.first_line()
    assert any(n.endswith("attn.q") for n in rep.only_a)  # a tap transformers has no seam for
    r = runner.invoke(app, ["dump", "北京是", "--engine", "vllm"])
    assert r.exit_code == 2 and "--engine" in r.output


@pytest.mark.parametrize("argv", [["verify"], ["dump", "北京是", "--engine", "transformers"]])
def test_without_transformers_one_line(monkeypatch, argv):
    """A machine without transformers: one line naming the package, exit 2, before any model work."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    r = runner.invoke(app, argv)
    assert r.exit_code == 2, r.output
    assert "pip install 'transformers" in r.output and "internal error" not in r.output
