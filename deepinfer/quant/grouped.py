"""The grouped projection V4's `wo_a` computes (each head group times its own weight), in plain PyTorch.

Here rather than with the model because the `fp8_grouped_linear` spec and the kernels' fallback path share it
with the model's float `wo_a`, and neither may import the model.
"""

from __future__ import annotations

import torch


def grouped_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[t, g] = x[t, g] w[g]ᵀ: x [T, G, K] (any strides: read in place), w [G, R, K] in x's dtype -> [T, G, R]
    contiguous, one bmm over the groups (fp32 accumulate). The float `wo_a`, and `fp8_grouped_linear` on its
    dequantised weight."""
    y = torch.empty(x.size(0), x.size(1), w.size(1), dtype=x.dtype, device=x.device)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
    return y
