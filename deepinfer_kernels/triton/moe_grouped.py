"""Grouped (per-row expert) GEMM for the routed experts: C[p] = A[p] · W[e[p]]ᵀ, host-sync free.

vLLM-style layout: `moe_align` (torch ops) or, at decode sizes, `_align_count_kernel` + `_align_scatter_kernel`
(the same layout in two chunk-parallel launches) sort the P (token, expert) rows by expert and pad each
expert's run to a multiple of BM rows, so every block of BM sorted rows belongs to one expert. The
kernel grid is (max blocks, cdiv(N, BN)[, K splits]) -- a function of (P, E, N, K) only, never of the
routing -- and each program loads its block's expert id (unused blocks: -1, return at once), gathers
its A rows, streams that expert's W tiles over K once for the whole block (fp32 accumulate) and
scatters the results to the rows' original positions. Rows with e = -1 belong to no block; one small
launch zeroes just those rows (`_zero_dead_rows`; IDENT launches, below, store them as 0 themselves), so
the output is never zero-filled whole. Nothing calls .item()/.tolist()/nonzero/unique, so a decode
step that routes through here can be captured in a CUDA graph. FP4 or FP8 with at most `IDENT_MAX_P` rows (one
token's top-k) skips the sort: block p is row p.

Numerics per weight format (same as `gemm.py` / `linear.py`, whose references the op's reference loops):
  fp8   e4m3 x e4m3 dots over K blocks of 128, times the row's A scale and the 128x128 W block scale;
  fp4   computed transposed (C^T = W . A^T: the decoded weight tile is the MMA's M side, the block's
        tokens its N side). 64 packed bytes per weight row per 128-K step, both nibbles decoded, the
        per-32 power-of-two scales (f32, or raw ue8m0 bytes: a quarter of the scale traffic) multiplied
        in, A pre-scaled by its per-128 power-of-two scale, two bf16 dots per step (the low / high
        nibbles against A's even / odd columns: no interleave), the nibble decode on sm_90 PTX bit placement
        (`_ASM_DECODE`: 4 values per ~7 integer instructions and 4 bf16x2 multiplies;
        `DEEPINFER_FP4_ASM=0`: the Triton-expression decode). The kernel is bound by these per-element
        instructions: against a byte-permute table lookup (~5 instructions per value) the per-step loop
        at decode tiles is 594 SASS instructions instead of 965 (offline sm_90 compile; unmasked loads
        for whole tiles give 66 of that), and it runs markedly faster at every size from batch 1 to a
        1024-token prefill (docs/perf-log.md, "Bit-placement FP4 decode, fewer decode launches, parallel
        routing sort").
        When every group scale of the weight is <= 2 (trained weights; checked once per scale tensor,
        `_scales_fold`) the decode multiplies once, by scale x 2^126 (`_ASM_DECODE_FOLDED`): 594 -> 546
        SASS per decode-tile step, but only a few percent faster at small batches and none at batch 32-64 --
        the loop is bound by the integer pipe (LOP3 / SHF / PRMT / LEA, half the FP pipe's rate), and the
        multiplies run on the FP pipe.
        Decode-sized blocks split K over a third grid axis (fp32 partials; the tile's last split
        sums them in split order, `splitk_store`).
        Why in-kernel FP4 -> bf16 and not the Hopper FP4 -> FP8 upcast (a per-row-per-128 power-of-two
        rescale, then FP8 MMA): the bf16 form is lossless for *every* scale pattern (e2m1 x 2^e has 2
        significant bits, bf16 the full fp32 exponent range), while the FP8 rescale stays exact only
        while a 128-K block's four group scales lie within 2^14 of each other and needs a second path
        beyond; and it is slower. Upcast once per call into FP8 scratch for a TMA FP8 grouped GEMM, the
        flash w1|w3 [256 x 4096, 4096] prefill is slower than the bf16 form at every prompt length measured:
        the scratch round trip (write 1 B, read 1 B per weight element after reading 0.5 B) costs more than
        the FP8 MMA saves at ~25-100 rows per expert. An FP8 MMA inside this kernel (nibbles -> e4m3 by bit
        placement, one k32 e4m3 dot per scale group, promoted in fp32) is slower at every decode batch (four
        dependent MMA + promotion rounds per 128-K step) and its sums inside the tensor core are not exact
        (docs/perf-log.md, "Transposed FP4 expert GEMM, prefill mHC and RoPE, short-context top-k" and
        "Prefill: pre-converted expert input, 64-head attention tiles, the non-GEMM kernels").
        A comes pre-converted (`a_bf16_split`, A_BF16 below) when K % 128 == 0, at prefill-sized blocks
        (BM >= 64) and, `A_BF16_DECODE`, at decode-sized ones -- or as its producer stored it (`a_split`:
        `swiglu_quant` / `rms_norm_quant` / `hc_pre_quant` with split=True, `_common.store_bf16_split`), with no
        conversion launch.
  float plain dot in A's dtype (W cast to it, as the reference's F.linear), input_precision="ieee" for
        fp32 (TF32 would cost ~1e-3).
FP8 dots pass max_num_imprecise_acc=0 (Hopper's FP8 wgmma otherwise keeps ~14 accumulator bits) at
decode; fp8 experts at prefill sizes (`moe_prefill`) promote once per 128-K block as DeepGEMM does (see
gemm.py).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from deepinfer import settings
from deepinfer.ops.registry import implement
from deepinfer.ops.routing import every_row_local, routing_memo
from deepinfer.settings import fusion  # DEEPINFER_DECODE_FUSIONS, read per call

from . import moe_prefill
from .moe import _TL_DTYPE
from .moe import swiglu_quant as _swiglu_quant
from ._common import cdiv, next_power_of_2
from ._common import e2m1_x2p14, e8m0_f32, pdl, pdl_wait, sm90_nvidia, split_buffers, split_k, splitk_store
from ._common import expert_block_tile, quant_e4m3_rows, store_bf16_split, swiglu_f32, unit_last_stride
from ._common import weight_scale_arg, zero_row_tile
from ._common import sms as _sms
from ._common import INTERPRET as _INTERPRET
from deepinfer.quant.grouped import align_max_blocks, moe_align  # noqa: F401  (the row layout, shared)



# ------------------------------------------------------------------------------------- row alignment
@triton.jit
def _align_count_kernel(e_ptr, cnt_ptr, rank_ptr, rows_ptr, P, E, NR, FILL, BP: tl.constexpr, BE: tl.constexpr,
                        BF: tl.constexpr):
    """`moe_align` in two launches, parallel over chunks of BP rows (decode sizes). This one, chunk c:
    its per-expert row counts -> cnt[c, :], and each row's rank among the chunk's earlier rows of its
    expert (a BP x BP comparison) -> rank; and its FILL entries of rows [NR] set to P (padding), which the
    scatter launch then overwrites with the sorted rows (no fill launch of its own)."""
    pdl_wait()
    c = tl.program_id(0)
    f0 = c.to(tl.int64) * FILL
    for j in range(0, FILL, BF):
        f = f0 + j + tl.arange(0, BF)
        tl.store(rows_ptr + f, tl.zeros([BF], tl.int64) + P, mask=(f < f0 + FILL) & (f < NR))
    i = tl.arange(0, BP)
    xs = tl.arange(0, BE)
    p = c * BP + i
    ev = tl.load(e_ptr + p, mask=p < P, other=-1)
    ev = tl.where((ev >= 0) & (ev < E), ev, -1).to(tl.int32)
    before = (ev[:, None] == ev[None, :]) & (i[None, :] < i[:, None])
    tl.store(rank_ptr + p, tl.sum(before.to(tl.int32), 1), mask=p < P)
    tl.store(cnt_ptr + c * BE + xs, tl.sum((ev[:, None] == xs[None, :]).to(tl.int32), 0))


@triton.jit
def _align_scatter_kernel(e_ptr, cnt_ptr, rank_ptr, rows_ptr, bexp_ptr, P, E, NB, NC,
                          BM: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr):
    """Chunk c again: from every chunk's counts, the experts' totals (-> block offsets, the cumsum of
    ceil(count / BM)) and the rows of each expert in chunks before c; each row goes to its expert's
    start * BM + those earlier rows + its rank (rows_ptr comes filled with P by the count launch). Blocks
    c*BP .. get their expert: #experts whose blocks end at or before the block (>= E: unused, -1)."""
    pdl_wait()
    c = tl.program_id(0)
    xs = tl.arange(0, BE)
    cs = tl.arange(0, BC)
    counts = tl.zeros([BE], tl.int32)
    earlier = tl.zeros([BE], tl.int32)
    for c0 in range(0, NC, BC):
        cc = c0 + cs
        cnt = tl.load(cnt_ptr + cc[:, None] * BE + xs[None, :], mask=cc[:, None] < NC, other=0)
        counts += tl.sum(cnt, 0)
        earlier += tl.sum(tl.where(cc[:, None] < c, cnt, 0), 0)
    nblk = (counts + BM - 1) // BM
    blk_end = tl.cumsum(nblk, 0)
    base = (blk_end - nblk) * BM + earlier
    i = tl.arange(0, BP)
    p = c * BP + i
    ev = tl.load(e_ptr + p, mask=p < P, other=-1)
    ok = (ev >= 0) & (ev < E) & (p < P)
    ev = tl.where(ok, ev, -1).to(tl.int32)
    rank = tl.load(rank_ptr + p, mask=ok, other=0)
    dst = tl.sum(tl.where(ev[:, None] == xs[None, :], base[None, :], 0), 1) + rank
    tl.store(rows_ptr + dst.to(tl.int64), p.to(tl.int64), mask=ok)
    b = c * BP + i  # NB <= P <= NC * BP: the chunks' block ranges cover every block
    x = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), 1)
    tl.store(bexp_ptr + b, tl.where(x < E, x, -1).to(tl.int64), mask=b < NB)


