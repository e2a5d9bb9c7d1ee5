"""Ops the model calls through one seam: `from deepinfer.ops import ops; ops.rms_norm(...)`."""

from deepinfer.ops.registry import REGISTRY, BackendError, Dispatcher, default_backend, ops

__all__ = ["REGISTRY", "BackendError", "Dispatcher", "default_backend", "ops"]
