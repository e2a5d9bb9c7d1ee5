"""Compressor kernels: gated pooling (per window and channel block, softmax over the slots, weighted sum) and the
fused decode step (state update + pooling of the current window)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv
from ._common import p2, pdl, pdl_wait, unit_last_stride


@triton.jit
def _pool_slots(kv, sc):
    """[BS, BD] slots x channels (masked slots: kv 0, score -inf) -> [BD]: softmax over the slots, weighted sum.
    The one pooling body of `compress_pool` and `compress_prefill`, so a window pools to the same bits either
    way at the same tile shape."""
    mx = tl.max(sc, 0)
    e = tl.exp(sc - mx[None, :])
    p = e / tl.sum(e, 0)[None, :]
    return tl.sum(kv * p, 0)


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
    tl.store(y_ptr + w * D + d, _pool_slots(kv, sc), mask=d < D)


def _pool_tile(slots: int, D: int) -> tuple[int, int]:
    """(BS, BD) of a pooling program: every slot, and channels up to 4096 elements a tile."""
    BS = p2(slots)
    return BS, max(16, min(p2(D), 4096 // BS))


@implement("compress_pool", "triton")
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    B, W, SL, D = kv.shape
    kv, score = kv.contiguous(), score.contiguous()
    y = torch.empty(B, W, D, dtype=torch.float32, device=kv.device)
    if B * W == 0 or D == 0:
        return y
    BS, BD = _pool_tile(SL, D)
    _compress_pool_kernel[(B * W, cdiv(D, BD))](kv, score, y, SL, D, BS=BS, BD=BD, **pdl())
    return y


def _check_states(op: str, kv_state: torch.Tensor, score_state: torch.Tensor, slots: int, C2: int) -> None:
    """The carried states as the kernels index them: contiguous float32 [R, slots, C2], both alike."""
    if kv_state.shape[1:] != (slots, C2) or score_state.shape != kv_state.shape \
            or kv_state.dtype != torch.float32 or score_state.dtype != torch.float32 \
            or not (kv_state.is_contiguous() and score_state.is_contiguous()):
        raise ValueError(f"{op}: states must be contiguous float32 [R, {slots}, {C2}], got "
                         f"{tuple(kv_state.shape)} {kv_state.dtype} / {tuple(score_state.shape)} {score_state.dtype}")


@triton.jit
def _prefill_slots(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, b, row, win, t, ch, m, part, r, C2, SLOTS_ST,
                   KV_BS, KV_SS, SC_BS, SC_SS, OFF, FRESH: tl.constexpr):
    """The values of slots (window win, slot t, channel ch) of a prompt chunk's sequence, m their mask: chunk
    token q = win·r + t - part (its score + ape[t]) where q >= 0, else the carried state of the row -- slot
    OFF + t (the current window's first tokens) for win 0, slot t (the overlap half) for win -1 -- which a
    FRESH row does not have (kv 0, score -inf). Masked slots: kv 0, score -inf."""
    q = win * r + t - part
    chunk = q >= 0
    mc = m & chunk
    kv = tl.load(kv_ptr + b * KV_BS + q * KV_SS + ch, mask=mc, other=0.0)
    sc = tl.load(sc_ptr + b * SC_BS + q * SC_SS + ch, mask=mc, other=0.0) + \
        tl.load(ape_ptr + t * C2 + ch, mask=mc, other=0.0)
    if FRESH:
        sc = tl.where(mc, sc, float("-inf"))
    else:
        ms = m & (q < 0)
        st = row * SLOTS_ST * C2 + tl.where(win < 0, t, OFF + t) * C2 + ch
        kv = tl.where(chunk, kv, tl.load(skv_ptr + st, mask=ms, other=0.0))
        sc = tl.where(mc, sc, tl.load(ssc_ptr + st, mask=ms, other=float("-inf")))
    return kv, sc


@triton.jit
def _compress_prefill_pool_kernel(kv_ptr, sc_ptr, ape_ptr, rows_ptr, skv_ptr, ssc_ptr, y_ptr, n, part, r, D, C2,
                                  SLOTS_ST, KV_BS, KV_SS, SC_BS, SC_SS, OFF, OVERLAP: tl.constexpr,
                                  FRESH: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
    # Program (row b, window w, channel block): the window's slots gathered where they lie -- the chunk's
    # projections (strided rows, + ape) or the row's carried state -- instead of assembled by copies, then
    # pooled as `compress_pool` pools them. Reads the state only; the state kernel runs after it.
    pdl_wait()
    pid = tl.program_id(0).to(tl.int64)
    b, w = pid // n, pid % n
    s = tl.arange(0, BS)
    j = tl.program_id(1) * BD + tl.arange(0, BD)
    mj = j < D
    if OVERLAP:  # slots 0..r-1: window w-1's first d channels; r..2r-1: window w's last d
        hi = s >= r
        win = w - 1 + hi.to(tl.int64)
        t = tl.where(hi, s - r, s)
        ch = j[None, :] + tl.where(hi, D, 0)[:, None]
        m = (s < 2 * r)[:, None] & mj[None, :]
    else:
        win = w + s * 0
        t = s
        ch = j[None, :] + s[:, None] * 0
        m = (s < r)[:, None] & mj[None, :]
    row = tl.load(rows_ptr + b).to(tl.int64)
    kv, sc = _prefill_slots(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, b, row, win[:, None], t[:, None], ch, m,
                            part, r, C2, SLOTS_ST, KV_BS, KV_SS, SC_BS, SC_SS, OFF, FRESH)
    tl.store(y_ptr + pid * D + j, _pool_slots(kv, sc).to(y_ptr.dtype.element_ty), mask=mj)


@triton.jit
def _compress_prefill_state_kernel(kv_ptr, sc_ptr, ape_ptr, rows_ptr, skv_ptr, ssc_ptr, n, part, L, r, C2, SLOTS_ST,
                                   KV_BS, KV_SS, SC_BS, SC_SS, OFF, FRESH: tl.constexpr, BS: tl.constexpr,
                                   BC: tl.constexpr):
    # Program (row b, channel block): every state slot of its channels, so no other program touches them. The
    # new slots are read first (chunk tokens, or the old slots they keep) and stored after a barrier, since a
    # kept slot may move (the first window's carried tokens become the overlap half).
    pdl_wait()
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    u = tl.arange(0, BS)  # state slot
    mc = c < C2
    row = tl.load(rows_ptr + b).to(tl.int64)
    rem = L % r
    # the overlap half (u < r) is the last complete window's slots, or with none complete the old half; the
    # partial window (OFF <= u < OFF + L % r) the tokens after the last complete window
    half = (u < OFF) & (n > 0)  # OFF: r with an overlap half, else 0
    keep = (u < OFF) & (n == 0)
    tail = (u >= OFF) & (u < OFF + rem)
    win = tl.where(half, n - 1, n).to(tl.int64)  # int64 offsets, as the pooling kernel's (S x row stride)
    t = tl.where(half, u, u - OFF)
    kv, sc = _prefill_slots(kv_ptr, sc_ptr, ape_ptr, skv_ptr, ssc_ptr, b, row, win[:, None], t[:, None],
                            c[None, :] + u[:, None] * 0, (half | tail)[:, None] & mc[None, :], part, r, C2, SLOTS_ST,
                            KV_BS, KV_SS, SC_BS, SC_SS, OFF, FRESH)
    st = row * SLOTS_ST * C2 + u[:, None] * C2 + c[None, :]
    if not FRESH:  # the old overlap half stays where no window completes
        mk = keep[:, None] & mc[None, :]
        kv = tl.where(mk, tl.load(skv_ptr + st, mask=mk, other=0.0), kv)
        sc = tl.where(mk, tl.load(ssc_ptr + st, mask=mk, other=float("-inf")), sc)
    tl.debug_barrier()
    ms = (u < SLOTS_ST)[:, None] & mc[None, :]
    tl.store(skv_ptr + st, kv, mask=ms)
    tl.store(ssc_ptr + st, sc, mask=ms)


@implement("compress_prefill", "triton")
def compress_prefill(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, start: int, rows: torch.Tensor,
                     kv_state: torch.Tensor, score_state: torch.Tensor, overlap: bool, fresh: bool = False,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Two launches for the reference's ~17 torch ops: the pooling of every window the chunk completes (B·n
    programs x channel blocks, each window's slots gathered from the strided projections and the old state),
    then the rows' new state (B programs x channel blocks). Positions, window counts and the chunk's phase are
    host integers (start, S): no host sync, so a prefill graph captures it."""
    B, S, C2 = kv.shape
    r = ape.size(0)
    coff = 2 if overlap else 1
    D = C2 // coff
    if fresh and start:
        raise ValueError(f"compress_prefill: a fresh chunk starts at position 0, not {start}")
    _check_states("compress_prefill", kv_state, score_state, coff * r, C2)
    part, off = start % r, r if overlap else 0
    L = part + S
    n = L // r
    y = torch.empty(B, n, D, dtype=out_dtype, device=kv.device)
    if B == 0 or C2 == 0:
        return y
    kv, score = unit_last_stride(kv.float()), unit_last_stride(score.float())
    ape, rows = ape.float().contiguous(), rows.contiguous()
    strides = (coff * r, kv.stride(0), kv.stride(1), score.stride(0), score.stride(1))
    if n:
        BS, BD = _pool_tile(coff * r, D)
        _compress_prefill_pool_kernel[(B * n, cdiv(D, BD))](
            kv, score, ape, rows, kv_state, score_state, y, n, part, r, D, C2, *strides, off, OVERLAP=bool(overlap),
            FRESH=bool(fresh), BS=BS, BD=BD, **pdl())
    BS = p2(coff * r)
    BC = max(16, min(p2(C2), 2048 // BS))
    _compress_prefill_state_kernel[(B, cdiv(C2, BC))](
        kv, score, ape, rows, kv_state, score_state, n, part, L, r, C2, *strides, off, FRESH=bool(fresh), BS=BS,
        BC=BC, **pdl())
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
    _check_states("compress_decode", kv_state, score_state, coff * r, C2)
    kv, score = unit_last_stride(kv.float()), unit_last_stride(score.float())
    BS = p2(r)
    BD = max(16, min(p2(D), 2048 // BS))
    _compress_decode_kernel[(B, cdiv(D, BD))](
        kv, score, ape.float().contiguous(), pos.contiguous(), rows.contiguous(), kv_state, score_state, y,
        coff * r, C2, D, r, kv.stride(0), score.stride(0), OVERLAP=bool(overlap), BS=BS, BD=BD, **pdl())
    return y
