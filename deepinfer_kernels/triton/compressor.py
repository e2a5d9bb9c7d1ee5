"""Compressor kernels: gated pooling (per window and channel block, softmax over the slots, weighted sum) and the
fused decode step (state update + pooling of the current window)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2, pdl, pdl_wait, unit_last_stride


@triton.jit
def _compress_pool_kernel(kv_ptr, sc_ptr, y_ptr, SLOTS, D, BS: tl.constexpr, BD: tl.constexpr):
    pdl_wait()
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
    _compress_pool_kernel[(B * W, triton.cdiv(D, BD))](kv, score, y, SL, D, BS=BS, BD=BD, **pdl())
    return y


@triton.jit
def _compress_decode_kernel(kv_ptr, sc_ptr, ape_ptr, pos_ptr, rows_ptr, skv_ptr, ssc_ptr, y_ptr, SLOTS, C2, D, r,
                            KV_RS, SC_RS, OVERLAP: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    # Program (token b, channel block j): every slot of the channels it owns -- j, and with OVERLAP also
    # d + j (the other half of the same pooled channel) -- so no other program touches them and the
    # state update needs no barrier. The token's own slot is taken from registers, never re-read.
    pdl_wait()
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BD + tl.arange(0, BD)
    mj = j < D
    row = tl.load(rows_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b)
    s = p % r
    sl = tl.arange(0, BS)
    m2 = (sl[:, None] < r) & mj[None, :]
    new = (sl == s)[:, None]
    base = row * SLOTS * C2
    kv_a = tl.load(kv_ptr + b * KV_RS + j, mask=mj, other=0.0)
    sc_a = tl.load(sc_ptr + b * SC_RS + j, mask=mj, other=0.0) + tl.load(ape_ptr + s * C2 + j, mask=mj, other=0.0)
    first = base + sl[:, None] * C2 + j[None, :]  # slots 0..r-1, channels j
    if OVERLAP:
        kv_b = tl.load(kv_ptr + b * KV_RS + D + j, mask=mj, other=0.0)
        sc_b = tl.load(sc_ptr + b * SC_RS + D + j, mask=mj, other=0.0) + tl.load(ape_ptr + s * C2 + D + j, mask=mj,
                                                                               other=0.0)
        second = base + (r + sl[:, None]) * C2 + D + j[None, :]  # slots r..2r-1, channels d + j
        k1 = tl.load(skv_ptr + first, mask=m2, other=0.0)
        s1 = tl.load(ssc_ptr + first, mask=m2, other=float("-inf"))
        k2 = tl.where(new, kv_b[None, :], tl.load(skv_ptr + second, mask=m2, other=0.0))
        s2 = tl.where(new, sc_b[None, :], tl.load(ssc_ptr + second, mask=m2, other=float("-inf")))
        mx = tl.maximum(tl.max(s1, 0), tl.max(s2, 0))
        e1 = tl.exp(s1 - mx[None, :])
        e2 = tl.exp(s2 - mx[None, :])
        den = tl.sum(e1, 0) + tl.sum(e2, 0)
        y = tl.sum(k1 * (e1 / den[None, :]), 0) + tl.sum(k2 * (e2 / den[None, :]), 0)
        own = base + (r + s) * C2
        tl.store(skv_ptr + own + j, kv_a, mask=mj)
        tl.store(ssc_ptr + own + j, sc_a, mask=mj)
        tl.store(skv_ptr + own + D + j, kv_b, mask=mj)
        tl.store(ssc_ptr + own + D + j, sc_b, mask=mj)
        if (p + 1) % r == 0:  # window complete: its slots (second half, all channels) become the overlap half
            second_j = base + (r + sl[:, None]) * C2 + j[None, :]
            tl.store(skv_ptr + first, tl.where(new, kv_a[None, :], tl.load(skv_ptr + second_j, mask=m2)), mask=m2)
            tl.store(ssc_ptr + first, tl.where(new, sc_a[None, :], tl.load(ssc_ptr + second_j, mask=m2)), mask=m2)
            tl.store(skv_ptr + first + D, k2, mask=m2)
            tl.store(ssc_ptr + first + D, s2, mask=m2)
    else:
        k1 = tl.where(new, kv_a[None, :], tl.load(skv_ptr + first, mask=m2, other=0.0))
        s1 = tl.where(new, sc_a[None, :], tl.load(ssc_ptr + first, mask=m2, other=float("-inf")))
        e1 = tl.exp(s1 - tl.max(s1, 0)[None, :])
        y = tl.sum(k1 * (e1 / tl.sum(e1, 0)[None, :]), 0)
        tl.store(skv_ptr + base + s * C2 + j, kv_a, mask=mj)
        tl.store(ssc_ptr + base + s * C2 + j, sc_a, mask=mj)
    tl.store(y_ptr + b * D + j, y.to(y_ptr.dtype.element_ty), mask=mj)


@implement("compress_decode", "triton")
def compress_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                    kv_state: torch.Tensor, score_state: torch.Tensor, overlap: bool,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One launch for what the reference does in ~25 torch ops (gather the rows' state, write the token,
    pool, shift the overlap half, scatter back): B programs x channel blocks. kv / score are read by row
    stride (the halves of the fused wkv|wgate projection, no copies); the entry is cast on the store."""
    B, C2 = kv.shape
    r = ape.size(0)
    coff = 2 if overlap else 1
    D = C2 // coff
    y = torch.empty(B, D, dtype=out_dtype, device=kv.device)
    if B == 0 or D == 0:
        return y
    if kv_state.shape[1:] != (coff * r, C2) or score_state.shape != kv_state.shape \
            or kv_state.dtype != torch.float32 or score_state.dtype != torch.float32 \
            or not (kv_state.is_contiguous() and score_state.is_contiguous()):
        raise ValueError(f"compress_decode: states must be contiguous float32 [R, {coff * r}, {C2}], got "
                         f"{tuple(kv_state.shape)} {kv_state.dtype} / {tuple(score_state.shape)} {score_state.dtype}")
    kv, score = unit_last_stride(kv.float()), unit_last_stride(score.float())
    BS = p2(r)
    BD = max(16, min(p2(D), 2048 // BS))
    _compress_decode_kernel[(B, triton.cdiv(D, BD))](
        kv, score, ape.float().contiguous(), pos.contiguous(), rows.contiguous(), kv_state, score_state, y,
        coff * r, C2, D, r, kv.stride(0), score.stride(0), OVERLAP=bool(overlap), BS=BS, BD=BD, **pdl())
    return y
