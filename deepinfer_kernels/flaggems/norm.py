"""RMSNorm through FlagGems' `rms_norm(x, normalized_shape, weight, eps)` (flag_gems.ops.rms_norm: fp32 statistics,
y = x * rrms * w in fp32, stored in x's dtype; our contract). Its weight is required: V4's unweighted norm
(weight=None) passes ones, allocated once per (size, dtype, device). rms_norm_quant is this norm then FlagGems'
act_quant, composed by the registry (`registry.compose`).
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import REGISTRY, implement

from ._common import cuda, fg, off_contract, run, why

_ones: dict = {}


def _weight(weight: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if weight is not None:
        return weight.contiguous()
    k = (x.size(-1), x.dtype, x.device)
    if k not in _ones:
        _ones[k] = torch.ones(x.size(-1), dtype=x.dtype, device=x.device)
    return _ones[k]


@implement("rms_norm", "flaggems")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    ref = REGISTRY["rms_norm"].ref
    if x.numel() == 0:
        return ref(x, weight, eps)
    bad = ""
    if not cuda(x):
        bad = f"FlagGems kernels run on CUDA, not {x.device}"
    elif x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        bad = f"FlagGems' rms_norm takes bf16/fp16/fp32, not {x.dtype}"
    elif weight is not None and (weight.shape != (x.size(-1),) or weight.dtype not in (x.dtype, torch.float32)):
        bad = f"weight {tuple(weight.shape)} {weight.dtype} for x {tuple(x.shape)} {x.dtype}"
    m = None if bad else fg("flag_gems.ops.rms_norm", x.device)
    if m is None:
        return off_contract("rms_norm", bad or why("flag_gems.ops.rms_norm"), ref, x, weight, eps)
    return run("rms_norm", (x.size(-1), str(x.dtype)), lambda: m.rms_norm(x.contiguous(), [x.size(-1)],
                                                                          _weight(weight, x), eps),
               lambda: ref(x, weight, eps))
