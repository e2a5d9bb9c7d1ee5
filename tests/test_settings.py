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
