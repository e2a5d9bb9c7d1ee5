"""RoPE tables: cos/sin per absolute position for the two rope types of V4.

`main` (sliding-window layers): theta = rope_theta, no YaRN. `compress` (CSA/HCA layers and their
compressors and indexer): theta = compress_rope_theta with YaRN from the config, without mscale.
"""

from __future__ import annotations

import math

import torch

from deepinfer.config import ModelConfig
from deepinfer.ops import ops


def yarn_inv_freq(dim: int, base: float, factor: float, original_seq_len: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """RoPE inverse frequencies [dim/2] with YaRN interpolation when original_seq_len > 0 (no mscale)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


class RopeTables:
    """cos/sin of both rope types, gathered by position: one [max_pos, 2, rope_head_dim/2] float32 table per
    type (cos then sin of a position side by side), so a step's cos and sin are one gather, not two."""

    def __init__(self, cfg: ModelConfig, max_pos: int, device):
        rd = cfg.rope_head_dim
        t = torch.arange(max_pos, dtype=torch.float32)
        self.tables = {}
        for kind, base, yarn in (("main", cfg.rope_theta, False), ("compress", cfg.compress_rope_theta, True)):
            inv = yarn_inv_freq(rd, base, cfg.rope_factor, cfg.original_seq_len if yarn else 0,
                                cfg.beta_fast, cfg.beta_slow)
            ang = torch.outer(t, inv)
            self.tables[kind] = torch.stack([ang.cos(), ang.sin()], 1).to(device)
        self.max_pos = max_pos

    def get(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] int64 -> (cos, sin) [B, S, R/2], views of one gathered [B, S, 2, R/2]."""
        cs = self.tables[kind][positions]
        return cs[..., 0, :], cs[..., 1, :]


def rope_kind(attn_kind: str) -> str:
    return "main" if attn_kind == "swa" else "compress"


def rope_tail_(x: torch.Tensor, rd: int, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rd` dims of x [..., d] in place and return x (V4 puts the RoPE dims last).

    x must be a fresh activation (not a view of a weight or cache). In place because the concatenation
    form (`cat([x[..., :-rd], rope(x[..., -rd:])])`) copied the whole tensor: at prefill the [T, 64, 512]
    query and attention output, a visible share of a flash prefill (docs/perf-log.md, "Transposed FP4 expert
    GEMM, prefill mHC and RoPE, short-context top-k")."""
    tail = x[..., -rd:]
    ops.rope(tail, cos, sin, inverse=inverse, out=tail)  # backends rotate it where it lies (no copies)
    return x
