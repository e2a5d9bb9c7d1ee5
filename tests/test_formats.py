"""Tests for deepinfer.quant.formats: ue8m0, FP8 e4m3 blocks, FP4 e2m1 groups, FP4->FP8 upcast.

Inputs are fresh random tensors from seeded torch.Generators (never all zeros).
Every test runs on CPU, and on CUDA too when it is available.
"""

import math

import pytest
import torch

from deepinfer.quant.formats import (
    FP4_VALUES,
    dequant_fp4,
    dequant_fp8_block,
    e8m0_bytes_as_dtype,
    e8m0_to_float,
    float_to_e8m0,
    fp4_pack,
    fp4_round,
    fp4_to_fp8_block,
    fp4_unpack,
    pow2_scale,
    quant_fp4,
    quant_fp8_block,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture(params=DEVICES)
def dev(request):
    return torch.device(request.param)


def gen(seed: int) -> torch.Generator:
    # CPU generator; tensors are made on CPU and moved, so results do not depend on the device.
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed, dev):
    return torch.randn(*shape, generator=gen(seed)).to(dev)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (tells -0.0 from 0.0, NaN equals NaN of the same bits)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(ib), b.view(ib))


def no_nan(*ts):
    for t in ts:
        assert not torch.isnan(t.float()).any()


