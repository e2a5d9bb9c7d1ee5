"""Small Triton kernels that exercise each feature the engine's Triton backend relies on.

Used by `deepinfer probe triton`. Two groups, each returns a list of check dicts
`{"check", "status": pass|fail|skip, "value", "detail"}`:

* `numeric_checks(device)` runs the kernels (on CUDA, or on CPU tensors under the Triton interpreter),
* `compile_check()` compiles a kernel for SM90 with `triton.compile(ASTSource, GPUTarget("cuda", 90, 32))`
  without running it and checks the PTX names `.target sm_90a`; this needs no GPU.

Whether `@triton.jit` builds interpreted functions is decided when this module is imported (Triton reads
`TRITON_INTERPRET` at decoration time), so `INTERPRET` records the mode; `probes.py` runs a group in a
subprocess (`python -m deepinfer.debug.triton_probe_kernels numeric|compile`, JSON on stdout) when the
mode of this process is the wrong one.
"""

from __future__ import annotations

import json
import sys
import time

from deepinfer import settings

INTERPRET = settings.triton_interpreted()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _k_elementwise(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=1.0)
    y = tl.load(y_ptr + o, mask=m, other=1.0)
    z = x * y + x / y - tl.exp(-tl.abs(x)) + tl.sqrt(tl.abs(y))
    tl.store(z_ptr + o, z, mask=m)


@triton.jit
def _k_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    c = tl.dot(a, b, out_dtype=tl.float32)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], c)


@triton.jit
def _k_gather_rows(x_ptr, idx_ptr, y_ptr, R: tl.constexpr, D: tl.constexpr, K: tl.constexpr):
    # gather K rows of an [R, D] tile held in registers (the sparse-attention/indexer pattern)
    rr = tl.arange(0, R)
    rd = tl.arange(0, D)
    rk = tl.arange(0, K)
    tile = tl.load(x_ptr + rr[:, None] * D + rd[None, :])
    idx = tl.load(idx_ptr + rk)
    full = tl.broadcast_to(idx[:, None], (K, D))
    g = tl.gather(tile, full, axis=0)
    tl.store(y_ptr + rk[:, None] * D + rd[None, :], g)


