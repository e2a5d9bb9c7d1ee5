"""The TileLang backend's kernels against the torch reference on fresh random inputs (GPU tests: they need CUDA
and TileLang), and its build-failure fallback (CPU: the helper module loads without TileLang)."""

import importlib.util
import pathlib

import pytest
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, BackendError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _common_module():
    """kernels/tilelang/_common.py on its own (the package's __init__ imports TileLang)."""
    spec = importlib.util.spec_from_file_location("tilelang_common", ROOT / "kernels/tilelang/_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_failed_build_falls_back_visibly_and_is_an_error_under_strict(capsys):
    c = _common_module()

    def broken():
        raise RuntimeError("layout inference failed\nInternalError: no layout for fragment part")

    ops.configure("torch", strict=False)
    assert c.build("act_quant", (4096, 128, "torch.bfloat16"), broken) is None
    reason = ops.fallbacks["act_quant"]
    assert "TileLang build failed for (4096, 128, 'torch.bfloat16')" in reason and "no layout for fragment" in reason
    assert "op act_quant falls back to the torch reference" in capsys.readouterr().err
    assert c.build("act_quant", (4096, 128, "torch.bfloat16"), lambda: 1 / 0) is None  # remembered: no rebuild
    assert c.build("act_quant", (256, 64, "torch.float32"), lambda: "kernel") == "kernel"
    ops.configure("torch", strict=True)
    try:
        with pytest.raises(BackendError, match="--strict: op 'fp8_gemm': TileLang build failed for"):
            c.build("fp8_gemm", (1536, 4096), broken)
    finally:
        ops.configure("torch", strict=False)


# ----------------------------------------------------------------------------------------------- GPU
def _tilelang():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("tilelang")
    from deepinfer.ops.registry import load_backend

    load_backend("tilelang")
    ops.configure("torch", strict=True)  # a kernel that fails to build must fail the test, not fall back
    return lambda name: REGISTRY[name].impls["tilelang"]


def _g(seed):
    return torch.Generator("cuda").manual_seed(seed)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,block,dtype", [((37, 4096), 128, torch.bfloat16), ((2, 3, 256), 64, torch.float32),
                                               ((1, 7168), 128, torch.bfloat16)])
def test_act_quant(shape, block, dtype):
    impl = _tilelang()("act_quant")
    x = (torch.randn(*shape, device="cuda", generator=_g(1)) * 3).to(dtype)
    x[..., :block] *= 1e-6  # a block near the 1e-4 amax floor
    q, s = impl(x, block)
    rq, rs = REGISTRY["act_quant"].ref(x, block)
    assert q.shape == rq.shape and s.shape == rs.shape and s.dtype == torch.float32
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,K,weighted", [(9, 4096, True), (3, 7168, False), (1, 1024, True)])
def test_rms_norm_quant(rows, K, weighted):
    impl = _tilelang()("rms_norm_quant")
    x = torch.randn(1, rows, K, device="cuda", generator=_g(2)).bfloat16()
    w = (torch.rand(K, device="cuda", generator=_g(3)) + 0.5) if weighted else None
    y, q, s = impl(x, w, 1e-6)
    ry, rq, rs = REGISTRY["rms_norm_quant"].ref(x, w, 1e-6)
    assert torch.isfinite(y.float()).all()
    torch.testing.assert_close(y.float(), ry.float(), rtol=2 ** -7, atol=0)  # one bf16 ulp (a last-bit rsqrt)
    assert (y == ry).float().mean() > 0.99
    same_scale = s == rs
    assert same_scale.float().mean() > 0.99  # a scale flips only where amax sits on a power of two
    deq, rdeq = q.float() * s.repeat_interleave(128, -1), rq.float() * rs.repeat_interleave(128, -1)
    torch.testing.assert_close(deq, rdeq, rtol=0.13, atol=2 ** -9)  # within one e4m3 step
    from deepinfer.ops.reference import bf16_split

    ys, qs, ss, split = impl(x, w, 1e-6, split=True)
    assert torch.equal(qs.view(torch.uint8), q.view(torch.uint8)) and torch.equal(split, bf16_split(qs, ss))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 33, 300])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm(M, out_dtype):
    """fp32 accumulation over the whole K, as the official kernel: the reference's outputs but for last-bit
    differences of the summation order."""
    impl = _tilelang()("fp8_gemm")
    N, K = 1536, 4096
    g = _g(M)
    a = (torch.randn(M, K, device="cuda", generator=g) * 50).to(torch.float8_e4m3fn)
    w = (torch.randn(N, K, device="cuda", generator=g) * 50).to(torch.float8_e4m3fn)
    a_s = torch.exp2(torch.randint(-6, 2, (M, K // 128), device="cuda", generator=g).float())
    w_s = torch.exp2(torch.randint(-9, -3, (N // 128, K // 128), device="cuda", generator=g).float())
    out = impl(a, a_s, w, w_s, out_dtype)
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, out_dtype)
    assert out.shape == (M, N) and out.dtype == out_dtype and torch.isfinite(out.float()).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 5e-5, rel
    if out_dtype == torch.bfloat16:
        assert (out != ref).float().mean().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,H,D,N,K", [(1, 9, 4, 128, 40, 12), (2, 1, 64, 512, 4096, 640), (1, 70, 64, 512, 300, 200)])
def test_sparse_attn(B, S, H, D, N, K):
    """Rounded as the reference (blocks of 64, running max over the logits, p in bf16 for P V, sink last); empty
    slots anywhere, and one token whose slots are all empty (0 out)."""
    impl = _tilelang()("sparse_attn")
    g = _g(B * 1000 + K)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(0, N, (B, S, K), device="cuda", generator=g)
    idx[torch.rand(B, S, K, device="cuda", generator=g) < 0.2] = -1
    idx[0, 0] = -1  # nothing valid: 0
    if K > 64:
        idx[-1, -1, :64] = -1  # a first block all empty, valid slots later
    out = impl(q, kv, sink, idx, D ** -0.5)
    ref = REGISTRY["sparse_attn"].ref(q, kv, sink, idx, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all() and (out[0, 0] == 0).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 2e-3, rel
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T_,D", [(1, 4096), (300, 4096), (7, 256)])
def test_hc_post_through_tile_kernels(T_, D):
    impl = _tilelang()("hc_post")
    pytest.importorskip("tile_kernels")
    g = _g(T_ + D)
    x = torch.randn(1, T_, D, device="cuda", generator=g).bfloat16()
    res = torch.randn(1, T_, 4, D, device="cuda", generator=g).bfloat16()
    post = torch.rand(1, T_, 4, device="cuda", generator=g) * 2
    comb = torch.rand(1, T_, 4, 4, device="cuda", generator=g)
    out = impl(x, res, post, comb)
    ref = REGISTRY["hc_post"].ref(x, res, post, comb)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=0)  # one bf16 rounding apart at most
    assert (out == ref).float().mean() > 0.99
