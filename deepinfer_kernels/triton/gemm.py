"""Block-scaled GEMMs: FP8 x FP8 (128-block scales), FP8 x FP4 (e2m1 unpacked in-kernel) and bf16 x FP8.

C = A Wᵀ, fp32 accumulation, every product exact, so the result equals the reference's "scale first,
then multiply" up to the fp32 summation order.

fp8_gemm: e4m3 x e4m3 tl.dot per 128-wide K block (one A scale per row and one W scale per 128x128
block multiply the block's partial sum). The dots pass max_num_imprecise_acc=0: Hopper's FP8 wgmma
otherwise accumulates with a ~14-bit mantissa (Triton's sm_90 default), which at K = 7168 misses the
fp32 tolerance by 100x (seen on H200). With it, Triton lowers the dot to f16 mma.sync on unpacked e4m3 (below).

fp4_gemm: each 128-wide K block loads 64 packed bytes per weight row, decodes both nibbles, multiplies
the per-32 power-of-two scales in (exact in bf16: e2m1 has 2 significant bits and bf16 the full fp32
exponent range), interleaves them back into natural K order (join + reshape), and feeds one bf16 dot
with A pre-scaled by its per-128 power-of-two scale (fp8 x 2^e is exact in bf16). bf16 x bf16 products
are exact in the fp32 accumulator, so the dot chains straight into the accumulator (no per-group
partial dots: over 32-wide K steps those are issue-bound, far below the copy rate). Under the
Triton interpreter (whose bf16 dot is broken) the same values go through an fp32 dot.

Tiling (heuristics by shape, deterministic; no autotune):
  * decode (M <= 64): memory-bound weight streaming. BM = next_pow2(M) >= 16, BN = 64, BK = 128, and
    split-K over a second grid axis so that about 2 programs per SM stream disjoint weight slices
    (each split >= 2 K blocks); splits write fp32 partials to a [splits, M, N] workspace and the tile's
    last split to finish sums them in split order and casts to out_dtype (`splitk_store`: a per-tile
    counter, no second launch; the sum's order is fixed, so it is deterministic). E.g. flash wq_a
    (M 32, N 1024, K 4096) runs 16 x 8 programs instead of 16; expert_w1 32 x 8 programs of 128-K steps
    instead of 32 programs of 32-K steps.
  * prefill (M > 64): the TMA kernel below on sm_90+ (`TMA_TILES`); elsewhere 128x128 output tiles
    (64xN for M <= 128), BK 128, num_warps 8, num_stages 3-4 (fp8: 32 KB of operands per stage), 1-D grid
    with a group-M swizzle (GROUP_M = 8) so that consecutive programs share weight tiles in L2.

fp8_grouped_linear (V4's wo_a: bf16 activations into G groups of one FP8 weight, the official bmm on the
dequantised weight): decode sizes stream the FP8 weight (`_fp8w_group_kernel`: e4m3 tiles converted to bf16
in registers, exact, the block's partial times its power-of-two scale); prefill dequantises into a per-call
bf16 scratch for cuBLAS's bmm.

fp8_gemm at prefill (M > 64) on sm_90+ runs the TMA kernel (`_fp8_gemm_tma_kernel`, operands through TMA tensor
descriptors, `TMA_TILES`). By default (DEEPINFER_FP8_GEMM=exact) it accumulates exact products in fp32
(max_num_imprecise_acc = 0): the official fp8_gemm's fp32 accumulation, its outputs to 5e-6 relative at M 4096
(tools/official/check_kernels.py), but at a fraction of the FP8 rate. Triton (3.6 and 3.8, sm_90a) lowers that dot
without wgmma: it unpacks both e4m3 tiles to f16 in registers and runs warp-level f16 MMAs (mma.sync m16n8k16,
fp32 accumulators), the A and W tiles converted once per warp that reads them. DEEPINFER_FP8_GEMM=exact-wgmma
(opt-in until measured on a GPU) computes the same exact products on f16 wgmma instead: e4m3 -> f16 is exact, and
f16 x f16 products are exact in the fp32 accumulator, so each 128-K block's sum is the tensor core's fp32 sum as
before, then scaled into the accumulator; each tile is converted once per program (`TMA_TILES_F16`). DEEPINFER_FP8_GEMM=triton promotes once per 128-K block (max_num_imprecise_acc =
128, DeepGEMM's scheme, the DeepSeek-V3 report's promotion interval: more than twice as fast), and =auto hands the
shapes cuBLASLt takes to its block-scaled GEMM (`gemm_vendor`, same promotion, faster still; docs/perf-log.md,
"Prefill FP8 GEMMs on cuBLASLt, fewer decode launches"). The price of both is the tensor core's accumulator precision
within a block (about 2^-13 relative to the block's sum of |a w|): below the bf16 output's rounding, but 6.7 % of
outputs one ulp off the official kernel's, which the next FP8 quantisation turns into 1-8 % per layer against the
official modules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.ops.registry import implement
from deepinfer.quant.grouped import grouped_bmm

from . import gemm_vendor
from .quant import act_quant
from ._common import cdiv, next_power_of_2
from ._common import INTERPRET as _INTERPRET
from ._common import dot_f32, e8m0_f32, pdl, pdl_wait, split_buffers, splitk_store, tma_ok, weight_scale_arg
from ._common import quant_e4m3_rows
from ._common import sms as _sms





DECODE_PROGRAMS_PER_SM = 2
MIN_KB_PER_SPLIT = 2
"""Decode-sized GEMMs split K until output tiles x splits ~ DECODE_PROGRAMS_PER_SM x SMs, each split at
least MIN_KB_PER_SPLIT 128-K blocks."""


def _config(M: int, N: int, K: int, device: torch.device):
    """(BM, BN, GROUP_M, splits, K blocks per split, num_warps, num_stages) for C[M, N] with BK = 128."""
    nkb = cdiv(K, 128)
    if M <= 64:
        BM, BN = max(16, next_power_of_2(M)), 64
        tiles = cdiv(M, BM) * cdiv(N, BN)
        splits = max(1, min(nkb // MIN_KB_PER_SPLIT, cdiv(DECODE_PROGRAMS_PER_SM * _sms(device), tiles)))
        per = cdiv(nkb, splits)
        return BM, BN, 1, cdiv(nkb, per), per, 4, 3
    BM = 64 if M <= 128 else 128
    return BM, 128, 8, 1, nkb, 8, 3


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Group-M swizzled (pid_m, pid_n) of the 1-D program id."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    return pid_m, pid_n


@triton.jit
def _store_out(acc, c_ptr, p_ptr, cnt_ptr, rm, rn, M, N, SPLIT: tl.constexpr):
    msk = (rm[:, None] < M) & (rn[None, :] < N)
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    if SPLIT:  # fp32 partial of split program_id(1); the tile's last split sums them into c
        splitk_store(acc, p_ptr + rm[:, None] * N + rn[None, :], c_ptrs, msk, tl.program_id(1),
                     tl.num_programs(1), M * N, cnt_ptr + tl.program_id(0))
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, p_ptr, cnt_ptr, M, N, K, KS_A, KS_W, KB_PER_SPLIT,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT: tl.constexpr, QUANT_A: tl.constexpr = False):
    # BK == 128: one scale per K block for A (per row) and for W (per 128x128 block).
    # QUANT_A: A comes unquantised (a float dtype, as_ptr unused) and each [BM, 128] block is act_quant'ed as it
    # is loaded (`quant_e4m3_rows`, act_quant's kernel's rule): the same q and scales, so the same sums as
    # act_quant then this kernel (`act_quant_fp8_gemm`), without the launch between them.
    pdl_wait()
    pid_m, pid_n = _tile(M, N, BM, BN, GROUP_M)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    n_blk = (pid_n * BN) // 128  # BN divides 128: the whole N tile shares one weight-scale row
    kb0 = tl.program_id(1) * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(K, BK))
    for kb in range(kb0, kb1):
        k = kb * BK + rk
        a = tl.load(a_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        if QUANT_A:
            a, sa = quant_e4m3_rows(a.to(tl.float32))
        else:
            sa = tl.load(as_ptr + rm * KS_A + kb, mask=rm < M, other=0.0)
        sw = tl.load(ws_ptr + n_blk * KS_W + kb)
        acc += tl.dot(a, w, max_num_imprecise_acc=0) * (sa[:, None] * sw)
    _store_out(acc, c_ptr, p_ptr, cnt_ptr, rm, rn, M, N, SPLIT)


@triton.jit
def _fp8_gemm_tma_kernel(a_desc, as_ptr, w_desc, ws_ptr, c_ptr, M, N, K, KS_A, KS_W,
                         BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, EXACT: tl.constexpr,
                         F16: tl.constexpr = False):
    # BK = 128; the descriptors zero-fill rows and K columns past the edges
    pdl_wait()
    pid_m, pid_n = _tile(M, N, BM, BN, GROUP_M)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        a = a_desc.load([pid_m * BM, kb * 128])
        w = w_desc.load([pid_n * BN, kb * 128])
        sa = tl.load(as_ptr + rm * KS_A + kb, mask=rm < M, other=0.0)
        sw = tl.load(ws_ptr + (rn // 128) * KS_W + kb, mask=rn < N, other=0.0)
        if F16:  # e4m3 -> f16 is exact, so are f16 products in fp32: the block's sum on f16 wgmma, in fp32
            acc += tl.dot(a.to(tl.float16), w.to(tl.float16).T) * (sa[:, None] * sw[None, :])
        elif EXACT:  # fp32 accumulation of exact products, as the official kernel accumulates
            acc += tl.dot(a, w.T, max_num_imprecise_acc=0) * (sa[:, None] * sw[None, :])
        else:
            acc += tl.dot(a, w.T, max_num_imprecise_acc=128) * (sa[:, None] * sw[None, :])
    _store_out(acc, c_ptr, c_ptr, c_ptr, rm, rn, M, N, False)


TMA_TILES = (64, 128, 16, 4, 3)
"""(BM, BN, GROUP_M, num_warps, num_stages) of the prefill kernel: one warpgroup on 64 x 128 tiles, 3 stages
(72 KB of shared memory: three programs per SM). Each 128-K block's wgmma must finish before its partial is
scaled into the accumulator, so a program's tensor core idles during its own promotion; with three small
programs per SM one's promotion overlaps another's MMAs. With L2 flushed these tiles beat 128 x 128 / 8 warps /
4 stages at every flash prefill shape, and 128 x 64 / 4 warps and 64 x 128 with 2 stages; GROUP_M 32 gave no
consistent gain (docs/perf-log.md, "Decode latency tiles, bf16 compressor weights, 64-row FP8 prefill tiles")."""

TMA_TILES_F16 = (64, 128, 16, 4, 3)
"""The same for DEEPINFER_FP8_GEMM=exact-wgmma: one warpgroup's f16 wgmma on 64 x 128 tiles. Offline (sm_90a, Triton
3.6, `tools/triton_sass.py`): 204 registers, no spill, 513 SASS a 128-K block against the exact form's 245 and 710
(its 128 HMMA and 224 conversions); 128 x 128 on 8 warps 237 registers, 128 x 64 on 4 warps 245, neither
spilling. Not yet timed: the device sweep (`tools/device/fp8_exact_sweep.py`) times them against the
alternatives."""


def _tma_prefill(a: torch.Tensor, w: torch.Tensor, M: int, K: int) -> bool:
    """Prefill-sized M on a GPU with TMA (sm_90+) and operands a descriptor accepts (16-byte rows and bases);
    the interpreter runs the same kernel so that the CPU tests cover its indexing."""
    if M <= 64 or K % 16 or a.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    return tma_ok(a)


@implement("fp8_gemm", "triton")
def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M, K = a.shape
    N = w.size(0)
    a, a_s, w, w_s = a.contiguous(), a_s.float().contiguous(), w.contiguous(), w_s.float().contiguous()
    if N and gemm_vendor.shape_ok(a, w, out_dtype) and gemm_vendor.unavailable(a.device) is None:
        return gemm_vendor.fp8_gemm_block_scaled(a, a_s, w, w_s, out_dtype)  # prefill on sm_90: cuBLASLt
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if _tma_prefill(a, w, M, K):
        mode = gemm_vendor.mode()
        BM, BN, GM, nw, ns = TMA_TILES_F16 if mode == "exact-wgmma" else TMA_TILES
        ad, wd = TensorDescriptor.from_tensor(a, [BM, 128]), TensorDescriptor.from_tensor(w, [BN, 128])
        grid = (cdiv(M, BM) * cdiv(N, BN),)
        _fp8_gemm_tma_kernel[grid](ad, a_s, wd, w_s, c, M, N, K, a_s.size(1), w_s.size(1),
                                   BM=BM, BN=BN, GROUP_M=GM, EXACT=mode == "exact", F16=mode == "exact-wgmma",
                                   num_warps=nw, num_stages=ns, **pdl())
        return c
    BM, BN, GM, splits, per, nw, ns = _config(M, N, K, a.device)
    if BN == 128 and M > 64:
        ns = 4  # 2 x 16 KB of fp8 operands per stage
    grid = (cdiv(M, BM) * cdiv(N, BN), splits)
    part, cnt = split_buffers(c, splits, grid[0])
    _fp8_gemm_kernel[grid](a, a_s, w, w_s, c, part, cnt, M, N, K, a_s.size(1), w_s.size(1), per,
                           BM=BM, BN=BN, BK=128, GROUP_M=GM, SPLIT=splits > 1, num_warps=nw, num_stages=ns,
                           **pdl())
    return c


@implement("act_quant_fp8_gemm", "triton")
def act_quant_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode sizes (the split-K kernel, M <= 64): A quantised per 128-block as the kernel loads it. Larger M
    (cuBLASLt, the TMA kernel: their operands come from memory as e4m3) and shapes off the kernel's contract:
    act_quant, then fp8_gemm."""
    M, K = x.shape
    N = w.size(0)
    if M == 0 or N == 0 or K % 128 or M > 64 or not x.dtype.is_floating_point or x.dtype.itemsize < 2:
        return fp8_gemm(*act_quant(x, 128), w, w_s, out_dtype)
    x, w, w_s = x.contiguous(), w.contiguous(), w_s.float().contiguous()
    c = torch.empty(M, N, dtype=out_dtype, device=x.device)
    BM, BN, GM, splits, per, nw, ns = _config(M, N, K, x.device)
    grid = (cdiv(M, BM) * cdiv(N, BN), splits)
    part, cnt = split_buffers(c, splits, grid[0])
    _fp8_gemm_kernel[grid](x, x, w, w_s, c, part, cnt, M, N, K, K // 128, w_s.size(1), per,
                           BM=BM, BN=BN, BK=128, GROUP_M=GM, SPLIT=splits > 1, QUANT_A=True, num_warps=nw,
                           num_stages=ns, **pdl())
    return c