@triton.jit
def _k_rope_pairs(x_ptr, y1_ptr, y2_ptr, R: tl.constexpr):
    lane = tl.arange(0, R)
    x = tl.load(x_ptr + lane)
    tl.store(y1_ptr + lane, tl.gather(x, lane ^ 1, axis=0))  # interleaved pairs (2i, 2i+1)
    tl.store(y2_ptr + lane, tl.gather(x, lane ^ (R // 2), axis=0))  # half-split pairs (i, i + R/2)


@triton.jit
def _k_fp8_quant(x_ptr, q_ptr, s_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-4)
    s = tl.exp2(tl.ceil(tl.log2(amax / 448.0)))
    q = tl.clamp(x / s, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + o, q.to(tl.uint8, bitcast=True))
    tl.store(s_ptr + pid, s)


@triton.jit
def _k_int64_cdf(w_ptr, u_ptr, out_ptr, V: tl.constexpr):
    # CDF sampling in integer arithmetic: weights are int64 (beyond 2^32), count entries with cdf <= u
    row = tl.program_id(0)
    lane = tl.arange(0, V)
    w = tl.load(w_ptr + row * V + lane)
    cdf = tl.cumsum(w, axis=0)
    u = tl.load(u_ptr + row)
    tok = tl.sum((cdf <= u).to(tl.int64), axis=0)
    tl.store(out_ptr + row, tok)


def _res(check: str, ok: bool | None, value, detail: str) -> dict:
    status = "skip" if ok is None else ("pass" if ok else "fail")
    return {"check": check, "status": status, "value": value, "detail": detail}


def _run(check: str, fn) -> dict:
    t0 = time.perf_counter()
    try:
        r = fn()
    except Exception as e:  # a feature the compiler/interpreter lacks is a failed check, not a crash
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return _res(check, False, None, f"{type(e).__name__}: {msg}"[:300])
    r["seconds"] = round(time.perf_counter() - t0, 3)
    return r


def numeric_checks(device: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)

    def dev(t):
        return t.to(device)

    def elementwise():
        n = 1000
        x = dev(torch.randn(n, generator=g))
        y = dev(torch.rand(n, generator=g) + 0.5)
        z = torch.empty_like(x).fill_(float("nan"))
        _k_elementwise[(triton.cdiv(n, 256),)](x, y, z, n, BLOCK=256)
        ref = x * y + x / y - torch.exp(-x.abs()) + y.abs().sqrt()
        err = (z - ref).abs().max().item()
        return _res("elementwise", err <= 1e-5, err, "max abs error vs torch, fp32 (n=1000, masked tail)")

    def dot():
        M = N = K = 32
        a = dev(torch.randn(M, K, generator=g).half())
        b = dev(torch.randn(K, N, generator=g).half())
        c = dev(torch.full((M, N), float("nan")))
        _k_dot[(1,)](a, b, c, M=M, N=N, K=K)
        ref = a.float() @ b.float()
        rel = ((c - ref).norm() / ref.norm()).item()
        return _res("tl.dot fp16->fp32", rel <= 1e-3, rel, "relative error of a 32x32x32 product vs fp32 matmul")

    def dot_bf16():
        M = N = K = 32
        a = dev(torch.randn(M, K, generator=g).bfloat16())
        b = dev(torch.randn(K, N, generator=g).bfloat16())
        c = dev(torch.full((M, N), float("nan")))
        _k_dot[(1,)](a, b, c, M=M, N=N, K=K)
        ref = a.float() @ b.float()
        rel = ((c - ref).norm() / ref.norm()).item()
        detail = "relative error of a 32x32x32 bf16 product vs fp32 matmul"
        if rel > 1e-3 and INTERPRET:
            detail += ("; the Triton interpreter mis-reads bf16 dot operands (kernels running interpreted should "
                       "upcast to fp32 before tl.dot)")
        return _res("tl.dot bf16->fp32", rel <= 1e-3, rel, detail)

    def gather_rows():
        R, D, K = 16, 32, 16
        x = dev(torch.randn(R, D, generator=g))
        idx = dev(torch.randint(0, R, (K,), generator=g, dtype=torch.int32))
        y = dev(torch.full((K, D), float("nan")))
        _k_gather_rows[(1,)](x, idx, y, R=R, D=D, K=K)
        bad = int((y != x[idx.long()]).sum().item())
        return _res("tl.gather tile rows", bad == 0, bad, "mismatching elements gathering 16 rows of a [16, 32] tile")

    def rope_pairs():
        R = 64
        x = dev(torch.randn(R, generator=g))
        y1, y2 = dev(torch.full((R,), float("nan"))), dev(torch.full((R,), float("nan")))
        _k_rope_pairs[(1,)](x, y1, y2, R=R)
        lane = torch.arange(R, device=device)
        bad = int((y1 != x[lane ^ 1]).sum().item() + (y2 != x[lane ^ (R // 2)]).sum().item())
        return _res("RoPE pair gather (lane^1, lane^half)", bad == 0, bad, "mismatching lanes of 64 (two patterns)")

    def fp8_quant():
        from deepinfer.ops.reference import act_quant

        nb, blk = 8, 128
        x = dev(torch.randn(nb * blk, generator=g) * torch.logspace(-3, 3, nb).repeat_interleave(blk))
        q = dev(torch.zeros(nb * blk, dtype=torch.uint8))
        s = dev(torch.full((nb,), float("nan")))
        _k_fp8_quant[(nb,)](x, q, s, BLOCK=blk)
        rq, rs = act_quant(x.cpu().view(1, -1), blk)
        bad_s = int((s.cpu() != rs.view(-1)).sum().item())
        bad_q = int((q.cpu() != rq.view(-1).view(torch.uint8)).sum().item())
        detail = f"bit mismatches vs act_quant: {bad_q} values, {bad_s} scales (8 blocks of 128)"
        if bad_q and INTERPRET:
            got = q.cpu().view(torch.float8_e4m3fn).float()
            want = rq.view(-1).float()
            wrong = got != want
            if bool((got[wrong] * 2 == want[wrong]).all()):
                detail += ("; Triton interpreter bug: its fp32->fp8 rounding does not carry a mantissa overflow "
                           "into the exponent (values just below 2^k become 2^(k-1)); compiled kernels are unaffected")
        return _res("fp8e4nv cast with block scale", bad_s == 0 and bad_q == 0, bad_q + bad_s, detail)

    def int64_cdf():
        B, V = 4, 64
        w = dev(torch.randint(1, 1 << 40, (B, V), generator=g, dtype=torch.int64))
        cdf = w.cumsum(-1)
        u = (cdf[:, -1].double() * torch.rand(B, generator=g, dtype=torch.float64).to(device)).long()
        out = dev(torch.full((B,), -1, dtype=torch.int64))
        _k_int64_cdf[(B,)](w, u, out, V=V)
        ref = (cdf <= u.unsqueeze(-1)).sum(-1)
        bad = int((out != ref).sum().item())
        return _res("int64 comparison (CDF sampling)", bad == 0, bad, "rows drawing the wrong token; weights up to 2^40")

    return [_run(n, f) for n, f in (("elementwise", elementwise), ("tl.dot fp16->fp32", dot), ("tl.dot bf16->fp32", dot_bf16),
                                     ("tl.gather tile rows", gather_rows), ("RoPE pair gather", rope_pairs),
                                     ("fp8e4nv block-scale cast", fp8_quant), ("int64 CDF compare", int64_cdf))]


def compile_check() -> dict:
    """Compile `_k_fp8_quant` (fp8 + reductions: a realistic kernel) for sm_90 without a device."""

    def go():
        if INTERPRET:
            return _res("compile target sm_90a", None, None, "this process runs the interpreter")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        src = ASTSource(fn=_k_fp8_quant, signature={"x_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*fp32",
                                                    "BLOCK": "constexpr"}, constexprs={"BLOCK": 128})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        ptx = k.asm.get("ptx", "")
        if isinstance(ptx, bytes):
            ptx = ptx.decode()
        target = next((ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".target")), None)
        ver = next((ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".version")), None)
        ok = target == "sm_90a"
        return _res("compile target sm_90a", ok, target,
                    f"triton.compile(ASTSource, GPUTarget('cuda', 90, 32)): PTX .target {target}, .version {ver}, "
                    f"stages {','.join(k.asm.keys())}")

    return _run("compile target sm_90a", go)


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "numeric"
    device = argv[1] if len(argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    out = {"interpret": INTERPRET, "device": device}
    if what == "numeric":
        out["checks"] = numeric_checks(device)
    else:
        out["checks"] = [compile_check()]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
