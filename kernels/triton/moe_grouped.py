"""Grouped (per-row expert) GEMM for the routed experts: C[p] = A[p] · W[e[p]]ᵀ, host-sync free.

vLLM-style layout: `moe_align` (torch) / `_align_kernel` (one Triton program, decode sizes) sort the P (token, expert) rows by expert with plain torch ops and
pads each expert's run to a multiple of BM rows, so every block of BM sorted rows belongs to one
expert. The kernel grid is (max blocks, cdiv(N, BN)) -- a function of (P, E, N) only, never of the
routing -- and each program loads its block's expert id (unused blocks: -1, return at once), gathers
its A rows, streams that expert's W tiles over K once for the whole block (fp32 accumulate) and
scatters the results to the rows' original positions. Rows with e = -1 belong to no block and keep
the zeros the output is allocated with. Nothing calls .item()/.tolist()/nonzero/unique, so a decode
step that routes through here can be captured in a CUDA graph.

Numerics per weight format (same as `gemm.py` / `linear.py`, whose references the op's reference loops):
  fp8   e4m3 x e4m3 dots over K blocks of 128, times the row's A scale and the 128x128 W block scale;
  fp4   e2m1 decoded in-kernel to e4m3 by bit arithmetic (exact), one A scale per 128 K, and four dots of K = 32 per
        128-K step, each times its per-32 W scale (scales are powers of two: exact in any order);
  float plain dot in A's dtype (W cast to it, as the reference's F.linear), input_precision="ieee" for
        fp32 (TF32 would cost ~1e-3).
FP8 dots pass max_num_imprecise_acc=0 (Hopper's FP8 wgmma otherwise keeps ~14 accumulator bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement



# ------------------------------------------------------------------------------------- row alignment
def align_max_blocks(P: int, E: int, block_m: int) -> int:
    """Upper bound on the blocks `moe_align` can use: Σ_e ceil(c_e / BM) with Σ c_e <= P and at most
    min(E, P) experts present is <= floor(P / BM) + min(E, P); each used block holds >= 1 row, so <= P."""
    return min(P, P // block_m + min(E, P))


def moe_align(e: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort rows by expert into blocks of `block_m`, without a host sync and with fixed output shapes.

    e [P] int (local expert ids; anything outside [0, n_experts) -- e.g. -1 -- is dropped) ->
    (sorted_rows [nb * block_m] int64, block_expert [nb] int64) with nb = align_max_blocks(P, E, BM).
    Block b covers sorted_rows[b*BM : (b+1)*BM]: rows of expert block_expert[b] in increasing row order
    (stable), padded with the value P; experts occupy consecutive blocks in id order; blocks past the
    last used one have block_expert -1 and rows P. Every row with a valid id appears exactly once.
    Pure torch (stable argsort, scatter_add counts, cumsum, searchsorted): usable by any backend.
    """
    P, E, BM = e.numel(), int(n_experts), int(block_m)
    dev = e.device
    nb = align_max_blocks(P, E, BM)
    e = e.reshape(-1).long()
    key = torch.where((e >= 0) & (e < E), e, torch.full_like(e, E))  # dropped rows sort last, bucket E
    order = torch.argsort(key, stable=True)
    skey = key[order]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    blocks = (counts + BM - 1) // BM
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    row_start = torch.cumsum(counts, 0) - counts
    k = skey.clamp(max=E - 1)
    pos = blk_start[k] * BM + (torch.arange(P, device=dev) - row_start[k])
    pos = torch.where(skey < E, pos, torch.full_like(pos, nb * BM))  # dropped rows -> a dump slot
    sorted_rows = torch.full((nb * BM + 1,), P, dtype=torch.int64, device=dev).scatter_(0, pos, order)[:-1]
    block_expert = torch.searchsorted(blk_end, torch.arange(nb, device=dev, dtype=torch.int64), right=True)
    block_expert = torch.where(block_expert < E, block_expert, torch.full_like(block_expert, -1))
    return sorted_rows, block_expert


