"""Block quantisation kernels: FP8 act_quant / fp8_fake_quant, FP4 fake quant, Walsh-Hadamard.

A program per up to 64 consecutive blocks of the last dim (`BLOCKS_PER_PROGRAM`, fewer at decode sizes); the
scale is the reference's power-of-two ceiling of amax / fmax computed from the float bits (exact), the division
by a power of two is exact, and the float32 -> e4m3 cast rounds to nearest even with the clamp applied first
(as torch's cast).

hadamard: a tensor-core dot of a BM-row tile with the ±1 Sylvester matrix (built in registers once per
program, reused over ITERS row blocks so the build is amortised), then one multiply by N^-0.5.
bf16/fp16 inputs go into the dot in their own dtype on the GPU (±1 is exact; fp32 accumulate; under
the interpreter, whose bf16 dot is broken, as tf32-exact fp32); fp32 inputs are split into three
tf32-exact pieces (3 dots), which keeps fp32 accuracy without the FMA-bound "ieee" dot. An ieee fp32
dot with S_N rebuilt by every 32-row program is ALU-bound, far from the copy rate; this one is a streaming
copy (~67 MB at flash prefill).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv
from ._common import INTERPRET as _INTERPRET
from ._common import p2, pdl, pdl_wait, pow2_ceil, quant_e4m3_rows, sms, tf32_hi



BLOCKS_PER_PROGRAM = 64
"""Quantisation blocks per program: the [rows, K] input is the contiguous [rows * K/block, block] list of its
blocks, and a program takes 64 consecutive ones ([64, block] tile, one row per block). One program per block
would be 786K programs of 128 elements for act_quant of the flash experts' input rows at 4096 prompt tokens
([24576, 4096]), several times its bytes' time (docs/perf-log.md, "Prefill: pre-converted expert input,
64-head attention tiles, the non-GEMM kernels")."""


