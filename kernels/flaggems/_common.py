"""The one place flag_gems is imported from (lazily, on the device of the first tensor a kernel sees), and the
helper every wrapper uses to fall back visibly."""

from __future__ import annotations

import importlib

import torch

from deepinfer.ops import ops

_mods: dict[str, object] = {}
_failed: dict[str, str] = {}


def fg(module: str = "flag_gems", device: torch.device | None = None):
    """flag_gems (or one of its modules, e.g. `flag_gems.fused.mhc`), imported on first use under
    `torch.cuda.device(device)`, so the CUDA context its import creates is on the device the run chose.
    None when the import fails; the reason is in `why(module)`."""
    if module in _mods:
        return _mods[module]
    if module in _failed:
        return None
    try:
        if device is not None and device.type == "cuda":
            with torch.cuda.device(device):
                m = importlib.import_module(module)
        else:
            m = importlib.import_module(module)
    except Exception as e:  # a wheel built for another torch fails at import with many error types
        _failed[module] = f"{module} failed to import: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        return None
    _mods[module] = m
    return m


def why(module: str) -> str:
    return _failed.get(module, "")


def off_contract(op: str, reason: str, ref, *args, **kwargs):
    """Run the reference for this call, visibly: `ops.runtime_fallback` (an error under --strict)."""
    ops.runtime_fallback(op, reason)
    return ref(*args, **kwargs)


def cuda(*ts) -> bool:
    return all(t.device.type == "cuda" for t in ts)
