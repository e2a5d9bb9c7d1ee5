"""Plain y = x Wᵀ (bf16 / fp16 / fp32 weights, no quantisation) in Triton.

The model calls it for the float weights of the official layout (indexer weights_proj [64, 4096]; the
compressors' stacked wkv|wgate [2048, 4096] as stored in bf16 with out_dtype=float32, the official
x.float() @ W.float() without either copy), for the fp32 LM head, and for every weight in `exact` numerics.
y = x.to(out_dtype) @ w.to(out_dtype)ᵀ, out_dtype defaulting to x's dtype.

Two paths, chosen from shapes only (CUDA-graph capturable, no host syncs):

* M <= 16 (decode) with 16-bit x: the tiled path below with 16-row tiles (`_native`: a tensor-core dot in
  x's dtype forms the exact products). The FMA GEMV ran the compressor projections at several times their
  bytes' floor and slower than the tiled path (docs/perf-log.md, "Fewer decode launches, FP8 `wo_a`, LM head
  tiles").
* M <= 16 otherwise (fp32 x): split-K GEMV. Grid (cdiv(N, BN), nsplit); a program owns BN weight rows and one
  K chunk of `per` x BK columns and does fp32 FMA products reduced with tl.sum (exact fp32 products,
  no tensor cores, no TF32). The program tile is BM x BN x BK <= 8192 (BM = p2(M) >= 2, BK = 128 so one
  fp32 weight row segment is 512 contiguous bytes); nsplit is chosen so that N tiles x splits ~ 4 x SMs
  (the [1024, 4096] fp32 weight at M = 1: 32 N tiles x 16 splits = 512 programs of 32 KB each instead
  of 16 programs streaming 1 MB; `GEMV_PROGRAMS_PER_SM`). Partials go to a fp32 [nsplit, M, N] workspace
  (torch.empty) and the tile's last split sums them in split order into y (`splitk_store`: deterministic,
  no second launch); with a single split the GEMV kernel stores y directly.
* fp32 x, bf16 W (the LM head, kept in its checkpoint bf16): x split exactly into three bf16
  parts, three bf16 dots into one fp32 accumulator (`_linear_x3_kernel`): fp32-exact products at the
  bf16 MMA rate, half the bytes of an fp32 head and no per-call upcast copy.
* M > 16: tiled tl.dot GEMM (BM x 64 x 32 tiles, BM 32 / 64 / 128 by M: `_tile_config`; K split as the
  GEMV's, fp32 accumulate); fp32 operands use 3xTF32
  ("tf32x3": ~2^-22 relative per product, fp32-accurate within the registry's float32 tolerance and far
  faster than "ieee" FMA dot emulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv
from ._common import INTERPRET as _INTERPRET
from ._common import dot_f32, p2, pdl, pdl_wait, sms, split_buffers, split_k, splitk_store, tf32_exact



@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, KCH, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, F32: tl.constexpr, X_TF32: tl.constexpr, W_TF32: tl.constexpr,
                   DIRECT: tl.constexpr):
    """Tile (pid_m, pid_n) over the K chunk pid_s * KCH ..: stores y (DIRECT) or a split-K partial.
    F32: float32 products of the operands' exact fp32 upcasts (`dot_f32`, X_TF32 / W_TF32 per operand
    dtype); else a dot in x's dtype of x and w.to(x.dtype), products exact in the fp32 accumulator."""
    pdl_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    k_lo = pid_s * KCH
    for k0 in range(k_lo, k_lo + KCH, BK):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        if F32:
            acc = dot_f32(x.to(tl.float32), w.to(tl.float32), acc, X_TF32, W_TF32)
        else:  # the reference's w.to(x.dtype), per tile (no full-size copy)
            acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
    msk = (rm[:, None] < M) & (rn[None, :] < N)
    if DIRECT:
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=msk)
    else:
        splitk_store(acc, p_ptr + rm[:, None] * N + rn[None, :], y_ptr + rm[:, None] * N + rn[None, :], msk,
                     pid_s, tl.num_programs(2), M * N, cnt_ptr + pid_m * tl.num_programs(1) + pid_n)


