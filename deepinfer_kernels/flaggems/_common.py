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
        first = (str(e).strip().splitlines() or [""])[0][:200]
        _failed[module] = f"{module} failed to import: {type(e).__name__}: {first}"
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


_broken: dict = {}  # (op, key) -> why FlagGems failed there: later calls go straight to the reference


def run(op: str, key: tuple, kernel, fallback):
    """kernel() -- a FlagGems call -- or, where it raises (a Triton compile out of resources, an assert on a shape
    FlagGems does not take), the reference `fallback()` for this and every later call with the same `key`, through
    `ops.runtime_fallback` naming the op, the key and the error (an error under --strict)."""
    k = (op, key)
    if k not in _broken:
        try:
            return kernel()
        except Exception as e:  # noqa: BLE001  (Triton and FlagGems raise many types; the message is what matters)
            first = (str(e).strip().splitlines() or [""])[0][:300]
            _broken[k] = f"FlagGems failed for {key}: {type(e).__name__}: {first}"
    ops.runtime_fallback(op, _broken[k])
    return fallback()
