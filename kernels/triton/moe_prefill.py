"""Prefill path of the grouped expert GEMM: FP4 -> FP8 upcast, then a TMA FP8 grouped GEMM (Hopper path).

At prefill every expert sees tens to hundreds of rows (4096 tokens x top-6 over 256 experts: ~96), so the
GEMMs are compute-bound and the in-loop FP4 decode of `_gg_fp4_kernel` (bf16 MMA, ~64 TFLOP/s on the
H200) is the bottleneck. Here the weights are decoded once, by a streaming kernel, into FP8 scratch:

  upcast   each weight row's 128-K block: 4 groups of 32 e2m1 codes with ue8m0 scales 2^(e_g-127). With
           S = max e_g over the block's nonzero scales, the FP8 value is e2m1 x 2^(e_g - S + 6) and the
           row's block scale 2^(S - 133). e2m1 has 2 significant bits and e4m3 keeps 3 down to its
           subnormal floor 2^-9, so this is exact iff S - e_g <= 14 for every group (e2m1's 0.5 at
           shift -8 is 2^-9; its 6 at shift +6 is 384 <= 448). A block beyond that spread sets a flag;
           the call then runs the bf16 kernel instead (one host read per call, prefill only: never in a
           captured decode graph), so results are exact for every scale pattern.
  gemm     `_gg_fp8_tma_kernel`: the aligned row blocks of `moe_align`, A rows gathered by pointer, the
           expert's W tiles through one TMA descriptor over the [E*N, K] scratch, one fp32 promotion
           per 128-K block (max_num_imprecise_acc = 128, DeepGEMM's scheme; see gemm.py), times the A
           row scale and the W row (upcast) or 128x128 block (fp8 checkpoint) scale.

Scratch is bounded: experts are upcast in chunks of at most SCRATCH_BYTES (1 GiB: 64 flash w1|w3
experts), each chunk followed by the GEMM programs of its experts (the others return at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import e2m1_x2p14, tma_ok

SCRATCH_BYTES = 1 << 30
MAX_SPREAD = 14  # largest exact S - e_g (see the module docstring)


@triton.jit
def _fp4_upcast_kernel(w_ptr, ws_ptr, used_ptr, out_ptr, os_ptr, bad_ptr, E0, ROWS, N, K, KS_W,
                       BR: tl.constexpr, SCALE_E8M0: tl.constexpr):
    """Rows [pid*BR, +BR) of experts E0.. (local row r = (expert - E0) * N + n), every 128-K block in turn:
    one program streams BR whole weight rows (a [BR, 128-K] tile per program was ~500k tiny programs)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    mr = r < ROWS
    used = tl.load(used_ptr + E0 + r // N, mask=mr, other=0)
    mr = mr & (used != 0)
    g = (E0 * N + r).to(tl.int64)  # global weight row
    rl = r.to(tl.int64)
    KH = K // 2
    NKB = tl.cdiv(K, 128)
    bad = tl.zeros([BR], tl.int1)
    for kb in range(0, NKB):
        jb = kb * 64 + tl.arange(0, 64)
        byte = tl.load(w_ptr + g[:, None] * KH + jb[None, :], mask=mr[:, None] & (jb[None, :] < KH), other=0)
        byte = byte.to(tl.int32) & 0xFF
        gi = kb * 4 + tl.arange(0, 4)
        sw = tl.load(ws_ptr + g[:, None] * KS_W + gi[None, :], mask=mr[:, None] & (gi[None, :] < K // 32), other=0)
        if SCALE_E8M0:
            ex = sw.to(tl.int32) & 0xFF
        else:
            ex = (sw.to(tl.int32, bitcast=True) >> 23) & 0xFF
        S = tl.max(ex, 1)  # [BR]
        lo_ex = tl.min(tl.where(ex != 0, ex, 255), 1)
        bad = bad | (mr & (S - lo_ex > 14) & (lo_ex != 255))
        bad = bad | (mr & (S != 0) & (S <= 6))  # block scale 2^(S-133) would be subnormal
        # per-group multiplier 2^(e_g - S + 6 + 14) on top of e2m1_x2p14's 2^-14 (0 for a zero scale)
        sh = tl.minimum(tl.maximum(ex - S[:, None] + 6 + 14 + 127, 1), 254)
        mult = tl.where(ex != 0, (sh << 23).to(tl.float32, bitcast=True), 0.0)  # [BR, 4]
        lo = tl.reshape(tl.reshape(e2m1_x2p14(byte & 0xF), [BR, 4, 16]) * mult[:, :, None], [BR, 64])
        hi = tl.reshape(tl.reshape(e2m1_x2p14(byte >> 4), [BR, 4, 16]) * mult[:, :, None], [BR, 64])
        w8 = tl.reshape(tl.join(lo, hi), [BR, 128]).to(tl.float8e4nv)  # natural K order, exact
        k = kb * 128 + tl.arange(0, 128)
        tl.store(out_ptr + rl[:, None] * K + k[None, :], w8, mask=mr[:, None] & (k[None, :] < K))
        s_bits = tl.minimum(tl.maximum(S - 6, 1), 254)
        s = tl.where(S != 0, (s_bits << 23).to(tl.float32, bitcast=True), 0.0)
        tl.store(os_ptr + rl * NKB + kb, s, mask=mr)
    tl.atomic_max(bad_ptr + tl.arange(0, BR) * 0, bad.to(tl.int32), mask=bad)


@triton.jit
def _gg_fp8_tma_kernel(a_ptr, as_ptr, w_desc, ws_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K, KS_A, KS_W, NS_W,
                       E0, E1, BM: tl.constexpr, BN: tl.constexpr, ROW_SCALE: tl.constexpr):
    """N tile pid0 x block pid1 (one expert's BM sorted rows), for the experts E0 <= e < E1 whose weights
    the descriptor holds as rows (e - E0) * N + n. ROW_SCALE: ws [rows, K/128] (upcast); else the fp8
    checkpoint's [E, N/128, K/128] block scales."""
    # N tiles vary fastest: consecutive programs reuse the block's gathered A rows from L2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if (ex < E0) | (ex >= E1):
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mr = rows < P
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mn = rn < N
    rk = tl.arange(0, 128)
    wrow = (ex - E0) * N + pid_n * BN
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        k = kb * 128 + rk
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=mr[:, None] & (k[None, :] < K), other=0.0)
        w = w_desc.load([wrow.to(tl.int32), kb * 128])
        sa = tl.load(as_ptr + rows * KS_A + kb, mask=mr, other=0.0)
        if ROW_SCALE:
            sw = tl.load(ws_ptr + ((ex - E0) * N + rn) * KS_W + kb, mask=mn, other=0.0)
        else:
            sw = tl.load(ws_ptr + (ex * NS_W + rn // 128) * KS_W + kb, mask=mn, other=0.0)
        acc += tl.dot(a, w.T, max_num_imprecise_acc=128) * (sa[:, None] * sw[None, :])
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mr[:, None] & mn[None, :])


def usable(a: torch.Tensor, w: torch.Tensor, BM: int) -> bool:
    """Prefill-sized blocks (BM >= 64) on a GPU with TMA (or the interpreter), N a multiple of the 128-row
    W tile (a tile never reaches into the next expert), K a multiple of 128, W 16-byte aligned (a TMA
    descriptor's base; the upcast scratch always is)."""
    N = w.size(1)
    K = a.size(1)
    if BM < 64 or N % 128 or K % 128 or w.data_ptr() % 16:
        return False
    return tma_ok(a)


def _gemm(a, a_s, w2d, ws, c, rows, bexp, P, N, K, NS_W, E0, E1, BM, row_scale):
    wd = TensorDescriptor.from_tensor(w2d, [128, 128])
    _gg_fp8_tma_kernel[(triton.cdiv(N, 128), bexp.numel())](
        a, a_s, wd, ws, c, rows, bexp, P, N, K, a_s.size(1), ws.size(-1), NS_W, E0, E1,
        BM=BM, BN=128, ROW_SCALE=row_scale, num_warps=8, num_stages=4)


def fp8_grouped(a, a_s, w, w_s, c, rows, bexp, BM):
    """fp8 checkpoint experts w [E, N, K] with [E, N/128, K/128] block scales."""
    E, N, K = w.shape
    _gemm(a, a_s, w.view(E * N, K), w_s, c, rows, bexp, a.size(0), N, K, w_s.size(1), 0, E, BM, False)
    return c


def fp4_upcast_grouped(a, a_s, w, w_s, e8m0, c, rows, bexp, BM) -> bool:
    """FP4 experts w [E, N, K/2] uint8 + w_s [E, N, K/32]: upcast in expert chunks, GEMM per chunk.
    Returns False (c then partly written: the caller recomputes it) when some block's scale spread makes
    the upcast inexact."""
    E, N, KH = w.shape
    K = 2 * KH
    P = a.size(0)
    used = torch.zeros(E + 1, dtype=torch.int32, device=a.device)  # unused blocks (-1) mark slot E
    used.scatter_(0, torch.where(bexp >= 0, bexp, E), 1)
    chunk = max(1, min(E, SCRATCH_BYTES // max(1, N * K)))
    w8 = torch.empty(chunk * N, K, dtype=torch.float8_e4m3fn, device=a.device)
    s8 = torch.empty(chunk * N, K // 128, dtype=torch.float32, device=a.device)
    bad = torch.zeros(1, dtype=torch.int32, device=a.device)
    wu, wsu = w.view(E * N, KH), w_s.view(E * N, -1)
    BR = 32
    for e0 in range(0, E, chunk):
        rows_here = min(chunk, E - e0) * N
        _fp4_upcast_kernel[(triton.cdiv(rows_here, BR),)](
            wu, wsu, used, w8, s8, bad, e0, rows_here, N, K, wsu.size(1), BR=BR, SCALE_E8M0=e8m0, num_warps=4)
        _gemm(a, a_s, w8, s8, c, rows, bexp, P, N, K, 0, e0, min(E, e0 + chunk), BM, True)
    return not bool(bad.item())  # prefill only: one host read per call

