"""FP8 activation quantisation and the block-FP8 GEMM through FlagGems.

act_quant: `flag_gems.ops.act_quant.act_quant_triton(x, block, scale_fmt="ue8m0")` -- DeepSeek's kernel.py
act_quant in Triton: amax floored at 1e-4, scale 2^ceil(log2(amax / 448)) from the bits, q = clamp(x / s, +-448)
to e4m3, (q [..., K], s f32 [..., K/block]): our contract exactly. It needs a contiguous x (an adapter copy for a
strided one) and a power-of-two block (tl.arange); anything else runs the reference, visibly.
fp8_gemm: `flag_gems.w8a8_block_fp8_matmul(A, W, As, Ws, [128, 128], out_dtype)` (the Hopper build where FlagGems
selects it), our contract with the operands in that order. Its Triton kernel scales and adds each 128-K block's
`tl.dot` into an fp32 accumulator: the FP8 wgmma's limited in-core accumulation is promoted once per 128-K block,
as cuBLASLt's block-scaled GEMM and our Triton prefill kernel do, so it is held to the same tensor-core bound
(`tests/tc_bounds.py`), not to the fp32-FMA bound of a kernel that promotes after every wgmma. Weight
scales in ue8m0 (float8_e8m0fnu or uint8 bytes) are decoded to f32 per call (a small copy: N/128 x K/128 values).
rms_norm_quant, swiglu_quant: the norm (FlagGems' rms_norm, `norm.py`) or the SwiGLU (PyTorch: FlagGems' swiglu
computes no clamp) then FlagGems' act_quant, composed by the registry (`registry.compose`).
"""

from __future__ import annotations

import torch

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


def _f32_scales(s: torch.Tensor) -> torch.Tensor | None:
    """f32 scales as they are; ue8m0 bytes (float8_e8m0fnu or uint8, as checkpoints hold them) decoded to f32
    (a copy of N/128 x K/128 values per call); None for anything else."""
    if s.dtype == torch.float32:
        return s.contiguous()
    if s.dtype in (getattr(torch, "float8_e8m0fnu", None), torch.uint8):
        from deepinfer.quant.formats import scale_f32

        return scale_f32(s, "fp8_gemm weight scales").contiguous()
    return None


@implement("fp8_gemm", "flaggems")
def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    ref = REGISTRY["fp8_gemm"].ref
    if a.size(0) == 0:
        return ref(a, a_s, w, w_s, out_dtype)
    M, K = a.shape
    N = w.size(0)
    ws = _f32_scales(w_s)
    bad = ""
    if not cuda(a, w):
        bad = f"FlagGems kernels run on CUDA, not {a.device}"
    elif a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        bad = f"w8a8_block_fp8_matmul takes e4m3 operands, not {a.dtype} x {w.dtype}"
    elif a_s.dtype != torch.float32 or ws is None:
        bad = f"w8a8_block_fp8_matmul takes f32 scales (or ue8m0 weight scales), not {a_s.dtype} / {w_s.dtype}"
    elif out_dtype not in _OUT:
        bad = f"no {out_dtype} output"
    elif tuple(a_s.shape) != (M, -(-K // 128)) or tuple(ws.shape) != (-(-N // 128), -(-K // 128)):
        bad = f"scale shapes {tuple(a_s.shape)} / {tuple(w_s.shape)} are not per-128 for A {tuple(a.shape)}, W {tuple(w.shape)}"
    g = None if bad else fg("flag_gems", a.device)
    if g is None:
        return off_contract("fp8_gemm", bad or why("flag_gems"), ref, a, a_s, w, w_s, out_dtype)
    return run("fp8_gemm", (N, K, str(out_dtype)),
               lambda: g.w8a8_block_fp8_matmul(a.contiguous(), w.contiguous(), a_s.contiguous(), ws, [128, 128],
                                               out_dtype),
               lambda: ref(a, a_s, w, w_s, out_dtype))
