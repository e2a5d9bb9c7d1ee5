"""Sampling (top-k / top-p Gumbel-max with the reference's counter-based hash noise), logprobs, and the guided-decoding
token bitmask (`apply_token_bitmask`: -inf where a packed int32 bitmask forbids a token).

sample: one program per row (the row is L2-resident after the first pass), runtime branch on the
row's temperature:
  * temperature == 0: one streaming argmax over the raw logits (first index on ties, as torch.argmax)
    -- a single read of the row, nothing else.
  * temperature > 0 (4 streaming passes, where a binary search takes up to 63; top_p >= 1 means no nucleus
    cut, and with no top-k either, passes 2-3 are skipped and every token is kept):
    1. online max m and softmax denominator Z of the scaled logits s = x / t (div_rn as the reference);
    2. a 256-bin count+mass histogram of q = floor((m - s) * 2048) >> 8 (bins of width 1/8 in m - s,
       monotone in s, so every bin is a contiguous run of the reference's stable descending order and
       never splits a tie). The histogram is one tensor-core dot per block: a [16, BLOCK] one-hot of
       the bin's high nibble times a [BLOCK, 64] one-hot of the low nibble weighted by the probability
       split into three tf32-exact pieces (+ a count column), so the products are exact and the sums
       are plain fp32 sums (only the summation order differs from a sequential sum). From the inclusive
       cumsums the boundary bin b* is the last bin whose first token is kept (count above < k and mass
       above < top_p: the reference's keep rule, monotone in the order);
    3. the same 256-bin histogram on the low byte of q inside bin b* gives the boundary sub-bin q*
       (width 1/2048 in m - s: typically a handful of tokens);
    4. one pass takes the Gumbel-max over every token with q < q* (all kept) and appends the keys of
       the q == q* tokens to a workspace (prefix-sum compaction, deterministic). Those candidates are
       sorted (distinct 63-bit keys: value then lower index, `_common.sort_key`), their exact keep
       flags come from count/mass-above = the bins above + an fp32 prefix sum in sorted order, and the
       kept ones join the Gumbel-max. More than CAND candidates (massive ties) fall back to the exact
       binary search over the candidate keys only.
    Tokens with m - s >= 31.875 (the last level-1 bin) can never win the Gumbel-max (the hash noise
    lies in [-3.14, 22.88], a range of 26.02 < 31.875, and the top token is always kept), so when the
    cut falls there the whole row is treated as kept: same sample.
The noise and the kept set equal the reference's bit for bit except where the reference's sequential
cumsum and this kernel's blocked fp32 sums of probabilities round differently at the top-p boundary
(an O(1e-7) window on `top_p`), as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.registry import implement

from ._common import cdiv
from ._common import INTERPRET as _INTERPRET
from ._common import key_index, p2, pdl, pdl_wait, sort_key, tf32_hi

MASK32 = 0xFFFFFFFF
CAND = 256  # candidates of the boundary sub-bin resolved in registers (more: binary-search fallback)


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
def _gumbel(hc, v):
    h = _hash32(hc ^ v.to(tl.int64))
    u = (h.to(tl.float64) + 0.5) / 4294967296.0
    return -tl.log(-tl.log(u))


@triton.jit
def _qbin(s, m):
    """floor((m - s) * 2048) clamped to [0, 65535]: monotone non-increasing in s."""
    return tl.minimum((m - s) * 2048.0, 65535.0).to(tl.int32)


@triton.jit
def _hist256(l_ptr, row, V, t, m, Z, b_sel, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Count and fp32 mass of the 256 bins (q >> SHIFT) & 255 over tokens with q >> 8 == b_sel
    (b_sel < 0: every token). Returns ([256] int32 counts, [256] float32 masses)."""
    r = tl.arange(0, BLOCK)
    c16 = tl.arange(0, 16)
    c64 = tl.arange(0, 64)
    piece = c64 // 16
    lcol = c64 % 16
    acc = tl.zeros([16, 64], tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        s = _scaled(l_ptr, row, V, v, t)
        q = _qbin(s, m)
        valid = (v < V) & ((b_sel < 0) | ((q >> 8) == b_sel))
        b = (q >> SHIFT) & 255
        p = tl.where(valid, tl.exp(s - m) / Z, 0.0)
        # p = w1 + w2 + w3 exactly, each exact in tf32: the dot's products are exact
        w1 = tf32_hi(p)
        rest = p - w1
        w2 = tf32_hi(rest)
        w3 = rest - w2
        hi = tl.where(valid, b >> 4, -1)
        a = (hi[None, :] == c16[:, None]).to(tl.float32)  # [16, BLOCK]
        w = tl.where(piece[None, :] == 0, w1[:, None],
                     tl.where(piece[None, :] == 1, w2[:, None],
                              tl.where(piece[None, :] == 2, w3[:, None], 1.0)))
        bm = tl.where((b & 15)[:, None] == lcol[None, :], w, 0.0)  # [BLOCK, 64]
        acc = tl.dot(a, bm, acc, input_precision="tf32")
    acc3 = tl.reshape(acc, [16, 4, 16])
    pc = tl.arange(0, 4)[None, :, None]
    mass = tl.reshape(tl.sum(tl.where(pc < 3, acc3, 0.0), 1), [256])
    cnt = tl.reshape(tl.sum(tl.where(pc == 3, acc3, 0.0), 1), [256]).to(tl.int32)
    return cnt, mass


@triton.jit
def _cut(cnt, mass, c0, m0, k_eff, top_p):
    """Boundary bin of a 256-bin histogram: the last bin whose first token is kept, and the count /
    mass of everything above it (c0 / m0: what lies above the histogram's range)."""
    ci = tl.cumsum(cnt, 0)
    mi = tl.cumsum(mass, 0)
    i = tl.arange(0, 256)
    ok = ((c0 + ci) < k_eff) & ((m0 + mi) < top_p) & (i < 255)
    bstar = tl.sum(ok.to(tl.int32), 0)
    above = i == bstar - 1
    return bstar, c0 + tl.sum(tl.where(above, ci, 0), 0), m0 + tl.sum(tl.where(above, mi, 0.0), 0)


@triton.jit
def _argmax_row(l_ptr, row, V, BLOCK: tl.constexpr):
    """The greedy token of logits row `row` [V]: one pass over the raw logits in BLOCK chunks, the first index
    on ties (torch.argmax's rule); shared by `sample` and the speculative step's greedy rows."""
    r = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    idx = tl.full([], 0, tl.int64)
    for v0 in range(0, V, BLOCK):
        v = v0 + r
        raw = tl.load(l_ptr + row * V + v, mask=v < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(raw, 0)
        bi = tl.argmax(raw, 0).to(tl.int64) + v0
        take = bm > best
        idx = tl.where(take, bi, idx)
        best = tl.where(take, bm, best)
    return idx


@triton.jit
def _sample_kernel(l_ptr, temp_ptr, topk_ptr, topp_ptr, seed_ptr, pos_ptr, ws_ptr, out_ptr, V,
                   BLOCK: tl.constexpr, HBLOCK: tl.constexpr, CB: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    r = tl.arange(0, BLOCK)
    result = tl.full([], 0, tl.int64)
    if temp > 0:
        t = tl.maximum(temp, 1e-5)
        top_k = tl.load(topk_ptr + row).to(tl.int64)
        top_p = tl.load(topp_ptr + row).to(tl.float32)
        top_p = tl.where(top_p >= 1.0, float("inf"), top_p)  # >= 1: no nucleus cut (the reference's rule)
        k_eff = tl.where(top_k > 0, top_k, V + 1)
        # pass 1: online max / softmax denominator of the scaled logits
        mv = tl.full([BLOCK], float("-inf"), tl.float32)
        zv = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            s = _scaled(l_ptr, row, V, v0 + r, t)
            mn = tl.maximum(mv, s)
            alpha = tl.where(mv == mn, 1.0, tl.exp(mv - mn))
            zv = zv * alpha + tl.where(s == mn, 1.0, tl.exp(s - mn))
            zv = tl.where(mn == float("-inf"), 0.0, zv)
            mv = mn
        m = tl.max(mv, 0)
        Z = tl.sum(tl.where(mv > float("-inf"), zv * tl.exp(mv - m), 0.0), 0)
        # passes 2-3: boundary bin (width 1/8 in m - s), then boundary sub-bin (width 1/2048)
        qstar = tl.full([], 65536, tl.int32)  # no q reaches it: every token kept
        cq = tl.full([], 0, tl.int32)
        mq = tl.full([], 0.0, tl.float32)
        if (k_eff <= V) | (top_p < float("inf")):  # a cut to find (plain temperature sampling has none)
            cnt1, mass1 = _hist256(l_ptr, row, V, t, m, Z, tl.full([], -1, tl.int32), 8, HBLOCK)
            b1, c1, m1 = _cut(cnt1, mass1, 0, 0.0, k_eff, top_p)
            cnt2, mass2 = _hist256(l_ptr, row, V, t, m, Z, b1, 0, HBLOCK)
            b2, cq, mq = _cut(cnt2, mass2, c1, m1, k_eff, top_p)
            qstar = tl.where(b1 == 255, 65536, b1 * 256 + b2)  # bin 255 cannot win: keep everything
        # pass 4: Gumbel-max over q < q* (all kept); collect the q == q* candidates
        ctr = (tl.load(seed_ptr + row).to(tl.int64) * 0x9E3779B1
               + tl.load(pos_ptr + row).to(tl.int64) * 0x85EBCA77) & 0xFFFFFFFF
        hc = _hash32(ctr)
        best = tl.full([], float("-inf"), tl.float64)
        b_idx = tl.full([], 0, tl.int64)
        n_c = tl.full([], 0, tl.int32)
        for v0 in range(0, V, BLOCK):
            v = v0 + r
            s = _scaled(l_ptr, row, V, v, t)
            q = _qbin(s, m)
            keep = (v < V) & (q < qstar)
            cand = (v < V) & (q == qstar)
            pos = n_c + tl.cumsum(cand.to(tl.int32), 0) - 1
            tl.store(ws_ptr + row * V + pos, sort_key(s, v), mask=cand)
            n_c += tl.sum(cand.to(tl.int32), 0)
            val = tl.where(keep, s.to(tl.float64), float("-inf")) + _gumbel(hc, v)
            val = tl.where(v < V, val, float("-inf"))
            bm = tl.max(val, 0)
            bi = tl.argmax(val, 0).to(tl.int64) + v0
            take = bm > best
            b_idx = tl.where(take, bi, b_idx)
            best = tl.where(take, bm, best)
        # resolve the boundary sub-bin exactly: stable descending order of its candidates
        if n_c <= CB:
            j = tl.arange(0, CB)
            key = tl.load(ws_ptr + row * V + j, mask=j < n_c, other=-1)
            key = tl.sort(key, 0, descending=True)
            ok = key >= 0
            ci = key_index(key)
            sc = _scaled(l_ptr, row, V, tl.where(ok, ci, V), t)
            pc = tl.where(ok, tl.exp(sc - m) / Z, 0.0)
            before = mq + (tl.cumsum(pc, 0) - pc)
            kc = ok & ((((cq + j) < k_eff) & (before < top_p)) | ((j == 0) & (qstar == 0)))
            val = tl.where(kc, sc.to(tl.float64) + _gumbel(hc, ci), float("-inf"))
            cb = tl.max(val, 0)
            cbi = tl.min(tl.where(kc & (val == cb), ci, V), 0)
        else:  # massive ties: binary search over the candidate keys only
            lo = tl.full([], 0, tl.int64)
            hi = tl.full([], 9223372036854775807, tl.int64)
            kmax = tl.full([], -1, tl.int64)
            for c0 in range(0, n_c, BLOCK):
                jj = c0 + r
                kmax = tl.maximum(kmax, tl.max(tl.load(ws_ptr + row * V + jj, mask=jj < n_c, other=-1), 0))
            while lo < hi:
                mid = lo + (hi - lo) // 2
                cnt = tl.zeros([BLOCK], tl.int32)
                mass = tl.zeros([BLOCK], tl.float32)
                for c0 in range(0, n_c, BLOCK):
                    jj = c0 + r
                    key = tl.load(ws_ptr + row * V + jj, mask=jj < n_c, other=-1)
                    above = key > mid
                    sc = _scaled(l_ptr, row, V, tl.where(above, key_index(key), V), t)
                    cnt += above.to(tl.int32)
                    mass += tl.where(above, tl.exp(sc - m) / Z, 0.0)
                okb = ((cq + tl.sum(cnt, 0)) < k_eff) & ((mq + tl.sum(mass, 0)) < top_p)
                hi = tl.where(okb, mid, hi)
                lo = tl.where(okb, lo, mid + 1)
            thr = tl.where(qstar == 0, tl.minimum(lo, kmax), lo)
            cb = tl.full([], float("-inf"), tl.float64)
            cbi = tl.full([], 0, tl.int64)
            for c0 in range(0, n_c, BLOCK):
                jj = c0 + r
                key = tl.load(ws_ptr + row * V + jj, mask=jj < n_c, other=-1)
                kc = (key >= 0) & (key >= thr)
                ci = key_index(key)
                sc = _scaled(l_ptr, row, V, tl.where(kc, ci, V), t)
                val = tl.where(kc, sc.to(tl.float64) + _gumbel(hc, ci), float("-inf"))
                bm = tl.max(val, 0)
                bi = tl.min(tl.where(kc & (val == bm), ci, V), 0)
                take = (bm > cb) | ((bm == cb) & (bi < cbi))
                cbi = tl.where(take, bi, cbi)
                cb = tl.where(take, bm, cb)
        take = (cb > best) | ((cb == best) & (cbi < b_idx))
        result = tl.where(take, cbi, b_idx)
    else:
        result = _argmax_row(l_ptr, row, V, BLOCK)  # greedy: first index on ties
    tl.store(out_ptr + row, result)


@implement("sample", "triton")
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    ws = torch.empty(B, V, dtype=torch.int64, device=logits.device)  # boundary candidates' keys
    _sample_kernel[(B,)](logits.contiguous(), temperature.float().contiguous(), top_k.contiguous(),
                         top_p.float().contiguous(), seeds.contiguous(), positions.contiguous(), ws, out, V,
                         BLOCK=min(p2(V), 2048), HBLOCK=min(p2(V), 1024 if _INTERPRET else 128), CB=CAND,
                         num_warps=8, **pdl())
    return out


@triton.jit
def _logprobs_kernel(x_ptr, y_ptr, V, BLOCK: tl.constexpr):
    pdl_wait()
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
        _logprobs_kernel[(rows,)](x, y, V, BLOCK=min(p2(V), 4096), **pdl())
    return y


@triton.jit
def _bitmask_kernel(x_ptr, m_ptr, y_ptr, V, W, BLOCK: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = v < V
    x = tl.load(x_ptr + row * V + v, mask=inside, other=0.0)
    wi = v // 32
    word = tl.load(m_ptr + row * W + wi, mask=inside & (wi < W), other=0)
    bit = (word >> (v % 32)) & 1
    y = tl.where(bit != 0, x, float("-inf"))
    tl.store(y_ptr + row * V + v, y.to(y_ptr.dtype.element_ty), mask=inside)


@implement("apply_token_bitmask", "triton")
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """One program per (row, block of 1024 tokens): each token's word of the bitmask, -inf where its bit is
    clear. Grid from shapes only, no host sync (capture-safe)."""
    B, V = logits.shape
    x = logits.contiguous()
    m = bitmask.to(torch.int32).contiguous()
    y = torch.empty_like(x)
    if B and V:
        BLOCK = 1024
        _bitmask_kernel[(B, cdiv(V, BLOCK))](x, m, y, V, m.size(-1), BLOCK=BLOCK, **pdl())
    return y
