"""V4 attention: shared-KV MQA over a sliding window plus (CSA/HCA) compressed entries.

* q: wq_a -> q_norm -> wq_b, per-head unweighted RMSNorm, RoPE on the last `rope_head_dim` dims.
* kv: one head, K = V: wkv -> kv_norm -> RoPE; official numerics FP8-simulate its no-RoPE dims.
* SWA sees the last `window_size` tokens; HCA adds every complete compressed entry; CSA adds the
  entries the lightning indexer picks (top-k). Entry j is visible to query t iff j < (t+1) // ratio.
* softmax with a learned per-head sink in the denominator; the output's RoPE dims get the inverse
  rotation; grouped low-rank output projection wo_a (per group) then wo_b.

Cache per layer (R rows): `kv_cache` [R, window + max_entries, ·] = window ring buffer (position p at
slot p % window) followed by the compressed entries; the indexer keeps its own key buffer. Official
numerics hold it in the FP8 KV layout (`ops.kv_pack`: uint8 rows of W bytes, e4m3 no-RoPE dims with a
ue8m0 scale per 64, rope dims in the compute dtype; V4: 592 bytes instead of 1024 in bf16); decode
attends with `ops.sparse_attn_fp8`, which reads it in place, prefill decodes its rows once (`_attend`). Packing is the cache's QAT, so the values attended
are the ones the float cache held (fp8_fake_quant); exact numerics keep [.., head_dim] floats.
"""

from __future__ import annotations

import torch

from deepinfer.capture import is_active, tap
from deepinfer.config import ModelConfig
from deepinfer.model.branch import Branch, Shared, fork
from deepinfer.model.compressor import Compressor
from deepinfer.model.rope import rope_kind, rope_tail_
from deepinfer.model.numerics import Numerics
from deepinfer.model.weights import Linear, WeightSource
from deepinfer.ops import ops
from deepinfer.quant.grouped import grouped_bmm
from deepinfer.quant.kv_layout import kv_packed_width


