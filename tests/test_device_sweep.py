"""tools/device/fp4_decode_sweep.py in its CPU smoke form (the interpreter, tiny shapes): every launch-config
variant runs the FP4 decode GEMM through the patched `_fp4_config` and gives the shipped config's values; the
report is written whole."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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
    ksubs = []
    kernel = mg._gg_fp4_kernel

    class Spy:  # records each launch's KSUB, then launches
        def __getitem__(self, grid):
            return lambda *a, **k: ksubs.append(k.get("KSUB", 1)) or kernel[grid](*a, **k)

    monkeypatch.setattr(mg, "_gg_fp4_kernel", Spy())
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
    assert ksubs[:6] == [1, 1, 1, 1, 2, 4]  # the sub-step variants launch with their KSUB
