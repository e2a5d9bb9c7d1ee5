"""DeepSeek-V4 in plain PyTorch: embed -> hc_mult streams -> blocks (mHC around attention and MoE)
-> hc head -> RMSNorm -> float32 LM head; plus the MTP block, and the verify / commit steps of speculative
decoding (`deepinfer.model.spec_verify`; the engine side is `deepinfer.engine.speculative`).

Every numerically significant op goes through `deepinfer.ops.ops`, so a backend can replace it.
Tap names (see `dumps/README.md`) are stable across backends.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from deepinfer.capture import is_active, tap
from deepinfer.config import ModelConfig
from deepinfer.model.attention import Attention, StepContext
from deepinfer.model.branch import fork
from deepinfer.model.moe import MoE
from deepinfer.model.numerics import Numerics
from deepinfer.model.rope import RopeTables
from deepinfer.model.weights import WeightSource
from deepinfer.ops import ops
from deepinfer.settings import fusion


class HCParams:
    """mHC mixing parameters (fn, base, scale) of one sub-layer or head, float32."""

    def __init__(self, W: WeightSource, prefix: str):
        self.fn, self.base, self.scale = (W.f32(prefix + s) for s in ("_fn", "_base", "_scale"))


class Block:
    """One transformer block with hyper-connection streams around attention and MoE."""

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, layer_id: int, numerics: Numerics,
                 hash_routed: bool, expert_range: tuple[int, int] | None = None):
        self.cfg, self.name = cfg, prefix.rstrip(".")
        self.attn = Attention(cfg, W, prefix + "attn.", layer_id, numerics)
        self.ffn = MoE(cfg, W, prefix + "ffn.", hash_routed, expert_range)
        self.attn_norm = W.f32(prefix + "attn_norm.weight")
        self.ffn_norm = W.f32(prefix + "ffn_norm.weight")
        self.hc_attn = HCParams(W, prefix + "hc_attn")
        self.hc_ffn = HCParams(W, prefix + "hc_ffn")
        # FP8 projections read the normed input (official numerics): norm + act_quant fused, the
        # quantised input shared by wq_a / wkv and by the shared expert's w1 / w3
        self.quant_in = self.attn.wq_a.fmt != "float"

    def __call__(self, h: torch.Tensor, ctx: StepContext, input_ids: torch.Tensor) -> torch.Tensor:
        """h [B, S, hc, D] streams -> [B, S, hc, D] (`run`, every post-mix done here)."""
        return self.run(h, ctx, input_ids)[0]

    def run(self, h: torch.Tensor, ctx: StepContext, input_ids: torch.Tensor, after: tuple | None = None,
            defer: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """h [B, S, hc, D] streams -> (h, None) or, defer, (h, after): for attention then the MoE, the mHC
        pre-mix (collapse to one stream, RMSNorm), the sub-layer, the mHC post-mix back into the streams.

        The one order of a block. At decode (not a speculative verify), the Sinkhorn rounds of post and comb
        are forked onto the "hc" lane, joined at the post-mix, and the MoE forks its shared expert
        (`MoE.parts`); a lane runs on a side stream only when the runner issuing the step supplies streams
        (`deepinfer.model.branch.Lanes`). The MoE's float32 sum of routed and shared rows is fused with the
        post-mix (`ops.moe_combine_post`, the bits of `moe_combine` then `hc_post`), except under a debug
        capture, whose taps read the MoE's output, and in a speculative verify (which runs in order). With FP8
        projections the attention's post-mix is done by the MoE's pre-mix op (`ops.hc_post_pre_quant`, the
        bits of `hc_post` then `hc_pre_quant`), which returns the new streams for the taps and the MoE's
        post-mix.

        after (tap name, a sub-layer's output, post, comb): the previous block's MoE output, its post-mix into h
        still to do -- done by this block's attention pre-mix op (`ops.moe_combine_post_pre_quant`). defer (FP8
        projections, the fused MoE post-mix): this block's MoE output is returned that way instead of mixed
        into h, for the next block (or the head: `ops.moe_combine_post_head`) to do in its first launch."""
        decode = not ctx.prefill and ctx.pending is None
        for sub in ("attn", "ffn"):
            if after is None:
                tap(f"{self.name}.hc_{sub}.in", h)
            br = fork(h, on=decode, lane="hc")
            h, x, xq, post, comb = self.mix_in(sub, h, ctx, side=br if br.active else None, after=after)
            after = None
            if sub == "attn":
                x = self.attn(x, ctx, xq)
                if self.quant_in:  # hc_post goes into the MoE's pre-mix (`ops.hc_post_pre_quant`)
                    tap(f"{self.name}.attn.out", x)
                    after = (f"{self.name}.hc_attn.out", x, *br.join(post, comb))
                    continue
            else:
                routed, shared = self.ffn.parts(x, input_ids, xq, decode=decode)
                if x.dtype == h.dtype and ctx.pending is None and not is_active():  # sum + post-mix, one launch
                    if defer and self.quant_in:  # into the next pre-mix's (or the head's) first launch
                        return h, (f"{self.name}.hc_ffn.out", (routed, shared), *br.join(post, comb))
                    h = ops.moe_combine_post(routed, shared, h, *br.join(post, comb))
                    continue
                x = ops.moe_combine(routed, shared, x.dtype).view(x.shape)
            tap(f"{self.name}.{sub}.out", x)
            h = ops.hc_post(x, h, *br.join(post, comb))
            tap(f"{self.name}.hc_{sub}.out", h)
        return h, None

    def mix_in(self, sub: str, h: torch.Tensor, ctx: StepContext, side=None, after: tuple | None = None) -> tuple:
        """The mHC pre-mix of sub-layer `sub` ("attn" | "ffn") and its RMSNorm: h [B, S, hc, D] -> (h, x [B, S, D],
        xq: x's act_quant (FP8 projections; None otherwise), post [B, S, hc], comb [B, S, hc, hc]).
        side: a `Branch` the op may compute post and comb on (read them after joining it). after (tap name, the
        previous sub-layer's output -- the attention's x, or the MoE's (routed, shared) rows --, post, comb; FP8
        projections): h is first post-mixed with it, in the same op (`hc_post_pre_quant`,
        `moe_combine_post_pre_quant`: one launch fewer at decode), and the new streams are returned as h."""
        c = self.cfg
        hcp, norm = (self.hc_attn, self.attn_norm) if sub == "attn" else (self.hc_ffn, self.ffn_norm)
        mhc = (hcp.fn, hcp.scale, hcp.base, c.norm_eps, c.hc_eps, c.hc_sinkhorn_iters)
        xq = None
        if self.quant_in:  # the collapse, the norm and its FP8 form in one op; for the FP4 experts of a
            # one-token step also the bf16 form their GEMM reads (`MoE.wants_split`)
            split = sub == "ffn" and self.ffn.wants_split(h.size(0) * h.size(1))
            if after is not None:
                name, out, *pc = after
                if isinstance(out, tuple):  # a MoE's rows: summed in the op too
                    h, x, *xq, post, comb = ops.moe_combine_post_pre_quant(*out, h, *pc, *mhc, norm, c.norm_eps,
                                                                           side=side, split=split)
                else:
                    h, x, *xq, post, comb = ops.hc_post_pre_quant(out, h, *pc, *mhc, norm, c.norm_eps, side=side,
                                                                  split=split)
                tap(name, h)
                tap(f"{self.name}.hc_{sub}.in", h)
            else:
                x, *xq, post, comb = ops.hc_pre_quant(h, *mhc, norm, c.norm_eps, side=side, split=split)
        else:
            if after is not None:  # float projections: the post-mix as its own op first
                h = resolve_after(h, after)
                tap(f"{self.name}.hc_{sub}.in", h)
            x, post, comb = ops.hc_pre(h, *mhc, side=side)
            x = ops.rms_norm(x, norm, c.norm_eps)
        tap(f"{self.name}.hc_{sub}.post", post)
        tap(f"{self.name}.hc_{sub}.comb", comb)
        tap(f"{self.name}.{sub}.in", x)
        return h, x, xq, post, comb


def resolve_after(h: torch.Tensor, after: tuple) -> torch.Tensor:
    """A deferred post-mix (`Block.run`'s after) done as its own op: -> the new streams (tapped)."""
    name, out, post, comb = after
    h = ops.moe_combine_post(*out, h, post, comb) if isinstance(out, tuple) else ops.hc_post(out, h, post, comb)
    tap(name, h)
    return h


class Head:
    """hc head (stream collapse) -> RMSNorm -> float32 LM head."""

    def __init__(self, cfg: ModelConfig, hc: HCParams, norm: torch.Tensor, weight: torch.Tensor):
        self.cfg, self.hc, self.norm, self.weight = cfg, hc, norm, weight

    def __call__(self, h: torch.Tensor, after: tuple | None = None) -> torch.Tensor:
        """h [B, S, hc, D] -> logits [B, S, V] float32. after: the last block's MoE output still to post-mix into h
        (`Block.run`), done inside the head's collapse (`ops.moe_combine_post_head`)."""
        c = self.cfg
        mix = (self.hc.fn, self.hc.scale, self.hc.base, c.norm_eps, c.hc_eps)
        if after is not None and isinstance(after[1], tuple):
            h, x = ops.moe_combine_post_head(*after[1], h, *after[2:], *mix)
            tap(after[0], h)
        else:
            if after is not None:
                h = resolve_after(h, after)
            x = ops.hc_head(h, *mix)
        x = ops.rms_norm(x, self.norm, c.norm_eps)
        return ops.linear(x, self.weight, out_dtype=torch.float32)  # = F.linear(x.float(), W.float())


class MTPBlock:
    """Multi-token prediction: embed(next token) and the streams, normalised, projected and summed,
    then one full block, its own hc head and norm, and the shared LM head."""

    def __init__(self, cfg: ModelConfig, W: WeightSource, prefix: str, layer_id: int, numerics: Numerics,
                 embed: torch.Tensor, head_weight: torch.Tensor, expert_range: tuple[int, int] | None = None):
        self.cfg, self.embed = cfg, embed
        self.block = Block(cfg, W, prefix, layer_id, numerics, hash_routed=False, expert_range=expert_range)
        self.e_proj, self.h_proj = W.linear(prefix + "e_proj"), W.linear(prefix + "h_proj")
        self.enorm, self.hnorm = W.f32(prefix + "enorm.weight"), W.f32(prefix + "hnorm.weight")
        self.head = Head(cfg, HCParams(W, prefix + "hc_head"), W.f32(prefix + "norm.weight"), head_weight)

    def __call__(self, h: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """h [B, S, hc, D] main-model streams, next_ids [B, S] (token t+1 at t) -> logits [B, S, V]."""
        return self.forward(h, next_ids, ctx)[0]

    def forward(self, h: torch.Tensor, next_ids: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As `__call__`, also returning the block's output streams [B, S, hc, D]: the `h` of the next draft
        when the block is reused for further draft tokens (as vLLM and SGLang do)."""
        eps = self.cfg.norm_eps
        e = ops.rms_norm(F.embedding(next_ids, self.embed), self.enorm, eps)
        x = self.e_proj(e).unsqueeze(2) + self.h_proj(ops.rms_norm(h, self.hnorm, eps))
        out = self.block(x, ctx, next_ids)
        return self.head(out), out


class Transformer:
    """The whole model. Build with `Transformer(cfg, state, numerics, device)`; `allocate` the caches
    (rows = concurrent sequences, max_seq_len = longest prompt + generation) before running.
    `expert_range` (lo, hi): this process holds routed experts lo..hi-1 only (expert parallelism)."""

    def __init__(self, cfg: ModelConfig, state: dict, numerics: Numerics, device="cpu",
                 expert_range: tuple[int, int] | None = None):
        self.cfg, self.numerics, self.device = cfg, numerics, torch.device(device)
        W = WeightSource(state, numerics, device)
        self.embed = W.compute("embed.weight")
        self.layers = [Block(cfg, W, f"layers.{i}.", i, numerics, cfg.hash_layers[i], expert_range)
                       for i in range(cfg.n_layers)]
        head_w = W.raw("head.weight")  # checkpoint dtype (bf16): `linear` computes in fp32 without a copy
        self.head = Head(cfg, HCParams(W, "hc_head"), W.f32("norm.weight"), head_w)
        self.mtp = [MTPBlock(cfg, W, f"mtp.{m}.", cfg.n_layers + m, numerics, self.embed, head_w, expert_range)
                    for m in range(cfg.n_mtp_layers)]
        unused = set(state) - W.taken
        if unused:  # the validator should have caught these; never ignore weights silently
            raise ValueError(f"{len(unused)} checkpoint tensors were not used by the model: {sorted(unused)[:5]}")
        self.rope = None
        # the compression ratios a decode step's tables serve (`StepContext.seed_decode_tables`), MTP's included
        self.decode_ratios = tuple(sorted({r for r in cfg.compress_ratios if r}))
        self.rows = self.max_seq_len = 0
        self.allocation_check = None  # (model, rows, max_seq_len) -> None or raises: the engine's refusal

    def attentions(self):
        return [b.attn for b in self.layers] + [m.block.attn for m in self.mtp]

    def set_kv_qat(self, on: bool) -> None:
        """Official numerics: the KV QAT on (the no-RoPE dims and compressed entries FP8-rounded per 64, the cache
        in its FP8 layout) or off (kept as computed, a float cache), whatever the numerics chose at build;
        allocate after it. Exact numerics have no KV QAT (ValueError)."""
        for a in self.attentions():
            a.set_kv_qat(on)
        self.numerics = dataclasses.replace(self.numerics, kv_qat=on)  # its name tells dumps the cache's form

    def set_kv_layout(self, layout: str) -> None:
        """Every attention cache's form, "fp8" | "float" (`Attention.set_kv_layout`); allocate after it."""
        for a in self.attentions():
            a.set_kv_layout(layout)

    def named_cache_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every per-row cache tensor with a name (`attn{i}.kv_cache`, `attn{i}.compressor.kv_state`, ...): KV
        (window + compressed entries), compressor carry-over, indexer keys; i counts `attentions()`."""
        out = []
        for i, a in enumerate(self.attentions()):
            out.append((f"attn{i}.kv_cache", a.kv_cache))
            if a.compressor is not None:
                out += [(f"attn{i}.compressor.kv_state", a.compressor.kv_state),
                        (f"attn{i}.compressor.score_state", a.compressor.score_state)]
            if a.indexer is not None:
                c = a.indexer.compressor
                out += [(f"attn{i}.indexer.cache", c.cache), (f"attn{i}.indexer.kv_state", c.kv_state),
                        (f"attn{i}.indexer.score_state", c.score_state)]
        return out

    def cache_tensors(self) -> list[torch.Tensor]:
        """`named_cache_tensors` without the names."""
        return [t for _, t in self.named_cache_tensors()]

    def allocate(self, rows: int, max_seq_len: int) -> None:
        """(Re)allocate every layer's cache for `rows` sequences of up to `max_seq_len` tokens. The engine's
        `allocation_check` (set by `engine.loader.build_model`: past the model's context, or beyond the device's
        free memory, refused with the numbers) runs first, so nothing is allocated for what cannot fit."""
        if self.allocation_check is not None:
            self.allocation_check(self, rows, max_seq_len)
        self.rope = RopeTables(self.cfg, max_seq_len, self.device)
        for a in self.attentions():
            a.allocate(rows, max_seq_len, self.device, self.numerics.dtype)
        self.rows, self.max_seq_len = rows, max_seq_len

    def _ctx(self, input_ids, rows, positions, prefill, start: int = 0):
        if self.rope is None:
            raise RuntimeError("call allocate(rows, max_seq_len) before running the model")
        if prefill and start + positions.size(1) > self.max_seq_len:  # decode: the caller keeps it in range
            raise ValueError(f"{start + positions.size(1)} tokens exceed max_seq_len {self.max_seq_len}")
        ops.phase = "prefill" if prefill else "decode"  # which entry of a phase-split op map the step's ops take
        ctx = StepContext(positions, rows, self.rope, prefill, start)
        if not prefill and positions.size(1) == 1 and fusion("decode_tables"):
            ctx.seed_decode_tables(self.decode_ratios, self.cfg.window_size)
        return ctx

    def _body(self, input_ids, ctx, defer_head: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """The embedding and the blocks -> (streams, None), or defer_head: (streams before the last block's MoE
        post-mix, that post-mix for the head to do: `Head.__call__`'s after). Each block's MoE post-mix goes into
        the next block's first launch (`Block.run`)."""
        tap("input_ids", input_ids)
        # the hc_mult residual streams start as copies of the embedding: one gather from the table viewed as
        # [V, hc, D] (stride 0 over hc) writes all of them, instead of an embedding then a repeat (two launches)
        B, S = input_ids.shape
        V, D = self.embed.shape
        table = self.embed.unsqueeze(1).expand(V, self.cfg.hc_mult, D)
        h = torch.index_select(table, 0, input_ids.reshape(-1)).view(B, S, self.cfg.hc_mult, D)
        after = None
        defer = not ops.sited  # bisect / graft address each block's ops at its own layer: no deferral then
        for i, layer in enumerate(self.layers):
            ops.layer = i  # the op sites of this block (`Dispatcher.override_sites`, `deepinfer bisect`)
            h, after = layer.run(h, ctx, input_ids, after, defer=defer)
        ops.layer = None
        if after is not None and not defer_head:
            h, after = resolve_after(h, after), None
        return h, after

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, rows: torch.Tensor | None = None, all_logits: bool = False,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, S] at positions start .. start+S-1 into cache `rows` [B] -> (logits [B, S or 1, V]
        f32, streams). start > 0 continues one row's prompt (B == 1) whose first `start` tokens an
        earlier call prefilled: chunked prefill, same logits as one call over the whole prompt."""
        B, S = input_ids.shape
        if start and B != 1:
            raise ValueError(f"chunked prefill (start {start}) runs one row at a time, got {B} rows")
        rows = torch.arange(B, device=self.device) if rows is None else rows.to(self.device)
        positions = torch.arange(start, start + S, device=self.device).unsqueeze(0).expand(B, S)
        ctx = self._ctx(input_ids, rows, positions, prefill=True, start=int(start))
        h, _ = self._body(input_ids.to(self.device), ctx)
        logits = self.head(h if all_logits else h[:, -1:])
        tap("logits", logits)
        return logits, h

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
               ) -> torch.Tensor:
        """One token per row: input_ids [B, 1] at positions [B] (per row) -> logits [B, 1, V] f32."""
        B = input_ids.size(0)
        rows = torch.arange(B, device=self.device) if rows is None else rows.to(self.device)
        ctx = self._ctx(input_ids, rows, positions.to(self.device).view(B, 1), prefill=False)
        h, after = self._body(input_ids.to(self.device), ctx, defer_head=True)
        logits = self.head(h, after)
        tap("logits", logits)
        return logits

    @torch.inference_mode()
    def mtp_prefill(self, streams: torch.Tensor, next_ids: torch.Tensor, rows: torch.Tensor | None = None,
                    start: int = 0, with_streams: bool = False):
        """MTP forward over a prompt (or, start > 0, a later chunk of one row's prompt, as `prefill`):
        streams [B, S, hc, D] from `prefill`, next_ids [B, S] (token t+1 at position t) -> logits [B, S, V]
        (with_streams: and the MTP block's output streams [B, S, hc, D])."""
        if not self.mtp:
            raise ValueError("this checkpoint has no MTP block")
        B, S = next_ids.shape
        if start and B != 1:
            raise ValueError(f"chunked MTP prefill (start {start}) runs one row at a time, got {B} rows")
        rows = torch.arange(B, device=self.device) if rows is None else rows.to(self.device)
        positions = torch.arange(start, start + S, device=self.device).unsqueeze(0).expand(B, S)
        ctx = self._ctx(next_ids, rows, positions, prefill=True, start=int(start))
        logits, out = self.mtp[0].forward(streams, next_ids.to(self.device), ctx)
        return (logits, out) if with_streams else logits

    # ------------------------------------------------------------------------ speculative decoding
    def _verify_ctx(self, B: int, S: int, start: torch.Tensor, rows: torch.Tensor) -> StepContext:
        positions = start.to(self.device).view(B, 1) + torch.arange(S, device=self.device)
        ctx = self._ctx(None, rows.to(self.device), positions, prefill=False)
        ctx.pending = {}
        return ctx

    @torch.inference_mode()
    def verify(self, input_ids: torch.Tensor, start: torch.Tensor, rows: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """S tokens per row at positions start[b] .. start[b] + S - 1 (the caches hold every position
        before): input_ids [B, S], start [B], rows [B] -> (logits [B, S, V] f32, streams [B, S, hc, D],
        the step's context for `commit`). Writes no cache (`deepinfer.model.spec_verify`): the caches are as
        before until `commit` keeps a prefix of each row's tokens."""
        B, S = input_ids.shape
        ctx = self._verify_ctx(B, S, start, rows)
        h, _ = self._body(input_ids.to(self.device), ctx)
        return self.head(h), h, ctx

    @torch.inference_mode()
    def mtp_verify(self, streams: torch.Tensor, next_ids: torch.Tensor, start: torch.Tensor, rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        """The MTP block over S positions per row, as `verify` (no cache written until `commit`):
        streams [B, S, hc, D] (the main model's at those positions, or the MTP block's own for a further
        draft), next_ids [B, S] (token t+1 at position t) -> (logits [B, S, V], MTP streams, context)."""
        B, S = next_ids.shape
        ctx = self._verify_ctx(B, S, start, rows)
        logits, out = self.mtp[0].forward(streams, next_ids.to(self.device), ctx)
        return logits, out, ctx

    @torch.inference_mode()
    def commit(self, ctx: StepContext, n_keep: torch.Tensor, spare_row: int | None = None) -> None:
        """Keep the first n_keep[b] (0 .. S) tokens of row b of a `verify` / `mtp_verify` step in every cache
        that step's layers own, as decode steps over exactly those tokens would have written them; the rest
        leave no trace. spare_row (default the last row: the decode runner's padding row) takes the
        writes of the dropped tokens and must not be a live row."""
        from deepinfer.model.spec_verify import commit

        spare = self.rows - 1 if spare_row is None else spare_row
        keep = torch.arange(ctx.positions.size(1), device=self.device) < n_keep.to(self.device).view(-1, 1)
        rows = torch.where(keep, ctx.rows.unsqueeze(1), spare)  # [B, S]: the dropped tokens to the spare row
        for a, pend in ctx.pending.items():
            commit(a, pend, ctx, rows)
