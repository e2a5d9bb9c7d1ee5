"""DeepGEMM's SM90 FP8 GEMMs under our contracts (DeepGEMM 2.6.1's API: `fp8_gemm_nt`,
`m_grouped_fp8_gemm_nt_contiguous`).

fp8_gemm: `fp8_gemm_nt((a, a_s), (w, w_s), d)`, D = A Bᵀ: A [M, K] and B [N, K] e4m3, K-major; the activation
scales per 1 x 128 and the weight's per 128 x 128 block in fp32 (our ue8m0 weight scales decoded exactly); d bf16
(the SM90 kernel `sm90_fp8_gemm_1d2d` writes bf16 only). DeepGEMM promotes its FP8 tensor-core sums to fp32 once per
128-K block, so it is held to the tensor-core bound of `ab` (as cuBLASLt), not to the official kernel's
accumulation after every MMA.

fp4_gemm: the FP4 weight requantised once to per-128 FP8 (`_common.requantised`), then as fp8_gemm.

grouped_gemm: our rows carry their expert id in any order (e [P], -1 a padding row whose output is 0). At prefill
(P > MASKED_MAX_P) the rows are sorted into blocks of 128 by `moe_align` (no host sync, fixed shapes, the layout our
Triton kernels use), gathered, and run by the m-grouped contiguous GEMM with the per-row expert index DeepGEMM takes
(-1 for padding rows, whose blocks it skips). At decode (a few rows over many experts, where 128-row segments would
be mostly padding) each row goes to its expert's slot of the masked layout ([E, max_m, K], `masked_m` rows per
expert, max_m = P rounded up to 128: every expert could take every row) and runs by the m-grouped masked GEMM.
Either way the outputs are gathered back by position, without a host sync. FP4 experts run requantised to per-128 FP8. Float
(bf16) experts and a non-bf16 output run the reference, visibly.
"""

from __future__ import annotations

import torch

from deepinfer.ops.registry import REGISTRY, implement
from deepinfer.quant.grouped import moe_align, repeat_rows

from ._common import dg, f32_block_scales, off_contract, requantised, sm90, why

BLOCK = 128  # K granularity of the SM90 scales
MASKED_MAX_P = 64  # grouped calls of at most this many rows (decode) use the masked layout


def _alignment(m) -> int:
    """The row alignment of an expert's segment in DeepGEMM's contiguous layout (128 on SM90 in 2.6.1), read from
    DeepGEMM so a kernel tile never spans two experts."""
    for name in ("get_mk_alignment_for_contiguous_layout", "get_m_alignment_for_contiguous_layout"):
        fn = getattr(m, name, None)
        if fn is not None:
            return int(fn())
    return BLOCK


