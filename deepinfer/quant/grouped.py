"""Grouped products in plain PyTorch that the spec, the model and the kernel backends share (none of which may
import the others): the grouped projection V4's `wo_a` computes (each head group times its own weight), and the
row layout by expert that every backend's grouped expert GEMM runs on (`moe_align`).
"""

from __future__ import annotations

import torch


def grouped_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[t, g] = x[t, g] w[g]ᵀ: x [T, G, K] (any strides: read in place), w [G, R, K] in x's dtype -> [T, G, R]
    contiguous, one bmm over the groups (fp32 accumulate). The float `wo_a`, and `fp8_grouped_linear` on its
    dequantised weight."""
    y = torch.empty(x.size(0), x.size(1), w.size(1), dtype=x.dtype, device=x.device)
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=y.transpose(0, 1))
    return y


def align_max_blocks(P: int, E: int, block_m: int) -> int:
    """Upper bound on the blocks `moe_align` can use: Σ_e ceil(c_e / BM) with Σ c_e <= P and at most
    min(E, P) experts present is <= floor(P / BM) + min(E, P); each used block holds >= 1 row, so <= P."""
    return min(P, P // block_m + min(E, P))


def moe_align(e: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort rows by expert into blocks of `block_m`, without a host sync and with fixed output shapes.

    e [P] int (local expert ids; anything outside [0, n_experts) -- e.g. -1 -- is dropped) ->
    (sorted_rows [nb * block_m] int64, block_expert [nb] int64) with nb = align_max_blocks(P, E, BM).
    Block b covers sorted_rows[b*BM : (b+1)*BM]: rows of expert block_expert[b] in increasing row order
    (stable), padded with the value P; experts occupy consecutive blocks in id order; blocks past the
    last used one have block_expert -1 and rows P. Every row with a valid id appears exactly once.
    Pure torch (stable argsort, scatter_add counts, cumsum, searchsorted): usable by any backend.
    """
    P, E, BM = e.numel(), int(n_experts), int(block_m)
    dev = e.device
    nb = align_max_blocks(P, E, BM)
    e = e.reshape(-1).long()
    key = torch.where((e >= 0) & (e < E), e, torch.full_like(e, E))  # dropped rows sort last, bucket E
    order = torch.argsort(key, stable=True)
    skey = key[order]
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))[:E]
    blocks = (counts + BM - 1) // BM
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    row_start = torch.cumsum(counts, 0) - counts
    k = skey.clamp(max=E - 1)
    pos = blk_start[k] * BM + (torch.arange(P, device=dev) - row_start[k])
    pos = torch.where(skey < E, pos, torch.full_like(pos, nb * BM))  # dropped rows -> a dump slot
    sorted_rows = torch.full((nb * BM + 1,), P, dtype=torch.int64, device=dev).scatter_(0, pos, order)[:-1]
    block_expert = torch.searchsorted(blk_end, torch.arange(nb, device=dev, dtype=torch.int64), right=True)
    block_expert = torch.where(block_expert < E, block_expert, torch.full_like(block_expert, -1))
    return sorted_rows, block_expert


def repeat_rows(topk: int, e: torch.Tensor, *ts: torch.Tensor | None) -> tuple:
    """`grouped_gemm(topk=)`'s inputs in the per-pair form: each tensor's rows [T, ...] repeated topk times row by
    row ([T * topk, ...]; None stays None), for a kernel that gathers A per pair. e [T * topk] is checked."""
    for t in ts:
        if t is not None and t.size(0) * topk != e.numel():
            raise ValueError(f"grouped_gemm: e has {e.numel()} rows, a {t.size(0)} x topk {topk}")
    return tuple(None if t is None else t.repeat_interleave(topk, 0) for t in ts)
