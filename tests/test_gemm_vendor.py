"""The prefill FP8 GEMM's cuBLASLt form (`deepinfer_kernels.triton.gemm_vendor`): when `fp8_gemm` uses it, that its
arguments describe the operands (on CPU, against an emulation of the block-scaled GEMM's contract), and on the GPU
its results against the reference within the tensor-core bound, against the Triton TMA kernel, and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from deepinfer.ops import REGISTRY  # noqa: E402
from tc_bounds import abs_products, assert_tensor_core_bound  # noqa: E402

gv = pytest.importorskip("deepinfer_kernels.triton.gemm_vendor")
E4 = torch.float8_e4m3fn


def _operands(seed: int, M: int, N: int, K: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 50).to(E4)
    w = (torch.randn(N, K, generator=g) * 50).to(E4)
    a_s = torch.exp2(torch.randint(-6, 2, (M, K // 128), generator=g).float())
    w_s = torch.exp2(torch.randint(-9, -3, (N // 128, K // 128), generator=g).float())
    return [t.to(device) for t in (a, a_s, w, w_s)]


# ----------------------------------------------------------------------------------------------- CPU
@pytest.fixture
def fresh_cache():
    gv._unavailable.cache_clear()
    yield
    gv._unavailable.cache_clear()


def test_unavailable_names_why(monkeypatch, fresh_cache):
    """Decided from facts: device kind, env switch, CUDA version, the GPU's architecture."""
    assert gv.unavailable(torch.device("cpu")) == "not a CUDA device"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    assert gv._unavailable(0, "auto") is None
    assert gv._unavailable(0, "cublas") is None
    assert "DEEPINFER_FP8_GEMM=triton" in gv._unavailable(0, "triton")
    assert "DEEPINFER_FP8_GEMM=exact" in gv._unavailable(0, "exact")
    assert "DEEPINFER_FP8_GEMM=exact-wgmma" in gv._unavailable(0, "exact-wgmma")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (10, 0))
    gv._unavailable.cache_clear()  # cached per (device, mode): a device does not change architecture
    assert "sm_100" in gv._unavailable(0, "auto")
    assert gv._unavailable(0, "cublas") is None  # asked for: used wherever torch has it
    gv._unavailable.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "12.9" in gv._unavailable(0, "cublas")


def test_mode_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "cutlass")
    with pytest.raises(ValueError, match="DEEPINFER_FP8_GEMM='cutlass'"):
        gv.mode()
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", " Triton ")
    assert gv.mode() == "triton"


def test_exact_is_the_default(monkeypatch, fresh_cache):
    """Official numerics' FP8 GEMMs accumulate as the official kernel does unless asked otherwise: cuBLASLt's
    block-scaled GEMM (promotion per 128-K block) is opt-in."""
    monkeypatch.delenv("DEEPINFER_FP8_GEMM", raising=False)
    assert gv.mode() == "exact"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    assert gv._unavailable(0, gv.mode()) == "DEEPINFER_FP8_GEMM=exact"


@pytest.mark.parametrize("M,N,K,dt,ok", [(65, 128, 512, torch.bfloat16, True), (64, 128, 512, torch.bfloat16, False),
                                         (300, 1536, 7168, torch.float32, True), (300, 200, 512, torch.bfloat16, False),
                                         (300, 256, 640, torch.bfloat16, False), (300, 256, 512, torch.float16, False)])
def test_shape_ok(M, N, K, dt, ok):
    a, _, w, _ = _operands(0, M, N, K)
    assert gv.shape_ok(a, w, dt) is ok