@triton.jit
def _linear_gemv_kernel(x_ptr, w_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, KCH, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, W_TO_X: tl.constexpr, DIRECT: tl.constexpr):
    """Partial over K split s: sum over its k of x[m, k] * w[n, k] (fp32 FMA), stored into y (DIRECT: one
    split) or through `splitk_store`. The products accumulate elementwise over the K steps and are reduced
    over BK once at the end: a reduction per step is a cross-thread shuffle tree every step (957 SASS
    instructions per step, 324 of them shuffles, against 154 deferred; offline sm_90 compile). Deferring is
    much faster at every decode shape but the smallest (M 1, N 512: about even); docs/perf-log.md, "In-kernel
    split-K reduction, fewer decode launches, deferred FMA reductions"."""
    pdl_wait()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, BM).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mm = rm < M
    mn = rn < N
    acc3 = tl.zeros([BM, BN, BK], tl.float32)  # BM x BN x BK <= 8192: 64 registers a thread at 4 warps
    k_lo = pid_s * KCH
    for k0 in range(k_lo, k_lo + KCH, BK):
        k = (k0 + tl.arange(0, BK)).to(tl.int64)
        mk = k < K
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if W_TO_X:  # the reference's w.to(x.dtype) (y in x's dtype); then exact fp32
            w = w.to(x_ptr.dtype.element_ty)
        w = w.to(tl.float32)
        acc3 += x[:, None, :] * w[None, :, :]
    acc = tl.sum(acc3, 2)
    msk = mm[:, None] & mn[None, :]
    if DIRECT:
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=msk)
    else:
        splitk_store(acc, p_ptr + rm[:, None] * N + rn[None, :], y_ptr + rm[:, None] * N + rn[None, :], msk,
                     pid_s, tl.num_programs(1), M * N, cnt_ptr + pid_n)


