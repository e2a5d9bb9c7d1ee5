"""FP8 activation quantisation in TileLang: `act_quant` (per-`block` e4m3 codes with ue8m0 scales) and the fused
`rms_norm_quant` (RMSNorm, the normed row rounded to the input dtype, then its act_quant), on sm_90.

act_quant: one program per 32 rows x one `block`-wide column block; the block's amax, floored at 1e-4 as the
official kernel does, gives the scale 2^ceil(log2(amax / 448)) (from its bits: `_common.pow2_ceil`), then
q = clamp(x / s, +-448) rounded to e4m3 (x / s is exact: s is a power of two).
rms_norm_quant: one program per row, the row held as K/128 blocks of 128 so that the per-block amax is one
reduction; the mean square is reduced over the whole row first.

No `from __future__ import annotations` here: TileLang evaluates a prim_func's annotations, which name
the enclosing builder's shape variables.
"""


import tilelang
import tilelang.language as T
import torch

from deepinfer.ops.reference import bf16_split
from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement

from ._common import FP8_MAX, build, pow2_ceil, tl_dtype

BLK_M = 32
DTYPES_16 = (torch.bfloat16, torch.float16)


def act_quant_kernel(N: int, block: int, in_dt: str):
    """X [M, N] in_dt -> Q [M, N] e4m3, S [M, N/block] f32 (M symbolic)."""
    M = T.symbolic("M")
    NB = N // block

    @T.prim_func
    def act_quant_k(X: T.Tensor((M, N), in_dt), Q: T.Tensor((M, N), "float8_e4m3"),
                    S: T.Tensor((M, NB), "float32")):
        with T.Kernel(T.ceildiv(M, BLK_M), NB, threads=128) as (bm, bk):
            xs = T.alloc_shared((BLK_M, block), in_dt)
            xf = T.alloc_fragment((BLK_M, block), "float32")
            amax = T.alloc_fragment((BLK_M,), "float32")
            sc = T.alloc_fragment((BLK_M,), "float32")
            qf = T.alloc_fragment((BLK_M, block), "float8_e4m3")
            T.copy(X[bm * BLK_M, bk * block], xs)
            for i, j in T.Parallel(BLK_M, block):
                xf[i, j] = T.Cast("float32", xs[i, j])
            T.reduce_absmax(xf, amax, dim=1)
            for i in T.Parallel(BLK_M):
                sc[i] = pow2_ceil(T, T.max(amax[i], T.float32(1e-4)) / T.float32(FP8_MAX))
            for i, j in T.Parallel(BLK_M, block):
                qf[i, j] = T.Cast("float8_e4m3", T.clamp(xf[i, j] / sc[i], -FP8_MAX, FP8_MAX))
            T.copy(qf, Q[bm * BLK_M, bk * block])
            for i in T.Parallel(BLK_M):
                if bm * BLK_M + i < M:
                    S[bm * BLK_M + i, bk] = sc[i]

    return act_quant_k


def rms_norm_quant_kernel(N: int, in_dt: str, has_w: bool, eps: float):
    """X [M, N] in_dt, W [N] f32 -> Y [M, N] in_dt, Q [M, N] e4m3, S [M, N/128] f32 (M symbolic)."""
    M = T.symbolic("M")
    B = 128
    NB = N // B

    @T.prim_func
    def rms_norm_quant_k(X: T.Tensor((M, N), in_dt), W: T.Tensor((N,), "float32"), Y: T.Tensor((M, N), in_dt),
                         Q: T.Tensor((M, N), "float8_e4m3"), S: T.Tensor((M, NB), "float32")):
        with T.Kernel(M, threads=128) as row:
            xs = T.alloc_shared((NB, B), in_dt)
            xf = T.alloc_fragment((NB, B), "float32")
            sq = T.alloc_fragment((NB, B), "float32")
            part = T.alloc_fragment((NB,), "float32")
            part_s = T.alloc_shared((NB,), "float32")
            r = T.alloc_local((1,), "float32")
            yb = T.alloc_fragment((NB, B), in_dt)
            amax = T.alloc_fragment((NB,), "float32")
            sc = T.alloc_fragment((NB,), "float32")
            qf = T.alloc_fragment((NB, B), "float8_e4m3")
            for b, j in T.Parallel(NB, B):
                xs[b, j] = X[row, b * B + j]
            T.copy(xs, xf)
            for b, j in T.Parallel(NB, B):
                sq[b, j] = xf[b, j] * xf[b, j]
            T.reduce_sum(sq, part, dim=1)
            T.copy(part, part_s)
            r[0] = T.float32(0)
            for b in T.serial(NB):
                r[0] += part_s[b]
            r[0] = T.rsqrt(r[0] / T.float32(N) + T.float32(eps))
            for b, j in T.Parallel(NB, B):
                if has_w:
                    yb[b, j] = T.Cast(in_dt, W[b * B + j] * (xf[b, j] * r[0]))
                else:
                    yb[b, j] = T.Cast(in_dt, xf[b, j] * r[0])
            for b, j in T.Parallel(NB, B):
                xf[b, j] = T.Cast("float32", yb[b, j])  # act_quant reads the rounded row
            T.reduce_absmax(xf, amax, dim=1)
            for b in T.Parallel(NB):
                sc[b] = pow2_ceil(T, T.max(amax[b], T.float32(1e-4)) / T.float32(FP8_MAX))
            for b, j in T.Parallel(NB, B):
                qf[b, j] = T.Cast("float8_e4m3", T.clamp(xf[b, j] / sc[b], -FP8_MAX, FP8_MAX))
            for b, j in T.Parallel(NB, B):
                Y[row, b * B + j] = yb[b, j]
                Q[row, b * B + j] = qf[b, j]
            for b in T.Parallel(NB):
                S[row, b] = sc[b]

    return rms_norm_quant_k


