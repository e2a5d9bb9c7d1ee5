"""Checkpoint I/O: open, validate and load V4 checkpoints (official or transformers layout); write them."""

from deepinfer.checkpoint.reader import (
    INDEX_NAME,
    Checkpoint,
    CheckpointError,
    expected_storage,
    load_state,
    mtp_layers_present,
    open_checkpoint,
    read_header,
    scale_name,
    validate,
)
from deepinfer.checkpoint.schema import TensorSpec, checkpoint_bytes, expected_tensors
from deepinfer.checkpoint.writer import write_checkpoint

__all__ = [
    "INDEX_NAME",
    "Checkpoint",
    "CheckpointError",
    "TensorSpec",
    "checkpoint_bytes",
    "expected_storage",
    "expected_tensors",
    "load_state",
    "mtp_layers_present",
    "open_checkpoint",
    "read_header",
    "scale_name",
    "validate",
    "write_checkpoint",
]
