"""RMSNorm: one program per row, two passes over the row in BLOCK chunks (any width), fp32 math.

Rows may be strided (`rows_2d`): a column slice of a wider output -- wq_a|wkv's stacked GEMM -- is read in
place, without a contiguous copy; the outputs are contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement
from deepinfer.settings import fusion  # DEEPINFER_DECODE_FUSIONS, read per call

from deepinfer.quant.kv_layout import kv_packed_width, kv_rope_offset

from ._common import p2, pdl, pdl_wait, rows_2d, store_act_quant
from .cache import _pack_entry
from .cache import kv_store as kv_store_op


@triton.jit
def _row_rsqrt(x_row, N, eps, BLOCK: tl.constexpr):
    """1 / rms of one row (sum of squares over BLOCK chunks, fp32): both norm kernels call this, so the
    fused `rms_norm_quant` produces exactly `rms_norm`'s y."""
    acc = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += x * x
    return tl.math.rsqrt(tl.sum(acc, 0) / N + eps)


@triton.jit
def _normed(x_row, w_ptr, cols, m, r, HAS_W: tl.constexpr):
    """x · r (· w) at cols in fp32, in the one product order every norm kernel here uses (so their y agree)."""
    y = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32) * r
    if HAS_W:
        y = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) * y
    return y


