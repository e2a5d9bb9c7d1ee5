"""Helpers shared by the TileLang kernels: dtype names, the per-shape build cache with its visible fallback,
and in-kernel numerics primitives."""

from __future__ import annotations

import torch

from deepinfer.ops import ops

FP8_MAX = 448.0

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
          torch.float8_e4m3fn: "float8_e4m3"}

_built: dict = {}  # (op, key) -> compiled kernel, or None when its build failed (the reason was recorded)


def tl_dtype(dt: torch.dtype) -> str:
    try:
        return DTYPES[dt]
    except KeyError:
        raise TypeError(f"no TileLang dtype for {dt}") from None


def build(op: str, key: tuple, make):
    """The kernel of `op` for `key` (the shape and dtype parameters it is specialised on): make() compiles it,
    once. A build that raises is remembered and reported through `ops.runtime_fallback` (naming the op and
    the key; an error under --strict), and None is returned: the caller runs the reference for that call."""
    k = (op, key)
    if k in _built:
        return _built[k]
    try:
        kern = make()
    except Exception as e:  # TileLang raises TVM errors of many types; the message is what matters
        first = (str(e).strip().splitlines() or [""])[-1][:300]
        _built[k] = None
        ops.runtime_fallback(op, f"TileLang build failed for {key}: {type(e).__name__}: {first}")
        return None
    _built[k] = kern
    return kern


def expert_blocks(e: torch.Tensor, P: int, N: int, E: int, BM: int, out_dtype: torch.dtype):
    """The grouped GEMMs' output and blocks: C [P, N] out_dtype zeroed (rows of no expert, e = -1, stay 0) and
    `moe_align`'s (rows [NB * BM], block experts [NB]), or (C, None, None) when there is nothing to compute."""
    from deepinfer.quant.grouped import moe_align

    c = torch.zeros(P, N, dtype=out_dtype, device=e.device)
    if P == 0 or N == 0 or E == 0:
        return c, None, None
    rows, bexp = moe_align(e, E, BM)
    return c, rows, bexp


def pow2_ceil(T, v):
    """2^ceil(log2 v) for a positive normal float32 `v`, from its bits (a power of two is its own ceiling):
    the ue8m0 scale rounding, exact where a log2 would round at powers of two."""
    bits = T.reinterpret("uint32", v)
    exp = (bits >> 23) & T.uint32(0xFF)
    up = T.if_then_else((bits & T.uint32(0x7FFFFF)) != T.uint32(0), T.uint32(1), T.uint32(0))
    return T.reinterpret("float32", (exp + up) << 23)
