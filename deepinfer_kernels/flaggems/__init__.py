"""FlagGems backend (import name `deepinfer_kernels.flaggems`): the V4 kernels FlagGems 5.0.2 ships, called where
their contract is ours (`pip install -e '.[flaggems]'`). Importing this package registers its implementations
with `implement(..., "flaggems")` and its reference-only list; it does NOT import flag_gems.

`import flag_gems` initialises a CUDA context on the current device (the field notes: 8 ranks landed on device 0),
so flag_gems is imported on the first kernel call (`_common.fg`), under `torch.cuda.device(<the tensor's
device>)`: by then the device is chosen. Here we only check that the package is installed, so that a missing
package is the registry's one line with the install hint.

This backend is separate from `--flaggems op,...` (deepinfer/engine/flaggems_aten.py), which swaps ATen ops under any
backend; both stay.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("flag_gems") is None:  # the registry turns this into "needs the flag_gems package"
    raise ModuleNotFoundError("No module named 'flag_gems'", name="flag_gems")

from deepinfer.ops import registry

from . import attention, mhc, norm, quant  # noqa: F401,E402
from .reference_only import REFERENCE_ONLY  # noqa: E402

registry.reference_only("flaggems", REFERENCE_ONLY)
# the fused ops the reference writes as compositions, from FlagGems' kernels (FlagGems has none of them fused)
registry.compose("flaggems", ("rms_norm_quant", "hc_pre_quant", "moe_combine_post", "swiglu_quant",
                              "act_quant_fp8_gemm", "swiglu_grouped_gemm", "q_norm_sparse_attn_fp8",
                              "hc_post_pre_quant", "moe_combine_post_pre_quant", "moe_combine_post_head"))


def facts(device) -> dict:
    """FlagGems' version (from its metadata: reading it imports nothing), whether it is imported yet, and the ops
    that promote to fp32 once per 128-K block ("per_128k_ops")."""
    import importlib.metadata as md
    import sys

    try:
        ver = md.version("flag_gems")
    except md.PackageNotFoundError:
        try:
            ver = md.version("flag-gems")
        except md.PackageNotFoundError:
            ver = None
    # w8a8_block_fp8_matmul promotes its FP8 dot to fp32 once per 128-K block (quant.py)
    return {"flag_gems": ver, "flag_gems_imported": "flag_gems" in sys.modules, "per_128k_ops": ["fp8_gemm"]}


__all__ = ["REFERENCE_ONLY", "facts"]
