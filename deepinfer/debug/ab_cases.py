"""Inputs for `deepinfer ab`: one case builder per registered op, at tiny / V4-Flash / V4-Pro shapes.

A builder `build_<op>(dims, phase, g, device) -> list[Variant]` returns the calls to make: each variant is
(name, args, kwargs) with realistic values: activations from a real distribution with per-block outliers,
FP8/FP4 operands produced by real quantisation (fp4 weights packed int8 with float32 power-of-two
scales), index tensors with -1 holes and a fully empty row, tid2eid hash tables, RoPE tables from the
real YaRN frequencies at random positions, logits with ties, ... Never zeros.

`phase` is "decode" (many sequences, one token each) or "prefill" (one long sequence). Shape sets other
than tiny are "big": they are only built when a CUDA device is present (the runner reports them skipped
otherwise).

Per-op comparison hints live in `COMPARE`: which outputs are index sets (compared as sets per row, with
their companion outputs re-ordered to match), which args a kernel writes in place (poisoned first), and
so on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.config import tiny_config
from deepinfer.model.rope import yarn_inv_freq
from deepinfer.ops.reference import act_quant, fp4_fake_quant, kv_pack
from deepinfer.quant.formats import e8m0_to_float, quant_fp4, quant_fp8_block
from deepinfer.quant.kv_layout import kv_packed_width


@dataclass(frozen=True)
class Dims:
    name: str
    dim: int
    n_heads: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_groups: int
    o_lora: int
    window: int
    n_experts: int
    moe_inter: int
    topk: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc: int
    vocab: int
    route_scale: float
    swiglu_limit: float
    ratio: int  # CSA compression ratio
    decode_batch: int
    decode_ctx: int  # tokens of context per decoding sequence
    prefill_len: int
    big: bool


def _tiny() -> Dims:
    c = tiny_config()
    return Dims("tiny", c.dim, c.n_heads, c.head_dim, c.rope_head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank,
                c.window_size, c.n_routed_experts, c.moe_inter_dim, c.n_activated_experts, c.index_n_heads,
                c.index_head_dim, c.index_topk, c.hc_mult, c.vocab_size, c.route_scale, c.swiglu_limit, 4,
                decode_batch=3, decode_ctx=40, prefill_len=20, big=False)


SHAPES: dict[str, Dims] = {
    "tiny": _tiny(),
    "flash": Dims("flash", 4096, 64, 512, 64, 1024, 8, 1024, 128, 256, 2048, 6, 64, 128, 512, 4, 129280, 1.5, 10.0,
                  4, decode_batch=32, decode_ctx=8192, prefill_len=2048, big=True),
    "pro": Dims("pro", 7168, 128, 512, 64, 1536, 16, 1024, 128, 384, 3072, 6, 64, 128, 1024, 4, 129280, 2.5, 10.0,
                4, decode_batch=32, decode_ctx=8192, prefill_len=2048, big=True),
}
PHASES = ("decode", "prefill")


@dataclass
class Variant:
    name: str
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class CompareSpec:
    """How to compare an op's outputs. `sets`: output indices holding index sets per row (last dim);
    `aligned`: output index -> the set output whose order it follows; `inplace`: arg indices written in
    place (the outputs are the op's return value, if any, then those args after the call, poisoned first);
    `exact`: integer equality only."""

    sets: tuple = ()
    aligned: tuple = ()  # pairs (output, set_output)
    inplace: tuple = ()
    # GEMMs whose compiled prefill kernels promote to fp32 once per 128-K block (DeepGEMM's scheme): an
    # element may also pass within tc_rel x Σ|terms| (+ its bf16 rounding), Σ|terms| being the reference
    # on `abs_args(args)` (the operands with their sign bits cleared; scales are positive).
    abs_args: object = None
    tc_rel: object = 0.0  # a float, or args -> float (a bound that grows with the reduction length K)
    # ops with a long float32 reduction before a smooth function (hc_pre's mixes over hc·D): args -> K;
    # float32 outputs then also pass within rtol FP32_C·√K·2^-24 (the reduction-order bound below)
    k_of: object = None
    # args, reference outputs -> per-output allowed |Δ| tensors (None: no widening), for outputs a bound
    # must be propagated through a nonlinearity (moe_route's scores and weights)
    bound: object = None


def _abs_operand(t):
    """|t| for an fp8 tensor or packed e2m1 pairs (int8/uint8: both nibbles' sign bits cleared); else t."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dtype == torch.float8_e4m3fn:
        return (t.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    if t.dtype in (torch.int8, torch.uint8):
        return (t.view(torch.uint8) & 0x77).view(t.dtype)
    return t.abs() if t.is_floating_point() else t


def _abs_gemm(*operands: int):
    return lambda args: tuple(_abs_operand(a) if i in operands else a for i, a in enumerate(args))


# DeepSeek-V3 §3.3.2: ~2 % error at K 4096 without promotion -> ~2^-10.6 per 128-K block; measured on sm_90:
# 2^-10.9 (docs/perf-log.md)
TC_REL = 2.0 ** -9

# Two float32 sums of the same K terms in different orders differ by at most 2·γ_K·Σ|terms| (γ_K ≈ K·u,
# u = 2^-24), and with round-off errors behaving as independent by ~√K·u·Σ|terms| (Higham, Accuracy and
# Stability, §4.2). FP32_C·√K·u·Σ|terms| is the per-element bound for float32 reductions here: FP32_C 4
# covers both sides' errors at twice the √K estimate (ab reports each case's worst |Δ| / allowed).
FP32_C = 4.0


def fp32_sum_rel(K: int) -> float:
    return FP32_C * K ** 0.5 * 2.0 ** -24


def _linear_rel(args) -> float:
    return fp32_sum_rel(args[0].size(-1))


def _hc_k(args) -> int:
    x = args[0]
    return x.size(-2) * x.size(-1)  # the mixes reduce over hc·D


def _moe_route_bound(args, ref: list) -> list:
    """|Δ| allowed per output of moe_route: the gate logits z = x·Wᵀ carry fp32_sum_rel(K)·Σ|x w|; the
    scores s = sqrt(softplus(z)) at most half of that (d/dz sqrt(softplus(z)) = σ(z)/(2·sqrt(softplus(z)))
    < 0.35); the weights w_i = rs·s_i/Σ_sel s the first-order sum of their parts."""
    x, gate_w, route_scale = args[0], args[1], args[7]
    if args[6] != "sqrtsoftplus":
        return [None, None, None]
    mag = x.float().abs() @ gate_w.float().abs().t()
    ds = 0.5 * fp32_sum_rel(x.size(-1)) * mag  # [T, E]
    w, idx, s = ref
    s_sel, ds_sel = s.gather(1, idx), ds.gather(1, idx)
    tot, dtot = s_sel.sum(-1, keepdim=True), ds_sel.sum(-1, keepdim=True)
    dw = route_scale * (ds_sel / tot + s_sel * dtot / tot ** 2)
    return [dw, None, ds]

COMPARE: dict[str, CompareSpec] = {
    "topk_indices": CompareSpec(sets=(0,)),
    "moe_route": CompareSpec(sets=(1,), aligned=((0, 1),), bound=_moe_route_bound),
    "kv_store": CompareSpec(inplace=(0,)),
    "rms_norm_rope_store": CompareSpec(inplace=(6,)),  # y, then the cache
    "compress_decode": CompareSpec(inplace=(5, 6)),  # the pooled entry, then both states
    "compress_prefill": CompareSpec(inplace=(5, 6)),  # the pooled windows, then both states
    "fp8_gemm": CompareSpec(abs_args=_abs_gemm(0, 2), tc_rel=TC_REL),  # (a, a_s, w, w_s)
    "act_quant_fp8_gemm": CompareSpec(abs_args=_abs_gemm(0, 1), tc_rel=TC_REL),  # (x, w, w_s)
    "grouped_gemm": CompareSpec(abs_args=_abs_gemm(0, 3), tc_rel=TC_REL),  # (a, a_s, e, w, w_s)
    # fp32 sums over K = 4096 / 7168 in another order than the reference's: outputs that cancel (the
    # activations' 1e-2..1e2 block spread) miss rtol 1e-5 of their own value; the bound is fp32_sum_rel(K)
    "linear": CompareSpec(abs_args=_abs_gemm(0, 1), tc_rel=_linear_rel),  # (x, w)
    "hc_pre": CompareSpec(k_of=_hc_k),
    "hc_pre_quant": CompareSpec(k_of=_hc_k),
    "hc_post_pre_quant": CompareSpec(k_of=lambda args: _hc_k(args[1:])),  # (x, residual [.., hc, D], ...)
    "moe_combine_post_pre_quant": CompareSpec(k_of=lambda args: _hc_k(args[2:])),  # (routed, shared, residual, ...)
    "moe_combine_post_head": CompareSpec(k_of=lambda args: _hc_k(args[2:])),
}


# ------------------------------------------------------------------------------------------ helpers
def _bs(d: Dims, phase: str) -> tuple[int, int]:
    return (d.decode_batch, 1) if phase == "decode" else (1, d.prefill_len)


def _act(g, shape, device, dtype=torch.bfloat16, outlier_block: int = 128) -> torch.Tensor:
    """Activations: normal values with a per-block magnitude spread of 1e-2..1e2 (real outlier channels)."""
    x = torch.randn(shape, generator=g)
    last = shape[-1]
    nb = max(1, last // outlier_block)
    mag = 10 ** (torch.rand(*shape[:-1], nb, generator=g) * 4 - 2)
    x = x * mag.repeat_interleave(outlier_block, -1)[..., :last]
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)  # never an exact zero
    return x.to(device=device, dtype=dtype)


def _w(g, shape, device, std: float = 0.02, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * std).to(device=device, dtype=dtype)


def _rope_tables(g, B, S, R, device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = yarn_inv_freq(R, 160000.0, 16.0, 65536, 32.0, 1.0)
    pos = torch.randint(0, 65536, (B, S), generator=g).float()
    ang = pos.unsqueeze(-1) * freqs
    return ang.cos().to(device), ang.sin().to(device)


# ------------------------------------------------------------------------------------------ builders
def build_rms_norm(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    return [
        Variant("hidden", (_act(g, (B, S, d.dim), device), (1 + _w(g, (d.dim,), device, 0.1)).bfloat16(), 1e-6), {}),
        Variant("q_head_unweighted", (_act(g, (B, S, d.n_heads, d.head_dim), device), None, 1e-6), {}),
    ]


def build_rms_norm_quant(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    return [Variant("attn_norm", (_act(g, (B, S, d.dim), device), (1 + _w(g, (d.dim,), device, 0.1)).float(), 1e-6),
                    {}),
            Variant("q_norm", (_act(g, (B, S, d.q_lora), device), (1 + _w(g, (d.q_lora,), device, 0.1)).float(), 1e-6),
                    {})]


def build_act_quant(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    return [Variant("hidden", (_act(g, (B * S, d.dim), device),), {"block": 128})]


def build_fp8_fake_quant(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    x = _act(g, (B, S, d.head_dim - d.rope_dim), device, outlier_block=64)
    return [Variant("kv_nope", (x,), {"block": 64})]


def build_fp4_fake_quant(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    x = _act(g, (B, S, d.index_heads, d.index_head_dim), device, outlier_block=32)
    return [Variant("index_q", (x,), {"block": 32})]


def build_hadamard(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    return [Variant("index_q", (_act(g, (B, S, d.index_heads, d.index_head_dim), device),), {})]


def _fp8_weight(g, N, K, device):
    """A block-quantised FP8 weight [N, K] (rows spread over a decade) and its f32 power-of-two scales."""
    w, w_sb = quant_fp8_block(torch.randn(N, K, generator=g) * 0.02 * (10 ** (torch.rand(N, 1, generator=g) - 0.5)))
    return w.to(device), e8m0_to_float(w_sb).to(device)


def _fp8_operands(g, M, N, K, device):
    a, a_s = act_quant(_act(g, (M, K), torch.device("cpu")), 128)
    return (a.to(device), a_s.to(device)) + _fp8_weight(g, N, K, device)


def build_fp8_gemm(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    M = B * S
    out = []
    for nm, N, K in (("wq_a", d.q_lora, d.dim), ("wo_b", d.dim, d.o_groups * d.o_lora)):
        a, a_s, w, w_s = _fp8_operands(g, M, N, K, device)
        out.append(Variant(nm, (a, a_s, w, w_s), {"out_dtype": torch.bfloat16}))
    return out


def build_act_quant_fp8_gemm(d: Dims, phase: str, g, device):
    """wo_b as the model calls it: the bf16 wo_a output, quantised per 128 inside the op."""
    B, S = _bs(d, phase)
    K = d.o_groups * d.o_lora
    return [Variant("wo_b", (_act(g, (B * S, K), device), *_fp8_weight(g, d.dim, K, device)),
                    {"out_dtype": torch.bfloat16})]


def build_fp8_grouped_linear(d: Dims, phase: str, g, device):
    """wo_a: the attention output [tokens, groups, heads·hd / groups] as the model passes it (a strided view of
    [tokens, heads, hd]) into each group's FP8 [o_lora, ·] block."""
    B, S = _bs(d, phase)
    K = d.n_heads * d.head_dim // d.o_groups
    o = _act(g, (B * S, d.n_heads, d.head_dim), device)
    w, w_s = _fp8_weight(g, d.o_groups * d.o_lora, K, device)
    return [Variant("wo_a", (o.view(B * S, d.o_groups, K), w, w_s), {})]


def build_fp4_gemm(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    M = B * S
    out = []
    for nm, N, K in (("expert_w1", d.moe_inter, d.dim), ("expert_w2", d.dim, d.moe_inter)):
        a, a_s = act_quant(_act(g, (M, K), torch.device("cpu")), 128)
        w, w_sb = quant_fp4(torch.randn(N, K, generator=g) * 0.02)
        out.append(Variant(nm, (a.to(device), a_s.to(device), w.to(device), e8m0_to_float(w_sb).to(device)),
                           {"out_dtype": torch.bfloat16}))
    return out


def build_linear(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    x = _act(g, (B, S, d.dim), device)
    return [Variant("index_weights_proj", (x, _w(g, (d.index_heads, d.dim), device, dtype=torch.bfloat16)), {}),
            Variant("compressor_wkv", (x, _w(g, (2 * d.head_dim, d.dim), device, dtype=torch.bfloat16)),
                    {"out_dtype": torch.float32})]  # the model's call: x.float() @ W.float(), no copies


def build_rope(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    cos, sin = _rope_tables(g, B, S, d.rope_dim, device)
    q = (torch.randn(B, S, d.n_heads, d.rope_dim, generator=g) * 2).bfloat16().to(device)
    kv = (torch.randn(B, S, d.rope_dim, generator=g) * 2).bfloat16().to(device)
    return [Variant("q", (q, cos, sin), {}), Variant("o_inverse", (q, cos, sin), {"inverse": True}),
            Variant("kv_3d", (kv, cos, sin), {})]


def build_rms_norm_rope(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    cos, sin = _rope_tables(g, B, S, d.rope_dim, device)
    q = _act(g, (B, S, d.n_heads, d.head_dim), device)
    wide = _act(g, (B, S, d.q_lora + d.head_dim), device)  # kv: the column slice of wq_a|wkv's output
    w = (1 + _w(g, (d.head_dim,), device, 0.1)).bfloat16()
    return [Variant("q_head_unweighted", (q, None, 1e-6, cos, sin, d.rope_dim), {}),
            Variant("q_head_official", (q, None, 1e-6, cos, sin, d.rope_dim), {"form": "official_q"}),
            Variant("q_head_transformers", (q, None, 1e-6, cos, sin, d.rope_dim), {"form": "transformers_q"}),
            Variant("kv_slice", (wide[..., d.q_lora:], w, 1e-6, cos, sin, d.rope_dim), {})]


def build_compress_pool(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    W = 1 if phase == "decode" else max(1, S // d.ratio)
    slots = 2 * d.ratio  # the overlapping (CSA) compressor pools two windows
    kv = torch.randn(B, W, slots, d.head_dim, generator=g)
    score = torch.randn(B, W, slots, d.head_dim, generator=g) * 3
    score[:, 0, : d.ratio] = float("-inf")  # the first window has no previous half: -inf slots
    return [Variant("csa", (kv.to(device), score.to(device)), {})]


def build_compress_prefill(d: Dims, phase: str, g, device):
    """A prompt chunk through the CSA (overlapping, ratio r) and HCA-like (one window of 4r) compressors: a fresh
    prompt from position 0 (the rows' old state never read) and a chunk continuing one mid-window, over a state of
    B + 2 rows. The decode phase runs a short chunk (a few tokens: speculative verify and extend sizes)."""
    B, S = (1, max(3, d.ratio + 1)) if phase == "decode" else _bs(d, phase)
    out = []
    for name, overlap, r in (("csa", True, d.ratio), ("hca", False, 4 * d.ratio)):
        coff = 2 if overlap else 1
        C2 = coff * d.head_dim
        R = B + 2
        rows = torch.randperm(R, generator=g)[:B]
        proj = torch.randn(B, S, 2 * C2, generator=g)
        proj[..., C2:] *= 2
        for start, fresh in ((0, True), (r + r // 2 + 1, False)):
            kv_state = torch.randn(R, coff * r, C2, generator=g)
            score_state = torch.randn(R, coff * r, C2, generator=g) * 2
            score_state[rows[0], :r] = float("-inf")  # the sequence's first window: no previous half
            args = (proj[..., :C2].to(device), proj[..., C2:].to(device), torch.randn(r, C2, generator=g).to(device),
                    start, rows.to(device), kv_state.to(device), score_state.to(device), overlap, fresh)
            out.append(Variant(f"{name}_{'fresh' if fresh else 'continued'}", args, {}))
    return out


def build_compress_decode(d: Dims, phase: str, g, device):
    """One decode step of the CSA (overlapping, ratio r) and HCA-like (one window of r) compressors over
    a state of B + 2 rows, the B rows permuted; positions mix windows just completed and partly filled.
    A decode-only op: both phases run the decode batch."""
    B = max(2, d.decode_batch)
    out = []
    for name, overlap, r in (("csa", True, d.ratio), ("hca", False, 4 * d.ratio)):
        coff = 2 if overlap else 1
        C2 = coff * d.head_dim
        R = B + 2
        kv_state = torch.randn(R, coff * r, C2, generator=g)
        score_state = torch.randn(R, coff * r, C2, generator=g) * 2
        score_state[0, : r] = float("-inf")  # a fresh row: the previous window's half is empty
        pos = torch.randint(0, 4 * r, (B,), generator=g)
        pos[0] = r - 1  # completes its window
        rows = torch.randperm(R, generator=g)[:B]
        args = (torch.randn(B, C2, generator=g), torch.randn(B, C2, generator=g) * 2,
                torch.randn(r, C2, generator=g), pos, rows, kv_state, score_state)
        out.append(Variant(name, tuple(t.to(device) for t in args) + (overlap,), {}))
    return out


def build_decode_slots(d: Dims, phase: str, g, device):
    """The slots of one decode step over a cache of B + 2 rows (the B rows permuted): positions before and
    after the ring fills, CSA top-k entries with -1 holes, HCA entries complete or not. A decode-only op:
    both phases run the decode batch."""
    B = max(2, d.decode_batch)
    R = B + 2
    hca = 4 * d.ratio
    n_hca = d.decode_ctx // hca + 1
    n_entries = d.decode_ctx // d.ratio + 1
    N = d.window + n_entries
    pos = torch.randint(0, d.decode_ctx, (B,), generator=g)
    pos[0], pos[1] = 1, d.window + 3  # a ring not yet full, one just wrapped
    rows = torch.randperm(R, generator=g)[:B]
    k = min(d.index_topk, n_entries)
    ent = torch.stack([torch.randperm(n_entries, generator=g)[:k] for _ in range(B)])
    ent = torch.where(torch.rand(B, k, generator=g) < 0.2, -1, ent).view(B, 1, k)
    pos, rows, ent = pos.to(device), rows.to(device), ent.to(device)
    return [Variant("swa", (pos, rows, d.window, d.window), {}),
            Variant("csa", (pos, rows, d.window, N, ent), {}),
            Variant("hca", (pos, rows, d.window, d.window + n_hca), {"n_entries": n_hca, "ratio": hca})]


def build_decode_tables(d: Dims, phase: str, g, device):
    """One decode step's position tables: rope tables of decode_ctx + 1 positions, the batch's positions with the
    first rows at a window's end and before the first, the model's CSA and HCA ratios. A decode-only op: both
    phases run the decode batch."""
    B = max(2, d.decode_batch)
    half = d.rope_dim // 2
    main, comp = (torch.randn(d.decode_ctx + 1, 2, half, generator=g).to(device) for _ in range(2))
    pos = torch.randint(0, d.decode_ctx, (B,), generator=g)
    pos[0], pos[1] = d.ratio - 1, 0
    return [Variant("csa_hca", (pos.to(device), main, comp, (d.ratio, 4 * d.ratio), d.window), {})]


def build_indexer_scores(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    T = max(2, (d.decode_ctx if phase == "decode" else d.prefill_len) // d.ratio)
    q = fp4_fake_quant(torch.randn(B, S, d.index_heads, d.index_head_dim, generator=g).bfloat16(), 32)
    k = fp4_fake_quant(torch.randn(B, T, d.index_head_dim, generator=g).bfloat16(), 32)
    w = torch.randn(B, S, d.index_heads, generator=g).bfloat16()  # weights_proj's output; the op scales it
    ws = {"w_scale": d.index_head_dim ** -0.5 * d.index_heads ** -0.5}
    out = [Variant("csa", (q.to(device), k.to(device), w.to(device)), ws)]
    if phase == "decode":  # the engine's decode form: a key cache of B + 3 rows read in place via rows
        cache = fp4_fake_quant(torch.randn(B + 3, T, d.index_head_dim, generator=g).bfloat16(), 32)
        rows = torch.randperm(B + 3, generator=g)[:B]
        out.append(Variant("csa_cache_rows", (q.to(device), cache.to(device), w.to(device), rows.to(device)), ws))
    return out


def build_topk_indices(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    T = max(2 * d.index_topk, (d.decode_ctx if phase == "decode" else d.prefill_len) // d.ratio)
    scores = torch.randn(B, S, T, generator=g).relu()  # ReLU scores: many exact-zero ties
    n_valid = torch.randint(0, T + 1, (B, S), generator=g)
    n_valid.view(-1)[0] = min(T, max(1, d.index_topk // 2))  # fewer valid entries than k: -1 pads
    n_valid.view(-1)[-1] = T
    return [Variant("csa", (scores.to(device), d.index_topk, n_valid.to(device)), {})]


def build_sparse_attn(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    T = max(2, (d.decode_ctx if phase == "decode" else d.prefill_len) // d.ratio)
    win = min(d.window, d.decode_ctx if phase == "decode" else d.prefill_len)
    N = T + win  # kv rows: compressed entries then the window
    K = d.index_topk + d.window
    q = (torch.randn(B, S, d.n_heads, d.head_dim, generator=g)).bfloat16()
    kv = (torch.randn(B, N, d.head_dim, generator=g)).bfloat16()
    sink = torch.randn(d.n_heads, generator=g)
    idx = torch.randint(0, N, (B, S, K), generator=g)
    holes = torch.rand(B, S, K, generator=g) < 0.2
    idx = idx.masked_fill(holes, -1)
    idx.view(-1, K)[0] = -1  # a query with nothing to attend to: output 0
    out = [Variant("csa", (q.to(device), kv.to(device), sink.to(device), idx.int().to(device), d.head_dim ** -0.5),
                   {})]
    if phase == "prefill":  # the slots as the model's prefill lays them out: whole 64-slot blocks of -1 early on
        idx, N = prefill_layout_idx(S, d.window, d.ratio, d.index_topk, g)
        kv = torch.randn(B, N, d.head_dim, generator=g).bfloat16()
        out.append(Variant("csa_prefill_layout", (q.to(device), kv.to(device), sink.to(device),
                                                  idx.expand(B, -1, -1).int().to(device), d.head_dim ** -0.5), {}))
    return out


def prefill_layout_idx(S: int, window: int, ratio: int, topk: int, g) -> tuple[torch.Tensor, int]:
    """[1, S, window + topk] slot ids as `Attention._prefill` writes them for a CSA layer, and the kv rows they
    index: query t's window (positions max(0, t - window + 1) .. t, then -1), then the top-k of the (t + 1) // ratio
    compressed entries complete at t (rows S + j; random scores), then -1. Early tokens have whole 64-slot blocks
    of -1."""
    from deepinfer.model.attention import _window_idx_prefill

    win = torch.full((S, window), -1, dtype=torch.int64)
    w = _window_idx_prefill(S, window, "cpu")
    win[:, :w.size(1)] = w
    T = max(1, S // ratio)
    n_valid = (torch.arange(S) + 1) // ratio
    j = torch.arange(T)
    scores = torch.rand(S, T, generator=g).masked_fill(j >= n_valid.unsqueeze(-1), -1.0)
    top = scores.topk(min(topk, T), -1)
    comp = torch.full((S, topk), -1, dtype=torch.int64)
    comp[:, :top.indices.size(-1)] = torch.where(top.values >= 0, top.indices + S, -1)
    return torch.cat([win, comp], -1).unsqueeze(0), S + T


def _kv_entries(g, shape, d: Dims) -> torch.Tensor:
    """KV cache entries [..., head_dim] bf16 with per-entry magnitudes over 2^-8..1 (the scales differ)."""
    mag = torch.exp2(torch.randint(-8, 1, (*shape, 1), generator=g).float())
    return (torch.randn(*shape, d.head_dim, generator=g) * mag).bfloat16()


def build_sparse_attn_fp8(d: Dims, phase: str, g, device):
    """The sparse_attn case over the FP8 KV layout (`kv_pack` of the same kind of entries)."""
    v = build_sparse_attn(d, phase, g, "cpu")[0]
    q, kv, sink, idx, scale = v.args
    packed = kv_pack(_kv_entries(g, kv.shape[:2], d), d.rope_dim)
    args = (q.to(device), packed.to(device), sink.to(device), idx.to(device), scale, d.rope_dim)
    out = [Variant(v.name, args, v.kwargs)]
    if phase == "decode":  # the model's decode form: the output's RoPE removed in the same op
        ang = torch.rand(*q.shape[:2], d.rope_dim // 2, generator=g) * 6.283
        out.append(Variant(v.name + "_out_rope", args, {**v.kwargs, "out_rope": (ang.cos().to(device),
                                                                               ang.sin().to(device))}))
    return out


def build_q_norm_sparse_attn_fp8(d: Dims, phase: str, g, device):
    """The FP8-layout case with q as wq_b leaves it, per-head magnitudes 2^-6..2^6, normed (official_q) and rotated
    inside the op, the output's RoPE removed (decode's form)."""
    v = build_sparse_attn_fp8(d, phase, g, "cpu")[0]
    q, packed, sink, idx, scale, rd = v.args
    q = (q.float() * torch.exp2(torch.randint(-6, 7, (*q.shape[:3], 1), generator=g).float())).bfloat16()
    ang = torch.rand(*q.shape[:2], rd // 2, generator=g) * 6.283
    rope = (ang.cos().to(device), ang.sin().to(device))
    return [Variant(v.name + "_q_norm", (q.to(device), packed.to(device), sink.to(device), idx.to(device), scale, rd,
                                         1e-6, "official_q", rope), {})]


def build_kv_unpack(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    packed = kv_pack(_kv_entries(g, (B, S), d), d.rope_dim)
    return [Variant("prefill_rows", (packed.to(device), d.head_dim, d.rope_dim, torch.bfloat16), {})]


def build_kv_pack(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    return [Variant("new_entries", (_kv_entries(g, (B, S), d).to(device), d.rope_dim), {})]


def _hc_mix_params(g, hc, dim, n_out, device):
    fn = torch.randn(n_out, hc * dim, generator=g) * (hc * dim) ** -0.5
    return fn.to(device)


def build_hc_pre(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    n = (2 + d.hc) * d.hc
    x = _act(g, (B, S, d.hc, d.dim), device)
    scale = (torch.rand(3, generator=g) + 0.5).to(device)
    base = (torch.randn(n, generator=g) * 0.5).to(device)
    return [Variant("layer", (x, _hc_mix_params(g, d.hc, d.dim, n, device), scale, base, 1e-6, 1e-6, 20), {})]


def build_hc_pre_quant(d: Dims, phase: str, g, device):
    (v,) = build_hc_pre(d, phase, g, device)
    return [Variant("layer", (*v.args, (1 + _w(g, (d.dim,), device, 0.1)).float(), 1e-6), {})]


def build_hc_post(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    x = _act(g, (B, S, d.dim), device)
    res = _act(g, (B, S, d.hc, d.dim), device)
    post = (2 * torch.rand(B, S, d.hc, generator=g)).to(device)
    comb = torch.randn(B, S, d.hc, d.hc, generator=g).softmax(-1)
    comb = (comb / comb.sum(-2, keepdim=True)).to(device)
    return [Variant("layer", (x, res, post, comb), {})]


def _grid(g, shape, device, steps: int = 64, unit: float = 2.0 ** -6) -> torch.Tensor:
    """bf16 values on a coarse grid (integers |n| <= steps times `unit`): sums of a few products of them with
    `_post_grid`'s post / comb are exact in float32, so the streams a post-mix writes are the same bits however
    its terms are ordered -- the fused post-mix ops' second halves then compare as their own ops do, not through
    a last-bit flip of a stream element moving a mix (or an FP8 block scale) downstream."""
    return (torch.randint(-steps, steps + 1, shape, generator=g).float() * unit).bfloat16().to(device)


def _post_grid(g, B, S, hc, device) -> tuple[torch.Tensor, torch.Tensor]:
    """post in {0.5, 1, 1.5, 2}, comb in eighths: `_grid`'s exactness."""
    post = torch.randint(1, 5, (B, S, hc), generator=g).float() * 0.5
    comb = torch.randint(0, 9, (B, S, hc, hc), generator=g).float() / 8
    return post.to(device), comb.to(device)


def build_hc_post_pre_quant(d: Dims, phase: str, g, device):
    """The attention's post-mix into the streams (`_grid` operands), then the MoE's pre-mix of them."""
    B, S = _bs(d, phase)
    (q,) = build_hc_pre_quant(d, phase, g, device)
    x, res = _grid(g, (B, S, d.dim), device), _grid(g, (B, S, d.hc, d.dim), device)
    return [Variant("layer", (x, res, *_post_grid(g, B, S, d.hc, device), *q.args[1:]), {})]


def _moe_rows_grid(d: Dims, phase: str, g, device) -> tuple:
    B, S = _bs(d, phase)
    routed, shared = _grid(g, (B * S, d.topk, d.dim), device), _grid(g, (B * S, d.dim), device)
    return routed, shared, _grid(g, (B, S, d.hc, d.dim), device), *_post_grid(g, B, S, d.hc, device)


def build_moe_combine_post_pre_quant(d: Dims, phase: str, g, device):
    """A block's MoE output into its streams (`_grid` operands), then the next block's attention pre-mix."""
    (q,) = build_hc_pre_quant(d, phase, g, device)
    return [Variant("layer", (*_moe_rows_grid(d, phase, g, device), *q.args[1:]), {})]


def build_moe_combine_post_head(d: Dims, phase: str, g, device):
    """The last block's MoE output into its streams (`_grid` operands), then the hc head's collapse."""
    (q,) = build_hc_head(d, phase, g, device)
    return [Variant("last_layer", (*_moe_rows_grid(d, phase, g, device), *q.args[1:]), {})]


def build_hc_head(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    x = _act(g, (B, S, d.hc, d.dim), device)
    scale = (torch.rand(1, generator=g) + 0.5).to(device)
    base = (torch.randn(d.hc, generator=g) * 0.5).to(device)
    return [Variant("head", (x, _hc_mix_params(g, d.hc, d.dim, d.hc, device), scale, base, 1e-6, 1e-6), {})]


def build_moe_route(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    T = B * S
    # the router reads the ffn_norm output: RMS 1 per row, outlier blocks kept. Unnormed rows with 1e2
    # blocks give gate logits of hundreds, where softplus underflows and a row's weights can be 0/0 on one
    # side (a pro-shape hash case on a GPU gave one such NaN row)
    x = _act(g, (T, d.dim), device).float()
    x = (x * torch.rsqrt(x.square().mean(-1, keepdim=True))).bfloat16()
    gate = _w(g, (d.n_experts, d.dim), device, 0.05, torch.bfloat16)
    bias = (torch.randn(d.n_experts, generator=g) * 0.1).to(device)
    ids = torch.randint(0, d.vocab, (T,), generator=g).to(device)
    tid2eid = torch.rand(d.vocab, d.n_experts, generator=g).argsort(-1)[:, : d.topk].int().to(device)
    return [
        Variant("bias_sqrtsoftplus", (x, gate, bias, None, ids, d.topk, "sqrtsoftplus", d.route_scale), {}),
        Variant("hash_tid2eid", (x, gate, None, tid2eid, ids, d.topk, "sqrtsoftplus", d.route_scale), {}),
    ]


def build_swiglu_quant(d: Dims, phase: str, g, device):
    return [Variant(v.name, v.args, {**v.kwargs, "out_dtype": torch.bfloat16}) for v in build_swiglu(d, phase, g, device)]


def build_swiglu(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    M = B * S * (d.topk if phase == "decode" else 1)
    gate = (torch.randn(M, d.moe_inter, generator=g) * 6).bfloat16().to(device)  # crosses the ±10 clamp
    up = (torch.randn(M, d.moe_inter, generator=g) * 6).bfloat16().to(device)
    h13 = (torch.randn(M, 2 * d.moe_inter, generator=g) * 6).bfloat16().to(device)
    w = torch.rand(M, generator=g).to(device)
    return [Variant("expert", (gate, up, d.swiglu_limit), {}),
            # the routed experts' form: the halves of the w1|w3 output in place, weighted, cast for w2
            Variant("routed_weighted", (h13[:, :d.moe_inter], h13[:, d.moe_inter:], d.swiglu_limit),
                    {"weight": w, "out_dtype": torch.bfloat16})]


def build_moe_combine(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    T = B * S
    routed = (torch.randn(T, d.topk, d.dim, generator=g) * 0.1).bfloat16().to(device)
    shared = (torch.randn(T, d.dim, generator=g) * 0.1).bfloat16().to(device)
    return [Variant("local", (routed, shared, torch.bfloat16), {}),
            # expert parallelism: the exchange's rows come back already summed (k = 1), in float32
            Variant("summed", (routed.float().sum(1, keepdim=True), shared, torch.bfloat16), {})]


def build_moe_combine_post(d: Dims, phase: str, g, device):
    (local, _) = build_moe_combine(d, phase, g, device)
    (post,) = build_hc_post(d, phase, g, device)
    _, res, p, c = post.args
    return [Variant("layer", (*local.args[:2], res.bfloat16(), p, c), {})]


POISON = float("nan")


def build_rms_norm_rope_store(d: Dims, phase: str, g, device):
    """Decode's kv norm with its write into the FP8-layout cache: one entry per row at a random ring slot."""
    B = d.decode_batch
    Nslots = d.window
    x = _act(g, (B, 1, d.head_dim), device)
    w = (1 + _w(g, (d.head_dim,), device, 0.1)).float()
    cos, sin = _rope_tables(g, B, 1, d.rope_dim, device)
    packed = torch.full((B + 1, Nslots, kv_packed_width(d.head_dim, d.rope_dim, torch.bfloat16)), 0xFF,
                        dtype=torch.uint8)
    slots = torch.randint(0, Nslots, (B,), generator=g)
    return [Variant("kv_ring", (x, w, 1e-6, cos, sin, d.rope_dim, packed.to(device), torch.arange(B).to(device),
                                slots.to(device), True), {})]


def build_kv_store(d: Dims, phase: str, g, device):
    B, S = _bs(d, phase)
    M = B * S
    R = B + 1  # one spare cache row never written
    Nslots = max(d.window, S)
    cache = torch.full((R, Nslots, d.head_dim), POISON, dtype=torch.bfloat16)
    rows = torch.arange(B).repeat_interleave(S)
    slots = torch.cat([torch.randperm(Nslots, generator=g)[:S] for _ in range(B)])
    values = torch.randn(M, d.head_dim, generator=g).bfloat16()
    # the FP8-layout cache (official decode): each entry packed on the way; unwritten slots keep 0xFF bytes
    packed = torch.full((R, Nslots, kv_packed_width(d.head_dim, d.rope_dim, torch.bfloat16)), 0xFF, dtype=torch.uint8)
    return [Variant("window", (cache.to(device), rows.to(device), slots.to(device), values.to(device)), {}),
            Variant("window_fp8_layout", (packed.to(device), rows.to(device), slots.to(device), values.to(device)),
                    {"rope_dim": d.rope_dim})]


def build_sample(d: Dims, phase: str, g, device):
    B = max(4, d.decode_batch)
    V = d.vocab
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # a greedy tie: the first index must win
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * (B // 4) + [0.8] * (B % 4))
    top_k = torch.tensor([0, 50, 0, 1000] * (B // 4) + [0] * (B % 4))
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.95] * (B // 4) + [1.0] * (B % 4))
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    pos = torch.randint(0, 65536, (B,), generator=g)
    return [Variant("mixed", tuple(t.to(device) for t in (logits, temp, top_k, top_p, seeds, pos)), {})]


def build_spec_probs(d: Dims, phase: str, g, device):
    """The K + 1 target rows of a verify step (greedy with a tie, plain temperatures) over the vocabulary; the
    top-k / top-p cut (a binary search over the sort keys) over a 1024-token slice, so that the CPU
    interpreter runs it in seconds."""
    B = max(4, d.decode_batch)
    logits = torch.randn(B, d.vocab, generator=g) * 3
    logits[0, 5] = logits[0, 7] = logits[0].max() + 1  # a greedy tie: the first index must win
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * (B // 4) + [0.8] * (B % 4))
    off = (torch.zeros(B, dtype=torch.long), torch.ones(B))
    cut = torch.randn(4, 1024, generator=g) * 3
    ct, ck, cp = torch.tensor([0.7, 1.0, 1.3, 1.0]), torch.tensor([50, 0, 200, 1]), torch.tensor([1.0, 0.9, 0.95, 1.0])
    return [Variant("verify_rows", tuple(t.to(device) for t in (logits, temp, *off)), {}),
            Variant("top_k_top_p", tuple(t.to(device) for t in (cut, ct, ck, cp)), {})]


def build_spec_verify(d: Dims, phase: str, g, device):
    """K = 3 drafts per row over the vocabulary: peaked target / draft distributions, drafts half the time
    the target's argmax (acceptance runs of every length), half drawn at random (rejections, residual draws)."""
    B, K, V = max(4, d.decode_batch), 3, d.vocab
    p = (torch.randn(B, K + 1, V, generator=g) * 4).softmax(-1)
    q = (torch.randn(B, K, V, generator=g) * 4).softmax(-1)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.5, p[:, :K].argmax(-1),
                         torch.randint(0, V, (B, K), generator=g))
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    pos = torch.randint(0, 65536, (B,), generator=g)
    return [Variant("k3", tuple(t.to(device) for t in (p, q, drafts, seeds, pos)), {})]


def build_logprobs(d: Dims, phase: str, g, device):
    B = d.decode_batch if phase == "decode" else 1
    return [Variant("lm_head", ((torch.randn(B, d.vocab, generator=g) * 5).to(device),), {})]




def build_apply_token_bitmask(d: Dims, phase: str, g, device):
    """Guided decoding's mask over the LM head's logits: random words, one all-ones row (unconstrained), one
    sparse row (a grammar that allows few tokens)."""
    B = max(2, d.decode_batch) if phase == "decode" else 1
    V = d.vocab
    logits = torch.randn(B, V, generator=g) * 5
    m = torch.randint(-2**31, 2**31, (B, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    m[0] = -1
    if B > 1:
        m[1] &= 0x01000010
    return [Variant("lm_head_mask", (logits.to(device), m.to(device)), {})]

def build_grouped_gemm(d: Dims, phase: str, g, device):
    """Routed experts' w1 (N=moe_inter, K=dim) and w2 (N=dim, K=moe_inter) over all E experts, FP4
    (random codes, power-of-two scales); 1/16 of the rows are padding (-1). expert_w1_topk: w1 as the model
    calls it beyond one token, one A row per token read by its top-k pairs (`topk`)."""
    B, S = _bs(d, phase)
    P, E = B * S * d.topk, d.n_experts
    e = torch.randint(0, E, (P,), generator=g)
    e[torch.randperm(P, generator=g)[: P // 16]] = -1
    out = []
    for nm, N, K in (("expert_w1", d.moe_inter, d.dim), ("expert_w2", d.dim, d.moe_inter)):
        a, a_s = act_quant(_act(g, (P, K), torch.device("cpu")), 128)
        w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
        w_s = torch.exp2(torch.randint(-12, -6, (E, N, K // 32), generator=g).float())
        out.append(Variant(nm, tuple(t.to(device) for t in (a, a_s, e, w, w_s)), {"out_dtype": torch.bfloat16}))
    T = B * S
    if T > 1:
        a, a_s = act_quant(_act(g, (T, d.dim), torch.device("cpu")), 128)
        w, w_s = out[0].args[3], out[0].args[4]
        out.append(Variant("expert_w1_topk", (*(t.to(device) for t in (a, a_s)), out[0].args[2], w, w_s),
                           {"out_dtype": torch.bfloat16, "topk": d.topk}))
    return out


def build_swiglu_grouped_gemm(d: Dims, phase: str, g, device):
    """The routed w2 on w1|w3's output [P, 2·moe_inter] (crossing the ±limit clamp), weighted, over all E FP4 experts;
    1/16 of the rows padding (-1). At decode (one token's top-k in the batch-1 shapes) the kernel computes A."""
    B, S = _bs(d, phase)
    P, E, N, K = B * S * d.topk, d.n_experts, d.dim, d.moe_inter
    h13 = (torch.randn(P, 2 * K, generator=g) * 6).bfloat16()
    wt = torch.rand(P, generator=g)
    e = torch.randint(0, E, (P,), generator=g)
    e[torch.randperm(P, generator=g)[: P // 16]] = -1
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    w_s = torch.exp2(torch.randint(-12, -6, (E, N, K // 32), generator=g).float())
    out = [Variant("expert_w2", (h13.to(device), d.swiglu_limit, wt.to(device), e.to(device), w.to(device),
                                 w_s.to(device)), {"out_dtype": torch.bfloat16})]
    if phase == "decode":  # one token's top-k: the fused kernel's size
        k = d.topk
        out.append(Variant("expert_w2_one_token", (h13[:k].to(device), d.swiglu_limit, wt[:k].to(device),
                                                    e[:k].clamp_min(0).to(device), w.to(device), w_s.to(device)),
                           {"out_dtype": torch.bfloat16}))
    return out


BUILDERS = {name[len("build_"):]: fn for name, fn in globals().items() if name.startswith("build_")}


def build(op: str, dims: Dims, phase: str, seed: int, device) -> list[Variant]:
    """The variants of `op` at `dims`/`phase`, from a generator seeded by (seed, op, shape, phase)."""
    if op not in BUILDERS:
        raise KeyError(f"no A/B case builder for op {op!r}")
    h = _stable_hash(f"{op}/{dims.name}/{phase}")  # not hash(): that is salted per process
    g = torch.Generator().manual_seed((seed * 1_000_003 + h) % (2**63))
    return BUILDERS[op](dims, phase, g, torch.device(device))


def _stable_hash(s: str) -> int:
    import zlib

    return zlib.crc32(s.encode())


def shape_summary(args) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append("x".join(map(str, a.shape)) or "scalar")
    return " ".join(parts[:3]) + (" …" if len(parts) > 3 else "")


__all__ = ["SHAPES", "PHASES", "Dims", "Variant", "CompareSpec", "COMPARE", "BUILDERS", "build", "POISON",
           "shape_summary"]
