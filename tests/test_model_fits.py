"""What a model will hold is checked against the device's free memory before any weight is read or generated:
`bench --preset flash-slice:4 --device cpu` on a 24 GiB machine is refused in one line with the numbers, not
killed by the kernel minutes later (exit 137)."""

import torch
from typer.testing import CliRunner

from deepinfer.engine import memory
from deepinfer.engine.random_weights import random_state
from deepinfer.model.numerics import Numerics
from deepinfer.presets import preset_config
from deepinfer_cli.app import app

runner = CliRunner()


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_loaded_bytes_are_what_random_state_makes():
    """The estimate's loaded part, counted independently: the bytes of every tensor `random_state` returns (the
    same form `load_state` returns for a checkpoint)."""
    cfg = preset_config("tiny")
    state = random_state(cfg, "cpu", 0)
    loaded, _ = memory.model_build_bytes(cfg, True, torch.bfloat16)
    assert loaded == _bytes(state.values())


def test_own_bytes_are_what_the_model_builds(tiny_dir):
    """The model's own copies, counted independently: official numerics restack the routed experts (their bytes
    in the built model), exact numerics hold every quantised weight dequantised in the compute dtype."""
    from deepinfer.checkpoint.schema import expected_tensors
    from deepinfer.engine.loader import build_model

    cfg = preset_config("tiny")
    state = random_state(cfg, "cpu", 0)
    model = build_model(cfg, state, Numerics("official", torch.bfloat16), torch.device("cpu"))
    blocks = list(model.layers) + [m.block for m in model.mtp]
    stacks = [t for b in blocks for m in (b.ffn.experts.w13, b.ffn.experts.w2) for t in (m.weight, m.scale)]
    _, own = memory.model_build_bytes(cfg, True, torch.bfloat16)
    assert own == _bytes(stacks)
    n_quant = sum(s.shape[0] * s.shape[1] for s in expected_tensors(cfg).values() if s.kind in ("fp8", "fp4"))
    assert memory.model_build_bytes(cfg, False, torch.float32)[1] == 4 * n_quant


def test_a_preset_too_large_is_refused_before_building(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 4 << 30)
    built = []
    monkeypatch.setattr("deepinfer.engine.random_weights.random_state", lambda *a, **k: built.append(1))
    r = runner.invoke(app, ["bench", "--preset", "flash-slice:1", "--device", "cpu", "--batch", "1"])
    assert r.exit_code == 2 and not built, r.output
    line = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and "flash-slice:1" in line[0] and "4.0 GiB is available" in line[0], r.output
    loaded, own = memory.model_build_bytes(preset_config("flash-slice:1"), True, torch.bfloat16)
    assert memory.fmt_bytes(loaded + own) in line[0]


def test_a_checkpoint_too_large_is_refused_before_reading(monkeypatch, tiny_dir):
    """generate / dump / verify load through `load_checkpoint`: the same refusal, before any tensor is read."""
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 1 << 20)
    monkeypatch.setattr("deepinfer.engine.loader.load_state", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    r = runner.invoke(app, ["generate", "北京是", "-n", "1", "--device", "cpu"])
    assert r.exit_code == 2 and "needs about" in r.output and "1 MiB is available" in r.output, r.output
