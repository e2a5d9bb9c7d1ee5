"""Registers, spills and the main loop's SASS of Triton kernels compiled for sm_90a without a GPU: the offline
look at a kernel's register pressure and instruction mix before a device run (what `ptxas -v` and `nvdisasm` say of
the cubin). The kernels are `tools/triton_ptx.py`'s cases, compiled as a flash-shaped launch specialises them.

    python tools/triton_sass.py gg_fp4 attn_             # the cases whose name contains one of the words
    python tools/triton_sass.py gg_fp4_swiglu --warps 8 --const KSUB=2 --const BN=64

Per case: registers, spill stores / loads (bytes), the instructions of the longest loop (the body of the longest
backward branch: a GEMM's K loop, an attention's slot loop) and its most frequent opcodes. ptxas and nvdisasm are
the ones bundled with Triton. Instruction counts are per thread and per loop trip; they say where a kernel spends
issue slots, not its time.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_INS = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^\.L_x_\d+:")
_BRA = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


def loop_body(sass: str) -> list[str]:
    """The opcodes of the longest loop: from a label to the furthest backward branch to it."""
    lines = sass.splitlines()
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if _LABEL.match(ln.strip())}
    best: list[str] = []
    for i, ln in enumerate(lines):
        m = _BRA.search(ln)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = [mm.group(1) for x in lines[labels[m.group(1)]:i + 1] if (mm := _INS.match(x))]
            best = body if len(body) > len(best) else best
    return best


def ptxas_info(stderr: str) -> dict:
    """Registers and spill bytes from `ptxas -v`."""
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, stderr)) else 0  # noqa: E731
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}


def analyse(name: str, consts: dict | None = None, **options) -> dict:
    """Compile case `name` (its constexprs overridden by `consts`) and read its cubin."""
    import triton
    import triton_ptx  # imported here: it turns the Triton interpreter off for the process

    if consts:
        base = triton_ptx.CASES[name]
        triton_ptx.CASES[name] = lambda: _with_consts(base(), consts)
    try:
        ptx = triton_ptx.compile_case(name, **options).asm["ptx"]
    finally:
        if consts:
            triton_ptx.CASES[name] = base
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", src, "-o", cubin],
                           capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    body = loop_body(sass)
    return {"case": name, "triton": triton.__version__, **ptxas_info(r.stderr), "loop_sass": len(body),
            "loop_ops": collections.Counter(op.split(".")[0] for op in body).most_common(10)}


def _with_consts(src, consts: dict):
    names = src.fn.arg_names
    for k, v in consts.items():
        i = names.index(k)
        src.signature[k] = "constexpr"
        src.constants[(i,)] = v
        src.attrs.pop((i,), None)
    return src


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("words", nargs="*", help="cases whose name contains one of these (default: every case)")
    ap.add_argument("--warps", type=int, help="num_warps (default: the case's launch)")
    ap.add_argument("--stages", type=int, help="num_stages (default: the case's launch)")
    ap.add_argument("--const", action="append", default=[], metavar="NAME=VALUE",
                    help="override a constexpr (a Python literal), e.g. KSUB=2")
    args = ap.parse_args(argv)
    consts = {}
    for c in args.const:
        k, _, v = c.partition("=")
        consts[k] = ast.literal_eval(v)
    options = {k: v for k, v in (("num_warps", args.warps), ("num_stages", args.stages)) if v is not None}
    import triton_ptx
    for name in triton_ptx.CASES:
        if args.words and not any(w in name for w in args.words):
            continue
        try:
            r = analyse(name, consts, **options)
        except Exception as e:  # noqa: BLE001 - a case that does not compile is reported, the rest go on
            print(f"{name}: FAILED {type(e).__name__}: {' '.join(str(e).split())[:200]}")
            continue
        ops = " ".join(f"{op} {n}" for op, n in r["loop_ops"])
        print(f"{name}: {r['registers']} registers, spill {r['spill_stores']} / {r['spill_loads']} B, "
              f"loop {r['loop_sass']} SASS ({ops})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
