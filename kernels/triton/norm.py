"""RMSNorm: one program per row, two passes over the row in BLOCK chunks (any width), fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * N
    y_row = y_ptr + row * N
    acc = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += x * x
    r = tl.math.rsqrt(tl.sum(acc, 0) / N + eps)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        m = cols < N
        y = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32) * r
        if HAS_W:
            y = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) * y
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@implement("rms_norm", "triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    N = x.size(-1)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rows = xc.numel() // max(N, 1)
    if rows == 0:
        return y
    _rms_norm_kernel[(rows,)](xc, weight if weight is not None else xc, y, N, float(eps),
                              HAS_W=weight is not None, BLOCK=min(p2(N), 4096))
    return y
