"""Random weights directly in the official storage formats, generated on the target device.

For benchmarks of shapes we have no checkpoint for (`deepinfer bench --preset flash-slice:4`): no
float-weight-then-quantise pass, so a 20 GB slice is generated on a GPU in seconds. The output is
exactly what `load_state` returns for a real checkpoint: {official name: tensor} with

* fp8 linears: float8_e4m3fn [N, K] + `.scale` float32 [ceil(N/128), ceil(K/128)] (powers of two),
* fp4 linears: int8 [N, K/2] (two random e2m1 codes per byte) + `.scale` float32 [N, K/32],
* floats: bf16, or fp32 for the tensors the release stores in fp32 (ape, attn_sink, hc_*, gate.bias),
* `tid2eid`: int64 [vocab, k], k distinct experts per row.

Spreads: dequantised linears have std ~ fan_in^-0.5 (within ~1.5x; scales are random powers of two
around the target), floats follow `deepinfer.tiny`'s rules, so activations stay O(1) and routing is
spread over the experts like a trained model's load-balanced router (which the bench's floors assume).
Deterministic for a (device type, seed): one `torch.Generator(device)` consumed in schema order.
"""

from __future__ import annotations

import math
import re

import torch

from deepinfer.checkpoint.reader import scale_name
from deepinfer.checkpoint.random_init import float_init
from deepinfer.checkpoint.schema import FP4_BLOCK, FP8_BLOCK, TensorSpec, expected_tensors, fp32_in_release
from deepinfer.config import ModelConfig

_FP8_STD = 0.75  # e4m3 payload std; x random pow2 scales (mean square factor 1.75) gives ~1.0 x target
_FP4_RMS = math.sqrt(68.5 / 8)  # rms of a uniformly random e2m1 code (|v| in 0, .5, 1, 1.5, 2, 3, 4, 6)
_EXPERT = re.compile(r"(.*\.experts\.)(\d+)\.(w[123])\.weight")


def _pow2_scales(shape: tuple, target: float, g: torch.Generator, device) -> torch.Tensor:
    """float32 powers of two 2^(round(log2 target) + {-1, 0, 1}), shape `shape`."""
    e0 = round(math.log2(target))
    r = torch.randint(-1, 2, shape, generator=g, device=device, dtype=torch.int32)
    return torch.exp2((r + e0).float())


def _fp8(spec: TensorSpec, g, device, lead: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [*lead, N, K], float32 scale [*lead, ceil(N/128), ceil(K/128)])."""
    n, k = spec.shape
    w = (torch.randn(lead + (n, k), generator=g, device=device) * _FP8_STD).to(torch.float8_e4m3fn)
    s = _pow2_scales(lead + (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), k**-0.5, g, device)
    return w, s


def _fp4(spec: TensorSpec, g, device, lead: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [*lead, N, K/2] random code pairs, float32 scale [*lead, N, K/32])."""
    n, k = spec.shape
    w = torch.randint(-128, 128, lead + (n, k // 2), generator=g, device=device, dtype=torch.int8)
    s = _pow2_scales(lead + (n, k // FP4_BLOCK), k**-0.5 / (_FP4_RMS * 1.32), g, device)
    return w, s


@torch.no_grad()
def random_state(cfg: ModelConfig, device="cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of `expected_tensors(cfg)` (+ `.scale` siblings), random, on `device`.

    Routed experts of one layer and matrix (w1/w2/w3) are generated as one [E, ...] tensor and handed
    out as views, so a layer costs three kernel launches, not 3 x E.
    """
    device = torch.device(device)
    g = torch.Generator(device).manual_seed(seed)
    specs = expected_tensors(cfg)
    fmt = {"fp8": _fp8, "fp4": _fp4}
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if name in out:
            continue  # an expert generated with its layer
        m = _EXPERT.fullmatch(name)
        if m and spec.kind in fmt:
            ws, ss = fmt[spec.kind](spec, g, device, lead=(cfg.n_routed_experts,))
            for e in range(cfg.n_routed_experts):
                n = f"{m[1]}{e}.{m[3]}.weight"
                out[n], out[scale_name(n)] = ws[e], ss[e]
        elif spec.kind in fmt:
            out[name], out[scale_name(name)] = fmt[spec.kind](spec, g, device)
        elif spec.kind == "int":  # tid2eid: k distinct experts per token = top-k of uniform noise
            noise = torch.rand(spec.shape[0], cfg.n_routed_experts, generator=g, device=device)
            out[name] = noise.topk(spec.shape[1], dim=1).indices.to(torch.int64)
        else:
            std, mean = float_init(name, spec.shape, cfg.dim)
            t = torch.randn(spec.shape, generator=g, device=device) * std + mean
            out[name] = t if fp32_in_release(name) else t.to(torch.bfloat16)
    order = []  # expected_tensors order, each scale right after its weight (as load_state returns)
    for name, spec in specs.items():
        order += [name, scale_name(name)] if spec.kind in fmt else [name]
    return {n: out[n] for n in order}
