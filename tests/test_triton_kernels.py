"""Triton backend vs the torch reference, op by op.

On a CPU machine every kernel runs under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported) on CPU tensors at tiny shapes; on a CUDA host the same
tests run compiled on the GPU.

Interpreter caveats (the reason for some input dtypes here): the interpreter computes a bf16 tl.dot
wrongly, so tests feed dot-based kernels fp32/fp16/fp8; its fp32 -> bf16 cast truncates instead of
rounding to nearest (<= 1 bf16 ulp, inside the registry's bf16 tolerance); its fp32 -> fp8 cast is
wrong, which the kernels sidestep by rounding to the e4m3 grid themselves (`_common.round_e4m3`).

Inputs are fresh random tensors from seeded torch.Generators; outputs of the wrappers under test are
allocated through a poisoned torch.empty/empty_like (NaN, or a sentinel for integers) so that any
element a kernel fails to write shows up, and NaN never passes a comparison.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

# Compiled on a CUDA host, interpreted on CPU: tests/conftest.py sets TRITON_INTERPRET for CPU sessions
# before triton is imported (setting it here would leak into every later test module of the session).
COMPILED = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from deepinfer.ops import REGISTRY  # noqa: E402
from deepinfer.ops.reference import kv_unpack  # noqa: E402
from launch_spy import LaunchSpy  # noqa: E402
from tc_bounds import abs_products, assert_tensor_core_bound  # noqa: E402
from deepinfer.quant.formats import fp4_pack  # noqa: E402
from deepinfer.quant.kv_layout import kv_packed_width  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda" if COMPILED else "cpu"
SEEDS = [0, 1, 2]
INT_POISON = -(2**40) + 7  # never a valid index or token


TK = importlib.import_module("deepinfer_kernels.triton")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


@contextlib.contextmanager
def poisoned():
    """torch.empty / torch.empty_like return NaN- (or sentinel-) filled tensors while active."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(INT_POISON if t.dtype == torch.int64 else -7)
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def run_both(name, *args, **kwargs):
    ref = REGISTRY[name].ref(*args, **kwargs)
    with poisoned():
        out = REGISTRY[name].impls["triton"](*args, **kwargs)
    return out, ref


def check(name, out, ref, tol_override=None):
    outs, refs = (out, ref) if isinstance(ref, tuple) else ((out,), (ref,))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape, (name, o.shape, r.shape)
        assert o.dtype == r.dtype, (name, o.dtype, r.dtype)
        assert o.device == r.device
        if o.dtype.is_floating_point:
            of, rf = o.float(), r.float()
            assert not torch.isnan(rf).any(), f"{name}: the reference produced NaN (test input bug)"
            assert not torch.isnan(of).any(), f"{name}: NaN in the Triton output (unwritten or wrong)"
            key = str(r.dtype).removeprefix("torch.")
            rtol, atol = (tol_override or REGISTRY[name].tol)[key]
            torch.testing.assert_close(of, rf, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(o, r), f"{name}: {(o != r).sum().item()} of {o.numel()} differ\n{o}\n{r}"


# ------------------------------------------------------------------------------------------ registry
def test_every_op_has_a_triton_kernel_or_a_documented_reason():
    names = set(REGISTRY)
    triton_ops = {n for n, d in REGISTRY.items() if "triton" in d.impls}
    ref_only = TK.REFERENCE_ONLY
    assert set(ref_only) <= names, f"REFERENCE_ONLY names unknown ops: {set(ref_only) - names}"
    assert not (set(ref_only) & triton_ops), "an op is both implemented and listed as reference-only"
    assert all(isinstance(v, str) and v for v in ref_only.values()), "each reference-only op needs a reason"
    missing = names - triton_ops - set(ref_only)
    assert not missing, f"ops with neither a Triton kernel nor a documented reason: {sorted(missing)}"
    assert not ref_only, "every op has a Triton kernel: --strict --backend triton must hold"


def test_backend_importable_by_its_registry_name():
    """`load_backend("triton")` imports deepinfer_kernels.triton, whose modules register their kernels."""
    from deepinfer.ops.registry import REGISTRY, load_backend

    load_backend("triton")
    impls = {n: d.impls["triton"] for n, d in REGISTRY.items() if "triton" in d.impls}
    assert len(impls) == len(REGISTRY) - len(TK.REFERENCE_ONLY)
    assert all(fn.__module__.startswith("deepinfer_kernels.triton.") for fn in impls.values()), impls


# -------------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("D,dtype,weighted", [(200, torch.float32, True), (200, torch.float32, False),
                                               (64, torch.bfloat16, True), (4100, torch.float32, True),
                                               (48, torch.float16, True)])
def test_rms_norm(seed, D, dtype, weighted):
    g = gen(seed)
    x = randn(g, 2, 3, D, dtype=dtype, scale=3.0)
    w = randn(g, D, dtype=dtype) if weighted else None
    check("rms_norm", *run_both("rms_norm", x, w, 1e-6))


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_quant"])
@pytest.mark.parametrize("lo,hi", [(0, 256), (128, 384)])
def test_norms_read_column_slices_in_place(op, lo, hi):
    """A column slice of a wider output (wq_a|wkv's stacked GEMM) is normalised where it lies: rows read at
    the parent's stride, equal bit for bit to the norm of a contiguous copy (and to the reference)."""
    g = gen(5)
    parent = randn(g, 2, 3, 384 + 128, dtype=torch.bfloat16, scale=3.0)
    x, w = parent[..., lo:hi], randn(g, hi - lo)
    out, ref = run_both(op, x, w, 1e-6)
    dense = REGISTRY[op].impls["triton"](x.contiguous(), w, 1e-6)
    for a, b in zip(*((out, dense) if op == "rms_norm_quant" else ((out,), (dense,)))):
        assert a.is_contiguous() and torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                 b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    check(op, out, ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("D,dtype,weighted", [(256, torch.float32, True), (384, torch.bfloat16, True),
                                               (8192, torch.float32, True), (128, torch.float32, False)])
def test_rms_norm_quant_is_norm_then_act_quant(seed, D, dtype, weighted):
    """The fused norm + FP8 quantisation equals the two Triton kernels back to back bit for bit (same
    sum-of-squares order; q, s quantise y after its cast), and the reference within the op tolerance."""
    g = gen(seed)
    x = randn(g, 2, 3, D, dtype=dtype, scale=3.0)
    w = randn(g, D) if weighted else None
    y, q, s = run_both("rms_norm_quant", x, w, 1e-6)[0]
    tk = REGISTRY["rms_norm"].impls["triton"](x, w, 1e-6)
    tq, ts = REGISTRY["act_quant"].impls["triton"](tk, 128)
    assert torch.equal(y, tk) and torch.equal(q.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(s, ts)
    check("rms_norm_quant", *run_both("rms_norm_quant", x, w, 1e-6))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", [None, 3])
@pytest.mark.parametrize("D,R", [(20, 8), (64, 64), (48, 12)])
@pytest.mark.parametrize("weighted", [False, True])
def test_rms_norm_rope_is_norm_then_rope(seed, heads, D, R, weighted):
    """The fused norm + RoPE of the last R dims equals `rms_norm` then `rope` on its tail (the Triton kernels
    back to back) bit for bit, and the reference within the op tolerance: bf16 [B, S, H, D] q heads or an
    fp32 [B, S, D] column slice of a wider row, cos / sin as the halves of one gathered table row, R = D
    (no unrotated dims) and R / 2 not a power of two included."""
    g = gen(seed)
    B, S = 2, 3
    if heads is None:
        x = randn(g, B, S, D + 16, scale=3.0)[..., 16:]  # strided rows, as kv in wq_a|wkv's output
    else:
        x = randn(g, B, S, heads, D, dtype=torch.bfloat16, scale=3.0)
    w = randn(g, D) + 1.0 if weighted else None
    ang = torch.rand(B, S, 2, R // 2, generator=g) * 6.28
    cs = torch.stack([ang[:, :, 0].cos(), ang[:, :, 1].sin()], 2).to(DEV)
    cos, sin = cs[..., 0, :], cs[..., 1, :]
    out, ref = run_both("rms_norm_rope", x, w, 1e-6, cos, sin, R)
    tk = REGISTRY["rms_norm"].impls["triton"](x, w, 1e-6)
    tail = tk[..., -R:]
    REGISTRY["rope"].impls["triton"](tail, cos, sin, out=tail)
    assert out.is_contiguous() and torch.equal(out, tk)
    check("rms_norm_rope", out, ref)


# ------------------------------------------------------------------------------------- quantisation
def _quant_input(g, rows, K, dtype, block):
    x = torch.randn(rows, K, generator=g) * torch.exp2(torch.randint(-12, 8, (rows, 1), generator=g).float())
    x[0, :block] *= 1e-7  # a block whose amax sits under the floor
    x[-1, -block:] = x[-1, -block:] / x[-1, -block:].abs().max() * 448.0 * 4  # amax exactly 448·2^k
    return x.to(dtype).to(DEV)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant(seed, dtype):
    x = _quant_input(gen(seed), 5, 384, dtype, 128).view(5, 3, 128).transpose(0, 1)[:, :, :]
    x = x.reshape(3, 5, 128).repeat(1, 1, 3)  # [3, 5, 384] from a non-trivial view
    (q, s), (rq, rs) = run_both("act_quant", x, 128)
    check("act_quant", (q.float(), s), (rq.float(), rs))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("wide", [False, True])
def test_quant_kernels_many_blocks(seed, wide, monkeypatch):
    """201, 150 and 231 blocks: one block a program (decode-sized grids), and (wide) several programs of
    BLOCKS_PER_PROGRAM blocks, the last one partial (prefill-sized)."""
    if wide:
        _one_sm(monkeypatch, "quant")
    g = gen(seed)
    x = _quant_input(g, 67, 384, torch.bfloat16, 128)
    (q, s), (rq, rs) = run_both("act_quant", x, 128)
    check("act_quant", (q.float(), s), (rq.float(), rs))
    check("fp8_fake_quant", *run_both("fp8_fake_quant", _quant_input(g, 50, 192, torch.float32, 64), 64))
    x4 = torch.randn(33, 224, generator=g) * torch.exp2(torch.randint(-20, 20, (33, 7), generator=g).float()
                                                         ).repeat_interleave(32, dim=1)  # a scale per block
    check("fp4_fake_quant", *run_both("fp4_fake_quant", x4.to(DEV), 32))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype,block", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 128)])
def test_fp8_fake_quant(seed, dtype, block):
    x = _quant_input(gen(seed), 4, 3 * block, dtype, block)
    check("fp8_fake_quant", *run_both("fp8_fake_quant", x, block))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_fake_quant(seed, dtype):
    g = gen(seed)
    x = torch.randn(6, 96, generator=g) * 2
    # a block with amax exactly 6 (scale 1) holding every rounding midpoint, both signs
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[1, :32] = torch.cat([mids, -mids, mids * 0.999, -mids * 1.001])[:32].clamp(-6, 6)
    x[2, 32:64] *= 1e-30  # tiny block: scale floor 2^-126
    check("fp4_fake_quant", *run_both("fp4_fake_quant", x.to(dtype).to(DEV), 32))


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("n,dtype", [(4, torch.float32), (16, torch.float32), (64, torch.float32),
                                     (128, torch.bfloat16), (32, torch.float16)])
def test_hadamard(seed, n, dtype):
    x = randn(gen(seed), 3, 7, n, dtype=dtype)
    check("hadamard", *run_both("hadamard", x))


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("shape,dtype", [((3, 7, 128), torch.bfloat16), ((2, 5, 64, 128), torch.float32),
                                         ((70, 128), torch.bfloat16), ((4, 64), torch.float16),
                                         ((9, 32), torch.float32)])
def test_hadamard_then_fp4_in_one_kernel(seed, shape, dtype):
    """hadamard(x, fp4_block=32), the indexer's rotation and FP4 rounding in one launch: the same bits as the
    Triton hadamard followed by fp4_fake_quant (its output as rounded to x's dtype, then the FP4 step), the FP4
    step exactly the reference's on that output, and within a rounding step of the whole reference."""
    g = gen(seed)
    x = randn(g, *shape, dtype=dtype) * 3
    x.view(-1, shape[-1])[1] *= 1e-30  # a row at the FP4 scale floor
    tri = REGISTRY["hadamard"].impls["triton"]
    with poisoned():
        fused = tri(x, 32)
        h = tri(x)
        two = REGISTRY["fp4_fake_quant"].impls["triton"](h, 32)
    assert fused.shape == x.shape and fused.dtype == dtype and not torch.isnan(fused).any()
    assert torch.equal(fused, two)
    assert torch.equal(fused, REGISTRY["fp4_fake_quant"].ref(h, 32))
    assert not torch.equal(fused, h)  # the FP4 step ran
    ref = REGISTRY["hadamard"].ref(x, 32)
    assert ref.shape == fused.shape
    # the rotations agree within fp32 sum order; an FP4 rounding may flip where they differ: by at most the
    # largest grid step of the group (2 x its power-of-two scale), twice where the group's scale itself flipped
    hb = REGISTRY["hadamard"].ref(x).float().unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(hb.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126) / 6)))
    diff = (fused.float() - ref.float()).unflatten(-1, hb.shape[-2:])
    assert (diff.abs() <= 4 * scale).all()
    assert (fused == ref).float().mean() > 0.98