@triton.jit
def _store_normed(x_row, w_ptr, y_row, n, r, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """y_row[:n] = `_normed` in y's dtype, BLOCK columns at a time."""
    for n0 in range(0, n, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        m = cols < n
        tl.store(y_row + cols, _normed(x_row, w_ptr, cols, m, r, HAS_W).to(y_row.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, XS, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * XS
    _store_normed(x_row, w_ptr, y_ptr + row * N, N, _row_rsqrt(x_row, N, eps, BLOCK), HAS_W, BLOCK)


@implement("rms_norm", "triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    N = x.size(-1)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x2 = rows_2d(x, N)  # a column slice of a wider output is read in place, at its row stride
    _rms_norm_kernel[(x2.size(0),)](x2, weight if weight is not None else x2, y, N, x2.stride(0), float(eps),
                              HAS_W=weight is not None, BLOCK=min(p2(N), 4096), **pdl())
    return y


@triton.jit
def _rms_norm_quant_kernel(x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, o_ptr, N, XS, NB, eps, HAS_W: tl.constexpr,
                           BLOCK: tl.constexpr, QB: tl.constexpr, RB: tl.constexpr, SPLIT: tl.constexpr = False):
    """One row: `_row_rsqrt` as `_rms_norm_kernel` (so the same y), then RB quantisation blocks of QB columns
    at a time as an [RB, QB] tile: y, its cast to y's dtype, and the act_quant of that cast value
    (`quant_e4m3_rows`, the act_quant kernel's rule). All of a 4096 row's 32 blocks in one pass: a loop
    of one 128 block at a time is a chain of 32 dependent load-reduce-store rounds, slower at batch 1 than
    separate rms_norm and act_quant launches. SPLIT (QB 128): also q x s
    as the FP4 expert GEMM reads it (`store_bf16_split`)."""
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * XS
    r = _row_rsqrt(x_row, N, eps, BLOCK)
    for b0 in range(0, NB, RB):
        blk = b0 + tl.arange(0, RB)
        cols = blk[:, None] * QB + tl.arange(0, QB)[None, :]
        m = blk[:, None] < NB
        yc = _normed(x_row, w_ptr, cols, m, r, HAS_W).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * N + cols, yc, mask=m)
        store_act_quant(yc.to(tl.float32), q_ptr + row * N, s_ptr + row * NB, o_ptr + row * N, blk, m, NB, QB, SPLIT)


@implement("rms_norm_quant", "triton")
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, block: int = 128,
                   split: bool = False) -> tuple:
    N = x.size(-1)
    assert N % block == 0 and block == p2(block), f"rms_norm_quant: last dim {N} is not a multiple of {block}"
    assert block == 128 or not split, f"rms_norm_quant: split needs block 128, not {block}"
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(*x.shape[:-1], N // block, dtype=torch.float32, device=x.device)
    o = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) if split else None
    if x.numel():
        x2 = rows_2d(x, N)
        _rms_norm_quant_kernel[(x2.size(0),)](x2, weight if weight is not None else x2, y, q, s, o if split else q, N,
                                              x2.stride(0), N // block, float(eps), HAS_W=weight is not None,
                                              BLOCK=min(p2(N), 4096), QB=block,
                                              RB=min(p2(N // block), max(1, 4096 // block)), SPLIT=split, **pdl())
    return (y, q, s, o) if split else (y, q, s)


@triton.jit
def _head_rsqrt(x_row, N, eps, FORM: tl.constexpr, BLOCK: tl.constexpr):
    """The q head norm's scale where the reference's `head_norm` rounds (FORM 1 official_q: the square,
    mean, + eps and rsqrt each in x's dtype; 2 transformers_q: the fp32 scale rounded once), returned in
    fp32 holding a value of x's dtype, so `_normed`'s fp32 product rounded to x's dtype is the dtype's product."""
    dt = x_row.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        if FORM == 1:
            acc += (x * x).to(dt).to(tl.float32)
        else:
            acc += x * x
    if FORM == 1:
        m = (tl.sum(acc, 0) / N).to(dt).to(tl.float32)
        m = (m + eps).to(dt).to(tl.float32)
        return tl.math.rsqrt(m).to(dt).to(tl.float32)
    return tl.math.rsqrt(tl.sum(acc, 0) / N + eps).to(dt).to(tl.float32)


@triton.jit
def _rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, N, XS, H, CS, SS, eps, HALF,
                          cache_ptr, cacher_ptr, rows_ptr, slots_ptr, s_c0, s_c1, ES, ROFF, NOPE, NB,
                          HAS_W: tl.constexpr, BLOCK: tl.constexpr, BR: tl.constexpr, FORM: tl.constexpr = 0,
                          STORE: tl.constexpr = False, BNB: tl.constexpr = 1, SB: tl.constexpr = 1):
    """Row `row` (token row // H): `_rms_norm_kernel`'s y for the first N - 2·HALF columns; the last 2·HALF
    (the RoPE pairs) are y cast to y's dtype and rotated as `_rope_kernel` rotates them -- the two kernels'
    bits in one launch. The pairs load as one contiguous [BR, 2] tile split in registers (stride-2 loads
    were slow at prefill: `_rope_kernel`).
    STORE (`rms_norm_rope_store`, H 1): the stored row is then packed into the FP8-layout cache at (rows[row],
    slots[row]) as `kv_store`'s kernel packs it (`cache._pack_entry`, from y as stored: a CTA barrier orders the
    reads after this program's writes)."""
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    x_row = x_ptr + row * XS
    y_row = y_ptr + row * N
    if FORM == 0:
        r = _row_rsqrt(x_row, N, eps, BLOCK)
    else:
        r = _head_rsqrt(x_row, N, eps, FORM, BLOCK)
    nope = N - 2 * HALF
    _store_normed(x_row, w_ptr, y_row, nope, r, HAS_W, BLOCK)
    i = tl.arange(0, BR)
    mi = i < HALF
    j = nope + tl.arange(0, 2 * BR)
    y = _normed(x_row, w_ptr, j, j < N, r, HAS_W)
    y0, y1 = tl.split(tl.reshape(y.to(y_ptr.dtype.element_ty).to(tl.float32), [BR, 2]))
    c = tl.load(cos_ptr + t * CS + i, mask=mi, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * SS + i, mask=mi, other=0.0).to(tl.float32)
    rot = tl.reshape(tl.join(tl.fma(y0, c, -(y1 * s)), tl.fma(y0, s, y1 * c)), [2 * BR])  # as `_rope_kernel`
    tl.store(y_row + j, rot.to(y_ptr.dtype.element_ty), mask=j < N)
    if STORE:
        tl.debug_barrier()  # every thread's y stores before any thread's pack loads (one CTA)
        base = tl.load(rows_ptr + row).to(tl.int64) * s_c0 + tl.load(slots_ptr + row).to(tl.int64) * s_c1
        _pack_entry(y_row, cache_ptr + base, cacher_ptr + base // ES + ROFF, NOPE, NB, 2 * HALF, BNB, BR * 2, SB)


@implement("rms_norm_rope", "triton")
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  rd: int, form: str = "module") -> torch.Tensor:
    N = x.size(-1)
    FORM = _FORMS[form]
    if FORM and weight is not None:
        raise ValueError(f"rms_norm_rope form {form!r} is the unweighted q head norm: weight must be None")
    assert rd % 2 == 0 and 0 < rd <= N, f"rms_norm_rope: rd {rd} must be even and within the last dim {N}"
    H = x.size(2) if x.dim() == 4 else 1
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x2 = rows_2d(x, N)  # q's heads, or kv as a column slice of wq_a|wkv's output, read in place
    cos, sin = rows_2d(cos, rd // 2), rows_2d(sin, rd // 2)  # [B·S, rd/2] rows: views of a gathered table
    _rms_norm_rope_kernel[(x2.size(0),)](x2, weight if weight is not None else x2, cos, sin, y, N, x2.stride(0), H,
                                         cos.stride(0), sin.stride(0), float(eps), rd // 2, x2, x2, x2, x2,
                                         *_NO_STORE,
                                         HAS_W=weight is not None, BLOCK=min(p2(N), 4096), BR=p2(rd // 2), FORM=FORM,
                                         **pdl())
    return y


_NO_STORE = (0, 0, 1, 0, 0, 0)  # the STORE integers of a launch without it (its pointers: x; never read)


@implement("rms_norm_rope_store", "triton")
def rms_norm_rope_store(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, rd: int, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                        pack: bool) -> torch.Tensor:
    """FP8-layout cache (pack): the norm's program packs its entry into the cache (`_rms_norm_rope_kernel`'s
    STORE), one launch where rms_norm_rope and kv_store took two; the same bits. A float cache: the two ops."""
    N = x.size(-1)
    M = x.numel() // max(N, 1)
    nope = N - rd
    if not fusion("rms_norm_rope_store") or not pack or M == 0 or rows.numel() != M or slots.numel() != M \
            or nope <= 0 or nope % 64 or weight is None or (x.dim() == 4 and x.size(2) != 1):
        y = rms_norm_rope(x, weight, eps, cos, sin, rd)
        kv_store_op(cache, rows, slots, y.reshape(-1, N), rope_dim=rd if pack else 0)
        return y
    es = x.element_size()
    W = kv_packed_width(N, rd, x.dtype)
    assert cache.dtype == torch.uint8 and cache.size(-1) == W and cache.stride(-1) == 1, \
        f"rms_norm_rope_store: a uint8 [.., {W}] FP8-layout cache for {N}-dim values, got {cache.dtype} {cache.shape}"
    assert cache.stride(0) % es == 0 and cache.stride(1) % es == 0 and cache.data_ptr() % es == 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = rows_2d(x, N)
    cos, sin = rows_2d(cos, rd // 2), rows_2d(sin, rd // 2)
    roff = kv_rope_offset(N, rd)
    store = (cache, cache.view(x.dtype), rows.reshape(-1).contiguous(), slots.reshape(-1).contiguous(),
             cache.stride(0), cache.stride(1), es, roff // es, nope, nope // 64)
    _rms_norm_rope_kernel[(M,)](x2, weight, cos, sin, y, N, x2.stride(0), 1, cos.stride(0), sin.stride(0), float(eps),
                                rd // 2, *store, HAS_W=True, BLOCK=min(p2(N), 4096), BR=p2(rd // 2), STORE=True,
                                BNB=p2(nope // 64), SB=roff - nope, **pdl())
    return y


_FORMS = {"module": 0, "official_q": 1, "transformers_q": 2}
