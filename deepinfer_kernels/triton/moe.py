"""MoE router (scores, biased top-k or hash routing, renormalised weights) and clamped SwiGLU.

moe_route runs as two kernels (grids from shapes only: CUDA-graph capturable, no host syncs):

1. `_moe_logits_kernel`, grid (cdiv(T, BT), cdiv(E, BE), nsplit): split-K gate GEMM into a fp32
   [nsplit, T, E] workspace (torch.empty). At T <= 16 (decode) it is a GEMV: fp32 FMA products reduced
   with tl.sum (exact fp32 products), BT = p2(T) >= 2, BD = 128, BE so that BT x BE x BD <= 8192, and
   nsplit so that the tiles x splits ~ 2 x SMs (256 experts x 4096 at T = 1: 8 expert tiles x 32
   splits = 256 programs instead of the single program that streamed the whole 2 MB gate). At T > 16
   it is a tl.dot GEMM on 32/64 x 64 x 32 tiles, fp32-accurate on tensor cores (`dot_f32`: for bf16 x,
   exact in tf32, the gate split in two tf32 dots; fp32 x 3xTF32), split over D only while the tile grid
   is short of 2 x SMs.
2. `_moe_select_kernel`, one program per BT tokens with all E experts in registers: sums the splits in
   a fixed order ([BS, BT, E] tiles + tl.sum: deterministic, no atomics), applies the score function,
   stores `scores`, then biased top-k / hash routing and the weights exactly as before: top-k is k
   rounds of max over distinct 63-bit keys (value, then lower expert id -- the reference's stable-sort
   tie-break), so no sort and no ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv, next_power_of_2
from ._common import dot_f32, key_index, p2, pdl, pdl_wait, rows_2d, sms, sort_key, split_k, tf32_exact
from ._common import store_act_quant, swiglu_f32, tile_counters, unit_last_stride

_SCORE_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _softplus(x):
    # torch's softplus: x above the threshold 20, else log1p(exp(x)); log1p via the compensated
    # log(u) * y / (u - 1) form (u = 1 + y), accurate to a few ulp where log(1 + y) is not.
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    l1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, l1p)


@triton.jit
def _moe_logits_kernel(x_ptr, g_ptr, ws_ptr, T, E, D, DCH, cnt_ptr, bias_ptr, t2e_ptr, ids_ptr, w_ptr, i_ptr, s_ptr,
                       TOPK, route_scale, BT: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr, DOT: tl.constexpr,
                       X_TF32: tl.constexpr, SELECT: tl.constexpr, FUNC: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HASH: tl.constexpr, BE2: tl.constexpr, BKT: tl.constexpr, BS: tl.constexpr, ONE: tl.constexpr):
    """ws[s, t, e] = sum over d in split s of x[t, d] * gate[e, d], fp32-accurate. The FMA form keeps the
    products elementwise over the D steps and reduces them over BD once at the end (a per-step reduction
    is a cross-thread shuffle tree every step; deferring makes moe_route markedly faster at 8-16 tokens and
    leaves 1 token unchanged; docs/perf-log.md, "In-kernel split-K reduction, fewer decode launches, deferred
    FMA reductions").

    SELECT (decode sizes): the last program of a token tile to store its partial -- the one whose increment of
    the tile's counter returns (E tiles x splits) - 1, after a barrier and a release/acquire atomic, as
    `splitk_store` -- runs `_select` for the tile (one launch instead of two) and re-arms the counter."""
    pdl_wait()
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    e = (pid_e * BE + tl.arange(0, BE)).to(tl.int64)
    mt = t < T
    me = e < E
    acc = tl.zeros([BT, BE], tl.float32)
    if DOT:  # the FMA form's accumulator is unused
        acc3 = tl.zeros([1, 1, 1], tl.float32)
    else:
        acc3 = tl.zeros([BT, BE, BD], tl.float32)
    d_lo = pid_s * DCH
    for d0 in range(d_lo, d_lo + DCH, BD):
        d = (d0 + tl.arange(0, BD)).to(tl.int64)
        md = d < D
        x = tl.load(x_ptr + t[:, None] * D + d[None, :], mask=mt[:, None] & md[None, :], other=0.0).to(tl.float32)
        if DOT:
            g = tl.load(g_ptr + e[None, :] * D + d[:, None], mask=me[None, :] & md[:, None], other=0.0)
            acc = dot_f32(x, g.to(tl.float32), acc, X_TF32)
        else:
            g = tl.load(g_ptr + e[:, None] * D + d[None, :], mask=me[:, None] & md[None, :], other=0.0)
            acc3 += x[:, None, :] * g.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, 2)
    tl.store(ws_ptr + (pid_s * T + t[:, None]) * E + e[None, :], acc, mask=mt[:, None] & me[None, :])
    if SELECT:
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) * tl.num_programs(2) - 1:
            _select(ws_ptr, bias_ptr, t2e_ptr, ids_ptr, w_ptr, i_ptr, s_ptr, pid_t, T, E, tl.num_programs(2), TOPK,
                    route_scale, FUNC, HAS_BIAS, HASH, BT, BE2, BKT, BS, ONE, True)
            tl.atomic_xchg(cnt_ptr + pid_t, 0, sem="relaxed", scope="gpu")


@triton.jit
def _select(ws_ptr, bias_ptr, t2e_ptr, ids_ptr, w_ptr, i_ptr, s_ptr, pid, T, E, NS, TOPK, route_scale,
            FUNC: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
            BKT: tl.constexpr, BS: tl.constexpr, ONE: tl.constexpr, CG: tl.constexpr):
    """Tokens pid * BT ..: sum the NS logit partials of ws [NS, T, E] in a fixed order, score, select the
    top-k (or the hash table's experts) and their weights. CG: read the partials from L2 (`.cg`): they
    were written by other programs of the same launch (`_moe_logits_kernel`'s fused select). ONE: ws is
    the scores tensor itself, overwritten in place once every thread has read it."""
    t = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    e = tl.arange(0, BE)
    mt = t < T
    me = e < E
    m2 = mt[:, None] & me[None, :]
    if ONE:
        if CG:
            acc = tl.load(ws_ptr + t[:, None] * E + e[None, :], mask=m2, other=0.0, cache_modifier=".cg")
        else:
            acc = tl.load(ws_ptr + t[:, None] * E + e[None, :], mask=m2, other=0.0)
    else:
        s = tl.arange(0, BS)
        acc3 = tl.zeros([BS, BT, BE], tl.float32)
        for s0 in range(0, NS, BS):
            ss = (s0 + s).to(tl.int64)
            wp = ws_ptr + (ss[:, None, None] * T + t[None, :, None]) * E + e[None, None, :]
            wm = (ss[:, None, None] < NS) & m2[None, :, :]
            if CG:
                acc3 += tl.load(wp, mask=wm, other=0.0, cache_modifier=".cg")
            else:
                acc3 += tl.load(wp, mask=wm, other=0.0)
        acc = tl.sum(acc3, 0)
    if FUNC == 0:
        lg = tl.where(me[None, :], acc, float("-inf"))
        ex = tl.exp(lg - tl.max(lg, 1)[:, None])
        sc = ex / tl.sum(ex, 1)[:, None]
    elif FUNC == 1:
        sc = tl.sigmoid(acc)
    else:
        sc = tl.sqrt(_softplus(acc))
    if ONE:
        # ws is s (unsplit logits, `moe_route`): the tile is held by several warps (replicas) while only one
        # of them stores, so a replica could read a score where it expects its logit. Every load first.
        tl.debug_barrier()
    tl.store(s_ptr + t[:, None] * E + e[None, :], sc, mask=m2)
    kk = tl.arange(0, BKT)
    mk = kk < TOPK
    if HASH:
        ids = tl.load(ids_ptr + t, mask=mt, other=0).to(tl.int64)
        sel = tl.load(t2e_ptr + ids[:, None] * TOPK + kk[None, :], mask=mt[:, None] & mk[None, :], other=0).to(tl.int64)
    else:
        s_sel = sc
        if HAS_BIAS:
            s_sel = sc + tl.load(bias_ptr + e, mask=me, other=0.0).to(tl.float32)[None, :]
        key = tl.where(me[None, :], sort_key(s_sel, e[None, :]), -1)
        sel = tl.zeros([BT, BKT], tl.int64)
        for r in range(0, TOPK):
            best = tl.max(key, 1)
            sel = tl.where(kk[None, :] == r, key_index(best)[:, None], sel)
            key = tl.where(key == best[:, None], -1, key)
    # gather the chosen scores: w[t, r] = sc[t, sel[t, r]]
    w = tl.sum(tl.where(sel[:, :, None] == e[None, None, :], sc[:, None, :], 0.0), 2)
    if FUNC != 0:
        w = w / tl.sum(tl.where(mk[None, :], w, 0.0), 1)[:, None]
    w = w * route_scale
    mo = mt[:, None] & mk[None, :]
    tl.store(w_ptr + t[:, None] * TOPK + kk[None, :], w, mask=mo)
    tl.store(i_ptr + t[:, None] * TOPK + kk[None, :], sel, mask=mo)


@triton.jit
def _moe_select_kernel(ws_ptr, bias_ptr, t2e_ptr, ids_ptr, w_ptr, i_ptr, s_ptr, T, E, NS, TOPK,
                       route_scale, FUNC: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
                       BT: tl.constexpr, BE: tl.constexpr, BKT: tl.constexpr, BS: tl.constexpr,
                       ONE: tl.constexpr):
    pdl_wait()
    _select(ws_ptr, bias_ptr, t2e_ptr, ids_ptr, w_ptr, i_ptr, s_ptr, tl.program_id(0), T, E, NS, TOPK, route_scale,
            FUNC, HAS_BIAS, HASH, BT, BE, BKT, BS, ONE, False)


GEMV_MAX_T = 16
ROUTE_ONE_TOKEN_BD, ROUTE_ONE_TOKEN_PER_SM = 256, 1
"""The GEMV launch (decode sizes, T <= GEMV_MAX_T): two-token tiles, 256-wide D steps and the split of one token
tile at one program per SM, so the fused select sums 8 partials (E 256, D 4096): at batch 1 the fastest of the
128-512-wide steps and 0.5-2 programs per SM tried (docs/perf-log.md, "The batch-1 critical path: norm
launches, routing, stream priority").
The tile and the split do not change with T, so a token's logits, scores and weights are the same bits
whether it is routed alone, in a batch of rows or in a speculative verify of S tokens (the general setting
-- tiles of p2(T) tokens, 128-wide steps, splits by tile count -- summed them in another order at T > 2).
More tokens are more token tiles, each re-reading the gate from L2."""
FUSED_SELECT = True
"""On the GEMV path (decode sizes) the selection runs in the logits kernel's last program of each token tile
(`_moe_logits_kernel` SELECT): one launch per routing instead of two, the same bits (`_select` either way)."""


@implement("moe_route", "triton")
def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor, topk: int, score_func: str, route_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, D = x.shape
    E = gate_w.size(0)
    func = _SCORE_FUNCS[score_func] if score_func in _SCORE_FUNCS else 2  # reference: else-branch
    k = tid2eid.size(1) if tid2eid is not None else topk
    x, gate_w = x.contiguous(), gate_w.contiguous()
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(T, k, dtype=torch.int64, device=x.device)
    scores = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return weights, indices, scores
    # Always fp32-accurate: the reference scores in fp32, and a plain bf16 wgmma at K=4096 drifted by
    # up to 2e-4. Small T: exact fp32 FMA GEMV; larger T: 3xTF32 tensor-core tiles.
    dot = T > GEMV_MAX_T
    per_sm = 2  # split-K target: programs per SM
    if dot:
        BT, BE, BD = (32 if T <= 64 else 64), 64, 32
    else:  # every T: one token tile's shape and split (GEMV_MAX_T's docstring)
        BT, per_sm = 2, ROUTE_ONE_TOKEN_PER_SM
        BD = max(16, min(p2(D), ROUTE_ONE_TOKEN_BD))
        BE = max(2, min(p2(E), 8192 // (BT * BD)))
    tiles = (cdiv(T, BT) if dot else 1) * cdiv(E, BE)
    per, ns = split_k(cdiv(D, BD), tiles, per_sm * sms(x.device))
    ws = scores if ns == 1 else torch.empty(ns, T, E, dtype=torch.float32, device=x.device)
    BE2 = max(16, p2(E))
    BT2 = BT if not dot else max(2, min(16, p2(T)))  # the GEMV path's fused select takes the logits' token tiles
    sel = dict(FUNC=func, HAS_BIAS=bias is not None, HASH=tid2eid is not None, BKT=max(2, p2(k)),
               BS=max(2, min(p2(ns), 8192 // (BT2 * BE2))), ONE=ns == 1)
    sel_args = (bias.contiguous() if bias is not None else ws, tid2eid.contiguous() if tid2eid is not None else ws,
                input_ids.contiguous(), weights, indices, scores, k, float(route_scale))
    fused = not dot and FUSED_SELECT
    cnt = tile_counters(x.device, cdiv(T, BT)) if fused else ws
    _moe_logits_kernel[(cdiv(T, BT), cdiv(E, BE), ns)](
        x, gate_w, ws, T, E, D, per * BD, cnt, *sel_args, BT=BT, BE=BE, BD=BD, DOT=dot, X_TF32=tf32_exact(x),
        SELECT=fused, BE2=BE2, **sel, **pdl())
    if not fused:
        _moe_select_kernel[(cdiv(T, BT2),)](ws, *sel_args[:6], T, E, ns, *sel_args[6:], BT=BT2, BE=BE2, **sel,
                                                   **pdl())
    return weights, indices, scores


@triton.jit
def combined_row(r_ptr, s_ptr, t, c, m, K, RT, RK, ST, BD: tl.constexpr):
    """Token t's MoE output at columns c (mask m), fp32: Σ_j routed[t, j] in pair order, then + shared[t] (rows by
    strides RT / RK / ST). `_moe_combine_kernel` and `mhc._moe_combine_post_kernel`: one sum, the same bits."""
    acc = tl.zeros([BD], tl.float32)
    for j in range(0, K):
        acc += tl.load(r_ptr + t * RT + j * RK + c, mask=m, other=0.0).to(tl.float32)
    return acc + tl.load(s_ptr + t * ST + c, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _moe_combine_kernel(r_ptr, s_ptr, y_ptr, K, D, RT, RK, ST, BD: tl.constexpr):
    # program (token t, channel block)
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    m = c < D
    acc = combined_row(r_ptr, s_ptr, t, c, m, K, RT, RK, ST, BD)
    tl.store(y_ptr + t * D + c, acc.to(y_ptr.dtype.element_ty), mask=m)


@implement("moe_combine", "triton")
def moe_combine(routed: torch.Tensor, shared: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One launch for the reference's float / sum / float / add / cast (five at decode); inputs read by
    row strides."""
    T, K, D = routed.shape
    routed, shared = unit_last_stride(routed), unit_last_stride(shared)
    y = torch.empty(T, D, dtype=out_dtype, device=routed.device)
    if T == 0 or D == 0:
        return y
    BD = max(16, min(p2(D), 512))
    _moe_combine_kernel[(T, cdiv(D, BD))](routed, shared, y, K, D, routed.stride(0), routed.stride(1),
                                                 shared.stride(0), BD=BD, **pdl())
    return y


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, w_ptr, y_ptr, n, N, SG, SU, limit, CLAMP: tl.constexpr, WEIGHT: tl.constexpr,
                   BLOCK: tl.constexpr):
    # gate / up by row stride: the two halves of the w1|w3 GEMM's [P, 2I] output are read in place
    pdl_wait()
    pid = tl.program_id(0)
    o = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m = o < n
    r = o // N
    c = o % N
    g = tl.load(g_ptr + r * SG + c, mask=m, other=0.0)
    u = tl.load(u_ptr + r * SU + c, mask=m, other=0.0)
    y = swiglu_f32(g, u, tl.load(w_ptr + r, mask=m, other=0.0), limit, CLAMP, WEIGHT)
    tl.store(y_ptr + o, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_quant_kernel(g_ptr, u_ptr, w_ptr, q_ptr, s_ptr, o_ptr, N, NB, SG, SU, limit, Y_DTYPE: tl.constexpr,
                         CLAMP: tl.constexpr, WEIGHT: tl.constexpr, QB: tl.constexpr, RB: tl.constexpr,
                         SPLIT: tl.constexpr):
    """Row r, quantisation blocks RB at a time as an [RB, QB] tile: the activation as `_swiglu_kernel`, its
    cast to Y_DTYPE (the unfused op's output dtype), and the act_quant of that cast value
    (`quant_e4m3_rows`, the act_quant kernel's rule). The activation itself is never stored.
    SPLIT (QB 128): also q x s in bf16 as each block's 64 even then 64 odd columns (`a_bf16_split`'s
    layout and expression), the FP4 w2's input."""
    pdl_wait()
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1) * RB + tl.arange(0, RB)
    cols = blk[:, None] * QB + tl.arange(0, QB)[None, :]
    m = blk[:, None] < NB
    g = tl.load(g_ptr + r * SG + cols, mask=m, other=0.0)
    u = tl.load(u_ptr + r * SU + cols, mask=m, other=0.0)
    y = swiglu_f32(g, u, tl.load(w_ptr + r), limit, CLAMP, WEIGHT)
    store_act_quant(y.to(Y_DTYPE).to(tl.float32), q_ptr + r * N, s_ptr + r * NB, o_ptr + r * N, blk, m, NB, QB, SPLIT)


@implement("swiglu", "triton")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    N = gate.size(-1)
    y = torch.empty(gate.shape, dtype=out_dtype or torch.float32, device=gate.device)
    n = gate.numel()
    if n == 0:
        return y
    g2, u2 = rows_2d(gate, N), rows_2d(up, N)
    w = weight.reshape(-1).float().contiguous() if weight is not None else g2
    BLOCK = 1024
    _swiglu_kernel[(cdiv(n, BLOCK),)](g2, u2, w, y, n, N, g2.stride(0), u2.stride(0), float(limit),
                                             CLAMP=limit > 0, WEIGHT=weight is not None, BLOCK=BLOCK, **pdl())
    return y


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@implement("swiglu_quant", "triton")
def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, block: int = 128, split: bool = False) -> tuple:
    N = gate.size(-1)
    assert N % block == 0 and block == next_power_of_2(block), \
        f"swiglu_quant: last dim {N} is not a multiple of {block}"
    assert block == 128 or not split, f"swiglu_quant: split needs block 128, not {block}"
    q = torch.empty(gate.shape, dtype=torch.float8_e4m3fn, device=gate.device)
    s = torch.empty(*gate.shape[:-1], N // block, dtype=torch.float32, device=gate.device)
    o = torch.empty(gate.shape, dtype=torch.bfloat16, device=gate.device) if split else None
    out = (q, s, o) if split else (q, s)
    rows = gate.numel() // max(N, 1)
    if rows == 0:
        return out
    g2, u2 = rows_2d(gate, N), rows_2d(up, N)
    w = weight.reshape(-1).float().contiguous() if weight is not None else g2
    NB = N // block
    RB = min(next_power_of_2(NB), max(1, 4096 // block))
    _swiglu_quant_kernel[(rows, cdiv(NB, RB))](g2, u2, w, q, s, o if split else q, N, NB, g2.stride(0),
                                                       u2.stride(0), float(limit), Y_DTYPE=_TL_DTYPE[out_dtype],
                                                       CLAMP=limit > 0, WEIGHT=weight is not None, QB=block, RB=RB,
                                                       SPLIT=split, **pdl())
    return out
