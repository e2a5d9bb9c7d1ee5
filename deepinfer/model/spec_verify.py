"""Speculative verify: S tokens per row at per-row positions, in one forward, with no cache written.

A verify step (`Transformer.verify`, `Transformer.mtp_verify`) feeds each row b the tokens at positions
start[b] .. start[b] + S - 1 (the last sampled token and the drafts). It must not change any cache: which of
those tokens are kept is known only after the step (acceptance), and a cache that saw a rejected token
would differ from one that never did (the ring overwrites an older position's slot; a compressor's partial
window and overlap half, and the entries it pools, would hold the rejected token).

So verify reads the caches and writes none of them:

* each layer gathers its rows' cache `kv_cache[rows]` [B, win + E, ·] (a copy) and attends over it plus
  this step's S keys: query t sees the window positions < start from the ring, those >= start from the
  step's own keys, and every compressed entry complete at t (j < (t + 1) // ratio);
* the entries the step's tokens complete are pooled on copies of the compressors' carried state
  (`compress_decode` token by token, exactly as decode would) and written into the gathered copy only
  (indexer: into a copy of its key cache), so the step's later queries see them;
* what a commit needs is kept in `ctx.pending[attention]`: the S tokens' normed kv and the compressors'
  projections of x.

`commit(attention, pending, ctx, rows)` then writes the kept tokens (a prefix of each row) exactly
as decode steps over those tokens would have: their kv into the ring, and the compressors fed token by
token (`compress_decode` + the entry of the window into the cache). The other tokens are written to
the spare row (the decode runner's padding row), so the shapes never depend on the acceptance and
nothing reads the host: the whole step can be captured as a CUDA graph. Equality with a run that never
saw the rejected tokens is tested cache tensor by cache tensor (tests/test_speculative.py).

`Snapshot` saves and restores what a commit of a few positions can touch (the MTP draft chain commits
its draft tokens so that the next draft attends them, then restores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import ops


@dataclass
class Pending:
    """What one attention's verify step leaves for `commit`: kv [B, S, hd] normed (cache values, the float
    form), the compressors' (kv, score) projections [B, S, coff·d] float32 (None without one)."""

    kv: torch.Tensor
    comp: tuple | None = None
    index: tuple | None = None


def _cache_values(a, kv: torch.Tensor) -> torch.Tensor:
    """kv after norm + RoPE -> the values the cache holds, float form (float layout's QAT as decode)."""
    if a.kv_qat and not a.fp8_kv:
        return torch.cat([ops.fp8_fake_quant(kv[..., :-a.rd], 64), kv[..., -a.rd:]], -1)
    return kv


def _feed_tables(ctx, r: int) -> tuple:
    """Per token i of a verify step: (cos, sin) [B, 1, R/2] of its window's first position max(p - (r - 1), 0)
    and its entry slot p // r [B], for ratio r. Made once a step (`ctx.memo`) for every compressor of that
    ratio, the step's and its commit's: a few launches a token that each compressor made again."""
    def make():  # one gather and one division for all S tokens, sliced per token (views)
        p = ctx.positions
        cos, sin = ctx.rope.get("compress", (p - (r - 1)).clamp_min(0))  # [B, S, R/2]
        slot = p // r
        return tuple((cos[:, i:i + 1], sin[:, i:i + 1], slot[:, i]) for i in range(p.size(1)))

    return ctx.memo(("feed", r), make)


def _feed(comp, proj: tuple, pos: torch.Tensor, rows: torch.Tensor, kv_state: torch.Tensor,
          score_state: torch.Tensor, cache: torch.Tensor, ctx) -> None:
    """Feed S tokens through a compressor as S decode steps would: proj (kv, score) [B, S, coff·d], pos
    [B, S] (ctx.positions), rows [B, S] into kv_state / score_state and the entry slot pos // ratio of `cache`
    (rows index all three). Same ops, same order as `Compressor.decode`: the values are decode's."""
    kvp, scp = proj
    for i, (cos, sin, slot) in enumerate(_feed_tables(ctx, comp.ratio)):
        pooled = ops.compress_decode(kvp[:, i], scp[:, i], comp.ape, pos[:, i], rows[:, i], kv_state, score_state,
                                     comp.overlap, out_dtype=comp.numerics.dtype).unsqueeze(1)
        entry = comp._finish(pooled, cos, sin)[:, 0]
        ops.kv_store(cache, rows[:, i], slot, entry, rope_dim=comp.rd if comp.fp8_cache else 0)


def _scratch_feed(comp, proj: tuple, ctx, cache_copy: torch.Tensor) -> None:
    """`_feed` on copies of the rows' carried state, writing entries into `cache_copy` [B, E, ·] (this
    step's gathered copy): the entries the step completes, seen by its own later queries only."""
    B = ctx.rows.size(0)
    ar = ctx.memo(("verify_copy_rows", B), lambda: torch.arange(B, device=ctx.rows.device))
    st_kv, st_sc = comp.kv_state[ctx.rows], comp.score_state[ctx.rows]  # copies
    _feed(comp, proj, ctx.positions, ar.unsqueeze(1).expand_as(ctx.positions), st_kv, st_sc, cache_copy, ctx)


