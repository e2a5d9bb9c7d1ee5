"""A plain-PyTorch stand-in for DeepSeek's `inference/kernel.py` (`for_release(rev)`), so the official
model.py's own Python -- its modules, caches and index helpers -- runs on a CPU in tests of the plumbing of
`deepinfer verify --against official` (`deepinfer/debug/official.py`). The command itself runs the release's
TileLang kernel.py on CUDA; this module is never used by it.

Each function has kernel.py's signature and computes what its kernel computes, through our reference ops where
the contracts agree (act_quant's ue8m0 scales, the FP8 / FP4 GEMMs accumulated in fp32, the sparse attention's
blockwise softmax with the sink added last). The one hunk between the releases is the inplace act_quant: 60d8d707's
rounds through e4m3, efc85512's casts to the input's bf16 and returns x unchanged.
"""
from __future__ import annotations

import sys
import types

import torch

from deepinfer.ops import reference as ref


def for_release(rev: str) -> types.ModuleType:
    """This module's functions as a `kernel` module of release `rev` (its inplace act_quant)."""
    mod = types.ModuleType(f"kernel_torch_{rev}")
    for name in ("fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn"):
        setattr(mod, name, getattr(sys.modules[__name__], name))
    mod.act_quant = act_quant if rev == "60d8d707" else act_quant_initial
    return mod


def act_quant_initial(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    """efc85512: the inplace branch's `T.Cast(out_dtype, ...)` with out_dtype = the input's bf16 -- x / s * s for
    a power-of-two s, x unchanged."""
    if inplace:
        return x
    return act_quant(x, block_size, scale_fmt, scale_dtype)


def act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    assert scale_fmt is not None, "model.py passes ue8m0 scales"
    if inplace:  # 60d8d707: quantise through e4m3 and back, in place
        x.copy_(ref.fp8_fake_quant(x, block_size))
        return x
    q, s = ref.act_quant(x, block_size)
    return q, s.to(scale_dtype)


def fp4_act_quant(x, block_size=32, inplace=False):
    assert inplace, "model.py calls it inplace only"
    x.copy_(ref.fp4_fake_quant(x, block_size))
    return x


def fp8_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    K = a.size(-1)
    c = ref.fp8_gemm(a.reshape(-1, K), a_s.reshape(-1, a_s.size(-1)).float(), b, b_s.float(),
                     out_dtype=torch.get_default_dtype())
    return c.view(*a.shape[:-1], b.size(0))


def fp4_gemm(a, a_s, b, b_s, scale_dtype=torch.float32):
    K = a.size(-1)
    c = ref.fp4_gemm(a.reshape(-1, K), a_s.reshape(-1, a_s.size(-1)).float(), b.view(torch.int8), b_s.float(),
                     out_dtype=torch.get_default_dtype())
    return c.view(*a.shape[:-1], b.size(0))


def sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    return ref.sparse_attn(q, kv, attn_sink.float(), topk_idxs, softmax_scale)


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb: softmax rows + eps, then alternating column / row
    normalisations (the first a column one), as hc_split_sinkhorn_kernel."""
    h = hc_mult
    m = mixes.float()
    pre = torch.sigmoid(m[..., :h] * hc_scale[0] + hc_base[:h]) + eps
    post = 2 * torch.sigmoid(m[..., h:2 * h] * hc_scale[1] + hc_base[h:2 * h])
    comb = (m[..., 2 * h:] * hc_scale[2] + hc_base[2 * h:]).unflatten(-1, (h, h))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb
