"""mHC (manifold-constrained hyper-connections): pre-mix with in-kernel Sinkhorn, post-mix, head.

hc_pre / hc_head: one program per token. Pass 1 streams the token's hc·D inputs once, accumulating
the sum of squares and the (2+hc)·hc mix dot products (pre [hc], post [hc], comb [hc, hc] kept as
separate register tiles); the hc x hc Sinkhorn then runs in registers; pass 2 collapses the streams
with `pre`. hc_post: one program per (token, D block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2


@triton.jit
def _mix_pass(x_ptr, fn_ptr, t, HC, D, rows0, BHC: tl.constexpr, BK: tl.constexpr, COMB: tl.constexpr):
    """(sum of squares, mixes for fn rows rows0 + j (j < hc), comb mixes [hc, hc] or a dummy)."""
    KD = HC * D
    j = tl.arange(0, BHC)
    ss = tl.zeros([BK], tl.float32)
    mix_a = tl.zeros([BHC, BK], tl.float32)
    mix_b = tl.zeros([BHC, BK], tl.float32)
    mix_c = tl.zeros([BHC, BHC, BK], tl.float32)
    for k0 in range(0, KD, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < KD
        x = tl.load(x_ptr + t * KD + kk, mask=mk, other=0.0).to(tl.float32)
        ss += x * x
        fa = tl.load(fn_ptr + (rows0 + j[:, None]) * KD + kk[None, :], mask=(j[:, None] < HC) & mk[None, :], other=0.0)
        mix_a += fa.to(tl.float32) * x[None, :]
        if COMB:
            fb = tl.load(fn_ptr + (HC + j[:, None]) * KD + kk[None, :], mask=(j[:, None] < HC) & mk[None, :], other=0.0)
            mix_b += fb.to(tl.float32) * x[None, :]
            r3 = 2 * HC + j[:, None, None] * HC + j[None, :, None]
            m3 = (j[:, None, None] < HC) & (j[None, :, None] < HC) & mk[None, None, :]
            fc = tl.load(fn_ptr + r3 * KD + kk[None, None, :], mask=m3, other=0.0)
            mix_c += fc.to(tl.float32) * x[None, None, :]
    return tl.sum(ss, 0), tl.sum(mix_a, 1), tl.sum(mix_b, 1), tl.sum(mix_c, 2)


@triton.jit
def _collapse(x_ptr, y_ptr, t, pre, HC, D, BHC: tl.constexpr, BD: tl.constexpr):
    j = tl.arange(0, BHC)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = (j[:, None] < HC) & (d[None, :] < D)
        x = tl.load(x_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * x, 0)
        tl.store(y_ptr + t * D + d, y.to(y_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _hc_pre_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr, HC, D,
                   norm_eps, hc_eps, iters, BHC: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ss, mpre, mpost, mcomb = _mix_pass(x_ptr, fn_ptr, t, HC, D, 0, BHC, BK, True)
    r = tl.math.rsqrt(ss / (HC * D) + norm_eps)
    j = tl.arange(0, BHC)
    mj = j < HC
    s0 = tl.load(scale_ptr + 0)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(mpre * r * s0 + tl.load(base_ptr + j, mask=mj, other=0.0)) + hc_eps
    post = 2 * tl.sigmoid(mpost * r * s1 + tl.load(base_ptr + HC + j, mask=mj, other=0.0))
    m2 = mj[:, None] & mj[None, :]
    cb = tl.load(base_ptr + 2 * HC + j[:, None] * HC + j[None, :], mask=m2, other=0.0)
    c = tl.where(m2, mcomb * r * s2 + cb, float("-inf"))
    c = tl.exp(c - tl.max(c, 1)[:, None])
    c = tl.where(m2, c / tl.sum(c, 1)[:, None] + hc_eps, 0.0)
    c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, 1)[:, None] + hc_eps)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    tl.store(post_ptr + t * HC + j, post, mask=mj)
    tl.store(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], c, mask=m2)
    _collapse(x_ptr, y_ptr, t, tl.where(mj, pre, 0.0), HC, D, BHC, BD)


def _blocks(HC: int, D: int) -> tuple[int, int, int]:
    BHC = p2(HC)
    BK = max(16, min(p2(HC * D), 8192 // (BHC * BHC)))
    BD = max(16, min(p2(D), 1024))
    return BHC, BK, BD


@implement("hc_pre", "triton")
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, HC, D = x.shape
    xc = x.contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    post = torch.empty(B, S, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(B, S, HC, HC, dtype=torch.float32, device=x.device)
    if B * S == 0:
        return y, post, comb
    BHC, BK, BD = _blocks(HC, D)
    _hc_pre_kernel[(B * S,)](xc, fn, scale, base, y, post, comb, HC, D, float(norm_eps), float(hc_eps),
                             int(iters), BHC=BHC, BK=BK, BD=BD)
    return y, post, comb


@triton.jit
def _hc_head_kernel(x_ptr, fn_ptr, scale_ptr, base_ptr, y_ptr, HC, D, norm_eps, hc_eps,
                    BHC: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ss, mix, _b, _c = _mix_pass(x_ptr, fn_ptr, t, HC, D, 0, BHC, BK, False)
    r = tl.math.rsqrt(ss / (HC * D) + norm_eps)
    j = tl.arange(0, BHC)
    mj = j < HC
    pre = tl.sigmoid(mix * r * tl.load(scale_ptr) + tl.load(base_ptr + j, mask=mj, other=0.0)) + hc_eps
    _collapse(x_ptr, y_ptr, t, tl.where(mj, pre, 0.0), HC, D, BHC, BD)


@implement("hc_head", "triton")
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    B, S, HC, D = x.shape
    xc = x.contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    if B * S == 0:
        return y
    BHC, BK, BD = _blocks(HC, D)
    _hc_head_kernel[(B * S,)](xc, fn, scale, base, y, HC, D, float(norm_eps), float(hc_eps), BHC=BHC, BK=BK, BD=BD)
    return y


@triton.jit
def _hc_post_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, y_ptr, HC, D, BHC: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    j = tl.arange(0, BHC)
    mj = j < HC
    d = db * BD + tl.arange(0, BD)
    md = d < D
    x = tl.load(x_ptr + t * D + d, mask=md, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * HC + j, mask=mj, other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], mask=mj[:, None] & mj[None, :],
                   other=0.0).to(tl.float32)  # [j, k]
    res = tl.load(res_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=mj[:, None] & md[None, :],
                  other=0.0).to(tl.float32)  # [j, d]
    mixed = tl.sum(comb[:, :, None] * res[:, None, :], 0)  # [k, d]
    y = post[:, None] * x[None, :] + mixed
    tl.store(y_ptr + (t * HC + j[:, None]) * D + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mj[:, None] & md[None, :])


@implement("hc_post", "triton")
def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    B, S, HC, D = residual.shape
    x, residual, post, comb = x.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous()
    y = torch.empty(B, S, HC, D, dtype=x.dtype, device=x.device)
    if B * S == 0:
        return y
    BHC = p2(HC)
    BD = max(16, min(p2(D), 2048 // (BHC * BHC) if BHC > 1 else 1024))
    _hc_post_kernel[(B * S, triton.cdiv(D, BD))](x, residual, post, comb, y, HC, D, BHC=BHC, BD=BD)
    return y