def window_idx(pos: torch.Tensor, start: torch.Tensor, win: int, n_cache: int) -> torch.Tensor:
    """pos [B, S] query positions, start [B] -> [B, S, win] indices into a row's [cache (n_cache) | step's
    S keys]: the window's positions in decode's order (`decode_slots`: oldest first, then -1), those before
    `start` at their ring slot, the step's own at n_cache + (u - start)."""
    c = torch.arange(win, device=pos.device)
    t = pos.unsqueeze(-1)
    full = t >= win - 1
    u = torch.where(full, t - win + 1 + c, c)
    st = start.view(-1, 1, 1)
    slot = torch.where(u < st, u % win, n_cache + (u - st))
    return torch.where(full | (c <= t), slot, -1)


def verify_attention(a, x: torch.Tensor, ctx, xq: tuple | None = None) -> torch.Tensor:
    """`Attention.__call__` for a verify step: x [B, S, D] at ctx.positions [B, S] (consecutive per row,
    from start = positions[:, 0]) -> [B, S, D]; no cache written, `ctx.pending[a]` filled."""
    B, S, _ = x.shape
    pos, rows, win = ctx.positions, ctx.rows, a.win
    cos, sin = ctx.rope_at_positions(a.rope_kind)
    qa, kva = a.project(x, xq)
    qr = a.q_lora(qa)
    q = a.q_heads(qr, cos, sin)
    kv = _cache_values(a, ops.rms_norm_rope(kva, a.kv_norm, a.eps, cos, sin, a.rd))
    new = ops.kv_pack(kv, a.rd) if a.fp8_kv else kv.to(a.kv_cache.dtype)
    seq = a.kv_cache[rows]  # [B, win + E, ·], a copy: the step's entries are written into it only
    N = seq.size(1)
    pend = Pending(kv)
    # the index tables are the same for every layer of one shape: made once a step (`ctx.memo`)
    idx = ctx.memo(("verify_window", win, N), lambda: window_idx(pos, pos[:, 0], win, N))
    if a.compressor is not None:
        pend.comp = a.compressor._project(x)
        _scratch_feed(a.compressor, pend.comp, ctx, seq[:, win:])
        if a.indexer is not None:
            ix = a.indexer
            keys = ix.compressor.cache[rows]
            pend.index = ix.compressor._project(x)
            _scratch_feed(ix.compressor, pend.index, ctx, keys)
            scores = ops.indexer_scores(ix.query(qr, ctx), keys, ix.weights_proj(x), None, w_scale=ix.scale,
                                        rounding=ix.rounding)
            top = ops.topk_indices(scores, min(ix.topk, keys.size(1)), ctx.n_valid(ix.ratio))
            ent = torch.where(top >= 0, top + win, -1)
        else:  # HCA: every entry complete at the query
            def visible():
                j = torch.arange(N - win, device=x.device)
                return torch.where(j < ((pos + 1) // a.ratio).unsqueeze(-1), j + win, -1)

            ent = ctx.memo(("verify_hca", a.ratio, win, N), visible)
        idx = torch.cat([idx, ent], -1)
    ctx.pending[a] = pend
    o = a._attend(q, torch.cat([seq, new], 1), idx, (cos, sin))
    return a.out(o)


def commit(a, pend: Pending, ctx, rows: torch.Tensor) -> None:
    """Write the kept tokens of a verify step into `a`'s caches, as decode steps over them would: rows [B, S] the
    cache row each token goes to -- its own row for the kept ones (a prefix of each row), the spare row (never a
    live row) for the others, made once a step by `Transformer.commit` -- so nothing here depends on the host."""
    pos = ctx.positions
    ring = ctx.memo(("commit_ring", a.win), lambda: (pos % a.win).flatten())  # the same for every layer
    ops.kv_store(a.kv_cache, rows.flatten(), ring, pend.kv.flatten(0, 1), rope_dim=a.rd if a.fp8_kv else 0)
    if a.compressor is not None:
        c = a.compressor
        _feed(c, pend.comp, pos, rows, c.kv_state, c.score_state, c.cache, ctx)
    if a.indexer is not None:
        c = a.indexer.compressor
        _feed(c, pend.index, pos, rows, c.kv_state, c.score_state, c.cache, ctx)


class Snapshot:
    """What committing positions start .. start + n - 1 of `rows` can change in attention `a`: those ring
    slots, the compressors' carried state and the entry slots those positions fall in. `restore()` puts
    them back (host-sync free). n <= window."""

    def __init__(self, a, rows: torch.Tensor, start: torch.Tensor, n: int):
        self.a, self.rows = a, rows
        p = start.unsqueeze(1) + torch.arange(n, device=start.device)  # [B, n]
        self.r2 = rows.unsqueeze(1).expand_as(p)
        self.ring = p % a.win
        self.saved = [(a.kv_cache, self.ring, a.kv_cache[self.r2, self.ring])]
        self.states = []
        comps = []
        if a.compressor is not None:
            comps.append((a.compressor, a.kv_cache, a.win))
        if a.indexer is not None:
            comps.append((a.indexer.compressor, a.indexer.compressor.cache, 0))
        for c, cache, off in comps:
            slots = off + p // c.ratio
            self.saved.append((cache, slots, cache[self.r2, slots]))
            self.states.append((c, c.kv_state[rows], c.score_state[rows]))

    def restore(self) -> None:
        for cache, slots, vals in self.saved:
            cache[self.r2, slots] = vals
        for c, kv, sc in self.states:
            c.kv_state[self.rows], c.score_state[self.rows] = kv, sc
