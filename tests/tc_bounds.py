"""Error bound for GEMMs whose fp32 promotion happens once per 128-K block (the compiled prefill kernels).

Hopper's FP8 wgmma accumulates inside the tensor core with limited precision; the DeepSeek-V3 report
(§3.3.2) measured ~2 % maximum relative error for K = 4096 without promotion. The error grows with the
accumulations inside the tensor core, so promoting every 128 K leaves ~2 %·128/4096 ≈ 2^-10.6 of the
block's Σ|a·w|, and summed over blocks: |out - exact| <~ 2^-10.6 · Σ_k |a_k w_k|. Measured on the H200
(2026-11-29, fp8_gemm 300 x 1024 x 7168): 1.04 · 2^-11 = 2^-10.9. The tests allow 2^-9 (`ab_cases.TC_REL`, 3.7x the
measurement), plus the output's own rounding (bf16: 2^-8 |ref| with margin). A wrong tile, scale or
row is off by O(1) of the value and still fails.
"""

from __future__ import annotations

import torch

from deepinfer.debug.ab_cases import COMPARE, TC_REL
from deepinfer.ops import REGISTRY


def assert_tensor_core_bound(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> None:
    """out, ref [..] (any float dtype), mag = Σ|terms| per element (same shape): NaN-free and within the bound."""
    o, r, m = out.double().cpu(), ref.double().cpu(), mag.double().cpu()
    assert not torch.isnan(o).any(), "NaN in the kernel output"
    bound = TC_REL * m + (2.0 ** -8 * r.abs() if out.dtype == torch.bfloat16 else 0.0) + 1e-30
    excess = ((o - r).abs() / bound).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the tensor-core accumulation bound"


def abs_products(op: str, *args, **kwargs) -> torch.Tensor:
    """Σ_k |a_k w_k| per output element of GEMM op `op`: its reference on the operands with their sign bits
    cleared (`COMPARE[op].abs_args`, as `deepinfer ab` computes it; the scales are positive)."""
    return REGISTRY[op].ref(*COMPARE[op].abs_args(args), **kwargs)


def block_fp8_operands(M: int, N: int, K: int, g: torch.Generator, device="cuda") -> tuple:
    """Random block-FP8 GEMM operands (a [M, K] e4m3, a_s [M, K/128] and w_s [N/128, K/128] powers of two, w [N, K]
    e4m3) -> (a, a_s, w, w_s), as `fp8_gemm` takes them; values x 50 so the e4m3 codes span their range."""
    a = (torch.randn(M, K, device=device, generator=g) * 50).to(torch.float8_e4m3fn)
    w = (torch.randn(N, K, device=device, generator=g) * 50).to(torch.float8_e4m3fn)
    a_s = torch.exp2(torch.randint(-6, 2, (M, K // 128), device=device, generator=g).float())
    w_s = torch.exp2(torch.randint(-9, -3, (N // 128, K // 128), device=device, generator=g).float())
    return a, a_s, w, w_s