ALIGN_KERNEL_MAX_P = 65536
"""Up to this many rows `align` runs the two chunk-parallel kernels; above, the torch form (~35 launches).
The two launches' time stays nearly flat with the row count, where one program walking the chunks in turn
grows with it and is several times slower from a few hundred rows. They also run at prefill sizes: a
4096-token flash prefill (24576 rows) would issue the torch form's ~35 launches twice per layer, ~280 in all,
and the prefill is host-bound, so every launch saved shortens it (docs/perf-log.md, "Bit-placement FP4 decode,
fewer decode launches, parallel routing sort" and "Decode latency tiles, bf16 compressor weights, 64-row FP8
prefill tiles"). Each scatter program reads every chunk's counts, O(chunks^2 x experts) in all: ~150 MB of L2
reads at 24576 rows, ~1 GB at the limit."""


def align(e: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align`'s layout; the choice of implementation depends on the sizes only."""
    P, E = e.numel(), int(n_experts)
    if P > ALIGN_KERNEL_MAX_P or E > 1024 or P == 0:
        return moe_align(e, E, block_m)
    nb = align_max_blocks(P, E, block_m)
    rows = torch.empty(nb * block_m, dtype=torch.int64, device=e.device)  # padding P: the count launch writes it
    bexp = torch.empty(nb, dtype=torch.int64, device=e.device)
    rank = torch.empty(P, dtype=torch.int32, device=e.device)
    BE = max(16, next_power_of_2(E))
    BP = max(16, min(64, 16384 // BE))
    nc = cdiv(P, BP)
    cnt = torch.empty(nc, BE, dtype=torch.int32, device=e.device)  # every chunk writes its whole row
    e = e.reshape(-1).long().contiguous()
    _align_count_kernel[(nc,)](e, cnt, rank, rows, P, E, rows.numel(), cdiv(rows.numel(), nc), BP=BP, BE=BE,
                               BF=256, num_warps=4, **pdl())
    BC = max(2, min(next_power_of_2(nc), 8192 // BE))
    _align_scatter_kernel[(nc,)](e, cnt, rank, rows, bexp, P, E, nb, nc, BM=block_m, BP=BP, BE=BE, BC=BC,
                                 num_warps=4, **pdl())
    return rows, bexp


IDENT_MAX_P = 8
"""Up to this many (row, expert) pairs the FP4 and FP8 GEMMs run one block per row, unsorted: a decode step at
batch 1 (top-6) saves the align launches (serial, on the critical path); a repeated expert among so few rows
costs at most one extra read of its weights."""


def _block_m(P: int, E: int) -> int:
    """Rows per block from the average rows per expert (decode: ~1-3 -> 16, the smallest tl.dot M)."""
    avg = P / max(E, 1)
    return 16 if avg <= 16 else (32 if avg <= 32 else (64 if avg <= 80 else 128))


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _gg_fp8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K, KS_A, NS_W, KS_W, E,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TOPK: tl.constexpr = 1,
                   IDENT: tl.constexpr = False, A_SWIGLU: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
                   WEIGHT: tl.constexpr = False, Y_DTYPE: tl.constexpr = tl.bfloat16):
    # BK == 128 and BN divides 128: one A scale per (row, K block), one W scale per (N tile, K block);
    # TOPK: pair p reads A's row p // TOPK (a token's row feeds its TOPK pairs). IDENT (a handful of rows, e.g.
    # one token's top-k): block b is row b alone and bexp_ptr is e itself -- no sort, as the FP4 kernel.
    # A_SWIGLU: A is w1|w3's output [P, 2K] and as_ptr the routing weights, as in the FP4 kernel
    # (`_swiglu_quant_a`): each step's e4m3 codes and scales are those `swiglu_quant` would store.
    pdl_wait()
    tl.static_assert(not (A_SWIGLU and (TOPK != 1 or BK != 128)))
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if (ex < 0) | (ex >= E):
        if IDENT:
            zero_row_tile(c_ptr, pid_m, pid_n, N, BN)
        return
    rows, mr, rn, mn = expert_block_tile(rows_ptr, pid_m, pid_n, P, N, BM, BN, IDENT)
    ar = rows // TOPK
    rk = tl.arange(0, BK)
    w_base = w_ptr + ex * N * K
    ws_base = ws_ptr + ex * NS_W * KS_W + ((pid_n * BN) // 128) * KS_W
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k = kb * BK + rk
        mk = k < K
        if A_SWIGLU:  # K % 128 == 0 (the wrapper's condition)
            a, sa = _swiglu_quant_a(a_ptr + ar * 2 * K, as_ptr + ar, k, K, mr, LIMIT, WEIGHT, Y_DTYPE)
            w = tl.load(w_base + rn[None, :] * K + k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
        else:
            a = tl.load(a_ptr + ar[:, None] * K + k[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
            w = tl.load(w_base + rn[None, :] * K + k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
            sa = tl.load(as_ptr + ar * KS_A + kb, mask=mr, other=0.0)
        sw = tl.load(ws_base + kb)
        acc += tl.dot(a, w, max_num_imprecise_acc=0) * (sa[:, None] * sw)
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mr[:, None] & mn[None, :])


# FP4 -> bf16 by bit placement (the Marlin-style trick, made exact for every scale): a nibble s|e1 e0 m put
# at bf16 bit 15 (sign) and bits 8..6 (exponent low bits, mantissa top bit) reads as e2m1 x 2^-126 --
# normal for e > 0, and for e = 0 the bf16 subnormal m x 2^-127 -- so one exact multiply by 2^126 restores
# it. Per 2 packed bytes b0, b1 (4 values; the MMA operand layout holds K pairs, so 2 bytes arrive as one
# 16-bit load): prmt spreads them into the high bytes of the two 16-bit halves, x = [0, b0, 0, b1]; then
# (x << 4 | x >> 2) & 0x81C081C0 is the bf16 pair of the low nibbles (sign at 15, bits 8..6 per half) and
# (h | h >> 6) & 0x81C081C0 with h = x & 0xF000F000 that of the high nibbles. ~1.75 integer instructions
# per value (a byte-permute table lookup takes ~5), then two bf16x2 multiplies, x 2^126 and
# x the group scale, both exact (powers of two; bf16 keeps subnormals). Two multiplies, not one by
# scale x 2^126: that product overflows bf16 for scales above 2.
_BITS_LO = ("prmt.b32 x, $2, 0, 0x1404; "  # [0, b0, 0, b1]
            "shl.b32 y, x, 4; shr.b32 u, x, 2; or.b32 y, y, u; and.b32 y, y, 0x81C081C0; ")  # low nibbles
_BITS_HI = "and.b32 x, x, 0xF000F000; shr.b32 u, x, 6; or.b32 x, x, u; and.b32 x, x, 0x81C081C0; "
_ASM_DECODE = tl.constexpr(
    "{ .reg .b32 x, y, u, k; mov.b32 k, 0x7E807E80; "  # k: 2^126 in both bf16 halves
    + _BITS_LO + "mul.rn.bf16x2 y, y, k; mul.rn.bf16x2 $0, y, $3; "
    + _BITS_HI + "mul.rn.bf16x2 x, x, k; mul.rn.bf16x2 $1, x, $3; }"
)
# Every group scale <= 2 (what trained weights have: |w| <= 6 x scale): scale x 2^126 is itself a bf16
# power of two, so one exact multiply by it replaces the two ($3 holds scale x 2^126): 2 of the 13
# instructions per 4 values, ~11 % of the decode-tile loop (`_scales_fold`).
_ASM_DECODE_FOLDED = tl.constexpr(
    "{ .reg .b32 x, y, u; " + _BITS_LO + "mul.rn.bf16x2 $0, y, $3; " + _BITS_HI + "mul.rn.bf16x2 $1, x, $3; }"
)


@triton.jit
def _fp4_bf16(byte, scale, FOLD: tl.constexpr):
    """uint8 `byte` (two e2m1 nibbles each) -> (low nibbles, high nibbles) as bf16 values times the bf16
    power-of-two `scale` (same shape), 2 bytes per PTX block (`_ASM_DECODE`); sm_90 (mul.bf16x2).
    FOLD: `scale` is the group scale x 2^126 (`_ASM_DECODE_FOLDED`, one multiply).
    The bit logic is checked for all 256 byte values by tests/test_moe_grouped.py (a host model of the
    PTX) and on the GPU by the grouped GEMM tests."""
    return tl.inline_asm_elementwise(
        asm=_ASM_DECODE_FOLDED if FOLD else _ASM_DECODE, constraints="=r,=r,r,r", args=[byte, scale],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _decode_dots(acc, byte, sw, a_e, a_o, GS: tl.constexpr, SCALE_E8M0: tl.constexpr, ASM: tl.constexpr,
                 FOLD: tl.constexpr, DOT_BF16: tl.constexpr, ONE_DOT: tl.constexpr = False):
    """acc [BN, BM] += the weight bytes [BN, 16 GS] (GS 32-groups: byte i = elements 2i, 2i + 1) decoded with their
    group scales sw [BN, GS], against A's even and odd columns a_e, a_o [BM, 16 GS]: two dots chained into acc.
    ONE_DOT: a_e is A's whole [BM, 32 GS] step in its split form (even columns, then odd) and a_o unused; the low
    and high nibbles are joined into one [BN, 32 GS] tile in the same column order, so one dot takes the step: the
    same products summed in the same K order, with no wgmma wait between two dots (`DEEPINFER_FP4_ONE_DOT`)."""
    BN: tl.constexpr = byte.shape[0]
    SW: tl.constexpr = 16 * GS
    if SCALE_E8M0:
        sw = e8m0_f32(sw)
    if ASM:  # packed PTX decode, the scale multiplied in bf16 (exact: powers of two)
        if FOLD:  # every scale <= 2: scale x 2^126 is a bf16 (exact product of powers of two)
            sw = sw * 8.507059173023462e37
        sb = tl.reshape(tl.broadcast_to(sw.to(tl.bfloat16)[:, :, None], [BN, GS, 16]), [BN, SW])
        lo, hi = _fp4_bf16(byte, sb, FOLD)
    else:
        byte = byte.to(tl.int32) & 0xFF
        sw = sw * 16384.0
        lo = tl.reshape(tl.reshape(e2m1_x2p14(byte & 0xF), [BN, GS, 16]) * sw[:, :, None], [BN, SW])
        hi = tl.reshape(tl.reshape(e2m1_x2p14(byte >> 4), [BN, GS, 16]) * sw[:, :, None], [BN, SW])
    if ONE_DOT:  # [BN, SW] x 2 -> [BN, 2 SW]: low nibbles in the first SW columns (registers only: no shuffle)
        acc = _exact_dot(tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BN, 2 * SW]), a_e, acc, DOT_BF16)
    else:
        acc = _exact_dot(lo, a_e, acc, DOT_BF16)
        acc = _exact_dot(hi, a_o, acc, DOT_BF16)
    return acc


@triton.jit
def _exact_dot(w, a, acc, DOT_BF16: tl.constexpr):
    """acc [BN, BM] += w [BN, K] . a [BM, K]ᵀ, every operand exact in bf16: a bf16 dot, or (the interpreter, whose
    bf16 dot is wrong) an fp32 "ieee" one of the same exact products."""
    if DOT_BF16:
        return tl.dot(w.to(tl.bfloat16), tl.trans(a.to(tl.bfloat16)), acc)
    return tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")


@triton.jit
def _a_bf16_split_kernel(a_ptr, as_ptr, o_ptr, P, K, sa_r, ss_r, BR: tl.constexpr):
    """Program (BR rows, one 128-K block): o[r, kb*128 + j] = a[r, kb*128 + 2j] x s[r, kb] for j < 64 and
    a[r, kb*128 + 2(j-64) + 1] x s[r, kb] for j >= 64, in bf16 (exact: e4m3 x 2^k). The FP4 GEMM's
    prefill form reads these even / odd halves as its two dot operands straight into shared memory.
    a and s are read through their row strides sa_r / ss_r: 0 for one token's rows repeated as a view."""
    pdl_wait()
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    kb = tl.program_id(1)
    mr = r < P
    j = tl.arange(0, 128)
    a = tl.load(a_ptr + r[:, None] * sa_r + kb * 128 + j[None, :], mask=mr[:, None], other=0.0)
    s = tl.load(as_ptr + r * ss_r + kb, mask=mr, other=0.0)
    store_bf16_split(o_ptr + r * K + kb * 128, a, s, mr[:, None], 128)


def a_bf16_split(a: torch.Tensor, a_s: torch.Tensor) -> torch.Tensor:
    """a [P, K] e4m3 (K % 128 == 0) with its per-128 scales a_s [P, K/128] f32 -> [P, K] bf16, scaled,
    each 128-K block as its 64 even then its 64 odd columns (`_a_bf16_split_kernel`). Any row strides (a
    token's top-k rows as a stride-0 view are read in place); columns must be unit-stride."""
    P, K = a.shape
    a, a_s = unit_last_stride(a), unit_last_stride(a_s.float())
    o = torch.empty(P, K, dtype=torch.bfloat16, device=a.device)
    if P:
        BR = 32
        _a_bf16_split_kernel[(cdiv(P, BR), K // 128)](a, a_s, o, P, K, a.stride(0), a_s.stride(0), BR=BR,
                                                             num_warps=4, **pdl())
    return o


@triton.jit
def _swiglu_quant_a(h_rows, w_rows, k, K, mr, LIMIT: tl.constexpr, WEIGHT: tl.constexpr, Y_DTYPE: tl.constexpr):
    """One [BM, 128] A step of w2 computed from w1|w3's output: rows h_rows (pointers [BM]: gate at + k, up at
    + K + k), routing weights at w_rows -> (q [BM, 128] e4m3, s [BM]): `swiglu_quant`'s activation, rounding and
    act_quant rule (`swiglu_f32`, `quant_e4m3_rows`), so the same values. Padded rows (mr false) give 0."""
    g = tl.load(h_rows[:, None] + k[None, :], mask=mr[:, None], other=0.0)
    u = tl.load(h_rows[:, None] + K + k[None, :], mask=mr[:, None], other=0.0)
    if WEIGHT:
        wr = tl.load(w_rows, mask=mr, other=0.0)[:, None]
    else:
        wr = 0.0
    y = swiglu_f32(g, u, wr, LIMIT, LIMIT > 0, WEIGHT)
    return quant_e4m3_rows(y.to(Y_DTYPE).to(tl.float32))


@triton.jit
def _swiglu_quant_split(h_rows, w_rows, k, K, mr, LIMIT: tl.constexpr, WEIGHT: tl.constexpr,
                        Y_DTYPE: tl.constexpr):
    """`_swiglu_quant_a` as the FP4 GEMM's operands: q x s (exact in bf16) split into the block's even and odd
    columns, as `store_bf16_split` writes them."""
    q, s = _swiglu_quant_a(h_rows, w_rows, k, K, mr, LIMIT, WEIGHT, Y_DTYPE)
    return tl.split(tl.reshape(q.to(tl.float32) * s[:, None], [q.shape[0], 64, 2]))


@triton.jit
def _gg_fp4_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, p_ptr, cnt_ptr, rows_ptr, bexp_ptr, P, E, N, K, KS_A, KS_W,
                   KB_PER_SPLIT, SA_R, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_BF16: tl.constexpr, SCALE_E8M0: tl.constexpr, ASM: tl.constexpr, IDENT: tl.constexpr,
                   EVEN: tl.constexpr, FOLD: tl.constexpr, A_BF16: tl.constexpr, N_FAST: tl.constexpr,
                   TOPK: tl.constexpr = 1, A_SWIGLU: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
                   WEIGHT: tl.constexpr = False, Y_DTYPE: tl.constexpr = tl.bfloat16, KSUB: tl.constexpr = 1,
                   ONE_DOT: tl.constexpr = False):
    # Program (block b, N tile, K split), computed transposed: acc[n, m] = W[n, :] . A[row m, :] ("swap AB").
    # The decoded weight tile is the MMA's M side (BN = 64/128 rows: Hopper's warpgroup MMA shape, the
    # operand taken from registers) and the block's BM tokens its N side (16..128). With the tokens as M
    # (the old form) a 16-row block ran the small-M MMA and staged every decoded weight tile through
    # shared memory; transposed it is faster at every size measured, most at prefill sizes
    # (docs/perf-log.md, "Transposed FP4 expert GEMM, prefill mHC and RoPE, short-context top-k").
    # Each 128-K step loads 64 packed bytes per weight row (one contiguous 64 B segment; byte i = element
    # 2i low nibble, 2i+1 high nibble) and decodes the low and the high nibbles as two [BN, 64] tiles with
    # the 4 per-32 power-of-two scales multiplied in. A's [BM, 128] step is loaded whole and split into
    # its even and odd columns in registers, so two dots (low x even, high x odd) cover the step with no
    # interleave shuffle. A is pre-scaled by its per-128 power-of-two scale. Every operand value is exact
    # in bf16 and every bf16 x bf16 product exact in the fp32 accumulator, so the dots chain straight
    # into it.
    # IDENT (a handful of rows, e.g. one token's top-k): block b is row b alone and bexp_ptr is e
    # itself -- no sort.
    # A_BF16 (K % 128 == 0): A comes pre-scaled in bf16 as even / odd column halves (`a_bf16_split`, or its
    # producer's `store_bf16_split`), rows SA_R apart (0: one token's k rows as a stride-0 view),
    # so its tiles go from global straight into shared memory as the dots' operand -- no per-program
    # fp8 -> fp32 -> x scale -> bf16 conversion and register-to-shared re-layout of the same A tile for
    # every N tile (about as many instructions per step as the weight decode: 516 -> 314 SASS per step at
    # prefill tiles, offline sm_90). N_FAST (prefill): the grid has the N tiles varying fastest, so the
    # programs of one block, which read the same A rows, run together and find them in L2.
    # N_FAST: the grid's first axis is the N tile (prefill), else the block.
    # TOPK: A holds one row per token, feeding its TOPK consecutive pairs: pair p reads A's row p // TOPK
    # (vLLM's fused_moe gather), so the k-fold copy of the tokens' rows is never made.
    # A_SWIGLU (w2 on w1|w3's output, `swiglu_grouped_gemm`): A is that output, rows SA_R apart, gate at column k
    # and up at K + k, and as_ptr the rows' routing weights (WEIGHT); each [BM, 128] step computes the
    # clamped SwiGLU (LIMIT > 0), rounds it to Y_DTYPE and act_quants it as `swiglu_quant` does
    # (`swiglu_f32`, `quant_e4m3_rows`): the same bf16 operands as that op's split form, no launch between.
    # KSUB (A_BF16 and EVEN): each 128-K step decoded and multiplied in KSUB sub-steps (`DECODE_KSUB`).
    # ONE_DOT (A_BF16, KSUB 1): A's step loaded as one [BM, 128] tile and multiplied in one dot (`_decode_dots`).
    pdl_wait()
    tl.static_assert(not (N_FAST and (SPLIT or IDENT)))
    tl.static_assert(not ONE_DOT or (A_BF16 and KSUB == 1))
    tl.static_assert(not (A_SWIGLU and (A_BF16 or TOPK != 1)))
    tl.static_assert(KSUB == 1 or (A_BF16 and EVEN))
    if N_FAST:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if (ex < 0) | (ex >= E):
        if IDENT:
            if tl.program_id(2) == 0:  # one K split stores the zeros
                zero_row_tile(c_ptr, pid_m, pid_n, N, BN)
        return
    rows, mr, rn, mn = expert_block_tile(rows_ptr, pid_m, pid_n, P, N, BM, BN, IDENT)
    ar = rows // TOPK
    jb = tl.arange(0, 64)
    g4 = tl.arange(0, 4)
    rk = tl.arange(0, 128)
    KH = K // 2
    KG = K // 32
    w_base = w_ptr + ex * N * KH
    ws_base = ws_ptr + ex * N * KS_W
    acc = tl.zeros([BN, BM], tl.float32)
    kb0 = tl.program_id(2) * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(K, 128))
    for kb in range(kb0, kb1):
        if KSUB > 1:  # A_BF16 and EVEN: the step in KSUB sub-steps of 128 / KSUB K, each its own decode and dots
            for sub in tl.static_range(KSUB):
                js = sub * (64 // KSUB) + tl.arange(0, 64 // KSUB)  # the sub-step's bytes = even / odd columns
                a_e = tl.load(a_ptr + ar[:, None] * SA_R + (kb * 128 + js)[None, :], mask=mr[:, None], other=0.0)
                a_o = tl.load(a_ptr + ar[:, None] * SA_R + (kb * 128 + 64 + js)[None, :], mask=mr[:, None],
                              other=0.0)
                byte = tl.load(w_base + rn[:, None] * KH + (kb * 64 + js)[None, :])
                gs = kb * 4 + sub * (4 // KSUB) + tl.arange(0, 4 // KSUB)  # its 32-groups
                sw = tl.load(ws_base + rn[:, None] * KS_W + gs[None, :])
                acc = _decode_dots(acc, byte, sw, a_e, a_o, 4 // KSUB, SCALE_E8M0, ASM, FOLD, DOT_BF16)
        else:
            kh = kb * 64 + jb
            k = kb * 128 + rk
            g = kb * 4 + g4
            if ONE_DOT:  # the split form's step whole: even columns, then odd
                a_e = tl.load(a_ptr + ar[:, None] * SA_R + (kb * 128 + rk)[None, :], mask=mr[:, None], other=0.0)
                a_o = a_e
            elif A_BF16:  # K % 128 == 0: only the padded rows are masked
                a_e = tl.load(a_ptr + ar[:, None] * SA_R + (kb * 128 + jb)[None, :], mask=mr[:, None], other=0.0)
                a_o = tl.load(a_ptr + ar[:, None] * SA_R + (kb * 128 + 64 + jb)[None, :], mask=mr[:, None],
                              other=0.0)
            elif A_SWIGLU:  # K % 128 == 0 (the wrapper's condition)
                a_e, a_o = _swiglu_quant_split(a_ptr + ar * SA_R, as_ptr + ar, k, K, mr, LIMIT, WEIGHT, Y_DTYPE)
            else:
                sa = tl.load(as_ptr + ar * KS_A + kb, mask=mr, other=0.0)
                if EVEN:
                    a = tl.load(a_ptr + ar[:, None] * K + k[None, :], mask=mr[:, None], other=0.0)
                else:
                    a = tl.load(a_ptr + ar[:, None] * K + k[None, :], mask=mr[:, None] & (k[None, :] < K),
                                other=0.0)
                a_e, a_o = tl.split(tl.reshape(a.to(tl.float32) * sa[:, None], [BM, 64, 2]))
            if EVEN:  # N % BN == 0 and K % 128 == 0 (every V4 expert shape): no weight masks
                byte = tl.load(w_base + rn[:, None] * KH + kh[None, :])
                sw = tl.load(ws_base + rn[:, None] * KS_W + g[None, :])
            else:
                byte = tl.load(w_base + rn[:, None] * KH + kh[None, :], mask=mn[:, None] & (kh[None, :] < KH),
                               other=0)
                sw = tl.load(ws_base + rn[:, None] * KS_W + g[None, :], mask=mn[:, None] & (g[None, :] < KG),
                             other=0)
            acc = _decode_dots(acc, byte, sw, a_e, a_o, 4, SCALE_E8M0, ASM, FOLD, DOT_BF16, ONE_DOT)
    msk = mn[:, None] & mr[None, :]
    c_ptrs = c_ptr + rows[None, :] * N + rn[:, None]
    if SPLIT:  # fp32 partial of this K split at the rows' original positions; the tile's last split sums
        splitk_store(acc, p_ptr + rows[None, :] * N + rn[:, None], c_ptrs, msk, tl.program_id(2),
                     tl.num_programs(2), P * N, cnt_ptr + pid_m * tl.num_programs(1) + pid_n)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=msk)


def _scales_fold(w_s: torch.Tensor) -> bool:
    """Every group scale of this weight <= 2 (raw ue8m0 byte <= 128), so the PTX decode multiplies once
    (`_ASM_DECODE_FOLDED`). Read once per scale tensor -- one host sync at its first GEMM (prefill, or the
    decode warm-up before any graph capture; a first call inside a capture fails with CUDA's capture
    error, never silently) -- and kept on the tensor object (weights are not modified in place)."""
    flag = getattr(w_s, "_deepinfer_fold", None)
    if flag is None:
        top = w_s.view(torch.uint8).max() <= 128 if w_s.dtype in (torch.uint8, torch.float8_e8m0fnu) \
            else w_s.max() <= 2.0
        flag = bool(top.item()) if w_s.numel() else True
        w_s._deepinfer_fold = flag
    return flag


def _asm_ok(device: torch.device) -> bool:
    """The packed PTX FP4 decode: compiled (not the interpreter), NVIDIA (PTX: not a ROCm build), sm_90+
    (mul.rn.bf16x2), and not switched off with DEEPINFER_FP4_ASM=0 (then the Triton-expression decode
    runs: same values)."""
    return not _INTERPRET and settings.flag("DEEPINFER_FP4_ASM") and sm90_nvidia(device)


def _fp4_config(nb: int, N: int, K: int, BM: int, n_fast: bool, device: torch.device
                ) -> tuple[int, int, int, int, int]:
    """(BN, splits, K blocks per split, num_warps, num_stages) for the grouped FP4 GEMM (from sweeps:
    decode sizes timed as CUDA graphs, prefill sizes with do_bench; fastest within a few %; docs/perf-log.md,
    "Bit-placement FP4 decode, fewer decode launches, parallel routing sort" and "Prefill: pre-converted
    expert input, 64-head attention tiles, the non-GEMM kernels"):

    BM <= 32 (decode, short prompts): 128 weight rows x BM tokens, 4 warps, 3 stages, the 128-K steps split
    over a third grid axis until there are ~2 programs per SM (batch 1: 6 blocks x 32 N tiles -> 2
    splits). Targets of 2, 4 and 8 programs per SM were about equal; 8 warps slower.
    n_fast (prefill-sized blocks, BM >= 64, A pre-converted): 64 weight rows x BM tokens, 4 warps, 2 stages.
    Each MMA waits for its result (the decoded weight tile is a register operand), so the weight decode of one program
    overlaps the MMAs of others only: small programs with small shared-memory footprints, several per
    SM, won: clearly faster than 128 x 128 / 8 warps / 3 stages or 64 x 64 with 4 stages at 4096 prompt
    tokens (BM 128), and level with 128 x 128 / 8 warps at 2048 (BM 64).
    Otherwise (K not a multiple of 128) BM 64: 64 x 64 tiles, 4 warps; BM 128: 128 x 128, 8 warps.
    """
    nkb = cdiv(K, 128)
    if BM <= 32:
        BN = 64 if N <= 64 else 128
        per, splits = split_k(nkb, nb * cdiv(N, BN), 2 * _sms(device))
        return BN, splits, per, 4, 3
    if n_fast:
        return 64, 1, nkb, 4, 2
    if BM <= 64:
        return 64, 1, nkb, 4, 3
    return 128, 1, nkb, 8, 3


A_BF16_DECODE = True
"""Decode-sized blocks (BM <= 32, K % 128 == 0) take A pre-converted too: one more small launch instead of
converting the A tile (fp8 -> fp32 x scale -> bf16, split) in each of its 32-64 (N tile, K split)
programs. Bitwise the same, and slightly faster from batch 8 on, level at batch 1 (docs/perf-log.md, "Decode
latency tiles, bf16 compressor weights, 64-row FP8 prefill tiles")."""
DECODE_KSUB = 1
"""Sub-steps per 128-K step of the decode-sized FP4 kernel (blocks of <= 32 rows reading A's bf16 split form, N a
multiple of the tile): each sub-step loads, decodes and multiplies 128 / KSUB K. 1 is the form every config sweep
timed. Compiled as a flash launch specialises it (sm_90a, 128 x 16 tiles, 4 warps, Triton 3.6; `tools/triton_sass.py`)
the whole-step form takes 127 registers at batch 1 and 167 in sorted blocks, no spill, 496-498 SASS a step; 2
sub-steps 123-127 registers and 538-541 SASS, 4 sub-steps 64-78 registers and 590-594 SASS: fewer registers (more
programs an SM could hold), more instructions. (An earlier offline compile without the launch's specialisation
showed the one-step form spilling; it does not: docs/perf-log.md, "2026-12-07 (third session)".) Untimed:
`tools/device/fp4_decode_sweep.py` times 2 and 4 against 1 before this changes."""
A_BF16_MIN_BM = 64
"""Blocks of at least this many rows (prefill) take A pre-converted to bf16 (`a_bf16_split`, one extra
pass over A: P x K x 3 bytes of traffic, P x K x 2 bytes of scratch) instead of converting it in every
(block, N tile) program."""


@triton.jit
def _gg_float_kernel(a_ptr, w_ptr, c_ptr, rows_ptr, bexp_ptr, P, N, K,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                     TOPK: tl.constexpr = 1):
    pdl_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ex = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if ex < 0:
        return
    rows, mr, rn, mn = expert_block_tile(rows_ptr, pid_m, pid_n, P, N, BM, BN)
    ar = rows // TOPK
    rk = tl.arange(0, BK)
    w_base = w_ptr + ex * N * K
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        mk = k < K
        a = tl.load(a_ptr + ar[:, None] * K + k[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_base + rn[None, :] * K + k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
        w = w.to(a_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    # the reference's F.linear rounds to A's dtype before the cast to out_dtype
    y = acc.to(a_ptr.dtype.element_ty).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * N + rn[None, :], y, mask=mr[:, None] & mn[None, :])


@triton.jit
def _zero_rows_kernel(c_ptr, e_ptr, P, N, E, BR: tl.constexpr, BN: tl.constexpr):
    """c[p, :] = 0 for the rows p of this program whose expert id is not local (outside [0, E)); the sorted
    blocks never visit those rows. Rows with a local expert are left alone (the GEMM writes them)."""
    pdl_wait()
    p = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    ev = tl.load(e_ptr + p, mask=p < P, other=0)
    dead = (p < P) & ((ev < 0) | (ev >= E))
    if tl.max(dead.to(tl.int32), 0) > 0:
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            tl.store(c_ptr + p[:, None] * N + n[None, :], tl.zeros([BR, BN], tl.float32).to(c_ptr.dtype.element_ty),
                     mask=dead[:, None] & (n[None, :] < N))


def _zero_dead_rows(c: torch.Tensor, e: torch.Tensor, E: int) -> None:
    """Zero the output rows with no local expert (expert parallelism, padding) without filling all of c:
    at prefill sizes a whole [P, N] zero fill is a memset of the full output per call (docs/perf-log.md,
    "Decode latency tiles, bf16 compressor weights, 64-row FP8 prefill tiles")."""
    P, N = c.shape
    BR = 32
    BN = max(16, min(256, next_power_of_2(N)))
    _zero_rows_kernel[(cdiv(P, BR),)](c, e.reshape(-1), P, N, E, BR=BR, BN=BN, num_warps=4, **pdl())


def _fp4_launch(a, a_s, w, w_s, c, rows, bexp, K: int, ks_a: int, sa_r: int, BM: int, ident: bool, a_bf16: bool,
                **meta) -> None:
    """c [P, N] = `_gg_fp4_kernel` over the blocks of rows / bexp (`align`; IDENT: bexp = e, a row a block): A as
    the kernel takes it (K columns, ks_a scale columns a row, rows sa_r apart; a_bf16: its bf16 split form), w
    [E, N, K/2] packed e2m1 with w_s [E, N, K/32] (float or ue8m0 bytes). The launch config (`_fp4_config`), the
    PTX decode and its folded form, K split and sub-steps (`DECODE_KSUB`) are chosen here; meta: TOPK, or
    A_SWIGLU and its constants."""
    E, N = w.size(0), w.size(1)
    nb = bexp.numel()
    asm = _asm_ok(c.device)
    fold = asm and _scales_fold(w_s)
    w_s, e8m0 = weight_scale_arg(w_s)  # raw ue8m0 bytes: 1/4 of the f32 bytes
    n_fast = a_bf16 and BM >= A_BF16_MIN_BM  # prefill-sized blocks (never IDENT, never split)
    BN, splits, per, nw, ns = _fp4_config(nb, N, K, BM, n_fast, c.device)
    part, cnt = split_buffers(c, splits, nb * cdiv(N, BN))  # no zero fill: each tile's rows only
    grid = (cdiv(N, BN), nb, 1) if n_fast else (nb, cdiv(N, BN), splits)
    even = N % BN == 0 and K % 128 == 0
    ksub = DECODE_KSUB if a_bf16 and even and BM <= 32 else 1
    one_dot = n_fast and settings.flag("DEEPINFER_FP4_ONE_DOT")  # read per call: an A/B in one bench run
    regs = {"maxnreg": ONE_DOT_MAXNREG} if one_dot and not _INTERPRET else {}
    _gg_fp4_kernel[grid](
        a, a_s, w.view(torch.uint8), w_s, c, part, cnt, rows, bexp, c.size(0), E, N, K, ks_a, w_s.size(2), per, sa_r,
        BM=BM, BN=BN, SPLIT=splits > 1, DOT_BF16=not _INTERPRET, SCALE_E8M0=e8m0, ASM=asm, IDENT=ident, EVEN=even,
        FOLD=fold, A_BF16=a_bf16, N_FAST=n_fast, KSUB=ksub, ONE_DOT=one_dot, **meta, num_warps=nw, num_stages=ns,
        **regs, **pdl())


ONE_DOT_MAXNREG = 168
"""The register cap of the one-dot prefill form: compiled as a flash launch specialises it (sm_90a, 64 x 128 tiles,
4 warps, Triton 3.6, the folded decode) it takes 175 registers uncapped, which leaves two 128-thread programs an SM
where the two-dot form's 167 leave three; capped at 168 it has no spill (`tools/triton_sass.py`). The shipped form's
one-step loop waits for its first dot's four wgmmas before the second dot's (WARPGROUP.DEPBAR 0 mid-step); the
one-dot form issues the step's eight with at most 7 in flight and waits at the next step. Whether that pays is for
the GPU to say (`bench --against triton:DEEPINFER_FP4_ONE_DOT=1`)."""


@implement("grouped_gemm", "triton")
def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                 w_s: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16,
                 a_split: torch.Tensor | None = None, topk: int = 1) -> torch.Tensor:
    T, K = a.shape
    P = e.numel()  # pairs; with topk > 1 row p of the output reads A's row p // topk (no k-fold copy of A)
    assert P == T * topk, f"grouped_gemm: e has {P} rows, a {T} x topk {topk}"
    E, N = w.size(0), w.size(1)
    fp4 = w.dtype in (torch.int8, torch.uint8)
    ident = (fp4 or w.dtype == torch.float8_e4m3fn) and P <= IDENT_MAX_P and N > 0 and E > 0
    # rows with e = -1 (no local expert) are 0: IDENT programs store them, sorted blocks never see them
    # (`_zero_dead_rows` does)
    c = torch.empty(P, N, dtype=out_dtype, device=a.device)
    if P == 0 or N == 0:
        return c
    if E == 0:
        return c.zero_()
    if not ident and not every_row_local(e):  # all experts here (same_routing vouches): no row is left unwritten
        _zero_dead_rows(c, e, E)
    if ident:  # block p = row p: no sort, no align launch (one token's top-k hits distinct experts)
        BM, rows, bexp = 16, e, e.reshape(-1).long().contiguous()
    else:
        BM = _block_m(P, E)
        # a MoE layer's GEMMs of the same pairs sort them once (`same_routing`: the caller vouches for e)
        rows, bexp = routing_memo(e, ("align", E, BM), lambda: align(e, E, BM))
    nb = bexp.numel()
    w = w.contiguous()
    if w.dtype == torch.float8_e4m3fn:
        a = a.contiguous()
        assert a.dtype == torch.float8_e4m3fn and w.size(2) == K, "grouped_gemm fp8: a [P, K] fp8, w [E, N, K]"
        a_s, w_s = a_s.float().contiguous(), w_s.float().contiguous()
        if moe_prefill.usable(a, w, BM):  # prefill: TMA weight tiles, promotion per 128-K block
            return moe_prefill.fp8_grouped(a, a_s, w, w_s, c, rows, bexp, BM, topk)
        BN = 64 if N <= 64 else 128
        _gg_fp8_kernel[(nb, cdiv(N, BN))](
            a, a_s, w, w_s, c, rows, bexp, P, N, K, a_s.size(1), w_s.size(1), w_s.size(2), E, BM=BM, BN=BN, BK=128,
            TOPK=topk, IDENT=ident, **pdl())
    elif fp4:
        assert a.dtype == torch.float8_e4m3fn and K % 32 == 0 and w.size(2) * 2 == K, \
            "grouped_gemm fp4: a [P, K] fp8 with K % 32 == 0, w [E, N, K/2]"
        a_bf16 = K % 128 == 0 and (A_BF16_DECODE or BM >= A_BF16_MIN_BM)
        if a_bf16 and a_split is not None:  # the producer wrote the converted form (`swiglu_quant(split=True)`)
            assert a_split.shape == a.shape and a_split.dtype == torch.bfloat16, \
                "grouped_gemm: a_split must be a's [T, K] bf16 split form"
            # rows K apart, or one token's k rows as a stride-0 view (batch-1 decode): read in place
            a = a_split if a_split.stride(-1) == 1 and a_split.stride(0) in (0, K) else a_split.contiguous()
        elif a_bf16:  # A and its scales converted once, read through their row strides (one token's k rows may
            a = a_bf16_split(a, a_s)  # be a stride-0 view: no copy); the kernel reads no A scale then
        else:
            a, a_s = a.contiguous(), a_s.float().contiguous()
        _fp4_launch(a, a_s, w, w_s, c, rows, bexp, K, a_s.size(1), a.stride(0) if a_bf16 else K, BM, ident,
                    a_bf16, TOPK=topk)
    else:
        assert w.size(2) == K, "grouped_gemm float: w [E, N, K]"
        a = a.contiguous()
        BN, BK = 64, 64 if a.dtype != torch.float32 else 32
        _gg_float_kernel[(nb, cdiv(N, BN))](
            a, w, c, rows, bexp, P, N, K, BM=BM, BN=BN, BK=BK, IEEE=a.dtype == torch.float32, TOPK=topk, **pdl())
    return c


@implement("swiglu_grouped_gemm", "triton")
def swiglu_grouped_gemm(h: torch.Tensor, limit: float, weight: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                        w_s: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """At a handful of rows (<= IDENT_MAX_P: one token's top-k, the batch-1 decode step) the w2 kernel computes
    each A step from h as it loads it (A_SWIGLU): the swiglu_quant launch between the routed experts' two GEMMs,
    on the step's critical path, goes. Its programs each recompute their rows' 128-blocks (6 rows x 128
    columns per step against 128 x 64 weight bytes). More rows (sorted blocks, prefill): swiglu_quant, then
    grouped_gemm, whose A is then converted once rather than in each of a block's N-tile programs
    (`A_BF16_DECODE`)."""
    P, I = e.numel(), h.size(-1) // 2
    E, N = w.size(0), w.size(1)
    fp4 = w.dtype in (torch.int8, torch.uint8)
    if not fp4 and w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"swiglu_grouped_gemm: w2 must be FP8 or FP4 expert stacks, not {w.dtype} (a float w2 "
                         "runs swiglu, then grouped_gemm)")
    fused = (fusion("swiglu_grouped_gemm") and 0 < P <= IDENT_MAX_P and E > 0 and N > 0 and I % 128 == 0
             and tuple(h.shape) == (P, 2 * I) and out_dtype in _TL_DTYPE and h.dtype.is_floating_point)
    if not fused:
        a = _swiglu_quant(h[:, :I], h[:, I:], limit, weight=weight, out_dtype=out_dtype, split=fp4)
        return grouped_gemm(a[0], a[1], e, w, w_s, out_dtype, a_split=a[2] if fp4 else None)
    h, w = h.contiguous(), w.contiguous()
    wt = weight.reshape(-1).float().contiguous() if weight is not None else h  # h: a pointer never read
    c = torch.empty(P, N, dtype=out_dtype, device=h.device)
    bexp = e.reshape(-1).long().contiguous()  # IDENT: block p is row p, bexp its expert
    fuse = dict(A_SWIGLU=True, LIMIT=float(limit) if limit > 0 else 0.0, WEIGHT=weight is not None,
                Y_DTYPE=_TL_DTYPE[out_dtype])
    if not fp4:
        assert w.size(2) == I, "swiglu_grouped_gemm fp8: w [E, N, I] for h [P, 2I]"
        w_s = w_s.float().contiguous()
        BN = 64 if N <= 64 else 128
        _gg_fp8_kernel[(P, cdiv(N, BN))](
            h, wt, w, w_s, c, bexp, bexp, P, N, I, I // 128, w_s.size(1), w_s.size(2), E, BM=16, BN=BN, BK=128,
            IDENT=True, **fuse, **pdl())
        return c
    assert w.size(2) * 2 == I, "swiglu_grouped_gemm fp4: w [E, N, I/2] for h [P, 2I]"
    _fp4_launch(h, wt, w, w_s, c, bexp, bexp, I, I // 128, 2 * I, 16, True, False, **fuse)
    return c
