"""How a step issues the model's sub-steps: which run beside each other on side streams (decode, CUDA) and
which are fused across a sub-step boundary. The maths is the model's (`deepinfer/model/`: `Block.__call__`,
`Attention.__call__`, `MoE.__call__` run the same sub-steps in order on one stream); this plan gives the
same values, and the loader sets it on every model it builds (`Transformer.schedule`).

Per block, for attention then the MoE:
  * mHC pre-mix: the collapse and the norm on the main stream; at decode the Sinkhorn rounds of post and
    comb on the "hc" stream (`Block.mix_in(side=...)`), joined at the post-mix.
  * attention, decode (`attention`): beside the q path (project -> q_lora -> q_heads) on the side stream:
    HCA's entry compressor; CSA's indexer keys and head weights, then the indexer's top-k; SWA / HCA's kv
    norm, cache write and window slots. CSA's kv write and entry compressor stay on the main stream: with
    the entry compressor on the branch too, the branch was the step's critical path, about twice the main
    chain at flash shapes (docs/perf-log.md, "Decode on two streams"). Everything is joined before the sparse
    attention.
  * MoE (`moe`): the shared expert on the side stream (decode) beside the routing and the routed experts;
    the float32 sum of routed and shared rows fused with the post-mix (`ops.moe_combine_post`, the bits of
    `moe_combine` then `hc_post`), prefill and decode.
Under a debug capture everything runs as the model writes it (the taps see each sub-step's output).
"""

from __future__ import annotations

import torch

from deepinfer.capture import is_active
from deepinfer.model.attention import Attention, StepContext
from deepinfer.model.branch import fork
from deepinfer.model.moe import MoE
from deepinfer.ops import ops


class Schedule:
    """The plan `Transformer._body` runs each block through (module docstring)."""

    def block(self, blk, h: torch.Tensor, ctx: StepContext, input_ids: torch.Tensor) -> torch.Tensor:
        """`Block.__call__`, issued: h [B, S, hc, D] -> [B, S, hc, D]."""
        if is_active() or ctx.pending is not None:  # taps, or a speculative verify step: in order
            return blk(h, ctx, input_ids)
        decode = not ctx.prefill
        for sub in ("attn", "ffn"):
            br = fork(h, on=decode, lane="hc")
            x, xq, post, comb = blk.mix_in(sub, h, ctx, side=br if br.active else None)
            if sub == "attn":
                x = self.attention(blk.attn, x, ctx, xq)
            elif x.dtype == h.dtype:  # the MoE's sum and the post-mix in one launch
                def combine_post(routed, shared, h=h, br=br, post=post, comb=comb):
                    return ops.moe_combine_post(routed, shared, h, *br.join(post, comb))

                h = self.moe(blk.ffn, x, input_ids, xq, decode, combine_post)
                continue
            else:
                x = self.moe(blk.ffn, x, input_ids, xq, decode)
            h = ops.hc_post(x, h, *br.join(post, comb))
        return h

    def moe(self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, xq: tuple | None, decode: bool,
            then=None) -> torch.Tensor:
        """`MoE.__call__` with the shared expert on a side stream (decode); then(routed [T, k, D], shared
        [T, D]), when given, takes the place of the float32 sum and its result is returned."""
        xt = x.reshape(-1, x.size(-1))
        br = fork(xt, on=decode, lane="shared_expert")
        with br:
            shared = moe.shared_expert(xt, xq)
        routed = moe.routed(xt, input_ids, xq)
        if then is not None:
            return then(routed, br.join(shared))
        return ops.moe_combine(routed, br.join(shared), x.dtype).view(x.shape)

    def attention(self, a: Attention, x: torch.Tensor, ctx: StepContext, xq: tuple | None) -> torch.Tensor:
        """`Attention.__call__`; at decode its sub-steps on the streams of the module docstring."""
        if ctx.prefill:
            return a(x, ctx, xq)
        cos, sin = ctx.rope_at_positions(a.rope_kind)
        entry_on_branch = a.compressor is not None and a.indexer is None  # HCA
        br = fork(x, on=entry_on_branch, lane="compressor")
        if entry_on_branch:
            with br:
                a.compressor.decode(x, ctx)
        csa = a.indexer is not None
        bk = fork(x, on=csa, lane="indexer_keys")
        w_ix = None
        if csa:
            with bk:
                w_ix = a.indexer.start_decode(x, ctx)
        qa, kva = a.project(x, xq)
        qr = a.q_lora(qa)
        slots = None
        bkv = fork(x, on=not csa, lane="kv")
        if not csa:  # SWA / HCA: kv norm, cache write and window slots need kva and the positions only
            with bkv:
                a.kv_decode(kva, ctx, cos, sin)  # into the cache, where the attention reads it
                slots = a.window_slots(ctx)
        bi = fork(x, on=csa, lane="indexer")
        if csa:
            with bi:
                slots = a.select_decode(x, qr, ctx, w=w_ix, early=bk)
        q = a.q_heads(qr, cos, sin)
        if csa:
            a.kv_decode(kva, ctx, cos, sin)
            a.compressor.decode(x, ctx)
        o = a.attend_decode(q, ctx, slots, (cos, sin), branches=(br, bk, bi, bkv))
        return a.out(o)
