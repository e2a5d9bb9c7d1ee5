"""Plain y = x Wᵀ (bf16 / fp16 / fp32 weights, no quantisation) as a tiled Triton GEMM.

fp32 operands use input_precision="ieee" (TF32 would cost ~1e-3 relative); accumulation is fp32.
The model calls it for the float weights of the official layout (indexer weights_proj, compressor
projections) and for every weight in `exact` numerics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import dot_ieee


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
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


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
        BM = 16 if M <= 16 else (32 if M <= 32 else 64)
        BN, BK = 64, 32
        _linear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](x2, w, y, M, N, K, BM=BM, BN=BN, BK=BK,
                                                                 IEEE=dot_ieee(x2, w))
    return y.view(*shape[:-1], N)
