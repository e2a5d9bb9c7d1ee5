"""tools/triton_ptx.py and tools/triton_sass.py, the offline look at compiled kernels: cases compile as a flash launch
specialises them (16-divisible pointers and integers marked, those named odd not), and the SASS reader finds a
loop's body and ptxas's register and spill counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import triton_sass  # noqa: E402  (its compiling half imports triton_ptx, which turns the interpreter off: a child)


def _child(code: str) -> str:
    """Run `code` in a fresh interpreter (the tools compile; this process runs Triton interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tools"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout

_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/              @P0 HGMMA.64x128x16.F32 R24, gdesc[UR8], R24 ;
        /*0030*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0040*/             @!P1 BRA `(.L_x_3) ;
        /*0050*/                   EXIT ;
.L_x_4:
        /*0060*/                   BRA `(.L_x_4) ;
"""


def test_loop_body_is_the_longest_backward_branch():
    assert triton_sass.loop_body(_SASS) == ["LDG", "HGMMA", "IADD3", "BRA"]
    assert triton_sass.loop_body("        /*0000*/   EXIT ;") == []


def test_ptxas_info_reads_registers_and_spills():
    log = ("ptxas info    : Used 159 registers, used 1 barriers\n"
           "ptxas info    : 16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n")
    assert triton_sass.ptxas_info(log) == {"registers": 159, "spill_stores": 12, "spill_loads": 8}


def test_cases_carry_the_launch_specialisation():
    """Pointers and integer arguments are marked 16-divisible as a flash launch's are; an odd one is not, nor a float
    scalar, nor a constexpr (a batch-1 M given as the constant the JIT makes of 1)."""
    out = json.loads(_child(
        "import json, triton_ptx as t\n"
        "def marks(case):\n"
        "    src = t.CASES[case]()\n"
        "    return [src.fn.arg_names[k[0]] for k, v in src.attrs.items() if ['tt.divisibility', 16] in v]\n"
        "print(json.dumps({'swiglu': marks('gg_fp4_swiglu'), 'attn': marks('attn_fp8_decode'),\n"
        "                  'S': t.CASES['attn_fp8_decode']().signature['S']}))"))
    assert {"a_ptr", "w_ptr", "c_ptr", "N", "K", "KS_W"} <= set(out["swiglu"]) and "P" not in out["swiglu"]
    assert "q_ptr" in out["attn"] and "scale" not in out["attn"] and "S" not in out["attn"]
    assert out["S"] == "constexpr"


@pytest.mark.slow
def test_a_case_compiles_and_reads_back():
    """One small kernel through ptxas and nvdisasm (Triton's bundled ones): a register count, no spill, its loop."""
    out = _child("import json, triton_sass as s\nprint(json.dumps(s.analyse('moe_combine_post')))")
    r = json.loads(out.strip().splitlines()[-1])
    assert 0 < r["registers"] <= 255 and r["spill_stores"] == 0 and r["loop_sass"] > 0
    assert r["loop_ops"] and all(isinstance(n, int) and n > 0 for _, n in r["loop_ops"])