def random_fp8(n, k, seed, dev):
    """Random finite e4m3fn values (all bytes except the NaNs 0x7F, 0xFF)."""
    b = torch.randint(0, 256, (n, k), generator=gen(seed), dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    return b.to(dev).view(torch.float8_e4m3fn)


def random_scale_bytes(shape, lo, hi, seed, dev):
    return torch.randint(lo, hi + 1, shape, generator=gen(seed), dtype=torch.int32).to(torch.uint8).to(dev)


# --------------------------------------------------------------------------- ue8m0


def test_e8m0_known_bytes(dev):
    b = torch.tensor([127, 128, 120, 0, 254, 1, 255], dtype=torch.uint8, device=dev)
    f = e8m0_to_float(b)
    assert f.dtype == torch.float32 and f.shape == b.shape
    assert f[:6].tolist() == [1.0, 2.0, 2.0**-7, 2.0**-127, 2.0**127, 2.0**-126]
    assert math.isnan(f[6].item())


def test_e8m0_all_bytes_both_dtypes(dev):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(dev)
    f_u8 = e8m0_to_float(b)
    f_e8 = e8m0_to_float(b.view(torch.float8_e8m0fnu))
    assert bits_equal(f_u8, f_e8)
    # Independent references: ldexp in float64, and torch's own e8m0 -> float cast.
    ref = torch.ldexp(torch.ones(255, dtype=torch.float64), torch.arange(255) - 127).to(torch.float32)
    assert torch.equal(f_u8[:255].cpu(), ref)
    assert torch.equal(f_u8[:255], b.view(torch.float8_e8m0fnu).float()[:255])
    assert torch.isnan(f_u8[255])
    # The trap: the byte read as a number is not the scale.
    assert not torch.equal(f_u8[:255], b[:255].float())


def test_e8m0_rejects_other_dtypes(dev):
    with pytest.raises(TypeError, match="int8"):
        e8m0_to_float(torch.tensor([127], dtype=torch.int8, device=dev))
    for dt in (torch.float32, torch.int32, torch.bfloat16):
        with pytest.raises(TypeError, match=str(dt)):
            e8m0_to_float(torch.ones(3, dtype=dt, device=dev))


def test_float_to_e8m0_round_trip(dev):
    b = torch.randint(0, 255, (64, 33), generator=gen(1), dtype=torch.int32).to(torch.uint8).to(dev)
    b[0, :3] = torch.tensor([0, 254, 127], dtype=torch.uint8)  # range ends included
    assert torch.equal(float_to_e8m0(e8m0_to_float(b)), b)
    # bf16 / float64 / e8m0 inputs work as well
    assert torch.equal(float_to_e8m0(e8m0_to_float(b).double()), b)
    assert torch.equal(float_to_e8m0(b.view(torch.float8_e8m0fnu)), b)
    mid = b.clamp(1, 254)
    assert torch.equal(float_to_e8m0(e8m0_to_float(mid).bfloat16()), mid)


def test_float_to_e8m0_errors(dev):
    s = e8m0_to_float(random_scale_bytes((10,), 100, 150, 2, dev))
    bad = s.clone()
    bad[2] = bad[2] * 3
    bad[5] = 0.0
    bad[7] = float("nan")
    with pytest.raises(ValueError, match="3 of 10 elements are not powers of two"):
        float_to_e8m0(bad)
    with pytest.raises(ValueError, match="not powers of two"):
        float_to_e8m0(-s)
    big = torch.tensor([2.0**127, 2.0**-127], dtype=torch.float64, device=dev)
    assert float_to_e8m0(big).tolist() == [254, 0]
    with pytest.raises(ValueError, match="1 are powers of two outside"):
        float_to_e8m0(torch.tensor([2.0**128, 1.0], dtype=torch.float64, device=dev))
    with pytest.raises(ValueError, match="outside"):
        float_to_e8m0(torch.tensor([2.0**-128, 1.0], dtype=torch.float64, device=dev))
    with pytest.raises(TypeError):
        float_to_e8m0(torch.tensor([1, 2], dtype=torch.int32, device=dev))


def test_e8m0_bytes_as_dtype(dev):
    b = random_scale_bytes((5, 7), 0, 254, 3, dev)
    v = e8m0_bytes_as_dtype(b)
    assert v.dtype == torch.float8_e8m0fnu and v.shape == b.shape
    assert v.data_ptr() == b.data_ptr()  # a view, not a copy
    assert torch.equal(e8m0_to_float(v), e8m0_to_float(b))
    with pytest.raises(TypeError, match="int8"):
        e8m0_bytes_as_dtype(b.view(torch.int8))


# --------------------------------------------------------------------------- pow2_scale


def test_pow2_scale_matches_definition(dev):
    amax = randn(4096, seed=4, dev=dev).abs() * torch.exp2(randn(4096, seed=5, dev=dev) * 20)
    for fmax, amin in ((448.0, 1e-4), (6.0, 6.0 * 2.0**-126)):
        s = pow2_scale(amax, fmax, amin)
        assert s.dtype == torch.float32
        a = amax.double().clamp_min(amin)
        ref = torch.exp2(torch.ceil(torch.log2(a / fmax)))
        assert torch.equal(s.double(), ref)
        assert (amax.double().clamp_min(amin) / s.double() <= fmax).all()
        no_nan(s)
        float_to_e8m0(s)  # encodable


def test_pow2_scale_edges(dev):
    k = torch.arange(-20, 21, device=dev, dtype=torch.float32)
    exact = 448.0 * torch.exp2(k)
    assert torch.equal(pow2_scale(exact, 448.0, 1e-4), torch.exp2(k))  # exact powers stay
    above = torch.nextafter(exact, torch.full_like(exact, math.inf))
    assert torch.equal(pow2_scale(above, 448.0, 1e-4), torch.exp2(k + 1))
    # zero amax is floored by amin, never a zero scale
    z = pow2_scale(torch.zeros(3, device=dev), 448.0, 1e-4)
    assert torch.equal(z, torch.full_like(z, 2.0**-22))  # 1e-4/448 ~ 2^-22.1, rounded up
    z4 = pow2_scale(torch.zeros(3, device=dev), 6.0, 6.0 * 2.0**-126)
    assert torch.equal(z4, torch.full_like(z4, 2.0**-126))
    # NaN stays NaN (not -0.0 from the bit trick); bad amin/fmax are refused
    assert torch.isnan(pow2_scale(torch.tensor([float("nan")], device=dev), 448.0, 1e-4)).all()
    with pytest.raises(ValueError):
        pow2_scale(exact, 448.0, 0.0)
    with pytest.raises(ValueError):
        pow2_scale(exact, 0.0, 1e-4)


# --------------------------------------------------------------------------- FP4 codes


def test_fp4_nibble_order(dev):
    b = torch.tensor([[0x21, 0x8F]], dtype=torch.uint8, device=dev)
    v = fp4_unpack(b)
    assert v.dtype == torch.float32 and v.shape == (1, 4)
    assert v.tolist() == [[0.5, 1.0, -6.0, -0.0]]
    assert torch.signbit(v[0, 3])  # code 8 is -0.0
    assert bits_equal(fp4_unpack(b.view(torch.int8)), v)  # int8 storage decodes the same
    with pytest.raises(TypeError, match="int16"):
        fp4_unpack(b.to(torch.int16))


def test_fp4_full_table(dev):
    # byte = lo | hi << 4 for all 256 pairs: element 2i is lo, 2i+1 is hi.
    lo = torch.arange(256) & 0xF
    hi = torch.arange(256) >> 4
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(dev)
    v = fp4_unpack(b).view(256, 2).cpu()
    table = torch.tensor(FP4_VALUES)
    assert bits_equal(v[:, 0].contiguous(), table[lo])
    assert bits_equal(v[:, 1].contiguous(), table[hi])
    assert table[:8].tolist() == GRID.tolist() and torch.equal(table[8:], -GRID)
    # bit 3 is the sign: code c and c ^ 8 are negatives of each other
    assert bits_equal(table[torch.arange(16) ^ 8], -table)


def test_fp4_pack_unpack_round_trip(dev):
    g = gen(6)
    b = torch.randint(0, 256, (3, 17, 64), generator=g, dtype=torch.int32).to(torch.uint8).to(dev)
    v = fp4_unpack(b)
    assert v.shape == (3, 17, 128)
    p = fp4_pack(v)
    assert p.dtype == torch.int8 and p.shape == b.shape
    assert torch.equal(p.view(torch.uint8), b)  # bit exact, -0.0 included
    # +0.0 and -0.0 are both accepted; values from other float dtypes too
    assert fp4_pack(torch.tensor([0.0, -0.0], device=dev)).view(torch.uint8).tolist() == [0x80]
    assert torch.equal(fp4_pack(v.bfloat16()), p)


def test_fp4_pack_rejects_off_grid(dev):
    v = fp4_unpack(random_scale_bytes((4, 8), 0, 255, 7, dev))
    bad = v.clone()
    bad[0, 0] = 3.5
    bad[1, 3] = 7.0
    bad[2, 2] = float("nan")
    bad[3, 1] = -0.25
    with pytest.raises(ValueError, match="4 of 64 values are not exact e2m1"):
        fp4_pack(bad)
    with pytest.raises(ValueError, match="even"):
        fp4_pack(torch.ones(3, device=dev))


def test_fp4_round_on_grid_and_ties(dev):
    table = torch.tensor(FP4_VALUES, device=dev)
    assert bits_equal(fp4_round(table), table)  # grid points map to themselves, sign of zero kept
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=dev)
    expect = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], device=dev)  # ties to even mantissa
    assert torch.equal(fp4_round(mids), expect)
    assert torch.equal(fp4_round(-mids), -expect)
    sat = torch.tensor([6.0001, 7.0, 1e30, float("inf"), -100.0], device=dev)
    assert fp4_round(sat).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0]
    assert torch.isnan(fp4_round(torch.tensor([float("nan")], device=dev))).all()


