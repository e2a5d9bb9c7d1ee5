"""tools/triton_launches.py: launches recorded under the interpreter as the JIT would specialise them, then
compiled for sm_90a in a child without the interpreter; a launch that does not compile is named, exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import triton_launches as tlx  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_runtime_arguments_keep_only_their_specialisation():
    # 1 is a constant, a multiple of 16 is marked, anything else is neither; past 32 bits it is i64
    assert [tlx.encode_arg(v)[1] for v in (1, 32, 7, 0)] == [1, 16, 3, 16]
    assert tlx.encode_arg(2 ** 40) == ["int", 2 ** 32 + 16] and tlx.encode_arg(2 ** 40 + 1)[1] == 2 ** 32 + 3
    assert tlx.encode_arg(0.37) == ["float", 0.0]
    # a constexpr keeps its value; bools, None and strings are constants
    assert tlx.encode_arg(7, constexpr=True) == ["int", 7] and tlx.encode_arg(True) == ["const", True]
    x = torch.empty(64, dtype=torch.float32)
    assert tlx.encode_arg(x) == ["ptr", "fp32", True]
    assert tlx.encode_arg(x[1:]) == ["ptr", "fp32", False]  # 4 bytes in: not 16-byte aligned
    assert tlx.encode_arg(torch.empty(4, dtype=torch.float8_e4m3fn))[1] == "fp8e4nv"
    with pytest.raises(TypeError, match="complex"):
        tlx.encode_arg(torch.empty(2, dtype=torch.complex64))


def _norm_launch():
    from deepinfer_kernels.triton import norm

    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    norm.rms_norm(x, torch.rand(40) + 0.5, 1e-6)
    norm.rms_norm(x[:, :32], None, 1e-6)  # a column slice at the wider row stride, no weight


@pytest.mark.skipif(not INTERPRETED, reason="records under Triton's interpreter")
def test_record_then_compile(tmp_path, monkeypatch):
    monkeypatch.setitem(tlx.SCENARIOS, "norm", _norm_launch)
    items = tlx.record(["norm"])
    assert [i["kernel"] for i in items] == ["_rms_norm_kernel"] * 2
    first = items[0]
    assert first["module"] == "deepinfer_kernels.triton.norm"
    assert first["args"]["HAS_W"] == ["const", True] and first["args"]["BLOCK"] == ["int", 64]  # constexprs kept
    assert first["args"]["N"] == ["int", 3] and first["args"]["eps"] == ["float", 0.0]  # 40: neither 1 nor 16k
    assert items[1]["args"]["HAS_W"] == ["const", False] and items[1]["args"]["N"] == ["int", 16]
    # the same launch again is not recorded twice
    assert len(tlx.record(["norm", "norm"])) == 2

    good = tmp_path / "good.json"
    good.write_text(json.dumps(items))
    r = _compile(good)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 distinct launches of 1 kernels compiled for sm_90a, 0 failed" in r.stdout

    bad = json.loads(json.dumps(items))
    bad[1]["args"]["BLOCK"] = ["int", 48]  # not a power of two: tl.arange refuses it when compiled
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = _compile(tmp_path / "bad.json")
    assert r.returncode == 1
    assert "FAILED norm._rms_norm_kernel" in r.stdout and "'BLOCK': 48" in r.stdout
    assert "2 distinct launches of 1 kernels compiled for sm_90a, 1 failed" in r.stdout


def _compile(path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(ROOT / "tools" / "triton_launches.py"), "--from", str(path)],
                          capture_output=True, text=True, env=env, timeout=600)