@triton.jit
def _align_kernel(e_ptr, rows_ptr, bexp_ptr, rank_ptr, P, E, NB,
                  BM: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """`moe_align` in ONE program (decode sizes): the same layout, 2 launches instead of ~35 torch ops.

    Pass 1, chunks of BP rows: a row's rank in its expert = rows of that expert in earlier chunks (the
    running per-expert counts) + earlier rows of this chunk (a BP x BP comparison) -> scratch. Then the
    block offsets (cumsum of ceil(count / BM)); pass 2 scatters each row to start * BM + rank; last,
    block b's expert = #experts whose blocks end at or before b (>= E: unused, -1). rows_ptr comes
    prefilled with P.
    """
    i = tl.arange(0, BP)
    xs = tl.arange(0, BE)
    counts = tl.zeros([BE], tl.int32)
    for p0 in range(0, P, BP):
        p = p0 + i
        ev = tl.load(e_ptr + p, mask=p < P, other=-1)
        ev = tl.where((ev >= 0) & (ev < E), ev, -1).to(tl.int32)
        before = (ev[:, None] == ev[None, :]) & (i[None, :] < i[:, None])
        onehot = ev[:, None] == xs[None, :]
        rank = tl.sum(tl.where(onehot, counts[None, :], 0), 1) + tl.sum(before.to(tl.int32), 1)
        tl.store(rank_ptr + p, rank, mask=p < P)
        counts += tl.sum(onehot.to(tl.int32), 0)
    nblk = (counts + BM - 1) // BM
    blk_end = tl.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    for p0 in range(0, P, BP):
        p = p0 + i
        ev = tl.load(e_ptr + p, mask=p < P, other=-1)
        ok = (ev >= 0) & (ev < E) & (p < P)
        ev = tl.where(ok, ev, -1).to(tl.int32)
        rank = tl.load(rank_ptr + p, mask=ok, other=0)
        start = tl.sum(tl.where(ev[:, None] == xs[None, :], blk_start[None, :], 0), 1)
        tl.store(rows_ptr + (start * BM + rank).to(tl.int64), p.to(tl.int64), mask=ok)
    for b0 in range(0, NB, BP):
        b = b0 + i
        x = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), 1)
        tl.store(bexp_ptr + b, tl.where(x < E, x, -1).to(tl.int64), mask=b < NB)


ALIGN_KERNEL_MAX_P = 4096
"""Up to this many rows (decode) `align` runs the one-program kernel; above (prefill) the torch form,
whose ~35 launches are small next to the GEMMs there and which scales where one program would not."""


