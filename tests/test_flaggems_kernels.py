"""The FlagGems backend's wrappers against the torch reference on fresh random inputs (GPU tests: they need CUDA
and flag_gems 5.0.2; skipped otherwise). Tolerances as each op's dtype justifies; `--strict`, so a call outside a
kernel's contract fails the test instead of quietly running the reference."""

import importlib.util
import sys

import pytest
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY

pytestmark = pytest.mark.gpu


def _fg():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if importlib.util.find_spec("flag_gems") is None:
        pytest.skip("needs flag_gems (pip install -e '.[flaggems]')")
    from deepinfer.ops.registry import load_backend

    load_backend("flaggems")
    ops.configure("torch", strict=True)  # an off-contract call must fail the test, not fall back
    return lambda name: REGISTRY[name].impls["flaggems"]


def _g(seed):
    return torch.Generator("cuda").manual_seed(seed)


def test_flag_gems_is_imported_by_the_first_kernel_call_on_that_device():
    impl = _fg()("act_quant")
    x = torch.randn(4, 256, device="cuda")
    impl(x, 128)
    assert "flag_gems" in sys.modules


@pytest.mark.parametrize("shape,block,dtype", [((37, 4096), 128, torch.bfloat16), ((2, 3, 256), 64, torch.float32),
                                               ((1, 7168), 128, torch.bfloat16)])
def test_act_quant_bit_exact(shape, block, dtype):
    """kernel.py's act_quant: scales are powers of two from the bits, x / s exact, e4m3 round to nearest even."""
    impl = _fg()("act_quant")
    x = (torch.randn(*shape, device="cuda", generator=_g(1)) * 3).to(dtype)
    x[..., :block] *= 1e-6  # a block near the 1e-4 amax floor
    x.view(-1)[block] = 1.75  # an amax of 448 * 2^-8: the scale is exactly a power of two
    q, s = impl(x, block)
    rq, rs = REGISTRY["act_quant"].ref(x, block)
    assert q.shape == rq.shape and s.shape == rs.shape and s.dtype == torch.float32
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("M", [1, 33, 300])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm(M, out_dtype):
    """w8a8_block_fp8_matmul scales and adds each 128-K block's FP8 dot into fp32: the tensor-core bound of a
    kernel that promotes once per 128-K block (tc_bounds, as cuBLASLt and our Triton prefill kernel), which a
    wrong tile, scale or row exceeds by orders of magnitude; ue8m0 weight scales give the same bits."""
    from tc_bounds import abs_products, assert_tensor_core_bound, block_fp8_operands

    impl = _fg()("fp8_gemm")
    N, K = 1536, 4096
    a, a_s, w, w_s = block_fp8_operands(M, N, K, _g(M))
    out = impl(a, a_s, w, w_s, out_dtype)
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, out_dtype)
    assert out.shape == (M, N) and out.dtype == out_dtype
    assert_tensor_core_bound(out, ref, abs_products("fp8_gemm", a, a_s, w, w_s, torch.float32))
    if hasattr(torch, "float8_e8m0fnu"):
        out8 = impl(a, a_s, w, w_s.to(torch.float8_e8m0fnu), out_dtype)
        assert torch.equal(out8, out)


@pytest.mark.parametrize("rows,K,weighted", [(9, 4096, True), (3, 7168, False), (1, 1024, True)])
def test_rms_norm_and_rms_norm_quant(rows, K, weighted):
    """fp32 statistics, one bf16 rounding: within a bf16 ulp of the reference (1/x.sqrt vs rsqrt: last bits);
    the quantised form within one e4m3 step."""
    f = _fg()
    x = torch.randn(1, rows, K, device="cuda", generator=_g(2)).bfloat16()
    w = (torch.rand(K, device="cuda", generator=_g(3)) + 0.5).bfloat16() if weighted else None
    y = f("rms_norm")(x, w, 1e-6)
    ry = REGISTRY["rms_norm"].ref(x, w, 1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), ry.float(), rtol=2 ** -7, atol=0)
    assert (y == ry).float().mean() > 0.98
    y2, q, s = f("rms_norm_quant")(x, w, 1e-6)
    assert torch.equal(y2, y)
    rq, rs = REGISTRY["act_quant"].ref(y, 128)  # the quantisation of this y is act_quant's, bit for bit
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.parametrize("B,S,H,D,N,K", [(1, 9, 16, 128, 40, 12), (2, 1, 64, 512, 4096, 640),
                                         (1, 70, 64, 512, 300, 200), (1, 8, 4, 128, 20, 80)])  # tiny: 4 heads
