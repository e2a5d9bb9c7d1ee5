"""Sparse attention with an attention sink in TileLang (`sparse_attn`), prefill and decode alike, on sm_90.

One program per query token holds every head (padded to 16: the MMA's smallest M) and walks its slots in idx
order, 64 at a time, rounding where the reference (and DeepSeek's kernel.py `sparse_attn_kernel`) rounds:
the block's kv rows gathered into shared memory (empty slots as zero rows, their logits -inf), logits
(q . kv) * scale in fp32, a running max over the logits only, p = exp(logit - max) summed in fp32 and cast to
the operands' dtype for the P V product, whose fp32 accumulator is rescaled as the max grows; the sink joins
the denominator at the end. A token with no valid slot gets 0 (its max stays -inf: the exponentials use 0).
bf16 / fp16 operands only (a float32 run takes the reference: tensor cores would round it to tf32).

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

import tilelang
import tilelang.language as T
import torch

from deepinfer.ops import ops
from deepinfer.ops.reference import SPARSE_ATTN_BLOCK
from deepinfer.ops.registry import REGISTRY, implement

from ._common import build, tl_dtype

BLK = SPARSE_ATTN_BLOCK  # 64: the official kernel's block of slots


def sparse_attn_kernel(H: int, D: int, K: int, dt: str, scale: float):
    """Q [T, H, D], KV [B, N, D], SINK [H] f32, IDX [T, K] int32, BT [T] int32 (each token's batch) ->
    O [T, H, D] (T, B, N symbolic; H a multiple of 16)."""
    Tn, Bn, N = T.symbolic("T"), T.symbolic("B"), T.symbolic("N")
    NBLK = (K + BLK - 1) // BLK

    @T.prim_func
    def sparse_attn_k(Q: T.Tensor((Tn, H, D), dt), KV: T.Tensor((Bn, N, D), dt), SINK: T.Tensor((H,), "float32"),
                      IDX: T.Tensor((Tn, K), "int32"), BT: T.Tensor((Tn,), "int32"), O: T.Tensor((Tn, H, D), dt)):
        with T.Kernel(Tn, threads=256) as t:
            q_s = T.alloc_shared((H, D), dt)
            kv_s = T.alloc_shared((BLK, D), dt)
            p_s = T.alloc_shared((H, BLK), dt)
            ids = T.alloc_shared((BLK,), "int32")
            lg = T.alloc_fragment((H, BLK), "float32")
            acc = T.alloc_fragment((H, D), "float32")
            m = T.alloc_fragment((H,), "float32")
            m_prev = T.alloc_fragment((H,), "float32")
            bm = T.alloc_fragment((H,), "float32")
            rs = T.alloc_fragment((H,), "float32")
            l = T.alloc_fragment((H,), "float32")
            o_s = T.alloc_shared((H, D), dt)
            b = BT[t]
            T.copy(Q[t, 0, 0], q_s)
            T.clear(acc)
            T.clear(l)
            T.fill(m, -T.infinity("float32"))
            for kb in T.serial(NBLK):
                for j in T.Parallel(BLK):
                    ids[j] = T.if_then_else(kb * BLK + j < K, IDX[t, T.min(kb * BLK + j, K - 1)], -1)
                for j, d in T.Parallel(BLK, D):
                    kv_s[j, d] = T.if_then_else(ids[j] >= 0, KV[b, T.max(ids[j], 0), d], T.Cast(dt, 0))
                T.clear(lg)
                T.gemm(q_s, kv_s, lg, transpose_B=True)
                for h, j in T.Parallel(H, BLK):
                    lg[h, j] = T.if_then_else(ids[j] >= 0, lg[h, j] * T.float32(scale), -T.infinity("float32"))
                T.copy(m, m_prev)
                T.reduce_max(lg, bm, dim=1, clear=True)
                for h in T.Parallel(H):
                    m[h] = T.max(m_prev[h], bm[h])
                    # no valid slot yet: exponentials against 0 (exp(-inf) = 0, nothing to rescale)
                    bm[h] = T.if_then_else(m[h] == -T.infinity("float32"), T.float32(0), m[h])
                    rs[h] = T.exp(m_prev[h] - bm[h])
                for h, j in T.Parallel(H, BLK):
                    lg[h, j] = T.exp(lg[h, j] - bm[h])
                T.reduce_sum(lg, m_prev, dim=1, clear=True)  # the block's sum of p (m_prev is free here)
                for h in T.Parallel(H):
                    l[h] = l[h] * rs[h] + m_prev[h]
                for h, d in T.Parallel(H, D):
                    acc[h, d] *= rs[h]
                T.copy(lg, p_s)  # p in the operands' dtype for the P V product
                T.gemm(p_s, kv_s, acc)
            for h in T.Parallel(H):
                bm[h] = T.if_then_else(m[h] == -T.infinity("float32"), T.float32(0), m[h])
                l[h] = l[h] + T.exp(SINK[h] - bm[h])
            for h, d in T.Parallel(H, D):
                acc[h, d] = acc[h, d] / l[h]
            T.copy(acc, o_s)
            T.copy(o_s, O[t, 0, 0])

    return sparse_attn_k


@implement("sparse_attn", "tilelang")
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
    B, S, H, D = q.shape
    ref = REGISTRY["sparse_attn"].ref
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype or D % 16 or B * S == 0:
        if B * S:
            ops.runtime_fallback("sparse_attn", f"the TileLang kernel takes bf16 / fp16 q and kv with D % 16 == 0, "
                                                f"not {q.dtype} / {kv.dtype}, D {D}")
        return ref(q, kv, sink, idx, scale)
    K = idx.size(-1)
    Hp = max(16, -(-H // 16) * 16)
    qf = q.reshape(B * S, H, D)
    sk = sink.float()
    if Hp != H:  # zero heads to the MMA's 16 rows (sliced off below)
        qf = torch.cat([qf, qf.new_zeros(B * S, Hp - H, D)], 1)
        sk = torch.cat([sk, sk.new_zeros(Hp - H)])
    kern = build("sparse_attn", (Hp, D, K, str(q.dtype), float(scale)),
                 lambda: tilelang.compile(sparse_attn_kernel(Hp, D, K, tl_dtype(q.dtype), float(scale)), out_idx=[5]))
    if kern is None:
        return ref(q, kv, sink, idx, scale)
    bt = torch.arange(B, device=q.device, dtype=torch.int32).repeat_interleave(S)
    o = kern(qf.contiguous(), kv.contiguous(), sk.contiguous(), idx.reshape(B * S, K).int().contiguous(), bt)
    return o[:, :H].reshape(B, S, H, D)


@implement("sparse_attn_fp8", "tilelang")
def sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                    rope_dim: int, out_rope: tuple | None = None) -> torch.Tensor:
    """The FP8 KV layout unpacked to q's dtype in PyTorch (`kv_unpack`: a copy of the cache rows it is given), then
    the TileLang sparse attention, then the output's RoPE removal in PyTorch (model.py's apply_rotary_emb)."""
    o = sparse_attn(q, REGISTRY["kv_unpack"].ref(kv, q.size(-1), rope_dim, q.dtype), sink, idx, scale)
    if out_rope is not None:
        o[..., -rope_dim:] = REGISTRY["rope"].ref(o[..., -rope_dim:], *out_rope, inverse=True)
    return o