def align(e: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align`'s layout; the choice of implementation depends on the sizes only."""
    P, E = e.numel(), int(n_experts)
    if P > ALIGN_KERNEL_MAX_P or E > 1024 or P == 0:
        return moe_align(e, E, block_m)
    nb = align_max_blocks(P, E, block_m)
    rows = torch.full((nb * block_m,), P, dtype=torch.int64, device=e.device)
    bexp = torch.empty(nb, dtype=torch.int64, device=e.device)
    rank = torch.empty(P, dtype=torch.int32, device=e.device)
    BE = max(16, triton.next_power_of_2(E))
    BP = max(16, min(64, 16384 // BE))
    _align_kernel[(1,)](e.reshape(-1).long().contiguous(), rows, bexp, rank, P, E, nb,
                        BM=block_m, BP=BP, BE=BE, num_warps=8)
    return rows, bexp


def _block_m(P: int, E: int) -> int:
    """Rows per block from the average rows per expert (decode: ~1-3 -> 16, the smallest tl.dot M)."""
    avg = P / max(E, 1)
    return 16 if avg <= 16 else (32 if avg <= 48 else 64)


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _e2m1_to_e4m3(code):
    """4-bit e2m1 codes (int32, 0..15) -> the same values as float8e4nv, by bits (exact, no float math).

    Magnitude m = code & 7 is 0, 0.5, 1, 1.5, 2, 3, 4, 6; for m >= 2 the e4m3 bits are (m << 2) + 0x30
    (exponent (m >> 1) + 6, mantissa bit m & 1 at the top), 0.5 is 0x30, 0 is 0; bit 3 -> bit 7.
    """
    m = code & 7
    bits = tl.where(m >= 2, (m << 2) + 0x30, tl.where(m == 1, 0x30, 0)) | ((code & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _gg_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K, KS_A, NS_W, KS_W,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # BK == 128 and BN divides 128: one A scale per (row, K block), one W scale per (N tile, K block)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if ex < 0:
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mr = rows < P
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mn = rn < N
    rk = tl.arange(0, BK)
    w_base = w_ptr + ex * N * K
    ws_base = ws_ptr + ex * NS_W * KS_W + ((pid_n * BN) // 128) * KS_W
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k = kb * BK + rk
        mk = k < K
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_base + rn[None, :] * K + k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
        sa = tl.load(as_ptr + rows * KS_A + kb, mask=mr, other=0.0)
        sw = tl.load(ws_base + kb)
        acc += tl.dot(a, w, max_num_imprecise_acc=0) * (sa[:, None] * sw)
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mr[:, None] & mn[None, :])


@triton.jit
def _gg_fp4_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K, KS_A, KS_W,
                   BM: tl.constexpr, BN: tl.constexpr):
    # One step = 128 K = one A scale = 4 W scale groups of 32 = 64 packed bytes per W row, taken as four
    # K = 32 dots (byte i: element 2i low nibble, 2i+1 high). As in gemm.py, lane j < 16 of a group is
    # element 2j (low nibble of byte j) and lane j >= 16 element 2(j-16)+1 (high nibble of byte j-16):
    # A is loaded in that permuted column order, so no interleave is needed.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if ex < 0:
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mr = rows < P
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mn = rn < N
    j = tl.arange(0, 32)
    jb = j % 16
    hi = j >= 16
    acol = 2 * jb + hi.to(tl.int32)
    KH = K // 2
    w_base = w_ptr + ex * N * KH
    ws_base = ws_ptr + ex * N * KS_W
    acc = tl.zeros([BM, BN], tl.float32)
    for kc in range(0, tl.cdiv(K, 128)):
        part = tl.zeros([BM, BN], tl.float32)
        for g in tl.static_range(4):
            ka = kc * 128 + g * 32 + acol
            kb = kc * 64 + g * 16 + jb
            a = tl.load(a_ptr + rows[:, None] * K + ka[None, :], mask=mr[:, None] & (ka[None, :] < K), other=0.0)
            byte = tl.load(w_base + rn[None, :] * KH + kb[:, None], mask=mn[None, :] & (kb[:, None] < KH), other=0)
            byte = byte.to(tl.int32) & 0xFF
            code = tl.where(hi[:, None], byte >> 4, byte & 0xF)
            w = _e2m1_to_e4m3(code)
            gi = kc * 4 + g + tl.zeros([BN], tl.int32)  # scale group (vector: a scalar mask operand trips the interpreter)
            sw = tl.load(ws_base + rn * KS_W + gi, mask=mn & (gi < KS_W), other=0.0)
            part += tl.dot(a, w, max_num_imprecise_acc=0) * sw[None, :]
        sa = tl.load(as_ptr + rows * KS_A + kc, mask=mr, other=0.0)
        acc += part * sa[:, None]
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mr[:, None] & mn[None, :])


@triton.jit
def _gg_float_kernel(a_ptr, w_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if ex < 0:
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    mr = rows < P
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mn = rn < N
    rk = tl.arange(0, BK)
    w_base = w_ptr + ex * N * K
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        mk = k < K
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_base + rn[None, :] * K + k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
        w = w.to(a_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    # the reference's F.linear rounds to A's dtype before the cast to out_dtype
    y = acc.to(a_ptr.dtype.element_ty).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], y, mask=mr[:, None] & mn[None, :])


@implement("grouped_gemm", "triton")
def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                 w_s: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    P, K = a.shape
    E, N = w.size(0), w.size(1)
    c = torch.zeros(P, N, dtype=out_dtype, device=a.device)  # rows with e = -1 stay 0
    if P == 0 or N == 0 or E == 0:
        return c
    BM = _block_m(P, E)
    rows, bexp = align(e, E, BM)
    nb = bexp.numel()
    a = a.contiguous()
    w = w.contiguous()
    if w.dtype == torch.float8_e4m3fn:
        assert a.dtype == torch.float8_e4m3fn and w.size(2) == K, "grouped_gemm fp8: a [P, K] fp8, w [E, N, K]"
        a_s, w_s = a_s.float().contiguous(), w_s.float().contiguous()
        BN = 64 if N <= 64 else 128
        _gg_fp8_kernel[(nb, triton.cdiv(N, BN))](
            a, a_s, w, w_s, c, rows, bexp, P, N, K, a_s.size(1), w_s.size(1), w_s.size(2), BM=BM, BN=BN, BK=128)
    elif w.dtype in (torch.int8, torch.uint8):
        assert a.dtype == torch.float8_e4m3fn and K % 32 == 0 and w.size(2) * 2 == K, \
            "grouped_gemm fp4: a [P, K] fp8 with K % 32 == 0, w [E, N, K/2]"
        a_s, w_s = a_s.float().contiguous(), w_s.float().contiguous()
        BN = 64 if N <= 64 else 128
        _gg_fp4_kernel[(nb, triton.cdiv(N, BN))](
            a, a_s, w.view(torch.uint8), w_s, c, rows, bexp, P, N, K, a_s.size(1), w_s.size(2), BM=BM, BN=BN)
    else:
        assert w.size(2) == K, "grouped_gemm float: w [E, N, K]"
        BN, BK = 64, 64 if a.dtype != torch.float32 else 32
        _gg_float_kernel[(nb, triton.cdiv(N, BN))](
            a, w, c, rows, bexp, P, N, K, BM=BM, BN=BN, BK=BK, IEEE=a.dtype == torch.float32)
    return c
