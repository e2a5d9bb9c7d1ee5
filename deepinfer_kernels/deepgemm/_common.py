"""The one place deep_gemm is imported from (on the first kernel call, under the tensor's device), and the checks
and caches every wrapper shares."""

from __future__ import annotations

import importlib

import torch

from deepinfer.ops import ops

_mod: list = []
_failed: list[str] = []


def dg(device: torch.device):
    """deep_gemm, imported on first use under `torch.cuda.device(device)`; None when the import fails (`why()`)."""
    if _mod:
        return _mod[0]
    if _failed:
        return None
    try:
        with torch.cuda.device(device):
            m = importlib.import_module("deep_gemm")
    except Exception as e:  # a build for another torch / CUDA fails at import with many error types
        first = (str(e).strip().splitlines() or [""])[0][:200]
        _failed.append(f"deep_gemm failed to import: {type(e).__name__}: {first}")
        return None
    _mod.append(m)
    return m


def why() -> str:
    return _failed[0] if _failed else ""


def off_contract(op: str, reason: str, ref, *args, **kwargs):
    """Run the reference for this call, visibly (`ops.runtime_fallback`: an error under --strict)."""
    ops.runtime_fallback(op, reason)
    return ref(*args, **kwargs)


def sm90(t: torch.Tensor) -> str:
    """"" where DeepGEMM's SM90 kernels can run on t's device, else why not."""
    if t.device.type != "cuda":
        return f"DeepGEMM runs on CUDA, not {t.device}"
    cap = torch.cuda.get_device_capability(t.device)
    if cap[0] != 9:
        return f"this adapter drives DeepGEMM's SM90 kernels (fp32 scales); the device is sm_{cap[0]}{cap[1]}"
    return ""


def f32_block_scales(w_s: torch.Tensor) -> torch.Tensor:
    """A weight's 128 x 128 block scales as DeepGEMM's SM90 path takes them: contiguous fp32 (ue8m0 bytes decoded
    exactly, once per scale tensor: kept on the tensor object, as weights are not modified in place)."""
    got = getattr(w_s, "_deepinfer_dg_f32", None)
    if got is None:
        from deepinfer.quant.formats import scale_f32

        got = scale_f32(w_s, "DeepGEMM weight scales").float().contiguous()
        w_s._deepinfer_dg_f32 = got
    return got


def requantised(w: torch.Tensor, w_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 weights (int8 e2m1 pairs [..., N, K/2], per-32 scales) as FP8 e4m3 with fp32 per-128 block scales
    (`deepinfer.quant.requant.requant_fp4`), computed once per weight and kept on it; a lossy requantisation is
    announced once with its measured error (never silent)."""
    got = getattr(w, "_deepinfer_dg_fp8", None)
    if got is None:
        import sys

        from deepinfer.quant.requant import requant_fp4

        w8, sc, rep = requant_fp4(w.view(torch.int8), w_s)
        if not rep.lossless:
            print(f"deepinfer: deepgemm requantised an FP4 weight {list(rep.shape)} to per-128 FP8 with "
                  f"{rep.lossy_values} values changed (rel err {rep.rel_err:.3g}; `deepinfer probe requant`)",
                  file=sys.stderr)
        got = w._deepinfer_dg_fp8 = (w8.contiguous(), sc.contiguous())
    return got