@triton.jit
def _fp8_block_kernel(x_ptr, q_ptr, s_ptr, y_ptr, NBLK, block, FAKE: tl.constexpr, BLOCK: tl.constexpr,
                      BR: tl.constexpr):
    pdl_wait()
    i = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)  # block index = row * NB + block of the row
    j = tl.arange(0, BLOCK)
    m = (i[:, None] < NBLK) & (j[None, :] < block)
    off = i[:, None] * block + j[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    q, s = quant_e4m3_rows(x)
    if FAKE:
        tl.store(y_ptr + off, (q.to(tl.float32) * s[:, None]).to(y_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(q_ptr + off, q, mask=m)
        tl.store(s_ptr + i, s, mask=i < NBLK)


def _per_program(nblk: int, device: torch.device) -> int:
    """Blocks per program: BLOCKS_PER_PROGRAM, fewer (a power of two) while that leaves under ~2 programs
    per SM -- a decode step's few dozen blocks keep one program each, as before."""
    per = BLOCKS_PER_PROGRAM
    while per > 1 and cdiv(nblk, per) < 2 * sms(device):
        per //= 2
    return per


@implement("act_quant", "triton")
def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.size(-1)
    assert K % block == 0, f"act_quant: last dim {K} is not a multiple of {block}"
    xc = x.contiguous()
    NB = K // block
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(*x.shape[:-1], NB, dtype=torch.float32, device=x.device)
    nblk = xc.numel() // block
    if nblk:
        BR = _per_program(nblk, x.device)
        _fp8_block_kernel[(cdiv(nblk, BR),)](xc, q, s, q, nblk, block, FAKE=False, BLOCK=p2(block), BR=BR,
                                                    **pdl())
    return q, s


@implement("fp8_fake_quant", "triton")
def fp8_fake_quant(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    K = x.size(-1)
    assert K % block == 0, f"fp8_fake_quant: last dim {K} is not a multiple of {block}"
    xc = x.contiguous()
    y = torch.empty_like(xc)
    nblk = xc.numel() // block
    if nblk:
        BR = _per_program(nblk, x.device)
        _fp8_block_kernel[(cdiv(nblk, BR),)](xc, y, y, y, nblk, block, FAKE=True, BLOCK=p2(block), BR=BR,
                                                    **pdl())
    return y


@triton.jit
def fp4_round(v):
    """Round to the nearest e2m1 magnitude grid point (ties to the even code), saturating at 6; keeps sign."""
    a = tl.minimum(tl.abs(v), 6.0)
    down = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    up = ((a >= 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a >= 1.25).to(tl.int32)
          + (a >= 1.75).to(tl.int32) + (a >= 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a >= 5.0).to(tl.int32))
    i = tl.where(down % 2 == 0, down, up)
    mag = tl.where(i <= 4, i.to(tl.float32) * 0.5,
                   tl.where(i == 5, 3.0, tl.where(i == 6, 4.0, 6.0)))
    return tl.where(v < 0, -mag, mag)


@triton.jit
def _fp4_fake_kernel(x_ptr, y_ptr, NBLK, block, BLOCK: tl.constexpr, BR: tl.constexpr):
    pdl_wait()
    i = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)  # BR consecutive blocks, as _fp8_block_kernel
    j = tl.arange(0, BLOCK)
    m = (i[:, None] < NBLK) & (j[None, :] < block)
    off = i[:, None] * block + j[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), 6.0 * 2.0**-126)
    s = pow2_ceil(tl.math.div_rn(amax, 6.0))[:, None]
    y = fp4_round(tl.minimum(tl.maximum(x / s, -6.0), 6.0)) * s
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)


@implement("fp4_fake_quant", "triton")
def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    K = x.size(-1)
    assert K % block == 0, f"fp4_fake_quant: last dim {K} is not a multiple of {block}"
    xc = x.contiguous()
    y = torch.empty_like(xc)
    nblk = xc.numel() // block
    if nblk:
        BR = _per_program(nblk, x.device)
        _fp4_fake_kernel[(cdiv(nblk, BR),)](xc, y, nblk, block, BLOCK=p2(block), BR=BR, **pdl())
    return y


@triton.jit
def _hadamard_kernel(x_ptr, y_ptr, M, scale, N: tl.constexpr, LOGN: tl.constexpr, BM: tl.constexpr,
                     ITERS: tl.constexpr, SPLIT: tl.constexpr, NATIVE: tl.constexpr, FP4: tl.constexpr = 0):
    # y = (x @ S_N) * N^-0.5 with S_N[i, j] = (-1)^popcount(i & j) (Sylvester order), built once per
    # program in registers and reused for ITERS row blocks. NATIVE: bf16/fp16 x ±1 in the input dtype
    # (exact products, fp32 accumulate). Otherwise tf32 dots, exact too: bf16/fp16 values are exact in
    # tf32, and an fp32 input is first split into three tf32-exact pieces (SPLIT).
    # FP4 > 0: then the FP4 fake quant per FP4 columns of the output as rounded to its dtype (what
    # fp4_fake_quant reads after hadamard), in registers: `hadamard(x, fp4_block)`.
    pdl_wait()
    pid = tl.program_id(0)
    i = tl.arange(0, N)
    a = i[:, None] & i[None, :]
    par = tl.zeros([N, N], tl.int32)
    for bit in tl.static_range(LOGN):
        par ^= (a >> bit) & 1
    h = tl.where(par == 0, 1.0, -1.0)
    if NATIVE:  # bf16/fp16 operands straight into the dot (±1 exact): half the registers and bytes
        h = h.to(x_ptr.dtype.element_ty)
    for it in range(ITERS):
        rows = ((pid * ITERS + it) * BM + tl.arange(0, BM)).to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * N + i[None, :], mask=rows[:, None] < M, other=0.0)
        if NATIVE:
            y = tl.dot(x, h)
        elif SPLIT:
            x = x.to(tl.float32)
            x1 = tf32_hi(x)
            r = x - x1
            x2 = tf32_hi(r)
            y = tl.dot(x1, h, input_precision="tf32")
            y = tl.dot(x2, h, y, input_precision="tf32")
            y = tl.dot(r - x2, h, y, input_precision="tf32")
        else:
            y = tl.dot(x.to(tl.float32), h, input_precision="tf32")
        if FP4 > 0:
            yb = tl.reshape((y * scale).to(y_ptr.dtype.element_ty).to(tl.float32), [BM, N // FP4, FP4])
            amax = tl.maximum(tl.max(tl.abs(yb), 2), 6.0 * 2.0**-126)
            s = pow2_ceil(tl.math.div_rn(amax, 6.0))[:, :, None]
            yb = fp4_round(tl.minimum(tl.maximum(yb / s, -6.0), 6.0)) * s
            tl.store(y_ptr + rows[:, None] * N + i[None, :], tl.reshape(yb, [BM, N]).to(y_ptr.dtype.element_ty),
                     mask=rows[:, None] < M)
        else:
            tl.store(y_ptr + rows[:, None] * N + i[None, :], (y * scale).to(y_ptr.dtype.element_ty),
                     mask=rows[:, None] < M)


@implement("hadamard", "triton")
def hadamard(x: torch.Tensor, fp4_block: int = 0) -> torch.Tensor:
    N = x.size(-1)
    assert N & (N - 1) == 0, f"Hadamard size {N} is not a power of two"
    if fp4_block and (N < 16 or fp4_block & (fp4_block - 1)):  # the two kernels in turn (fp4_fake_quant checks
        return fp4_fake_quant(hadamard(x), fp4_block)         # that the block divides N)
    assert not fp4_block or N % fp4_block == 0, f"hadamard: fp4_block {fp4_block} does not divide the last dim {N}"
    xc = x.contiguous()
    y = torch.empty_like(xc)
    M = xc.numel() // max(N, 1)
    if M == 0:
        return y
    split = x.dtype == torch.float32
    native = not _INTERPRET and x.dtype in (torch.bfloat16, torch.float16)  # the interpreter's bf16 dot is broken
    if N < 16:  # tl.dot needs every dim >= 16: run the transform at width 16 on a zero-padded copy
        xp = torch.zeros(M, 16, dtype=x.dtype, device=x.device)
        xp[:, :N] = xc.reshape(M, N)
        yp = torch.empty_like(xp)
        # H_16 restricted to the first N rows/cols is H_N (Sylvester); rescale 1/sqrt(N).
        _hadamard_kernel[(cdiv(M, 16),)](xp, yp, M, N ** -0.5, N=16, LOGN=4, BM=16, ITERS=1, SPLIT=split,
                                                NATIVE=native, **pdl())
        return yp[:, :N].reshape(x.shape).to(x.dtype)
    BM = 64 if N <= 128 else (32 if N <= 256 else 16)
    nblk = cdiv(M, BM)
    iters = 8 if nblk >= 8 * 264 else (4 if nblk >= 4 * 264 else 1)  # amortise building S_N per program
    _hadamard_kernel[(cdiv(nblk, iters),)](xc, y, M, N ** -0.5, N=N, LOGN=N.bit_length() - 1, BM=BM,
                                                    ITERS=iters, SPLIT=split, NATIVE=native, FP4=fp4_block,
                                                    num_warps=8 if N >= 128 else 4, **pdl())
    return y