def _emulated_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=None, **_):
    """The block-scaled GEMM's contract as documented for cuBLASLt: a [M, K] row-major, b [K, N] column-major,
    scale_a [M, K/128] with M contiguous (16-byte columns), scale_b [K/128, N/128]; fp32 result."""
    assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
    M, K = a.shape
    N = b.size(1)
    assert a.is_contiguous() and b.t().is_contiguous() and M % 4 == 0
    assert scale_a.shape == (M, K // 128) and scale_a.stride() == (1, M)
    assert scale_b.shape == (K // 128, N // 128)
    af = a.float() * scale_a.repeat_interleave(128, 1)
    bf = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (af @ bf).to(output_dtype)


@pytest.mark.parametrize("M", [68, 130])  # 130: a ragged M, padded to 132 rows
def test_block_scaled_arguments(monkeypatch, M):
    """The wrapper's layout work (scale transpose, row padding, the first M rows back) against the reference."""
    monkeypatch.setattr(F, "scaled_mm", _emulated_scaled_mm)
    a, a_s, w, w_s = _operands(1, M, 256, 1024)
    out = gv.fp8_gemm_block_scaled(a, a_s, w, w_s, torch.float32)
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, torch.float32)
    assert out.shape == (M, 256) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(65, 1536, 4096), (301, 256, 7168), (2048, 4096, 2048)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cublas_fp8_gemm_on_gpu(monkeypatch, fresh_cache, M, N, K, out_dtype):
    """`fp8_gemm` takes cuBLASLt here (counted), within the tensor-core bound of the reference, and within twice
    that bound of the Triton TMA kernel (DEEPINFER_FP8_GEMM=triton)."""
    from deepinfer_kernels.triton import gemm

    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "auto")
    if gv.unavailable(torch.device("cuda")) is not None:
        pytest.skip(gv.unavailable(torch.device("cuda")))
    calls = []
    real = F.scaled_mm
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, a_s, w, w_s = _operands(M + N, M, N, K, "cuda")
    out = gemm.fp8_gemm(a, a_s, w, w_s, out_dtype)
    assert calls and out.shape == (M, N) and out.dtype == out_dtype
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, torch.float32)
    mag = abs_products("fp8_gemm", a, a_s, w, w_s, torch.float32)
    assert_tensor_core_bound(out, ref, mag)
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "triton")
    tri = gemm.fp8_gemm(a, a_s, w, w_s, out_dtype)
    assert len(calls) == 1
    assert_tensor_core_bound(out, tri.double(), 2 * mag)


@pytest.mark.gpu
def test_cublas_fp8_gemm_in_a_cuda_graph(monkeypatch, fresh_cache):
    """Decode buckets above 64 rows capture it: replay gives the eager bits, with new inputs copied in."""
    from deepinfer_kernels.triton import gemm

    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "auto")
    if gv.unavailable(torch.device("cuda")) is not None:
        pytest.skip(gv.unavailable(torch.device("cuda")))
    a, a_s, w, w_s = _operands(5, 128, 1024, 4096, "cuda")
    gemm.fp8_gemm(a, a_s, w, w_s)  # warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemm.fp8_gemm(a, a_s, w, w_s)
    a2, a2_s, _, _ = _operands(6, 128, 1024, 4096, "cuda")
    a.copy_(a2)
    a_s.copy_(a2_s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemm.fp8_gemm(a2, a2_s, w, w_s))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "exact-wgmma"])
@pytest.mark.parametrize("M,N,K", [(4096, 1536, 4096), (301, 256, 7168)])
def test_exact_prefill_gemm_accumulates_in_fp32(monkeypatch, fresh_cache, mode, M, N, K):
    """DEEPINFER_FP8_GEMM=exact (the default) and exact-wgmma: the TMA kernel sums exact products in fp32, so its
    bf16 outputs are the fp32 reference's but for last-bit ties of the summation order (exact, H200: 5e-6 relative
    to the official fp8_gemm at M 4096). Promotion per 128-K block measured 6.9e-4 with 6.7 % of the outputs one
    ulp off."""
    from deepinfer_kernels.triton import gemm

    monkeypatch.setenv("DEEPINFER_FP8_GEMM", mode)
    a, a_s, w, w_s = _operands(M + K, M, N, K, "cuda")
    out = gemm.fp8_gemm(a, a_s, w, w_s, torch.bfloat16)
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, torch.bfloat16)
    assert torch.isfinite(out.float()).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    differ = (out != ref).float().mean().item()
    assert rel < 5e-5 and differ < 1e-3, (rel, differ)
