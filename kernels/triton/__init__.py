"""Triton backend: importing this package registers every op implementation with `implement(...,"triton")`.

Each module holds one op family; every wrapper allocates its outputs with torch.empty (the kernels
write every element), launches with a grid that depends only on shapes, and never syncs with the host
(no .item()/.tolist()/data-dependent shapes), so the calls can be captured in CUDA graphs.
"""

from __future__ import annotations

from . import attention, cache, compressor, gemm, indexer, linear, mhc, moe, moe_grouped, norm, quant, rope, sampling  # noqa: F401

REFERENCE_ONLY: dict[str, str] = {}
"""Ops the Triton backend intentionally leaves to the torch reference, with the reason."""

__all__ = ["REFERENCE_ONLY"]
