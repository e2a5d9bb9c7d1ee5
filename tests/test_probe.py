"""`deepinfer probe ...`: JSON shapes and exit codes on this (CPU) machine; the SM90 compile must pass here."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from deepinfer_cli.app import app

runner = CliRunner()


def _sub(*args, timeout=300):
    # triton-importing probes run in a subprocess: the interpreter mode is fixed at triton import time,
    # and the pytest process must stay free to choose it for other tests
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _last_json(text: str) -> dict:
    return json.loads(next(ln for ln in reversed(text.strip().splitlines()) if ln.startswith("{")))


def test_probe_triton_json_compile_target_passes_without_gpu():
    pytest.importorskip("triton")
    p = _sub("probe", "triton", "--json")
    assert p.returncode in (0, 1), p.stderr
    d = _last_json(p.stdout)
    assert d["install"]["installed"] and d["install"]["version"]
    assert d["install"]["flavor"] in ("upstream", "FlagTree") or d["install"]["flavor"].startswith("other")
    checks = {c["check"]: c for c in d["checks"]}
    cc = checks["compile target sm_90a"]
    assert cc["status"] == "pass" and cc["value"] == "sm_90a", cc
    for name in ("elementwise", "tl.dot fp16->fp32", "tl.gather tile rows", "RoPE pair gather (lane^1, lane^half)",
                 "fp8e4nv cast with block scale", "int64 comparison (CDF sampling)"):
        assert checks[name]["status"] in ("pass", "fail", "skip"), checks[name]
    assert checks["elementwise"]["status"] == "pass"
    pdl = checks["programmatic dependent launch"]  # Triton 3.6+ has grid dependency control
    assert pdl["status"] == "pass" and pdl["value"] is True, pdl
    assert p.returncode == (0 if d["ok"] else 1)
    import torch

    if not torch.cuda.is_available():
        assert d["interpreter"] is True and "interpreter" in checks["elementwise"]["mode"]


def test_probe_kernels_json():
    p = _sub("probe", "kernels", "--json", timeout=120)
    assert p.returncode == 0, p.stderr
    d = _last_json(p.stdout)
    from deepinfer.ops.registry import REGISTRY, _ensure_reference

    _ensure_reference()
    assert [r["op"] for r in d["ops"]] == list(REGISTRY)
    assert set(d["backends"]) == {"torch", "triton", "tilelang", "flaggems", "deepgemm"}
    for r in d["ops"]:
        assert r["backends"]["torch"]["implemented"] and r["backends"]["torch"]["importable"]
        assert r["here"] == "used" or r["here"].startswith("fallback")
    from deepinfer.ops.registry import default_backend

    assert d["default_backend"] == default_backend()  # the subprocess runs in this environment


def test_probe_env_json():
    r = runner.invoke(app, ["probe", "env", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("gpus", "driver", "cuda_runtime", "packages", "infiniband", "expert_parallel", "py_spy"):
        assert k in d
    assert set(d["packages"]) >= {"torch", "triton", "tilelang", "flag_gems", "deep_gemm", "deep_ep"}
    if not d["infiniband"]:
        assert "intranode" in d["expert_parallel"] and "unavailable" in d["expert_parallel"]


def test_probe_flaggems_and_tilelang_json_exit_0_when_absent():
    for cmd in (["probe", "flaggems", "--json", "--include", "softmax,add"], ["probe", "tilelang", "--json"]):
        r = runner.invoke(app, cmd)
        d = json.loads(r.stdout)
        assert "rows" in d and "installed" in d
        if not d["installed"]:
            assert r.exit_code == 0, r.output
            assert d["rows"][0]["status"] == "skip" and "not installed" in d["rows"][0]["detail"]
    # the table's exit code is the JSON's verdict: 0 where FlagGems is absent (a skip) or every check passes
    d = json.loads(runner.invoke(app, ["probe", "flaggems", "--json"]).stdout)
    want = 0 if not d["installed"] or all(row["status"] in ("pass", "skip") for row in d["rows"]) else 1
    assert d["ok"] == (want == 0)
    r = runner.invoke(app, ["probe", "flaggems"])
    assert r.exit_code == want and "FlagGems" in r.stdout, r.output


def test_probe_tilelang_names_tile_kernels_and_the_extra():
    import importlib.metadata as md

    r = runner.invoke(app, ["probe", "tilelang", "--json"])
    d = json.loads(r.stdout)
    assert set(d) >= {"version", "tile_kernels_version", "arch"}
    rows = {row["check"]: row for row in d["rows"]}
    try:
        assert d["tile_kernels_version"] == md.version("tile-kernels") and rows["tile-kernels"]["status"] == "pass"
    except md.PackageNotFoundError:
        assert d["tile_kernels_version"] is None and "pip install -e '.[tilelang]'" in rows["tile-kernels"]["detail"]


def test_flaggems_name_resolution():
    from deepinfer.engine.flaggems_aten import resolve_op_names

    ok, bad = resolve_op_names(["softmax", "add", "rmsnorm"], ["_softmax", "add", "rms_norm", "log_softmax"])
    assert ok == ["add"]
    assert bad["softmax"][0] == "_softmax" and "rms_norm" in bad["rmsnorm"]


def test_probe_kernels_table_names_the_extra_to_install():
    """The table prints each unimportable backend's reason as written: `pip install -e '.[tilelang]'`, not rich's
    markup-eaten `pip install -e '.'` (the brackets read as a style tag)."""
    import importlib.util

    r = runner.invoke(app, ["probe", "kernels"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # the console wraps long lines at its width
    d = json.loads(runner.invoke(app, ["probe", "kernels", "--json"]).stdout)
    reasons = [info["reason"] for info in d["backends"].values() if not info["importable"]]
    if importlib.util.find_spec("tilelang") is None:  # its backend imports TileLang when loaded
        assert any("pip install -e '.[tilelang]'" in why for why in reasons), reasons
    for why in reasons:
        assert " ".join(why.split()) in text, (why, r.output)