def _fp8_args_bad(a, a_s, w, out_dtype, k_w: int) -> str:
    M, K = a.shape
    if sm90(a):
        return sm90(a)
    if out_dtype != torch.bfloat16:
        return f"DeepGEMM's SM90 FP8 GEMM writes bf16, not {out_dtype}"
    if a.dtype != torch.float8_e4m3fn:
        return f"DeepGEMM takes e4m3 activations, not {a.dtype}"
    if a_s is None or a_s.dtype != torch.float32 or tuple(a_s.shape) != (M, -(-K // BLOCK)):
        return f"activation scales {None if a_s is None else tuple(a_s.shape)} are not fp32 per-128 for A {tuple(a.shape)}"
    if K % BLOCK or k_w != K:
        return f"K = {K} (weight K {k_w}) is not a multiple of {BLOCK} matching the weight"
    return ""


def _dense(op: str, a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
           out_dtype: torch.dtype) -> torch.Tensor:
    """fp8_gemm / fp4_gemm on `fp8_gemm_nt` (the FP4 weight requantised once), or the reference off contract."""
    ref = REGISTRY[op].ref
    if a.size(0) == 0:
        return ref(a, a_s, w, w_s, out_dtype)
    fp4 = op == "fp4_gemm"
    bad = _fp8_args_bad(a, a_s, w, out_dtype, 2 * w.size(1) if fp4 else w.size(1))
    if not bad and not fp4 and w.dtype != torch.float8_e4m3fn:
        bad = f"DeepGEMM takes e4m3 weights, not {w.dtype}"
    m = None if bad else dg(a.device)
    if m is None:
        return off_contract(op, bad or why(), ref, a, a_s, w, w_s, out_dtype)
    wb = requantised(w, w_s) if fp4 else (w.contiguous(), f32_block_scales(w_s))
    d = torch.empty(a.size(0), w.size(0), dtype=torch.bfloat16, device=a.device)
    m.fp8_gemm_nt((a.contiguous(), a_s.contiguous()), wb, d)
    return d


@implement("fp8_gemm", "deepgemm")
def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return _dense("fp8_gemm", a, a_s, w, w_s, out_dtype)


@implement("fp4_gemm", "deepgemm")
def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return _dense("fp4_gemm", a, a_s, w, w_s, out_dtype)


@implement("grouped_gemm", "deepgemm")
def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                 w_s: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16,
                 a_split: torch.Tensor | None = None, topk: int = 1) -> torch.Tensor:
    ref = REGISTRY["grouped_gemm"].ref
    if topk != 1:  # DeepGEMM's layouts take A per pair: the tokens' rows repeated for their topk pairs
        a, a_s, a_split = repeat_rows(topk, e, a, a_s, a_split)
    P, K = a.shape
    fp4 = w.dtype in (torch.int8, torch.uint8)
    if P == 0:
        return ref(a, a_s, e, w, w_s, out_dtype, a_split)
    bad = _fp8_args_bad(a, a_s, w, out_dtype, 2 * w.size(2) if fp4 else w.size(2))
    if not bad and not fp4 and w.dtype != torch.float8_e4m3fn:
        bad = f"float ({w.dtype}) experts: this adapter wires DeepGEMM's FP8 m-grouped GEMM only"
    m = None if bad else dg(a.device)
    if m is None:
        return off_contract("grouped_gemm", bad or why(), ref, a, a_s, e, w, w_s, out_dtype, a_split)
    E, N = w.size(0), w.size(1)
    w8, s8 = requantised(w, w_s) if fp4 else (w.contiguous(), f32_block_scales(w_s))
    if P <= MASKED_MAX_P and hasattr(m, "m_grouped_fp8_gemm_nt_masked"):
        return _grouped_masked(m, a, a_s, e, w8, s8, out_dtype)
    al = _alignment(m)
    rows, bexp = moe_align(e, E, al)  # [nb * al] source rows (P: padding), [nb] expert per block (-1 unused)
    # gather A and its scales by block: row P is a zero row (padding rows contribute nothing and stay finite)
    a8 = torch.cat([a.contiguous().view(torch.uint8), a.new_zeros(1, K, dtype=torch.uint8)])
    ag = a8.index_select(0, rows).view(torch.float8_e4m3fn)
    sg = torch.cat([a_s.contiguous(), a_s.new_zeros(1, a_s.size(1))]).index_select(0, rows)
    # DeepGEMM reads each row's expert (-1: padding, its blocks skipped)
    layout = torch.where(rows < P, bexp.to(torch.int32).repeat_interleave(al), -1).to(torch.int32)
    d = torch.empty(rows.numel() + 1, N, dtype=torch.bfloat16, device=a.device)
    d[-1].zero_()  # the row a dropped input row (e = -1) reads: its output is 0
    m.m_grouped_fp8_gemm_nt_contiguous((ag, sg), (w8, s8), d[:-1], layout)
    return d.index_select(0, _inverse(rows, P)).to(out_dtype)


def _grouped_masked(m, a, a_s, e, w8, s8, out_dtype) -> torch.Tensor:
    """The masked layout (module docstring): row p of expert j at slot (j, its rank among j's rows); rows with an
    id outside [0, E) go to their own dump slots past the layout and read back as 0."""
    P, K = a.shape
    E, N = w8.size(0), w8.size(1)
    dev = a.device
    max_m = -(-P // BLOCK) * BLOCK
    key = torch.where((e >= 0) & (e < E), e.long(), E)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    order = torch.argsort(key, stable=True)
    skey = key[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[skey]
    dump = E * max_m + torch.arange(P, device=dev)
    slot_sorted = torch.where(skey < E, skey * max_m + rank, dump)
    slot = torch.empty_like(slot_sorted).index_copy_(0, order, slot_sorted)  # a permutation: no duplicate index
    a8 = torch.empty(E * max_m + P, K, dtype=torch.uint8, device=dev)
    a8.index_copy_(0, slot, a.contiguous().view(torch.uint8))
    sa = torch.empty(E * max_m + P, a_s.size(1), dtype=torch.float32, device=dev)
    sa.index_copy_(0, slot, a_s.contiguous())
    d = torch.empty(E * max_m + 1, N, dtype=torch.bfloat16, device=dev)
    d[-1].zero_()
    expected = max(1, -(-P // max(1, min(E, P))))  # a hint to DeepGEMM's heuristics only
    m.m_grouped_fp8_gemm_nt_masked((a8[:E * max_m].view(torch.float8_e4m3fn).view(E, max_m, K),
                                    sa[:E * max_m].view(E, max_m, -1)), (w8, s8), d[:-1].view(E, max_m, N),
                                   counts[:E].to(torch.int32), expected)
    return d.index_select(0, torch.where(slot < E * max_m, slot, E * max_m)).to(out_dtype)


def _inverse(rows: torch.Tensor, P: int) -> torch.Tensor:
    """pos [P]: where input row p sits in `rows` (each valid row appears once), or rows.numel() (the zero row) for
    a row moe_align dropped; fixed shapes, no host sync, deterministic (a sorted search, no scatter)."""
    order = torch.argsort(rows, stable=True)
    srt = rows[order]
    want = torch.arange(P, device=rows.device)
    idx = torch.searchsorted(srt, want).clamp(max=rows.numel() - 1)
    return torch.where(srt[idx] == want, order[idx], rows.numel())


# The FP4 weights run requantised per 128 x 128 block (`_common.requantised`): `deepinfer ab` judges these two
# against the reference on the requantised weights and reports the requantisation's own error beside.
fp4_gemm.fp4_as = grouped_gemm.fp4_as = "fp8-per-128"