def test_fp4_round_nearest_random(dev):
    x = randn(20000, seed=8, dev=dev) * 3
    r = fp4_round(x)
    grid = torch.cat([-GRID.flip(0), GRID]).to(dev)
    dist = (x[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1).values
    assert torch.equal((x - r).abs(), best)  # beyond ±6 the nearest grid point is ±6 itself
    assert torch.isin(r, grid).all()
    assert r.dtype == x.dtype
    xb = x.bfloat16()
    assert torch.equal(fp4_round(xb), fp4_round(xb.float()).bfloat16())
    assert fp4_round(xb).dtype == torch.bfloat16


# --------------------------------------------------------------------------- FP8 blocks


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 129), (130, 1)])
def test_fp8_block_round_trip(dev, shape):
    n, k = shape
    # Rows of different magnitude so blocks get different scales.
    w = randn(n, k, seed=9, dev=dev) * torch.exp2(randn(n, 1, seed=10, dev=dev) * 4)
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (n, k)
    assert s.dtype == torch.uint8 and s.shape == (math.ceil(n / 128), math.ceil(k / 128))
    d = dequant_fp8_block(q, s)
    assert d.dtype == torch.float32 and d.shape == (n, k)
    no_nan(q, d)
    assert ((d - w).norm() / w.norm()).item() < 0.05
    # per element: within half an e4m3 ulp (2^-4 relative) or the subnormal step
    sf = dequant_fp8_block(torch.ones(n, k, device=dev).to(torch.float8_e4m3fn), s)
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2.0**-4, sf * 2.0**-10)).all()
    # the e8m0 dtype input and bf16 output agree
    assert torch.equal(dequant_fp8_block(q, e8m0_bytes_as_dtype(s), out_dtype=torch.bfloat16), d.bfloat16())
    # the scale is the smallest power of two that fits: each block's max |q| is in [224, 448]
    # (amax / s is in (224, 448]; the cast can round it down onto 224)
    qmax = q.float().abs()
    nb, kb = s.shape
    qmax = torch.nn.functional.pad(qmax, (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128).amax((1, 3))
    assert ((qmax >= 224) & (qmax <= 448)).all()


def test_fp8_block_exact_for_representable(dev):
    n, k = 300, 260
    q0 = random_fp8(n, k, 11, dev)
    # Scale bytes >= 106: below that, 448 * scale < 1e-4 and the amax floor raises the scale.
    sb = random_scale_bytes((3, 3), 106, 150, 12, dev)
    # Put +-448 in every block so the quantiser picks exactly the same scale.
    q0f = q0.float()
    q0f[::128, ::128] = torch.where(torch.arange(9, device=dev).view(3, 3) % 2 == 0, 448.0, -448.0)
    q0 = q0f.to(torch.float8_e4m3fn)
    w = dequant_fp8_block(q0, sb)
    q, s = quant_fp8_block(w)
    assert torch.equal(s, sb)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))  # bit exact, -0.0 included
    assert torch.equal(dequant_fp8_block(q, s), w)
    # bf16 input of representable values gives the same result
    q2, s2 = quant_fp8_block(w.bfloat16())
    assert torch.equal(s2, sb) and torch.equal(q2.view(torch.uint8), q0.view(torch.uint8))


