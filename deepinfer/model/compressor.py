"""KV compressor of CSA/HCA layers and of the lightning indexer.

Each window of `ratio` tokens pools into one compressed entry: a per-channel softmax over the window of
`wgate(x) + ape` weighting `wkv(x)`, then RMSNorm, RoPE at the window's first position, and (official
numerics) the same QAT simulation as the cache it feeds. CSA (`overlap`) projects two series per token:
entry w pools window w-1's first half of channels with window w's second half (2·ratio slots).

Decode carries the partial window and the overlap half between steps in `kv_state` / `score_state`
[R, coff·ratio, coff·d] (float32; -inf scores mark empty slots, which softmax weights 0).
"""

from __future__ import annotations

import torch

from deepinfer.model.numerics import Numerics
from deepinfer.model.weights import WeightSource
from deepinfer.ops import ops


class Compressor:
    """One compressor. `cache` is a [R, max_entries, d] view the owner allocates (attention: the tail
    of its KV buffer; indexer: its key buffer)."""

    def __init__(self, W: WeightSource, prefix: str, ratio: int, head_dim: int, rope_dim: int,
                 overlap: bool, rotate: bool, numerics: Numerics, norm_eps: float):
        self.ratio, self.d, self.rd = ratio, head_dim, rope_dim
        self.overlap, self.rotate, self.numerics, self.eps = overlap, rotate, numerics, norm_eps
        self.coff = 2 if overlap else 1
        # The official code keeps the compressor in float32 (the checkpoint stores bf16).
        self.ape = W.f32(prefix + "ape")  # [ratio, coff·d]
        # wkv and wgate stacked: [2·coff·d, D], one projection (one GEMV launch at decode) for both series,
        # held as stored (bf16): `_project` computes x.float() @ W.float() without either copy
        self.wkv_gate = torch.cat([W.stored_float(prefix + name) for name in ("wkv", "wgate")])
        self.norm = W.f32(prefix + "norm.weight")
        self.cache: torch.Tensor | None = None
        self.kv_state = self.score_state = None
        # Set by the owner (`Attention.set_kv_layout`) when `cache` holds FP8-layout rows (`ops.kv_pack`):
        # entries are packed on the way in (which is also their QAT) and handed out packed.
        self.fp8_cache = False
        self.kv_qat = False  # attention entries on the FP8 grid (set by the owner with the cache's QAT)

    def allocate(self, rows: int, device) -> None:
        shape = (rows, self.coff * self.ratio, self.coff * self.d)
        self.kv_state = torch.zeros(shape, dtype=torch.float32, device=device)
        self.score_state = torch.full(shape, float("-inf"), dtype=torch.float32, device=device)

    # ------------------------------------------------------------------------------------------
    def _finish(self, pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """pooled [B, W, d] (f32 or the compute dtype), cos/sin [B, W, rd/2] of the windows' first positions
        -> entries [B, W, d] in the compute dtype."""
        kv = ops.rms_norm_rope(pooled.to(self.numerics.dtype), self.norm, self.eps, cos, sin, self.rd)
        if self.rotate:  # indexer keys: Hadamard (both numerics, see Indexer), then FP4 simulation (one op)
            kv = ops.hadamard(kv, 32) if self.numerics.official else ops.hadamard(kv)
        elif self.kv_qat and not self.fp8_cache:  # float layout: the FP8 QAT of the no-RoPE dims
            kv = torch.cat([ops.fp8_fake_quant(kv[..., :-self.rd], 64), kv[..., -self.rd:]], -1)
        return kv

    def _encode(self, entries: torch.Tensor) -> torch.Tensor:
        """Entries [..., d] in the cache's form: FP8 layout rows (the QAT and the packing in one op) or a cast."""
        return ops.kv_pack(entries, self.rd) if self.fp8_cache else entries.to(self.cache.dtype)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> (wkv(x), wgate(x)) [B, S, coff·d] float32: the two halves of one projection."""
        y = ops.linear(x, self.wkv_gate, out_dtype=torch.float32)
        n = self.coff * self.d
        return y[..., :n], y[..., n:]

    def prefill(self, x: torch.Tensor, rows: torch.Tensor, ctx) -> torch.Tensor:
        """x [B, S, D] from position 0 -> the S // ratio complete entries [B, S//ratio, d] (FP8-layout rows
        [B, S//ratio, W] when `fp8_cache`); also writes them to `cache` and leaves the carry-over (overlap
        half, partial window) in the state. ctx: the step's `StepContext` (its rope tables and memo)."""
        n, entries = self._pool(x, 0, rows, ctx, fresh=True)
        if entries is None:  # no window complete: no entry
            entries = self.cache[rows, :0]
        return entries if self.fp8_cache else entries.to(self.numerics.dtype)

    def extend(self, x: torch.Tensor, start: int, rows: torch.Tensor, ctx) -> int:
        """x [B, S, D] at positions start .. start+S-1 of each row, the state holding positions < start (an
        earlier `prefill` / `extend`, or empty at 0). Pools every window the tokens complete into
        `cache[rows, start // ratio ..]` and leaves the new carry-over in the state, exactly as one pass
        over the whole prompt would (chunked prefill). Returns the number of entries now complete.
        """
        return self._pool(x, start, rows, ctx, fresh=False)[0]

    def _window_rope(self, ctx, start: int, S: int, B: int):
        """The (cos, sin) [B, n, rd/2] at the first positions of the n windows a prompt chunk at start ..
        start+S-1 completes for this ratio, or None when it completes none: made once a step and shared by every
        compressor of the ratio (`ctx.memo`)."""
        r = self.ratio

        def make():
            part = start % r
            n = (part + S) // r
            if not n:
                return None
            first = (start - part + torch.arange(n, device=ctx.positions.device) * r).unsqueeze(0).expand(B, n)
            return ctx.rope.get("compress", first)

        return ctx.memo(("compress_chunk", r, start, S, B), make)

    def _pool(self, x: torch.Tensor, start: int, rows: torch.Tensor, ctx, fresh: bool) -> tuple:
        """`extend`'s work -> (entries complete after the chunk, the chunk's new entries in the cache's form
        [B, n, ·] or None when it completes none). fresh: rows start a new sequence (start 0): their state is
        empty (zeros, -inf scores) whatever it holds, so it is neither reset nor read, only written."""
        B, S = x.size(0), x.size(1)
        kv, score = self._project(x)  # [B, S, coff*d]
        # the windows the chunk completes, pooled, and the carry-over (overlap half, partial window) in the state:
        # one op (two launches on Triton) where the assembly of the windows was ~17 torch launches
        pooled = ops.compress_prefill(kv, score, self.ape, start, rows, self.kv_state, self.score_state,
                                      self.overlap, fresh, out_dtype=self.numerics.dtype)
        first_entry, n = start // self.ratio, pooled.size(1)
        if n == 0:
            return first_entry, None
        entries = self._encode(self._finish(pooled, *self._window_rope(ctx, start, S, B)))
        self.cache[rows, first_entry:first_entry + n] = entries
        return first_entry + n, entries

    def decode(self, x: torch.Tensor, ctx) -> None:
        """x [B, 1, D] at the step's per-row positions ctx.pos [B] (< the allocated max_seq_len), cache rows
        ctx.rows: update the state and write the entry of the window pos lies in to `cache[row, pos //
        ratio]` (complete once (pos + 1) % ratio == 0). Branch-free over rows (no host sync). The window's
        cos/sin and entry slot are built once per step and ratio (`ctx.memo`), shared by every compressor
        of that ratio."""
        r, pos, rows = self.ratio, ctx.pos, ctx.rows
        # the step's tables first: a compressor of the same ratio on another stream waits for these only
        cos, sin = ctx.memo(("compress_first", r),
                            lambda: ctx.rope.get("compress", (pos - (r - 1)).clamp_min_(0).unsqueeze(1)))
        slot = ctx.memo(("entry_slot", r), lambda: pos // r)
        kv, score = self._project(x)
        pooled = ops.compress_decode(kv[:, 0], score[:, 0], self.ape, pos, rows, self.kv_state, self.score_state,
                                     self.overlap, out_dtype=self.numerics.dtype).unsqueeze(1)  # [B, 1, d]
        # The window being filled owns slot pos // r (the +1 entry `allocate` adds), so its partial entry
        # is written every step and the complete one when the window completes; nothing reads an entry
        # before that (attention: j < (t + 1) // r; the indexer's top-k masks j >= n_valid). Saves the
        # read of the old entry and the select of the old per-row `where` form.
        if self.fp8_cache and not self.rotate:  # the entry norm's launch packs it into its slot
            ops.rms_norm_rope_store(pooled.to(self.numerics.dtype), self.norm, self.eps, cos, sin, self.rd,
                                    self.cache, rows, slot, True)
            return
        entry = self._finish(pooled, cos, sin)[:, 0]
        # kv_store casts to the cache's dtype, or packs into its FP8 layout (rope_dim): `_encode` in the write
        ops.kv_store(self.cache, rows, slot, entry, rope_dim=self.rd if self.fp8_cache else 0)
