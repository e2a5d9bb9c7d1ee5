"""What every timing of `deepinfer bench` runs on: the same random prompts for the engine, its `--against`
configurations and the transformers peer, and the warm-up steps before a timed run."""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig

WARMUP_STEPS = 2  # untimed steps before each timed run: first-call costs (compiles, allocator growth) stay out


def random_prompts(cfg: ModelConfig, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] int64 token ids drawn uniformly from 2..vocab-1 on the CPU, the same for the same
    seed: the engine and the transformers peer time the same prompts."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, cfg.vocab_size, (rows, length), generator=g)
