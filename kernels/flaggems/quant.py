"""FP8 activation quantisation through FlagGems.

act_quant: `flag_gems.ops.act_quant.act_quant_triton(x, block, scale_fmt="ue8m0")` -- DeepSeek's kernel.py
act_quant in Triton: amax floored at 1e-4, scale 2^ceil(log2(amax / 448)) from the bits, q = clamp(x / s, +-448)
to e4m3, (q [..., K], s f32 [..., K/block]): our contract exactly. It needs a contiguous x (an adapter copy for a
strided one) and a power-of-two block (tl.arange); anything else runs the reference, visibly.
fp8_gemm is not wrapped: FlagGems' `w8a8_block_fp8_matmul` missed the fp32-accumulation bound on the H200 (see
`reference_only.py`).
rms_norm_quant, swiglu_quant: the norm (FlagGems' rms_norm, `norm.py`) or the SwiGLU (PyTorch: FlagGems' swiglu
computes no clamp) then FlagGems' act_quant: two steps, unfused.
"""

from __future__ import annotations

import torch

from deepinfer.ops.reference import _quant_outputs
from deepinfer.ops.registry import REGISTRY, implement

from ._common import cuda, fg, off_contract, run, why

_IN = (torch.bfloat16, torch.float16, torch.float32)
_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _act_quant_contract(x: torch.Tensor, block: int) -> str:
    if not cuda(x):
        return f"FlagGems kernels run on CUDA, not {x.device}"
    if x.dtype not in _IN:
        return f"FlagGems' act_quant takes bf16/fp16/fp32 input, not {x.dtype}"
    if block < 16 or block & (block - 1):
        return f"FlagGems' act_quant takes a power-of-two block >= 16, not {block}"
    if x.size(-1) % block:
        return f"last dim {x.size(-1)} is not a multiple of the block {block}"
    return ""


@implement("act_quant", "flaggems")
def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    ref = REGISTRY["act_quant"].ref
    if x.numel() == 0:
        return ref(x, block)
    bad = _act_quant_contract(x, block)
    m = None if bad else fg("flag_gems.ops.act_quant", x.device)
    if m is None:
        return off_contract("act_quant", bad or why("flag_gems.ops.act_quant"), ref, x, block)
    return run("act_quant", (x.size(-1), block, str(x.dtype)),
               lambda: m.act_quant_triton(x.contiguous(), block, scale_fmt="ue8m0"), lambda: ref(x, block))


@implement("swiglu_quant", "flaggems")
def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, block: int = 128, split: bool = False) -> tuple:
    """The clamped SwiGLU in PyTorch (as the reference), then FlagGems' act_quant."""
    y = REGISTRY["swiglu"].ref(gate, up, limit, weight, out_dtype)
    return _quant_outputs(*act_quant(y, block), block, split, "swiglu_quant")
