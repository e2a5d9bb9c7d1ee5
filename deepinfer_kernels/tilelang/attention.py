"""Sparse attention with an attention sink in TileLang (`sparse_attn`), prefill and decode alike, on sm_90.

One program per query token holds every head (padded to 16: the MMA's smallest M) and walks its slots in idx
order, 64 at a time, rounding where the reference (and DeepSeek's kernel.py `sparse_attn_kernel`) rounds:
the block's kv rows gathered into shared memory (empty slots as zero rows, their logits -inf), logits
(q . kv) * scale in fp32, a running max over the logits only, p = exp(logit - max) summed in fp32 and cast to
the operands' dtype for the P V product, whose fp32 accumulator is rescaled as the max grows; the sink joins
the denominator at the end. A token with no valid slot gets 0 (its max stays -inf: the exponentials use 0).
bf16 / fp16 operands only (a float32 run takes the reference: tensor cores would round it to tf32).
`sparse_attn` at 64-head blocks runs attention_ws.py's warp-specialised form by default (DEEPINFER_TL_ATTN).
`sparse_attn_fp8` is the plain kernel reading the FP8 cache layout (`kv_pack`) in place: each gathered entry's
codes times their ue8m0 scale, and its RoPE dims as stored, decoded into the shared tile.

No `from __future__ import annotations`: TileLang evaluates the prim_func's annotations.
"""

from collections import Counter

import tilelang
import tilelang.language as T
import torch

from deepinfer import settings
from deepinfer.ops import ops
from deepinfer.ops.reference import SPARSE_ATTN_BLOCK
from deepinfer.ops.registry import REGISTRY, implement
from deepinfer.quant.kv_layout import kv_packed_width, kv_rope_offset

from . import attention_ws
from .attention_ws import online_softmax
from ._common import build, tl_dtype

BLK = SPARSE_ATTN_BLOCK  # 64: the official kernel's block of slots
FORMS_RUN: Counter = Counter()  # "ws" / "plain": which bf16 kernel each sparse_attn call ran (tests read it)


