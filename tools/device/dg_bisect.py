"""Where DeepGEMM's host code crashes on this machine: one step per child process, each a little further down the
path `fp8_gemm_nt` takes (DeepGEMM 2.6.1, 54e22612), so a segfault in one step leaves the others' results.

2026-12-06 (H100, torch 2.11.0+cu130, nvcc 13.0): every FP8 GEMM call segfaulted before any JIT log line. Those
lines are C printf calls without a flush, lost when the process dies on a pipe, so each child runs under
`stdbuf -oL -eL` with faulthandler on. The order (from reading 2.6.1's host path: `csrc/apis/gemm.hpp`, then
`csrc/jit/device_runtime.hpp`, `csrc/apis/layout.hpp`, the TMA descriptors, the compile):

  runtime      get_num_sms: the device runtime's constructor alone (its own cuBLASLt handle, a workspace)
  cublaslt     cublaslt_gemm_nt on bf16: the cuBLASLt the extension bound to (not linked by its setup.py)
  sf_layout    get_mn_major_tma_aligned_tensor on fp32 activation scales: the layout kernel's JIT compile
  bf16         bf16_gemm_nt: a JIT-compiled SM90 GEMM without scales
  fp8_aligned  fp8_gemm_nt with the activation scales already MN-major (no layout transform first)
  fp8          fp8_gemm_nt as our adapter calls it (row-major fp32 scales)

The first step that fails names the site. Prints `step NAME rc=N: last line` per step and writes each child's
output to $OUT/dg_bisect_NAME.log. Usage: python3 tools/device/dg_bisect.py [STEP ...]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

PRELUDE = """
import torch, deep_gemm
torch.manual_seed(0)
M, N, K = 128, 256, 512
a = torch.randn(M, K, device="cuda")
b = torch.randn(N, K, device="cuda")
d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
ref = a @ b.t()
def check(what, out, ref):
    torch.cuda.synchronize()
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    print(what, "max rel err", err, flush=True)
    assert err < 0.1, err
"""

STEPS = {
    "runtime": "print('num_sms', deep_gemm.get_num_sms(), flush=True)",
    "cublaslt": "ab, bb = a.bfloat16(), b.bfloat16()\n"
                "deep_gemm.cublaslt_gemm_nt(ab, bb, d)\n"
                "check('cublaslt bf16', d, ab.float() @ bb.float().t())",
    "sf_layout": "sa = torch.rand(M, K // 128, device='cuda') + 0.5\n"
                 "t = deep_gemm._C.get_mn_major_tma_aligned_tensor(sa)\n"
                 "torch.cuda.synchronize()\n"
                 "print('aligned', tuple(t.shape), t.stride(), bool(torch.equal(t, sa)), flush=True)",
    "bf16": "ab, bb = a.bfloat16(), b.bfloat16()\n"
            "deep_gemm.bf16_gemm_nt(ab, bb, d)\n"
            "check('bf16_gemm_nt', d, ab.float() @ bb.float().t())",
    "fp8_aligned": "a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)\n"
                   "sa = torch.ones(M, K // 128, device='cuda').t().contiguous().t()\n"
                   "sb = torch.ones(N // 128, K // 128, device='cuda')\n"
                   "deep_gemm.fp8_gemm_nt((a8, sa), (b8, sb), d)\n"
                   "check('fp8_gemm_nt, MN-major scales', d, a8.float() @ b8.float().t())",
    "fp8": "a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)\n"
           "sa = torch.ones(M, K // 128, device='cuda')\n"
           "sb = torch.ones(N // 128, K // 128, device='cuda')\n"
           "deep_gemm.fp8_gemm_nt((a8, sa), (b8, sb), d)\n"
           "check('fp8_gemm_nt', d, a8.float() @ b8.float().t())",
}


def run_step(name: str, out_dir: str, timeout: int = 120) -> tuple[int, str]:
    """Run one step in a child (line-buffered C stdio, faulthandler) -> (return code, its last output line)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DG_JIT_DEBUG": os.environ.get("DG_JIT_DEBUG", "1")}
    cmd = [sys.executable, "-X", "faulthandler", "-c", PRELUDE + STEPS[name]]
    if shutil.which("stdbuf"):
        cmd = ["stdbuf", "-oL", "-eL", *cmd]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"{e.stdout or ''}{e.stderr or ''}timed out after {timeout} s"
    with open(os.path.join(out_dir, f"dg_bisect_{name}.log"), "w") as f:
        f.write(text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return rc, lines[-1][:200] if lines else ""


def main(argv: list[str]) -> int:
    names = argv or list(STEPS)
    bad = [n for n in names if n not in STEPS]
    if bad:
        print(f"unknown step {bad[0]!r}; steps: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    first_bad = None
    for n in names:
        rc, last = run_step(n, out_dir)
        print(f"step {n} rc={rc}: {last}", flush=True)
        if rc and first_bad is None:
            first_bad = n
    print(f"first failing step: {first_bad or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
