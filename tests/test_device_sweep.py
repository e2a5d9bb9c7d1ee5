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

    seen, shipped = [], mg._fp4_config
    real_split = mg.split_k
    monkeypatch.setattr(mg, "split_k", lambda *a: seen.append(a[1]) or real_split(*a))  # tiles per config
    out = tmp_path / "sweep.json"
    assert sweep.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == len(sweep.VARIANTS) * 2 and not any(r["nan"] for r in doc["rows"])
    assert all(r["rel_diff_vs_shipped"] == 0.0 for r in doc["rows"])
    # batch 1 (6 one-row blocks, N 128): 128-row tiles give 6 (block, N tile) pairs, 64-row tiles 12; the shipped
    # config is back afterwards
    assert seen[:4] == [6, 6, 12, 12] and mg._fp4_config is shipped
