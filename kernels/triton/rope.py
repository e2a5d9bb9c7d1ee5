"""Interleaved RoPE: one program per (token, head block); pairs (2i, 2i+1) rotated in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, HALF, INVERSE: tl.constexpr,
                 BH: tl.constexpr, BR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # token (b, s)
    hb = tl.program_id(1)
    h = hb * BH + tl.arange(0, BH)
    i = tl.arange(0, BR)
    mi = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=mi, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + i, mask=mi, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    m = (h[:, None] < H) & mi[None, :]
    base = (t * H + h[:, None]) * (2 * HALF) + 2 * i[None, :]
    x0 = tl.load(x_ptr + base, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + base + 1, mask=m, other=0.0).to(tl.float32)
    y0 = x0 * c[None, :] - x1 * s[None, :]
    y1 = x0 * s[None, :] + x1 * c[None, :]
    tl.store(y_ptr + base, y0.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y_ptr + base + 1, y1.to(y_ptr.dtype.element_ty), mask=m)


@implement("rope", "triton")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    R = x.size(-1)
    H = 1 if x.dim() == 3 else x.size(2)
    xc = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty_like(xc)
    T = x.size(0) * x.size(1)
    if T == 0 or xc.numel() == 0:
        return y
    BH = min(p2(H), 16)
    _rope_kernel[(T, triton.cdiv(H, BH))](xc, cos, sin, y, H, R // 2, INVERSE=bool(inverse), BH=BH, BR=p2(R // 2))
    return y
