"""tools/device/fp4_decode_sweep.py and fp8_exact_sweep.py in their CPU smoke forms (the interpreter, tiny shapes):
every variant runs the kernel it names and gives the shipped form's values; the report is written whole and the
settings are back afterwards."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from backend_device import device_for
from launch_spy import LaunchSpy

# --smoke runs the kernels on CPU tensors (the tools' own `TRITON_INTERPRET=1 ... --smoke` form): the interpreter's
# path, which a CUDA host, where Triton compiles, cannot take (the sweeps' full forms are device runs)
pytestmark = pytest.mark.skipif(device_for("triton") != "cpu",
                                reason="the sweeps' --smoke forms run Triton's interpreter on CPU tensors")

_SPEC = importlib.util.spec_from_file_location(
    "fp4_decode_sweep", Path(__file__).parent.parent / "tools/device/fp4_decode_sweep.py")


def test_fp4_decode_sweep_smoke(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    sweep = importlib.util.module_from_spec(_SPEC)
    _SPEC.loader.exec_module(sweep)
    from deepinfer_kernels.triton import moe_grouped as mg

    seen, shipped, ksub = [], mg._fp4_config, mg.DECODE_KSUB
    real_split = mg.split_k
    monkeypatch.setattr(mg, "split_k", lambda *a: seen.append(a[1]) or real_split(*a))  # tiles per config
    spy = LaunchSpy(mg._gg_fp4_kernel)
    monkeypatch.setattr(mg, "_gg_fp4_kernel", spy)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == len(sweep.VARIANTS) * 2 and not any(r["nan"] for r in doc["rows"])
    # launch configs change no sum; sub-steps group the fp32 sums otherwise
    assert all(r["rel_diff_vs_shipped"] == 0.0 for r in doc["rows"] if r["ksub"] == 1)
    assert all(r["rel_diff_vs_shipped"] < 1e-6 for r in doc["rows"])
    # batch 1 (6 one-row blocks, N 128): 128-row tiles give 6 (block, N tile) pairs, 64-row tiles 12; the shipped
    # config is back afterwards
    assert seen[:6] == [6, 6, 12, 12, 6, 6] and mg._fp4_config is shipped and mg.DECODE_KSUB == ksub
    ksubs = [k.get("KSUB", 1) for k in spy.launches]
    assert ksubs[:6] == [1, 1, 1, 1, 2, 4]  # the sub-step variants launch with their KSUB


_SPEC8 = importlib.util.spec_from_file_location(
    "fp8_exact_sweep", Path(__file__).parent.parent / "tools/device/fp8_exact_sweep.py")


def test_fp8_exact_sweep_smoke(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    import os

    sweep = importlib.util.module_from_spec(_SPEC8)
    _SPEC8.loader.exec_module(sweep)
    from deepinfer_kernels.triton import gemm

    monkeypatch.delenv("DEEPINFER_FP8_GEMM", raising=False)
    tiles, spy = gemm.TMA_TILES_F16, LaunchSpy(gemm._fp8_gemm_tma_kernel)
    monkeypatch.setattr(gemm, "_fp8_gemm_tma_kernel", spy)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(sweep.VARIANTS)
    ran = [r for r in rows if "error" not in r]
    assert [r["mode"] for r in rows if "error" in r] == ["cublas"]  # no CUDA here: named, not run
    assert ran and not any(r["nan"] for r in ran)
    # the exact forms and the per-128 one at M 130 give exact's bits on the interpreter (fp32 products summed in fp32)
    assert all(r["differ_from_exact"] == 0.0 for r in ran)
    # each variant launched its form with its tiles: exact, six f16 tilings, per-128-K
    launches = [(k["EXACT"], k["F16"], k["BM"], k["BN"]) for k in spy.launches]
    assert launches == ([(True, False, 64, 128)] + [(False, True, t[0], t[1]) for m, t in sweep.VARIANTS.values()
                                                     if m == "exact-wgmma"] + [(False, False, 64, 128)])
    assert gemm.TMA_TILES_F16 == tiles and "DEEPINFER_FP8_GEMM" not in os.environ
