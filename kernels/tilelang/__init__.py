"""TileLang backend (import name `deepinfer_kernels.tilelang`): importable only where TileLang is installed
(`pip install -e '.[tilelang]'`); importing it registers its implementations with `implement(..., "tilelang")`.

Each kernel is built per shape on first use (`_common.compiled`). A build that fails names the op and the shape:
under `--strict` it is an error, otherwise that call runs the torch reference and says so once
(`Dispatcher.runtime_fallback`).
"""

from __future__ import annotations

import tilelang  # noqa: F401  (an ImportError here marks the backend unavailable, with the reason)

from . import attention, gemm, mhc, quant  # noqa: F401

REFERENCE_ONLY: dict[str, str] = {
    "sample": "sampling is a handful of small reductions over the vocabulary, latency-bound; the Triton kernel "
              "serves it and a TileLang one would add nothing to compare",
    "logprobs": "a log-softmax of the logits, as sample",
    "spec_probs": "speculative decoding's sampling distribution, as sample",
    "spec_verify": "speculative decoding's acceptance and residual draw: two passes over K + 1 rows, as sample",
}
"""Ops this backend leaves to the torch reference on purpose, with the reason."""


def facts(device) -> dict:
    """Versions and the arch kernels are built for on `device` (`registry.backend_facts`)."""
    import importlib.metadata as md

    import torch

    try:
        tk = md.version("tile-kernels")
    except md.PackageNotFoundError:
        tk = None
    cap = torch.cuda.get_device_capability(device) if getattr(device, "type", None) == "cuda" else None
    return {"tilelang": tilelang.__version__, "tile_kernels": tk, "arch": f"sm_{cap[0]}{cap[1]}" if cap else None}


__all__ = ["REFERENCE_ONLY", "facts"]
