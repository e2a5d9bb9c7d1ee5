"""Sparse attention with a sink through FlagGems' `flag_gems.fused.sparse_attention.sparse_attn_triton(q, kv, sink,
idx, scale)`: one program per (token, batch), all heads at once, slots in blocks of 64 with an online softmax, the
sink added to the denominator at the end, p rounded to bf16 for the P V product: the rounding our reference
describes (kernel.py's). Its contract is narrower than ours, so the adapter:
- takes bf16 q / kv and a power-of-two head dim >= 16 (tl.arange, tl.dot); else the reference, visibly;
- pads the heads to a power of two >= 16 with zero queries when the model has fewer (deepinfer-tiny: 4; a copy of
  q and a slice of the output), since the kernel's tl.arange / tl.dot over all heads needs it;
- maps every negative slot to -1 (FlagGems masks only -1): a copy of idx (B*S*K ints);
- moves each query's valid slots to the front, in their order (a stable sort of idx per query: a copy), because
  FlagGems' online softmax starts from exp(-inf - -inf) = NaN when a query's first block of 64 holds no valid slot,
  which our window slots do for the first tokens. So slots fall into other blocks of 64 than the reference's where
  a query has empty slots before valid ones: the bf16 rounding of p then differs within the bf16 tolerance;
- zeroes the output of a query with no valid slot at all (FlagGems: NaN; ours: 0).
sparse_attn_fp8: the reference's `kv_unpack` of the whole cache to bf16 (a copy of every cached row per call: the
cost of this adapter), this kernel, and the output de-rotation in PyTorch.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import REGISTRY, implement

from ._common import cuda, fg, off_contract, run, why

_MOD = "flag_gems.fused.sparse_attention"


def _pow2(n: int) -> bool:
    return n >= 16 and not n & (n - 1)


@implement("sparse_attn", "flaggems")
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    ref = REGISTRY["sparse_attn"].ref
    B, S, H, D = q.shape
    if B * S == 0 or idx.size(-1) == 0:
        return ref(q, kv, sink, idx, scale)
    bad = ""
    if not cuda(q, kv, idx):
        bad = f"FlagGems kernels run on CUDA, not {q.device}"
    elif q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        bad = f"FlagGems' sparse_attn_triton takes bf16 q and kv, not {q.dtype} / {kv.dtype}"
    elif not _pow2(D):
        bad = f"FlagGems' sparse_attn_triton takes a power-of-two head dim >= 16, not {D}"
    elif kv.dim() != 3 or kv.size(-1) != D:
        bad = f"kv {tuple(kv.shape)} is not [B, N, {D}]"
    m = None if bad else fg(_MOD, q.device)
    if m is None:
        return off_contract("sparse_attn", bad or why(_MOD), ref, q, kv, sink, idx, scale)
    empty = idx < 0
    order = torch.argsort(empty.to(torch.int8), dim=-1, stable=True)
    idx2 = torch.where(empty, -1, idx).gather(-1, order).to(torch.int32).contiguous()
    q0, sink0 = q, sink
    sink = sink.float().contiguous()
    Hp = H if _pow2(H) else max(16, 1 << (H - 1).bit_length())
    if Hp != H:
        q = torch.cat([q, q.new_zeros(B, S, Hp - H, D)], 2)
        sink = torch.cat([sink, sink.new_zeros(Hp - H)])
    o = run("sparse_attn", (Hp, D), lambda: m.sparse_attn_triton(q, kv, sink, idx2, float(scale))[:, :, :H],
            lambda: None)
    if o is None:
        return ref(q0, kv, sink0, idx, scale)
    return torch.where(empty.all(-1)[..., None, None], 0, o)


@implement("sparse_attn_fp8", "flaggems")
def sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                    rope_dim: int, out_rope: tuple | None = None) -> torch.Tensor:
    o = sparse_attn(q, REGISTRY["kv_unpack"].ref(kv, q.size(-1), rope_dim, q.dtype), sink, idx, scale)
    if out_rope is not None:
        o[..., -rope_dim:] = REGISTRY["rope"].ref(o[..., -rope_dim:], *out_rope, inverse=True)
    return o
