"""Plain y = x Wᵀ (bf16 / fp16 / fp32 weights, no quantisation) in Triton.

The model calls it for the float weights of the official layout (indexer weights_proj [64, 4096],
compressor wkv / wgate [1024, 4096], all fp32) and for every weight in `exact` numerics.

Two paths, chosen from shapes only (CUDA-graph capturable, no host syncs):

* M <= 16 (decode): split-K GEMV. Grid (cdiv(N, BN), nsplit); a program owns BN weight rows and one
  K chunk of `per` x BK columns and does fp32 FMA products reduced with tl.sum (exact fp32 products,
  no tensor cores, no TF32). The program tile is BM x BN x BK <= 8192 (BM = p2(M) >= 2, BK = 128 so one
  fp32 weight row segment is 512 contiguous bytes); nsplit is chosen so that N tiles x splits ~ 2 x SMs
  (the [1024, 4096] fp32 weight at M = 1: 32 N tiles x 16 splits = 512 programs of 32 KB each instead
  of 16 programs streaming 1 MB). Partials go to a fp32 [nsplit, M, N] workspace (torch.empty) and a
  second kernel sums them in a fixed order (one [BS, BLOCK] tile + tl.sum: deterministic, no atomics);
  with a single split the GEMV kernel stores y directly.
* M > 16: tiled tl.dot GEMM (BM x 64 x 32 tiles, fp32 accumulate); fp32 operands use 3xTF32
  ("tf32x3": ~2^-22 relative per product, fp32-accurate within the registry's float32 tolerance and far
  faster than "ieee" FMA dot emulation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import dot_ieee, p2, sms, split_k


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="tf32x3")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _linear_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, KCH, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, DIRECT: tl.constexpr):
    """out[s, m, n] = sum over k in split s of x[m, k] * w[n, k] (fp32 FMA); DIRECT: out is y itself."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, BM).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mm = rm < M
    mn = rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    k_lo = pid_s * KCH
    for k0 in range(k_lo, k_lo + KCH, BK):
        k = (k0 + tl.arange(0, BK)).to(tl.int64)
        mk = k < K
        x = tl.load(x_ptr + rm[:, None] * K + k[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=mn[:, None] & mk[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    if DIRECT:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mm[:, None] & mn[None, :])
    else:
        tl.store(out_ptr + (pid_s * M + rm[:, None]) * N + rn[None, :], acc, mask=mm[:, None] & mn[None, :])


@triton.jit
def _splitk_reduce_kernel(ws_ptr, y_ptr, MN, NS, BS: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum_s ws[s, i] for the flat [NS, MN] fp32 workspace, in a fixed order."""
    o = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mo = o < MN
    s = tl.arange(0, BS)
    acc = tl.zeros([BS, BLOCK], tl.float32)
    for s0 in range(0, NS, BS):
        ss = (s0 + s).to(tl.int64)
        acc += tl.load(ws_ptr + ss[:, None] * MN + o[None, :], mask=(ss[:, None] < NS) & mo[None, :], other=0.0)
    tl.store(y_ptr + o, tl.sum(acc, 0).to(y_ptr.dtype.element_ty), mask=mo)


GEMV_MAX_M = 16


def _gemv(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    M, K = x2.shape
    N = w.size(0)
    BM = max(2, p2(M))
    BK = max(16, min(p2(K), 128))
    BN = max(2, min(p2(N), 8192 // (BM * BK)))
    n_tiles = triton.cdiv(N, BN)
    per, ns = split_k(triton.cdiv(K, BK), n_tiles, 2 * sms(x2.device))
    if ns == 1:
        _linear_gemv_kernel[(n_tiles, 1)](x2, w, y, M, N, K, per * BK, BM=BM, BN=BN, BK=BK, DIRECT=True)
        return
    ws = torch.empty(ns, M, N, dtype=torch.float32, device=x2.device)
    _linear_gemv_kernel[(n_tiles, ns)](x2, w, ws, M, N, K, per * BK, BM=BM, BN=BN, BK=BK, DIRECT=False)
    BS = min(p2(ns), 32)
    BLOCK = max(16, min(p2(M * N), 4096 // BS))
    _splitk_reduce_kernel[(triton.cdiv(M * N, BLOCK),)](ws, y, M * N, ns, BS=BS, BLOCK=BLOCK)


@implement("linear", "triton")
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    K = shape[-1]
    N = w.size(0)
    x2 = x.reshape(-1, K).contiguous()
    w = w.to(x.dtype).contiguous()
    M = x2.size(0)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        if M <= GEMV_MAX_M:
            _gemv(x2, w, y)
        else:
            BM = 32 if M <= 32 else 64
            BN, BK = 64, 32
            _linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](x2, w, y, M, N, K, BM=BM, BN=BN, BK=BK,
                                                                     IEEE=dot_ieee(x2, w))
    return y.view(*shape[:-1], N)
