"""The lightning indexer's scores in TileLang (`indexer_scores`), rounded where DeepSeek's model.py rounds them
(`rounding="bf16"`, what official numerics use), on sm_90.

scores[b, s, t] = sum_h w'[b, s, h] relu(q[b, s, h] . k[t]), with model.py's roundings: the q . k einsum of bf16
operands accumulates in fp32 and returns bf16; w' = weights_proj(x) * scale is bf16; relu(logits) * w' is a bf16
product; the sum over the heads accumulates in fp32 and rounds once to bf16. One program per (64 keys, query
token, batch row): the query's heads (padded to a multiple of 16 with zero rows) times the key tile on the tensor
cores, fp32 accumulation, then the roundings elementwise and the head sum as one reduction. Decode reads the
key cache in place through `rows`. `rounding="fp32"` runs the reference: its fp32 dot would be TF32 on the
tensor cores, and exact needs fp32 products.

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

import tilelang
import tilelang.language as T
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, implement

from ._common import build

BT = 64


def indexer_scores_kernel(H: int, D: int):
    """Q [B, S, H, D] bf16, K [R, T, D] bf16, W [B, S, H] bf16 (w'), ROWS [B] int64 -> O [B, S, T] f32."""
    B = T.symbolic("B")
    S = T.symbolic("S")
    R = T.symbolic("R")
    TK = T.symbolic("T")
    HP = max(16, (H + 15) // 16 * 16)

    @T.prim_func
    def indexer_scores_k(Q: T.Tensor((B, S, H, D), "bfloat16"), K: T.Tensor((R, TK, D), "bfloat16"),
                         W: T.Tensor((B, S, H), "bfloat16"), ROWS: T.Tensor((B,), "int64"),
                         O: T.Tensor((B, S, TK), "float32")):
        with T.Kernel(T.ceildiv(TK, BT), S, B, threads=128) as (bt, s, b):
            q_t = T.alloc_shared((HP, D), "bfloat16")
            k_t = T.alloc_shared((BT, D), "bfloat16")
            w_t = T.alloc_shared((HP,), "float32")
            acc = T.alloc_fragment((HP, BT), "float32")
            tot = T.alloc_fragment((BT,), "float32")
            r = T.alloc_local((1,), "int64")
            r[0] = ROWS[b]
            for h, d in T.Parallel(HP, D):
                q_t[h, d] = T.if_then_else(h < H, Q[b, s, T.min(h, H - 1), d], T.Cast("bfloat16", 0))
            for i, d in T.Parallel(BT, D):
                k_t[i, d] = T.if_then_else(bt * BT + i < TK, K[r[0], T.min(bt * BT + i, TK - 1), d],
                                           T.Cast("bfloat16", 0))
            for h in T.Parallel(HP):
                w_t[h] = T.if_then_else(h < H, T.Cast("float32", W[b, s, T.min(h, H - 1)]), T.float32(0))
            T.clear(acc)
            T.gemm(q_t, k_t, acc, transpose_B=True)
            for h, i in T.Parallel(HP, BT):
                logit = T.Cast("float32", T.Cast("bfloat16", acc[h, i]))
                acc[h, i] = T.Cast("float32", T.Cast("bfloat16", T.max(logit, T.float32(0)) * w_t[h]))
            T.reduce_sum(acc, tot, dim=0)
            for i in T.Parallel(BT):
                if bt * BT + i < TK:
                    O[b, s, bt * BT + i] = T.Cast("float32", T.Cast("bfloat16", tot[i]))

    return indexer_scores_k


@implement("indexer_scores", "tilelang")
def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, rows: torch.Tensor | None = None,
                   w_scale: float = 1.0, rounding: str = "fp32") -> torch.Tensor:
    ref = REGISTRY["indexer_scores"].ref
    B, S, H, D = q.shape
    if rounding != "bf16":
        ops.runtime_fallback("indexer_scores", "the TileLang indexer computes model.py's bf16 scores (official "
                                               "numerics); fp32 scores would run as TF32 on the tensor cores")
        return ref(q, k, w, rows, w_scale, rounding)
    if D % 16 or B * S == 0 or k.size(1) == 0:
        if B * S and k.size(1):
            ops.runtime_fallback("indexer_scores", f"the TileLang indexer takes a head dim % 16 == 0, not {D}")
        return ref(q, k, w, rows, w_scale, rounding)
    kern = build("indexer_scores", (H, D), lambda: tilelang.compile(indexer_scores_kernel(H, D), out_idx=[4]))
    if kern is None:
        return ref(q, k, w, rows, w_scale, rounding)
    bf = torch.bfloat16
    if rows is None:
        rows = torch.arange(B, device=q.device)
    wq = (w.to(bf) * w_scale).contiguous()  # model.py: weights_proj(x) * scale, a bf16 product
    return kern(q.to(bf).contiguous(), k.to(bf).contiguous(), wq, rows.long().contiguous())