@triton.jit
def _linear_x3_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DOT_BF16: tl.constexpr, X_BF16: tl.constexpr):
    """y = x Wᵀ for fp32 x and bf16 W (the LM head) at fp32 accuracy on bf16 tensor cores.

    x = x1 + x2 + x3 exactly, each a bf16 (round to nearest, take the exact fp32 remainder, twice:
    8 + 8 + 8 significant bits cover fp32's 24), and W is bf16 already, so the three bf16 x bf16 dots
    form exact products in the fp32 accumulator: the sum of fp32 products, as the reference's
    F.linear(x, W.float()), with no fp32 copy of W (1 GB for V4's head) and at the bf16 MMA rate.
    X_BF16: x is bf16 already (y = x.float() Wᵀ): one dot, x1 = x.
    """
    pdl_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
        wt = tl.trans(w)
        if DOT_BF16 and X_BF16:
            acc = tl.dot(x, wt, acc)
        elif DOT_BF16:
            x1 = x.to(tl.bfloat16)
            r = x - x1.to(tl.float32)
            x2 = r.to(tl.bfloat16)
            x3 = (r - x2.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(x1, wt, acc)
            acc = tl.dot(x2, wt, acc)
            acc = tl.dot(x3, wt, acc)
        else:  # the interpreter's bf16 dot is wrong; an fp32 "ieee" dot forms the same exact products
            acc = tl.dot(x.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


GEMV_MAX_M = 16
GEMV_PROGRAMS_PER_SM = 4
"""K splits until N tiles x splits ~ this many programs per SM: each program's K loop waits on its loads
(an FMA reduction, not a dot: nothing pipelines them), so bytes in flight come from programs. 4 per SM beat 2
on the largest fp32 weight at M = 1, were about even on the smaller ones, and 8 to 32 per SM were no better
(docs/perf-log.md, "In-kernel split-K reduction, fewer decode launches, deferred FMA reductions")."""


def _gemv(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    M, K = x2.shape
    N = w.size(0)
    BM = max(2, p2(M))
    BK = max(16, min(p2(K), 128))
    BN = max(2, min(p2(N), 8192 // (BM * BK)))
    n_tiles = cdiv(N, BN)
    per, ns = split_k(cdiv(K, BK), n_tiles, GEMV_PROGRAMS_PER_SM * sms(x2.device))
    ws, cnt = split_buffers(y, ns, n_tiles)
    _linear_gemv_kernel[(n_tiles, ns)](x2, w, y, ws, cnt, M, N, K, per * BK, BM=BM, BN=BN, BK=BK,
                                       W_TO_X=y.dtype == x2.dtype, DIRECT=ns == 1, **pdl())


def _native(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> bool:
    """The products are exact as a dot in x's 16-bit dtype: y in x's dtype (the reference's w.to(x.dtype)),
    or fp32 y from x and w of one 16-bit dtype (16 x 16-bit products are exact in the fp32 accumulator; not
    under the interpreter, whose bf16 dot is wrong). Otherwise fp32 operands (`dot_f32` / FMA)."""
    return x2.dtype != torch.float32 and (y.dtype == x2.dtype or (w.dtype == x2.dtype and not _INTERPRET))


def _tiled(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """BM x 64 tiles, K split over a third grid axis until ~2 programs per SM (the fp32 compressor
    projections at batch 64 -- [64, 4096] x [1024, 4096] -- would be 16 programs streaming 1 MB each, far
    too few to fill the GPU; the same fixed-order partial reduction as the GEMV). Every M > 16, and
    decode-sized M when the dot runs in x's 16-bit dtype (`_native`): there the tensor-core dot streams the
    weight like the FP8 decode GEMM, where the FMA GEMV's per-step reduction bound it at several times the
    bytes' floor."""
    M, K = x2.shape
    N = w.size(0)
    BM, BN, BK, nw, stages = _tile_config(M, N, K)
    tiles = cdiv(M, BM) * cdiv(N, BN)
    per, ns = split_k(cdiv(K, BK), tiles, 2 * sms(x2.device))
    grid = (cdiv(M, BM), cdiv(N, BN), ns)
    native = _native(x2, w, y)
    ws, cnt = split_buffers(y, ns, tiles)
    _linear_kernel[grid](x2, w, y, ws, cnt, M, N, K, per * BK, BM=BM, BN=BN, BK=BK, F32=not native,
                         X_TF32=tf32_exact(x2), W_TF32=tf32_exact(w), DIRECT=ns == 1,
                         num_warps=nw, num_stages=stages, **pdl())


def _tile_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) of the tiled path. Prefill-sized M (>= 1024) takes 128-row
    tiles, faster than 64-row ones for the fp32 tf32x3 projections; 128 x 128 tiles, BK 64 or 8 warps are no
    better (docs/perf-log.md, "Prefill: pre-converted expert input, 64-head attention tiles, the non-GEMM
    kernels")."""
    if M >= 1024:
        return 128, 64, 32, 4, 3
    if M <= 16:  # decode: weight streaming, the FP8 decode GEMM's tile (BK 128: 256-byte bf16 row segments)
        return 16, 64, 128, 4, 3
    return (32 if M <= 32 else 64), 64, 32, 4, 3


def _head_form(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> bool:
    """The LM head's kernel (`_linear_x3_kernel`): bf16 W into fp32 y, from fp32 x at every M (at M = 1 the
    FMA GEMV streamed V4's 1 GB head at a fraction of the copy rate; the x3 kernel's 128-row tiles stream it
    at the copy rate), or from bf16 x (the head without an x.float() copy) once its 128-row tiles fill the
    GPU without a K split."""
    if w.dtype != torch.bfloat16 or y.dtype != torch.float32:
        return False
    if x2.dtype == torch.float32:
        return True
    return x2.dtype == torch.bfloat16 and cdiv(w.size(0), 128) >= 2 * sms(x2.device)


@implement("linear", "triton")
def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype not in (None, x.dtype, torch.float32):
        x = x.to(out_dtype)  # y = x.to(out) W.to(out)ᵀ; only fp32 y from 16-bit x skips the copy
    shape = x.shape
    K = shape[-1]
    N = w.size(0)
    x2 = x.reshape(-1, K).contiguous()
    w = w.contiguous()  # kept in its own dtype: each kernel casts tiles as the reference's w.to(x.dtype)
    M = x2.size(0)
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M and N:
        if _head_form(x2, w, y):
            BM = 16 if M <= 16 else (32 if M <= 32 else 64)
            # bf16 x (the head as the model calls it): 128-deep K steps, 4 stages -- faster than 64-deep / 3
            # stages at M 1-64, at the copy rate at M 1 (docs/perf-log.md, "Fewer decode launches, FP8 `wo_a`,
            # LM head tiles"); fp32 x keeps 64-deep steps, 3 stages (its x tile is twice the bytes: at 64 rows
            # a 128-deep stage is 64 KB, so 4 stages exceed the 228 KB of shared memory -- not measured)
            BN, BK, ns = (128, 128, 4) if x2.dtype == torch.bfloat16 else (128, 64, 3)
            _linear_x3_kernel[(cdiv(N, BN), cdiv(M, BM))](
                x2, w, y, M, N, K, BM=BM, BN=BN, BK=BK, DOT_BF16=not _INTERPRET,
                X_BF16=x2.dtype == torch.bfloat16, num_warps=4, num_stages=ns, **pdl())
        elif M <= GEMV_MAX_M and (not _native(x2, w, y) or (_INTERPRET and x2.dtype == torch.bfloat16)):
            _gemv(x2, w, y)  # (the interpreter's bf16 dot is wrong: bf16 decode rows take the FMA GEMV there)
        else:
            _tiled(x2, w, y)
    return y.view(*shape[:-1], N)
