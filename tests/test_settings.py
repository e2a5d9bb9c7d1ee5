"""Settings: one module reads every DEEPINFER_* variable, the README lists exactly those, bad values fail."""

import os
import re
from pathlib import Path

import pytest

from deepinfer import settings

ROOT = Path(__file__).resolve().parents[1]


def _readme_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    return {m[1]: m[2] for m in re.finditer(r"^\| `([A-Z0-9_]+)` \| ([^|]+) \|", section, re.M)}


def test_readme_lists_every_setting_with_its_default():
    rows = _readme_rows()
    assert set(rows) == set(settings.SETTINGS), set(rows) ^ set(settings.SETTINGS)
    for name, s in settings.SETTINGS.items():
        assert rows[name].strip() == (s.default or "(unset)"), name


def test_no_deepinfer_variable_is_read_outside_settings():
    """os.environ / os.getenv reads of a DEEPINFER_* name anywhere but settings.py (writes, e.g. --debug
    setting DEEPINFER_DEBUG for the process, are fine)."""
    read = re.compile(r"(environ\.get|environ\[|getenv)\(?\s*[\"'](DEEPINFER_[A-Z_]+)")
    found = []
    for d in ("deepinfer", "deepinfer_cli", "deepinfer_kernels"):
        for p in (ROOT / d).rglob("*.py"):
            if p.name == "settings.py":
                continue
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
                m = read.search(line)
                if m and not re.search(r"environ\[[^\]]+\]\s*=[^=]", line):
                    found.append(f"{p.relative_to(ROOT)}:{i}: {m[2]}")
    assert not found, found
    used = set()
    for d in ("deepinfer", "deepinfer_cli", "deepinfer_kernels"):
        for p in (ROOT / d).rglob("*.py"):
            used |= set(re.findall(r"[\"'](DEEPINFER_[A-Z0-9_]+)[\"']", p.read_text(encoding="utf-8")))
    assert used <= set(settings.SETTINGS), f"unregistered: {used - set(settings.SETTINGS)}"
    stale = {n for n in settings.SETTINGS if n.startswith("DEEPINFER_")} - used - {"DEEPINFER_HOME"}
    assert not stale, f"registered but read nowhere: {stale}"


def test_malformed_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_STRICT", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_STRICT"):
        settings.flag("DEEPINFER_STRICT")
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "cutlass")
    with pytest.raises(ValueError, match="DEEPINFER_FP8_GEMM"):
        settings.choice("DEEPINFER_FP8_GEMM")
    monkeypatch.setenv("DEEPINFER_STRICT", "0")
    assert settings.flag("DEEPINFER_STRICT") is False
    monkeypatch.delenv("DEEPINFER_BRANCHES", raising=False)
    assert settings.flag("DEEPINFER_BRANCHES") is True  # its default
    assert os.environ.get("DEEPINFER_BRANCHES") is None


def test_fast_policy_changes_only_unset_defaults(monkeypatch):
    for n in ("DEEPINFER_POLICY", "DEEPINFER_FP8_GEMM", "DEEPINFER_TL_FP4"):
        monkeypatch.delenv(n, raising=False)
    assert settings.choice("DEEPINFER_FP8_GEMM") == "exact" and settings.choice("DEEPINFER_TL_FP4") == "bf16"
    monkeypatch.setenv("DEEPINFER_POLICY", "fast")
    assert settings.choice("DEEPINFER_FP8_GEMM") == "auto" and settings.choice("DEEPINFER_TL_FP4") == "fold"
    assert settings.choice("DEEPINFER_TL_ATTN") == "ws"  # not a promotion choice: the same under either policy
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "exact")  # a value set wins over the policy's default
    assert settings.choice("DEEPINFER_FP8_GEMM") == "exact"
    monkeypatch.setenv("DEEPINFER_POLICY", "FAST")  # as any choice, case-insensitive
    assert settings.choice("DEEPINFER_TL_FP4") == "fold"


def test_applied_sets_per_call_settings_and_puts_them_back(monkeypatch):
    import os

    monkeypatch.delenv("DEEPINFER_POLICY", raising=False)
    monkeypatch.setenv("DEEPINFER_TL_ATTN", "plain")
    with settings.applied({"DEEPINFER_POLICY": "fast", "DEEPINFER_TL_ATTN": "ws"}):
        assert settings.choice("DEEPINFER_FP8_GEMM") == "auto" and os.environ["DEEPINFER_TL_ATTN"] == "ws"
    assert "DEEPINFER_POLICY" not in os.environ and os.environ["DEEPINFER_TL_ATTN"] == "plain"
    with pytest.raises(RuntimeError):
        with settings.applied({"DEEPINFER_POLICY": "fast"}):
            raise RuntimeError("inside")
    assert "DEEPINFER_POLICY" not in os.environ  # also after an error
    with pytest.raises(ValueError, match="not a setting read per call"):
        with settings.applied({"DEEPINFER_PDL": "0"}):
            pass
    with pytest.raises(ValueError, match="DEEPINFER_POLICY='slow'"):
        with settings.applied({"DEEPINFER_POLICY": "slow"}):
            pass


def _clean_deepinfer_env(monkeypatch):
    for n in [n for n in os.environ if n.startswith("DEEPINFER_") and n != "DEEPINFER_HOME"]:
        monkeypatch.delenv(n)


@pytest.mark.parametrize("name,value", [("DEEPINFER_STRICT", "maybe"), ("DEEPINFER_ATTN_PREFILL_BK", "48"),
                                        ("DEEPINFER_FP4_ONE_DOT", "yes please"),
                                        ("DEEPINFER_DECODE_FUSIONS", "-nope")])
def test_a_bad_value_is_refused_when_the_environment_is_checked(monkeypatch, name, value):
    _clean_deepinfer_env(monkeypatch)
    assert settings.check_environment() == []
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        settings.check_environment()


def test_an_unknown_name_is_a_warning_with_the_closest_setting(monkeypatch):
    _clean_deepinfer_env(monkeypatch)
    monkeypatch.setenv("DEEPINFER_FP4_ONEDOT", "1")
    monkeypatch.setenv("DEEPINFER_ZZZ", "1")
    monkeypatch.setenv("DEEPINFER_POLICY", "FAST")  # a good value: nothing to say
    assert settings.check_environment() == [
        "DEEPINFER_FP4_ONEDOT is not a deepinfer setting and is ignored (did you mean DEEPINFER_FP4_ONE_DOT?)",
        "DEEPINFER_ZZZ is not a deepinfer setting and is ignored"]


def test_the_cli_checks_the_environment_before_any_work(monkeypatch):
    """A value a kernel would refuse only when (or if) it reads it -- the torch reference never reads the Triton
    attention's tile setting -- is one line and exit 2 before the command runs; an unknown name is a warning."""
    from typer.testing import CliRunner

    from deepinfer_cli.app import app

    _clean_deepinfer_env(monkeypatch)
    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_BK", "48")
    r = CliRunner().invoke(app, ["generate", "北京是", "-n", "1", "--dtype", "float32"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert lines == ["error: DEEPINFER_ATTN_PREFILL_BK='48': choose one of 32, 64 (hint: the README's Settings "
                     "table lists each variable's values)"], r.output
    monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_BK", "64")
    monkeypatch.setenv("DEEPINFER_FP4_ONEDOT", "1")
    r = CliRunner().invoke(app, ["generate", "北京是", "-n", "1", "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    assert "warning: DEEPINFER_FP4_ONEDOT is not a deepinfer setting" in r.output
