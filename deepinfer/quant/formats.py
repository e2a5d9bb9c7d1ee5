"""Checkpoint number formats of DeepSeek-V4, as pure PyTorch functions.

Everything here is vectorised tensor code (no Python loops over elements), so it
runs unchanged on CPU and CUDA. It is the reference for the formats; fast kernels
elsewhere are checked against it.

Formats
-------
ue8m0 (a.k.a. e8m0, safetensors ``F8_E8M0``, ``torch.float8_e8m0fnu``)
    A scale stored as one unsigned byte ``b`` that is *only an exponent*:
    value = 2**(b - 127), b in 0..254; b == 255 is NaN. There is no sign, no
    mantissa and no zero. A byte must never be read as the number ``b``
    (``s.view(torch.uint8).float()`` gives plausible-looking garbage); every
    decode in this module goes through :func:`e8m0_to_float`.

FP8 e4m3 (``torch.float8_e4m3fn``), dense weights
    A weight ``[N, K]`` in e4m3 (max 448, 3 mantissa bits, subnormals down to
    2**-9, no inf, 0x7F/0xFF are NaN) with one ue8m0 scale per 128x128 block:
    scale ``[ceil(N/128), ceil(K/128)]``. real = fp8 value * scale of its block.

FP4 e2m1, routed-expert weights
    A logical weight ``[N, K]`` stored as int8 ``[N, K/2]`` (safetensors ``I8``),
    two 4-bit codes per byte along K, LOW nibble first: element 2i is the low
    nibble of byte i, element 2i+1 the high nibble. A code's bit 3 is the sign,
    bits 0..2 index the magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6]. One ue8m0 scale
    per 32 consecutive K elements: scale ``[N, K/32]``.

Power-of-two scale rounding (activations, weight quantisation)
    s = 2**ceil(log2(max(amax, amin) / fmax)), fmax = 448 (e4m3) or 6 (e2m1).
    The clamp ``amin`` keeps s away from 0 (1e-4 for FP8 activations,
    6 * 2**-126 for FP4). Rounding the scale *up* guarantees |x / s| <= fmax.

FP4 -> FP8 upcast
    The official ``convert.py`` turns FP4 experts into FP8 blocks losslessly by
    folding each 32-group's scale into the values: see :func:`fp4_to_fp8_block`.

Conventions: scales are returned as raw ``uint8`` bytes (the unambiguous
on-disk form); :func:`e8m0_bytes_as_dtype` views them as ``float8_e8m0fnu``
for writing ``F8_E8M0`` safetensors. Functions that consume scales accept
``torch.float8_e8m0fnu`` or ``torch.uint8`` and reject every other integer dtype,
int8 included (a signed byte is ambiguous: is 0x80 the exponent byte 128 or -128?);
the dequantisers and :func:`scale_f32` also take scales already decoded to a
float dtype, the form the model holds them in. Checks that could let a NaN
through raise instead (they cost one host sync); the dequantisers' ``check=False``
skips them for callers on the device's hot path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "FP8_ACT_AMIN",
    "FP4_AMIN",
    "FP4_VALUES",
    "e8m0_to_float",
    "float_to_e8m0",
    "e8m0_bytes_as_dtype",
    "scale_f32",
    "pow2_scale",
    "fp4_unpack",
    "fp4_pack",
    "fp4_round",
    "dequant_fp8_block",
    "quant_fp8_block",
    "dequant_fp4",
    "quant_fp4",
    "fp4_to_fp8_block",
]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0  # largest e2m1 magnitude
FP8_ACT_AMIN = 1e-4  # amax floor for FP8 activations/weights (official kernel.py)
FP4_AMIN = 6.0 * 2.0**-126  # amax floor for FP4: makes the smallest scale 2^-126, a normal float32

# Nibble code -> value. Index = code; bit 3 is the sign, so -0.0 sits at code 8.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_MAGNITUDES = FP4_VALUES[:8]
# Midpoints between neighbouring magnitudes, the decision points of fp4_round.
_FP4_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_FP4_MAGNITUDES[:-1], _FP4_MAGNITUDES[1:]))

_E8M0_NAN_BYTE = 255
_E8M0_BIAS = 127
_F32_NAN_BITS = 0x7FC00000
_F32_2_POW_M127_BITS = 0x00400000  # 2^-127 is a float32 subnormal: mantissa bit 22 only

_table_cache: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}


def _const(name: str, values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    # Small lookup tables, built once per device so hot callers do not pay a
    # host->device copy per call.
    key = (name, dtype, device)
    t = _table_cache.get(key)
    if t is None:
        t = torch.tensor(values, dtype=dtype, device=device)
        _table_cache[key] = t
    return t


def _e8m0_raw_bytes(s: Tensor, what: str = "scale") -> Tensor:
    """View an e8m0 scale tensor as its raw bytes: uint8, same shape (no copy)."""
    if s.dtype == torch.float8_e8m0fnu:
        return s.view(torch.uint8)
    if s.dtype == torch.uint8:
        return s
    raise TypeError(
        f"{what}: expected ue8m0 scales as torch.float8_e8m0fnu or torch.uint8 (raw bytes), got {s.dtype}"
        + (" (signed bytes are ambiguous; view the raw bytes as torch.uint8)" if s.dtype == torch.int8 else "")
    )


def _counts(*flags: Tensor) -> list[int]:
    # One host sync for several checks instead of one per .item().
    return torch.stack([f.sum() for f in flags]).tolist()


def _checked_scale(scale: Tensor, what: str) -> Tensor:
    """Decode e8m0 scales to float32, raising ValueError if any byte is the NaN byte 255."""
    b = _e8m0_raw_bytes(scale, what)
    (n_nan,) = _counts(b == _E8M0_NAN_BYTE)
    if n_nan:
        raise ValueError(f"{what}: {n_nan} of {b.numel()} ue8m0 scale bytes are 255 (NaN)")
    return e8m0_to_float(b)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _mul_block_scale(x: Tensor, s: Tensor, bn: int, bk: int) -> Tensor:
    """Multiply each (bn x bk) block of x by its scale.

    x: float [..., N, K]; s: float [..., ceil(N/bn), ceil(K/bk)] -> float [..., N, K].
    Ragged edges are handled by zero padding then slicing, so no [N, K] copy of
    the scales is ever materialised.
    """
    *lead, n, k = x.shape
    nb, kb = s.shape[-2:]
    pn, pk = nb * bn - n, kb * bk - k
    if pn or pk:
        x = F.pad(x, (0, pk, 0, pn))
    y = x.reshape(*lead, nb, bn, kb, bk) * s.reshape(*lead, nb, 1, kb, 1)
    y = y.reshape(*lead, nb * bn, kb * bk)
    if pn or pk:
        y = y[..., :n, :k].contiguous()  # callers view and hand the result on as a weight
    return y


def _block_amax(x: Tensor, bn: int, bk: int) -> Tensor:
    """Max of |x| per (bn x bk) block: float [..., N, K] -> [..., ceil(N/bn), ceil(K/bk)].

    Padding is with zeros, which never wins a max of absolute values.
    """
    *lead, n, k = x.shape
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    pn, pk = nb * bn - n, kb * bk - k
    a = x.abs()
    if pn or pk:
        a = F.pad(a, (0, pk, 0, pn))
    return a.reshape(*lead, nb, bn, kb, bk).amax(dim=(-3, -1))


def _check_scale_shape(scale: Tensor, expect: tuple[int, ...], what: str) -> None:
    if tuple(scale.shape) != tuple(expect):
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} does not match expected {tuple(expect)}")


def _require_finite(x: Tensor, what: str) -> None:
    (n_bad,) = _counts(~torch.isfinite(x))
    if n_bad:
        raise ValueError(f"{what}: {n_bad} of {x.numel()} elements are not finite (NaN or inf)")


# --------------------------------------------------------------------------- ue8m0


def e8m0_to_float(s: Tensor) -> Tensor:
    """Decode ue8m0 scales to float32: 2**(b - 127), NaN for b == 255.

    s: torch.float8_e8m0fnu or torch.uint8 (raw bytes), any shape ->
    float32, same shape. Any other dtype (int8 included) raises TypeError.

    The float32 is assembled from its bit pattern rather than through pow/ldexp:
    byte b in 1..254 is exactly the float32 exponent field (b << 23), and b == 0
    (2**-127) is the float32 subnormal with only mantissa bit 22 set. That is
    exact on every device, with no libm and no flush-to-zero in the way.
    """
    b = _e8m0_raw_bytes(s, "e8m0_to_float").to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, _F32_2_POW_M127_BITS), b << 23)
    bits = torch.where(b == _E8M0_NAN_BYTE, torch.full_like(b, _F32_NAN_BITS), bits)
    return bits.view(torch.float32)


def float_to_e8m0(s: Tensor) -> Tensor:
    """Encode exact powers of two as ue8m0 bytes.

    s: floating tensor, any shape, every element an exact power of two in
    [2**-127, 2**127] -> uint8 bytes, same shape (byte = log2(s) + 127).

    Raises TypeError for non-floating input and ValueError (with counts) if any
    element is not a power of two (0, negatives, inf, NaN, 3.0, ...) or lies
    outside the e8m0 range: nothing is silently rounded or turned into NaN.
    """
    if not s.is_floating_point():
        raise TypeError(f"float_to_e8m0: expected a floating tensor of powers of two, got {s.dtype}")
    # float64 holds every float32/bf16/fp16 value exactly and 2^-127 as a
    # normal, so frexp there is exact and sees no subnormals.
    x = s.to(torch.float64)
    m, e = torch.frexp(x)  # x = m * 2^e, m in [0.5, 1) for positive finite x
    exp = e.to(torch.int32) - 1
    is_pow2 = torch.isfinite(x) & (m == 0.5)
    in_range = is_pow2 & (exp >= -_E8M0_BIAS) & (exp <= _E8M0_BIAS)
    n_not_pow2, n_out = _counts(~is_pow2, is_pow2 & ~in_range)
    if n_not_pow2 or n_out:
        raise ValueError(
            f"float_to_e8m0: {n_not_pow2} of {x.numel()} elements are not powers of two "
            f"(0, negative, inf and NaN count as not), {n_out} are powers of two outside [2^-127, 2^127]"
        )
    return (exp + _E8M0_BIAS).to(torch.uint8)


def e8m0_bytes_as_dtype(b: Tensor) -> Tensor:
    """View raw ue8m0 bytes as torch.float8_e8m0fnu (no copy), e.g. to save as safetensors F8_E8M0.

    b: uint8, any shape -> float8_e8m0fnu view, same shape and storage.
    """
    if b.dtype != torch.uint8:
        raise TypeError(f"e8m0_bytes_as_dtype: expected raw bytes as torch.uint8, got {b.dtype}")
    return b.view(torch.float8_e8m0fnu)


def scale_f32(s: Tensor, what: str = "scale_f32") -> Tensor:
    """Scales as float32, same shape: ue8m0 bytes (float8_e8m0fnu or uint8, as the checkpoint and the stacked
    FP4 experts hold them) decoded by :func:`e8m0_to_float`, scales already in a float dtype cast.

    Any other dtype (int8 included) raises TypeError naming `what`.
    """
    if s.dtype != torch.float8_e8m0fnu and s.is_floating_point():
        return s.float()
    return e8m0_to_float(_e8m0_raw_bytes(s, what))


def pow2_scale(amax: Tensor, fmax: float, amin: float) -> Tensor:
    """Power-of-two scale s = 2**ceil(log2(max(amax, amin) / fmax)), float32.

    amax: floating tensor, any shape (block max of |x|) -> float32, same shape.
    fmax: the format's largest magnitude (448 for e4m3, 6 for e2m1).
    amin: floor for amax, > 0, so s is never 0 (1e-4 for FP8, 6*2**-126 for FP4).

    Mirrors the official kernel.py ``fast_round_scale`` bit for bit: it multiplies
    by the float32 reciprocal ``1/fmax`` (not a division) and takes ceil(log2) from
    the float32 bits (exponent field, +1 if any mantissa bit is set), so there is
    no log2/ceil rounding to worry about. A product that is a float32 subnormal
    gives 2**-126, as in the kernel. Since s >= amax/fmax, |x / s| <= fmax.
    NaN amax gives a NaN scale (float_to_e8m0 refuses it); no host sync here, so
    this is safe in hot paths.
    """
    if not (fmax > 0 and math.isfinite(fmax)):
        raise ValueError(f"pow2_scale: fmax must be positive and finite, got {fmax}")
    if not (amin > 0 and math.isfinite(amin)):
        raise ValueError(f"pow2_scale: amin must be positive and finite (else s can be 0), got {amin}")
    inv = torch.tensor(1.0 / fmax, dtype=torch.float32).item()  # the kernel's float32 constant
    x = amax.to(torch.float32).clamp_min(amin) * inv
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - _E8M0_BIAS + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    s = ((e + _E8M0_BIAS) << 23).view(torch.float32)
    # NaN has exponent field 255 and a mantissa: the bit trick would turn it into
    # -0.0, so keep it NaN explicitly.
    return torch.where(torch.isnan(x), x, s)


# --------------------------------------------------------------------------- FP4 e2m1


def fp4_unpack(packed: Tensor) -> Tensor:
    """Unpack FP4 e2m1 codes to their float32 values (no scale applied).

    packed: int8 or uint8 [..., K/2] -> float32 [..., K].
    Element 2i is the low nibble of byte i, element 2i+1 its high nibble.
    Code 8 decodes to -0.0.
    """
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"fp4_unpack: expected packed FP4 as torch.int8 or torch.uint8, got {packed.dtype}")
    # Work on unsigned bytes: an arithmetic right shift of int8 would smear the
    # sign bit into the high nibble.
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    table = _const("fp4", FP4_VALUES, torch.float32, b.device)
    return table[codes.long()]


def fp4_pack(values: Tensor) -> Tensor:
    """Pack exact e2m1 values into bytes, two per byte, low nibble first.

    values: floating [..., K], K even, every element in
    {±0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6} -> int8 [..., K/2].
    The sign bit is taken from the float's sign bit, so -0.0 packs to code 8 and
    round-trips through fp4_unpack. Anything else (3.5, 7, NaN, inf) raises
    ValueError with a count; use fp4_round first to round arbitrary values.
    """
    if not values.is_floating_point():
        raise TypeError(f"fp4_pack: expected a floating tensor, got {values.dtype}")
    if values.shape[-1] % 2:
        raise ValueError(f"fp4_pack: last dimension must be even, got {values.shape[-1]}")
    v = values.to(torch.promote_types(values.dtype, torch.float32))
    mag = v.abs()
    grid = _const("fp4_mag", _FP4_MAGNITUDES, v.dtype, v.device)
    idx = torch.bucketize(mag, grid).clamp_max(7)  # first grid point >= mag
    (n_bad,) = _counts(grid[idx] != mag)  # NaN != anything, so NaN is caught too
    if n_bad:
        raise ValueError(f"fp4_pack: {n_bad} of {v.numel()} values are not exact e2m1 values {FP4_VALUES}")
    codes = (idx | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)
    codes = codes.unflatten(-1, (-1, 2))
    return (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8)


def fp4_round(x: Tensor) -> Tensor:
    """Round to the nearest e2m1 value, saturating at ±6.

    x: floating, any shape -> same dtype and shape, every element in the e2m1
    value set (NaN stays NaN).

    Ties go to the even mantissa, as the hardware cast (cvt.rn.satfinite) does:
    with the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 the midpoints round
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. Even mantissa is the
    same as even code index, which is what the code below picks. Magnitudes above
    6 saturate to 6 (no inf in e2m1). The sign is kept, so small negatives give
    -0.0.
    """
    if not x.is_floating_point():
        raise TypeError(f"fp4_round: expected a floating tensor, got {x.dtype}")
    ct = torch.promote_types(x.dtype, torch.float32)  # midpoints are exact in any float type
    v = x.to(ct)
    mag = v.abs().clamp_max(E2M1_MAX)
    mids = _const("fp4_mid", _FP4_MIDPOINTS, ct, v.device)
    down = torch.bucketize(mag, mids, right=False)  # number of midpoints < mag: ties round down
    up = torch.bucketize(mag, mids, right=True)  # number of midpoints <= mag: ties round up
    # down == up except exactly on a midpoint, where they are neighbours; take the even one.
    idx = torch.where(down % 2 == 0, down, up)
    grid = _const("fp4_mag", _FP4_MAGNITUDES, ct, v.device)
    out = torch.copysign(grid[idx], v)
    out = torch.where(torch.isnan(v), v, out)
    return out.to(x.dtype)


# --------------------------------------------------------------------------- FP8 blocks


def dequant_fp8_block(
    w: Tensor, scale: Tensor, block: int = 128, out_dtype: torch.dtype = torch.float32, *, check: bool = True
) -> Tensor:
    """Dequantise a block-scaled FP8 weight: real = fp8 value * scale of its block.

    w: torch.float8_e4m3fn [..., N, K]
    scale: [..., ceil(N/block), ceil(K/block)], ue8m0 (float8_e8m0fnu or uint8) or
    already decoded to a float dtype (:func:`scale_f32`)
    -> out_dtype [..., N, K], contiguous.

    N and K need not be multiples of block (the last blocks are partial). The
    product is formed in float32, where it is exact (3-bit mantissa times a power
    of two) unless it leaves the float32 range; bf16 output is exact too, fp16
    can overflow/underflow. With `check`, raises ValueError if w holds an e4m3
    NaN or a scale is NaN (byte 255), so a corrupt checkpoint fails loudly here
    (one host sync). The model and the reference pass False: the reference
    GEMMs dequantise on every call on a GPU, where a sync each would stall it.
    """
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequant_fp8_block: expected w as torch.float8_e4m3fn, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"dequant_fp8_block: w must be at least 2-D [..., N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    _check_scale_shape(scale, (*lead, _cdiv(n, block), _cdiv(k, block)), "dequant_fp8_block")
    s = scale_f32(scale, "dequant_fp8_block")
    wf = w.to(torch.float32)
    if check:
        n_nan_w, n_nan_s = _counts(torch.isnan(wf), torch.isnan(s))
        if n_nan_w or n_nan_s:
            raise ValueError(
                f"dequant_fp8_block: {n_nan_w} NaN weights (e4m3 0x7F/0xFF) and {n_nan_s} NaN scales (ue8m0 byte 255)"
            )
    return _mul_block_scale(wf, s, block, block).to(out_dtype)


def quant_fp8_block(w: Tensor, block: int = 128) -> tuple[Tensor, Tensor]:
    """Quantise a weight to FP8 e4m3 with one power-of-two ue8m0 scale per block.

    w: floating [..., N, K] (finite) ->
    (w_fp8: torch.float8_e4m3fn [..., N, K],
     scale_bytes: uint8 [..., ceil(N/block), ceil(K/block)]).

    Scale per block = pow2_scale(block amax, 448, 1e-4); values are w / scale
    (exact: scale is a power of two), clamped to ±448 (the e4m3fn cast turns
    anything larger into NaN, it does not saturate), then cast with
    round-to-nearest-even. Values already of the form e4m3 * 2**k, with a block
    amax of exactly 448 * 2**k, come back bit-exact. Non-finite input raises
    ValueError.
    """
    if not w.is_floating_point():
        raise TypeError(f"quant_fp8_block: expected a floating tensor, got {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"quant_fp8_block: w must be at least 2-D [..., N, K], got shape {tuple(w.shape)}")
    wf = w.to(torch.float32)
    _require_finite(wf, "quant_fp8_block")
    s = pow2_scale(_block_amax(wf, block, block), E4M3_MAX, FP8_ACT_AMIN)
    q = _mul_block_scale(wf, s.reciprocal(), block, block)  # reciprocal of 2^k is exact
    q = q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(s)


# --------------------------------------------------------------------------- FP4 groups


def dequant_fp4(
    packed: Tensor, scale: Tensor, block: int = 32, out_dtype: torch.dtype = torch.float32, *, check: bool = True
) -> Tensor:
    """Dequantise packed FP4 e2m1 with one scale per `block` K elements.

    packed: int8 or uint8 [..., N, K/2] (low nibble first)
    scale: [..., N, ceil(K/block)], ue8m0 (float8_e8m0fnu or uint8) or already
    decoded to a float dtype (:func:`scale_f32`)
    -> out_dtype [..., N, K], contiguous.

    Exact in float32 (and bf16) within range. With `check`, raises ValueError if
    any scale is NaN (byte 255) (one host sync); the model and the reference
    pass False, as for :func:`dequant_fp8_block`.
    """
    values = fp4_unpack(packed)
    if values.dim() < 2:
        raise ValueError(f"dequant_fp4: packed must be at least 2-D [..., N, K/2], got {tuple(packed.shape)}")
    *lead, n, k = values.shape
    _check_scale_shape(scale, (*lead, n, _cdiv(k, block)), "dequant_fp4")
    s = scale_f32(scale, "dequant_fp4")
    if check:
        (n_nan,) = _counts(torch.isnan(s))
        if n_nan:
            raise ValueError(f"dequant_fp4: {n_nan} of {s.numel()} scales are NaN (ue8m0 byte 255)")
    return _mul_block_scale(values, s, 1, block).to(out_dtype)


def quant_fp4(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Quantise a weight to FP4 e2m1 with one power-of-two ue8m0 scale per `block` K elements.

    w: floating [..., N, K] (finite, K even) ->
    (packed: int8 [..., N, K/2], scale_bytes: uint8 [..., N, ceil(K/block)]).

    Scale per group = pow2_scale(group amax, 6, 6*2**-126); values are
    fp4_round(w / scale) (ties to even, saturating). Non-finite input raises
    ValueError.
    """
    if not w.is_floating_point():
        raise TypeError(f"quant_fp4: expected a floating tensor, got {w.dtype}")
    if w.dim() < 2 or w.shape[-1] % 2:
        raise ValueError(f"quant_fp4: w must be [..., N, K] with K even, got shape {tuple(w.shape)}")
    wf = w.to(torch.float32)
    _require_finite(wf, "quant_fp4")
    s = pow2_scale(_block_amax(wf, 1, block), E2M1_MAX, FP4_AMIN)
    q = fp4_round(_mul_block_scale(wf, s.reciprocal(), 1, block))
    return fp4_pack(q), float_to_e8m0(s)


