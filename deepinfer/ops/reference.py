"""Plain-PyTorch reference of every op: the spec each kernel is tested against.

Written to read like the paper and the official inference code (`inference/model.py`, `kernel.py`),
computing in float32 where the official kernels accumulate in float32. Shapes use B batch, S query
positions, H heads, D head dim, T compressed entries, K selected entries, E experts, V vocab.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import RefParts, composition, defop
from deepinfer.quant.formats import dequant_fp4, dequant_fp8_block, fp4_round
from deepinfer.quant.grouped import grouped_bmm
from deepinfer.quant.kv_layout import kv_packed_width, kv_rope_offset, kv_scale_bytes

FP8_MAX = 448.0
FP4_MAX = 6.0


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive float32 x, exactly (frexp avoids log2 rounding at powers of two)."""
    m, e = torch.frexp(x)
    # x = m * 2^e with m in [0.5, 1): a power of two has m == 0.5 and is its own ceiling.
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(x), e)


# --------------------------------------------------------------------------------------------- norms
_REF = RefParts()  # the parts' references: what a composition's reference runs with

@defop("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32; `weight=None` is the unweighted form (V4's q head norm)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------- quantisation
@defop("act_quant", tol={"float32": (0.0, 0.0), "float8_e4m3fn": (0.0, 0.0)})
def act_quant(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 activation quantisation per `block` along the last dim, power-of-two (ue8m0) scales.

    x [..., K] -> (q float8_e4m3fn [..., K], s float32 [..., K/block]); x ≈ q * s.
    amax is floored at 1e-4 as the official kernel does, so a zero block gets a finite scale.
    """
    K = x.size(-1)
    assert K % block == 0, f"act_quant: last dim {K} is not a multiple of {block}"
    xb = x.float().unflatten(-1, (K // block, block))
    amax = xb.abs().amax(-1).clamp_min(1e-4)
    s = _pow2_ceil(amax / FP8_MAX)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def bf16_split(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """An act_quant'd activation as the FP4 expert GEMM reads it: q [..., K] e4m3 (K % 128 == 0) times its
    per-128 scales s [..., K/128], in bf16 (exact: e4m3 x 2^k), each 128-K block as its 64 even then its 64
    odd columns (the two dot operands of a 128-K step) -> [..., K] bfloat16."""
    K = q.size(-1)
    v = (q.float().unflatten(-1, (K // 128, 128)) * s.float().unsqueeze(-1)).to(torch.bfloat16)
    return v.unflatten(-1, (64, 2)).transpose(-1, -2).flatten(-3)


def _quant_outputs(q: torch.Tensor, s: torch.Tensor, block: int, split: bool, op: str) -> tuple:
    """An op's act_quant outputs (q, s), followed by `bf16_split(q, s)` when `split` (block 128 only)."""
    if not split:
        return q, s
    assert block == 128, f"{op}: split needs block 128, not {block}"
    return q, s, bf16_split(q, s)


@defop("rms_norm_quant", tol={"float8_e4m3fn": (0.13, 1e-6), "float32": (1e-5, 1e-5), "bfloat16": (1e-2, 1e-2)})
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float, block: int = 128,
                   split: bool = False) -> tuple:
    """RMSNorm and the FP8 quantisation of its output for the FP8 GEMMs it feeds, in one op.

    x [..., K] -> (y = rms_norm(x) in x's dtype, q float8_e4m3fn [..., K], s float32 [..., K/block]) with
    (q, s) = act_quant(y, block) exactly: y is rounded to x's dtype first, as when a Linear quantises it.
    split (block 128): a fourth output, `bf16_split(q, s)`, the form FP4 experts read (`grouped_gemm`'s a_split).
    Tolerance: y as rms_norm; q within one e4m3 step (a last-bit difference in y may flip a rounding); the
    split form is q x s, so backends are compared on it through q and s (tests: bit for bit against
    `bf16_split` of their own q, s).
    """
    return _rms_norm_quant(_REF, x, weight, eps, block, split)


@composition("rms_norm_quant", ("rms_norm", "act_quant"))
def _rms_norm_quant(p, x, weight, eps, block: int = 128, split: bool = False) -> tuple:
    y = p["rms_norm"](x, weight, eps)
    return (y, *_quant_outputs(*p["act_quant"](y, block), block, split, "rms_norm_quant"))


@defop("fp8_fake_quant", tol={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)})
def fp8_fake_quant(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Quantise-dequantise through FP8 e4m3 per `block` (power-of-two scales); returns x's dtype.

    The official code applies this to the KV cache's no-RoPE dims (block 64) to match its QAT.
    """
    return _fp8_fake_quant(_REF, x, block)


@composition("fp8_fake_quant", ("act_quant",))
def _fp8_fake_quant(p, x, block: int = 64) -> torch.Tensor:
    q, s = p["act_quant"](x, block)  # q x s is exact: s is a power of two
    return (q.float().unflatten(-1, (-1, block)) * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


@defop("fp4_fake_quant", tol={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)})
def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Quantise-dequantise through FP4 e2m1 per `block` with power-of-two scales (indexer q/k QAT)."""
    K = x.size(-1)
    xb = x.float().unflatten(-1, (K // block, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    s = _pow2_ceil(amax / FP4_MAX)
    y = fp4_round((xb / s).clamp(-FP4_MAX, FP4_MAX)) * s
    return y.flatten(-2).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _hadamard_matrix(n: int, device: str) -> torch.Tensor:
    assert n & (n - 1) == 0, f"Hadamard size {n} is not a power of two"
    h = torch.ones(1, 1)
    while h.size(0) < n:  # Sylvester construction: natural order, as fast_hadamard_transform uses
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n**-0.5).to(device)


@defop("hadamard")
def hadamard(x: torch.Tensor, fp4_block: int = 0) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of the last dim (size a power of two), x's dtype out.

    fp4_block > 0: then `fp4_fake_quant(·, fp4_block)` of that output, as the official indexer rotates and
    FP4-rounds its queries and keys (`rotate_activation`, then the FP4 simulation): one op, so a kernel backend
    does both in one pass (one launch fewer per use)."""
    h = _hadamard_matrix(x.size(-1), str(x.device))
    y = (x.float() @ h).to(x.dtype)
    return fp4_fake_quant(y, fp4_block) if fp4_block else y


# -------------------------------------------------------------------------------------------- GEMMs
@defop("fp8_gemm", tol={"float32": (1e-5, 1e-5)})
def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C = A Wᵀ with FP8 A (per-128 K scales) and FP8 W (128x128 block scales), fp32 accumulate.

    a [M, K] float8_e4m3fn, a_s [M, K/128] f32, w [N, K] float8_e4m3fn, w_s [ceil(N/128), ceil(K/128)] f32
    -> [M, N] out_dtype. Scales are powers of two, so scaling before the product is exact.
    """
    M, K = a.shape
    af = a.float() * a_s.repeat_interleave(128, -1)[:, :K]
    wf = _fp8_weight_f32(w, w_s)
    return (af @ wf.t()).to(out_dtype)


@defop("act_quant_fp8_gemm", tol={"float32": (1e-5, 1e-5)})
def act_quant_fp8_gemm(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An FP8 Linear on an activation not yet quantised: fp8_gemm(*act_quant(x, 128), w, w_s) in one op, so a
    kernel backend may quantise A's 128-blocks as it loads them (no launch, no q / s round trip between the
    two: at decode the act_quant before wo_b is a launch on the critical path of every layer).
    x [M, K] float (K % 128 == 0), w [N, K] e4m3, w_s [ceil(N/128), K/128] -> [M, N] out_dtype."""
    return _act_quant_fp8_gemm(_REF, x, w, w_s, out_dtype)


@composition("act_quant_fp8_gemm", ("act_quant", "fp8_gemm"))
def _act_quant_fp8_gemm(p, x, w, w_s, out_dtype=torch.bfloat16) -> torch.Tensor:
    q, s = p["act_quant"](x, 128)
    return p["fp8_gemm"](q, s, w, w_s, out_dtype)


@defop("fp4_gemm", tol={"float32": (1e-5, 1e-5)})
def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C = A Wᵀ with FP8 A (per-128 K scales) and FP4 e2m1 W (int8-packed, per-32 K scales).

    a [M, K] float8_e4m3fn, a_s [M, K/128] f32, w [N, K/2] int8, w_s [N, K/32] f32 or ue8m0 bytes
    -> [M, N] out_dtype.
    """
    K = a.size(-1)
    af = a.float() * a_s.repeat_interleave(128, -1)[:, :K]
    wf = _fp4_weight_f32(w, w_s)
    return (af @ wf.t()).to(out_dtype)


@defop("fp8_grouped_linear")
def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """Grouped projection with an FP8 weight, as the official code runs V4's `wo_a`: its convert step
    dequantises the weight to the compute dtype, then y[t, g] = x[t, g] W_gᵀ per group (bmm, fp32 accumulate).

    x [T, G, K] compute dtype (any strides), w [G·R, K] float8_e4m3fn (group g's rows g·R .. g·R+R-1),
    w_s [ceil(G·R/128), ceil(K/128)] f32 (powers of two: the dequantised weight is exact in bf16)
    -> [T, G, R] in x's dtype.
    """
    T, G, K = x.shape
    N = w.size(0)
    return grouped_bmm(x, dequant_fp8_block(w, w_s, out_dtype=x.dtype, check=False).view(G, N // G, K))


@defop("linear")
def linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain y = x Wᵀ (bf16/fp32 weights, no quantisation), computed and returned in out_dtype (default
    x's dtype): F.linear(x.to(out_dtype), w.to(out_dtype)). out_dtype float32 with bf16 x and W is the
    official compressor's x.float() @ W.float() without either copy in the kernels."""
    dt = out_dtype or x.dtype
    if w.dtype != dt and w.device.type == "cpu" and w.numel() >= 1 << 22:
        # the LM head on a CPU: its kept fp32 copy transposed ([K, N] contiguous) runs faster in MKL's
        # sgemm at a few rows than F.linear's [N, K] (same products, fp32 accumulation)
        wt = _keep(w, f"_deepinfer_{str(dt)[6:]}_t", lambda: w.to(dt).t().contiguous())
        return torch.matmul(x.to(dt), wt)
    return F.linear(x.to(dt), _working_copy(w, dt))


# On a CPU the reference keeps the float32 working copy of a stored weight (the bf16 LM head read as fp32,
# an FP8 / FP4 weight dequantised) on the weight tensor itself, so it lives exactly as long as the weight
# (weights never change in place). Recomputing them every decode step was most of deepinfer-tiny's CPU
# step time. The values are the ones the conversion computes each call; a cap bounds the extra memory.
WORKING_CAP = 2 << 30
_working_bytes = 0


def _keep(w: torch.Tensor, key: str, make) -> torch.Tensor:
    global _working_bytes
    if w.device.type != "cpu":
        return make()
    c = getattr(w, key, None)
    if c is None:
        c = make()
        if _working_bytes + c.nbytes > WORKING_CAP:
            return c
        _working_bytes += c.nbytes
        setattr(w, key, c)
        weakref.finalize(w, _release, c.nbytes)  # the copy goes with its weight: give its bytes back
    return c


def _release(nbytes: int) -> None:
    global _working_bytes
    _working_bytes -= nbytes


def _working_copy(w: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """w in dt (kept on CPU: `_keep`)."""
    if w.dtype == dt:
        return w
    return _keep(w, f"_deepinfer_{str(dt)[6:]}", lambda: w.to(dt))


def _fp8_weight_f32(w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """An FP8 weight [..., N, K] with its 128x128 block scales [..., ceil(N/128), ceil(K/128)] (f32 or ue8m0),
    dequantised to float32 (kept on CPU)."""
    return _keep(w, "_deepinfer_deq", lambda: dequant_fp8_block(w, w_s, check=False))


def _fp4_weight_f32(w: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """An FP4 weight [..., N, K/2] int8 with per-32 scales [..., N, K/32] (f32 or ue8m0), dequantised to float32
    (kept on CPU)."""
    return _keep(w, "_deepinfer_deq", lambda: dequant_fp4(w, w_s, check=False))


# --------------------------------------------------------------------------------------------- RoPE
@defop("rope")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Interleaved rotary embedding of x's last dim (pairs (2i, 2i+1)), in float32.

    x [B, S, H, R] (or [B, S, R]), cos/sin [B, S, R/2]. `inverse` rotates by -θ (the output
    de-rotation). Returns x's dtype; written into `out` (x's shape and dtype, may be x itself: in place)
    when given, and `out` returned.
    """
    if out is not None:
        return out.copy_(rope(x, cos, sin, inverse))
    squeeze = x.dim() == 3
    if squeeze:
        x = x.unsqueeze(2)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()
    if inverse:
        s = -s
    y = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).to(x.dtype)
    return y.squeeze(2) if squeeze else y


@defop("decode_tables", tol={"float32": (0.0, 0.0), "int64": (0.0, 0.0)})
def decode_tables(pos: torch.Tensor, main: torch.Tensor, compress: torch.Tensor, ratios: tuple[int, ...],
                  win: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's position tables, every layer's in one op (the memos of `StepContext`, which the model
    otherwise builds a few launches each, on the layer that first asks).

    pos [B] int64 query positions; main / compress [max_pos, 2, R/2] float32 (`RopeTables`: cos then sin of a
    position); ratios: the model's compression ratios -> (cs, idx):
    cs [2 + nr, B, 1, 2, R/2] float32: main at pos, compress at pos, then per ratio r compress at
    max(pos - (r - 1), 0) (the window a compressor completes starts there);
    idx [1 + 2 nr, B] int64: pos % win (the ring slot), per ratio pos // r (the entry slot), then per ratio
    (pos + 1) // r (the entries complete). Gathers and integer arithmetic: kernels give these bits.
    """
    gathers = [main[pos], compress[pos]] + [compress[(pos - (r - 1)).clamp_min(0)] for r in ratios]
    cs = torch.stack(gathers).unsqueeze(2)
    idx = torch.stack([pos % win] + [pos // r for r in ratios] + [(pos + 1) // r for r in ratios])
    return cs, idx


# bf16: one ulp of the norm's output (its rsqrt may differ from torch's in the last fp32 bits and flip a bf16
# rounding) moves a rotated value by up to one ulp of the pair's larger input, ~2^-5 for normalised values < 4,
# even where the rotated value itself is near 0
NORM_FORMS = ("module", "official_q", "transformers_q")


def head_norm(x: torch.Tensor, eps: float, form: str) -> torch.Tensor:
    """The unweighted per-head RMSNorm of V4's queries, rounded where each implementation rounds (x's dtype
    out; in float32 the three forms agree):

    * "module": the RMSNorm module's form, fp32 throughout and one rounding (`rms_norm(x, None, eps)`);
    * "official_q": DeepSeek's inference/model.py, Attention.forward (release 60d8d707),
      `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)` on wq_b's output in the compute
      dtype: the square, the mean, the + eps, the rsqrt and the product each rounded to x's dtype;
    * "transformers_q": transformers' DeepseekV4UnweightedRMSNorm, `x * torch.rsqrt(x.float().square()
      .mean(-1, keepdim=True) + eps).to(x.dtype)`: the scale in fp32 rounded once, the product in x's dtype.
    """
    if form == "module":
        return rms_norm(x, None, eps)
    if form == "official_q":
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    if form == "transformers_q":
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    raise ValueError(f"head norm form {form!r}: choose {', '.join(NORM_FORMS)}")


@defop("rms_norm_rope", tol={"bfloat16": (2e-2, 2.0**-5)})
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  rd: int, form: str = "module") -> torch.Tensor:
    """`rms_norm`, then `rope` of the last `rd` dims of its output (V4 keeps the RoPE dims last): the q head
    norm, the kv norm and the compressors' entry norm are each followed by this rotation.

    x [B, S, H, d] or [B, S, d] (any strides), weight [d] or None, cos / sin [B, S, rd/2] -> x's shape and
    dtype. The rotation reads the norm's output in x's dtype, as the two ops in turn do. `form` (weight
    None only): where the norm rounds, `head_norm`'s forms.
    """
    if form != "module":
        if weight is not None:
            raise ValueError(f"rms_norm_rope form {form!r} is the unweighted q head norm: weight must be None")
        y = head_norm(x, eps, form).contiguous()
        tail = y[..., -rd:]
        tail.copy_(rope(tail, cos, sin))
        return y
    y = rms_norm(x, weight, eps)
    tail = y[..., -rd:]
    tail.copy_(rope(tail, cos, sin))
    return y


@defop("rms_norm_rope_store", tol={"bfloat16": (2e-2, 2.0**-5)})
def rms_norm_rope_store(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, rd: int, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                        pack: bool) -> torch.Tensor:
    """Decode's kv norm with its cache write, in one op: y = `rms_norm_rope(x, weight, eps, cos, sin, rd)`, then
    `kv_store(cache, rows, slots, y's rows, rope_dim=rd if pack else 0)` (pack: the FP8 KV layout, packed on the
    way). x [B, 1, d] or [B, d] (one entry per row), rows / slots [B] -> y (x's shape and dtype); cache written
    in place. Kernels may pack each entry in the norm's launch; the values are the two ops'."""
    return _rms_norm_rope_store(_REF, x, weight, eps, cos, sin, rd, cache, rows, slots, pack)


@composition("rms_norm_rope_store", ("rms_norm_rope", "kv_store"))
def _rms_norm_rope_store(p, x, weight, eps, cos, sin, rd, cache, rows, slots, pack) -> torch.Tensor:
    y = p["rms_norm_rope"](x, weight, eps, cos, sin, rd)
    p["kv_store"](cache, rows, slots, y.reshape(-1, y.size(-1)), rope_dim=rd if pack else 0)
    return y


# ------------------------------------------------------------------------------ compressor, indexer
@defop("compress_pool")
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Gated pooling of a window: softmax over the window slots per channel, weighted sum.

    kv, score [B, W, slots, D] float32 (score already carries the `ape` position bias; -inf slots have
    weight 0) -> [B, W, D] float32.
    """
    return (kv.float() * score.float().softmax(dim=2)).sum(dim=2)


@defop("compress_prefill")
def compress_prefill(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, start: int, rows: torch.Tensor,
                     kv_state: torch.Tensor, score_state: torch.Tensor, overlap: bool, fresh: bool = False,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A prompt chunk through a compressor's windows: the windows it completes pooled, the carry-over stored.

    kv, score [B, S, coff·d] float32: the chunk's wkv / wgate projections at positions start .. start+S-1
    (coff = 2 if `overlap`; rows may be strided views, e.g. the two halves of one fused projection);
    ape [r, coff·d] the window-position bias (a token at position p scores + ape[p % r]); rows [B] state rows,
    distinct (kernels update each row's state in place, one program per row and channel block);
    kv_state, score_state [R, coff·r, coff·d] float32: row rows[b] holds what precedes `start` (with `overlap`,
    slots 0..r-1 the previous window's, then from slot r the current window's first start % r tokens; else those
    from slot 0; empty slots kv 0 and score -inf). fresh: start is 0 and the rows' state is neither read nor
    reset, only written (a new sequence, whatever the row held). The rows' state is replaced by the carry-over
    after the chunk, as one pass over the whole prompt would leave it.
    Returns [B, n, d] in `out_dtype` (pooled in float32, then cast), n = (start % r + S) // r: `compress_pool`
    of each window the chunk completes (overlap: the previous window's r slots of the first d channels, then
    the window's r slots of the last d channels -- an empty previous window for the first; else its r slots).
    """
    B, S = kv.shape[:2]
    r = ape.size(0)
    d = kv.size(-1) // (2 if overlap else 1)
    off = r if overlap else 0
    w0, part = start - start % r, start % r
    if fresh and start:
        raise ValueError(f"compress_prefill: a fresh chunk starts at position 0, not {start}")
    phase = torch.arange(start, start + S, device=kv.device) % r
    kv_seq, sc_seq = kv.float(), score.float() + ape.float()[phase]  # the state's scores already have ape
    st_kv, st_sc = (None, None) if fresh else (kv_state[rows], score_state[rows])
    if part:  # the sequence from the current window's first position w0: carried partial window + the tokens
        kv_seq = torch.cat([st_kv[:, off:off + part], kv_seq], 1)
        sc_seq = torch.cat([st_sc[:, off:off + part], sc_seq], 1)
    L = part + S
    n = L // r  # windows completed here
    cutoff = n * r
    new_kv = kv_seq.new_zeros(B, *kv_state.shape[1:])
    new_sc = kv_seq.new_full((B, *kv_state.shape[1:]), float("-inf"))
    if overlap:  # next window's overlap half: the last complete window's slots (or the old one)
        if n:
            new_kv[:, :r], new_sc[:, :r] = kv_seq[:, cutoff - r:cutoff], sc_seq[:, cutoff - r:cutoff]
        elif not fresh:
            new_kv[:, :r], new_sc[:, :r] = st_kv[:, :r], st_sc[:, :r]
    if L % r:
        new_kv[:, off:off + L % r], new_sc[:, off:off + L % r] = kv_seq[:, cutoff:], sc_seq[:, cutoff:]
    kv_state[rows], score_state[rows] = new_kv, new_sc
    if n == 0:
        return kv_seq.new_zeros(B, 0, d).to(out_dtype)
    kvw = kv_seq[:, :cutoff].unflatten(1, (n, r))
    scw = sc_seq[:, :cutoff].unflatten(1, (n, r))
    if overlap:  # slots: previous window's first half | this window's second half
        # window w0/r - 1: the state's overlap half, empty (weight 0) for a fresh sequence
        if fresh:
            before_kv, before_sc = kvw.new_zeros(B, 1, r, d), kvw.new_full((B, 1, r, d), float("-inf"))
        else:
            before_kv, before_sc = st_kv[:, None, :r, :d], st_sc[:, None, :r, :d]
        kvw = torch.cat([torch.cat([before_kv, kvw[:, :-1, :, :d]], 1), kvw[..., d:]], 2)
        scw = torch.cat([torch.cat([before_sc, scw[:, :-1, :, :d]], 1), scw[..., d:]], 2)
    return compress_pool(kvw, scw).to(out_dtype)


@defop("compress_decode")
def compress_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                    kv_state: torch.Tensor, score_state: torch.Tensor, overlap: bool,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One decode token through a compressor's carried window: the state update and the window's pooling.

    kv, score [B, coff·d] float32: this token's wkv / wgate projections (coff = 2 if `overlap` else 1; rows
    may be strided views, e.g. the two halves of one fused projection);
    ape [r, coff·d] the window-position bias; pos [B] positions; rows [B] state rows (a row listed twice,
    as the decode runner's padding entries share a spare row, ends in an unspecified state);
    kv_state, score_state [R, coff·r, coff·d] float32, updated in place: the token lands in slot
    (r if overlap else 0) + pos % r with score + ape[pos % r]; with `overlap`, once its window completes
    ((pos + 1) % r == 0) the second half becomes the next window's overlap half (both halves = it).
    Returns [B, d] in `out_dtype` (pooled in float32, then cast): `compress_pool` of the row's current
    window (overlap: the previous window's r slots of the first d channels, then this window's r slots of
    the last d channels; else its r slots) -- the entry once the window is complete.
    """
    r = ape.size(0)
    d = kv.size(-1) // (2 if overlap else 1)
    score = score + ape[pos % r]
    slot = (r if overlap else 0) + pos % r
    st_kv, st_sc = kv_state[rows], score_state[rows]
    ar = torch.arange(len(rows), device=kv.device)
    st_kv[ar, slot], st_sc[ar, slot] = kv, score
    if overlap:
        kvw = torch.cat([st_kv[:, :r, :d], st_kv[:, r:, d:]], 1)
        scw = torch.cat([st_sc[:, :r, :d], st_sc[:, r:, d:]], 1)
        m = ((pos + 1) % r == 0).view(-1, 1, 1)
        kv_state[rows] = torch.where(m, torch.cat([st_kv[:, r:], st_kv[:, r:]], 1), st_kv)
        score_state[rows] = torch.where(m, torch.cat([st_sc[:, r:], st_sc[:, r:]], 1), st_sc)
    else:
        kvw, scw = st_kv, st_sc
        kv_state[rows], score_state[rows] = st_kv, st_sc
    return compress_pool(kvw.unsqueeze(1), scw.unsqueeze(1))[:, 0].to(out_dtype)


@defop("indexer_scores", tol={"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2)})
def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, rows: torch.Tensor | None = None,
                   w_scale: float = 1.0, rounding: str = "fp32") -> torch.Tensor:
    """Lightning-indexer scores Σ_h w'[b,s,h] · relu(q[b,s,h]·k[b,t]), w' = w · w_scale.

    q [B, S, H, D], k [B, T, D], w [B, S, H] (the head weights as projected; w_scale = D^-0.5 · H^-0.5, the
    model's scale) -> [B, S, T] f32.
    rows [B] int64: k is a key cache [R, T, D] and batch b scores against k[rows[b]] (decode reads the
    cache in place instead of gathering every row's keys first).
    rounding "fp32": every step in float32 (w' = w.float() * w_scale). "bf16": where DeepSeek's model.py
    `Indexer.forward` rounds -- its einsum of bf16 q and keys returns bf16 logits (fp32 accumulation),
    `weights_proj(x) * scale` is bf16, so is relu(logits) * w', and `.sum(dim=2)` over the heads accumulates
    in fp32 and rounds once to bf16: scores on the bf16 grid, where ties are common (`topk_indices` breaks
    them towards the lower index, as torch.topk's CUDA selection does).
    """
    if rounding not in ("fp32", "bf16"):
        raise ValueError(f"indexer_scores rounding {rounding!r}: fp32 | bf16")
    if rows is not None:
        k = k[rows]
    if rounding == "bf16":
        bf = torch.bfloat16
        logits = torch.einsum("bshd,btd->bsht", q.to(bf), k.to(bf))
        return (logits.relu() * (w.to(bf) * w_scale).unsqueeze(-1)).sum(dim=2).float()
    logits = torch.einsum("bshd,btd->bsht", q.float(), k.float())
    return (logits.relu() * (w.float() * w_scale).unsqueeze(-1)).sum(dim=2)


@defop("topk_indices", tol={"int64": (0.0, 0.0)})
def topk_indices(scores: torch.Tensor, k: int, n_valid: torch.Tensor) -> torch.Tensor:
    """Indices of the k largest scores per row among the first `n_valid` entries; -1 pads.

    scores [B, S, T] f32, n_valid [B, S] int64 (entries j >= n_valid are not yet complete) ->
    [B, S, k] int64. Tie-break: among equal scores the LOWER index wins (stable descending sort), so
    the selection is deterministic on every backend -- ReLU scores tie at exactly 0 often.
    """
    T = scores.size(-1)
    j = torch.arange(T, device=scores.device)
    valid = j < n_valid.unsqueeze(-1)
    masked = scores.float().masked_fill(~valid, float("-inf"))
    idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    if idx.size(-1) < k:
        idx = F.pad(idx, (0, k - idx.size(-1)), value=-1)
    ok = (idx >= 0) & (idx < n_valid.unsqueeze(-1))
    return torch.where(ok, idx, torch.full_like(idx, -1))


# ---------------------------------------------------------------------------------------- attention
@defop("decode_slots", tol={"int64": (0.0, 0.0)})
def decode_slots(pos: torch.Tensor, rows: torch.Tensor, win: int, n_slots: int, entries: torch.Tensor | None = None,
                 n_entries: int = 0, ratio: int = 0) -> torch.Tensor:
    """The cache slots each decode query attends, as rows of the layer's cache viewed as one flat sequence
    [R x n_slots] (row r's slot i at r x n_slots + i; -1 = none).

    pos [B] int64 query positions, rows [B] int64 cache rows; per row n_slots = win ring slots (position p
    at slot p % win) then the compressed entries. -> [1, B, win + k] int64: the ring's slots oldest position
    first -- slot (pos + 1 + c) % win for c < win once the ring is full (pos >= win - 1), else slot c while
    c <= pos, then -1 -- then the compressed entries: CSA `entries` [B, 1, k] or [B, k] (the top-k, -1 =
    none), or HCA (`ratio`) entries j < n_entries complete at pos (j < (pos + 1) // ratio), or none.
    The ring's order is model.py's `get_window_topk_idxs` for decode: `sparse_attn` takes its slots in
    blocks in this order, and the blocks decide where its probabilities round.
    """
    base = (rows * n_slots).unsqueeze(-1)
    c = torch.arange(win, device=pos.device)
    p = pos.unsqueeze(-1)
    full = p >= win - 1
    w = torch.where(full, (p + 1 + c) % win, c)
    idx = torch.where(full | (c <= p), w + base, -1)
    if entries is not None:
        e = entries.reshape(pos.size(0), -1)
        idx = torch.cat([idx, torch.where(e >= 0, e + base + win, -1)], -1)
    elif ratio:
        j = torch.arange(n_entries, device=pos.device)
        idx = torch.cat([idx, torch.where(j < ((pos + 1) // ratio).unsqueeze(-1), j + base + win, -1)], -1)
    return idx.unsqueeze(0)


SPARSE_ATTN_BLOCK = 64
"""Slots per step of the online softmax: kernel.py `sparse_attn_kernel`, `block = 64`."""


@defop("sparse_attn", tol={"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 1e-2)})
def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Shared-KV sparse attention with an attention sink, for prefill and decode alike.

    q [B, S, H, D], kv [B, N, D] (K = V), sink [H] f32 (a learned logit in the denominator only),
    idx [B, S, K] int (rows of kv; -1 = empty) -> [B, S, H, D] in q's dtype. A query whose K slots are
    all empty gets 0.

    Rounded where DeepSeek's kernel.py `sparse_attn_kernel` rounds: the slots are taken in idx's order in
    blocks of SPARSE_ATTN_BLOCK; logits (q . kv) * scale in fp32; a running max m over the logits only (the
    sink joins at the end: `sum_exp += exp(attn_sink - scores_max)`); each block's p = exp(logit - m) summed
    in fp32 unrounded but cast to the operands' dtype for the P V product (`T.copy(acc_s, acc_s_cast)`, bf16)
    whose fp32 accumulator is rescaled by exp(m_prev - m) as m grows. In float32 the cast is exact and this
    is the plain softmax(logits ++ sink) V that transformers computes.
    """
    B, S, H, D = q.shape
    K = idx.size(-1)
    g = torch.gather(kv.float(), 1, idx.clamp_min(0).reshape(B, -1, 1).expand(-1, -1, D).long())
    g = g.view(B, S, -1, D)  # [B, S, K, D]
    logits = torch.einsum("bshd,bskd->bshk", q.float(), g) * scale
    logits = logits.masked_fill(~(idx >= 0).unsqueeze(2), float("-inf"))
    m = torch.full((B, S, H, 1), float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, S, H, D, device=q.device)
    for k0 in range(0, K, SPARSE_ATTN_BLOCK):
        s = logits[..., k0:k0 + SPARSE_ATTN_BLOCK]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_use = m_new.nan_to_num(neginf=0.0)  # no valid slot yet: p = exp(-inf) = 0, nothing to rescale
        alpha = torch.exp(m - m_use)
        p = torch.exp(s - m_use)
        l = l * alpha + p.sum(-1, keepdim=True)
        pv = torch.einsum("bshk,bskd->bshd", p.to(q.dtype).float(), g[:, :, k0:k0 + SPARSE_ATTN_BLOCK])
        acc = acc * alpha + pv
        m = m_new
    l = l + torch.exp(sink.float().view(1, 1, H, 1) - m.nan_to_num(neginf=0.0))
    return (acc / l).to(q.dtype)


@defop("kv_pack", tol={"uint8": (0.0, 0.0)})
def kv_pack(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """The FP8 KV cache layout of entries kv [..., D] (last `rope_dim` dims RoPE'd) -> uint8 [..., W]:

    [D - rope_dim e4m3 codes | one ue8m0 scale byte per 64 of them, zero-padded to a multiple of 16 |
     the rope_dim RoPE dims in kv's dtype, as bytes] with W = `kv_packed_width`. The codes and scales are
    `act_quant(kv_nope, 64)`, the official QAT of the cache, so unpacking gives `fp8_fake_quant(kv_nope,
    64)` exactly (packing an already fake-quantised kv is lossless: its blocks requantise to themselves).
    """
    D = kv.size(-1)
    nope = D - rope_dim
    assert nope > 0 and nope % 64 == 0, f"kv_pack: {nope} no-RoPE dims are not a positive multiple of 64"
    q, s = act_quant(kv[..., :nope], 64)
    sb = ((s.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # power-of-two scale -> its biased exponent
    pad = sb.new_zeros(*sb.shape[:-1], kv_scale_bytes(nope) - sb.size(-1))
    rope = kv[..., nope:].contiguous().view(torch.uint8)
    codes = q.view(torch.uint8)
    codes = torch.where(codes == 0x80, 0, codes)  # -0 as +0: one byte pattern per value, compared bytewise
    return torch.cat([codes, sb, pad, rope], -1)


@defop("kv_unpack", tol={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0), "float16": (0.0, 0.0)})
def kv_unpack(packed: torch.Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `kv_pack`: uint8 [..., W] -> [..., head_dim] in `dtype` (the rope part's storage dtype)."""
    nope = head_dim - rope_dim
    W = kv_packed_width(head_dim, rope_dim, dtype)
    assert packed.dtype == torch.uint8 and packed.size(-1) == W, \
        f"kv_unpack: expected uint8 [..., {W}] for head_dim {head_dim}, got {packed.dtype} {list(packed.shape)}"
    codes = packed[..., :nope].contiguous().view(torch.float8_e4m3fn).float()
    s = (packed[..., nope:nope + nope // 64].to(torch.int32) << 23).view(torch.float32)
    deq = (codes.unflatten(-1, (-1, 64)) * s.unsqueeze(-1)).flatten(-2)
    rope = packed[..., kv_rope_offset(head_dim, rope_dim):].contiguous().view(dtype)
    return torch.cat([deq.to(dtype), rope], -1)


@defop("sparse_attn_fp8", tol={"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 1e-2)})
def sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                    rope_dim: int, out_rope: tuple | None = None) -> torch.Tensor:
    """`sparse_attn` reading the FP8 KV layout: kv uint8 [B, N, W] (`kv_pack` of [B, N, D] entries whose
    rope part is in q's dtype) -> [B, S, H, D], equal to `sparse_attn` on the unpacked entries.
    out_rope (cos, sin) [B, S, rope_dim/2]: the output's last rope_dim dims then de-rotated, `rope(...,
    inverse=True)` of the output in its dtype (the attention output's RoPE removal, fused by backends)."""
    o = sparse_attn(q, kv_unpack(kv, q.size(-1), rope_dim, q.dtype), sink, idx, scale)
    if out_rope is not None:
        o[..., -rope_dim:] = rope(o[..., -rope_dim:], *out_rope, inverse=True)
    return o


@defop("q_norm_sparse_attn_fp8", tol={"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 1e-2)})
def q_norm_sparse_attn_fp8(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                           rope_dim: int, eps: float, form: str, rope: tuple) -> torch.Tensor:
    """Decode's q head norm and sparse attention in one op: `sparse_attn_fp8(rms_norm_rope(q, None, eps, *rope,
    rope_dim, form), kv, sink, idx, scale, rope_dim, out_rope=rope)`.

    q [B, S, H, D]: wq_b's output per head, before its unweighted norm (`head_norm`'s `form`) and the RoPE of
    its last rope_dim dims; rope (cos, sin) [B, S, rope_dim/2]: that RoPE, and the output's inverse one. kv,
    sink, idx as `sparse_attn_fp8` -> [B, S, H, D]. Kernels may normalise and rotate each q tile as they load
    it (no launch, no q round trip through memory between the two); the values are the two ops'."""
    return _q_norm_sparse_attn_fp8(_REF, q, kv, sink, idx, scale, rope_dim, eps, form, rope)


@composition("q_norm_sparse_attn_fp8", ("rms_norm_rope", "sparse_attn_fp8"))
def _q_norm_sparse_attn_fp8(p, q, kv, sink, idx, scale, rope_dim, eps, form, rope) -> torch.Tensor:
    qn = p["rms_norm_rope"](q, None, eps, *rope, rope_dim, form=form)
    return p["sparse_attn_fp8"](qn, kv, sink, idx, scale, rope_dim, out_rope=rope)


# ---------------------------------------------------------------------------------------------- mHC
@defop("hc_pre", tol={"float32": (1e-5, 1e-5)})
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, hc_eps: float, iters: int, side=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre-mix: mixes from the RMS-normalised streams, Sinkhorn comb, collapse with `pre`.

    x [B, S, hc, D], fn [(2+hc)·hc, hc·D], scale [3], base [(2+hc)·hc] (all f32) ->
    (y [B, S, D] x's dtype, post [B, S, hc] f32, comb [B, S, hc, hc] f32) with
    pre = σ(·)+eps, post = 2σ(·), comb = Sinkhorn(softmax(·)) doubly stochastic.
    side: a context manager (`deepinfer.model.branch.Branch`) under which a backend may compute post and
    comb, on a second stream; the caller joins it before reading them. Same values either way; this
    reference computes everything in place.
    """
    hc = x.size(2)
    xf = x.flatten(2).float()
    rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(xf, fn.float()) * rsqrt
    pre_l, post_l, comb_l = mixes.split([hc, hc, hc * hc], dim=-1)
    pre = torch.sigmoid(pre_l * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(post_l * scale[1] + base[hc:2 * hc])
    comb = (comb_l * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=2)
    return y.to(x.dtype), post, comb


@defop("hc_pre_quant", tol={"float8_e4m3fn": (0.13, 1e-6), "float32": (1e-5, 1e-5), "bfloat16": (2e-2, 1e-2)})
def hc_pre_quant(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_eps: float,
                 hc_eps: float, iters: int, weight: torch.Tensor | None, eps: float, side=None, split: bool = False
                 ) -> tuple:
    """`hc_pre`, then `rms_norm_quant` of its y (a sub-layer's normed input and its FP8 form), in one op.

    x [B, S, hc, D] and the mHC parameters as `hc_pre`; weight [D] (or None), eps: the sub-layer's norm ->
    (y [B, S, D] x's dtype, q float8_e4m3fn [B, S, D], s f32 [B, S, D/128], post, comb). `side` as `hc_pre`;
    split: `rms_norm_quant`'s fourth output after s (y, q, s, split, post, comb).
    y is rounded to x's dtype before the norm, as between the two ops, so two roundings stand between a
    backend's y and this one's: bf16 tolerance 2e-2 relative (two ulps just above a power of two are 1.6 %),
    q within one e4m3 step as `rms_norm_quant`.
    """
    return _hc_pre_quant(_REF, x, fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side, split)


@composition("hc_pre_quant", ("hc_pre", "rms_norm_quant"))
def _hc_pre_quant(p, x, fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side=None, split: bool = False) -> tuple:
    y, post, comb = p["hc_pre"](x, fn, scale, base, norm_eps, hc_eps, iters)
    return (*p["rms_norm_quant"](y, weight, eps, split=split), post, comb)


@defop("hc_post_pre_quant", tol={"float8_e4m3fn": (0.13, 1e-6), "float32": (1e-5, 1e-5), "bfloat16": (2e-2, 1e-2)})
def hc_post_pre_quant(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      scale: torch.Tensor, base: torch.Tensor, norm_eps: float, hc_eps: float, iters: int,
                      weight: torch.Tensor | None, eps: float, side=None, split: bool = False) -> tuple:
    """One sub-layer's mHC post-mix and the next one's pre-mix with its norm and FP8 form, in one op: h =
    `hc_post(x, residual, post, comb)`, then `hc_pre_quant(h, fn, scale, base, norm_eps, hc_eps, iters, weight, eps,
    side, split)` -> (h [B, S, hc, D], y, q, s[, the split form], post', comb'). Kernels may write h inside the
    pre-mix's first launch (no launch, no boundary between the two at decode); the values are the two ops'."""
    return _hc_post_pre_quant(_REF, x, residual, post, comb, fn, scale, base, norm_eps, hc_eps, iters, weight, eps,
                              side, split)


@composition("hc_post_pre_quant", ("hc_post", "hc_pre_quant"))
def _hc_post_pre_quant(p, x, residual, post, comb, fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side=None,
                       split: bool = False) -> tuple:
    h = p["hc_post"](x, residual, post, comb)
    return (h, *p["hc_pre_quant"](h, fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side=side, split=split))


@defop("moe_combine_post_pre_quant",
       tol={"float8_e4m3fn": (0.13, 1e-6), "float32": (1e-5, 1e-5), "bfloat16": (2e-2, 1e-2)})
def moe_combine_post_pre_quant(routed: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                               comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                               norm_eps: float, hc_eps: float, iters: int, weight: torch.Tensor | None, eps: float,
                               side=None, split: bool = False) -> tuple:
    """A block's MoE output into its streams and the next block's attention pre-mix, in one op: h =
    `moe_combine_post(routed, shared, residual, post, comb)`, then `hc_pre_quant(h, ...)` -> (h, y, q, s[, split
    form], post', comb'), as `hc_post_pre_quant` for the attention's output."""
    return _moe_combine_post_pre_quant(_REF, routed, shared, residual, post, comb, fn, scale, base, norm_eps, hc_eps,
                                       iters, weight, eps, side, split)


@composition("moe_combine_post_pre_quant", ("moe_combine_post", "hc_pre_quant"))
def _moe_combine_post_pre_quant(p, routed, shared, residual, post, comb, fn, scale, base, norm_eps, hc_eps, iters,
                                weight, eps, side=None, split: bool = False) -> tuple:
    h = p["moe_combine_post"](routed, shared, residual, post, comb)
    return (h, *p["hc_pre_quant"](h, fn, scale, base, norm_eps, hc_eps, iters, weight, eps, side=side, split=split))


@defop("moe_combine_post_head", tol={"float32": (1e-5, 1e-5)})
def moe_combine_post_head(routed: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                          comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                          norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last block's MoE output into its streams and the hc head's collapse of them, in one op: (h =
    `moe_combine_post(routed, shared, residual, post, comb)`, `hc_head(h, fn, scale, base, norm_eps, hc_eps)`)."""
    return _moe_combine_post_head(_REF, routed, shared, residual, post, comb, fn, scale, base, norm_eps, hc_eps)


@composition("moe_combine_post_head", ("moe_combine_post", "hc_head"))
def _moe_combine_post_head(p, routed, shared, residual, post, comb, fn, scale, base, norm_eps, hc_eps) -> tuple:
    h = p["moe_combine_post"](routed, shared, residual, post, comb)
    return h, p["hc_head"](h, fn, scale, base, norm_eps, hc_eps)


@defop("hc_post")
def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC post-mix: new stream k = post_k · x + Σ_j comb[j, k] · residual_j (comb transposed).

    x [B, S, D], residual [B, S, hc, D], post [B, S, hc], comb [B, S, hc, hc] -> [B, S, hc, D] x's dtype.
    """
    y = post.unsqueeze(-1) * x.float().unsqueeze(-2) + torch.einsum("bsjk,bsjd->bskd", comb, residual.float())
    return y.to(x.dtype)


@defop("hc_head")
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Final stream collapse (no Sinkhorn): y = Σ_j (σ(mix_j·scale + base_j) + eps) · x_j.

    x [B, S, hc, D], fn [hc, hc·D], scale [1], base [hc] -> [B, S, D] x's dtype.
    """
    xf = x.flatten(2).float()
    rsqrt = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(xf, fn.float()) * rsqrt
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)


# ---------------------------------------------------------------------------------------------- MoE
# Scores come from K = hidden (4096-7168) long fp32 dot products: two correct summation orders differ by
# up to ~K·2^-24·Σ|x·w| per element, which with cancellation reaches 1e-4 of the score (flash shapes, on a GPU).
@defop("moe_route", tol={"float32": (1e-4, 1e-5)})
def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
              input_ids: torch.Tensor, topk: int, score_func: str, route_scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router: scores in fp32, bias for selection only, hash table for the first layers.

    x [T, D], gate_w [E, D], bias [E] or None, tid2eid [V, k] or None, input_ids [T] ->
    (weights [T, k] f32 summing to route_scale, indices [T, k] int64, scores [T, E] f32).
    Top-k ties break towards the lower expert id (stable sort), as in `topk_indices`.
    """
    logits = F.linear(x.float(), gate_w.float())
    if score_func == "softmax":
        scores = logits.softmax(-1)
    elif score_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    if tid2eid is not None:
        indices = tid2eid[input_ids].long()  # hash routing ignores the bias
    else:
        sel = scores + bias.float() if bias is not None else scores
        indices = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(1, indices)
    if score_func != "softmax":
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * route_scale, indices, scores


@defop("swiglu")
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Clamped SwiGLU in float32: silu(min(gate, limit)) · clamp(up, -limit, limit) (limit 0: no clamp).

    gate, up [..., N]; weight [...] (optional): each row times its routing weight, in float32 (the
    official code scales a routed expert's activation before w2); the result cast to `out_dtype`
    (default float32)."""
    g, u = gate.float(), up.float()
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    y = F.silu(g) * u
    if weight is not None:
        y = weight.float().unsqueeze(-1) * y
    return y if out_dtype is None else y.to(out_dtype)


@defop("swiglu_quant", tol={"float8_e4m3fn": (0.13, 2.0**-9), "float32": (1e-5, 1e-5), "bfloat16": (0.13, 2.0**-9)})
def swiglu_quant(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, block: int = 128, split: bool = False) -> tuple:
    """The clamped SwiGLU and the FP8 quantisation of its output for the FP8 / FP4 w2 it feeds, in one op:
    act_quant(swiglu(gate, up, limit, weight, out_dtype), block) -> (q float8_e4m3fn [..., N], s float32
    [..., N/block]). The activation is rounded to out_dtype first, as when w2's Linear quantises it.
    split (block 128): also `bf16_split(q, s)`, the form an FP4 w2 reads (`grouped_gemm`'s a_split), so its
    GEMM need not convert it in a launch of its own.
    Tolerance: q within one e4m3 step (a last-bit difference in the activation may flip a rounding): 1/8
    relative for normal codes, 2^-9 absolute for the subnormal ones (the activation's many near-zero values
    in a block scaled for its largest); the split form, q x s, likewise."""
    return _swiglu_quant(_REF, gate, up, limit, weight, out_dtype, block, split)


@composition("swiglu_quant", ("swiglu", "act_quant"))
def _swiglu_quant(p, gate, up, limit, weight=None, out_dtype=torch.bfloat16, block: int = 128,
                  split: bool = False) -> tuple:
    return _quant_outputs(*p["act_quant"](p["swiglu"](gate, up, limit, weight, out_dtype), block), block, split,
                          "swiglu_quant")


@defop("swiglu_grouped_gemm", tol={"float32": (1e-5, 1e-5)})
def swiglu_grouped_gemm(h: torch.Tensor, limit: float, weight: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                        w_s: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The routed experts' down projection on their w1|w3 output, in one op: `grouped_gemm(*swiglu_quant(h[:, :I],
    h[:, I:], limit, weight, out_dtype), e, w, w_s, out_dtype)` -- the clamped SwiGLU weighted by each pair's
    routing weight, rounded to out_dtype, act_quant per 128, then row p through expert e[p]'s w2.

    h [P, 2I] (gate | up, as the stacked w1|w3 GEMM writes them), weight [P] f32 or None, e [P] int64 local ids
    (-1: a zero row), w [E, N, I] FP8 with w_s [E, N/128, I/128] f32, or FP4 [E, N, I/2] with w_s [E, N, I/32]
    (float w2 runs swiglu, then grouped_gemm) -> [P, N] out_dtype. Kernels may compute the activation and its
    quantisation as they load each A block (no launch between the two GEMMs); the values are the same."""
    return _swiglu_grouped_gemm(_REF, h, limit, weight, e, w, w_s, out_dtype)


@composition("swiglu_grouped_gemm", ("swiglu_quant", "grouped_gemm"))
def _swiglu_grouped_gemm(p, h, limit, weight, e, w, w_s, out_dtype=torch.bfloat16) -> torch.Tensor:
    fp4 = w.dtype in (torch.int8, torch.uint8)
    if not fp4 and w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"swiglu_grouped_gemm: w2 must be FP8 or FP4 expert stacks, not {w.dtype} (a float w2 "
                         "runs swiglu, then grouped_gemm)")
    I = h.size(-1) // 2
    a = p["swiglu_quant"](h[:, :I], h[:, I:], limit, weight=weight, out_dtype=out_dtype, split=fp4)
    return p["grouped_gemm"](a[0], a[1], e, w, w_s, out_dtype=out_dtype, a_split=a[2] if fp4 else None)


@defop("moe_combine")
def moe_combine(routed: torch.Tensor, shared: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A MoE layer's output: the sum over k of each token's routed rows plus its shared-expert row, in
    float32, cast to `out_dtype`.

    routed [T, k, D] (the weighted expert outputs of a token's k pairs; k = 1 for a form already summed),
    shared [T, D] -> [T, D]."""
    return (routed.float().sum(1) + shared.float()).to(out_dtype)


@defop("moe_combine_post")
def moe_combine_post(routed: torch.Tensor, shared: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> torch.Tensor:
    """A MoE layer's output straight into its mHC post-mix: `hc_post(moe_combine(routed, shared, residual.dtype),
    residual, post, comb)`, the sub-layer output rounded to the streams' dtype in between as the two ops do.

    routed [T, k, D], shared [T, D] (T = B·S), residual [B, S, hc, D], post [B, S, hc], comb [B, S, hc, hc] ->
    the new streams [B, S, hc, D] in residual's dtype."""
    return _moe_combine_post(_REF, routed, shared, residual, post, comb)


@composition("moe_combine_post", ("moe_combine", "hc_post"))
def _moe_combine_post(p, routed, shared, residual, post, comb) -> torch.Tensor:
    B, S, _, D = residual.shape
    return p["hc_post"](p["moe_combine"](routed, shared, residual.dtype).view(B, S, D), residual, post, comb)


# ------------------------------------------------------------------------------------------- caches
@defop("kv_store", tol={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0)})
def kv_store(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
             rope_dim: int = 0) -> None:
    """In-place cache write: cache[rows[i], slots[i]] = values[i].

    cache [R, N, D], rows [M] int64, slots [M] int64, values [M, D]. Host-sync free (graph safe).
    rope_dim > 0: the cache is the FP8 layout (uint8 [R, N, W]) and each row is packed on the way,
    `kv_pack(values, rope_dim)` (values [M, head_dim] in their float dtype).
    """
    if rope_dim:
        values = kv_pack(values, rope_dim)
    cache[rows, slots] = values.to(cache.dtype)


# ------------------------------------------------------------------------------------------ sampling
def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix in int64 arithmetic (products stay below 2^63)."""
    m = 0xFFFFFFFF
    x = x & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x45D9F3B & m
    x = ((x >> 16) ^ x) * 0x2C1B3C6D & m
    return (x >> 16) ^ x


@defop("sample", tol={"int64": (0.0, 0.0)})
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Next token per row: greedy where temperature == 0, else Gumbel-max over the top-k/top-p set.

    logits [B, V] f32, temperature/top_p [B] f32, top_k [B] int64 (0 = off), seeds/positions [B] int64
    -> [B] int64. The noise is a counter-based hash of (seed, position, token id): the same seed and
    inputs give the same tokens on every device and batch layout, and nothing syncs with the host.
    """
    B, V = logits.shape
    lf = logits.float()
    greedy = lf.argmax(-1)  # first maximal index on ties
    if logits.device.type == "cpu" and temperature.shape == (B,) and not bool((temperature > 0).any()):
        return greedy  # all greedy: skip the sort (on a CPU the check costs no device sync)
    masked = _kept_logits(lf, temperature, top_k, top_p)
    drawn = (masked.double() + _gumbel(seeds, positions, V)).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


def _kept_logits(lf: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                 ) -> torch.Tensor:
    """The distribution `sample` draws from, as logits: lf [B, V] f32 / temperature, -inf outside the top-k /
    top-p set (stable descending order; the first token always kept; top_p >= 1 cuts nothing)."""
    V = lf.size(-1)
    t = temperature.float().clamp_min(1e-5).unsqueeze(-1)
    scaled = lf / t
    sorted_l, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=lf.device).unsqueeze(0)
    keep = torch.ones_like(sorted_l, dtype=torch.bool)
    k = top_k.unsqueeze(-1)
    keep &= (k <= 0) | (rank < k)
    probs = sorted_l.softmax(-1)
    before = probs.cumsum(-1) - probs  # mass strictly above this token
    # top_p >= 1 is no cut: the fp32 cumsum can reach 1.0 before the tail, and `before < 1` would drop it
    keep &= (before < top_p.float().unsqueeze(-1)) | (top_p.float().unsqueeze(-1) >= 1.0)
    keep[:, 0] = True
    masked_sorted = sorted_l.masked_fill(~keep, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, masked_sorted)


def _counter(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, 1] the per-(seed, position) hash every sampling draw of that position derives from."""
    return _hash32((seeds.long().unsqueeze(-1) * 0x9E3779B1 + positions.long().unsqueeze(-1) * 0x85EBCA77)
                   & 0xFFFFFFFF)


def _gumbel(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] float64 Gumbel noise of token ids 0 .. V-1 at (seed, position): the hash of the counter and
    the token id."""
    h = _hash32(_counter(seeds, positions) ^ torch.arange(V, device=seeds.device).unsqueeze(0))
    u = (h.double() + 0.5) / 2.0**32
    return -torch.log(-torch.log(u))


DRAFT_SEED_SALT = 0x5DEECE66D
"""Added to a request's seed for its draft tokens' noise (`sample` on the MTP logits): independent of the
noise `spec_verify` draws the emitted tokens with at the same positions."""
ACCEPT_SALT = 0xA5A5A5A5
"""The acceptance uniform of position t is the hash of t's counter with this value in place of a token id
(above any vocabulary id, so it never coincides with a token's Gumbel noise)."""


# fp32 softmax over the vocabulary (129 280 terms): the reference itself is 2.8e-5 relative (7.6e-6 absolute) off
# float64 at tiny shapes, the Triton kernel's blocked sums 3e-6 relative
@defop("spec_probs", tol={"float32": (1e-4, 1e-6)})
def spec_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
               ) -> torch.Tensor:
    """The distribution `sample` draws from, as probabilities (speculative decoding's p and q).

    logits [B, V], temperature / top_p [B] f32, top_k [B] int64 -> [B, V] float32: softmax of the logits over
    temperature inside the top-k / top-p set (`sample`'s keep rule), 0 outside; temperature 0: one-hot of
    the argmax (first index on ties), so greedy rows go through rejection sampling unchanged (accept iff
    the draft is the argmax; the residual is the argmax's one-hot).
    """
    lf = logits.float()
    greedy = F.one_hot(lf.argmax(-1), lf.size(-1)).float()
    if logits.device.type == "cpu" and not bool((temperature > 0).any()):
        return greedy  # all greedy: skip the sort (on a CPU the check costs no device sync)
    drawn = _kept_logits(lf, temperature, top_k, top_p).softmax(-1)
    return torch.where((temperature > 0).unsqueeze(-1), drawn, greedy)


@defop("spec_verify", tol={"int64": (0.0, 0.0)})
def spec_verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of K draft tokens per row (speculative decoding): accept, residual draw, bonus.

    p [B, K+1, V] f32 the target's distributions at the K+1 verified positions (`spec_probs`), q [B, K, V]
    the drafts' distributions, drafts [B, K] int64 (draft j drawn from q[:, j]), seeds [B] int64,
    positions [B] int64: the position of the first draft token -> (n [B] int64 accepted drafts 0 .. K,
    token [B] int64 the token after them).
    Draft j (at position t = positions + j) is accepted when u_j · q_j(d_j) <= p_j(d_j), u_j uniform in
    (0, 1) from the hash of (seed, t) (`ACCEPT_SALT`); n is the number accepted before the first
    rejection. The token after them, at position t' = positions + n, is the Gumbel-max with (seed, t')'s
    noise (`sample`'s) over the residual max(0, p_n - q_n) (normalising does not move an argmax), or over
    p_K when all K were accepted (the bonus token). The emitted tokens are then distributed exactly as the
    target's (Leviathan et al. 2023); one-hot p and q (greedy) give the target's argmax. Nothing syncs.
    """
    B, K1, V = p.shape
    K = K1 - 1
    pos = positions.long().unsqueeze(-1) + torch.arange(K1, device=p.device)  # [B, K+1]
    pd = p[:, :K].float().gather(-1, drafts.long().unsqueeze(-1))[..., 0]
    qd = q.float().gather(-1, drafts.long().unsqueeze(-1))[..., 0]
    h = _hash32(_counter(seeds.repeat_interleave(K1), pos.flatten()) ^ ACCEPT_SALT).view(B, K1)[:, :K]
    u = (h.double() + 0.5) / 2.0**32
    ok = u * qd.double() <= pd.double()
    n = ok.long().cumprod(-1).sum(-1)  # accepted before the first rejection
    ar = torch.arange(B, device=p.device)
    pn = p[ar, n].float()
    qn = torch.where((n < K).unsqueeze(-1), q[ar, n.clamp(max=max(K - 1, 0))].float(), 0.0) if K else 0.0
    resid = (pn - qn).clamp_min(0.0)
    resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, pn)  # (rounding only: p_n <= q_n everywhere)
    tok = (resid.double().log() + _gumbel(seeds, positions.long() + n, V)).argmax(-1)
    return n, tok


@defop("logprobs", tol={"float32": (1e-6, 1e-5)})
def logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log-softmax of the model's raw logits in float32: [B, V] -> [B, V]."""
    return torch.log_softmax(logits.float(), dim=-1)


@defop("apply_token_bitmask", tol={"float32": (0.0, 0.0), "bfloat16": (0.0, 0.0), "float16": (0.0, 0.0)})
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with the tokens a packed bitmask forbids set to -inf (guided decoding).

    logits [B, V], bitmask [B, W] int32: token v is allowed when bit v % 32 of word v // 32 is set (W =
    ceil(V / 32); tokens past 32 W are forbidden, bits past V ignored) -> a new [B, V] tensor, the logits'
    dtype, allowed entries unchanged. A row of all-ones words leaves the row as it is.
    """
    B, V = logits.shape
    W = bitmask.size(-1)
    v = torch.arange(V, device=logits.device)
    word = bitmask.long()[:, (v // 32).clamp_max(max(W - 1, 0))] if W else torch.zeros(B, V, dtype=torch.long,
                                                                                          device=logits.device)
    allowed = (((word >> (v % 32)) & 1) == 1) & (v // 32 < W)
    return logits.masked_fill(~allowed, float("-inf"))


# ------------------------------------------------------------------------------- grouped expert GEMM
@defop("grouped_gemm", tol={"float32": (1e-5, 1e-5)})
def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor | None, e: torch.Tensor, w: torch.Tensor,
                 w_s: torch.Tensor | None, out_dtype: torch.dtype = torch.bfloat16,
                 a_split: torch.Tensor | None = None, topk: int = 1) -> torch.Tensor:
    """Per-row expert GEMM: C[p] = A[p // topk] · W[e[p]]ᵀ (the routed experts' w1 / w3 / w2 in one call).

    a [P, K]: float8_e4m3fn with a_s [P, K/128] f32 (act_quant), or a float dtype with a_s None.
    a_split: optional, `bf16_split(a, a_s)` when a's producer wrote it too (`swiglu_quant(split=True)`); the
    same values, so the result is the same -- kernels for FP4 weights read it instead of converting a.
    e [P] int64 local expert ids; -1 marks a padding row, whose output row is 0.
    w [E, N, K] float8_e4m3fn + w_s [E, ceil(N/128), ceil(K/128)] f32 (fp8_gemm per expert), or
    [E, N, K/2] int8 e2m1 pairs + w_s [E, N, K/32] f32 or ue8m0 bytes (fp4_gemm per expert), or [E, N, K] float + None
    (linear per expert, in a's dtype). -> [P, N] out_dtype.
    topk: a holds one row per token, feeding its topk consecutive pairs (a [T, K], a_s and a_split likewise, e
    [T * topk]; vLLM's fused_moe gathers its A rows the same way): the same result as a, a_s repeated topk times
    row by row, without the copy (a flash prefill's routed w1|w3 input: 100 MB per layer as FP8).
    Reference: a host-synchronising loop over the experts present (the kernels sort rows by expert).
    """
    if topk != 1:
        from deepinfer.quant.grouped import repeat_rows

        a, a_s = repeat_rows(topk, e, a, a_s)
    P, N = a.size(0), w.size(1)
    out = torch.zeros(P, N, dtype=out_dtype, device=a.device)
    # on a CPU every expert's weight is dequantised once and kept (`_keep`: what fp8_gemm / fp4_gemm compute
    # per expert); on a GPU per expert, as the experts present need (all of V4-Pro's at once are 31 GiB)
    kept = w.device.type == "cpu" and w.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8)
    if kept:
        wf = _fp8_weight_f32(w, w_s) if w.dtype == torch.float8_e4m3fn else _fp4_weight_f32(w, w_s)
        af = a.float() * a_s.repeat_interleave(128, -1)[:, :a.size(-1)]
    for j in torch.unique(e).tolist():
        if j < 0:
            continue
        (p,) = torch.where(e == j)
        if kept:
            out[p] = (af[p] @ wf[j].t()).to(out_dtype)
        elif w.dtype == torch.float8_e4m3fn:
            out[p] = fp8_gemm(a[p], a_s[p], w[j], w_s[j], out_dtype=out_dtype)
        elif w.dtype in (torch.int8, torch.uint8):
            out[p] = fp4_gemm(a[p], a_s[p], w[j].view(torch.int8), w_s[j], out_dtype=out_dtype)
        else:
            out[p] = linear(a[p], w[j]).to(out_dtype)
    return out
