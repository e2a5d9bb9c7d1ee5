"""KV cache scatter: cache[rows[i], slots[i]] = values[i], one program per (entry, column block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2


@triton.jit
def _kv_store_kernel(cache_ptr, rows_ptr, slots_ptr, v_ptr, NSLOT, D, s_c0, s_c1, BD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    d = db * BD + tl.arange(0, BD)
    r = tl.load(rows_ptr + i).to(tl.int64)
    s = tl.load(slots_ptr + i).to(tl.int64)
    v = tl.load(v_ptr + i * D + d, mask=d < D)
    tl.store(cache_ptr + r * s_c0 + s * s_c1 + d, v.to(cache_ptr.dtype.element_ty), mask=d < D)


@implement("kv_store", "triton")
def kv_store(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    M = rows.numel()
    D = cache.size(-1)
    assert cache.stride(-1) == 1, "kv_store: the cache's last dim must be contiguous"
    if M == 0 or D == 0:
        return None
    values = values.reshape(M, D).contiguous()
    BD = min(p2(D), 1024)
    _kv_store_kernel[(M, triton.cdiv(D, BD))](cache, rows.contiguous(), slots.contiguous(), values,
                                              cache.size(1), D, cache.stride(0), cache.stride(1), BD=BD)
    return None
