"""Sparse shared-KV attention with a sink (prefill and decode alike).

One program per query token (b, s) and head block: the token's K selected kv rows are gathered by
index in BK-row tiles, logits = Q Kᵀ for all heads of the block at once (K = V is shared across
heads), online softmax in fp32 seeded with the sink (m = sink, l = exp(sink - sink) = 1, so the sink
sits in the denominator only and a token whose slots are all -1 gets exactly 0), -1 slots masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2


@triton.jit
def _sparse_attn_kernel(q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, S, H, N, D, KSEL, scale,
                        BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr):
    bs = tl.program_id(0).to(tl.int64)  # b * S + s
    hb = tl.program_id(1)
    b = bs // S
    h = hb * BH + tl.arange(0, BH)
    d = tl.arange(0, BD)
    mh = h < H
    md = d < D
    q = tl.load(q_ptr + (bs * H + h[:, None]) * D + d[None, :], mask=mh[:, None] & md[None, :], other=0.0)
    sink = tl.load(sink_ptr + h, mask=mh, other=0.0).to(tl.float32)
    m_i = sink
    l_i = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    for k0 in range(0, KSEL, BK):
        kk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + bs * KSEL + kk, mask=kk < KSEL, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(kv_ptr + (b * N + idx[:, None]) * D + d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        if IEEE:
            logits = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(kv))
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, kv.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(kv.dtype), kv)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + (bs * H + h[:, None]) * D + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mh[:, None] & md[None, :])


@implement("sparse_attn", "triton")
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    B, S, H, D = q.shape
    N = kv.size(1)
    KSEL = idx.size(-1)
    q, kv, sink, idx = q.contiguous(), kv.contiguous(), sink.float().contiguous(), idx.contiguous()
    o = torch.empty_like(q)
    if B * S * H == 0:
        return o
    ieee = q.dtype == torch.float32 or kv.dtype == torch.float32 or q.dtype != kv.dtype
    BH = max(16, min(p2(H), 64))
    BD = max(16, p2(D))
    BK = 16 if BD >= 256 else 32
    _sparse_attn_kernel[(B * S, triton.cdiv(H, BH))](q, kv, sink, idx, o, S, H, N, D, KSEL, float(scale),
                                                      BH=BH, BK=BK, BD=BD, IEEE=ieee)
    return o
