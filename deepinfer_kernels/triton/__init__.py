"""Triton backend: importing this package registers every op implementation with `implement(...,"triton")`.

Each module holds one op family; every wrapper allocates its outputs with torch.empty (the kernels
write every element), launches with a grid that depends only on shapes, and never syncs with the host
(no .item()/.tolist()/data-dependent shapes), so the calls can be captured in CUDA graphs.
"""

from __future__ import annotations

from . import attention, cache, compressor, gemm, indexer, linear, mhc, moe, moe_grouped, norm, quant, rope, sampling  # noqa: F401
from . import speculative  # noqa: F401

REFERENCE_ONLY: dict[str, str] = {}
"""Ops the Triton backend intentionally leaves to the torch reference, with the reason."""



def facts(device) -> dict:
    """What this backend chose for `device`, for reports (`registry.backend_facts`): "fp8_prefill_gemm", the
    GEMM prefill-sized `fp8_gemm` calls (M >= "fp8_prefill_min_m") run -- "cublaslt", or "triton: <why not>";
    "pdl_triton" (this Triton has grid dependency control), "pdl_env" / "pdl_enabled" (the switch and its
    value) and "pdl" (launches on `device` use programmatic dependent launch); "per_128k_ops", the ops whose FP8
    tensor-core sums are promoted to fp32 once per 128-K block rather than after every MMA as the official kernels
    (`fp8_gemm` unless DEEPINFER_FP8_GEMM=exact, the default, or exact-wgmma)."""
    import torch

    from . import _common, gemm_vendor

    device = torch.device(device)
    return {"fp8_prefill_gemm": gemm_vendor.used_for(device), "fp8_prefill_min_m": gemm_vendor.MIN_M,
            "pdl_triton": _common._PDL_TRITON, "pdl_env": _common.PDL_ENV, "pdl_enabled": _common._PDL_ON,
            "pdl": device.type == "cuda" and bool(_common.pdl()),
            "per_128k_ops": [] if gemm_vendor.mode() in ("exact", "exact-wgmma") else ["fp8_gemm"]}


__all__ = ["REFERENCE_ONLY", "facts"]
