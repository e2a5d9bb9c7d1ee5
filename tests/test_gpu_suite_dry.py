"""tools/device/gpu_suite.sh in its dry form (GPU_SUITE_DRY=1): the bench-type phases run at deepinfer-tiny on the
CPU, so their commands, files and one-line summaries are checked before a device call spends time on them. Each
phase's row must exit 0 and carry its summary, not "no report"."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bench_phases_run_dry(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") or k == "DEEPINFER_HOME"}
    env.update(OUT=str(tmp_path / "out"), GPU_SUITE_DRY="1", GPU_SUITE_LIMIT="1200", POLICY_BATCHES="1",
               FUSION_OPS="hc_post_pre_quant,rms_norm_rope_store", TUNE_OPS="^rms_norm$",
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    r = subprocess.run(["bash", "tools/device/gpu_suite.sh", "bench", "fusions", "fp4sweep", "tune", "policy", "smoke"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.rindex("| phase | marker |"):]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\w+) \|.*$", table, re.M) if m.group(1) != "phase"}
    assert list(rows) == ["bench", "fusions", "fp4sweep", "tune", "policy", "smoke"]
    for phase in ("bench", "fusions", "fp4sweep", "tune", "policy"):
        assert "| rc 0 |" in rows[phase] and "no report" not in rows[phase], rows[phase]
    assert "not run: a test phase" in rows["smoke"]
    assert "TTFT eager" in rows["bench"] and "graph skipped" in rows["bench"]
    assert "torch:DEEPINFER_FP8_GEMM=exact-wgmma: TTFT" in rows["bench"]
    assert "-hc_post_pre_quant" in rows["fusions"] and "-rms_norm_rope_store" in rows["fusions"]
    assert "targets: TTFT official" in rows["policy"] and "torch:experts=fp8,policy=fast" in rows["policy"]
    out = tmp_path / "out"
    # every fusion configuration wrote a report: on, off, the two named off alone, on again
    runs = sorted(out.glob("fusions_[0-9]*.json"))
    assert len(runs) == 5 and all("decode" in json.loads(p.read_text().splitlines()[-1]) for p in runs)
    assert {"bench.json", "bench_policy.json", "map.yaml", "fp4_decode_sweep.json", "fp8_exact_sweep.json",
            "fusions_drift.json"} <= {p.name for p in out.iterdir()}