def test_fp8_block_scale_shape_and_partial_blocks(dev):
    n, k = 200, 300
    q = random_fp8(n, k, 13, dev)
    sb = random_scale_bytes((2, 3), 110, 140, 14, dev)
    d = dequant_fp8_block(q, sb)
    # explicit reference: expand scales element-wise
    sf = e8m0_to_float(sb).repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(d, q.float() * sf)
    with pytest.raises(ValueError, match="scale shape"):
        dequant_fp8_block(q, sb[:1])
    with pytest.raises(TypeError, match="int8"):
        dequant_fp8_block(q, sb.view(torch.int8))
    with pytest.raises(TypeError, match="float32"):
        dequant_fp8_block(q.float(), sb)


def test_fp8_nan_never_passes(dev):
    q = random_fp8(128, 128, 15, dev)
    sb = random_scale_bytes((1, 1), 120, 130, 16, dev)
    bad_s = torch.full_like(sb, 255)
    with pytest.raises(ValueError, match="NaN"):
        dequant_fp8_block(q, bad_s)
    qn = q.view(torch.uint8).clone()
    qn[3, 5] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        dequant_fp8_block(qn.view(torch.float8_e4m3fn), sb)
    w = randn(128, 128, seed=17, dev=dev)
    for bad in (float("nan"), float("inf")):
        w2 = w.clone()
        w2[1, 1] = bad
        with pytest.raises(ValueError, match="not finite"):
            quant_fp8_block(w2)
    # huge but finite values are clamped by the scale, never cast to NaN
    q3, s3 = quant_fp8_block(w * 1e30)
    no_nan(q3, dequant_fp8_block(q3, s3))


# --------------------------------------------------------------------------- FP4 groups