def sparse_attn_kernel(H: int, D: int, K: int, dt: str, scale: float, fp8: tuple | None = None):
    """Q [T, H, D], KV [B, N, D], SINK [H] f32, IDX [T, K] int32, BT [T] int32 (each token's batch) ->
    O [T, H, D] (T, B, N symbolic; H a multiple of 16).
    fp8 = (nope, rope_off, W): KV is the FP8 cache layout (`kv_pack`, W bytes per entry) read through three views of
    the same bytes -- KC [B, N, W] e4m3 (the no-RoPE codes), KS [B, N, W] uint8 (the ue8m0 scale per 64 codes at
    byte nope + d/64), KR [B, N, W/2] dt (the RoPE dims from element rope_off/2) -- and decoded into the block's
    shared tile as it is gathered: code x 2^(byte - 127), rounded to dt (exact: e4m3 x a power of two), as
    `kv_unpack` computes it."""
    Tn, Bn, N = T.symbolic("T"), T.symbolic("B"), T.symbolic("N")
    NBLK = (K + BLK - 1) // BLK
    W = fp8[2] if fp8 else D

    @T.macro
    def slots(t, kb, IDX, ids):
        for j in T.Parallel(BLK):
            ids[j] = T.if_then_else(kb * BLK + j < K, IDX[t, T.min(kb * BLK + j, K - 1)], -1)

    @T.macro
    def block_step(q_s, kv_s, p_s, ids, lg, acc, m, m_prev, bm, rs, l):
        T.clear(lg)
        T.gemm(q_s, kv_s, lg, transpose_B=True)
        for h, j in T.Parallel(H, BLK):
            lg[h, j] = T.if_then_else(ids[j] >= 0, lg[h, j] * T.float32(scale), -T.infinity("float32"))
        online_softmax(lg, m, m_prev, bm, rs, l, H, BLK, T.exp)
        for h, d in T.Parallel(H, D):
            acc[h, d] *= rs[h]
        T.copy(lg, p_s)  # p in the operands' dtype for the P V product
        T.gemm(p_s, kv_s, acc)

    @T.macro
    def finish(t, SINK, O, acc, m, bm, l, o_s):
        for h in T.Parallel(H):
            bm[h] = T.if_then_else(m[h] == -T.infinity("float32"), T.float32(0), m[h])
            l[h] = 1 / (l[h] + T.exp(SINK[h] - bm[h]))  # the reciprocal: a multiply per element, not a division
        for h, d in T.Parallel(H, D):
            acc[h, d] = acc[h, d] * l[h]
        T.copy(acc, o_s)
        T.copy(o_s, O[t, 0, 0])

    if fp8 is None:
        @T.prim_func
        def sparse_attn_k(Q: T.Tensor((Tn, H, D), dt), KV: T.Tensor((Bn, N, D), dt), SINK: T.Tensor((H,), "float32"),
                          IDX: T.Tensor((Tn, K), "int32"), BT: T.Tensor((Tn,), "int32"), O: T.Tensor((Tn, H, D), dt)):
            with T.Kernel(Tn, threads=256) as t:
                q_s = T.alloc_shared((H, D), dt)
                kv_s = T.alloc_shared((BLK, D), dt)
                p_s = T.alloc_shared((H, BLK), dt)
                o_s = T.alloc_shared((H, D), dt)
                ids = T.alloc_shared((BLK,), "int32")
                lg = T.alloc_fragment((H, BLK), "float32")
                acc = T.alloc_fragment((H, D), "float32")
                m = T.alloc_fragment((H,), "float32")
                m_prev = T.alloc_fragment((H,), "float32")
                bm = T.alloc_fragment((H,), "float32")
                rs = T.alloc_fragment((H,), "float32")
                l = T.alloc_fragment((H,), "float32")
                b = BT[t]
                T.copy(Q[t, 0, 0], q_s)
                T.clear(acc)
                T.clear(l)
                T.fill(m, -T.infinity("float32"))
                for kb in T.serial(NBLK):
                    slots(t, kb, IDX, ids)
                    for j, d in T.Parallel(BLK, D):
                        kv_s[j, d] = T.if_then_else(ids[j] >= 0, KV[b, T.max(ids[j], 0), d], T.Cast(dt, 0))
                    block_step(q_s, kv_s, p_s, ids, lg, acc, m, m_prev, bm, rs, l)
                finish(t, SINK, O, acc, m, bm, l, o_s)

        return sparse_attn_k

    nope, rope_off, _ = fp8
    NG = nope // 64

    @T.prim_func
    def sparse_attn_fp8_k(Q: T.Tensor((Tn, H, D), dt), KC: T.Tensor((Bn, N, W), "float8_e4m3"),
                          KS: T.Tensor((Bn, N, W), "uint8"), KR: T.Tensor((Bn, N, W // 2), dt),
                          SINK: T.Tensor((H,), "float32"), IDX: T.Tensor((Tn, K), "int32"),
                          BT: T.Tensor((Tn,), "int32"), O: T.Tensor((Tn, H, D), dt)):
        with T.Kernel(Tn, threads=256) as t:
            q_s = T.alloc_shared((H, D), dt)
            kv_s = T.alloc_shared((BLK, D), dt)
            p_s = T.alloc_shared((H, BLK), dt)
            o_s = T.alloc_shared((H, D), dt)
            ids = T.alloc_shared((BLK,), "int32")
            sc_s = T.alloc_shared((BLK, NG), "float32")
            lg = T.alloc_fragment((H, BLK), "float32")
            acc = T.alloc_fragment((H, D), "float32")
            m = T.alloc_fragment((H,), "float32")
            m_prev = T.alloc_fragment((H,), "float32")
            bm = T.alloc_fragment((H,), "float32")
            rs = T.alloc_fragment((H,), "float32")
            l = T.alloc_fragment((H,), "float32")
            b = BT[t]
            T.copy(Q[t, 0, 0], q_s)
            T.clear(acc)
            T.clear(l)
            T.fill(m, -T.infinity("float32"))
            for kb in T.serial(NBLK):
                slots(t, kb, IDX, ids)
                for j, g in T.Parallel(BLK, NG):
                    sc_s[j, g] = T.reinterpret("float32", T.shift_left(
                        T.Cast("uint32", KS[b, T.max(ids[j], 0), nope + g]), T.uint32(23)))
                for j, d in T.Parallel(BLK, nope):
                    kv_s[j, d] = T.if_then_else(
                        ids[j] >= 0, T.Cast(dt, T.Cast("float32", KC[b, T.max(ids[j], 0), d]) * sc_s[j, d // 64]),
                        T.Cast(dt, 0))
                for j, d in T.Parallel(BLK, D - nope):
                    kv_s[j, nope + d] = T.if_then_else(ids[j] >= 0, KR[b, T.max(ids[j], 0), rope_off // 2 + d],
                                                       T.Cast(dt, 0))
                block_step(q_s, kv_s, p_s, ids, lg, acc, m, m_prev, bm, rs, l)
            finish(t, SINK, O, acc, m, bm, l, o_s)

    return sparse_attn_fp8_k


def _plain_heads(H: int) -> int:
    """The plain kernel's padded head count: the MMA's 16 rows, or whole 64-row tiles for its 8 warps' MMAs."""
    return 16 if H <= 16 else -(-H // 64) * 64


def _pad_heads(qf: torch.Tensor, sk: torch.Tensor, Hp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero heads up to the kernel's padded count Hp (sliced off after): q [T, H, D], sink [H] -> [T, Hp, D], [Hp]."""
    T_, H, D = qf.shape
    if Hp == H:
        return qf, sk
    return torch.cat([qf, qf.new_zeros(T_, Hp - H, D)], 1), torch.cat([sk, sk.new_zeros(Hp - H)])


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
    dt = tl_dtype(q.dtype)
    form = "ws" if settings.choice("DEEPINFER_TL_ATTN") == "ws" and attention_ws.ws_fits(H, D, K) else "plain"
    if form == "ws":
        Hp = -(-H // attention_ws.HB) * attention_ws.HB
        key, make = ("ws", Hp, D, K, str(q.dtype), float(scale)), lambda: tilelang.compile(
            attention_ws.sparse_attn_ws_kernel(Hp, D, K, dt, float(scale)), out_idx=[5],
            pass_configs=attention_ws.PASS_CONFIGS)
    else:
        Hp = _plain_heads(H)
        key, make = (Hp, D, K, str(q.dtype), float(scale)), lambda: tilelang.compile(
            sparse_attn_kernel(Hp, D, K, dt, float(scale)), out_idx=[5])
    qf, sk = _pad_heads(q.reshape(B * S, H, D), sink.float(), Hp)
    kern = build("sparse_attn", key, make)
    if kern is None:
        return ref(q, kv, sink, idx, scale)
    FORMS_RUN[form] += 1
    bt = torch.arange(B, device=q.device, dtype=torch.int32).repeat_interleave(S)
    o = kern(qf.contiguous(), kv.contiguous(), sk.contiguous(), idx.reshape(B * S, K).int().contiguous(), bt)
    return o[:, :H].reshape(B, S, H, D)


@implement("sparse_attn_fp8", "tilelang")
def sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                    rope_dim: int, out_rope: tuple | None = None) -> torch.Tensor:
    """The sparse attention reading the FP8 cache layout in place (the kernel decodes each gathered entry), then the
    output's RoPE removal in PyTorch (model.py's apply_rotary_emb)."""
    B, S, H, D = q.shape
    ref = REGISTRY["sparse_attn_fp8"].ref
    nope = D - rope_dim
    W = kv_packed_width(D, rope_dim, q.dtype) if q.dtype in (torch.bfloat16, torch.float16) else -1
    if kv.size(-1) != W or nope % 64 or D % 16 or B * S == 0 or kv.stride(-1) != 1:
        if B * S:
            ops.runtime_fallback("sparse_attn_fp8", f"the TileLang kernel takes bf16 / fp16 q with D % 16 == 0 over "
                                                    f"the packed cache, not {q.dtype}, D {D}, {kv.size(-1)} bytes")
        return ref(q, kv, sink, idx, scale, rope_dim, out_rope)
    K = idx.size(-1)
    Hp = _plain_heads(H)
    qf, sk = _pad_heads(q.reshape(B * S, H, D), sink.float(), Hp)
    fp8 = (nope, kv_rope_offset(D, rope_dim), W)
    kern = build("sparse_attn_fp8", (Hp, D, K, str(q.dtype), float(scale), fp8), lambda: tilelang.compile(
        sparse_attn_kernel(Hp, D, K, tl_dtype(q.dtype), float(scale), fp8), out_idx=[7]))
    if kern is None:
        return ref(q, kv, sink, idx, scale, rope_dim, out_rope)
    kv = kv.contiguous()
    bt = torch.arange(B, device=q.device, dtype=torch.int32).repeat_interleave(S)
    o = kern(qf.contiguous(), kv.view(torch.float8_e4m3fn), kv, kv.view(q.dtype), sk.contiguous(),
             idx.reshape(B * S, K).int().contiguous(), bt)
    o = o[:, :H].reshape(B, S, H, D)
    if out_rope is not None:
        o[..., -rope_dim:] = REGISTRY["rope"].ref(o[..., -rope_dim:], *out_rope, inverse=True)
    return o
