"""Compressor gated pooling: per (window, channel block) softmax over the slots, weighted sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2


@triton.jit
def _compress_pool_kernel(kv_ptr, sc_ptr, y_ptr, SLOTS, D, BS: tl.constexpr, BD: tl.constexpr):
    w = tl.program_id(0).to(tl.int64)  # (b, window)
    db = tl.program_id(1)
    s = tl.arange(0, BS)
    d = db * BD + tl.arange(0, BD)
    m = (s[:, None] < SLOTS) & (d[None, :] < D)
    off = w * SLOTS * D + s[:, None] * D + d[None, :]
    sc = tl.load(sc_ptr + off, mask=m, other=float("-inf")).to(tl.float32)
    kv = tl.load(kv_ptr + off, mask=m, other=0.0).to(tl.float32)
    mx = tl.max(sc, 0)
    e = tl.exp(sc - mx[None, :])
    p = e / tl.sum(e, 0)[None, :]
    y = tl.sum(kv * p, 0)
    tl.store(y_ptr + w * D + d, y, mask=d < D)


@implement("compress_pool", "triton")
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    B, W, SL, D = kv.shape
    kv, score = kv.contiguous(), score.contiguous()
    y = torch.empty(B, W, D, dtype=torch.float32, device=kv.device)
    if B * W == 0 or D == 0:
        return y
    BS = p2(SL)
    BD = max(16, min(p2(D), 4096 // BS))
    _compress_pool_kernel[(B * W, triton.cdiv(D, BD))](kv, score, y, SL, D, BS=BS, BD=BD)
    return y
