"""DeepGEMM backend (import name `deepinfer_kernels.deepgemm`): DeepSeek's FP8 GEMM library, the design's GEMM
library and what the field notes' engine ran on SM90, where `deep_gemm` is installed (built from its source:
it JIT-compiles its kernels with nvcc at run time and needs CUTLASS's headers; no PyPI release).

Importing this package registers `fp8_gemm`, `fp4_gemm` and `grouped_gemm` (`gemm.py`) and the reference-only
list; it does NOT import deep_gemm (whose import initialises its JIT runtime): `_common.dg` imports it on the first
kernel call. The FP4 experts run as FP8 requantised per 128 x 128 block, once per weight
(`deepinfer.quant.requant`, measured by `deepinfer probe requant`), since DeepGEMM's SM90 kernels take fp32
scales at a K granularity of 128 only.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("deep_gemm") is None:  # the registry turns this into the one line naming the fix
    raise ModuleNotFoundError("No module named 'deep_gemm'", name="deep_gemm")

from deepinfer.ops import registry

from . import gemm  # noqa: F401,E402
from .reference_only import REFERENCE_ONLY  # noqa: E402

registry.reference_only("deepgemm", REFERENCE_ONLY)
# its GEMMs after the reference's act_quant / swiglu_quant
registry.compose("deepgemm", ("act_quant_fp8_gemm", "swiglu_grouped_gemm"))


def facts(device) -> dict:
    """DeepGEMM's version (package metadata, importing nothing), whether it is imported yet, and the ops that
    promote to fp32 once per 128-K block ("per_128k_ops")."""
    import importlib.metadata as md
    import sys

    ver = None
    for name in ("deep_gemm", "deep-gemm"):
        try:
            ver = md.version(name)
            break
        except md.PackageNotFoundError:
            continue
    # DeepGEMM's SM90 FP8 GEMMs promote their tensor-core sums to fp32 once per 128-K block
    return {"deep_gemm": ver, "deep_gemm_imported": "deep_gemm" in sys.modules,
            "per_128k_ops": ["fp8_gemm", "fp4_gemm", "grouped_gemm"]}


__all__ = ["REFERENCE_ONLY", "facts"]
