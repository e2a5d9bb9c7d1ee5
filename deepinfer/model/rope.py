"""RoPE tables: cos/sin per absolute position for the two rope types of V4.

`main` (sliding-window layers): theta = rope_theta, no YaRN. `compress` (CSA/HCA layers and their
compressors and indexer): theta = compress_rope_theta with YaRN from the config, without mscale.
"""

from __future__ import annotations

import torch

from deepinfer.config import ModelConfig
from deepinfer.ops.reference import yarn_inv_freq


class RopeTables:
    """cos/sin [max_pos, rope_head_dim/2] float32 for both rope types, gathered by position."""

    def __init__(self, cfg: ModelConfig, max_pos: int, device):
        rd = cfg.rope_head_dim
        t = torch.arange(max_pos, dtype=torch.float32)
        self.tables = {}
        for kind, base, yarn in (("main", cfg.rope_theta, False), ("compress", cfg.compress_rope_theta, True)):
            inv = yarn_inv_freq(rd, base, cfg.rope_factor, cfg.original_seq_len if yarn else 0,
                                cfg.beta_fast, cfg.beta_slow)
            ang = torch.outer(t, inv)
            self.tables[kind] = (ang.cos().to(device), ang.sin().to(device))
        self.max_pos = max_pos

    def get(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] int64 -> (cos, sin) [B, S, R/2]."""
        cos, sin = self.tables[kind]
        return cos[positions], sin[positions]


def rope_kind(attn_kind: str) -> str:
    return "main" if attn_kind == "swa" else "compress"
