"""Sparse shared-KV attention with a sink (prefill and decode alike).

Each program takes one query token (b, s), a block of BH heads and a range of its K selected slots:
the token's kv rows are gathered by index in BK-row tiles, loaded once for all BH heads (V4 is MQA:
K = V is one row shared by every head), logits = Q Kᵀ and P V are tensor-core dots, online softmax
in fp32, -1 slots masked. Rounded as `reference.sparse_attn` (DeepSeek's kernel.py): the running max
is over the logits only and the sink joins the denominator at the end; p is summed in fp32 and cast to
q's dtype for the P V dot. The reference steps 64 slots at a time and these tiles BK; where the max
grows inside a 64-slot block the two round p against different maxima (a bf16 ulp of p, at most).

Tiling (`_tiles`): BH = 64 heads and BK = 32 kv rows for D = 512 at 8 warps (more heads for smaller D),
2 pipeline stages for prefill-sized calls (>= 256 query tokens), 3 for decode. 64 heads make the Q Kᵀ and
P V dots warpgroup MMAs (M = 64 per warpgroup) and dequantise each gathered kv tile once per token
instead of once per head block. At flash shapes they are several times faster than 32-head / BK 16 / 3-stage
tiles at prefill and at decode batch 32-64, and faster at batch 1 (docs/perf-log.md, "Prefill: pre-converted
expert input, 64-head attention tiles, the non-GEMM kernels"). 16 warps and 4 warps are slower; a decode call
over few slots (~160) is a little slower at BK 32 than at BK 16.
  * prefill (many query tokens): one program per (token, head block) over all K slots; the sink is
    added last, l += exp(sink - m) (a token whose slots are all -1 gets exactly 0: m = -inf is read as
    0 wherever it would make a NaN).
  * decode (few query tokens: B*S*head-blocks < 2 programs per SM): flash-decoding. The K slots are
    split over programs (>= 2 kv tiles each) so that ~2 programs per SM run; each writes its partial
    (m, l, acc) -- m = -inf for a split with no valid slot -- to an fp32 workspace, and a combine
    kernel merges the splits in a fixed order (deterministic) and adds the sink: l = exp(sink - m) +
    Σ l_s e^(m_s - m). Each split's running max starts afresh, so p rounds against it. Flash decode shapes
    (32 tokens x 64 heads x 512, 640 slots) go from 32 programs to 32 x 7 (96 slots each).

`sparse_attn_fp8` is the same kernel reading the FP8 KV layout (`reference.kv_pack`): each gathered row's
e4m3 codes times its per-64 e8m0 scales, and the rope dims in q's dtype, form the [BK, D] tile in
registers (exact: e4m3 x 2^k is a bf16 value). V4 rows are 592 bytes instead of 1024.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import settings
from deepinfer.ops.registry import implement
from deepinfer.settings import fusion  # DEEPINFER_DECODE_FUSIONS, read per call
from deepinfer.quant.kv_layout import kv_packed_width, kv_rope_offset

from ._common import cdiv
from ._common import INTERPRET as _INTERPRET
from ._common import e8m0_f32, p2, pdl, pdl_wait, rows_2d
from ._common import sms as _sms
from .norm import rms_norm_rope as rms_norm_rope_op
from .rope import rope as rope_op





@triton.jit
def _q_head_norm_rope(x, cos_row, sin_row, D, eps, R0, HALF, FORM: tl.constexpr, BD: tl.constexpr):
    """q tile x [BH, BD] (heads x head dim D, padded columns 0) -> `rms_norm_rope(x, None, eps, cos, sin, 2 HALF,
    form)` of each head in x's dtype: the scale rounded where `head_norm`'s FORM rounds (1 official_q: the
    squares, the mean, + eps and the rsqrt each in x's dtype; 2 transformers_q: the fp32 scale once), the product
    in x's dtype, then pairs R0 .. R0 + HALF - 1 rotated with `_rms_norm_rope_kernel`'s FMAs; the other pairs
    pass through (cos 1, sin 0: exact). The per-head sum of squares is a row reduction of the tile here and one
    of a [D] vector there: the same terms, the fp32 sum in another order (official_q then rounds it to x's
    dtype)."""
    dt = x.dtype
    xf = x.to(tl.float32)
    if FORM == 1:
        m = (tl.sum((xf * xf).to(dt).to(tl.float32), 1) / D).to(dt).to(tl.float32)
        m = (m + eps).to(dt).to(tl.float32)
        r = tl.math.rsqrt(m).to(dt).to(tl.float32)
    else:
        r = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps).to(dt).to(tl.float32)
    y0, y1 = tl.split(tl.reshape((xf * r[:, None]).to(dt).to(tl.float32), [x.shape[0], BD // 2, 2]))
    i = tl.arange(0, BD // 2) - R0
    mi = (i >= 0) & (i < HALF)
    c = tl.load(cos_row + i, mask=mi, other=1.0).to(tl.float32)
    sn = tl.load(sin_row + i, mask=mi, other=0.0).to(tl.float32)
    rot = tl.join(tl.fma(y0, c[None, :], -(y1 * sn[None, :])), tl.fma(y0, sn[None, :], y1 * c[None, :]))
    return tl.reshape(rot, [x.shape[0], BD]).to(dt)


@triton.jit
def _sparse_attn_kernel(q_ptr, kv_ptr, kvr_ptr, sink_ptr, idx_ptr, o_ptr, ml_ptr, acc_ptr, S, H, N, D, KSEL,
                        CHUNK, scale, W, WE, ROFF, NOPE, qc_ptr, qs_ptr, QCS, QSS, QR0, QHALF, q_eps,
                        BH: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
                        SPLIT: tl.constexpr, PACKED: tl.constexpr, QNORM: tl.constexpr = 0):
    # QNORM (`q_norm_sparse_attn_fp8`; 1 official_q, 2 transformers_q): q is wq_b's output before its head norm;
    # the tile is normalised per head and its pairs QR0 .. QR0 + QHALF - 1 rotated by the token's cos / sin rows
    # (qc_ptr / qs_ptr, strides QCS / QSS) as it is loaded (`_q_head_norm_rope`): no q launch before this one.
    pdl_wait()
    bs = tl.program_id(0).to(tl.int64)  # b * S + s
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    b = bs // S
    h = hb * BH + tl.arange(0, BH)
    d = tl.arange(0, BD)
    mh = h < H
    md = d < D
    q = tl.load(q_ptr + (bs * H + h[:, None]) * D + d[None, :], mask=mh[:, None] & md[None, :], other=0.0)
    if QNORM > 0:
        q = _q_head_norm_rope(q, qc_ptr + bs * QCS, qs_ptr + bs * QSS, D, q_eps, QR0, QHALF, QNORM, BD)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    k_lo = sp * CHUNK
    k_hi = tl.minimum(k_lo + CHUNK, KSEL)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        idx = tl.load(idx_ptr + bs * KSEL + kk, mask=kk < k_hi, other=-1).to(tl.int64)
        valid = idx >= 0
        if PACKED:  # FP8 layout rows of W bytes: e4m3 codes x e8m0 scale per 64 dims | rope dims (kvr: q's dtype)
            ent = b * N + idx[:, None]
            nope = valid[:, None] & (d[None, :] < NOPE)
            code = tl.load(kv_ptr + ent * W + d[None, :], mask=nope, other=0)
            jg = tl.arange(0, BD // 64)  # one scale byte per 64 dims, loaded once per row, broadcast
            sc = tl.load(kv_ptr + ent * W + NOPE + jg[None, :], mask=valid[:, None] & (jg[None, :] * 64 < NOPE),
                         other=0)
            deq = tl.reshape(tl.reshape(code.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BK, BD // 64, 64])
                             * e8m0_f32(sc)[:, :, None], [BK, BD])
            rmask = valid[:, None] & (d[None, :] >= NOPE) & md[None, :]
            rope = tl.load(kvr_ptr + ent * WE + ROFF + (d[None, :] - NOPE), mask=rmask, other=0.0)
            kv = tl.where(d[None, :] < NOPE, deq, rope.to(tl.float32)).to(q_ptr.dtype.element_ty)
        else:
            kv = tl.load(kv_ptr + (b * N + idx[:, None]) * D + d[None, :], mask=valid[:, None] & md[None, :],
                         other=0.0)
        if IEEE:
            logits = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            logits = tl.dot(q, tl.trans(kv))
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: p = 0, nothing to rescale
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(logits - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:  # P in the operands' dtype, as the tensor-core path and the reference round it
            p = p.to(q_ptr.dtype.element_ty).to(tl.float32)
            pv = tl.dot(p, kv.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(kv.dtype), kv)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLIT:  # partial (m, l, acc) of split sp: [splits, B*S, H] and [splits, B*S, H, D]
        row = (sp * tl.num_programs(0) + bs) * H + h
        tl.store(ml_ptr + 2 * row, m_i, mask=mh)
        tl.store(ml_ptr + 2 * row + 1, l_i, mask=mh)
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=mh[:, None] & md[None, :])
    else:
        sink = tl.load(sink_ptr + h, mask=mh, other=0.0).to(tl.float32)
        o = acc / (l_i + tl.exp(sink - tl.where(m_i == float("-inf"), 0.0, m_i)))[:, None]
        tl.store(o_ptr + (bs * H + h[:, None]) * D + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=mh[:, None] & md[None, :])


@triton.jit
def _sparse_attn_combine_kernel(ml_ptr, acc_ptr, sink_ptr, o_ptr, BS, H, D, SPLITS, cos_ptr, sin_ptr, CS, SS,
                                R0, HALF, BH: tl.constexpr, BD: tl.constexpr, BSP: tl.constexpr,
                                ROPE: tl.constexpr = False):
    """Merge the splits' (m, l, acc) of token bs, heads h, BSP splits per load: the few splits of a decode
    call arrive in one round of loads instead of one dependent round per split (the loop form's chain of
    dependent rounds was a visible part of a batch-1 call). Masked splits load m = -inf, weight 0.
    ROPE (`out_rope`): the output's pairs R0 .. R0 + HALF - 1 (its last 2 HALF dims) de-rotated by the token's
    cos / sin rows (stride CS / SS) -- from the output rounded to its dtype, with `_rope_kernel`'s FMAs, so
    the bits of the rope launch it replaces; the other pairs pass through (cos 1, sin 0: exact)."""
    pdl_wait()
    bs = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    d = tl.arange(0, BD)
    sp = tl.arange(0, BSP)
    mh = h < H
    md = d < D
    sink = tl.load(sink_ptr + h, mask=mh, other=0.0).to(tl.float32)
    m = tl.full([BH], float("-inf"), tl.float32)
    for s0 in range(0, SPLITS, BSP):
        ss = s0 + sp
        ms = (ss[:, None] < SPLITS) & mh[None, :]
        row = (ss[:, None] * BS + bs) * H + h[None, :]  # [BSP, BH]
        m = tl.maximum(m, tl.max(tl.load(ml_ptr + 2 * row, mask=ms, other=float("-inf")), 0))
    m = tl.where(m == float("-inf"), 0.0, m)  # every slot empty: acc = 0, l = exp(sink), o = 0
    l = tl.exp(sink - m)
    acc = tl.zeros([BH, BD], tl.float32)
    for s0 in range(0, SPLITS, BSP):  # fixed shapes and order: deterministic
        ss = s0 + sp
        ms = (ss[:, None] < SPLITS) & mh[None, :]
        row = (ss[:, None] * BS + bs) * H + h[None, :]
        w = tl.exp(tl.load(ml_ptr + 2 * row, mask=ms, other=float("-inf")) - m[None, :])
        l += tl.sum(w * tl.load(ml_ptr + 2 * row + 1, mask=ms, other=0.0), 0)
        part = tl.load(acc_ptr + row[:, :, None] * D + d[None, None, :], mask=ms[:, :, None] & md[None, None, :],
                       other=0.0)
        acc += tl.sum(w[:, :, None] * part, 0)
    o = acc / l[:, None]
    if ROPE:
        x0, x1 = tl.split(tl.reshape(o.to(o_ptr.dtype.element_ty).to(tl.float32), [BH, BD // 2, 2]))
        i = tl.arange(0, BD // 2) - R0
        mi = (i >= 0) & (i < HALF)
        c = tl.load(cos_ptr + bs * CS + i, mask=mi, other=1.0).to(tl.float32)
        sn = -tl.load(sin_ptr + bs * SS + i, mask=mi, other=0.0).to(tl.float32)  # inverse: rotate by -theta
        y0 = tl.fma(x0, c[None, :], -(x1 * sn[None, :]))
        y1 = tl.fma(x0, sn[None, :], x1 * c[None, :])
        o = tl.reshape(tl.join(y0, y1), [BH, BD])
    tl.store(o_ptr + (bs * H + h[:, None]) * D + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mh[:, None] & md[None, :])


def _combine_tiles(splits: int, H: int, BD: int) -> tuple[int, int]:
    """(BH heads, BSP splits) per combine program and load: <= 8192 fp32 of partials (64 a thread)."""
    BSP = min(p2(splits), 8)
    return max(1, min(p2(H), 8192 // (BSP * BD))), BSP


def _tiles(H: int, BD: int, tokens: int, fp32_dots: bool) -> tuple[int, int, int, int]:
    """(BH heads, BK kv rows, num_warps, num_stages) per program for H heads of padded dim BD and
    `tokens` query tokens (module docstring). fp32_dots (fp32 operands -- `exact` numerics -- on a GPU):
    the fp32 Q and kv tiles staged for the dots need smaller tiles, 32 heads x 16 rows at D 512 (133 KB of
    shared memory in the FP8 layout, offline sm_90 compile; 64 x 32 needs 271 KB, over sm_90's 227).
    The interpreter has no such limit and runs the bf16 tiles, so the CPU tests cover their shape.

    DEEPINFER_ATTN_PREFILL_BK=64 (experimental, untimed; read per call): prefill tiles of 64 kv slots, not 32.
    DeepSeek's `sparse_attn_kernel` and the reference take the slots in blocks of 64 (`SPARSE_ATTN_BLOCK`): the
    running max, and so each bf16 P, is per block, and 32-slot steps round P against another max where a block's
    larger logits lie in its second half. Compiled as a flash prefill launch specialises it (sm_90a, 64 heads x
    512 dims, 8 warps, 2 stages, Triton 3.6), a 64-slot step takes 1294 SASS, 22 % fewer a slot than two 32-slot
    steps (831 each: the [64, 512] fp32 accumulator's rescale is paid once a step), at 255 registers and 88 B of
    spill (`tools/triton_sass.py`). Whether that pays is for the GPU to say (`bench --against
    triton:DEEPINFER_ATTN_PREFILL_BK=64`)."""
    if fp32_dots:
        BH = max(16, min(p2(H), 64, 16384 // BD))
        BK = 16 if BD >= 256 else 32
    else:
        BH = max(16, min(p2(H), 64, 32768 // BD))
        BK = 32 if BD <= 512 else 16
        if tokens >= 256 and BK == 32 and settings.choice("DEEPINFER_ATTN_PREFILL_BK") == "64":
            BK = 64  # the official kernel's block (above)
    return BH, BK, 8 if BH * BD >= 8192 else 4, 2 if tokens >= 256 else 3


LATENCY_TILES = (16, 32, 4)
"""(BH, BK, num_warps) for decode calls with few query tokens and slots (`_plan`)."""
LATENCY_TOKENS = 16
"""Query tokens (x 64-head blocks) below which decode runs the latency tiles ..."""
LATENCY_MAX_SLOTS = 256
"""... over at most this many slots: past it the [splits, tokens, H, D] fp32 partials that one-tile splits
write outweigh the parallelism: at 640 slots the 64-head tiles are faster at batch 1 and 8 (docs/perf-log.md,
"Decode latency tiles, bf16 compressor weights, 64-row FP8 prefill tiles")."""


def _plan(tokens: int, H: int, BD: int, KSEL: int, fp32_dots: bool, sms: int):
    """(BH, BK, num_warps, num_stages, splits, slots per split) for `tokens` query tokens of H heads over
    KSEL slots. Few tokens (decode at small batch): 64-head tiles would leave a handful of programs, each
    walking its slots serially (batch 1: 2 programs), so the latency tiles take fewer heads and the slots split
    down to one kv tile per program. At flash shapes the 16 x 32 latency tiles are faster than the 64-head
    tiles at batch 1 and 8 over the SWA / HCA (128) and CSA (170) slot counts of a short context, and faster
    than 16 x 16 or 32 x 16 tiles (docs/perf-log.md, "Decode latency tiles, bf16 compressor weights, 64-row FP8
    prefill tiles")."""
    BH, BK, nw, ns = _tiles(H, BD, tokens, fp32_dots)
    min_tiles = 2
    if tokens * cdiv(H, 64) < LATENCY_TOKENS and KSEL <= LATENCY_MAX_SLOTS:
        BH, BK, nw = max(1, min(BH, LATENCY_TILES[0])), min(BK, LATENCY_TILES[1]), LATENCY_TILES[2]
        min_tiles = 1
    progs = tokens * cdiv(H, BH)
    splits = 1
    if progs < 2 * sms and KSEL > min_tiles * BK:
        splits = min(cdiv(2 * sms, progs), cdiv(KSEL, min_tiles * BK))
    chunk = cdiv(cdiv(KSEL, splits), BK) * BK if KSEL else BK
    return BH, BK, nw, ns, max(1, cdiv(KSEL, chunk)), chunk


def _launch(q, kv, kvr, sink, idx, scale, N, ieee, packed=(0, 0, 0, 0), out_rope=None, q_norm=None):
    """Both ops: kv [B, N, D] entries, or (packed) uint8 [B, N, W] FP8-layout rows with kvr the same storage
    viewed in q's dtype and packed = (W, W in q elements, rope offset in q elements, no-RoPE dims).
    out_rope (cos, sin, rd): the output's last rd dims de-rotated -- in the combine launch when the slots are
    split (decode), else by the rope kernel in place after the attention. q_norm (eps, FORM): q is wq_b's
    output, head-normed and rotated (by out_rope's cos / sin) in the attention kernel as it loads it."""
    B, S, H, D = q.shape
    KSEL = idx.size(-1)
    o = torch.empty_like(q)
    if B * S * H == 0:
        return o
    BD = max(16, p2(D))
    BH, BK, nw, ns, splits, chunk = _plan(B * S, H, BD, KSEL, ieee and not _INTERPRET, _sms(q.device))
    hbs = cdiv(H, BH)
    meta = dict(BH=BH, BK=BK, BD=BD, IEEE=ieee, SPLIT=splits > 1, PACKED=kvr is not None, num_warps=nw,
                num_stages=ns)
    kvr = kv if kvr is None else kvr
    qn = (q, q, 0, 0, 0, 0, 0.0)  # no q norm: pointers never read
    if q_norm is not None:
        cos, sin, rd = out_rope
        cos, sin = rows_2d(cos, rd // 2), rows_2d(sin, rd // 2)  # [B·S, rd/2] rows of the gathered tables
        qn = (cos, sin, cos.stride(0), sin.stride(0), (D - rd) // 2, rd // 2, float(q_norm[0]))
        meta["QNORM"] = q_norm[1]
    if splits == 1:
        _sparse_attn_kernel[(B * S, hbs, 1)](q, kv, kvr, sink, idx, o, o, o, S, H, N, D, KSEL, max(KSEL, 1),
                                             float(scale), *packed, *qn, **meta, **pdl())
        if out_rope is not None:
            cos, sin, rd = out_rope
            tail = o[..., D - rd:]
            rope_op(tail, cos, sin, inverse=True, out=tail)
        return o
    ml = torch.empty(splits, B * S, H, 2, dtype=torch.float32, device=q.device)
    acc = torch.empty(splits, B * S, H, D, dtype=torch.float32, device=q.device)
    _sparse_attn_kernel[(B * S, hbs, splits)](q, kv, kvr, sink, idx, o, ml, acc, S, H, N, D, KSEL, chunk,
                                              float(scale), *packed, *qn, **meta, **pdl())
    BHc, BSP = _combine_tiles(splits, H, BD)
    rope = (o, o, 0, 0, 0, 0)
    if out_rope is not None:
        cos, sin, rd = out_rope
        cos, sin = rows_2d(cos, rd // 2), rows_2d(sin, rd // 2)  # [B·S, rd/2] rows of the gathered tables
        rope = (cos, sin, cos.stride(0), sin.stride(0), (D - rd) // 2, rd // 2)
    _sparse_attn_combine_kernel[(B * S, cdiv(H, BHc))](ml, acc, sink, o, B * S, H, D, splits, *rope,
                                                              BH=BHc, BD=BD, BSP=BSP, ROPE=out_rope is not None,
                                                              num_warps=4, **pdl())
    return o


@implement("sparse_attn", "triton")
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    q, kv, sink, idx = q.contiguous(), kv.contiguous(), sink.float().contiguous(), idx.contiguous()
    ieee = q.dtype == torch.float32 or kv.dtype == torch.float32 or q.dtype != kv.dtype
    return _launch(q, kv, None, sink, idx, scale, kv.size(1), ieee)


@implement("sparse_attn_fp8", "triton")
def sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                    rope_dim: int, out_rope: tuple | None = None) -> torch.Tensor:
    D = q.size(-1)
    W = kv_packed_width(D, rope_dim, q.dtype)
    assert kv.dtype == torch.uint8 and kv.size(-1) == W, \
        f"sparse_attn_fp8: kv must be uint8 [B, N, {W}] (FP8 layout of head_dim {D}), got {kv.dtype} {list(kv.shape)}"
    q, kv, sink, idx = q.contiguous(), kv.contiguous(), sink.float().contiguous(), idx.contiguous()
    es = q.element_size()
    packed = (W, W // es, kv_rope_offset(D, rope_dim) // es, D - rope_dim)
    # fp32 dots under the interpreter too: its bf16 tl.dot is wrong, and the tile is dequantised here anyway
    ieee = q.dtype == torch.float32 or _INTERPRET
    return _launch(q, kv, kv.view(q.dtype), sink, idx, scale, kv.size(1), ieee, packed,
                   None if out_rope is None else (*out_rope, rope_dim))


_Q_FORMS = {"official_q": 1, "transformers_q": 2}


@implement("q_norm_sparse_attn_fp8", "triton")
def q_norm_sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                           rope_dim: int, eps: float, form: str, rope: tuple) -> torch.Tensor:
    """The q head norm with its RoPE in the attention kernel's q load (`_q_head_norm_rope`): one launch fewer
    on every layer's decode critical path. The module form (fp32 q norms of the reference's RMSNorm) and
    head dims past one tile run the two ops."""
    D = q.size(-1)
    W = kv_packed_width(D, rope_dim, q.dtype)
    if (not fusion("q_norm_sparse_attn_fp8") or form not in _Q_FORMS or kv.dtype != torch.uint8
            or kv.size(-1) != W or D != max(16, p2(D)) or q.numel() == 0):
        qn = rms_norm_rope_op(q, None, eps, *rope, rope_dim, form=form)
        return sparse_attn_fp8(qn, kv, sink, idx, scale, rope_dim, out_rope=rope)
    q, kv, sink, idx = q.contiguous(), kv.contiguous(), sink.float().contiguous(), idx.contiguous()
    es = q.element_size()
    packed = (W, W // es, kv_rope_offset(D, rope_dim) // es, D - rope_dim)
    ieee = q.dtype == torch.float32 or _INTERPRET
    return _launch(q, kv, kv.view(q.dtype), sink, idx, scale, kv.size(1), ieee, packed, (*rope, rope_dim),
                   q_norm=(eps, _Q_FORMS[form]))


@triton.jit
def _decode_slots_kernel(pos_ptr, rows_ptr, ent_ptr, out_ptr, WIN, NSLOTS, K, L, ent_stride, ratio,
                         MODE: tl.constexpr, BL: tl.constexpr):
    """out[b, c] for c in one BL block of the row's L = WIN + K slots (`reference.decode_slots`); MODE 0: the
    ring only, 1: CSA entries from ent_ptr [B, K] (row stride ent_stride), 2: HCA entries j < (pos+1)//ratio."""
    pdl_wait()
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BL + tl.arange(0, BL)
    p = tl.load(pos_ptr + b)
    base = tl.load(rows_ptr + b) * NSLOTS
    j = c - WIN
    if MODE == 1:
        e = tl.load(ent_ptr + b * ent_stride + j, mask=(c >= WIN) & (c < L), other=-1)
    elif MODE == 2:
        e = tl.where(j < (p + 1) // ratio, j, -1).to(tl.int64)
    else:
        e = tl.full([BL], -1, tl.int64)
    full = p >= WIN - 1  # the ring oldest position first (reference.decode_slots)
    w = tl.where(full, (p + 1 + c) % WIN, c)
    v = tl.where(c < WIN, tl.where(full | (c <= p), w + base, -1), tl.where(e >= 0, e + base + WIN, -1))
    tl.store(out_ptr + b * L + c, v, mask=c < L)


@implement("decode_slots", "triton")
def decode_slots(pos: torch.Tensor, rows: torch.Tensor, win: int, n_slots: int, entries: torch.Tensor | None = None,
                 n_entries: int = 0, ratio: int = 0) -> torch.Tensor:
    B = pos.size(0)
    pos, rows = pos.contiguous(), rows.contiguous()
    if entries is not None:
        entries = entries.reshape(B, -1)
        if entries.stride(-1) != 1:
            entries = entries.contiguous()
        mode, K = 1, entries.size(1)
    else:
        mode, K = (2, n_entries) if ratio else (0, 0)
    L = win + K
    out = torch.empty(1, B, L, dtype=torch.int64, device=pos.device)
    if B and L:
        BL = min(1024, p2(L))
        ent = entries if entries is not None else out
        _decode_slots_kernel[(B, cdiv(L, BL))](pos, rows, ent, out, win, n_slots, K, L, ent.stride(0),
                                                      max(int(ratio), 1), MODE=mode, BL=BL, **pdl())
    return out
