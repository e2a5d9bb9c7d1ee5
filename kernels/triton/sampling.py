"""Sampling (top-k / top-p Gumbel-max with the reference's counter-based hash noise) and logprobs.

sample: one program per row, streaming the vocabulary in BLOCK chunks (no sort of the row):
  1. max, then the softmax denominator Z of the temperature-scaled logits, and the greedy argmax;
  2. the kept set is the prefix, in the reference's stable descending order, of tokens i with
     rank(i) < top_k and mass-above(i) < top_p. Ranks come from distinct 63-bit keys (value, then
     lower index: `_common.sort_key`), and both conditions are monotone in the key, so the kept set is
     {i : key_i >= c*}; c* is found by a binary search over the key space (<= 63 streaming passes of
     count / mass of keys above a candidate);
  3. Gumbel-max over the kept set with the reference's hash noise in float64, first index on ties.
The noise and the kept set equal the reference's bit for bit except where the reference's sequential
cumsum and this kernel's blocked sum of probabilities round differently at the top-p boundary
(an O(1e-7) window on `top_p`). A radix select (4 passes of 256-bin count/mass histograms) can replace
the binary search once this runs on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import p2, sort_key

MASK32 = 0xFFFFFFFF


@triton.jit
def _hash32(x):
    x = x & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x2C1B3C6D) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _scaled(l_ptr, row, V, v, t):
    x = tl.load(l_ptr + row * V + v, mask=v < V, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(x, t)


@triton.jit
def _sample_kernel(l_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, out_ptr, V,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    t = tl.maximum(temp, 1e-5)
    top_k = tl.load(topk_ptr + row).to(tl.int64)
    top_p = tl.load(topp_ptr + row).to(tl.float32)
    r = tl.arange(0, BLOCK)
    # pass 1: max of scaled logits, greedy argmax of the raw logits, the top key
    m = tl.full([], float("-inf"), tl.float32)
    g_best = tl.full([], float("-inf"), tl.float32)
    g_idx = tl.full([], 0, tl.int64)
    kmax = tl.full([], -1, tl.int64)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        raw = tl.load(l_ptr + row * V + v, mask=v < V, other=float("-inf")).to(tl.float32)
        s = tl.math.div_rn(raw, t)
        m = tl.maximum(m, tl.max(s, 0))
        bm = tl.max(raw, 0)
        bi = tl.argmax(raw, 0).to(tl.int64) + v0
        take = bm > g_best
        g_idx = tl.where(take, bi, g_idx)
        g_best = tl.where(take, bm, g_best)
        kmax = tl.maximum(kmax, tl.max(tl.where(v < V, sort_key(s, v), -1), 0))
    # pass 2: softmax denominator
    z = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        s = _scaled(l_ptr, row, V, v, t)
        z += tl.where(v < V, tl.exp(s - m), 0.0)
    Z = tl.sum(z, 0)
    # binary search for the smallest key threshold c with count(key > c) < k and mass(key > c) < top_p
    k_eff = tl.where(top_k > 0, top_k, V + 1)
    lo = tl.full([], 0, tl.int64)
    hi = tl.full([], 9223372036854775807, tl.int64)
    if temp > 0:
        while lo < hi:
            mid = lo + (hi - lo) // 2
            cnt = tl.zeros([BLOCK], tl.int32)
            mass = tl.zeros([BLOCK], tl.float32)
            for v0 in range(0, V, BLOCK):
                v = v0 + r
                s = _scaled(l_ptr, row, V, v, t)
                above = (v < V) & (sort_key(s, v) > mid)
                cnt += above.to(tl.int32)
                mass += tl.where(above, tl.exp(s - m) / Z, 0.0)
            ok = (tl.sum(cnt, 0) < k_eff) & (tl.sum(mass, 0) < top_p)
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
    thr = tl.minimum(lo, kmax)  # the top token is always kept
    # pass 3: Gumbel-max over the kept set, float64, first index on ties
    ctr = (tl.load(seed_ptr + row).to(tl.int64) * 0x9E3779B1
           + tl.load(pos_ptr + row).to(tl.int64) * 0x85EBCA77) & 0xFFFFFFFF
    hc = _hash32(ctr)
    best = tl.full([], float("-inf"), tl.float64)
    b_idx = tl.full([], 0, tl.int64)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        s = _scaled(l_ptr, row, V, v, t)
        keep = (v < V) & (sort_key(s, v) >= thr)
        h = _hash32(hc ^ v.to(tl.int64))
        u = (h.to(tl.float64) + 0.5) / 4294967296.0
        gmb = -tl.log(-tl.log(u))
        val = tl.where(keep, s.to(tl.float64), float("-inf")) + gmb
        val = tl.where(v < V, val, float("-inf"))
        bm = tl.max(val, 0)
        bi = tl.argmax(val, 0).to(tl.int64) + v0
        take = bm > best
        b_idx = tl.where(take, bi, b_idx)
        best = tl.where(take, bm, best)
    tl.store(out_ptr + row, tl.where(temp > 0, b_idx, g_idx))


@implement("sample", "triton")
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    _sample_kernel[(B,)](logits.contiguous(), temperature.float().contiguous(), top_k.contiguous(),
                         top_p.float().contiguous(), seeds.contiguous(), positions.contiguous(), out, V,
                         BLOCK=min(p2(V), 4096))
    return out


@triton.jit
def _logprobs_kernel(x_ptr, y_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        mv = tl.maximum(mv, tl.load(x_ptr + row * V + v, mask=v < V, other=float("-inf")).to(tl.float32))
    m = tl.max(mv, 0)
    z = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        x = tl.load(x_ptr + row * V + v, mask=v < V, other=float("-inf")).to(tl.float32)
        z += tl.where(v < V, tl.exp(x - m), 0.0)
    lz = tl.log(tl.sum(z, 0))
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        x = tl.load(x_ptr + row * V + v, mask=v < V, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * V + v, x - m - lz, mask=v < V)


@implement("logprobs", "triton")
def logprobs(logits: torch.Tensor) -> torch.Tensor:
    V = logits.size(-1)
    x = logits.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // max(V, 1)
    if rows:
        _logprobs_kernel[(rows,)](x, y, V, BLOCK=min(p2(V), 4096))
    return y
