"""TileLang backend (import name `deepinfer_kernels.tilelang`): importable only where TileLang is installed
(`pip install -e '.[tilelang]'`); importing it registers its implementations with `implement(..., "tilelang")`.

Each kernel is built per shape on first use (`_common.build`). A build that fails names the op and the shape:
under `--strict` it is an error, otherwise that call runs the torch reference and says so once
(`Dispatcher.runtime_fallback`).
"""

from __future__ import annotations

import tilelang  # noqa: F401  (an ImportError here marks the backend unavailable, with the reason)

# TileLang logs each kernel compile at INFO on stdout, which would break `--json` output (as kernel.py, WARNING)
tilelang.set_log_level("WARNING")

from deepinfer.ops import registry

from . import attention, gemm, indexer, mhc, moe, quant, routing  # noqa: F401
from .reference_only import REFERENCE_ONLY

registry.reference_only("tilelang", REFERENCE_ONLY)
# the fused ops the reference writes as compositions, from this backend's kernels and model.py's PyTorch steps
registry.compose("tilelang", ("hc_pre_quant", "moe_combine_post", "swiglu_quant", "fp8_fake_quant",
                              "act_quant_fp8_gemm", "swiglu_grouped_gemm", "q_norm_sparse_attn_fp8",
                              "hc_post_pre_quant", "moe_combine_post_pre_quant", "moe_combine_post_head"))


def facts(device) -> dict:
    """Versions, the arch kernels are built for on `device` (`registry.backend_facts`), and the ops that promote
    their FP8 sums to fp32 once per 128-K block ("per_128k_ops": grouped_gemm's folded form, DEEPINFER_TL_FP4=fold,
    the fast policy's default)."""
    import importlib.metadata as md

    import torch

    from deepinfer import settings

    try:
        tk = md.version("tile-kernels")
    except md.PackageNotFoundError:
        tk = None
    cap = torch.cuda.get_device_capability(device) if getattr(device, "type", None) == "cuda" else None
    return {"tilelang": tilelang.__version__, "tile_kernels": tk, "arch": f"sm_{cap[0]}{cap[1]}" if cap else None,
            "per_128k_ops": ["grouped_gemm"] if settings.choice("DEEPINFER_TL_FP4") == "fold" else []}


__all__ = ["REFERENCE_ONLY", "facts"]
