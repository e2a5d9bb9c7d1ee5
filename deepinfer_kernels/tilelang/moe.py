"""The routed experts' grouped GEMM in TileLang (`grouped_gemm`, and `fp4_gemm` as its one-expert case), on sm_90.

C[p] = A[p] W[e[p]]^T for P (token, expert) rows. The rows are sorted by expert into blocks of BM rows with
`moe_align` (torch ops on the device: no host sync, shapes fixed by (P, E), so a decode step captures in a CUDA
graph); one program per (N tile, block) gathers its block's A rows, streams its expert's weight tiles over K and
scatters its rows of C. Blocks past the last used one carry expert -1 and do nothing.

FP4 experts (w int8 [E, N, K/2], e2m1 pairs along K, low nibble first; w_s [E, N, K/32] power-of-two scales)
run `grouped_fp4.py`'s bf16 form by default (DEEPINFER_TL_FP4=fold: its folded FP8 form at prefill). The official form
here runs with DEEPINFER_TL_FP4=fp8 and for shapes those do not take (N % 64 != 0), as DeepSeek's kernel.py
`fp4_gemm` computes them. Each 32-wide K step decodes the weight nibbles to e4m3 in
shared memory -- lossless, every e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) is an e4m3 value --
and runs one FP8 x FP8 tensor-core product into an fp32 fragment, cleared every step. The step's product is then
multiplied by the row's per-128 activation scale (the step's K lies inside one activation block: four steps per
block) and the weight row's per-32 scale, and added to an fp32 accumulator. So the per-32 weight scales and the
per-128 activation scales meet in fp32 on every 32-K partial, never inside the tensor core, and the whole K is
accumulated in fp32.
FP8 experts (w e4m3 [E, N, K], w_s [E, N/128, K/128]): 128-wide K steps, each step's product times the row's
activation scale and the 128 x 128 weight block's scale, accumulated in fp32 (as `fp8_gemm`).

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

import tilelang
import tilelang.language as T
import torch

from deepinfer import settings
from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement
from deepinfer.quant.formats import scale_f32
from deepinfer.quant.grouped import repeat_rows

from . import grouped_fp4
from ._common import build, expert_blocks, tl_dtype

BM, BN = 32, 128



def _e2m1_to_e4m3_bits(code):
    """An e2m1 code (0..15: sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0) -> the e4m3 byte of the
    same value, by bit placement: a normal e2m1 (exponent e >= 1) is 2^(e-1) (1 + m/2), the e4m3 exponent field
    e + 6 (bias 7) with the mantissa bit at the top of e4m3's three; the subnormal 0.5 is e4m3's 2^-1 (0x30)."""
    e = (code >> 1) & 3
    m = code & 1
    mag = T.if_then_else(e == 0, m * 0x30, ((e + 6) << 3) | (m << 2))
    return ((code & 8) << 4) | mag


def grouped_fp4_kernel(E: int, N: int, K: int, out_dt: str):
    """A [P, K] e4m3, AS [P, K/128] f32, W [E, N, K/2] uint8, WS [E, N, K/32] f32, ROWS [NB, BM] int64 (P = pad),
    BEXP [NB] int64 (-1 = unused) -> C [P, N] out_dt, rows of no block untouched (P, NB symbolic)."""
    P = T.symbolic("P")
    NB = T.symbolic("NB")
    BK = 32

    @T.prim_func
    def grouped_fp4_k(A: T.Tensor((P, K), "float8_e4m3"), AS: T.Tensor((P, K // 128), "float32"),
                      W: T.Tensor((E, N, K // 2), "uint8"), WS: T.Tensor((E, N, K // 32), "float32"),
                      ROWS: T.Tensor((NB, BM), "int64"), BEXP: T.Tensor((NB,), "int64"),
                      C: T.Tensor((P, N), out_dt)):
        with T.Kernel(T.ceildiv(N, BN), NB, threads=128) as (bx, by):
            a_t = T.alloc_shared((BM, BK), "float8_e4m3")
            w_t = T.alloc_shared((BN, BK), "float8_e4m3")
            rows = T.alloc_shared((BM,), "int64")
            sa = T.alloc_shared((BM,), "float32")
            sw = T.alloc_shared((BN,), "float32")
            part = T.alloc_fragment((BM, BN), "float32")
            acc = T.alloc_fragment((BM, BN), "float32")
            ex = T.alloc_local((1,), "int64")
            ex[0] = BEXP[by]
            for i in T.Parallel(BM):
                rows[i] = ROWS[by, i]
            T.clear(acc)
            if ex[0] >= 0:
                for k in T.Pipelined(K // BK, num_stages=2):
                    for i, j in T.Parallel(BM, BK):
                        a_t[i, j] = T.if_then_else(rows[i] < P, A[T.min(rows[i], P - 1), k * BK + j],
                                                   T.Cast("float8_e4m3", 0))
                    for i, j in T.Parallel(BN, BK // 2):
                        byte = T.if_then_else(bx * BN + i < N, W[ex[0], T.min(bx * BN + i, N - 1), k * (BK // 2) + j],
                                              T.uint8(0))
                        lo = _e2m1_to_e4m3_bits(T.Cast("int32", byte & T.uint8(15)))
                        hi = _e2m1_to_e4m3_bits(T.Cast("int32", byte >> T.uint8(4)))
                        w_t[i, 2 * j] = T.reinterpret("float8_e4m3", T.Cast("uint8", lo))
                        w_t[i, 2 * j + 1] = T.reinterpret("float8_e4m3", T.Cast("uint8", hi))
                    for i in T.Parallel(BM):
                        sa[i] = T.if_then_else(rows[i] < P, AS[T.min(rows[i], P - 1), k // 4], T.float32(0))
                    for i in T.Parallel(BN):
                        sw[i] = T.if_then_else(bx * BN + i < N, WS[ex[0], T.min(bx * BN + i, N - 1), k], T.float32(0))
                    T.clear(part)
                    T.gemm(a_t, w_t, part, transpose_B=True)
                    for i, j in T.Parallel(BM, BN):
                        acc[i, j] += part[i, j] * sa[i] * sw[j]
                for i, j in T.Parallel(BM, BN):
                    if rows[i] < P and bx * BN + j < N:
                        C[rows[i], bx * BN + j] = T.Cast(out_dt, acc[i, j])

    return grouped_fp4_k


def grouped_fp8_kernel(E: int, N: int, K: int, out_dt: str):
    """A [P, K] e4m3, AS [P, K/128] f32, W [E, N, K] e4m3, WS [E, ceil(N/128), K/128] f32, ROWS, BEXP as the FP4
    kernel -> C [P, N] out_dt."""
    P = T.symbolic("P")
    NB = T.symbolic("NB")
    BK = 128
    NW = (N + 127) // 128

    @T.prim_func
    def grouped_fp8_k(A: T.Tensor((P, K), "float8_e4m3"), AS: T.Tensor((P, K // 128), "float32"),
                      W: T.Tensor((E, N, K), "float8_e4m3"), WS: T.Tensor((E, NW, K // 128), "float32"),
                      ROWS: T.Tensor((NB, BM), "int64"), BEXP: T.Tensor((NB,), "int64"),
                      C: T.Tensor((P, N), out_dt)):
        with T.Kernel(T.ceildiv(N, BN), NB, threads=128) as (bx, by):
            a_t = T.alloc_shared((BM, BK), "float8_e4m3")
            w_t = T.alloc_shared((BN, BK), "float8_e4m3")
            rows = T.alloc_shared((BM,), "int64")
            sa = T.alloc_shared((BM,), "float32")
            part = T.alloc_fragment((BM, BN), "float32")
            acc = T.alloc_fragment((BM, BN), "float32")
            ex = T.alloc_local((1,), "int64")
            ex[0] = BEXP[by]
            for i in T.Parallel(BM):
                rows[i] = ROWS[by, i]
            T.clear(acc)
            if ex[0] >= 0:
                for k in T.Pipelined(K // BK, num_stages=2):
                    for i, j in T.Parallel(BM, BK):
                        a_t[i, j] = T.if_then_else(rows[i] < P, A[T.min(rows[i], P - 1), k * BK + j],
                                                   T.Cast("float8_e4m3", 0))
                    for i, j in T.Parallel(BN, BK):
                        w_t[i, j] = T.if_then_else(bx * BN + i < N, W[ex[0], T.min(bx * BN + i, N - 1), k * BK + j],
                                                   T.Cast("float8_e4m3", 0))
                    for i in T.Parallel(BM):
                        sa[i] = T.if_then_else(rows[i] < P, AS[T.min(rows[i], P - 1), k], T.float32(0)) * WS[ex[0], bx, k]
                    T.clear(part)
                    T.gemm(a_t, w_t, part, transpose_B=True)
                    for i, j in T.Parallel(BM, BN):
                        acc[i, j] += part[i, j] * sa[i]
                for i, j in T.Parallel(BM, BN):
                    if rows[i] < P and bx * BN + j < N:
                        C[rows[i], bx * BN + j] = T.Cast(out_dt, acc[i, j])

    return grouped_fp8_k


def _run(a, a_s, e, w, w_s, out_dtype, op, a_split=None):
    """The grouped kernel for w's format, or None where it does not apply (the reason reported)."""
    P, K = a.shape
    E, N = w.size(0), w.size(1)
    fp4 = w.dtype in (torch.int8, torch.uint8)
    if w.dtype != torch.float8_e4m3fn and not fp4:
        ops.runtime_fallback(op, f"the TileLang grouped GEMM takes FP8 or FP4 experts, not {w.dtype} weights")
        return None
    if a.dtype != torch.float8_e4m3fn or K % 128 or (not fp4 and N % 16):
        ops.runtime_fallback(op, f"the TileLang grouped GEMM takes e4m3 A with K % 128 == 0, not {a.dtype}, K {K}")
        return None
    dt = tl_dtype(out_dtype)
    # DEEPINFER_TL_FP4 (read per call): "bf16" / "fold", grouped_fp4.py's forms where N % 64 == 0 ("fold": the
    # folded FP8 form at 64- and 128-row blocks where the weight's scales allow it); "fp8", the official form
    form = settings.choice("DEEPINFER_TL_FP4") if fp4 else None
    if form in ("fold", "bf16") and grouped_fp4.takes(N, K):
        return grouped_fp4.run(a, a_s, e, w, w_s, out_dtype, a_split, lambda key, mk: build(op, key, mk), dt,
                               fold=form == "fold")
    make = grouped_fp4_kernel if fp4 else grouped_fp8_kernel
    kern = build(op, ("fp4" if fp4 else "fp8", E, N, K, dt), lambda: tilelang.compile(make(E, N, K, dt), out_idx=[]))
    if kern is None:
        return None
    c, rows, bexp = expert_blocks(e, P, N, E, BM, out_dtype)
    if rows is None:
        return c
    if fp4:
        ws = scale_f32(w_s, "grouped_gemm w_s")
        kern(a.contiguous(), a_s.float().contiguous(), w.contiguous().view(torch.uint8), ws.contiguous(),
             rows.view(-1, BM), bexp, c)
    else:
        kern(a.contiguous(), a_s.float().contiguous(), w.contiguous(), w_s.float().contiguous(), rows.view(-1, BM),
             bexp, c)
    return c


@implement("grouped_gemm", "tilelang")
def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                 w_s: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16,
                 a_split: torch.Tensor | None = None, topk: int = 1) -> torch.Tensor:
    if topk != 1:  # these kernels gather A per pair: the tokens' rows repeated for their topk pairs
        a, a_s, a_split = repeat_rows(topk, e, a, a_s, a_split)
    c = _run(a, a_s, e, w, w_s, out_dtype, "grouped_gemm", a_split)
    return c if c is not None else REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, out_dtype, a_split)


@implement("fp4_gemm", "tilelang")
def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M = a.size(0)
    e = torch.zeros(M, dtype=torch.int64, device=a.device)
    c = _run(a, a_s, e, w.unsqueeze(0), w_s.unsqueeze(0), out_dtype, "fp4_gemm")
    return c if c is not None else REGISTRY["fp4_gemm"].ref(a, a_s, w, w_s, out_dtype)
