"""Byte sizes of the FP8 KV cache layout, the form `ops.kv_pack` writes and `ops.kv_unpack` reads.

An entry of head_dim D whose last rope_dim dims are RoPE'd is one uint8 row of `kv_packed_width` bytes:

    [D - rope_dim e4m3 codes | one ue8m0 scale byte per 64 codes, zero-padded to `kv_scale_bytes` |
     the rope_dim RoPE dims in the compute dtype, as bytes (from `kv_rope_offset`)]

The scale bytes are padded to a multiple of 16 so that the rope part starts 16-byte aligned.
"""

from __future__ import annotations

import torch


def kv_scale_bytes(nope: int) -> int:
    """Bytes for the e8m0 scales of `nope` no-RoPE dims (one per 64), rounded up to 16 (aligned rope part)."""
    return -(-(nope // 64) // 16) * 16


def kv_rope_offset(head_dim: int, rope_dim: int) -> int:
    """Byte offset of the rope dims in an FP8-layout entry: after the codes and the padded scale bytes."""
    nope = head_dim - rope_dim
    return nope + kv_scale_bytes(nope)


def kv_packed_width(head_dim: int, rope_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one FP8-layout cache entry (V4: 448 + 16 + 64·2 = 592 in bf16, against 1024 as bf16)."""
    return kv_rope_offset(head_dim, rope_dim) + rope_dim * dtype.itemsize