# -------------------------------------------------------------------------------------------- GEMMs
def _pow2(g, *shape, lo=-6, hi=2):
    return torch.exp2(torch.randint(lo, hi, shape, generator=g).float()).to(DEV)


@pytest.mark.parametrize("M,N,K,dtype", [(1, 192, 512, torch.float32), (5, 130, 384, torch.float16),
                                         (17, 64, 256, torch.float32), (64, 128, 1024, torch.float16),
                                         (100, 256, 256, torch.float32)])
def test_act_quant_fp8_gemm_quantises_a_as_it_loads(M, N, K, dtype):
    """wo_b's FP8 Linear on its unquantised input: at decode sizes (M <= 64) the split-K kernel act_quants each
    [BM, 128] block of A as it loads it -- the same bits as Triton's act_quant then fp8_gemm (same q, same
    scales, same dots); M 100 runs those two. Blocks a million times apart in one row, a row at the amax floor."""
    g = gen(3)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-10, 10, (M, K // 128), generator=g).float()
                                                    ).repeat_interleave(128, -1)
    x[0, :128] = 1e-7  # amax floored at 1e-4
    x = x.to(dtype).to(DEV)
    w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w_s = _pow2(g, -(-N // 128), K // 128)
    tri = REGISTRY["act_quant_fp8_gemm"].impls["triton"]
    with poisoned():
        got = tri(x, w, w_s, torch.float32)
        q, s = REGISTRY["act_quant"].impls["triton"](x, 128)
        two = REGISTRY["fp8_gemm"].impls["triton"](q, s, w, w_s, torch.float32)
    assert torch.equal(got, two)
    ref = REGISTRY["act_quant_fp8_gemm"].ref(x, w, w_s, torch.float32)
    sab = abs_products("fp8_gemm", q, s, w, w_s, out_dtype=torch.float32)
    if COMPILED and M > 64:
        assert_tensor_core_bound(got, ref, sab)
    else:  # fp32 sums of the same exact products in another order (blocks far apart: relative to sum |a w|)
        assert ((got - ref).abs() <= 4 * K ** 0.5 * 2.0 ** -24 * sab).all()
    assert not torch.equal(got, REGISTRY["fp8_gemm"].ref(q, s * 2, w, w_s, torch.float32))  # the scales count


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("M,N,K,out_dtype", [(5, 130, 320, torch.float32), (17, 64, 256, torch.bfloat16),
                                             (1, 200, 128, torch.float32), (130, 200, 320, torch.float32)])
def test_fp8_gemm(seed, M, N, K, out_dtype):
    """M 130: the prefill kernel (TMA descriptors; edges in M, N and K zero-filled by the descriptor)."""
    g = gen(seed)
    a = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    a_s = _pow2(g, M, -(-K // 128))
    w_s = _pow2(g, -(-N // 128), -(-K // 128))
    out, ref = run_both("fp8_gemm", a, a_s, w, w_s, out_dtype)
    if COMPILED and M > 64:  # the compiled prefill kernel promotes once per 128-K block (tc_bounds)
        assert_tensor_core_bound(out, ref, abs_products("fp8_gemm", a, a_s, w, w_s, torch.float32))
        return
    # fp32 sums in another order differ by ~eps·sqrt(K) of the output scale on elements that cancel to near
    # zero (seen 3e-7 of the scale at M 130): atol relative to the scale, as in test_v4_shapes_compiled
    check("fp8_gemm", out, ref, tol_override={"float32": (1e-5, 1e-6 * ref.abs().max().item()),
                                              "bfloat16": REGISTRY["fp8_gemm"].tol["bfloat16"]})


@pytest.mark.parametrize("mode", ["exact", "exact-wgmma"])
@pytest.mark.parametrize("M,N,K,out_dtype", [(130, 200, 320, torch.float32), (257, 256, 1024, torch.bfloat16)])
def test_fp8_gemm_exact_prefill_forms(monkeypatch, mode, M, N, K, out_dtype):
    """The TMA prefill kernel's two exact forms (DEEPINFER_FP8_GEMM=exact: the FP8 dot with no imprecise
    accumulation; exact-wgmma: the tiles as f16 on f16 wgmma) give the fp32 sums of the same exact products: within
    fp32 summation-order error of the reference, relative to sum |a w| (edges in M, N and K included)."""
    from deepinfer_kernels.triton import gemm

    monkeypatch.setenv("DEEPINFER_FP8_GEMM", mode)
    spy = LaunchSpy(gemm._fp8_gemm_tma_kernel)
    monkeypatch.setattr(gemm, "_fp8_gemm_tma_kernel", spy)
    g = gen(11)
    a = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    a_s, w_s = _pow2(g, M, -(-K // 128)), _pow2(g, -(-N // 128), -(-K // 128))
    got = gemm.fp8_gemm(a, a_s, w, w_s, out_dtype).float()
    assert [(k["EXACT"], k["F16"]) for k in spy.launches] == [(mode == "exact", mode == "exact-wgmma")]
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, torch.float32)
    sab = abs_products("fp8_gemm", a, a_s, w, w_s, out_dtype=torch.float32)
    assert torch.isfinite(got).all()
    # fp32 sums of the same products in another order; on a GPU the tensor core's fp32 accumulator may also
    # truncate once per 16-K instruction (one fp32 ulp of the running sum, <= sum |a w|, per step)
    bound = max(4 * K ** 0.5 * 2.0 ** -24, -(-K // 16) * 2.0 ** -23 * COMPILED) * sab
    if out_dtype == torch.bfloat16:
        bound = bound + 2.0 ** -7 * ref.abs()  # the output's bf16 cast (the interpreter's truncates): one ulp
    assert ((got - ref).abs() <= bound).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("B,win,n_entries,mode", [(3, 8, 0, "swa"), (4, 128, 40, "csa"), (2, 16, 1500, "hca"),
                                                  (1, 8, 9, "csa")])
def test_decode_slots(seed, B, win, n_entries, mode):
    """Ring slots before and after the ring fills, CSA entries with -1 holes (taken from a strided [B, 1, k]
    top-k view), HCA entries complete or not, rows permuted over a larger cache; 1500 entries: two blocks."""
    g = gen(seed)
    N = win + n_entries
    pos = torch.randint(0, 3 * win + 4 * max(n_entries, 1), (B,), generator=g)
    pos[0] = win // 2
    rows = torch.randperm(B + 3, generator=g)[:B]
    args, kw = (pos.to(DEV), rows.to(DEV), win, N), {}
    if mode == "csa":
        k = min(6, n_entries)
        ent = torch.stack([torch.randperm(n_entries, generator=g)[:k] for _ in range(B)])
        ent = torch.where(torch.rand(B, k, generator=g) < 0.3, -1, ent)
        wide = torch.full((B, 1, 2 * k), 77)
        wide[..., ::2] = ent.unsqueeze(1)
        args += (wide[..., ::2].to(DEV),)  # strided: every other element
    elif mode == "hca":
        kw = {"n_entries": n_entries, "ratio": 4}
    out, ref = run_both("decode_slots", *args, **kw)
    k = {"csa": min(6, n_entries), "hca": n_entries}.get(mode, 0)
    assert out.shape == ref.shape == (1, B, win + k)
    assert ((ref >= 0).sum(-1) > 0).all(), "every row attends something (the test needs non-trivial rows)"
    check("decode_slots", out, ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("T,G,R,K,dtype", [(1, 2, 128, 384, torch.float32), (3, 4, 64, 256, torch.float16),
                                           (2, 2, 128, 256, torch.bfloat16), (70, 2, 64, 200, torch.float32),
                                           (5, 3, 48, 128, torch.float32), (300, 2, 64, 128, torch.float16)])
def test_fp8_grouped_linear(seed, T, G, R, K, dtype):
    """wo_a: x a strided [T, G, K] view of [T, H, hd] (as the model passes it), the FP8 weight's products as
    the reference's bmm on the dequantised weight. Covers split-K decode tiles (T 1-5; K 384: three K
    blocks over two splits, a ragged K 200), 48-row groups (16-row tiles), tiles over T (70) and the
    dequantise + bmm path (300). fp32 x: products of x and the tf32-exact weight, fp32-accurate."""
    g = gen(seed)
    H = 2 * G
    x = (torch.randn(T, H, G * K // H, generator=g) * 3).to(DEV, dtype).view(T, G, K)
    w = (torch.randn(G * R, K, generator=g) * 40).to(torch.float8_e4m3fn).to(DEV)
    w_s = _pow2(g, -(-G * R // 128), -(-K // 128), lo=-10, hi=-4)
    out, ref = run_both("fp8_grouped_linear", x, w, w_s)
    assert out.shape == (T, G, R) and out.dtype == dtype
    if dtype == torch.float32:
        wd = w.double() * w_s.double().repeat_interleave(128, 0)[:G * R].repeat_interleave(128, 1)[:, :K]
        exact = torch.einsum("tgk,grk->tgr", x.double(), wd.view(G, R, K))
        mag = torch.einsum("tgk,grk->tgr", x.double().abs(), wd.abs().view(G, R, K))
        err = (out.double() - exact).abs() / mag
        assert err.max() < 1e-5, f"{err.max():.2e}: not fp32-accurate (or NaN)"
    else:
        check("fp8_grouped_linear", out, ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape,N,K,dtype", [((5,), 70, 96, torch.float32), ((2, 9), 64, 40, torch.float32),
                                             ((3,), 33, 64, torch.float16)])
def test_linear(seed, shape, N, K, dtype):
    g = gen(seed)
    x = torch.randn(*shape, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, dtype)
    check("linear", *run_both("linear", x, w))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("M,N,K,w_dtype", [(1, 96, 512, torch.bfloat16), (9, 70, 200, torch.bfloat16),
                                           (1, 34000, 64, torch.bfloat16),  # the LM head (wide N: x3 kernel)
                                           (40, 130, 192, torch.bfloat16), (300, 64, 256, torch.bfloat16),
                                           (40, 70, 96, torch.float32)])
def test_linear_f32_out_from_bf16(seed, M, N, K, w_dtype):
    """The compressor's projection: bf16 x and bf16 W (as stored), y = x.float() W.float()ᵀ in fp32 with no
    copy of either (GEMV at M <= 16, tiles above; fp32 W: the products split in two tf32 dots). Checked
    at the fp32 tolerance relative to sum |x_k w_k|: a bf16-rounded y or a tf32 product misses it."""
    g = gen(seed)
    x = (torch.randn(M, K, generator=g) * 3).to(DEV, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, w_dtype)
    out, ref = run_both("linear", x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    exact = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    err = (out.double() - exact).abs() / mag
    assert err.max() < 1e-5, f"{err.max():.2e}: not fp32-accurate (or NaN)"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("M,N,K", [(1, 300, 256), (5, 300, 200), (40, 130, 192)])
def test_linear_fp32_x_bf16_w_is_the_fp32_head(seed, M, N, K):
    """The LM head form: fp32 x, W kept bf16: F.linear(x, W.float()) at fp32 accuracy (the registry's
    float32 tolerance relative to sum |x_k w_k|; a bf16-rounded x would miss it by ~100x)."""
    g = gen(seed)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, 1), generator=g).float())).to(DEV)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV, torch.bfloat16)
    out, ref = run_both("linear", x, w)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    exact = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()  # fp32 summation error scales with sum |x_k w_k|
    err = (out.double() - exact).abs() / mag
    assert err.max() < 1e-5, f"{err.max():.2e}: not fp32-accurate (or NaN)"


@pytest.mark.parametrize("M,N", [(1, 200), (33, 70)])
def test_linear_fp32_x_bf16_w_keeps_every_bit_of_x(M, N):
    """x with a full 24-bit significand times power-of-two bf16 weights, K = 1: the exact product is an
    fp32 number, so the head kernel must return it bit for bit -- dropping any of x's low bits (a
    2-part bf16 split keeps 16 of 24) changes the result."""
    g = gen(11)
    mant = torch.randint(2**23, 2**24, (M, 1), generator=g).double() * 2.0**-24
    sgn = torch.randint(0, 2, (M, 1), generator=g).double() * 2 - 1
    x = (mant * sgn * torch.exp2(torch.randint(-8, 8, (M, 1), generator=g).double())).float().to(DEV)
    w = (torch.exp2(torch.randint(-3, 4, (N, 1), generator=g).float())
         * (torch.randint(0, 2, (N, 1), generator=g).float() * 2 - 1)).to(DEV, torch.bfloat16)
    with poisoned():
        out = REGISTRY["linear"].impls["triton"](x, w)
    exact = (x.double() @ w.double().t()).float()
    assert torch.equal(out, exact), f"{(out != exact).sum().item()} of {out.numel()} products inexact"

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("M,N,K,out_dtype", [(3, 70, 96, torch.float32), (20, 64, 256, torch.bfloat16)])
def test_fp4_gemm(seed, M, N, K, out_dtype):
    g = gen(seed)
    a = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    codes = torch.randint(0, 16, (N, K), generator=g)  # every code, -0.0 (code 8) included
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    w = fp4_pack(vals[codes]).to(DEV)
    a_s = _pow2(g, M, -(-K // 128))
    w_s = _pow2(g, N, K // 32)
    check("fp4_gemm", *run_both("fp4_gemm", a, a_s, w, w_s, out_dtype))


# --------------------------------------------------------------------------------------------- RoPE
def _one_sm(monkeypatch, module: str) -> None:
    """Tile choices that depend on the SM count take their prefill (many-token) form at test sizes."""
    monkeypatch.setattr(importlib.import_module(f"deepinfer_kernels.triton.{module}"), "sms", lambda device: 1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", [None, 3, 20])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("wide", [False, True])  # 16-head programs (decode) / 64-head ones (prefill)
def test_rope(seed, heads, inverse, wide, monkeypatch):
    if wide:
        _one_sm(monkeypatch, "rope")
    g = gen(seed)
    B, S, R = 2, 3, 12
    x = randn(g, B, S, R) if heads is None else randn(g, B, S, heads, R, dtype=torch.bfloat16)
    ang = torch.rand(B, S, R // 2, generator=g) * 6.28
    check("rope", *run_both("rope", x, ang.cos().to(DEV), ang.sin().to(DEV), inverse))
    # cos / sin as `RopeTables.get` hands them out: the two halves of one gathered [B, S, 2, R/2] row
    cs = torch.stack([ang.cos(), ang.sin()], 2).to(DEV)
    check("rope", *run_both("rope", x, cs[..., 0, :], cs[..., 1, :], inverse))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("heads", [None, 5])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_rope_in_place_on_the_tail_view(seed, heads, inverse, wide, monkeypatch):
    """`rope_tail_`'s form: out = x = the last R dims of a wider activation (strided view, B and S > 1),
    rotated where they lie: the tail equals the reference, the other dims keep their bits."""
    if wide:
        _one_sm(monkeypatch, "rope")
    g = gen(seed)
    B, S, D, R = 3, 2, 20, 8
    full = randn(g, B, S, D) if heads is None else randn(g, B, S, heads, D, dtype=torch.bfloat16)
    ang = torch.rand(B, S, R // 2, generator=g) * 6.28
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    want = REGISTRY["rope"].ref(full[..., -R:].contiguous(), cos, sin, inverse)
    before = full.clone()
    tail = full[..., -R:]
    got = REGISTRY["rope"].impls["triton"](tail, cos, sin, inverse, out=tail)
    assert got.data_ptr() == tail.data_ptr()
    check("rope", full[..., -R:], want)
    assert torch.equal(full[..., :-R], before[..., :-R])


# ------------------------------------------------------------------------------ compressor, indexer
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("overlap,r,D,out_dtype", [(True, 4, 24, torch.float32), (True, 4, 130, torch.bfloat16),
                                                   (False, 16, 20, torch.float32), (False, 1, 17, torch.bfloat16)])
def test_compress_decode(seed, overlap, r, D, out_dtype):
    """The fused decode step: pooled entries and both states (every slot of every row, untouched rows
    included) equal the reference's. Rows permuted over a larger state; positions that complete a window
    (the overlap half shifts) and positions inside one; a fresh row whose previous half is -inf. kv and
    score are the two halves of one [B, 2·C2] projection (strided rows), as the compressor passes them."""
    g = gen(seed)
    coff = 2 if overlap else 1
    B, R, C2 = 5, 7, coff * D
    kv_state, score_state = randn(g, R, coff * r, C2), randn(g, R, coff * r, C2, scale=2.0)
    rows = torch.randperm(R, generator=g)[:B].to(DEV)
    score_state[rows[1], :r] = float("-inf")
    pos = torch.tensor([r - 1, 0, 2 * r - 1, r + r // 2, 3 * r + 1])[:B].to(DEV)
    proj = torch.cat([randn(g, B, C2), randn(g, B, C2, scale=2.0)], -1)
    args = (proj[:, :C2], proj[:, C2:], randn(g, r, C2), pos, rows)
    ref_states = (kv_state.clone(), score_state.clone())
    ref = REGISTRY["compress_decode"].ref(*args, *ref_states, overlap, out_dtype)
    with poisoned():
        out = REGISTRY["compress_decode"].impls["triton"](*args, kv_state, score_state, overlap, out_dtype)
    check("compress_decode", out, ref)
    check("compress_decode", kv_state, ref_states[0])
    check("compress_decode", score_state, ref_states[1])


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("overlap,r,D", [(True, 4, 24), (False, 16, 20), (True, 2, 130), (False, 1, 17)])
@pytest.mark.parametrize("start,S,fresh", [(0, 11, True), (0, 11, False), (6, 13, False), (5, 1, False),
                                           (8, 7, False), (0, 3, True)])
def test_compress_prefill(seed, overlap, r, D, start, S, fresh):
    """A prompt chunk's windows pooled and its carry-over stored: the pooled entries and both states (every slot of
    every row, untouched rows included) equal the reference's. Chunks from position 0 (fresh: the rows' old state,
    NaN here, is never read) and continuing ones inside a window and at a window's start, chunks that complete
    several windows, one, or none (the old overlap half then stays); kv and score are the two halves of one
    [B, S, 2·C2] projection (strided rows), as the compressor passes them; bf16 entries for the CSA case."""
    g = gen(seed)
    coff = 2 if overlap else 1
    B, R, C2 = 2, 4, coff * D
    kv_state, score_state = randn(g, R, coff * r, C2), randn(g, R, coff * r, C2, scale=2.0)
    rows = torch.randperm(R, generator=g)[:B].to(DEV)
    score_state[rows[1], :r] = float("-inf")  # an empty half (a sequence's first window)
    if fresh:
        kv_state[rows], score_state[rows] = float("nan"), float("nan")
    proj = torch.cat([randn(g, B, S, C2), randn(g, B, S, C2, scale=2.0)], -1)
    out_dtype = torch.bfloat16 if overlap and r == 4 else torch.float32
    args = (proj[..., :C2], proj[..., C2:], randn(g, r, C2), start, rows)
    ref_states = (kv_state.clone(), score_state.clone())
    ref = REGISTRY["compress_prefill"].ref(*args, *ref_states, overlap, fresh, out_dtype)
    assert ref.shape == (B, (start % r + S) // r, D) and ref.dtype == out_dtype
    with poisoned():
        out = REGISTRY["compress_prefill"].impls["triton"](*args, kv_state, score_state, overlap, fresh, out_dtype)
    check("compress_prefill", out, ref)
    for got, want in zip((kv_state, score_state), ref_states):
        assert torch.equal(got[rows], want[rows]), (got[rows] - want[rows]).abs().max()  # copies: bit for bit
        assert torch.equal(got.isnan(), want.isnan()) and not got[rows].isnan().any()


@pytest.mark.parametrize("start,S,fresh", [(0, 300, True), (100, 200, False)])
def test_compress_prefill_hca_ratio(start, S, fresh):
    """Flash's HCA ratio (128 slots a window, no overlap): windows completed across a carried partial one."""
    g = gen(5)
    B, R, r, D = 1, 3, 128, 16
    kv_state, score_state = randn(g, R, r, D), randn(g, R, r, D, scale=2.0)
    rows = torch.tensor([2], device=DEV)
    args = (randn(g, B, S, D), randn(g, B, S, D, scale=2.0), randn(g, r, D), start, rows)
    ref_states = (kv_state.clone(), score_state.clone())
    ref = REGISTRY["compress_prefill"].ref(*args, *ref_states, False, fresh)
    assert ref.size(1) == (start % r + S) // r == 2
    with poisoned():
        out = REGISTRY["compress_prefill"].impls["triton"](*args, kv_state, score_state, False, fresh)
    check("compress_prefill", out, ref)
    assert torch.equal(kv_state, ref_states[0]) and torch.equal(score_state, ref_states[1])


def test_compress_prefill_refuses_a_fresh_chunk_past_zero():
    kv = torch.zeros(1, 4, 8, device=DEV)
    st = torch.zeros(1, 4, 8, device=DEV)
    for impl in (REGISTRY["compress_prefill"].ref, REGISTRY["compress_prefill"].impls["triton"]):
        with pytest.raises(ValueError, match="fresh chunk starts at position 0, not 4"):
            impl(kv, kv, torch.zeros(4, 8, device=DEV), 4, torch.tensor([0], device=DEV), st, st.clone(), False, True)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("slots,D", [(5, 20), (8, 300), (1, 16)])
def test_compress_pool(seed, slots, D):
    g = gen(seed)
    kv = randn(g, 2, 3, slots, D)
    score = randn(g, 2, 3, slots, D, scale=2.0)
    if slots > 1:  # -inf slots get weight 0 (never all of a channel's slots: that is 0/0 in the reference)
        drop = torch.rand(2, 3, slots, D, generator=g) < 0.3
        drop[:, :, 0] = False
        score = score.masked_fill(drop.to(DEV), float("-inf"))
    check("compress_pool", *run_both("compress_pool", kv, score))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("H,T,D,dtype", [(5, 7, 16, torch.float32), (4, 40, 24, torch.float32),
                                         (16, 33, 32, torch.float16)]
                         + ([(64, 50, 128, torch.bfloat16)] if COMPILED else []))  # bf16 dot: GPU only
def test_indexer_scores(seed, H, T, D, dtype):
    g = gen(seed)
    B, S = 2, 3
    q = randn(g, B, S, H, D, dtype=dtype)
    k = randn(g, B, T, D, dtype=dtype)
    w = randn(g, B, S, H) * (D ** -0.5 * H ** -0.5)
    check("indexer_scores", *run_both("indexer_scores", q, k, w))
    # decode form: k is a 5-row key cache read in place through rows (repeats and any order)
    cache = randn(g, 5, T, D, dtype=dtype)
    rows = torch.tensor([3, 0], device=DEV)
    out, ref = run_both("indexer_scores", q, cache, w, rows)
    check("indexer_scores", out, ref)
    torch.testing.assert_close(ref, REGISTRY["indexer_scores"].ref(q, cache[rows], w))
    # the model's form: weights_proj's bf16 output, scaled in the op as w.float() * scale
    wb, sc = randn(g, B, S, H, dtype=torch.bfloat16), D ** -0.5 * H ** -0.5
    out, ref = run_both("indexer_scores", q, cache, wb, rows, w_scale=sc)
    check("indexer_scores", out, ref)
    assert torch.equal(ref, REGISTRY["indexer_scores"].ref(q, cache, wb.float() * sc, rows))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("H,T,D,dtype", [(4, 40, 24, torch.float32)]
                         + ([(64, 50, 128, torch.bfloat16)] if COMPILED else []))  # bf16 dot: GPU only
def test_indexer_scores_bf16_rounding(seed, H, T, D, dtype):
    """rounding="bf16" (official numerics, model.py's bf16 einsum, weights and head sum): the Triton scores sit
    on the bf16 grid and match the reference's to one bf16 rounding of a differently ordered fp32 sum. Inputs
    bf16-exact (the interpreter's bf16 dot is wrong: fp32 operands there)."""
    g = gen(seed)
    B, S = 2, 3
    q = randn(g, B, S, H, D, dtype=torch.bfloat16).to(dtype)
    cache = randn(g, 5, T, D, dtype=torch.bfloat16).to(dtype)
    rows = torch.tensor([3, 0], device=DEV)
    wb, sc = randn(g, B, S, H, dtype=torch.bfloat16), D ** -0.5 * H ** -0.5
    out, ref = run_both("indexer_scores", q, cache, wb, rows, w_scale=sc, rounding="bf16")
    assert not torch.isnan(out).any() and (out != 0).any()
    assert torch.equal(out, out.bfloat16().float()) and torch.equal(ref, ref.bfloat16().float())
    torch.testing.assert_close(out, ref, rtol=2.0 ** -7, atol=2.0 ** -8 * ref.abs().max().item())
    assert (out == ref).float().mean() > 0.9  # the same rounding points: mostly the same bits
    fp32 = REGISTRY["indexer_scores"].ref(q, cache, wb, rows, w_scale=sc)
    assert not torch.equal(fp32, ref)  # the form matters (the test would not see a missing rounding)


def _tied_scores(g, B, S, T):
    s = torch.randn(B, S, T, generator=g).relu()  # ~half exact zeros: massive ties
    s = (s * 4).round() / 4  # more ties among the positives
    s[0, 0, : T // 3] = -0.0  # -0.0 must tie with +0.0
    s[-1, -1, -3:] = float("-inf")  # valid -inf entries still rank above invalid ones
    return s.to(DEV)


def _topk_path(monkeypatch, path: str) -> None:
    """Force topk_indices' rank selection (decode sizes) or its sort rounds for every problem size."""
    mod = importlib.import_module("deepinfer_kernels.triton.indexer")
    monkeypatch.setattr(mod, "RANK_MAX_COMPARES", 10 ** 18 if path == "rank" else -1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("path", ["rank", "sort"])
@pytest.mark.parametrize("T,k", [(37, 8), (7, 10), (64, 64), (20, 5), (33, 512), (300, 40)])
def test_topk_indices(seed, T, k, path, monkeypatch):
    _topk_path(monkeypatch, path)
    g = gen(seed)
    B, S = 2, 3
    scores = _tied_scores(g, B, S, T)
    n_valid = torch.randint(0, T + 1, (B, S), generator=g)
    n_valid[0, 0], n_valid[0, 1], n_valid[1, 0] = 0, T, 1  # all invalid, all valid, one valid
    check("topk_indices", *run_both("topk_indices", scores, k, n_valid.to(DEV)))


@pytest.mark.parametrize("seed", SEEDS)
def test_topk_indices_multi_round(seed, monkeypatch):
    """A small CHUNK forces the hierarchical path: several merge rounds of candidate keys."""
    import deepinfer_kernels.triton.indexer as ix

    monkeypatch.setattr(ix, "CHUNK", 16)
    _topk_path(monkeypatch, "sort")
    g = gen(seed)
    T, k = 300, 5  # KP 8, chunk 16: 300 -> 152 -> 80 -> 40 -> 24 -> 16 -> final
    scores = _tied_scores(g, 2, 2, T)
    n_valid = torch.tensor([[T, 250], [3, 0]])
    check("topk_indices", *run_both("topk_indices", scores, k, n_valid.to(DEV)))


# ---------------------------------------------------------------------------------------- attention
def _attn_tiles(monkeypatch, latency: bool) -> None:
    """Force the decode latency tiles (16 heads, one kv tile per split) on or off for every call size."""
    mod = importlib.import_module("deepinfer_kernels.triton.attention")
    monkeypatch.setattr(mod, "LATENCY_TOKENS", 10 ** 9 if latency else 0)


@pytest.mark.parametrize("latency", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("S,H,D,K,dtype", [(3, 5, 24, 13, torch.float32), (1, 4, 16, 40, torch.float32),
                                           (2, 20, 32, 9, torch.float16), (1, 64, 64, 70, torch.float16),
                                           (2, 40, 512, 20, torch.float32)]  # V4 head dim: 64-head tiles
                         + ([(2, 16, 64, 40, torch.bfloat16)] if COMPILED else []))  # bf16 dot: GPU only
def test_sparse_attn(seed, S, H, D, K, dtype, latency, monkeypatch):
    _attn_tiles(monkeypatch, latency)
    g = gen(seed)
    B, N = 2, 11
    q = randn(g, B, S, H, D, dtype=dtype)
    kv = randn(g, B, N, D, dtype=dtype)
    sink = randn(g, H)
    idx = torch.randint(0, N, (B, S, K), generator=g)
    idx[torch.rand(B, S, K, generator=g) < 0.3] = -1
    idx[0, 0] = -1  # a query with every slot empty -> exactly 0
    if S > 1:
        idx[1, 1, :3] = 4  # repeated rows are attended once per slot, as in the reference
    out, ref = run_both("sparse_attn", q, kv, sink, idx.to(DEV), D ** -0.5)
    check("sparse_attn", out, ref)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


@pytest.mark.parametrize("latency", [False, True])
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("B,S,H,D,K,dtype", [(2, 1, 20, 48, 300, torch.float32), (3, 1, 64, 64, 200, torch.float16),
                                             (1, 1, 8, 32, 700, torch.float32)])  # > 8 splits: combine chunks
def test_sparse_attn_split(seed, B, S, H, D, K, dtype, latency, monkeypatch):
    """Decode-sized calls split the slots over programs (flash-decoding) and combine with the sink."""
    _attn_tiles(monkeypatch, latency)
    g = gen(seed)
    N = 50
    q = randn(g, B, S, H, D, dtype=dtype)
    kv = randn(g, B, N, D, dtype=dtype)
    idx = torch.randint(0, N, (B, S, K), generator=g)
    idx[torch.rand(B, S, K, generator=g) < 0.3] = -1
    idx[0, 0] = -1
    idx[-1, -1, :150] = -1  # whole splits with nothing to attend to
    out, ref = run_both("sparse_attn", q, kv, randn(g, H, scale=3.0), idx.to(DEV), D ** -0.5)
    check("sparse_attn", out, ref)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


@pytest.mark.parametrize("latency", [False, True])
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("B,S,H,D,rd,K,dtype", [(2, 3, 5, 128, 64, 13, torch.float32),  # prefill-like
                                                (2, 1, 20, 192, 64, 300, torch.float32),  # split (decode)
                                                (3, 1, 16, 160, 32, 200, torch.float16),
                                                (1, 2, 40, 512, 64, 40, torch.float32)]  # 64-head tiles, masked
                         + ([(2, 2, 64, 512, 64, 90, torch.bfloat16)] if COMPILED else []))  # V4 dims: GPU
def test_sparse_attn_fp8_reads_the_packed_layout(seed, B, S, H, D, rd, K, dtype, latency, monkeypatch):
    """Attention over FP8-layout rows (codes, e8m0 scales, rope dims in q's dtype) equals the reference on
    the unpacked entries; per-row magnitudes 2^-8..1 exercise the scales (larger ones sharpen the softmax past
    fp32 tolerances in any implementation), -1 holes the masking."""
    _attn_tiles(monkeypatch, latency)
    g = gen(seed)
    N = 50
    q = randn(g, B, S, H, D, dtype=dtype)
    kv = torch.randn(B, N, D, generator=g) * torch.exp2(torch.randint(-8, 1, (B, N, 1), generator=g).float())
    packed = REGISTRY["kv_pack"].ref(kv.to(dtype), rd).to(DEV)
    idx = torch.randint(0, N, (B, S, K), generator=g)
    idx[torch.rand(B, S, K, generator=g) < 0.3] = -1
    idx[0, 0] = -1
    out, ref = run_both("sparse_attn_fp8", q, packed, randn(g, H, scale=3.0), idx.to(DEV), D ** -0.5, rd)
    check("sparse_attn_fp8", out, ref)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_sparse_attn_prefill_bk64_rounds_p_per_official_block(monkeypatch):
    """DEEPINFER_ATTN_PREFILL_BK=64: prefill tiles (>= 256 query tokens) take the slots in the official kernel's
    64-slot blocks, so each P is rounded against the same running max as the reference's. Slot k holds the
    one-hot row e_k, so output dim k is P_k / l with no sum in between, and each head's largest logit lies in its
    block's second half: the 32-slot tiles round the first half's P against that half's own max and miss the
    reference on ~30 % of those outputs; the 64-slot tiles only where l's fp32 sum order shows (fp16 operands:
    the interpreter rounds fp16 to nearest, where it truncates bf16). The default is the 32-slot form."""
    g = gen(0)
    B, S, H, D, rd, K = 1, 256, 16, 128, 64, 64
    kv = torch.zeros(B, K, D)
    kv[0, torch.arange(K), torch.arange(K)] = 1.0
    packed = REGISTRY["kv_pack"].ref(kv.half(), rd).to(DEV)
    q = torch.zeros(B, S, H, D)
    q[..., :K] = torch.rand(B, S, H, K, generator=g) * 6 - 3
    q[..., K // 2 + 5] += 4.0
    q = q.half().to(DEV)
    idx = torch.arange(K).expand(B, S, K).contiguous().to(DEV)
    args = (q, packed, randn(g, H).to(DEV), idx, 1.0, rd)
    ref = REGISTRY["sparse_attn_fp8"].ref(*args)
    impl = REGISTRY["sparse_attn_fp8"].impls["triton"]
    default = impl(*args)
    off = {}
    for bk in ("32", "64"):
        monkeypatch.setenv("DEEPINFER_ATTN_PREFILL_BK", bk)
        out = impl(*args)
        assert not torch.isnan(out).any()
        check("sparse_attn_fp8", out, ref)
        off[bk] = (out[..., :K // 2] != ref[..., :K // 2]).sum().item() / out[..., :K // 2].numel()
        if bk == "32":
            assert torch.equal(out, default)
    assert off["32"] > 0.1 and off["64"] < 1e-3, off


def _fp8_cache_slots_rope(g, B, S, H, N, D, rd, K, dtype) -> tuple:
    """A decode attention's other operands: N FP8-layout cache rows per batch row (magnitudes 2^-8..1), K slots
    per query (-1 holes), the step's (cos, sin) [B, S, rd/2], a sink per head -> (packed, idx, cos, sin, sink)."""
    kv = torch.randn(B, N, D, generator=g) * torch.exp2(torch.randint(-8, 1, (B, N, 1), generator=g).float())
    packed = REGISTRY["kv_pack"].ref(kv.to(dtype), rd).to(DEV)
    idx = torch.randint(-1, N, (B, S, K), generator=g).to(DEV)
    ang = torch.rand(B, S, rd // 2, generator=g) * 6.28
    return packed, idx, ang.cos().to(DEV), ang.sin().to(DEV), randn(g, H, scale=3.0)


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("B,S,H,D,rd,K,dtype", [(2, 1, 20, 192, 64, 300, torch.float32),  # split: in the combine
                                                (3, 1, 16, 160, 32, 200, torch.float16),
                                                (2, 3, 5, 128, 64, 13, torch.float32)])  # one split: rope launch
def test_sparse_attn_fp8_out_rope(seed, B, S, H, D, rd, K, dtype):
    """out_rope: the output's last rd dims de-rotated, against the reference, and the bits of the attention
    followed by the rope kernel in place (the two launches the combine's ROPE form replaces)."""
    g = gen(seed)
    N = 50
    q = randn(g, B, S, H, D, dtype=dtype)
    packed, idx, cos, sin, sink = _fp8_cache_slots_rope(g, B, S, H, N, D, rd, K, dtype)
    out, ref = run_both("sparse_attn_fp8", q, packed, sink, idx, D ** -0.5, rd, out_rope=(cos, sin))
    check("sparse_attn_fp8", out, ref)
    two = TK.attention.sparse_attn_fp8(q, packed, sink, idx, D ** -0.5, rd)
    TK.rope.rope(two[..., -rd:], cos, sin, inverse=True, out=two[..., -rd:])
    assert torch.equal(out, two)
    assert not torch.equal(out[..., -rd:], TK.attention.sparse_attn_fp8(q, packed, sink, idx, D ** -0.5, rd)[..., -rd:])


@pytest.mark.parametrize("form", ["official_q", "transformers_q"])
@pytest.mark.parametrize("B,S,H,D,rd,K,dtype", [(2, 1, 16, 128, 64, 300, torch.float32),  # split: decode
                                                (1, 1, 24, 256, 64, 170, torch.float16),
                                                (2, 3, 5, 128, 64, 13, torch.bfloat16),  # one split
                                                (3, 1, 16, 160, 32, 200, torch.float16)])  # D off a tile: two ops
def test_q_norm_sparse_attn_fp8_normalises_q_as_it_loads_it(form, B, S, H, D, rd, K, dtype):
    """Decode's q head norm and RoPE inside the attention's q load: against the reference (the two ops), and
    against Triton's rms_norm_rope then sparse_attn_fp8 -- the same bits in the interpreter; on a GPU the per-head
    sum of squares is reduced in another order (the fp32 sum, official_q then rounds it to q's dtype)."""
    g = gen(7)
    N = 50
    q = randn(g, B, S, H, D, dtype=torch.float32) * torch.exp2(torch.randint(-6, 7, (B, S, H, 1), generator=g)
                                                               .float()).to(DEV)
    q = q.to(dtype)
    packed, idx, cos, sin, sink = _fp8_cache_slots_rope(g, B, S, H, N, D, rd, K, dtype)
    args = (q, packed, sink, idx, D ** -0.5, rd, 1e-6, form, (cos, sin))
    out, ref = run_both("q_norm_sparse_attn_fp8", *args)
    check("q_norm_sparse_attn_fp8", out, ref, tol_override={"float32": (1e-5, 1e-5), "float16": (2e-2, 1e-2),
                                                            "bfloat16": (2e-2, 1e-2)})
    qn = TK.norm.rms_norm_rope(q, None, 1e-6, cos, sin, rd, form=form)
    two = TK.attention.sparse_attn_fp8(qn, packed, sink, idx, D ** -0.5, rd, out_rope=(cos, sin))
    if COMPILED:
        check("q_norm_sparse_attn_fp8", out, two)
    else:
        assert torch.equal(out, two)
    # q as given (not normed) is another attention: the norm did run
    assert not torch.allclose(out.float(), TK.attention.sparse_attn_fp8(q, packed, sink, idx, D ** -0.5, rd,
                                                                        out_rope=(cos, sin)).float(), atol=1e-3)


@pytest.mark.parametrize("B,hd,rd,dtype,pack", [(3, 512, 64, torch.bfloat16, True), (2, 192, 64, torch.float32, True),
                                               (1, 128, 64, torch.float16, True), (2, 128, 64, torch.float32, False)])
def test_rms_norm_rope_store_is_the_norm_then_kv_store_bitwise(B, hd, rd, dtype, pack):
    """Decode's kv norm packing its entry into the FP8-layout cache in the same launch: y and every cache byte
    (the written slots and the untouched ones) are the bits of Triton's rms_norm_rope then kv_store; a float cache
    (pack False) runs the two."""
    from deepinfer.quant.kv_layout import kv_packed_width

    g = gen(12)
    x = randn(g, B, 1, hd, scale=3.0, dtype=dtype)
    w = 1 + randn(g, hd, scale=0.1)
    ang = torch.rand(B, 1, rd // 2, generator=g) * 6.28
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    W = kv_packed_width(hd, rd, dtype) if pack else hd
    cache = torch.randint(0, 255, (B + 2, 7, W), generator=g, dtype=torch.uint8).to(DEV)
    if not pack:
        cache = randn(g, B + 2, 7, hd, dtype=dtype)
    rows = torch.randperm(B + 2, generator=g)[:B].to(DEV)
    slots = torch.randint(0, 7, (B,), generator=g).to(DEV)
    c1, c2 = cache.clone(), cache.clone()
    with poisoned():
        y = REGISTRY["rms_norm_rope_store"].impls["triton"](x, w, 1e-6, cos, sin, rd, c1, rows, slots, pack)
    y2 = TK.norm.rms_norm_rope(x, w, 1e-6, cos, sin, rd)
    TK.cache.kv_store(c2, rows, slots, y2.reshape(-1, hd), rope_dim=rd if pack else 0)
    assert torch.equal(y, y2) and torch.equal(c1, c2)
    assert not torch.equal(c1, cache)  # written
    check("rms_norm_rope", y, REGISTRY["rms_norm_rope"].ref(x, w, 1e-6, cos, sin, rd))


# ---------------------------------------------------------------------------------------------- mHC
def _hc_inputs(g, hc, D, dtype, n_mix, S=3):
    x = randn(g, 2, S, hc, D, dtype=dtype)
    fn = randn(g, n_mix, hc * D, scale=0.05)
    base = randn(g, n_mix, scale=0.5)
    return x, fn, base


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hc,D,dtype,S", [(4, 40, torch.float32, 3), (3, 20, torch.float32, 3),
                                          (4, 64, torch.bfloat16, 3), (4, 40, torch.float32, 45),
                                          (4, 64, torch.bfloat16, 40)])
def test_hc_pre(seed, hc, D, dtype, S):
    """S 45 / 40: 90 / 80 tokens, the token-tiled prefill mix (TILE_TOKENS) with a partial last tile, fp32
    (3xTF32 dot) and bf16 x (fn split in two tf32 dots; post and comb are fp32, checked at fp32 tolerance)."""
    g = gen(seed)
    x, fn, base = _hc_inputs(g, hc, D, dtype, (2 + hc) * hc, S)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    check("hc_pre", *run_both("hc_pre", x, fn, scale, base, 1e-6, 1e-6, 20))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hc,D,dtype,S,weighted", [(4, 256, torch.bfloat16, 3, True),
                                                   (4, 384, torch.float32, 1, False),
                                                   (3, 128, torch.bfloat16, 2, True),
                                                   (4, 256, torch.bfloat16, 40, True)])
def test_hc_pre_quant(seed, hc, D, dtype, S, weighted):
    """hc_pre, then rms_norm_quant of its y, in one op: the reference within the op tolerance; every output is
    the two Triton kernels' back to back, bit for bit, at decode (B x S < 64) and prefill sizes alike (a fused
    one-program form that summed the mixes in its own order broke speculative decoding's greedy equality)."""
    g = gen(seed)
    x, fn, base = _hc_inputs(g, hc, D, dtype, (2 + hc) * hc, S)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    w = (1 + randn(g, D, scale=0.1)) if weighted else None
    args = (x, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)
    out, ref = run_both("hc_pre_quant", *args)
    check("hc_pre_quant", out, ref)
    y0, p0, c0 = REGISTRY["hc_pre"].impls["triton"](*args[:7])
    two = (*REGISTRY["rms_norm_quant"].impls["triton"](y0, w, 1e-6), p0, c0)
    for a, b in zip(out, two):
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["hc_pre", "hc_pre_quant", "hc_head"])
def test_mhc_token_bits_do_not_depend_on_the_token_count(op):
    """A token's outputs at decode sizes are the same bits whether it is alone or one of T < 64 tokens (a batch
    of rows, a verify step of S tokens): the mix's split-K is one token's at every T (at hc 4, D 4096 it
    was 64 splits at T <= 4 and 32 at T = 5..8)."""
    g = gen(11)
    hc, D = 4, 4096  # hc·D = 16384: 64 K blocks of 256, more than 2 x 132 / T splits from T = 5 on
    R = (2 + hc) * hc if op != "hc_head" else hc
    x, fn, base = _hc_inputs(g, hc, D, torch.bfloat16, R, 1)
    x = randn(g, 6, 1, hc, D, dtype=torch.bfloat16)  # 6 rows (T = 6)
    scale = (torch.rand(3 if op != "hc_head" else 1, generator=g) + 0.5).to(DEV)
    impl = REGISTRY[op].impls["triton"]
    extra = (1e-6, 1e-6, 20) if op != "hc_head" else (1e-6, 1e-6)
    if op == "hc_pre_quant":
        extra = extra + (1 + randn(g, D, scale=0.1), 1e-6)
    many = impl(x, fn, scale, base, *extra)
    many = many if isinstance(many, tuple) else (many,)
    for t in (0, 5):
        one = impl(x[t:t + 1], fn, scale, base, *extra)
        one = one if isinstance(one, tuple) else (one,)
        for a, b in zip(many, one):
            a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
            assert torch.equal(a[t:t + 1], b), (op, t)


def _counting_side():
    """A stand-in for a `branch.Branch` handed to an op as `side`: a context manager counting its entries (on CPU
    and here the work stays on the current stream)."""

    class Side:
        entered = 0

        def __enter__(self):
            Side.entered += 1

        def __exit__(self, *exc):
            pass

    return Side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_quant_with_side_is_hc_pre_then_rms_norm_quant(dtype, monkeypatch):
    """At decode with a side stream hc_pre_quant is hc_pre(side=...) then rms_norm_quant: their bits, post / comb
    issued under the side."""
    g = gen(6)
    hc, D, S = 4, 256, 1
    x, fn, base = _hc_inputs(g, hc, D, dtype, (2 + hc) * hc, S)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    w = 1 + randn(g, D, scale=0.1)

    Side = _counting_side()
    with poisoned():
        out = REGISTRY["hc_pre_quant"].impls["triton"](x, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6, side=Side())
    assert Side.entered == 1
    y0, p0, c0 = REGISTRY["hc_pre"].impls["triton"](x, fn, scale, base, 1e-6, 1e-6, 20)
    two = (*REGISTRY["rms_norm_quant"].impls["triton"](y0, w, 1e-6), p0, c0)
    for a, b in zip(out, two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("S,side", [(1, False), (1, True), (40, False)])
def test_norm_quant_split_forms(S, side):
    """split=True (the FP4 experts' input at batch 1): rms_norm_quant's and hc_pre_quant's (with and without a
    side stream, decode and prefill sizes) fourth output is bit for bit `a_bf16_split` of their own
    q, s, and the other outputs are those without split; the reference's is `bf16_split` of its q, s."""
    from deepinfer.ops.reference import bf16_split
    from deepinfer_kernels.triton import moe_grouped

    Side = _counting_side()
    g = gen(7)
    hc, D = 4, 256
    x, fn, base = _hc_inputs(g, hc, D, torch.bfloat16, (2 + hc) * hc, S)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    w = 1 + randn(g, D, scale=0.1)
    args = (x, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)
    kw = {"side": Side()} if side else {}
    impl = REGISTRY["hc_pre_quant"].impls["triton"]
    y, q, s, o, post, comb = impl(*args, split=True, **kw)
    plain = impl(*args, **kw)
    for a, b in zip((y, q, s, post, comb), plain):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert torch.equal(o, moe_grouped.a_bf16_split(q.reshape(-1, D), s.reshape(-1, D // 128)).view_as(o))
    ry, rq, rs, ro, *_ = REGISTRY["hc_pre_quant"].ref(*args, split=True)
    assert torch.equal(ro, bf16_split(rq, rs))
    y2, q2, s2, o2 = REGISTRY["rms_norm_quant"].impls["triton"](y, w, 1e-6, split=True)
    assert torch.equal(o2, moe_grouped.a_bf16_split(q2.reshape(-1, D), s2.reshape(-1, D // 128)).view_as(o2))


@pytest.mark.parametrize("hc,D,dtype,S", [(4, 40, torch.float32, 1), (4, 64, torch.bfloat16, 3)])
def test_hc_pre_side_same_bits(hc, D, dtype, S):
    """hc_pre(side=...) (decode: post / comb issued under the branch, y in a launch of its own) gives the
    bits of the one-launch form, and issues exactly its post / comb launch under `side`."""
    g = gen(5)
    x, fn, base = _hc_inputs(g, hc, D, dtype, (2 + hc) * hc, S)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    impl = REGISTRY["hc_pre"].impls["triton"]
    one = impl(x, fn, scale, base, 1e-6, 1e-6, 20)

    Side = _counting_side()
    with poisoned():
        two = impl(x, fn, scale, base, 1e-6, 1e-6, 20, side=Side())
    assert Side.entered == 1
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hc,D,dtype,S", [(4, 40, torch.float32, 3), (3, 20, torch.float32, 3),
                                          (4, 64, torch.bfloat16, 3), (3, 20, torch.bfloat16, 40)])
def test_hc_head(seed, hc, D, dtype, S):
    g = gen(seed)
    x, fn, base = _hc_inputs(g, hc, D, dtype, hc, S)
    scale = (torch.rand(1, generator=g) + 0.5).to(DEV)
    check("hc_head", *run_both("hc_head", x, fn, scale, base, 1e-6, 1e-6))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("hc,D,dtype", [(4, 40, torch.float32), (3, 300, torch.float32), (4, 64, torch.bfloat16)])
def test_hc_post(seed, hc, D, dtype):
    g = gen(seed)
    x = randn(g, 2, 3, D, dtype=dtype)
    res = randn(g, 2, 3, hc, D, dtype=dtype)
    post = (2 * torch.rand(2, 3, hc, generator=g)).to(DEV)
    comb = torch.rand(2, 3, hc, hc, generator=g).to(DEV)
    check("hc_post", *run_both("hc_post", x, res, post, comb))


@pytest.mark.parametrize("hc,D,T,dtype,side", [(4, 256, 1, torch.bfloat16, False), (4, 256, 1, torch.bfloat16, True),
                                                (4, 4096, 3, torch.bfloat16, False),  # 64 splits of 256 columns
                                                (3, 256, 2, torch.float32, False),  # hc 3: off the tiles
                                                (4, 256, 70, torch.bfloat16, False)])  # prefill: the two ops
def test_hc_post_pre_quant_is_hc_post_then_hc_pre_quant_bitwise(hc, D, T, dtype, side):
    """The post-mix of the attention's output made inside the MoE pre-mix's first launch (decode sizes): the new
    streams, y, q, s, post and comb are the bits of Triton's hc_post then hc_pre_quant, with and without a side
    stream; the reference within the op tolerance."""
    g = gen(9)
    x = randn(g, T, 1, D, dtype=dtype)
    res = randn(g, T, 1, hc, D, dtype=dtype)
    post = (2 * torch.rand(T, 1, hc, generator=g)).to(DEV)
    comb = torch.rand(T, 1, hc, hc, generator=g).to(DEV)
    _, fn, base = _hc_inputs(g, hc, D, dtype, (2 + hc) * hc, 1)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEV)
    w = 1 + randn(g, D, scale=0.1)
    args = (x, res, post, comb, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)
    Side = _counting_side()
    with poisoned():
        out = REGISTRY["hc_post_pre_quant"].impls["triton"](*args, side=Side() if side else None)
    assert Side.entered == (1 if side else 0)
    h = REGISTRY["hc_post"].impls["triton"](x, res, post, comb)
    two = (h, *REGISTRY["hc_pre_quant"].impls["triton"](h, *args[4:]))
    assert len(out) == len(two)
    for a, b in zip(out, two):
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a, b)
    # each stage against its reference on the same input (a last-bit difference in the streams may flip an FP8
    # block scale downstream, so the whole chain is not compared at the FP8 tolerance)
    check("hc_post", out[0], REGISTRY["hc_post"].ref(x, res, post, comb))
    ref = REGISTRY["hc_pre_quant"].ref(out[0], *args[4:])
    for i in (0, 3, 4):  # the normed y, post, comb (q, s: a y near a power-of-two block amax may move its scale)
        check("hc_pre_quant", out[1 + i], ref[i])
    y, q, sc = out[1].float(), out[2].float(), out[3].repeat_interleave(128, -1)
    assert ((q * sc - y).abs() <= 2.0**-4 * y.abs() + 2.0**-9 * sc).all()  # q x s: y to one e4m3 rounding


@pytest.mark.parametrize("op", ["moe_combine_post_pre_quant", "moe_combine_post_head"])
@pytest.mark.parametrize("hc,D,T,k,side", [(4, 256, 1, 6, False), (4, 256, 1, 6, True), (4, 4096, 2, 6, False),
                                          (3, 256, 3, 1, False),  # k = 1: rows already summed (expert parallel)
                                          (4, 256, 70, 6, False)])  # prefill: the two ops
def test_moe_post_into_the_next_mix_is_the_two_ops_bitwise(op, hc, D, T, k, side):
    """A block's MoE output summed and post-mixed inside the next pre-mix's (or the hc head's) first launch at
    decode sizes: every output the bits of Triton's moe_combine_post then hc_pre_quant (hc_head); the routed rows
    read through strides (a [T, k, D] view of wider rows)."""
    head = op == "moe_combine_post_head"
    if head and side:
        pytest.skip("the head has no Sinkhorn to put on a side stream")
    g = gen(10)
    routed = randn(g, T, k, D + 64, scale=0.1, dtype=torch.bfloat16)[..., :D]  # strided rows (the model's scale)
    shared = randn(g, T, D, scale=0.1, dtype=torch.bfloat16)
    res = randn(g, T, 1, hc, D, dtype=torch.bfloat16)
    post = (2 * torch.rand(T, 1, hc, generator=g)).to(DEV)
    comb = torch.rand(T, 1, hc, hc, generator=g).to(DEV)
    R = hc if head else (2 + hc) * hc
    _, fn, base = _hc_inputs(g, hc, D, torch.bfloat16, R, 1)
    scale = (torch.rand(1 if head else 3, generator=g) + 0.5).to(DEV)
    rest = (fn, scale, base, 1e-6, 1e-6) if head else (fn, scale, base, 1e-6, 1e-6, 20, 1 + randn(g, D, scale=0.1),
                                                       1e-6)
    Side = _counting_side()
    kw = {"side": Side()} if side else {}
    with poisoned():
        out = REGISTRY[op].impls["triton"](routed, shared, res, post, comb, *rest, **kw)
    assert Side.entered == (1 if side else 0)
    h = REGISTRY["moe_combine_post"].impls["triton"](routed, shared, res, post, comb)
    second = REGISTRY["hc_head" if head else "hc_pre_quant"].impls["triton"](h, *rest)
    two = (h, second) if head else (h, *second)
    assert len(out) == len(two)
    for a, b in zip(out, two):
        a, b = (a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (a, b)
        assert torch.equal(a, b)
    check("moe_combine_post", out[0], REGISTRY["moe_combine_post"].ref(routed, shared, res, post, comb))
    if head:
        check("hc_head", out[1], REGISTRY["hc_head"].ref(out[0], *rest))


# ---------------------------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("mode", ["bias", "nobias", "hash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # the model's x is bf16 (dot_f32's split)
def test_moe_route(seed, score_func, mode, dtype):
    """Exact ties: identical gate rows, and x and the gate on grids (multiples of 2^-6 and 2^-5) that make
    every dot product exact in fp32, so the tied scores are equal in any summation order -- a BLAS under the
    interpreter sums a padded tile's columns in different orders (OpenBLAS on AVX-512 did), a GPU may too."""
    g = gen(seed)
    T, D, E, k, V = 19, 40, 20, 3, 10
    x = ((torch.randn(T, D, generator=g) * 64).round().clamp(-255, 255) / 64).to(dtype).to(DEV)
    gate = (torch.randn(E, D, generator=g) * 0.3 * 32).round() / 32
    gate[7] = gate[3]  # identical experts: exact score ties, the lower id must win
    gate[12] = gate[3]
    gate[5] *= 40  # saturate: softplus threshold branch and sigmoid tails
    bias = None
    if mode == "bias":
        bias = (torch.rand(E, generator=g) * 0.1).to(DEV)
        bias[7] = bias[3]
    tid2eid = torch.randint(0, E, (V, k), generator=g).to(DEV) if mode == "hash" else None
    ids = torch.randint(0, V, (T,), generator=g).to(DEV)
    out, ref = run_both("moe_route", x, gate.to(DEV), bias, tid2eid, ids, k, score_func, 2.5)
    check("moe_route", out, ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route_off_grid(seed, score_func, dtype):
    """Scores of full-precision inputs (no ties): the fp32-accurate dot against the reference's."""
    g = gen(seed + 10)
    T, D, E, k = 19, 40, 20, 3
    x = randn(g, T, D, dtype=dtype)
    gate = (torch.randn(E, D, generator=g) * 0.3).to(DEV)
    bias = (torch.rand(E, generator=g) * 0.1).to(DEV)
    ids = torch.zeros(T, dtype=torch.int64, device=DEV)
    check("moe_route", *run_both("moe_route", x, gate, bias, None, ids, k, score_func, 2.5))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("score_func,mode", [("sqrtsoftplus", "bias"), ("softmax", "nobias"), ("sigmoid", "hash")])
def test_moe_route_fused_select(seed, T, score_func, mode, monkeypatch):
    """Decode sizes select inside the logits launch (the last program of a token tile, after the others'
    partials): the same bits as the two-launch form, the reference within tolerance, the tile counters
    re-armed to 0 (a second call, as a graph replay, gives the same result)."""
    g = gen(seed)
    D, E, k, V = 1024, 64, 6, 10
    x = randn(g, T, D, dtype=torch.bfloat16)
    gate = (torch.randn(E, D, generator=g) * 0.05).to(DEV)
    bias = (torch.rand(E, generator=g) * 0.1).to(DEV) if mode == "bias" else None
    tid2eid = torch.randint(0, E, (V, k), generator=g).to(DEV) if mode == "hash" else None
    ids = torch.randint(0, V, (T,), generator=g).to(DEV)
    args = (x, gate, bias, tid2eid, ids, k, score_func, 2.5)
    out, ref = run_both("moe_route", *args)
    again = REGISTRY["moe_route"].impls["triton"](*args)
    monkeypatch.setattr(TK.moe, "FUSED_SELECT", False)
    two = REGISTRY["moe_route"].impls["triton"](*args)
    for a, b, c in zip(out, again, two):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not TK._common.tile_counters(x.device, 1).any()
    check("moe_route", out, ref)


@pytest.mark.parametrize("mode", ["bias", "hash"])
def test_moe_route_token_bits_do_not_depend_on_the_token_count(mode):
    """At decode sizes (T <= 16) a token's logits, scores, experts and weights are the same bits routed alone or
    among T tokens (a batch, a speculative verify): one token tile's shape and split at every T (before, 3-16
    tokens took 4-16-token tiles, 128-wide D steps and other splits, summing the logits in another order)."""
    g = gen(12)
    D, E, k, V = 2048, 64, 6, 10
    gate = (torch.randn(E, D, generator=g) * 0.05).to(DEV)
    bias = (torch.rand(E, generator=g) * 0.1).to(DEV) if mode == "bias" else None
    tid2eid = torch.randint(0, E, (V, k), generator=g).to(DEV) if mode == "hash" else None
    impl = REGISTRY["moe_route"].impls["triton"]
    for T in (7, 16):
        x = randn(g, T, D, dtype=torch.bfloat16)
        ids = torch.randint(0, V, (T,), generator=g).to(DEV)
        many = impl(x, gate, bias, tid2eid, ids, k, "sqrtsoftplus", 2.5)
        for t in (0, T - 1):
            one = impl(x[t:t + 1], gate, bias, tid2eid, ids[t:t + 1], k, "sqrtsoftplus", 2.5)
            for a, b in zip(many, one):
                assert torch.equal(a[t:t + 1], b), (T, t)


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILED, reason="a race between warps: compiled on the GPU only")
@pytest.mark.parametrize("T,D,E,k,mode,score_func", [(13, 256, 8, 2, "hash", "sqrtsoftplus"),  # deepinfer-tiny
                                                     (8, 256, 8, 2, "bias", "sqrtsoftplus"),
                                                     (40, 256, 8, 2, "nobias", "softmax"),  # the two-launch form
                                                     (16, 4096, 256, 6, "bias", "sqrtsoftplus")])  # split logits
def test_gpu_moe_route_same_bits_every_launch(T, D, E, k, mode, score_func):
    """Thousands of launches on the same inputs give the same bits. Unsplit logits are written into the scores
    tensor and scored in place; without the barrier between the read and the write, a warp holding a replica
    of the tile now and then read a score as its logit (deepinfer-tiny, H200: one token's weights off by up to
    0.19, in about one verify-and-decode run of six, scores and experts unchanged)."""
    g = gen(3)
    V = 50
    x = randn(g, T, D, dtype=torch.bfloat16)
    gate = (torch.randn(E, D, generator=g) * 0.05).to(DEV)
    bias = (torch.rand(E, generator=g) * 0.1).to(DEV) if mode == "bias" else None
    tid2eid = torch.randint(0, E, (V, k), generator=g).to(DEV) if mode == "hash" else None
    ids = torch.randint(0, V, (T,), generator=g).to(DEV)
    impl = REGISTRY["moe_route"].impls["triton"]
    args = (x, gate, bias, tid2eid, ids, k, score_func, 2.5)
    first = impl(*args)
    runs = [impl(*args) for _ in range(3000)]
    bad = sum(not all(torch.equal(a, b) for a, b in zip(first, r)) for r in runs)
    assert bad == 0, f"{bad} of {len(runs)} launches gave other bits"
    check("moe_route", first, REGISTRY["moe_route"].ref(*args))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("limit,dtype", [(0.0, torch.float32), (7.0, torch.float32), (1.5, torch.bfloat16)])
def test_swiglu(seed, limit, dtype):
    g = gen(seed)
    gate = randn(g, 3, 1100, dtype=dtype, scale=5.0)
    up = randn(g, 3, 1100, dtype=dtype, scale=5.0)
    check("swiglu", *run_both("swiglu", gate, up, limit))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, None])
def test_swiglu_routed_form(seed, out_dtype):
    """The routed experts' call: gate and up the two halves of one [P, 2I] GEMM output (row-strided views,
    read in place), each row times its routing weight, cast to the next GEMM's dtype."""
    g = gen(seed)
    P, I = 7, 300
    h13 = randn(g, P, 2 * I, dtype=torch.bfloat16, scale=5.0)
    w = torch.rand(P, generator=g).to(DEV)
    out, ref = run_both("swiglu", h13[:, :I], h13[:, I:], 7.0, weight=w, out_dtype=out_dtype)
    check("swiglu", out, ref)
    assert out.dtype == (out_dtype or torch.float32)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("P,I,weighted,out_dtype", [(7, 384, True, torch.bfloat16), (3, 128, False, torch.bfloat16),
                                                    (5, 2560, True, torch.float32)])  # > 16 blocks: two tiles
def test_swiglu_quant_is_swiglu_then_act_quant(seed, P, I, weighted, out_dtype):
    """The fused activation + FP8 quantisation for w2 equals the two Triton kernels back to back bit for bit
    (the same fp32 activation, rounded to out_dtype, then quantised), and the reference within the op
    tolerance; gate / up are the halves of one [P, 2I] output read in place."""
    g = gen(seed)
    h13 = randn(g, P, 2 * I, dtype=torch.bfloat16, scale=5.0)
    w = torch.rand(P, generator=g).to(DEV) if weighted else None
    args, kw = (h13[:, :I], h13[:, I:], 7.0), {"weight": w, "out_dtype": out_dtype}
    (q, s), ref = run_both("swiglu_quant", *args, **kw)
    y = REGISTRY["swiglu"].impls["triton"](*args, **kw)
    tq, ts = REGISTRY["act_quant"].impls["triton"](y, 128)
    assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(s, ts)
    check("swiglu_quant", (q, s), ref)



@pytest.mark.parametrize("P,I", [(6, 384), (2, 2560)])
def test_swiglu_quant_split_is_a_bf16_split_of_its_q_s(P, I):
    """split=True (an FP4 w2's input): q and s as without it, and the bf16 form the FP4 GEMM reads, bit for
    bit `a_bf16_split(q, s)` (the launch it replaces); the reference's within the op tolerance."""
    from deepinfer_kernels.triton import moe_grouped

    g = gen(4)
    h13 = randn(g, P, 2 * I, dtype=torch.bfloat16, scale=5.0)
    w = torch.rand(P, generator=g).to(DEV)
    args, kw = (h13[:, :I], h13[:, I:], 7.0), {"weight": w, "out_dtype": torch.bfloat16}
    (q, s, o), ref = run_both("swiglu_quant", *args, split=True, **kw)
    q0, s0 = REGISTRY["swiglu_quant"].impls["triton"](*args, **kw)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    assert o.dtype == torch.bfloat16 and torch.equal(o, moe_grouped.a_bf16_split(q, s))
    check("swiglu_quant", (q, s, o), ref)


# ------------------------------------------------------------------------------------------- caches
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("T,k,D,dtype,out_dtype", [(3, 6, 130, torch.bfloat16, torch.bfloat16),
                                                   (5, 1, 64, torch.float32, torch.bfloat16),
                                                   (2, 4, 700, torch.float32, torch.float32)])
def test_moe_combine(seed, T, k, D, dtype, out_dtype):
    """Σ_k routed + shared in fp32; routed read through its row strides (a [T, k, D] view of a wider buffer)."""
    g = gen(seed)
    routed = randn(g, T, k, D + 3, dtype=dtype)[..., :D]
    shared = randn(g, T, D, dtype=dtype)
    check("moe_combine", *run_both("moe_combine", routed, shared, out_dtype))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k,hc,D,dtype", [(6, 4, 130, torch.bfloat16), (1, 4, 64, torch.float32),
                                          (3, 3, 300, torch.bfloat16)])
def test_moe_combine_post(seed, k, hc, D, dtype):
    """The MoE's combine and hc_post in one launch: against the reference, and the bits of the two Triton launches
    it replaces (routed read through its row strides)."""
    g = gen(seed)
    B, S = 2, 3
    routed = randn(g, B * S, k, D + 5, dtype=dtype)[..., :D]
    shared = randn(g, B * S, D, dtype=dtype)
    res = randn(g, B, S, hc, D, dtype=dtype)
    post = (2 * torch.rand(B, S, hc, generator=g)).to(DEV)
    comb = torch.rand(B, S, hc, hc, generator=g).to(DEV)
    out, ref = run_both("moe_combine_post", routed, shared, res, post, comb)
    # bf16: the combined output is rounded to bf16 before the post-mix, as between the two ops; where a backend's
    # rounding of it differs by one step (the interpreter truncates), post (< 2) carries that step, <= 2^-7 |x|
    x = routed.float().sum(1) + shared.float()
    check("moe_combine_post", out, ref, tol_override={"bfloat16": (2e-2, 1e-2 + 2 * 2.0 ** -7 * x.abs().max().item()),
                                                     "float32": REGISTRY["moe_combine_post"].tol["float32"]})
    two = TK.mhc.hc_post(TK.moe.moe_combine(routed, shared, dtype).view(B, S, D), res, post, comb)
    assert torch.equal(out, two)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype,vdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.float16)])
def test_kv_store(seed, dtype, vdtype):
    g = gen(seed)
    R, N, D, M = 3, 8, 20, 7
    cache = randn(g, R, N, D, dtype=dtype)
    flat = torch.randperm(R * N, generator=g)[:M]  # distinct (row, slot) pairs
    rows, slots = (flat // N).to(DEV), (flat % N).to(DEV)
    values = randn(g, M, D, dtype=vdtype)
    ref_cache, tri_cache = cache.clone(), cache.clone()
    assert REGISTRY["kv_store"].ref(ref_cache, rows, slots, values) is None
    with poisoned():
        assert REGISTRY["kv_store"].impls["triton"](tri_cache, rows, slots, values) is None
    check("kv_store", tri_cache, ref_cache)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("D,rd,dtype", [(192, 64, torch.bfloat16), (128, 64, torch.float32), (576, 64, torch.float16)])
def test_kv_store_packs_into_the_fp8_layout(seed, D, rd, dtype):
    """rope_dim > 0: each entry is packed into its slot of a uint8 FP8-layout cache, byte for byte `kv_pack` then
    the store (the reference, and the two Triton launches it replaces); other slots keep their bytes."""
    g = gen(seed)
    R, N, M = 3, 8, 7
    W = kv_packed_width(D, rd, dtype)
    cache = torch.randint(0, 256, (R, N, W), generator=g, dtype=torch.uint8).to(DEV)
    flat = torch.randperm(R * N, generator=g)[:M]
    rows, slots = (flat // N).to(DEV), (flat % N).to(DEV)
    values = (torch.randn(M, D, generator=g) * torch.exp2(torch.randint(-8, 4, (M, 1), generator=g).float()))
    values = values.to(dtype).to(DEV)
    ref_cache, tri_cache, two = cache.clone(), cache.clone(), cache.clone()
    REGISTRY["kv_store"].ref(ref_cache, rows, slots, values, rope_dim=rd)
    with poisoned():
        assert REGISTRY["kv_store"].impls["triton"](tri_cache, rows, slots, values, rope_dim=rd) is None
    REGISTRY["kv_store"].impls["triton"](two, rows, slots, REGISTRY["kv_pack"].impls["triton"](values, rd))
    assert torch.equal(tri_cache, ref_cache) and torch.equal(tri_cache, two)
    assert (tri_cache != cache).any()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("D,rd,dtype", [(512, 64, torch.bfloat16), (128, 64, torch.float32), (1216, 64, torch.float16)])
def test_kv_pack_bytes_and_round_trip(seed, D, rd, dtype):
    """The FP8 KV layout byte for byte (codes, scale bytes, zeroed padding, rope bytes) and its decode: the
    official cache QAT (fp8_fake_quant per 64 on the no-RoPE dims) exactly, rope dims untouched. D 1216:
    18 scales, two 16-byte scale groups."""
    g = gen(seed)
    kv = torch.randn(3, 5, D, generator=g) * torch.exp2(torch.randint(-20, 8, (3, 5, 1), generator=g).float())
    kv[0, 0, :64] *= 1e-9  # a block under act_quant's amax floor; negative values round to -0 there
    kv = kv.to(DEV, dtype)
    check("kv_pack", *run_both("kv_pack", kv, rd))
    packed = REGISTRY["kv_pack"].ref(kv, rd)
    check("kv_unpack", *run_both("kv_unpack", packed, D, rd, dtype))
    assert packed.shape == (3, 5, kv_packed_width(D, rd, dtype))
    want = torch.cat([REGISTRY["fp8_fake_quant"].ref(kv[..., :-rd], 64), kv[..., -rd:]], -1)
    assert torch.equal(kv_unpack(packed, D, rd, dtype), want)
    assert torch.equal(kv_unpack(REGISTRY["kv_pack"].ref(want, rd), D, rd, dtype), want)  # lossless again


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("V", [300, 5000])
def test_sample(seed, V):
    g = gen(seed)
    B = 8
    logits = torch.randn(B, V, generator=g) * 3
    logits[1] = (logits[1] * 2).round() / 2  # ties for greedy and for the stable order
    logits[2, 17] = logits[2].max() + 5  # one dominant token
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.5, 1.0, 0.3, 1.0])
    top_k = torch.tensor([0, 0, 5, 0, 50, 1, 0, 3])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.9, 0.5, 1.0, 0.8, 1.0])
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    positions = torch.randint(0, 10**6, (B,), generator=g)
    args = [t.to(DEV) for t in (logits, temperature, top_k, top_p, seeds, positions)]
    check("sample", *run_both("sample", *args))


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("cand", [None, 4])
def test_sample_hard_rows(seed, cand, monkeypatch):
    """Histogram cut corner cases: massive ties, an all-equal row, a cut in the never-winning tail, top_p 0,
    and (cand = 4) the binary-search fallback for boundary sub-bins with more candidates than fit."""
    import deepinfer_kernels.triton.sampling as smp

    if cand is not None:
        monkeypatch.setattr(smp, "CAND", cand)
    g = gen(seed)
    B, V = 8, 700
    logits = torch.randn(B, V, generator=g) * 3
    logits[0] = (logits[0] * 1.5).round()  # large tie groups
    logits[1] = 0.25  # every token ties
    logits[2] *= 20  # most of the row can never win the Gumbel-max
    logits[3, :300] = float("-inf")
    temperature = torch.tensor([1.0, 0.9, 1.0, 1.2, 0.5, 1.0, 2.0, 1.0])
    top_k = torch.tensor([0, 100, 0, 0, 7, 0, 400, 1])
    top_p = torch.tensor([0.7, 0.5, 1.0, 0.9, 1.0, 0.0, 0.97, 1.0])
    seeds = torch.randint(0, 2**31, (B,), generator=g)
    positions = torch.randint(0, 10**6, (B,), generator=g)
    args = [t.to(DEV) for t in (logits, temperature, top_k, top_p, seeds, positions)]
    check("sample", *run_both("sample", *args))


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("M,N,K", [(5, 130, 1024), (130, 200, 640)])  # split-K decode / 128x128 swizzled tiles
def test_gemm_paths(seed, M, N, K):
    g = gen(seed)
    a = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    a_s = _pow2(g, M, -(-K // 128))
    w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w_s = _pow2(g, -(-N // 128), -(-K // 128))
    out, ref = run_both("fp8_gemm", a, a_s, w, w_s, torch.float32)
    if COMPILED and M > 64:  # the compiled prefill kernel promotes once per 128-K block (tc_bounds)
        assert_tensor_core_bound(out, ref, abs_products("fp8_gemm", a, a_s, w, w_s, torch.float32))
    else:
        check("fp8_gemm", out, ref, tol_override={"float32": (1e-5, 1e-6 * ref.abs().max().item())})
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    w4 = fp4_pack(vals[torch.randint(0, 16, (N, K), generator=g)]).to(DEV)
    out, ref = run_both("fp4_gemm", a, a_s, w4, _pow2(g, N, K // 32), torch.float32)
    check("fp4_gemm", out, ref, tol_override={"float32": (1e-5, 1e-6 * ref.abs().max().item())})


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("V,dtype", [(300, torch.float32), (5000, torch.float32), (257, torch.bfloat16)])
def test_logprobs(seed, V, dtype):
    x = randn(gen(seed), 3, V, dtype=dtype, scale=4.0)
    check("logprobs", *run_both("logprobs", x))


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.skipif(not COMPILED, reason="V4-sized shapes: compiled on the GPU only")
def test_v4_shapes_compiled():
    """DeepSeek-V4-like sizes, to catch what tiny shapes cannot (register limits, multi-round top-k)."""
    g = gen(0)
    B, S, H, D, N, K = 1, 4, 64, 512, 4096, 512
    q = randn(g, B, S, H, D, dtype=torch.bfloat16)
    kv = randn(g, B, N, D, dtype=torch.bfloat16)
    idx = torch.randint(-1, N, (B, S, K), generator=g).to(DEV)
    check("sparse_attn", *run_both("sparse_attn", q, kv, randn(g, H), idx, D ** -0.5))
    scores = _tied_scores(g, 2, 3, 20000)
    n_valid = torch.tensor([[20000, 15000, 100], [0, 513, 19999]], device=DEV)
    check("topk_indices", *run_both("topk_indices", scores, 512, n_valid))
    scores = _tied_scores(g, 64, 1, 1024)  # decode: batch 64, 4096 tokens of context (rank selection)
    n_valid = torch.randint(0, 1025, (64, 1), generator=g).to(DEV)
    check("topk_indices", *run_both("topk_indices", scores, 512, n_valid))
    logits = randn(g, 4, 129280, scale=3.0)
    args = [logits, torch.tensor([0.0, 1.0, 0.6, 1.0]), torch.tensor([0, 0, 50, 20]),
            torch.tensor([1.0, 0.95, 0.9, 1.0]), torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8])]
    check("sample", *run_both("sample", *[a.to(DEV) for a in args]))
    a = (torch.randn(64, 7168, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w = (torch.randn(1024, 7168, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    out, ref = run_both("fp8_gemm", a, _pow2(g, 64, 56), w, _pow2(g, 8, 56), torch.float32)
    # Two correct fp32 GEMMs at K = 7168 differ by summation order: ~eps·sqrt(K)·|terms| ≈ 1e-7 of the
    # output scale, which the registry's per-element (1e-5, 1e-5) cannot grant an element that cancels
    # to near zero (seen: 0.12 on outputs ~1e6). Relative-to-scale atol instead of a looser rtol.
    check("fp8_gemm", out, ref, tol_override={"float32": (1e-5, 1e-6 * ref.abs().max().item())})
    # Prefill M: the TMA kernel promotes to fp32 once per 128-K block, as DeepGEMM does (tc_bounds)
    a2 = (torch.randn(300, 7168, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    a2_s, w_s = _pow2(g, 300, 56), _pow2(g, 8, 56)
    for odt in (torch.float32, torch.bfloat16):
        out, ref = run_both("fp8_gemm", a2, a2_s, w, w_s, odt)
        assert_tensor_core_bound(out, ref, abs_products("fp8_gemm", a2, a2_s, w, w_s, torch.float32))
    x = randn(g, 2, 2, 4, 4096, dtype=torch.bfloat16)
    fn = randn(g, 24, 4 * 4096, scale=0.01)
    check("hc_pre", *run_both("hc_pre", x, fn, torch.tensor([0.7, 0.8, 0.9], device=DEV),
                              randn(g, 24, scale=0.5), 1e-6, 1e-6, 20))
    xr = randn(g, 64, 4096, dtype=torch.bfloat16)
    check("moe_route", *run_both("moe_route", xr, randn(g, 256, 4096, dtype=torch.bfloat16, scale=0.02),
                                 randn(g, 256, scale=0.01), None, torch.zeros(64, dtype=torch.long, device=DEV),
                                 6, "sqrtsoftplus", 2.5))
