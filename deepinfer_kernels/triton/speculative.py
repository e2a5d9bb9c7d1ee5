"""Speculative decoding's sampling ops: `spec_probs` (the distribution `sample` draws from, as probabilities)
and `spec_verify` (acceptance, residual draw, bonus token), one program per row, capture-safe (grids from
shapes, no host reads; the wrappers allocate with torch.empty and the kernels write every element).

spec_probs, temperature > 0: pass 1 the online max m and softmax denominator Z of s = x / t (div_rn, as the
reference); rows with a top-k / top-p cut find the smallest sort key whose token is kept by binary search
over the 63-bit keys (`_common.sort_key`: value, then lower index: the reference's stable descending order):
key > mid counted and their probability mass summed per step -- up to 63 passes over the row, latency the
`sample` kernel's histogram avoids, acceptable for a first version (it runs K + 1 rows per sequence and
step); then the kept mass and the normalised probabilities. Rows without a cut keep everything (2 passes).
temperature == 0: one-hot of the argmax (first index on ties).

spec_verify: the K acceptance tests read two values per draft; then one pass sums the residual
max(0, p_n - q_n) (p_K for the bonus) and one takes its Gumbel-max with the hash noise of the reference
(float64 log of the residual plus `_gumbel`), first index on ties. Same tokens as the reference up to the
last bit of a float64 log (no mismatch seen in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.reference import ACCEPT_SALT
from deepinfer.ops.registry import implement

from ._common import p2, pdl, pdl_wait, sort_key
from .sampling import _argmax_row, _gumbel, _hash32, _scaled

_BLOCK = 2048


@triton.jit
def _spec_probs_kernel(l_ptr, temp_ptr, topk_ptr, topp_ptr, out_ptr, V, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    r = tl.arange(0, BLOCK)
    if temp > 0:
        t = tl.maximum(temp, 1e-5)
        top_k = tl.load(topk_ptr + row).to(tl.int64)
        top_p = tl.load(topp_ptr + row).to(tl.float32)
        top_p = tl.where(top_p >= 1.0, float("inf"), top_p)  # >= 1: no nucleus cut (the reference's rule)
        k_eff = tl.where(top_k > 0, top_k, V + 1)
        mv = tl.full([BLOCK], float("-inf"), tl.float32)
        zv = tl.zeros([BLOCK], tl.float32)
        kmax = tl.full([], -1, tl.int64)
        for v0 in range(0, V, BLOCK):
            v = v0 + r
            s = _scaled(l_ptr, row, V, v, t)
            mn = tl.maximum(mv, s)
            alpha = tl.where(mv == mn, 1.0, tl.exp(mv - mn))
            zv = zv * alpha + tl.where(s == mn, 1.0, tl.exp(s - mn))
            zv = tl.where(mn == float("-inf"), 0.0, zv)
            mv = mn
            kmax = tl.maximum(kmax, tl.max(tl.where(v < V, sort_key(s, v), -1), 0))
        m = tl.max(mv, 0)
        Z = tl.sum(tl.where(mv > float("-inf"), zv * tl.exp(mv - m), 0.0), 0)
        thr = tl.full([], 0, tl.int64)
        if (k_eff <= V) | (top_p < float("inf")):
            lo = tl.full([], 0, tl.int64)
            hi = tl.full([], 9223372036854775807, tl.int64)
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
                okb = (tl.sum(cnt, 0) < k_eff) & (tl.sum(mass, 0) < top_p)
                hi = tl.where(okb, mid, hi)
                lo = tl.where(okb, lo, mid + 1)
            thr = tl.minimum(lo, kmax)  # the first token is always kept
        zk = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            v = v0 + r
            s = _scaled(l_ptr, row, V, v, t)
            zk += tl.where((v < V) & (sort_key(s, v) >= thr), tl.exp(s - m), 0.0)
        zkept = tl.sum(zk, 0)
        for v0 in range(0, V, BLOCK):
            v = v0 + r
            s = _scaled(l_ptr, row, V, v, t)
            pr = tl.where(sort_key(s, v) >= thr, tl.exp(s - m) / zkept, 0.0)
            tl.store(out_ptr + row * V + v, pr, mask=v < V)
    else:
        a = _argmax_row(l_ptr, row, V, BLOCK)
        for v0 in range(0, V, BLOCK):
            v = v0 + r
            tl.store(out_ptr + row * V + v, tl.where(v == a, 1.0, 0.0), mask=v < V)


@implement("spec_probs", "triton")
def spec_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
               ) -> torch.Tensor:
    B, V = logits.shape
    out = torch.empty(B, V, dtype=torch.float32, device=logits.device)
    if B:
        _spec_probs_kernel[(B,)](logits.contiguous(), temperature.float().contiguous(), top_k.contiguous(),
                                 top_p.float().contiguous(), out, V, BLOCK=min(p2(V), _BLOCK), num_warps=8, **pdl())
    return out


@triton.jit
def _spec_verify_kernel(p_ptr, q_ptr, d_ptr, seed_ptr, pos_ptr, n_ptr, tok_ptr, K, V, SALT: tl.constexpr,
                        BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos0 = tl.load(pos_ptr + row).to(tl.int64)
    n = tl.full([], 0, tl.int64)
    going = tl.full([], 1, tl.int64)
    for j in range(0, K):
        d = tl.load(d_ptr + row * K + j).to(tl.int64)
        pd = tl.load(p_ptr + (row * (K + 1) + j) * V + d).to(tl.float64)
        qd = tl.load(q_ptr + (row * K + j) * V + d).to(tl.float64)
        ctr = (seed * 0x9E3779B1 + (pos0 + j) * 0x85EBCA77) & 0xFFFFFFFF
        u = (_hash32(_hash32(ctr) ^ SALT).to(tl.float64) + 0.5) / 4294967296.0
        going = going * (u * qd <= pd).to(tl.int64)
        n += going
    has_q = n < K
    prow = p_ptr + (row * (K + 1) + n) * V
    qrow = q_ptr + (row * K + tl.minimum(n, K - 1)) * V
    r = tl.arange(0, BLOCK)
    tot = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        pv = tl.load(prow + v, mask=v < V, other=0.0).to(tl.float32)
        qv = tl.load(qrow + v, mask=(v < V) & has_q, other=0.0).to(tl.float32)
        tot += tl.maximum(pv - qv, 0.0)
    use_resid = tl.sum(tot, 0) > 0
    hc = _hash32((seed * 0x9E3779B1 + (pos0 + n) * 0x85EBCA77) & 0xFFFFFFFF)
    best = tl.full([], float("-inf"), tl.float64)
    b_idx = tl.full([], 0, tl.int64)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        pv = tl.load(prow + v, mask=v < V, other=0.0).to(tl.float32)
        qv = tl.load(qrow + v, mask=(v < V) & has_q, other=0.0).to(tl.float32)
        w = tl.where(use_resid, tl.maximum(pv - qv, 0.0), pv).to(tl.float64)
        val = tl.where((v < V) & (w > 0), tl.log(w) + _gumbel(hc, v), float("-inf"))
        bm = tl.max(val, 0)
        bi = tl.argmax(val, 0).to(tl.int64) + v0
        take = bm > best
        b_idx = tl.where(take, bi, b_idx)
        best = tl.where(take, bm, best)
    tl.store(n_ptr + row, n)
    tl.store(tok_ptr + row, b_idx)


@implement("spec_verify", "triton")
def spec_verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, K1, V = p.shape
    n = torch.empty(B, dtype=torch.int64, device=p.device)
    tok = torch.empty(B, dtype=torch.int64, device=p.device)
    if B:
        _spec_verify_kernel[(B,)](p.float().contiguous(), q.float().contiguous(), drafts.long().contiguous(),
                                  seeds.long().contiguous(), positions.long().contiguous(), n, tok, K1 - 1, V,
                                  SALT=ACCEPT_SALT, BLOCK=min(p2(V), _BLOCK), num_warps=8, **pdl())
    return n, tok