def test_fp4_quant_dequant_round_trip(dev):
    n, k = 64, 256
    w = randn(n, k, seed=18, dev=dev) * torch.exp2(randn(n, 1, seed=19, dev=dev) * 4)
    p, s = quant_fp4(w)
    assert p.dtype == torch.int8 and p.shape == (n, k // 2)
    assert s.dtype == torch.uint8 and s.shape == (n, k // 32)
    d = dequant_fp4(p, s)
    assert d.dtype == torch.float32 and d.shape == (n, k)
    no_nan(d)
    # each element is the nearest grid point of w / s, times s
    sf = e8m0_to_float(s).repeat_interleave(32, 1)
    assert torch.equal(d, fp4_round(w / sf) * sf)
    assert ((d - w).abs() <= sf).all()  # half the widest grid gap (2) times s
    assert ((d - w).norm() / w.norm()).item() < 0.15  # e2m1 on Gaussian data: ~0.1
    # scales are as small as possible: some element of each group needs them
    assert ((w.abs().view(n, -1, 32).amax(-1) / e8m0_to_float(s)) > 3).all()
    # values already on the grid come back exactly. The bytes may differ: a group
    # whose max rounded down to <= 3*s gets the scale s/2 and doubled codes.
    p2, s2 = quant_fp4(d)
    assert torch.equal(dequant_fp4(p2, s2), d)
    assert (s2 <= s).all() and (s2 < s).any()
    assert torch.equal(dequant_fp4(p, e8m0_bytes_as_dtype(s)), d)
    assert torch.equal(dequant_fp4(p.view(torch.uint8), s), d)


def test_fp4_dequant_reference_and_errors(dev):
    n, k = 16, 96
    p = random_scale_bytes((n, k // 2), 0, 255, 20, dev).view(torch.int8)
    sb = random_scale_bytes((n, k // 32), 90, 160, 21, dev)
    d = dequant_fp4(p, sb)
    # explicit element-wise reference
    b = p.view(torch.uint8).long().cpu()
    codes = torch.stack([b & 15, b >> 4], -1).view(n, k)
    ref = torch.tensor(FP4_VALUES)[codes] * e8m0_to_float(sb).cpu().repeat_interleave(32, 1)
    assert torch.equal(d.cpu(), ref)
    bad = sb.clone()
    bad[3, 1] = 255
    with pytest.raises(ValueError, match="255"):
        dequant_fp4(p, bad)
    with pytest.raises(ValueError, match="scale shape"):
        dequant_fp4(p, sb[:, :2])
    w = randn(4, 64, seed=22, dev=dev)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        quant_fp4(w)


# --------------------------------------------------------------------------- FP4 -> FP8


def _fp4_case(n, k, spread, seed, dev, base=120):
    """Random packed FP4 [n, k/2] and scales [n, k/32] with bytes in [base-spread, base]."""
    p = random_scale_bytes((n, k // 2), 0, 255, seed, dev).view(torch.int8)
    sb = random_scale_bytes((n, k // 32), base - spread, base, seed + 1, dev)
    return p, sb


@pytest.mark.parametrize("spread", [0, 3, 6, 14])
def test_fp4_to_fp8_exact(dev, spread):
    n, k = 256, 512
    p, sb = _fp4_case(n, k, spread, 23 + spread, dev)
    # make sure each 128x128 block really spans the full spread
    sb[::128, ::4] = 120
    sb[1::128, 1::4] = 120 - spread
    w8, s8 = fp4_to_fp8_block(p, sb, strict=True)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == (n, k)
    assert s8.dtype == torch.uint8 and s8.shape == (2, 4)
    assert (s8 == 120 - 6).all()  # block scale = max group scale / 2^6
    a, b = dequant_fp4(p, sb), dequant_fp8_block(w8, s8)
    no_nan(w8, a, b)
    assert bits_equal(a, b)  # lossless, signs of zeros included
    assert w8.float().abs().max() <= 384


def test_fp4_to_fp8_matches_official_formula(dev):
    # The convert.py recipe written out on 128x128 tiles, for multiples of 128.
    n, k = 128, 256
    p, sb = _fp4_case(n, k, 10, 40, dev)
    x = fp4_unpack(p).view(1, 128, 2, 128).transpose(1, 2)
    sc = e8m0_to_float(sb).view(1, 128, 2, 4).transpose(1, 2).flatten(2)
    tile = sc.amax(-1, keepdim=True) / 2**6
    off = (sc / tile).unflatten(-1, (128, -1)).repeat_interleave(32, -1)
    ref = (x * off).transpose(1, 2).reshape(n, k).to(torch.float8_e4m3fn)
    w8, s8 = fp4_to_fp8_block(p, sb)
    assert torch.equal(w8.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(s8, tile.squeeze(-1).to(torch.float8_e8m0fnu).view(torch.uint8))


def test_fp4_to_fp8_partial_blocks(dev):
    n, k = 200, 320  # neither a multiple of 128
    p, sb = _fp4_case(n, k, 8, 50, dev)
    w8, s8 = fp4_to_fp8_block(p, sb, strict=True)
    assert w8.shape == (n, k) and s8.shape == (2, 3)
    assert bits_equal(dequant_fp4(p, sb), dequant_fp8_block(w8, s8))


def test_fp4_to_fp8_lossy_beyond_2_pow_14(dev):
    n, k = 128, 128
    # every code 1 (0.5): the value that needs offset >= 2^-8
    p = torch.full((n, k // 2), 0x11, dtype=torch.uint8, device=dev).view(torch.int8)
    sb = torch.full((n, k // 32), 100, dtype=torch.uint8, device=dev)
    sb[0, 0] = 115  # spread 2^15 -> offset 2^-9 for the rest
    w8, s8 = fp4_to_fp8_block(p, sb)  # default: like convert.py, no error
    no_nan(w8)
    assert not torch.equal(dequant_fp4(p, sb), dequant_fp8_block(w8, s8))
    with pytest.raises(ValueError, match="change in the upcast"):
        fp4_to_fp8_block(p, sb, strict=True)
    sb[0, 0] = 114  # spread 2^14: exact again
    w8, s8 = fp4_to_fp8_block(p, sb, strict=True)
    assert torch.equal(dequant_fp4(p, sb), dequant_fp8_block(w8, s8))


def test_fp4_to_fp8_rejects_nan_scale(dev):
    p, sb = _fp4_case(128, 128, 4, 60, dev)
    sb[5, 2] = 255
    with pytest.raises(ValueError, match="255"):
        fp4_to_fp8_block(p, sb)
    with pytest.raises(TypeError, match="int8"):
        fp4_to_fp8_block(p, sb.view(torch.int8))
