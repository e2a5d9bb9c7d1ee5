"""`deepinfer generate` through typer's CliRunner: output, JSON shape, exit codes."""

import json

from typer.testing import CliRunner

from deepinfer_cli.app import app

runner = CliRunner()


def test_generate_json_shape(tiny_dir):
    r = runner.invoke(app, ["generate", "北京是", "--max-new-tokens", "4", "--json", "--logprobs", "2"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["input_ids"] == [0, 6127, 389]
    assert len(out["token_ids"]) == 4 and len(out["logprobs"]) == 4
    assert all(lp < 0 for lp in out["logprobs"])
    assert len(out["top_logprobs"]) == 4 and all(len(t) == 2 and len(t[0]) == 2 for t in out["top_logprobs"])
    assert isinstance(out["text"], str)


def test_generate_table_output(tiny_dir):
    r = runner.invoke(app, ["generate", "北京是", "-n", "3"])
    assert r.exit_code == 0, r.output
    assert "tokens/s" in r.stdout and "margin" in r.stdout


def test_sampling_filters_at_temperature_zero_are_said_to_do_nothing(tiny_dir):
    """--top-k / --top-p with greedy decoding were ignored in silence (sweep of 2026-12-08): one stderr line."""
    r = runner.invoke(app, ["generate", "北京是", "-n", "2", "--top-k", "5", "--top-p", "0.5", "--json"])
    assert r.exit_code == 0, r.output
    assert "--top-k and --top-p have no effect at --temperature 0" in r.stderr
    r = runner.invoke(app, ["generate", "北京是", "-n", "2", "--top-k", "5", "-t", "0.7", "--json"])
    assert r.exit_code == 0 and "no effect" not in r.stderr


def test_a_rows_own_budget_past_the_context_names_the_request(tmp_path, tiny_dir):
    """An --input-file row's max_new_tokens beyond the context was refused as `--max-new-tokens`, an option the user
    gave as 2 (sweep of 2026-12-08): the request is named."""
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b", "max_new_tokens": 1000000000}\n')
    r = runner.invoke(app, ["generate", "--input-file", str(f), "-n", "2"])
    assert r.exit_code == 2 and "request 2 of 2: its 2 prompt tokens plus its max_new_tokens 1000000000" in r.output


def test_generate_chat_layout_and_stdin(tiny_dir):
    r = runner.invoke(app, ["generate", "-", "--chat", "-n", "1", "--json"], input="你好\n")
    assert r.exit_code == 0, r.output
    ids = json.loads(r.stdout.strip().splitlines()[-1])["input_ids"]
    assert ids[0] == 0 and ids[1] == 128803 and ids[-2:] == [128804, 128822]


def test_bad_inputs_exit_2_one_line(tmp_path):
    cases = [
        ["generate", "x", "--model", str(tmp_path / "nope")],
        ["generate", "x", "--numerics", "fast"],
        ["generate", "x", "--dtype", "int8"],
        ["generate", "x", "--top-p", "0"],
        ["generate", "x", "--backend", "nonesuch"],
        ["generate", "x", "--prefill-chunk", "-1"],
    ]
    for args in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output
        assert r.output.strip().startswith("error:"), r.output


def test_broken_checkpoint_lists_every_problem(tmp_path, tiny_dir):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 256  # every expert and shared-expert tensor now mis-shaped
    (d / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["generate", "x", "--model", str(d)])
    assert r.exit_code == 2
    assert "mis-shaped tensor layers.0.ffn.experts.0.w1.weight" in r.output
    assert "mis-shaped tensor mtp.0.ffn.shared_experts.w2.weight" in r.output
    assert "Traceback" not in r.output


def test_help_lists_commands_with_example():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "generate" in r.stdout and "Example" in r.stdout


def _real_structure_table():
    """FlagGems 5.0.2's _FULL_CONFIG rebuilt from the copy in deepinfer/debug/flaggems_table.py (flag_gems does not
    import without a GPU): its real keys, each bound to a stand-in function with the real function's name."""
    from deepinfer.debug.flaggems_table import FULL_CONFIG

    def fn(name):
        f = lambda *a, **k: None  # noqa: E731
        f.__name__ = name
        return f

    return tuple((k, fn(f)) + ((lambda: True),) * c for k, f, c in FULL_CONFIG)


def test_flaggems_allow_list(monkeypatch):
    """--flaggems: missing package -> one line, exit 2; names resolved against the registration table,
    an unresolved name is an error with its close match, and only the allow-list is enabled."""
    import sys
    import types

    import pytest

    from deepinfer.engine.flaggems_aten import enable_flaggems
    from deepinfer.engine.loader import OptionError

    if "flag_gems" not in sys.modules:
        import importlib.util

        if importlib.util.find_spec("flag_gems") is None:
            r = runner.invoke(app, ["generate", "x", "--flaggems", "add,mul"])
            assert r.exit_code == 2 and "flag_gems is not installed" in r.output and "Traceback" not in r.output
    calls = {}
    fake = types.ModuleType("flag_gems")
    fake._FULL_CONFIG = _real_structure_table()
    fake.only_enable = lambda include: calls.setdefault("include", include)
    monkeypatch.setitem(sys.modules, "flag_gems", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "flag_gems" else None)
    with pytest.raises(OptionError, match=r"rmsnorm \(close: rms_norm"):
        enable_flaggems(["add", "rmsnorm"], "cpu", require_cuda=False)
    # keys and function names alike reach only_enable as FlagGems 5.0.2 matches them: function names
    out = enable_flaggems(["add.Tensor", "_softmax", "eq.Scalar", "true_divide"], "cpu", require_cuda=False)
    assert calls["include"] == ["add", "softmax", "eq_scalar", "true_divide"]
    assert out["enabled"] == ["add.Tensor", "_softmax", "eq.Scalar", "true_divide"]
    with pytest.raises(OptionError, match="needs a CUDA device"):
        enable_flaggems(["add"], "cpu")
