"""Block-scaled GEMMs: FP8 x FP8 (128-block scales) and FP8 x FP4 (e2m1 unpacked in-kernel).

C = A Wᵀ, fp32 accumulation. Both operands stay in 8 bits into tl.dot (e4m3 x e4m3 -> fp32 is exact
per product), and the power-of-two scales multiply each K-block's partial sum, which equals the
reference's "scale first, then multiply" exactly up to the fp32 summation order. The dots pass
max_num_imprecise_acc=0: Hopper's FP8 wgmma otherwise accumulates with a ~14-bit mantissa (Triton's
sm_90 default), which at K = 7168 misses the fp32 tolerance by 100x (seen on H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, KS_A, KS_W,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # BK == 128: one scale per K block for A (per row) and for W (per 128x128 block)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    n_blk = (pid_n * BN) // 128  # BN divides 128: the whole N tile shares one weight-scale row
    for kb in range(0, tl.cdiv(K, BK)):
        k = kb * BK + rk
        a = tl.load(a_ptr + rm[:, None] * K + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        sa = tl.load(as_ptr + rm * KS_A + kb, mask=rm < M, other=0.0)
        sw = tl.load(ws_ptr + n_blk * KS_W + kb)
        acc += tl.dot(a, w, max_num_imprecise_acc=0) * (sa[:, None] * sw)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@implement("fp8_gemm", "triton")
def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M, K = a.shape
    N = w.size(0)
    a, a_s, w, w_s = a.contiguous(), a_s.float().contiguous(), w.contiguous(), w_s.float().contiguous()
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    BM = 16 if M <= 16 else (32 if M <= 32 else 64)
    BN = 64
    _fp8_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        a, a_s, w, w_s, c, M, N, K, a_s.size(1), w_s.size(1), BM=BM, BN=BN, BK=128)
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
def _fp4_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, M, N, K, KS_A, KS_W,
                     BM: tl.constexpr, BN: tl.constexpr):
    # K steps of 32 = one FP4 scale group = 16 packed bytes (byte i: element 2i low nibble, 2i+1 high).
    # The dot's K order is free, so lane j < 16 takes element 2j (low nibble of byte j) and lane
    # j >= 16 element 2(j-16)+1 (high nibble of byte j-16): A is loaded in that permuted column order,
    # no interleave needed. e2m1 values are exact in e4m3, so the dot is e4m3 x e4m3 -> fp32 (K = 32).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    j = tl.arange(0, 32)
    jb = j % 16
    hi = j >= 16
    acol = 2 * jb + hi.to(tl.int32)
    acc = tl.zeros([BM, BN], tl.float32)
    KH = K // 2
    for g in range(0, tl.cdiv(K, 32)):
        ka = g * 32 + acol
        kb = g * 16 + jb
        a = tl.load(a_ptr + rm[:, None] * K + ka[None, :], mask=(rm[:, None] < M) & (ka[None, :] < K), other=0.0)
        byte = tl.load(w_ptr + rn[None, :] * KH + kb[:, None], mask=(rn[None, :] < N) & (kb[:, None] < KH), other=0)
        byte = byte.to(tl.int32) & 0xFF
        code = tl.where(hi[:, None], byte >> 4, byte & 0xF)
        w = _e2m1(code).to(a_ptr.dtype.element_ty)
        part = tl.dot(a, w, max_num_imprecise_acc=0)
        sa = tl.load(as_ptr + rm * KS_A + (g * 32) // 128, mask=rm < M, other=0.0)
        sw = tl.load(ws_ptr + rn * KS_W + g, mask=rn < N, other=0.0)
        acc += part * sa[:, None] * sw[None, :]
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@implement("fp4_gemm", "triton")
def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    M, K = a.shape
    N = w.size(0)
    assert K % 32 == 0 and w.size(1) * 2 == K, "fp4_gemm: K must be a multiple of 32 and w [N, K/2]"
    a, a_s, w, w_s = a.contiguous(), a_s.float().contiguous(), w.contiguous(), w_s.float().contiguous()
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    BM = 16 if M <= 16 else (32 if M <= 32 else 64)
    BN = 64
    _fp4_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        a, a_s, w.view(torch.uint8), w_s, c, M, N, K, a_s.size(1), w_s.size(1), BM=BM, BN=BN)
    return c