def test_sparse_attn(B, S, H, D, N, K):
    """Empty slots anywhere, a query with none valid (0 out), and a first block of 64 all empty (FlagGems' kernel
    alone gives NaN there: the adapter moves valid slots first)."""
    impl = _fg()("sparse_attn")
    g = _g(B * 1000 + K)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(0, N, (B, S, K), device="cuda", generator=g)
    idx[torch.rand(B, S, K, device="cuda", generator=g) < 0.2] = -1
    idx[0, 0] = -1
    if K > 64:
        idx[-1, -1, :64] = -1
    out = impl(q, kv, sink, idx, D ** -0.5)
    ref = REGISTRY["sparse_attn"].ref(q, kv, sink, idx, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all() and (out[0, 0] == 0).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 2e-3, rel
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu_smoke
def test_sparse_attn_fp8_reads_the_fp8_layout():
    impl = _fg()("sparse_attn_fp8")
    g = _g(31)
    B, S, H, D, N, K, rd = 2, 3, 16, 512, 300, 200, 64
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    kv = REGISTRY["kv_pack"].ref(torch.randn(B, N, D, device="cuda", generator=g).bfloat16(), rd)
    sink = torch.randn(H, device="cuda", generator=g)
    idx = torch.randint(-1, N, (B, S, K), device="cuda", generator=g)
    out = impl(q, kv, sink, idx, D ** -0.5, rd)
    ref = REGISTRY["sparse_attn_fp8"].ref(q, kv, sink, idx, D ** -0.5, rd)
    assert torch.isfinite(out.float()).all()
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3


@pytest.mark.parametrize("T_,D", [(1, 4096), (300, 4096), (7, 256)])
def test_hc_pre_sinkhorn(T_, D):
    """The mixes are the reference's (PyTorch); FlagGems' split + Sinkhorn reciprocal-multiplies: fp32 last bits."""
    f = _fg()
    g = _g(T_ * 3 + D)
    hc = 4
    x = torch.randn(1, T_, hc, D, device="cuda", generator=g).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * D, device="cuda", generator=g) * 0.02
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn((2 + hc) * hc, device="cuda", generator=g) * 0.1
    y, post, comb = f("hc_pre")(x, fn, scale, base, 1e-6, 1e-6, 20)
    ry, rpost, rcomb = REGISTRY["hc_pre"].ref(x, fn, scale, base, 1e-6, 1e-6, 20)
    torch.testing.assert_close(post, rpost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, rcomb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.float(), ry.float(), rtol=2 ** -7, atol=1e-5)
    yq, q, s, pq, cq = f("hc_pre_quant")(x, fn, scale, base, 1e-6, 1e-6, 20, None, 1e-6)
    assert torch.equal(pq, post) and torch.equal(cq, comb)


@pytest.mark.parametrize("T_,D", [(1, 4096), (300, 4096), (7, 256)])
def test_hc_post(T_, D):
    impl = _fg()("hc_post")
    g = _g(T_ + D)
    x = torch.randn(1, T_, D, device="cuda", generator=g).bfloat16()
    res = torch.randn(1, T_, 4, D, device="cuda", generator=g).bfloat16()
    post = torch.rand(1, T_, 4, device="cuda", generator=g) * 2
    comb = torch.rand(1, T_, 4, 4, device="cuda", generator=g)
    out = impl(x, res, post, comb)
    ref = REGISTRY["hc_post"].ref(x, res, post, comb)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    terms = (post.unsqueeze(-1) * x.float().unsqueeze(-2)).abs() + torch.einsum("bsjk,bsjd->bskd", comb,
                                                                                 res.float().abs())
    assert ((out.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 8 * 2 ** -24 * terms).all()
    assert (out == ref).float().mean() > 0.99
    strided = res.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [1, T, 4, D] with strided layout
    assert torch.equal(impl(x, strided, post, comb), out)
