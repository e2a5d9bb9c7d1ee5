"""Prefill-sized FP8 block-scaled GEMM through cuBLASLt (torch's `F.scaled_mm` with 1x128 / 128x128 scaling).

C[M, N] = A Wᵀ with A e4m3 [M, K] and its per-row, per-128-K scales, W e4m3 [N, K] with its 128x128 block scales:
the numerics of `fp8_gemm`. cuBLASLt (CUDA 12.9+) implements that scaling on Hopper (`VEC128_32F` for A,
`BLK128x128_32F` for W), promoting the tensor-core partials to fp32 per 128-K block as DeepGEMM does. At prefill
sizes it is faster than the Triton TMA kernel at every flash shape, near the FP8 rate the bench measures
(docs/perf-log.md, "Prefill FP8 GEMMs on cuBLASLt, fewer decode launches"). Its accumulation within a block is the
tensor core's, not fp32: against DeepSeek's own fp8_gemm (TileLang, fp32 accumulation) 6.9e-4 relative with 6.7 % of
the bf16 outputs one ulp off (M 4096, N 1536, K 4096, tools/official/check_kernels.py), where the exact Triton kernel
is 5e-6 / 0.001 %; through the FP8 re-quantisation of the next layer that grows to 1-8 % per layer against the
official modules. So it is opt-in (`DEEPINFER_FP8_GEMM=auto` or `cublas`; a faster prefill); the default `exact`
keeps every shape on the Triton kernels.

When it is used is decided from facts, never by catching an error: `unavailable(device)` names why not (the env switch,
no CUDA, a torch or CUDA without block-scaled `scaled_mm`, a GPU other than sm_90, where it was not measured) and
`shape_ok` the layout cuBLASLt takes: K a multiple of 512 (its scale rows in groups of four 128-K blocks), N a
multiple of 128, 16-byte-aligned operands, bf16 or fp32 output. `DEEPINFER_FP8_GEMM=triton` keeps every shape on the
Triton kernels (A/B runs, other GPUs); `=cublas` uses cuBLASLt on any CUDA GPU whose torch offers it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_M = 65
"""From this many rows on (`fp8_gemm`'s prefill path); decode sizes stay on the split-K Triton kernel."""

_MODES = ("exact", "exact-wgmma", "auto", "cublas", "triton")


def mode() -> str:
    """DEEPINFER_FP8_GEMM: exact (the Triton kernel, exact products summed in fp32), exact-wgmma (the same sums on
    f16 wgmma), auto (cuBLASLt on sm_90), cublas (on any CUDA GPU that has it) or triton (the Triton kernel,
    promotion per 128-K block)."""
    from deepinfer import settings

    return settings.choice("DEEPINFER_FP8_GEMM") or "exact"


def _cuda_version() -> tuple[int, int]:
    v = (torch.version.cuda or "0.0").split(".")
    return int(v[0]), int(v[1]) if len(v) > 1 else 0


@functools.lru_cache(maxsize=None)
def _unavailable(index: int, m: str) -> str | None:
    if m in ("triton", "exact", "exact-wgmma"):
        return f"DEEPINFER_FP8_GEMM={m}"
    if torch.version.hip is not None:
        return "ROCm build: no cuBLASLt"
    if _cuda_version() < (12, 9):
        return f"CUDA {torch.version.cuda}: block-scaled FP8 in cuBLASLt needs 12.9+"
    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise1x128"):
        return f"torch {torch.__version__} has no block-scaled F.scaled_mm"
    cap = torch.cuda.get_device_capability(index)
    if m == "auto" and cap != (9, 0):
        return (f"sm_{cap[0]}{cap[1]}: cuBLASLt's block-scaled FP8 GEMM was measured on sm_90 only "
                "(DEEPINFER_FP8_GEMM=cublas)")
    return None


def unavailable(device: torch.device) -> str | None:
    """Why `fp8_gemm` does not hand prefill-sized GEMMs on `device` to cuBLASLt; None when it does."""
    if device.type != "cuda":
        return "not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _unavailable(index, mode())


def used_for(device: torch.device) -> str:
    """What runs `fp8_gemm`'s prefill-sized GEMMs on `device`: "cublaslt", or "triton: <why not cuBLASLt>" (what
    `deepinfer bench`, `probe triton` and `ab` report)."""
    why = unavailable(device)
    return "cublaslt" if why is None else f"triton: {why}"


def shape_ok(a: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """A [M, K] and W [N, K] in the layout cuBLASLt's block-scaled GEMM takes, at prefill-sized M."""
    M, K = a.shape
    N = w.size(0)
    return (M >= MIN_M and K % 512 == 0 and N % 128 == 0 and out_dtype in (torch.bfloat16, torch.float32)
            and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def fp8_gemm_block_scaled(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """C [M, N] out_dtype from contiguous a [M, K] e4m3, a_s [M, K/128] f32, w [N, K] e4m3, w_s [N/128, K/128] f32.

    cuBLASLt wants A's scales K-block-major ([K/128, M] memory, 16-byte columns: M padded to a multiple of 4) and
    W as the column-major B of a TN GEMM (Wᵀ, a view). A ragged M gets zero rows (scale 1) appended and the
    result's first M rows are returned: a contiguous view."""
    M, K = a.shape
    Mp = -(-M // 4) * 4
    s = torch.empty(K // 128, Mp, dtype=torch.float32, device=a.device)
    s[:, :M].copy_(a_s.t())
    if Mp != M:
        a = torch.cat([a, a.new_zeros(Mp - M, K)])
        s[:, M:].fill_(1.0)
    c = F.scaled_mm(a, w.t(), s.t(), F.ScalingType.BlockWise1x128, w_s.t(), F.ScalingType.BlockWise128x128,
                    output_dtype=out_dtype)
    return c[:M] if Mp != M else c
