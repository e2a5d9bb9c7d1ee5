"""Lightning indexer: scores Σ_h w·relu(q·k) and the exact, tie-stable top-k selection.

indexer_scores: one program per (query token, BT-key tile) with every head at once (a [BH, BT] tensor-core
dot over the head dim, ReLU, weighted head sum in registers). BT = 128 for 64 heads (at 32, Q is
re-read 16x per token at flash prefill and the tiles are too small to hide latency).

topk_indices is a hierarchical bitonic selection on 63-bit keys (value order, then LOWER index, see
`_common.sort_key`): every key is distinct, so any correct sort gives exactly the reference's stable
descending order. Round 1 sorts chunks of CHUNK scores and keeps each chunk's best KP = next_pow2(k)
keys; further rounds merge candidate lists the same way until one chunk remains, whose first k keys
decode to indices (-1 for padding / entries past n_valid). The number of rounds depends only on
shapes, so nothing syncs with the host.

Decode-sized problems (rows x T x T <= `RANK_MAX_COMPARES`) take `_topk_rank_kernel` instead: every key's
rank in the descending order is the number of keys above it (all keys are distinct), counted by
comparing it against all T keys, and the index is stored at out[rank] when rank < k -- the same output
as the sort, from cdiv(T, 16) programs per row that each compare 16 keys against T, where the sort was
one program per row sorting all T keys (a bitonic network of log2(T)^2/2 dependent stages).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv
from ._common import key_index, p2, pdl, pdl_wait, round_bf16, sort_key


@triton.jit
def _indexer_scores_kernel(q_ptr, k_ptr, w_ptr, o_ptr, rows_ptr, S, H, T, D, w_scale,
                           BH: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
                           ROWS: tl.constexpr, BF16: tl.constexpr):
    pdl_wait()
    bs = tl.program_id(0).to(tl.int64)  # b * S + s
    tb = tl.program_id(1)
    b = bs // S
    if ROWS:  # keys of cache row rows[b], read in place
        b = tl.load(rows_ptr + b).to(tl.int64)
    h = tl.arange(0, BH)
    t = tb * BT + tl.arange(0, BT)
    acc = tl.zeros([BH, BT], tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        q = tl.load(q_ptr + (bs * H + h[:, None]) * D + d[None, :], mask=(h[:, None] < H) & (d[None, :] < D), other=0.0)
        k = tl.load(k_ptr + (b * T + t[None, :]) * D + d[:, None], mask=(t[None, :] < T) & (d[:, None] < D), other=0.0)
        if IEEE:
            acc += tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(q, k)
    w = tl.load(w_ptr + bs * H + h, mask=h < H, other=0.0).to(tl.float32) * w_scale  # the model's w.float() * scale
    if BF16:  # rounding "bf16": logits, w', each head's term and the head sum on the bf16 grid
        lg = round_bf16(acc)
        term = round_bf16(tl.maximum(lg, 0.0) * round_bf16(w)[:, None])
        sc = round_bf16(tl.sum(term, 0))
    else:
        sc = tl.sum(tl.maximum(acc, 0.0) * w[:, None], 0)
    tl.store(o_ptr + bs * T + t, sc, mask=t < T)


@implement("indexer_scores", "triton")
def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, rows: torch.Tensor | None = None,
                   w_scale: float = 1.0, rounding: str = "fp32") -> torch.Tensor:
    if rounding not in ("fp32", "bf16"):
        raise ValueError(f"indexer_scores rounding {rounding!r}: fp32 | bf16")
    B, S, H, D = q.shape
    T = k.size(1)
    q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
    rows_t = rows.long().contiguous() if rows is not None else q  # (dummy pointer when unused)
    ieee = q.dtype == torch.float32 or k.dtype == torch.float32 or q.dtype != k.dtype
    out = torch.empty(B, S, T, dtype=torch.float32, device=q.device)
    if B * S * T == 0:
        return out
    BH = max(16, p2(H))
    # one [BH, BT] fp32 tile per program: BT up to 128 (BH * BT <= 8192) so Q is re-read T/128 times,
    # not T/32; the whole head dim (<= 128) per step
    BT = max(16, min(p2(T), 8192 // BH, 128))
    BD = max(16, min(p2(D), 128))
    _indexer_scores_kernel[(B * S, cdiv(T, BT))](q, k, w, out, rows_t, S, H, T, D, float(w_scale), BH=BH,
                                                        BT=BT, BD=BD, IEEE=ieee, ROWS=rows is not None,
                                                        BF16=rounding == "bf16", num_warps=4,
                                                        **pdl())
    return out


@triton.jit
def _topk_round_kernel(src_ptr, nv_ptr, dst_ptr, out_ptr, n_src, n_dst, k,
                       FROM_SCORES: tl.constexpr, FINAL: tl.constexpr, C: tl.constexpr, KP: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    j = ch * C + tl.arange(0, C)
    if FROM_SCORES:
        nv = tl.load(nv_ptr + row)
        x = tl.load(src_ptr + row * n_src + j, mask=j < n_src, other=0.0).to(tl.float32)
        key = tl.where((j < n_src) & (j < nv), sort_key(x, j), -1)
    else:
        key = tl.load(src_ptr + row * n_src + j, mask=j < n_src, other=-1)
    key = tl.sort(key, 0, descending=True)
    r = tl.arange(0, C)
    if FINAL:
        idx = tl.where(key >= 0, key_index(key), -1)
        tl.store(out_ptr + row * k + r, idx, mask=r < k)
        if C < KP:  # fewer entries than k (short context): the slots past them are empty
            r2 = tl.arange(0, KP)
            tl.store(out_ptr + row * k + r2, tl.full([KP], -1, tl.int64), mask=(r2 >= C) & (r2 < k))
    else:
        tl.store(dst_ptr + row * n_dst + ch * KP + r, key, mask=r < KP)


@triton.jit
def _topk_rank_kernel(src_ptr, nv_ptr, out_ptr, T, k, BI: tl.constexpr, BJ: tl.constexpr):
    """Program (row, block of BI entries): each valid entry i's rank = #{valid j: key_j > key_i} (keys are
    distinct, invalid ones -1 and below every valid key); out[row, rank] = i for rank < k. Slots from the
    number of valid entries up to k get -1, each program the slots of its own block."""
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    nv = tl.minimum(tl.load(nv_ptr + row), T)
    vi = i < nv  # nv <= T
    xi = tl.load(src_ptr + row * T + i, mask=vi, other=0.0).to(tl.float32)
    ki = tl.where(vi, sort_key(xi, i), -1)
    above = tl.zeros([BI, BJ], tl.int32)  # counts per lane, reduced once after the loop (no per-step shuffles)
    for j0 in range(0, nv, BJ):
        j = j0 + tl.arange(0, BJ)
        vj = j < nv
        xj = tl.load(src_ptr + row * T + j, mask=vj, other=0.0).to(tl.float32)
        kj = tl.where(vj, sort_key(xj, j), -1)
        above += (kj[None, :] > ki[:, None]).to(tl.int32)
    rank = tl.sum(above, 1)
    tl.store(out_ptr + row * k + rank, i.to(tl.int64), mask=vi & (rank < k))
    tl.store(out_ptr + row * k + i, tl.full([BI], -1, tl.int64), mask=(i >= nv) & (i < k))


RANK_MAX_COMPARES = 1 << 24
"""Rows x T x T (key comparisons) up to which `topk_indices` ranks instead of sorting. Ranking (16 x 256 tiles)
is several times faster than the sort at decode sizes -- most where the sort pads T to the next power of two
(T 1030, a flash cache sized for 4096 + a few tokens, sorts 2048 keys) -- and still ahead at 2^24 compares
(batch 16 at T 1024); past it the sort wins, since ranking's work grows as T^2 (docs/perf-log.md,
"Programmatic dependent launch, rank top-k")."""
RANK_BI, RANK_BJ = 16, 256

CHUNK = 2048  # keys sorted per program per round (tests lower it to exercise several rounds)


@implement("topk_indices", "triton")
def topk_indices(scores: torch.Tensor, k: int, n_valid: torch.Tensor) -> torch.Tensor:
    B, S, T = scores.shape
    rows = B * S
    out = torch.empty(B, S, k, dtype=torch.int64, device=scores.device)
    if rows == 0 or k == 0:
        return out
    sc = scores.contiguous()
    nv = n_valid.to(torch.int64).contiguous()
    if rows * T * T <= RANK_MAX_COMPARES:
        _topk_rank_kernel[(rows, cdiv(max(T, k), RANK_BI))](sc, nv, out, T, k, BI=RANK_BI, BJ=RANK_BJ,
                                                                   **pdl())
        return out
    KP = p2(k)
    C = max(2 * KP, p2(CHUNK))
    if T <= C:
        # sort only the T entries, not k slots: at decode the context often has fewer compressed entries
        # than the top-k (V4: k 512; 32 entries at 128 tokens), where a 512-key sort was a visible part of
        # each CSA layer's decode step
        Cf = max(p2(T), 16)
        _topk_round_kernel[(rows, 1)](sc, nv, out, out, T, 0, k, FROM_SCORES=True, FINAL=True, C=Cf, KP=KP,
                                      **pdl())
        return out
    nch = cdiv(T, C)
    cand = torch.empty(rows, nch * KP, dtype=torch.int64, device=scores.device)
    _topk_round_kernel[(rows, nch)](sc, nv, cand, out, T, nch * KP, k, FROM_SCORES=True, FINAL=False, C=C, KP=KP,
                                    **pdl())
    n = nch * KP
    while n > C:
        nch = cdiv(n, C)
        nxt = torch.empty(rows, nch * KP, dtype=torch.int64, device=scores.device)
        _topk_round_kernel[(rows, nch)](cand, nv, nxt, out, n, nch * KP, k, FROM_SCORES=False, FINAL=False, C=C, KP=KP,
                                        **pdl())
        cand, n = nxt, nch * KP
    _topk_round_kernel[(rows, 1)](cand, nv, out, out, n, 0, k, FROM_SCORES=False, FINAL=True, C=max(p2(n), KP), KP=KP,
                                  **pdl())
    return out
