"""Weights as the model holds them, and the numerics mode that decides their form.

`official` keeps FP8/FP4 weights in their checkpoint formats and quantises activations on the way into
each GEMM (what the official inference code computes). `exact` dequantises every weight once, at load,
to the compute dtype and quantises nothing (what transformers computes).
"""

from __future__ import annotations

import torch

# the numerics value has its own module; named here too, where it decides the weights' form
from deepinfer.model.numerics import DTYPES, NUMERICS, Numerics  # noqa: F401
from deepinfer.ops import ops
from deepinfer.quant.formats import dequant_fp4, dequant_fp8_block


class Linear:
    """y = x Wᵀ for one weight in one of three forms.

    fmt "float": weight [N, K] in the compute dtype. fmt "fp8": weight [N, K] float8_e4m3fn, scale
    [ceil(N/128), ceil(K/128)] f32. fmt "fp4": weight [N, K/2] int8 (e2m1 pairs), scale [N, K/32] f32 or
    raw ue8m0 bytes (uint8, as stacked experts hold them).
    Quantised forms quantise the input per 128 along K (power-of-two scales) and call the FP8/FP4 GEMM.
    """

    __slots__ = ("weight", "scale", "fmt", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, fmt: str):
        self.weight, self.scale, self.fmt = weight, scale, fmt
        self.out_features = weight.size(0)
        self.in_features = weight.size(1) * (2 if fmt == "fp4" else 1)

    def __call__(self, x: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]. xq: x's act_quant (q, s) when the caller has it already (e.g. from
        `rms_norm_quant`, shared by the projections of one input); float weights ignore it."""
        if self.fmt == "float":
            return ops.linear(x, self.weight)
        if xq is None and self.fmt == "fp8":  # one op: a kernel may quantise A's blocks as it loads them
            y = ops.act_quant_fp8_gemm(x.reshape(-1, x.size(-1)), self.weight, self.scale, out_dtype=x.dtype)
            return y.view(*x.shape[:-1], self.out_features)
        if xq is None:
            xq = ops.act_quant(x.reshape(-1, x.size(-1)), 128)
        return self.quantised(xq[0].reshape(x.shape), xq[1], x.dtype)

    def quantised(self, q: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The FP8 / FP4 GEMM of an input already act_quant'ed: q [..., K] e4m3, s [..., K/128] -> [..., N]
        out_dtype (e.g. from `swiglu_quant`, which never materialises the activation)."""
        K = q.size(-1)
        gemm = ops.fp8_gemm if self.fmt == "fp8" else ops.fp4_gemm
        y = gemm(q.reshape(-1, K), s.reshape(-1, s.size(-1)), self.weight, self.scale, out_dtype=out_dtype)
        return y.view(*q.shape[:-1], self.out_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a [N, K] float tensor (exact for FP8/FP4: the scales are powers of two)."""
        if self.fmt == "float":
            return self.weight.to(dtype)
        if self.fmt == "fp8":
            return dequant_fp8_block(self.weight, self.scale, out_dtype=dtype, check=False)
        return dequant_fp4(self.weight, self.scale, out_dtype=dtype, check=False)

    @staticmethod
    def stacked(parts: list["Linear"]) -> "Linear | None":
        """The parts' rows stacked into one Linear -- projections of one input as one GEMM -- or None where
        they cannot be: different forms or K, FP4, or an FP8 part whose rows do not fill its 128-row scale
        blocks (the stacked scale rows would then straddle two parts)."""
        f, k = parts[0].fmt, parts[0].in_features
        if f == "fp4" or any(p.fmt != f or p.in_features != k for p in parts):
            return None
        if f == "fp8" and any(p.out_features % 128 for p in parts):
            return None
        return Linear(torch.cat([p.weight for p in parts]),
                      None if f == "float" else torch.cat([p.scale for p in parts]), f)

    def rows(self, lo: int, hi: int) -> "Linear":
        """Output rows lo:hi as a Linear over views (no copy); FP8: lo and hi on 128-row scale blocks."""
        if self.scale is None:
            return Linear(self.weight[lo:hi], None, self.fmt)
        if self.fmt == "fp8":
            return Linear(self.weight[lo:hi], self.scale[lo // 128:-(-hi // 128)], self.fmt)
        return Linear(self.weight[lo:hi], self.scale[lo:hi], self.fmt)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + (
            self.scale.numel() * self.scale.element_size() if self.scale is not None else 0)


class WeightSource:
    """Hands each module its tensors by official name, converted for the chosen numerics.

    `state` maps official names to tensors as `load_state` returns them: FP8 as float8_e4m3fn, FP4 as
    packed int8, scales already decoded to float32, floats as stored.
    """

    def __init__(self, state: dict, numerics: Numerics, device: torch.device | str):
        self.state, self.numerics, self.device = state, numerics, torch.device(device)
        self.taken: set[str] = set()

    def raw(self, name: str) -> torch.Tensor:
        self.taken.add(name)
        return self.state[name].to(self.device)

    def f32(self, name: str) -> torch.Tensor:
        """Norm weights, hc_*, ape, attn_sink, gate weight/bias, LM head: float32 as the official code."""
        return self.raw(name).float()

    def compute(self, name: str) -> torch.Tensor:
        return self.raw(name).to(self.numerics.dtype)

    def stored_float(self, prefix: str) -> torch.Tensor:
        """`prefix.weight` of a projection the model computes in float32 (the compressor's), at the precision
        the checkpoint stores it: a float weight as stored (bf16 -> float32 is exact, so the kernels upcast
        per tile instead of the engine holding an fp32 copy), a quantised one dequantised to float32."""
        w = self.raw(prefix + ".weight")
        if w.is_floating_point() and w.dtype != torch.float8_e4m3fn:
            return w
        return self.linear(prefix, force_float=True, dtype=torch.float32).weight

    def linear(self, prefix: str, force_float: bool = False, dtype: torch.dtype | None = None) -> Linear:
        """The Linear at `prefix` (`prefix.weight` and, when quantised, `prefix.scale`)."""
        w = self.raw(prefix + ".weight")
        dtype = dtype or self.numerics.dtype
        if w.dtype == torch.float8_e4m3fn:
            lin = Linear(w, self.raw(prefix + ".scale").float(), "fp8")
        elif w.dtype in (torch.int8, torch.uint8):
            lin = Linear(w.view(torch.int8), self.raw(prefix + ".scale").float(), "fp4")
        else:
            return Linear(w.to(dtype), None, "float")
        if force_float or not self.numerics.official:
            return Linear(lin.dequantized(dtype), None, "float")
        return lin
