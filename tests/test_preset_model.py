"""`--model preset:NAME`: random weights at a preset's shapes for the debugging commands (issue 50's margin of the
requantised experts on flash-slice:4, where no checkpoint exists). Checked on the tiny preset on CPU."""

import json

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.engine.loader import OptionError, load_checkpoint, load_model, resolve_model_dir
from deepinfer.quant.requant import requant_experts
from deepinfer_cli.app import app

runner = CliRunner()


def test_preset_weights_are_deterministic_and_not_the_tiny_checkpoint():
    cfg, a, name, layout = load_checkpoint("preset:tiny", torch.device("cpu"), progress=False)
    _, b, _, _ = load_checkpoint("preset:tiny", torch.device("cpu"), progress=False)
    _, ck, _, _ = load_checkpoint(None, torch.device("cpu"), progress=False)
    assert name == "preset:tiny" and layout == "official" and cfg.vocab_size == 129280
    assert a.keys() == b.keys() == ck.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)  # ref and test of one margin run hold the same weights
    assert any(not torch.equal(a[k], ck[k]) for k in a if a[k].is_floating_point())


def test_preset_model_generates_with_the_package_tokenizer():
    lm = load_model("preset:tiny", "official", "float32", "cpu", progress=False)
    assert lm.tokenizer.encode_prompt("北京是", "raw") == [0, 6127, 389]
    r = runner.invoke(app, ["generate", "北京是", "-m", "preset:tiny", "-n", "2", "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["token_ids"]) == 2


def test_margin_of_requantised_experts_on_preset_weights():
    """The preset's FP4 group scales are powers of two within 2^1 of their target, so the per-128 requantisation is
    lossless (measured on the state itself), and margin must find the two paths equal to the last bit."""
    _, state, _, _ = load_checkpoint("preset:tiny", torch.device("cpu"), progress=False)
    reports = requant_experts(dict(state))
    assert reports and all(r.lossless for r in reports)
    r = runner.invoke(app, ["margin", "北京是中国的首都", "-m", "preset:tiny", "--steps", "3", "--json",
                            "--ref", "backend=torch,dtype=float32,device=cpu",
                            "--test", "backend=torch,dtype=float32,device=cpu,experts=fp8"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["verdict"] == "agree" and d["agreement"] == 1.0 and d["max_logits_rel_err"] == 0.0


@pytest.mark.parametrize("model,want", [
    ("preset:flash-slice:99", "--model preset:flash-slice:99: N must be 1..43"),
    ("preset:nope", "--model preset:nope: expected tiny, flash, pro"),
    ("preset:flash", "--model preset:flash in official"),  # refused with the numbers, before any work
])
def test_bad_or_too_big_preset_is_one_line_exit_2(model, want):
    r = runner.invoke(app, ["generate", "北京是", "-m", model, "-n", "1", "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert want in r.output and "Traceback" not in r.output
    if model == "preset:flash":
        assert "GiB" in r.output and "available" in r.output


def test_commands_that_read_a_directory_refuse_a_preset():
    with pytest.raises(OptionError, match="random weights have no checkpoint directory"):
        resolve_model_dir("preset:tiny")


def test_preset_refusals_before_any_work(monkeypatch):
    """margin across two devices (random weights differ per device type), verify (it reads the checkpoint's files)
    and a preset too big for the device with no model numerics given (probe requant) are one line each, exit 2."""
    import deepinfer.engine.loader as L

    monkeypatch.setattr(L, "resolve_device", lambda d: torch.device(d or "cpu"))
    r = runner.invoke(app, ["margin", "x", "-m", "preset:tiny", "--ref", "device=cpu", "--test", "device=meta"])
    assert r.exit_code == 2 and "must name the same device" in r.output, r.output
    r = runner.invoke(app, ["verify", "x", "-m", "preset:tiny"])
    assert r.exit_code == 2 and "random weights have no checkpoint directory" in r.output, r.output
    from deepinfer.engine.memory import MemoryRefused

    with pytest.raises(MemoryRefused, match="GiB"):
        load_checkpoint("preset:flash", torch.device("cpu"), progress=False)