@triton.jit
def _e2m1(code):
    """Decode 4-bit e2m1 codes (int32, 0..15) to float32: bit 3 sign, bits 0..2 magnitude index."""
    e = (code >> 1) & 3
    mnt = (code & 1).to(tl.float32)
    p = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    mag = tl.where(e == 0, mnt * 0.5, (1.0 + mnt * 0.5) * p)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _fp4_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, p_ptr, cnt_ptr, M, N, K, KS_A, KS_W, KB_PER_SPLIT,
                     BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
                     DOT_BF16: tl.constexpr, SCALE_E8M0: tl.constexpr):
    # K blocks of 128 = 64 packed bytes per weight row (byte i: element 2i low nibble, 2i+1 high nibble)
    # = 4 scale groups of 32. One A scale per 128 block.
    pdl_wait()
    pid_m, pid_n = _tile(M, N, BM, BN, GROUP_M)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, 128)
    jb = tl.arange(0, 64)
    g4 = tl.arange(0, 4)
    KH = K // 2
    KG = K // 32
    acc = tl.zeros([BM, BN], tl.float32)
    kb0 = tl.program_id(1) * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(K, 128))
    for kb in range(kb0, kb1):
        k = kb * 128 + rk
        a = tl.load(a_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        sa = tl.load(as_ptr + rm * KS_A + kb, mask=rm < M, other=0.0)
        a = a.to(tl.float32) * sa[:, None]  # exact: power-of-two scale
        kh = kb * 64 + jb
        byte = tl.load(w_ptr + rn[:, None] * KH + kh[None, :], mask=(rn[:, None] < N) & (kh[None, :] < KH), other=0)
        byte = byte.to(tl.int32) & 0xFF
        g = kb * 4 + g4
        sw = tl.load(ws_ptr + rn[:, None] * KS_W + g[None, :], mask=(rn[:, None] < N) & (g[None, :] < KG), other=0)
        if SCALE_E8M0:
            sw = e8m0_f32(sw)
        lo = tl.reshape(tl.reshape(_e2m1(byte & 0xF), [BN, 4, 16]) * sw[:, :, None], [BN, 64])
        hi = tl.reshape(tl.reshape(_e2m1(byte >> 4), [BN, 4, 16]) * sw[:, :, None], [BN, 64])
        w = tl.reshape(tl.join(lo, hi), [BN, 128])  # natural K order: element 2i then 2i+1
        if DOT_BF16:
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    _store_out(acc, c_ptr, p_ptr, cnt_ptr, rm, rn, M, N, SPLIT)


@implement("fp4_gemm", "triton")
def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M, K = a.shape
    N = w.size(0)
    assert K % 32 == 0 and w.size(1) * 2 == K, "fp4_gemm: K must be a multiple of 32 and w [N, K/2]"
    w_s, e8m0 = weight_scale_arg(w_s)  # raw ue8m0 bytes are decoded in-kernel
    a, a_s, w = a.contiguous(), a_s.float().contiguous(), w.contiguous()
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    BM, BN, GM, splits, per, nw, ns = _config(M, N, K, a.device)
    grid = (cdiv(M, BM) * cdiv(N, BN), splits)
    part, cnt = split_buffers(c, splits, grid[0])
    _fp4_gemm_kernel[grid](a, a_s, w.view(torch.uint8), w_s, c, part, cnt, M, N, K, a_s.size(1), w_s.size(1), per,
                           BM=BM, BN=BN, GROUP_M=GM, SPLIT=splits > 1, DOT_BF16=not _INTERPRET, SCALE_E8M0=e8m0,
                           num_warps=nw, num_stages=ns, **pdl())
    return c


@triton.jit
def _fp8w_group_kernel(x_ptr, w_ptr, ws_ptr, c_ptr, p_ptr, cnt_ptr, M, N, K, R, sx_t, sx_g, KS_W, KB_PER_SPLIT,
                       BM: tl.constexpr, BN: tl.constexpr, DOT_16: tl.constexpr, SPLIT: tl.constexpr,
                       SWAP: tl.constexpr):
    """C[t, n] = sum_k x[t, n // R, k] · w[n, k] · s[n // 128, k // 128] over one split of the K blocks.

    One 128-K block at a time: the weight tile's e4m3 values are exact in x's 16-bit dtype (DOT_16: one dot
    of exact products) or in tf32 (fp32 x: `dot_f32`), and the block's partial is multiplied by its
    power-of-two scale (exact), so every product equals the reference's x · bf16(w · s). BN divides R and
    128: a tile lies in one group and one scale row. C is [M, N] = [T, G·R], the reference's [T, G, R].

    SWAP computes the tile transposed, acc[n, t] = W[n, :] · x[t, :] (as the FP4 expert GEMM): the converted
    weight tile is the MMA's M side, which Hopper's warpgroup MMA takes from registers, instead of going
    back through shared memory as the B operand. At flash wo_a the swapped form is slightly slower up to 32
    tokens and clearly faster at 64, so it runs from 64 rows on (`fp8_grouped_linear`; docs/perf-log.md,
    "Fewer decode launches, FP8 `wo_a`, LM head tiles")."""
    pdl_wait()
    pid_m, pid_n = _tile(M, N, BM, BN, 1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, 128)
    g = (pid_n * BN) // R
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    kb0 = tl.program_id(1) * KB_PER_SPLIT
    kb1 = tl.minimum(kb0 + KB_PER_SPLIT, tl.cdiv(K, 128))
    for kb in range(kb0, kb1):
        k = kb * 128 + rk
        sw = tl.load(ws_ptr + ((pid_n * BN) // 128) * KS_W + kb)
        if SWAP:  # w [BN, 128] . x tile [128, BM]
            w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
            a = tl.load(x_ptr + rm[None, :] * sx_t + g * sx_g + k[:, None],
                        mask=(rm[None, :] < M) & (k[:, None] < K), other=0.0)
            if DOT_16:
                blk = tl.dot(w.to(a.dtype), a)
            else:
                blk = dot_f32(w.to(tl.float32), a.to(tl.float32), tl.zeros([BN, BM], tl.float32), True)
        else:  # x tile [BM, 128] . w [128, BN]
            a = tl.load(x_ptr + rm[:, None] * sx_t + g * sx_g + k[None, :],
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
            if DOT_16:
                blk = tl.dot(a, w.to(a.dtype))
            else:
                blk = dot_f32(a.to(tl.float32), w.to(tl.float32), tl.zeros([BM, BN], tl.float32), False, True)
        acc += blk * sw
    if SWAP:
        msk = (rn[:, None] < N) & (rm[None, :] < M)
        off = rm[None, :] * N + rn[:, None]
    else:
        msk = (rm[:, None] < M) & (rn[None, :] < N)
        off = rm[:, None] * N + rn[None, :]
    if SPLIT:
        splitk_store(acc, p_ptr + off, c_ptr + off, msk, tl.program_id(1), tl.num_programs(1), M * N,
                     cnt_ptr + tl.program_id(0))
    else:
        tl.store(c_ptr + off, acc.to(c_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _fp8_dequant_kernel(w_ptr, ws_ptr, y_ptr, N, K, KS_W, BN: tl.constexpr, BK: tl.constexpr):
    """y[n, k] = w[n, k] · s[n // 128, k // 128] in y's dtype (BN, BK divide 128: one scale per tile)."""
    pdl_wait()
    rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = (tl.program_id(1) * BK + tl.arange(0, BK)).to(tl.int64)
    m = (rn[:, None] < N) & (rk[None, :] < K)
    s = tl.load(ws_ptr + ((tl.program_id(0) * BN) // 128) * KS_W + (tl.program_id(1) * BK) // 128)
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn[:, None] * K + rk[None, :], (w * s).to(y_ptr.dtype.element_ty), mask=m)


W8_SWAP_MIN_BM = 64
"""`_fp8w_group_kernel` tiles of this many tokens and more run transposed (its docstring says why)."""

W8_TILED_MAX_M = 256
"""Up to this many tokens `fp8_grouped_linear` runs `_fp8w_group_kernel` (decode: it streams the FP8 weight,
half the bytes of the bf16 copy the official code holds); from here on (prefill) the weight is dequantised
into a per-call bf16 scratch and multiplied by cuBLAS's bmm, whose bf16 rate the Triton tiles do not reach
(the scratch costs one pass over 2x the FP8 bytes). The crossover was not measured."""


@implement("fp8_grouped_linear", "triton")
def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    T, G, K = x.shape
    N = w.size(0)
    R = N // G
    assert R * G == N and w.size(1) == K, \
        f"fp8_grouped_linear: w {tuple(w.shape)} is not [G·R, K] for x {tuple(x.shape)}"
    w, w_s = w.contiguous(), w_s.float().contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if T > W8_TILED_MAX_M or R % 16:  # prefill (or groups no 16-row tile divides): dequantise once, cuBLAS bmm
        wd = torch.empty(N, K, dtype=x.dtype, device=x.device)
        _fp8_dequant_kernel[(cdiv(N, 64), cdiv(K, 128))](w, w_s, wd, N, K, w_s.size(1), BN=64, BK=128,
                                                                       **pdl())
        return grouped_bmm(x, wd.view(G, R, K))
    y = torch.empty(T, G, R, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    BN = min(64, R & -R)  # divides R and 128: a tile in one group and one scale row
    if T <= 64:  # decode: split K as the FP8 decode GEMM does (~2 programs per SM)
        BM, _, _, splits, per, _, _ = _config(T, N, K, x.device)
    else:
        BM, splits, per = 64, 1, cdiv(K, 128)
    c = y.view(T, N)
    grid = (cdiv(T, BM) * cdiv(N, BN), splits)
    part, cnt = split_buffers(c, splits, grid[0])
    dot16 = x.dtype in (torch.bfloat16, torch.float16) and not (_INTERPRET and x.dtype == torch.bfloat16)
    _fp8w_group_kernel[grid](x, w, w_s, c, part, cnt, T, N, K, R, x.stride(0), x.stride(1), w_s.size(1), per,
                             BM=BM, BN=BN, DOT_16=dot16, SPLIT=splits > 1, SWAP=BM >= W8_SWAP_MIN_BM, num_warps=4,
                             num_stages=3, **pdl())
    return y