def fp4_fake_quant_kernel(N: int, block: int, in_dt: str):
    """X [M, N] in_dt -> Y [M, N] in_dt: each `block` of a row through e2m1 with a power-of-two scale and back
    (M symbolic). amax floored at 6 x 2^-126; s = 2^ceil(log2(amax / 6)); the e2m1 rounding is the hardware cast
    (round to nearest even, saturating), as kernel.py's fp4_quant_kernel with inplace=True."""
    M = T.symbolic("M")
    NB = N // block

    @T.prim_func
    def fp4_fake_quant_k(X: T.Tensor((M, N), in_dt), Y: T.Tensor((M, N), in_dt)):
        with T.Kernel(T.ceildiv(M, BLK_M), NB, threads=128) as (bm, bk):
            xs = T.alloc_shared((BLK_M, block), in_dt)
            xf = T.alloc_fragment((BLK_M, block), "float32")
            amax = T.alloc_fragment((BLK_M,), "float32")
            sc = T.alloc_fragment((BLK_M,), "float32")
            yf = T.alloc_fragment((BLK_M, block), in_dt)
            T.copy(X[bm * BLK_M, bk * block], xs)
            for i, j in T.Parallel(BLK_M, block):
                xf[i, j] = T.Cast("float32", xs[i, j])
            T.reduce_absmax(xf, amax, dim=1)
            for i in T.Parallel(BLK_M):
                sc[i] = pow2_ceil(T, T.max(amax[i], T.float32(6.0 * 2.0**-126)) / T.float32(6.0))
            for i, j in T.Parallel(BLK_M, block):
                yf[i, j] = T.Cast(in_dt, T.Cast("float32", T.Cast("float4_e2m1fn", T.clamp(xf[i, j] / sc[i], -6.0, 6.0)))
                                  * sc[i])
            T.copy(yf, Y[bm * BLK_M, bk * block])

    return fp4_fake_quant_k


@implement("act_quant", "tilelang")
def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.size(-1)
    assert K % block == 0, f"act_quant: last dim {K} is not a multiple of {block}"
    x2 = x.reshape(-1, K).contiguous()
    if x2.size(0) == 0:
        return REGISTRY["act_quant"].ref(x, block)
    key = (K, block, str(x.dtype))
    kern = build("act_quant", key, lambda: tilelang.compile(act_quant_kernel(K, block, tl_dtype(x.dtype)),
                                                              out_idx=[1, 2]))
    if kern is None:
        return REGISTRY["act_quant"].ref(x, block)
    q, s = kern(x2)
    return q.view(x.shape), s.view(*x.shape[:-1], K // block)


@implement("rms_norm_quant", "tilelang")
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, block: int = 128,
                   split: bool = False) -> tuple:
    K = x.size(-1)
    x2 = x.reshape(-1, K).contiguous()
    if block != 128 or K % 128 or x2.size(0) == 0:
        if x2.size(0):
            ops.runtime_fallback("rms_norm_quant", f"the TileLang kernel takes block 128 and K % 128 == 0, not "
                                                   f"block {block}, K {K}")
        return REGISTRY["rms_norm_quant"].ref(x, weight, eps, block, split)
    key = (K, str(x.dtype), weight is not None, float(eps))
    kern = build("rms_norm_quant", key, lambda: tilelang.compile(
        rms_norm_quant_kernel(K, tl_dtype(x.dtype), weight is not None, float(eps)), out_idx=[2, 3, 4]))
    if kern is None:
        return REGISTRY["rms_norm_quant"].ref(x, weight, eps, block, split)
    w = weight.float().contiguous() if weight is not None else x2.new_empty(K, dtype=torch.float32)
    y, q, s = kern(x2, w)
    y, q, s = y.view(x.shape), q.view(x.shape), s.view(*x.shape[:-1], K // 128)
    return (y, q, s, bf16_split(q, s)) if split else (y, q, s)


@implement("fp4_fake_quant", "tilelang")
def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    K = x.size(-1)
    x2 = x.reshape(-1, K).contiguous()
    if K % block or x2.size(0) == 0 or x.dtype not in DTYPES_16:
        if x2.size(0):
            ops.runtime_fallback("fp4_fake_quant", f"the TileLang kernel takes bf16/fp16 rows of a multiple of "
                                                   f"{block}, not {x.dtype} [..., {K}]")
        return REGISTRY["fp4_fake_quant"].ref(x, block)
    kern = build("fp4_fake_quant", (K, block, str(x.dtype)), lambda: tilelang.compile(
        fp4_fake_quant_kernel(K, block, tl_dtype(x.dtype)), out_idx=[1]))
    if kern is None:
        return REGISTRY["fp4_fake_quant"].ref(x, block)
    return kern(x2).view(x.shape)
