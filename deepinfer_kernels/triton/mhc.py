"""mHC (manifold-constrained hyper-connections): pre-mix with in-kernel Sinkhorn, post-mix, head.

hc_pre / hc_head run as two kernels each (grids from shapes only: graph-capturable, no host syncs,
no atomics):

1. `_hc_mix_kernel`, grid (T, nsplit) (from `TILE_TOKENS` tokens on: `_hc_mix_tiles_kernel`, 32 tokens a
   program, the same partials as one fp32 dot per K chunk): split-K over the token's hc·D inputs. fn is one [R, hc·D]
   matrix (R = (2+hc)·hc = 24 rows for hc_pre, hc for hc_head); a program streams one K chunk
   (`per` x BK columns, BR x BK <= 4096 fp32 per step with BR = p2(R)) and writes its R mix partials
   plus the partial sum of squares to a fp32 [T, nsplit, R + 1] workspace (torch.empty). nsplit makes
   T x nsplit ~ 2 x SMs: at one token, hc 4, D 4096 that is 128 programs of 12 KB of fn each instead of
   one program streaming all 1.5 MB.
2. `_hc_apply_kernel`, grid (T, cdiv(D, BD)), BD <= 256: each program sums the partials in a fixed order
   ([BS, p2(R + 1)] tiles + tl.sum: deterministic), applies rsqrt, the sigmoids and the hc x hc
   Sinkhorn in registers (a few hundred flops, redundantly per D tile so no third launch), stores
   post / comb from the first D tile, and collapses its D tile: y = sum_j pre_j x_j.

hc_post: one program per (token, D block); `moe_combine_post` the same with the MoE's combine in front.

hc_pre(..., side=branch) (decode): the apply launch collapses y only, and a second apply launch of one
program per token, issued under `side` (a second stream), computes post and comb: the 20 Sinkhorn rounds
(a serial chain of dependent reductions, which made hc_pre's apply several times slower than hc_head's, which
has none; docs/perf-log.md, "Decode on two streams") run beside the attention or MoE that reads y, and only
hc_post waits for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement
from deepinfer.settings import fusion  # DEEPINFER_DECODE_FUSIONS, read per call

from . import norm
from .moe import combined_row
from ._common import cdiv
from ._common import dot_f32, p2, pdl, pdl_wait, sms, split_k, tf32_exact
from ._common import unit_last_stride


@triton.jit
def _post_value(x, post_k, comb_col, res_col, m, HC, D, BHC: tl.constexpr):
    """The post-mix of one new stream k at some columns: post_k x + sum_j comb[j, k] res_j, fp32, the j terms in
    order as explicit FMAs -- one expression wherever it runs (`_post_mix`, and the mix kernel's POST form, which
    gathers comb[j, k] per element), so the same bits. x, post_k [..] fp32; comb_col: pointers to comb[0, k]
    (comb[j, k] at + j HC); res_col: pointers to res_0 at the columns (res_j at + j D); m: the valid ones."""
    mixed = tl.zeros_like(x)
    for j in tl.static_range(BHC):
        mj = m & (j < HC)
        c = tl.load(comb_col + j * HC, mask=mj, other=0.0).to(tl.float32)
        r = tl.load(res_col + j * D, mask=mj, other=0.0).to(tl.float32)
        mixed = tl.fma(c, r, mixed)
    return tl.fma(post_k, x, mixed)


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, ws_ptr, R, KD, KCH, NS, sub_ptr, res_ptr, post_ptr, comb_ptr, HC, D,
                   sh_ptr, K, RT, RK, ST, BR: tl.constexpr, BK: tl.constexpr, POST: tl.constexpr = 0,
                   BHC: tl.constexpr = 1):
    """ws[t, s, r] = sum over k in split s of fn[r, k] * x[t, k] (r < R); ws[t, s, R] = sum x^2.
    POST (`hc_post_pre_quant` 1, `moe_combine_post_pre_quant` / `moe_combine_post_head` 2): x is first made
    here -- the previous sub-layer's post-mix of its output into the streams res [T, HC, D] with its post / comb
    (`_post_value`, as `hc_post`), stored to x_ptr in its dtype and mixed as that stored value: one launch where
    hc_post and this one took two. The output is sub [T, D] (1), or (2) the MoE's: its K routed rows at sub_ptr
    and shared row at sh_ptr (strides RT, RK, ST) summed as `moe_combine` sums them (`combined_row`) and rounded
    to the streams' dtype, as `moe_combine_post` does."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    r = tl.arange(0, BR)
    mr = r < R
    ss = tl.zeros([BK], tl.float32)
    acc = tl.zeros([BR, BK], tl.float32)
    k_lo = sp * KCH
    for k0 in range(k_lo, k_lo + KCH, BK):
        kk = (k0 + tl.arange(0, BK)).to(tl.int64)
        mk = kk < KD
        if POST > 0:  # column kk is stream kk // D at d = kk % D
            hk = kk // D
            dd = kk % D
            if POST == 1:
                sub = tl.load(sub_ptr + t * D + dd, mask=mk, other=0.0).to(tl.float32)
            else:
                sub = combined_row(sub_ptr, sh_ptr, t, dd, mk, K, RT, RK, ST, BK)
                sub = sub.to(x_ptr.dtype.element_ty).to(tl.float32)
            pk = tl.load(post_ptr + t * HC + hk, mask=mk, other=0.0).to(tl.float32)
            y = _post_value(sub, pk, comb_ptr + t * HC * HC + hk, res_ptr + t * KD + dd, mk, HC, D, BHC)
            y = y.to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + t * KD + kk, y, mask=mk)
            x = y.to(tl.float32)
        else:
            x = tl.load(x_ptr + t * KD + kk, mask=mk, other=0.0).to(tl.float32)
        ss += x * x
        f = tl.load(fn_ptr + r[:, None] * KD + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        acc += f.to(tl.float32) * x[None, :]
    base = (t * NS + sp) * (R + 1)
    tl.store(ws_ptr + base + r, tl.sum(acc, 1), mask=mr)
    tl.store(ws_ptr + base + R, tl.sum(ss, 0))


@triton.jit
def _hc_mix_tiles_kernel(x_ptr, fn_ptr, ws_ptr, T, R, KD, KCH, NS, BT: tl.constexpr, BR: tl.constexpr,
                         BK: tl.constexpr, X_TF32: tl.constexpr):
    """`_hc_mix_kernel` for BT tokens per program (prefill): the mixes as an fp32 dot [BT, BK] x [BK, BR], so
    fn is read once per BT tokens instead of once per token. The dot is fp32-accurate on tensor cores
    (`dot_f32`: two tf32 dots for bf16 x, else 3xTF32; ~2^-21 relative per product). The "ieee" form is
    an FMA loop (524 FFMA + 103 LDS per 64-K step, offline sm_90 compile), several times slower at prefill
    sizes (docs/perf-log.md, "Prefill: pre-converted expert input, 64-head attention tiles, the non-GEMM
    kernels")."""
    pdl_wait()
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    mt = t < T
    sp = tl.program_id(1)
    r = tl.arange(0, BR)
    mr = r < R
    ss = tl.zeros([BT], tl.float32)
    acc = tl.zeros([BT, BR], tl.float32)
    k_lo = sp * KCH
    for k0 in range(k_lo, k_lo + KCH, BK):
        kk = (k0 + tl.arange(0, BK)).to(tl.int64)
        mk = kk < KD
        x = tl.load(x_ptr + t[:, None] * KD + kk[None, :], mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, 1)
        f = tl.load(fn_ptr + r[None, :] * KD + kk[:, None], mask=mr[None, :] & mk[:, None], other=0.0)
        acc = dot_f32(x, f.to(tl.float32), acc, X_TF32)
    base = (t * NS + sp) * (R + 1)
    tl.store(ws_ptr + base[:, None] + r[None, :], acc, mask=mt[:, None] & mr[None, :])
    tl.store(ws_ptr + base + R, ss, mask=mt)


@triton.jit
def _pick1(v, w, idx):
    """v[idx] for a [BW] vector v with positions w and a 1-D index tile idx (exact: one nonzero term)."""
    return tl.sum(tl.where(w[None, :] == idx[:, None], v[None, :], 0.0), 1)


@triton.jit
def _pick2(v, w, idx):
    """v[idx] for a 2-D index tile idx."""
    return tl.sum(tl.where(w[None, None, :] == idx[:, :, None], v[None, None, :], 0.0), 2)


@triton.jit
def _mixes(ws_ptr, t, NS, R, KD, norm_eps, BW: tl.constexpr, BS: tl.constexpr):
    """Token t's mixes from the split-K workspace: (mix [BW] -- the R mix sums, the sum of squares at R --,
    their positions w, 1 / rms of the token's KD stream values). The NS partials are summed in a fixed
    order ([BS, BW] tiles, then tl.sum): deterministic."""
    W = R + 1
    w = tl.arange(0, BW)
    s = tl.arange(0, BS)
    acc = tl.zeros([BS, BW], tl.float32)
    for s0 in range(0, NS, BS):
        ss_ = s0 + s
        acc += tl.load(ws_ptr + (t * NS + ss_[:, None]) * W + w[None, :],
                       mask=(ss_[:, None] < NS) & (w[None, :] < W), other=0.0)
    mix = tl.sum(acc, 0)
    ssq = tl.sum(tl.where(w == R, mix, 0.0), 0)
    return mix, w, tl.math.rsqrt(ssq / KD + norm_eps)


@triton.jit
def _pre(mix, w, r, scale_ptr, base_ptr, HC, hc_eps, BHC: tl.constexpr):
    """pre [BHC] = sigmoid(mix_j · r · scale_0 + base_j) + hc_eps for the HC streams (0 past HC is not
    masked here: callers mask)."""
    j = tl.arange(0, BHC)
    mj = j < HC
    return tl.sigmoid(_pick1(mix, w, j) * r * tl.load(scale_ptr + 0)
                      + tl.load(base_ptr + j, mask=mj, other=0.0)) + hc_eps


@triton.jit
def _hc_apply_kernel(x_ptr, ws_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr, HC, D, NS,
                     norm_eps, hc_eps, iters, FULL: tl.constexpr, BHC: tl.constexpr, BW: tl.constexpr,
                     BS: tl.constexpr, BD: tl.constexpr, COMB: tl.constexpr = True, APPLY: tl.constexpr = True):
    """FULL (hc_pre) with COMB: post / comb from the first D tile; APPLY: y of the program's D tile. The
    `side` form of hc_pre launches it twice, APPLY only (pre is all y needs) and COMB only (one program
    per token), the second on another stream: the same expressions, so the same bits."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    if FULL:
        R = (2 + HC) * HC
    else:
        R = HC
    mix, w, r = _mixes(ws_ptr, t, NS, R, HC * D, norm_eps, BW, BS)
    j = tl.arange(0, BHC)
    mj = j < HC
    pre = _pre(mix, w, r, scale_ptr, base_ptr, HC, hc_eps, BHC)
    if FULL and COMB:
        post = 2 * tl.sigmoid(_pick1(mix, w, HC + j) * r * tl.load(scale_ptr + 1)
                              + tl.load(base_ptr + HC + j, mask=mj, other=0.0))
        m2 = mj[:, None] & mj[None, :]
        cidx = 2 * HC + j[:, None] * HC + j[None, :]
        cb = tl.load(base_ptr + cidx, mask=m2, other=0.0)
        c = tl.where(m2, _pick2(mix, w, cidx) * r * tl.load(scale_ptr + 2) + cb, float("-inf"))
        c = tl.exp(c - tl.max(c, 1)[:, None])
        c = tl.where(m2, c / tl.sum(c, 1)[:, None] + hc_eps, 0.0)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, 1)[:, None] + hc_eps)
            c = c / (tl.sum(c, 0)[None, :] + hc_eps)
        if db == 0:
            tl.store(post_ptr + t * HC + j, post, mask=mj)
            tl.store(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], c, mask=m2)
    if APPLY:
        pre = tl.where(mj, pre, 0.0)
        d = db * BD + tl.arange(0, BD)
        m = mj[:, None] & (d[None, :] < D)
        x = tl.load(x_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * x, 0)
        tl.store(y_ptr + t * D + d, y.to(y_ptr.dtype.element_ty), mask=d < D)


TILE_TOKENS = 64
"""From this many tokens (prefill) the mix runs token-tiled: per-token programs re-read the whole fn
([24, 16384] fp32 = 1.5 MB for hc_pre) once per token, which dominates the call at prompt lengths."""


APPLY_WARPS_DECODE = 1
"""Warps of a decode-sized `_hc_apply_kernel` program. Its time is the latency of the partial sums and the
Sinkhorn iterations on a [hc, hc] tile (20 x two row/column sums); in one warp those reductions are
shuffles, across warps each also crosses shared memory behind a barrier."""

MIX_TILE = 8192
"""fn elements (BR x BK) a decode-sized mix program reads per K step; with the token count it sets the
number of split-K partials (ns) each apply program sums (64 at batch 1, hc 4, D 4096)."""
APPLY_PARTIALS = 16
"""Partials per thread in one load of the apply's [BS, BW] tile. All of a program's 4096 / BW partials at once
(128 per thread in one warp) spill the tile to local memory (offline sm_90 compile); 32 a thread in one warp
spills too, and bounding the tile by a loop of dependent loads is slower still. One warp with 16 a thread was
the fastest of the 1-4 warp settings tried at decode sizes (docs/perf-log.md, "Fewer decode launches, FP8
`wo_a`, LM head tiles" and "Decode latency tiles, bf16 compressor weights, 64-row FP8 prefill tiles")."""


def _mix(xc, T, HC, D, R, fn, post_in=None) -> tuple[torch.Tensor, int, bool]:
    """The mix launch: -> (ws [T, ns, R + 1] split-K partials, ns, tiled). Below `TILE_TOKENS` a token's
    partials are the same bits at every T (ns is one token's split); from it on the token-tiled kernel's.
    post_in (decode sizes only): xc is first written as `hc_post` of (sub [T, D], res, post, comb), or as
    `moe_combine_post` of ((routed [T, K, D], shared [T, D]), res, post, comb)."""
    KD = HC * D
    tiled = T >= TILE_TOKENS  # prefill: BT tokens per program share each fn tile (tl.dot: dims >= 16)
    assert post_in is None or not tiled, "the post-mix goes into the decode-sized mix only"
    BT = 64 if tiled else 1
    BR = max(16, p2(R)) if tiled else p2(R)
    BK = 64 if tiled else max(16, min(p2(KD), MIX_TILE // BR))
    # decode sizes: the split of one token whatever T, so a token's partials -- and the order the apply sums
    # them in -- do not depend on how many tokens share the call (a verify step of S tokens, a batch of B
    # rows: the same bits as one decode step of that row)
    per, ns = split_k(cdiv(KD, BK), cdiv(T, BT) if tiled else 1, 2 * sms(xc.device))
    ws = torch.empty(T, ns, R + 1, dtype=torch.float32, device=xc.device)
    if tiled:
        _hc_mix_tiles_kernel[(cdiv(T, BT), ns)](xc, fn, ws, T, R, KD, per * BK, ns, BT=BT, BR=BR, BK=BK,
                                                       X_TF32=tf32_exact(xc), **pdl())
    else:
        mode, post = 0, (xc, xc, xc, xc, 0, 0, xc, 0, 0, 0, 0)
        if post_in is not None and isinstance(post_in[0], tuple):  # the MoE's rows, summed in the kernel
            (routed, shared), res, p, c = post_in
            mode, post = 2, (routed, res, p, c, HC, D, shared, routed.size(1), routed.stride(0), routed.stride(1),
                             shared.stride(0))
        elif post_in is not None:
            mode, post = 1, (*post_in, HC, D, xc, 0, 0, 0, 0)
        _hc_mix_kernel[(T, ns)](xc, fn, ws, R, KD, per * BK, ns, *post, BR=BR, BK=BK, POST=mode, BHC=p2(HC),
                                **pdl())
    return ws, ns, tiled


def _apply_meta(HC: int, R: int, D: int, ns: int, tiled: bool, full: bool) -> dict:
    """Launch constants of `_hc_apply_kernel` (BHC, BW, BS, BD, num_warps, FULL). One D tile per 256 columns at
    decode (parallelism); at prefill wider tiles, since every tile redoes the partial sums and the Sinkhorn
    iterations (T x 16 programs of that at D 4096)."""
    BW = p2(R + 1)
    nw = 4 if tiled else APPLY_WARPS_DECODE
    return dict(FULL=full, BHC=p2(HC), BW=BW, BS=max(2, min(p2(ns), APPLY_PARTIALS * 32 * nw // BW)),
                BD=max(16, min(p2(D), 1024 if tiled else 256)), num_warps=nw)


def _pre_buffers(x, fn, scale, base):
    """hc_pre's operands as the kernels read them (contiguous, f32 parameters) and its outputs y, post, comb."""
    B, S, HC, D = x.shape
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    post = torch.empty(B, S, HC, dtype=torch.float32, device=x.device)
    comb = torch.empty(B, S, HC, HC, dtype=torch.float32, device=x.device)
    return x.contiguous(), fn, scale, base, y, post, comb


def _comb(args: tuple, meta: dict, T: int, ws: torch.Tensor, side) -> None:
    """post / comb (the Sinkhorn rounds) in an apply launch of one program per token, issued under `side`
    (beside the sub-layer, which needs y only) or, side None, here."""
    if side is None:
        _hc_apply_kernel[(T, 1)](*args, APPLY=False, **meta, **pdl())
        return
    with side:
        if ws.is_cuda:  # the partials are freed on this stream when hc_pre returns: not reused before the read
            ws.record_stream(torch.cuda.current_stream(ws.device))
        _hc_apply_kernel[(T, 1)](*args, APPLY=False, **meta, **pdl())


def _mix_and_apply(xc, fn, scale, base, y, post, comb, HC, D, norm_eps, hc_eps, iters, full, side=None,
                   post_in=None):
    T = y.numel() // D
    R = (2 + HC) * HC if full else HC
    ws, ns, tiled = _mix(xc, T, HC, D, R, fn, post_in)
    args = (xc, ws, scale, base, y, post, comb, HC, D, ns, float(norm_eps), float(hc_eps), int(iters))
    meta = _apply_meta(HC, R, D, ns, tiled, full)
    grid = (T, cdiv(D, meta["BD"]))
    if side is None:
        _hc_apply_kernel[grid](*args, **meta, **pdl())
        return
    _hc_apply_kernel[grid](*args, COMB=False, **meta, **pdl())
    _comb(args, meta, T, ws, side)


@implement("hc_pre", "triton")
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int, side=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, S, HC, D = x.shape
    xc, fn, scale, base, y, post, comb = _pre_buffers(x, fn, scale, base)
    if B * S == 0:
        return y, post, comb
    _mix_and_apply(xc, fn, scale, base, y, post, comb, HC, D, norm_eps, hc_eps, iters, True, side)
    return y, post, comb


@implement("hc_pre_quant", "triton")
def hc_pre_quant(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                 hc_eps: float, iters: int, weight: torch.Tensor | None, eps: float, side=None, split: bool = False
                 ) -> tuple:
    """`hc_pre` then `rms_norm_quant` of its y (two launches, post / comb under `side` when given).

    At every size and with or without `side` the bits are those two kernels', so a decode step (side stream on
    CUDA), the same step in order, and a speculative verify of S tokens give a token the same y, q, s. A
    one-program-per-token fused form (sum, norm and quantisation of the row in registers) summed the mixes in
    its own order: most of its fp32 y differed in the last bits, a bf16 x flipped by one ulp now and then,
    the compressors' fp32 projections of x moved, and speculative greedy decoding left plain decoding
    (docs/perf-log.md, "Speculative decoding's bf16 greedy equality"). It was only marginally faster per call
    than this composition where no side stream runs."""
    y, post, comb = hc_pre(x, fn, scale, base, norm_eps, hc_eps, iters, side)
    return (*norm.rms_norm_quant(y, weight, eps, 128, split=split), post, comb)


def _post_fused(op: str, residual: torch.Tensor) -> bool:
    """Does fused op `op`'s post-mix go into the next mix launch: decode sizes (the token-tiled prefill mix has no
    POST form) with the fusion on (DEEPINFER_DECODE_FUSIONS)."""
    T = residual.size(0) * residual.size(1)
    return fusion(op) and 0 < T < TILE_TOKENS


def _post_pre_quant(post_in: tuple, dtype: torch.dtype, residual: torch.Tensor, fn, scale, base, norm_eps, hc_eps,
                    iters, weight, eps, side, split) -> tuple:
    """The new streams (dtype) written by the pre-mix's mix launch from `_mix`'s post_in, then the pre-mix's apply
    and norm-quant, as `hc_pre_quant` -> (streams, y, q, s[, split form], post, comb)."""
    B, S, HC, D = residual.shape
    h = torch.empty(B, S, HC, D, dtype=dtype, device=residual.device)
    hc, fn, scale, base, y, post, comb = _pre_buffers(h, fn, scale, base)
    _mix_and_apply(hc, fn, scale, base, y, post, comb, HC, D, norm_eps, hc_eps, iters, True, side, post_in)
    return (h, *norm.rms_norm_quant(y, weight, eps, 128, split=split), post, comb)


@implement("hc_post_pre_quant", "triton")
def hc_post_pre_quant(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      scale: torch.Tensor, base: torch.Tensor, norm_eps: float, hc_eps: float, iters: int,
                      weight: torch.Tensor | None, eps: float, side=None, split: bool = False) -> tuple:
    """Decode sizes (below `TILE_TOKENS`): the post-mix inside the mix launch (`_hc_mix_kernel`'s POST form), so
    the attention's hc_post and the MoE's pre-mix take one launch fewer on the critical path; the streams, y, q, s,
    post and comb are the bits of `hc_post` then `hc_pre_quant`. Prefill sizes run the two."""
    pre = (fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side, split)
    if not _post_fused("hc_post_pre_quant", residual):
        h = hc_post(x, residual, post, comb)
        return (h, *hc_pre_quant(h, *pre))
    post_in = (x.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous())
    return _post_pre_quant(post_in, x.dtype, residual, *pre)


def _moe_post_in(routed, shared, residual, post, comb) -> tuple:
    """`_mix`'s post_in for the MoE's output: its rows read through their strides (unit columns)."""
    return ((unit_last_stride(routed), unit_last_stride(shared)), residual.contiguous(), post.contiguous(),
            comb.contiguous())


@implement("moe_combine_post_pre_quant", "triton")
def moe_combine_post_pre_quant(routed: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                               comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                               norm_eps: float, hc_eps: float, iters: int, weight: torch.Tensor | None, eps: float,
                               side=None, split: bool = False) -> tuple:
    """`hc_post_pre_quant` for a MoE sub-layer's output (the next block's attention pre-mix): its rows summed and
    post-mixed inside the mix launch at decode sizes, the bits of `moe_combine_post` then `hc_pre_quant`."""
    pre = (fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side, split)
    if not _post_fused("moe_combine_post_pre_quant", residual):
        h = moe_combine_post(routed, shared, residual, post, comb)
        return (h, *hc_pre_quant(h, *pre))
    return _post_pre_quant(_moe_post_in(routed, shared, residual, post, comb), residual.dtype, residual, *pre)


@implement("moe_combine_post_head", "triton")
def moe_combine_post_head(routed: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                          norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last block's MoE output post-mixed inside the hc head's mix launch at decode sizes: (streams, head
    output), the bits of `moe_combine_post` then `hc_head`."""
    if not _post_fused("moe_combine_post_head", residual):
        h = moe_combine_post(routed, shared, residual, post, comb)
        return h, hc_head(h, fn, scale, base, norm_eps, hc_eps)
    B, S, HC, D = residual.shape
    h = torch.empty(B, S, HC, D, dtype=residual.dtype, device=residual.device)
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    y = torch.empty(B, S, D, dtype=residual.dtype, device=residual.device)
    _mix_and_apply(h, fn, scale, base, y, y, y, HC, D, norm_eps, hc_eps, 1, False, None,
                   _moe_post_in(routed, shared, residual, post, comb))
    return h, y


@implement("hc_head", "triton")
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    B, S, HC, D = x.shape
    xc = x.contiguous()
    fn, scale, base = fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous()
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    if B * S == 0:
        return y
    _mix_and_apply(xc, fn, scale, base, y, y, y, HC, D, norm_eps, hc_eps, 1, False)
    return y


@triton.jit
def _post_mix(x, res_ptr, post_ptr, comb_ptr, y_ptr, t, d, md, HC, D, BHC: tl.constexpr):
    """New streams of token t at columns d from the sub-layer output x [BD] (fp32): post_k x + Σ_j comb[j, k] res_j
    (`_post_value`, stream by stream)."""
    for k in tl.static_range(BHC):  # stream k of the D block, `_post_value`'s expression
        mk = md & (k < HC)
        kd = d * 0 + k  # k at every column: the gathers `_post_value` makes (one address each)
        pk = tl.load(post_ptr + t * HC + kd, mask=mk, other=0.0).to(tl.float32)
        y = _post_value(x, pk, comb_ptr + t * HC * HC + kd, res_ptr + t * HC * D + d, mk, HC, D, BHC)
        tl.store(y_ptr + (t * HC + k) * D + d, y.to(y_ptr.dtype.element_ty), mask=mk)


@triton.jit
def _hc_post_kernel(x_ptr, res_ptr, post_ptr, comb_ptr, y_ptr, HC, D, BHC: tl.constexpr, BD: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < D
    x = tl.load(x_ptr + t * D + d, mask=md, other=0.0).to(tl.float32)
    _post_mix(x, res_ptr, post_ptr, comb_ptr, y_ptr, t, d, md, HC, D, BHC)


@triton.jit
def _moe_combine_post_kernel(r_ptr, s_ptr, res_ptr, post_ptr, comb_ptr, y_ptr, HC, D, K, RT, RK, ST,
                             BHC: tl.constexpr, BD: tl.constexpr):
    """`moe_combine` then `hc_post` for token t's D block: the routed rows in pair order plus the shared row in
    fp32 (`_moe_combine_kernel`'s sum), rounded to the streams' dtype as that launch stores it, then the post-mix
    of `_hc_post_kernel`: the bits of the two launches, in one."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < D
    acc = combined_row(r_ptr, s_ptr, t, d, md, K, RT, RK, ST, BD)
    x = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    _post_mix(x, res_ptr, post_ptr, comb_ptr, y_ptr, t, d, md, HC, D, BHC)


def _post_bd(HC: int, D: int) -> tuple[int, int]:
    """(BHC, BD) of the post-mix launches: the [hc, hc, BD] product stays ~2048 values a program."""
    BHC = p2(HC)
    return BHC, max(16, min(p2(D), 2048 // (BHC * BHC) if BHC > 1 else 1024))


@implement("hc_post", "triton")
def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    B, S, HC, D = residual.shape
    x, residual, post, comb = x.contiguous(), residual.contiguous(), post.contiguous(), comb.contiguous()
    y = torch.empty(B, S, HC, D, dtype=x.dtype, device=x.device)
    if B * S == 0:
        return y
    BHC, BD = _post_bd(HC, D)
    _hc_post_kernel[(B * S, cdiv(D, BD))](x, residual, post, comb, y, HC, D, BHC=BHC, BD=BD, **pdl())
    return y


@implement("moe_combine_post", "triton")
def moe_combine_post(routed: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> torch.Tensor:
    """One launch where `moe_combine` and `hc_post` took two (decode: one launch and its boundary fewer per
    MoE sub-layer on the batch-1 critical path); routed and shared read through their row strides."""
    B, S, HC, D = residual.shape
    T, K, _ = routed.shape
    routed, shared = unit_last_stride(routed), unit_last_stride(shared)
    residual, post, comb = residual.contiguous(), post.contiguous(), comb.contiguous()
    y = torch.empty(B, S, HC, D, dtype=residual.dtype, device=residual.device)
    if T == 0:
        return y
    BHC, BD = _post_bd(HC, D)
    _moe_combine_post_kernel[(T, cdiv(D, BD))](routed, shared, residual, post, comb, y, HC, D, K,
                                                      routed.stride(0), routed.stride(1), shared.stride(0),
                                                      BHC=BHC, BD=BD, **pdl())
    return y