def fp4_to_fp8_block(
    packed: Tensor, scale: Tensor, *, strict: bool = False
) -> tuple[Tensor, Tensor]:
    """Upcast FP4 (1x32 ue8m0 groups) to FP8 e4m3 (128x128 ue8m0 blocks), as the official convert.py.

    packed: int8 or uint8 [N, K/2]; scale: ue8m0 (float8_e8m0fnu or uint8) [N, K/32]
    -> (w_fp8: torch.float8_e4m3fn [N, K], scale_bytes: uint8 [ceil(N/128), ceil(K/128)]).

    Per 128x128 block: block_scale = (max of its 32-group scales) / 2**6; each
    group's offset = group scale / block_scale, a power of two <= 2**6; the FP8
    value is fp4 value * offset. 6 * 2**6 = 384 < 448, so nothing saturates
    (2**7 would give 768). N, K that are not multiples of 128 are allowed (the
    official code requires multiples); the last blocks are partial.

    Lossless condition: fp4 values are n/2 with n in {1, 2, 3, 4, 6, 8, 12}, at
    most 2 significant bits, so they stay exact in e4m3's normal range; in its
    subnormal range (below 2**-6, step 2**-9) 0.5 * offset and 1.5 * offset are
    exact iff offset >= 2**-8. So the upcast is exact for every possible code iff
    every group scale >= (block max group scale) * 2**-14, i.e. the group scales
    inside each 128x128 block span at most 2**14. Beyond that the smallest
    values of the small-scale groups round (RNE) or flush to 0; the error is at
    most 2**-10 * block_scale per element, tiny next to the block's largest
    values (up to 384 * block_scale), which is why convert.py accepts it.
    With strict=True such a loss raises ValueError instead (one more pass).

    One deviation from convert.py, only for group scales below 2**-121 that real
    checkpoints do not have: block_scale is floored at 2**-127 (the smallest
    e8m0), so the block scale stays encodable. Scale byte 255 (NaN) raises.
    """
    values = fp4_unpack(packed)
    if values.dim() != 2:
        raise ValueError(f"fp4_to_fp8_block: packed must be 2-D [N, K/2], got shape {tuple(packed.shape)}")
    fp8_block, fp4_block = 128, 32
    n, k = values.shape
    _check_scale_shape(scale, (n, _cdiv(k, fp4_block)), "fp4_to_fp8_block")
    if k % fp4_block:
        # A 128-wide FP8 block must hold whole 32-groups for the group max below.
        raise ValueError(f"fp4_to_fp8_block: K={k} must be a multiple of {fp4_block}")
    s = _checked_scale(scale, "fp4_to_fp8_block")  # [N, K/32]
    groups_per_block = fp8_block // fp4_block
    # Scales are > 0, so the zero padding of _block_amax never wins the max.
    block_scale = _block_amax(s, fp8_block, groups_per_block) / 2.0**6
    block_scale = block_scale.clamp_min(2.0**-127)
    offset = _mul_block_scale(s, block_scale.reciprocal(), fp8_block, groups_per_block)  # [N, K/32]
    w_fp8 = _mul_block_scale(values, offset, 1, fp4_block).to(torch.float8_e4m3fn)
    if strict:
        before = _mul_block_scale(values, s, 1, fp4_block)
        after = _mul_block_scale(w_fp8.to(torch.float32), block_scale, fp8_block, fp8_block)
        (n_lossy,) = _counts(before != after)
        if n_lossy:
            raise ValueError(
                f"fp4_to_fp8_block: {n_lossy} of {before.numel()} values change in the upcast "
                "(some 32-group scale is below its 128x128 block's max scale * 2^-14)"
            )
    return w_fp8, float_to_e8m0(block_scale)