class StepContext:
    """What one forward step needs besides the activations.

    prefill: every row starts at position `start` (0, or a later chunk of one row's prompt, its earlier
    positions in the caches) and has S tokens; decode: S == 1 at per-row `pos` [B].
    """

    def __init__(self, positions: torch.Tensor, rows: torch.Tensor, rope, prefill: bool, start: int = 0):
        self.positions = positions  # [B, S] int64
        self.rows = rows  # [B] int64 cache rows
        self.rope = rope
        self.prefill = prefill
        self.start = start  # prefill: first position (> 0: a later chunk of one row's prompt)
        # verify (speculative decoding, `deepinfer.model.spec_verify`): a dict the attentions fill with what a
        # later `commit` writes -- the step itself writes no cache; None for prefill and decode
        self.pending: dict | None = None
        self._memo = {}

    def memo(self, key, make):
        """`make()` once per step for `key`: tensors every layer of the same kind or shape would rebuild
        (cos/sin, decode's window slots, HCA's visible entries), a few small kernels each."""
        if key not in self._memo:  # made on one stream, read on any (`Shared`: ordered, kept alive)
            self._memo[key] = Shared(make())
        return self._memo[key].get()

    def seed_decode_tables(self, ratios: tuple[int, ...], win: int) -> None:
        """A decode step (one position a row): make every layer's position tables now, in one op
        (`ops.decode_tables`), under the keys the layers ask for them by -- the rope rows at pos, the
        compressors' window-start rows and entry slots, the indexer's complete-entry counts, the ring slot --
        instead of a few launches each on the layer that asks first. Made before any fork, so every lane reads
        them without waiting on another."""
        cs, idx = ops.decode_tables(self.pos, self.rope.tables["main"], self.rope.tables["compress"], ratios, win)
        m = self._memo
        for i, kind in enumerate(("main", "compress")):
            m[("rope", kind)] = Shared((cs[i][..., 0, :], cs[i][..., 1, :]))
        m[("ring", win)] = Shared(idx[0])
        for k, r in enumerate(ratios):
            m[("compress_first", r)] = Shared((cs[2 + k][..., 0, :], cs[2 + k][..., 1, :]))
            m[("entry_slot", r)] = Shared(idx[1 + k])
            m[("n_valid", r)] = Shared(idx[1 + len(ratios) + k].view(-1, 1))

    def n_valid(self, ratio: int) -> torch.Tensor:
        """[B, S] int64: the compressed entries of ratio `ratio` complete at each position ((t + 1) // ratio),
        made once a step for every indexer of that ratio (decode, verify)."""
        return self.memo(("n_valid", ratio), lambda: (self.positions + 1) // ratio)

    def rope_at_positions(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [B, S, R/2] of rope type `kind` at this step's positions, gathered once per step and
        kind for every layer (and indexer) of that kind."""
        return self.memo(("rope", kind), lambda: self.rope.get(kind, self.positions))

    @property
    def pos(self) -> torch.Tensor:
        return self.positions[:, -1]


def _window_idx_prefill(S: int, win: int, device) -> torch.Tensor:
    """[S, min(S, win)]: query t sees positions max(0, t-win+1) .. t; -1 pads (official layout)."""
    base = torch.arange(S, device=device).unsqueeze(1)
    m = (base - win + 1).clamp_min(0) + torch.arange(min(S, win), device=device)
    return torch.where(m > base, -1, m)


class Indexer:
    """Lightning indexer: picks the top-k compressed entries per query for CSA."""

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, ratio: int, numerics: Numerics):
        self.n_heads, self.d, self.rd = cfg.index_n_heads, cfg.index_head_dim, cfg.rope_head_dim
        self.topk, self.ratio, self.numerics = cfg.index_topk, ratio, numerics
        self.wq_b = W.linear(prefix + "wq_b")
        self.weights_proj = W.linear(prefix + "weights_proj", force_float=True)
        self.scale = self.d ** -0.5 * self.n_heads ** -0.5
        self.rounding = "bf16" if numerics.official else "fp32"  # scores rounded as each numerics' source
        self.compressor = Compressor(W, prefix + "compressor.", ratio, self.d, self.rd, overlap=True, rotate=True,
                                     numerics=numerics, norm_eps=cfg.norm_eps)

    def allocate(self, rows: int, max_entries: int, device, dtype) -> None:
        self.compressor.cache = torch.zeros(rows, max_entries, self.d, dtype=dtype, device=device)
        self.compressor.allocate(rows, device)

    def start_decode(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Decode, the part that needs x only: the key compressor's step (into its cache) and the head weights
        weights_proj(x) [B, 1, n_heads] -> the weights, for `__call__`'s `w` (Attention issues this on a
        stream of its own, beside the q projections)."""
        self.compressor.decode(x, ctx)
        return self.weights_proj(x)

    def query(self, qr: tuple, ctx: StepContext) -> torch.Tensor:
        """qr (q-LoRA activations [B, S, q_lora], their act_quant or None) -> indexer queries [B, S, H, d]:
        wq_b, RoPE of the last rd dims at the step's positions, Hadamard (official: then FP4-rounded)."""
        q = self.wq_b(*qr).unflatten(-1, (self.n_heads, self.d))
        cos, sin = ctx.rope_at_positions("compress")
        q = rope_tail_(q, self.rd, cos, sin)
        # The Hadamard rotation is orthogonal (scores unchanged), so `exact` applies it too: the tapped
        # q/keys are then in the same basis in both numerics and compare element by element.
        # official: then FP4-rounded per 32, in the same op (one launch)
        return ops.hadamard(q, 32) if self.numerics.official else ops.hadamard(q)

    def __call__(self, x: torch.Tensor, qr: tuple, ctx: StepContext, name: str, w: torch.Tensor | None = None,
                 early: Branch | None = None) -> torch.Tensor:
        """x [B, S, D], qr = (q-LoRA activations [B, S, q_lora], their act_quant or None) -> entry indices
        [B, S, k'] int64 (-1 = none), k' = min(topk, T). Decode with `w` from `start_decode` (issued on the
        branch `early`, joined here before the scores read the keys) or without (done here)."""
        q = self.query(qr, ctx)
        if ctx.prefill and ctx.start:  # a later chunk: every entry complete so far, from the cache
            n = self.compressor.extend(x, ctx.start, ctx.rows[:1], ctx)
            keys = self.compressor.cache[ctx.rows[:1], :n]
        elif ctx.prefill:
            keys = self.compressor.prefill(x, ctx.rows, ctx)
        else:  # decode: score against the key cache in place (rows), no per-step gather of every row
            if w is None:
                w = self.start_decode(x, ctx)
            elif early is not None:
                w = early.join(w)
            keys = self.compressor.cache
        rows = None if ctx.prefill else ctx.rows
        if w is None:
            w = self.weights_proj(x)
        # the head weights as projected; the op scales them (w.float() * scale) as it loads them
        scores = ops.indexer_scores(q, keys, w, rows, w_scale=self.scale, rounding=self.rounding)  # [B, S, T]
        n_valid = ctx.n_valid(self.ratio)
        idx = ops.topk_indices(scores, min(self.topk, keys.size(1)), n_valid)
        if is_active():  # debug only: trim to the entries visible so far (a host sync is fine here)
            n = int(n_valid.max())
            tap(name + ".q", q)
            tap(name + ".kv", (keys if rows is None else keys[rows])[:, :n])
            tap(name + ".scores", scores[..., :n].masked_fill(
                torch.arange(n, device=scores.device) >= n_valid.unsqueeze(-1), float("-inf")))
            tap(name + ".topk", idx)
        return idx


class Attention:
    """One layer's attention (kind swa | csa | hca) with its cache."""

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, layer_id: int, numerics: Numerics):
        self.cfg, self.numerics, self.name = cfg, numerics, prefix.rstrip(".")
        self.kind, self.ratio = cfg.attn_kinds[layer_id], cfg.compress_ratios[layer_id]
        self.n_heads, self.hd, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.win, self.eps, self.groups = cfg.window_size, cfg.norm_eps, cfg.o_groups
        self.rope_kind = rope_kind(self.kind)
        self.sink = W.f32(prefix + "attn_sink")
        self.wq_a = W.linear(prefix + "wq_a")
        self.q_norm = W.f32(prefix + "q_norm.weight")
        self.wq_b = W.linear(prefix + "wq_b")
        self.wkv = W.linear(prefix + "wkv")
        # wq_a|wkv stacked: both read the normed x (and its act_quant), one GEMM for the two; the norms
        # take the output's column slices in place; wq_a / wkv stay as views of its rows
        self.wq_a_kv = Linear.stacked([self.wq_a, self.wkv])
        if self.wq_a_kv is not None:
            n = self.wq_a.out_features
            self.wq_a, self.wkv = self.wq_a_kv.rows(0, n), self.wq_a_kv.rows(n, n + self.wkv.out_features)
        self.kv_norm = W.f32(prefix + "kv_norm.weight")
        # Grouped low-rank output projection. The official convert.py dequantises wo_a to bf16 for a bmm;
        # held here as stored (FP8 + block scales, half the bytes a decode step streams) and run by
        # `fp8_grouped_linear`, whose products equal the bmm's on the dequantised weight.
        self.wo_a = W.linear(prefix + "wo_a")
        self.wo_b = W.linear(prefix + "wo_b")
        self.scale = self.hd ** -0.5
        self.compressor = self.indexer = None
        if self.kind != "swa":
            self.compressor = Compressor(W, prefix + "compressor.", self.ratio, self.hd, self.rd,
                                         overlap=self.kind == "csa", rotate=False, numerics=numerics,
                                         norm_eps=cfg.norm_eps)
        if self.kind == "csa":
            self.indexer = Indexer(cfg, W, prefix + "indexer.", self.ratio, numerics)
        # the q head norm rounds where the implementation each numerics follows rounds (`head_norm`)
        self.q_norm_form = "official_q" if numerics.official else "transformers_q"
        self.kv_cache = None
        # official numerics' QAT of the cache (the release's act_quant(inplace=True): `Numerics.kv_qat`): its
        # no-RoPE dims and the compressed entries on the FP8 grid, the cache in its FP8 layout
        self.set_kv_qat(numerics.kv_qat)

    def set_kv_qat(self, on: bool) -> None:
        """Official numerics' KV QAT on (no-RoPE dims and compressed entries FP8-rounded per 64, the cache in its
        FP8 layout) or off (kept as computed, a float cache); before `allocate`. The model is built with its
        numerics' choice; bisect's KV-format sites switch single layers."""
        if on and not self.numerics.official:
            raise ValueError("the KV QAT (kv=fp8) is official numerics'; exact numerics keep a float cache")
        self.kv_qat = on
        if self.compressor is not None:
            self.compressor.kv_qat = on
        self.set_kv_layout("fp8" if on else "float")

    def set_kv_layout(self, layout: str) -> None:
        """How the cache holds kv (before `allocate`): "fp8", official numerics' form, the FP8 KV layout
        (`ops.kv_pack`); or "float", [.., head_dim] in the compute dtype, exact numerics' only form. Under
        official numerics the float form holds the same QAT values (fp8_fake_quant of the no-RoPE dims per
        64): the oracle the FP8 layout is checked against (tests/test_kv_layout.py)."""
        if layout not in ("fp8", "float"):
            raise ValueError(f"kv layout {layout!r}: fp8 | float")
        if layout == "fp8" and not self.kv_qat:
            raise ValueError("the FP8 KV layout is official numerics' KV QAT; exact numerics and kv=bf16 keep "
                             "float caches")
        self.fp8_kv = layout == "fp8"
        if self.compressor is not None:
            self.compressor.fp8_cache = self.fp8_kv

    def allocate(self, rows: int, max_seq_len: int, device, dtype) -> None:
        # +1: the entry being filled has a slot too (decode writes its partial entry there until it completes)
        n_entries = max_seq_len // self.ratio + 1 if self.ratio else 0
        if self.fp8_kv:  # the indexer's key cache below stays in `dtype`
            width, store = kv_packed_width(self.hd, self.rd, dtype), torch.uint8
        else:
            width, store = self.hd, dtype
        self.kv_cache = torch.zeros(rows, self.win + n_entries, width, dtype=store, device=device)
        if self.compressor is not None:
            self.compressor.cache = self.kv_cache[:, self.win:]
            self.compressor.allocate(rows, device)
        if self.indexer is not None:
            self.indexer.allocate(rows, n_entries, device, dtype)

    def __call__(self, x: torch.Tensor, ctx: StepContext, xq: tuple | None = None) -> torch.Tensor:
        """x [B, S, D] (after attn_norm; xq its act_quant when the caller fused it) -> [B, S, D].

        The one order of the sub-steps. At decode, the work that reads only x (or only the positions) is
        forked onto lanes (`deepinfer.model.branch.fork`): a lane runs beside the q path on a side stream when
        the runner issuing the step supplies streams (`Lanes.issuing`, the engine's decode runner on CUDA), in
        this order on one stream otherwise. The values are the same either way."""
        if ctx.pending is not None:  # speculative verify: reads the caches, writes none of them
            from deepinfer.model.spec_verify import verify_attention

            return verify_attention(self, x, ctx, xq)
        cos, sin = ctx.rope_at_positions(self.rope_kind)
        if ctx.prefill:
            qa, kva = self.project(x, xq)
            qr = self.q_lora(qa)
            q = self.q_heads(qr, cos, sin)
            kv = self.kv_prefill(kva, ctx, cos, sin)
            self.tap_qkv(q, kv, ctx)
            o = (self._extend if ctx.start else self._prefill)(x, q, kv, qr, ctx, (cos, sin))
        else:
            o = self._decode(x, ctx, xq, cos, sin)
        tap(self.name + ".core", o)
        return self.out(o)

    def _decode(self, x: torch.Tensor, ctx: StepContext, xq: tuple | None, cos, sin) -> torch.Tensor:
        """One token per row, x [B, 1, D] -> the attention's core output [B, 1, H, hd]. Beside the q path
        (project -> q_lora -> q_heads), on lanes: HCA's entry compressor; CSA's indexer keys and head weights,
        then the indexer's top-k; SWA / HCA's kv norm, cache write and window slots. CSA's kv write and entry
        compressor stay on the q path: with the entry compressor on a lane too, the lanes were the step's
        critical path, about twice the q path at flash shapes (docs/perf-log.md, "Decode on two streams").
        Every lane is joined before the sparse attention reads the cache."""
        csa, hca = self.indexer is not None, self.compressor is not None and self.indexer is None
        b_entry = fork(x, on=hca, lane="compressor")
        if hca:
            with b_entry:
                self.compressor.decode(x, ctx)
        b_keys = fork(x, on=csa, lane="indexer_keys")
        w_ix = None
        if csa:
            with b_keys:
                w_ix = self.indexer.start_decode(x, ctx)
        qa, kva = self.project(x, xq)
        qr = self.q_lora(qa)
        b_kv = fork(x, on=not csa, lane="kv")
        if not csa:  # SWA / HCA: kv norm, cache write and window slots need kva and the positions only
            with b_kv:
                kv = self.kv_decode(kva, ctx, cos, sin)  # into the cache, where the attention reads it
                slots = self.window_slots(ctx)
        b_top = fork(x, on=csa, lane="indexer")
        if csa:
            with b_top:
                slots = self.select_decode(x, qr, ctx, w=w_ix, early=b_keys)
        # the FP8 cache's attention op takes wq_b's output and norms it as it loads q (`q_norm_sparse_attn_fp8`:
        # one launch fewer on the critical path); a debug capture taps the normed q, so it runs the two ops
        fused_q = self.fp8_kv and not is_active()
        q = self.q_raw(qr) if fused_q else self.q_heads(qr, cos, sin)
        if csa:
            kv = self.kv_decode(kva, ctx, cos, sin)
            self.compressor.decode(x, ctx)
        if is_active():  # debug capture: no lane is on a side stream, kv is ready
            self.tap_qkv(q, kv, ctx)
        return self.attend_decode(q, ctx, slots, (cos, sin), branches=(b_entry, b_keys, b_top, b_kv),
                                  q_normed=not fused_q)

    # ---------------------------------------------------------------------------------- sub-steps
    def project(self, x: torch.Tensor, xq: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, D] -> (q-LoRA input wq_a(x) [B, S, q_lora], kv input wkv(x) [B, S, hd]), one GEMM for
        both when they are stacked."""
        if self.wq_a_kv is None:
            return self.wq_a(x, xq), self.wkv(x, xq)
        qa_kv = self.wq_a_kv(x, xq)
        nq = self.wq_a.out_features
        return qa_kv[..., :nq], qa_kv[..., nq:]

    def q_lora(self, qa: torch.Tensor) -> tuple:
        """q_norm(qa) -> (qr [B, S, q_lora], its act_quant or None): the input of wq_b and of the indexer's
        wq_b (two FP8 projections: quantised once)."""
        if self.wq_b.fmt != "float":
            qr, *qrq = ops.rms_norm_quant(qa, self.q_norm, self.eps)
            return qr, qrq
        return ops.rms_norm(qa, self.q_norm, self.eps), None

    def q_raw(self, qr: tuple) -> torch.Tensor:
        """wq_b(qr) per head, before its norm -> [B, S, H, hd]."""
        return self.wq_b(*qr).unflatten(-1, (self.n_heads, self.hd))

    def q_heads(self, qr: tuple, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """wq_b(qr) -> per-head unweighted RMSNorm (rounded as each numerics' source, `head_norm`) with the
        RoPE of the last rd dims, one launch -> q [B, S, H, hd]."""
        return ops.rms_norm_rope(self.q_raw(qr), None, self.eps, cos, sin, self.rd, form=self.q_norm_form)

    def kv_prefill(self, kva: torch.Tensor, ctx: StepContext, cos, sin) -> torch.Tensor:
        """kv_norm with RoPE of the prompt's kv [B, S, hd] -> the cache's form of it (`_cache_form`)."""
        return self._cache_form(ops.rms_norm_rope(kva, self.kv_norm, self.eps, cos, sin, self.rd), ctx)

    def kv_decode(self, kva: torch.Tensor, ctx: StepContext, cos, sin) -> torch.Tensor:
        """Decode: kva [B, 1, hd] -> the kv norm with the RoPE of its last rd dims, written to the ring slot
        pos % win of each row (the FP8 layout packed on the way). Returns the normed kv (debug taps)."""
        pos, win = ctx.pos, self.win
        slots = ctx.memo(("ring", win), lambda: pos % win)
        if self.fp8_kv:  # the norm's launch packs the entry into its slot (`rms_norm_rope_store`)
            return ops.rms_norm_rope_store(kva, self.kv_norm, self.eps, cos, sin, self.rd, self.kv_cache, ctx.rows,
                                           slots, True)
        kv = self._cache_form(ops.rms_norm_rope(kva, self.kv_norm, self.eps, cos, sin, self.rd), ctx)
        ops.kv_store(self.kv_cache, ctx.rows, slots, kv[:, 0])
        return kv

    def window_slots(self, ctx: StepContext) -> torch.Tensor:
        """The decode slots of SWA and HCA layers (one launch, shared by the layers of one shape): ring slots
        holding a position <= pos, oldest first, then (HCA) every complete compressed entry."""
        pos, rows, win, N = ctx.pos, ctx.rows, self.win, self.kv_cache.size(1)
        if self.compressor is not None:
            return ctx.memo(("slots", win, N, self.ratio),
                            lambda: ops.decode_slots(pos, rows, win, N, None, N - win, self.ratio))
        return ctx.memo(("slots", win, N), lambda: ops.decode_slots(pos, rows, win, N))

    def select_decode(self, x: torch.Tensor, qr: tuple, ctx: StepContext, w: torch.Tensor | None = None,
                      early: Branch | None = None) -> torch.Tensor:
        """CSA decode: the window's slots then the indexer's top-k entries, as cache slots [1, B, win + k]
        (`Indexer.__call__`; w, early: its `start_decode` issued ahead, on a branch)."""
        top = self.indexer(x, qr, ctx, self.name + ".indexer", w=w, early=early)
        return ops.decode_slots(ctx.pos, ctx.rows, self.win, self.kv_cache.size(1), top)

    def tap_qkv(self, q: torch.Tensor, kv: torch.Tensor, ctx: StepContext) -> None:
        tap(self.name + ".q", q)
        if is_active():
            packed = ops.kv_pack(kv, self.rd) if self.fp8_kv and not ctx.prefill else kv
            tap(self.name + ".kv", self._entries(packed, q.dtype))

    def attend_decode(self, q: torch.Tensor, ctx: StepContext, slots: torch.Tensor, rope: tuple,
                      branches: tuple = (), q_normed: bool = True) -> torch.Tensor:
        """Attend straight into the cache: its rows flattened into one sequence, each query a "token" of one
        batch whose slot indices are offset to its row (row * N). Same op, same result as gathering
        kv_cache[rows] first, without copying every row's whole cache each step. This step's kv and (HCA,
        CSA) compressed entry are in the cache; `branches` that issued them (or the slots) are joined first.
        q [B, 1, H, hd], slots [1, B, K]; rope: this step's (cos, sin) [B, 1, rd/2], whose inverse the output
        gets (in the attention op) -> [B, 1, H, hd]. q_normed False (FP8 cache): q is wq_b's output per head, normed
        and rotated by the attention op as it loads it (`q_norm_sparse_attn_fp8`)."""
        B, _, H, D = q.shape
        for br in branches:
            slots = br.join(slots)
        out_rope = tuple(t.view(1, B, -1) for t in rope)  # one "token" of the flattened batch per row
        kv = self.kv_cache.view(1, -1, self.kv_cache.size(-1))
        if not q_normed:
            o = ops.q_norm_sparse_attn_fp8(q.view(1, B, H, D), kv, self.sink, slots, self.scale, self.rd, self.eps,
                                           self.q_norm_form, out_rope)
        else:
            o = self._attend(q.view(1, B, H, D), kv, slots, out_rope, decode=True)
        return o.view(B, 1, H, D)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, S, H, hd] -> wo_b(wo_a(o)) [B, S, D]."""
        return self.wo_b(self._wo_a(o))

    def _wo_a(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection, o [B, S, H, hd] -> [B, S, groups * o_lora] in o's dtype.

        Group j reads o's columns j*d .. (j+1)*d of every row in place (a strided [tokens, groups, d] view):
        the einsum form ("bsgd,grd->bsgr") let bmm copy o to [groups, tokens, d] first -- a 268 MB copy per
        layer at 4096 prompt tokens on flash shapes -- and flatten copy the output back."""
        B, S = o.shape[:2]
        g = self.groups
        og = o.reshape(B * S, g, -1)
        if self.wo_a.fmt == "fp8":
            y = ops.fp8_grouped_linear(og, self.wo_a.weight, self.wo_a.scale)
        else:  # float weight (exact numerics, float checkpoints): the same bmm in o's dtype
            y = grouped_bmm(og, self.wo_a.weight.to(o.dtype).view(g, -1, og.size(-1)))
        return y.view(B, S, -1)

    def _entries(self, kv: torch.Tensor, dtype) -> torch.Tensor:
        """Cache-form rows -> [..., head_dim] values (debug taps)."""
        return ops.kv_unpack(kv, self.hd, self.rd, dtype) if self.fp8_kv else kv

    def _attend(self, q, kv, idx, out_rope: tuple, decode: bool = False) -> torch.Tensor:
        """Sparse attention over cache-form rows kv [B, N, ·], the output's RoPE dims de-rotated by out_rope
        (cos, sin) [B, S, rd/2] (the FP8 layout's decode op does it in its combine launch). FP8 layout: decode
        reads it in place (each query gathers its own ~K rows once); prefill decodes the N rows once to q's dtype
        first, since reading in place would dequantise every gathered row once per query token and head block
        (S·K·H/BH row decodes instead of N: several times slower at a flash prefill; docs/perf-log.md, "FP8 KV
        layout, TMA FP8 GEMM, FP4 -> FP8 prefill experts")."""
        if self.fp8_kv and decode:
            return ops.sparse_attn_fp8(q, kv, self.sink, idx, self.scale, self.rd, out_rope=out_rope)
        if self.fp8_kv:
            kv = ops.kv_unpack(kv, self.hd, self.rd, q.dtype)
        return rope_tail_(ops.sparse_attn(q, kv, self.sink, idx, self.scale), self.rd, *out_rope, inverse=True)

    def _select(self, x, qr, ctx: StepContext, n_entries: int) -> torch.Tensor:
        """Compressed entries each query attends: [B, S, k] entry indices (-1 = none). CSA: the indexer's
        top-k; HCA: every entry complete at the query's position (j < (t + 1) // ratio)."""
        if self.indexer is not None:
            return self.indexer(x, qr, ctx, self.name + ".indexer")
        def visible():
            j = torch.arange(n_entries, device=x.device)
            return torch.where(j < (ctx.positions.unsqueeze(-1) + 1) // self.ratio, j, -1)

        return ctx.memo(("hca", self.ratio, n_entries), visible)

    def _prefill(self, x, q, kv, qr, ctx: StepContext, rope: tuple) -> torch.Tensor:
        """The prompt from position 0: window + selected compressed entries; rope: the tokens' (cos, sin), whose
        inverse the output gets (`_attend`). The index tables that depend only on the shapes (the window's, HCA's
        with its visible entries, the ring slots) are made once a step per layer shape (`ctx.memo`) and held for
        the step: 8 * (win + S / ratio) bytes a token, against the MB a token of `memory.prefill_token_bytes`."""
        B, S, _ = x.shape
        dev, win = x.device, self.win
        window = ctx.memo(("window_prefill", S, win, B),
                          lambda: _window_idx_prefill(S, win, dev).unsqueeze(0).expand(B, -1, -1))
        idx, kv_all = window, kv
        if self.compressor is not None:
            entries = self.compressor.prefill(x, ctx.rows, ctx)  # [B, S//r, hd]
            if is_active():
                tap(self.name + ".compressed_kv", self._entries(entries, q.dtype))
            kv_all = torch.cat([kv, entries], 1)
            n = entries.size(1)
            if self.indexer is not None:  # CSA: the indexer's picks, after the window's S slots
                sel = self._select(x, qr, ctx, n)
                idx = torch.cat([window, torch.where(sel >= 0, sel + S, -1)], -1)
            else:  # HCA: every entry complete at the query's position, the same for each layer of the shape
                def hca():
                    sel = self._select(x, qr, ctx, n)
                    return torch.cat([window, torch.where(sel >= 0, sel + S, -1)], -1)

                idx = ctx.memo(("hca_prefill", self.ratio, n, S, win, B), hca)
        o = self._attend(q, kv_all, idx, rope)
        # ring buffer: the last min(S, win) positions at slot p % win
        keep = min(S, win)

        def ring():
            p = torch.arange(S - keep, S, device=dev)
            return ctx.rows.repeat_interleave(keep), (p % win).repeat(B)

        rows, slots = ctx.memo(("ring_prefill", S, win, B), ring)
        ops.kv_store(self.kv_cache, rows, slots, kv[:, S - keep:].flatten(0, 1))
        return o

    def _extend(self, x, q, kv, qr, ctx: StepContext, rope: tuple) -> torch.Tensor:
        """A later prompt chunk of one row (B == 1) at positions p0 .. p0+S-1: the window reads earlier
        positions from the ring and the chunk's own keys; entries come from the cache after the
        compressor has pooled the windows this chunk completes. rope: as `_prefill`; the shape-only tables
        once a step per layer shape, as there."""
        B, S, _ = x.shape
        assert B == 1, "chunked prefill runs one row at a time"
        p0, win, dev = ctx.start, self.win, x.device
        row = ctx.rows[:1]

        def window():
            t = torch.arange(p0, p0 + S, device=dev).unsqueeze(1)  # query positions
            u = t - win + 1 + torch.arange(win, device=dev)  # its window positions, ascending
            idx = torch.where(u < p0, u % win, win + u - p0)  # ring slot (earlier chunks) | this chunk
            return torch.where(u >= 0, idx, -1).unsqueeze(0)  # [1, S, win]

        idx = ctx.memo(("window_extend", p0, S, win), window)
        parts = [self.kv_cache[row, :win], kv]
        if self.compressor is not None:
            n = self.compressor.extend(x, p0, row, ctx)  # entries complete after this chunk
            entries = self.kv_cache[row, win:win + n]
            parts.append(entries)
            sel = self._select(x, qr, ctx, n)
            idx = torch.cat([idx, torch.where(sel >= 0, sel + win + S, -1)], -1)
        o = self._attend(q, torch.cat(parts, 1), idx, rope)
        keep = min(S, win)  # ring: the chunk's last positions (earlier ones stay where they are)

        def ring():
            p = torch.arange(p0 + S - keep, p0 + S, device=dev)
            return row.repeat(keep), p % win

        rows, slots = ctx.memo(("ring_extend", p0, S, win), ring)
        ops.kv_store(self.kv_cache, rows, slots, kv[0, S - keep:])
        return o

    def _cache_form(self, kv: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """kv after its norm and RoPE -> the form the cache holds. Packing is the QAT of the no-RoPE dims (values
        as fp8_fake_quant): decode packs in the cache write (`kv_store` with rope_dim: one launch), prefill here."""
        rd = self.rd
        if self.fp8_kv and ctx.prefill:
            return ops.kv_pack(kv, rd)
        if self.kv_qat and not self.fp8_kv:  # float layout: the same QAT values (`set_kv_layout`)
            return torch.cat([ops.fp8_fake_quant(kv[..., :-rd], 64), kv[..., -rd:]], -1)
        return kv
