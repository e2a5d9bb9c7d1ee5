"""Measured rates of the device this process runs on: copy bandwidth and dense matmul FLOP/s.

The floors of `deepinfer bench` (`deepinfer.bench.floor`), the per-op roofline of `deepinfer bench
--profile` and `deepinfer ab --bench` are all held against these numbers, measured here rather than
taken from a spec sheet, so a ratio of 1.0 means "as fast as this device moved bytes / multiplied
matrices in this process".
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA, where every op is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, iters: int) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def _copy_seconds(nbytes: int, device: torch.device, iters: int) -> float:
    """Seconds per device-to-device copy of an `nbytes` uint8 tensor. The two buffers live only in this
    frame, so they are freed on return, before the caller measures anything else."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return _timed(lambda: dst.copy_(src), device, iters)


def measure_bandwidth(device: torch.device) -> float:
    """Copy bandwidth in bytes/s: (read + written) bytes / time of a large tensor copy on `device`
    (2 GiB on GPU, 256 MiB on CPU: both far past the caches)."""
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    s = _copy_seconds(nbytes, device, 10 if device.type == "cuda" else 3)
    return 2 * nbytes / s


def measure_matmul(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, what was measured): 8192^3 bf16 on GPU, 1024^3 fp32 on CPU."""
    n, dt = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    s = _timed(lambda: a @ b, device, 10 if device.type == "cuda" else 3)
    return 2 * n**3 / s, f"{n}^3 {str(dt).removeprefix('torch.')} matmul"


def measure_fp8_matmul(device: torch.device) -> float | None:
    """FP8 e4m3 FLOP/s of an 8192^3 `torch._scaled_mm` (cuBLASLt, bf16 out): the ceiling the FP8/FP4
    GEMMs are held against. None off CUDA or where `_scaled_mm` refuses (no FP8 MMA on this GPU)."""
    if device.type != "cuda":
        return None
    n = 8192
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        s = _timed(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device, 10)
    except (RuntimeError, TypeError):
        return None
    return 2 * n**3 / s
