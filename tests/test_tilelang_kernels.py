"""The TileLang backend's kernels against the torch reference on fresh random inputs (GPU tests: they need CUDA
and TileLang), and its build-failure fallback (CPU: the helper module loads without TileLang)."""

import importlib.util
import pathlib

import pytest
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, BackendError

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.tilelang_gpu  # with `gpu`, the TileLang half of a split GPU run (README)


def _common_module():
    """deepinfer_kernels/tilelang/_common.py on its own (the package's __init__ imports TileLang)."""
    spec = importlib.util.spec_from_file_location("tilelang_common", ROOT / "deepinfer_kernels/tilelang/_common.py")
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


def test_ws_attention_takes_only_shapes_its_copies_cover():
    """The warp-specialised sparse attention's shape guard (no GPU needed, TileLang is): Q's cp.async copy splits a
    half-row over D / 16 threads, which must divide the scorer's 128 (D 384 gives 24: rows would go unloaded); every
    64-slot block needs a prologue thread; and it must fit sm_90's shared memory (Q, two stages, the slot ids)."""
    pytest.importorskip("tilelang")
    from deepinfer_kernels.tilelang import attention_ws as a

    assert all(a.ws_fits(H, D, K) for H, D, K in [(64, 512, 640), (128, 512, 1152), (64, 128, 12), (64, 256, 70)])
    assert not a.ws_fits(64, 384, 640) and not a.ws_fits(64, 640, 640) and not a.ws_fits(64, 96, 640)
    assert not a.ws_fits(64, 512, 8000) and a.smem_bytes(512, 8000) > a.SMEM_BYTES
    assert not a.ws_fits(64, 128, 385 * 64) and a.ws_fits(64, 128, 384 * 64)
    with pytest.raises(AssertionError):
        a.sparse_attn_ws_kernel(64, 384, 640, "bfloat16", 0.05)


def _lower_fold_ws(K: int, out_dt: str, BM: int) -> str:
    """grouped_fp4_ws.py's kernel (E 8, N 256) lowered to CUDA source for sm_90a, without a GPU."""
    import tilelang
    import tvm

    from deepinfer_kernels.tilelang import grouped_fp4_ws as ws

    target = {"kind": "cuda", "arch": "sm_90a"}
    with tvm.transform.PassContext(opt_level=3, config=ws.PASS_CONFIGS), tvm.target.Target(target):
        return tilelang.lower(ws.grouped_fp4_fold_ws_kernel(8, 256, K, out_dt, BM), target=target).kernel_source


def test_fold_ws_gemm_decodes_while_its_mma_runs():
    """The warp-specialised folded FP4 GEMM, lowered for sm_90a (no GPU needed, TileLang and nvcc are): each consumer
    issues its step's wgmma without waiting, decodes the next step's weights, then waits -- a synchronous gemm
    (TileLang's `warpgroup_wait<0>` after the issue) would put decode and MMA back in turn. The packed weights are
    copied with the L2 prefetch hint; the shape guard and the stage count follow the shared memory."""
    pytest.importorskip("tilelang")
    from deepinfer_kernels.tilelang import grouped_fp4_ws as ws

    src = _lower_fold_ws(512, "bfloat16", 128)
    assert "warpgroup_wait<0>" not in src
    mma = src.index("wgmma_ss")
    assert mma < src.index("di_fp4_group_e4m3(", mma) < src.index("wait_wgmma<0>", mma)
    assert "di_cp_async16<256>(" in src
    assert ws.stages_for(128, 2) == 4 and ws.stages_for(128, 4) == 3 and ws.stages_for(64, 4) == 4
    assert ws.takes(4096, 4096, 128) and ws.takes(2048, 4096, 64)
    assert not ws.takes(192, 384, 128) and not ws.takes(256, 512, 16) and not ws.takes(256, 320, 64)


@pytest.mark.parametrize("K,out_dt,BM", [(640, "bfloat16", 128), (512, "float32", 128), (768, "bfloat16", 64),
                                         (4096, "bfloat16", 128)])
def test_fold_ws_gemm_wgmma_stays_async_at_any_k(K, out_dt, BM, tmp_path):
    """ptxas keeps the consumers' wgmma asynchronous when K / 128 is not a multiple of the stage count (no GPU needed;
    TileLang and nvcc are): a wgmma under a per-step branch is one it cannot prove uniform, and it then serialises it
    (C7518) or waits for it before the decode (C7517). Nor may the registers spill."""
    pytest.importorskip("tilelang")
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    import tilelang

    (tmp_path / "k.cu").write_text(_lower_fold_ws(K, out_dt, BM))
    tl = pathlib.Path(tilelang.__file__).parent
    r = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-std=c++17", f"-I{tl}/src", f"-I{tl}/3rdparty/cutlass/include",
                        "-Xptxas=-v", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")],
                       capture_output=True, text=True)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    assert "C7517" not in log and "C7518" not in log, log[-2000:]
    assert " 0 bytes spill stores" in log, log[-2000:]


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
    from tc_bounds import block_fp8_operands

    impl = _tilelang()("fp8_gemm")
    N, K = 1536, 4096
    a, a_s, w, w_s = block_fp8_operands(M, N, K, _g(M))
    out = impl(a, a_s, w, w_s, out_dtype)
    ref = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s, out_dtype)
    assert out.shape == (M, N) and out.dtype == out_dtype and torch.isfinite(out.float()).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 5e-5, rel
    if out_dtype == torch.bfloat16:
        assert (out != ref).float().mean().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "plain"])
@pytest.mark.parametrize("B,S,H,D,N,K", [(1, 9, 4, 128, 40, 12), (2, 1, 64, 512, 4096, 640), (1, 70, 64, 512, 300, 200),
                                         (2, 5, 128, 512, 700, 300), (1, 3, 72, 256, 100, 70),
                                         (1, 300, 64, 512, 2000, 256), (2, 150, 64, 128, 500, 100),
                                         (1, 80, 128, 512, 700, 300)])
def test_sparse_attn(B, S, H, D, N, K, form, monkeypatch):
    """Rounded as the reference (blocks of 64, running max over the logits, p in bf16 for P V, sink last); empty
    slots anywhere, and one token whose slots are all empty (0 out). Both forms (DEEPINFER_TL_ATTN): the
    warp-specialised one at an odd number of 64-slot blocks (its stages alternate), two 64-head blocks (H 128) and
    padded heads (H 72), and batch rows read through their own cache (B 2); more programs than an H200 has SMs
    (300 tokens; 300 programs of a single block pair, where each stage half is gathered once; 160 programs at
    H 128)."""
    monkeypatch.setenv("DEEPINFER_TL_ATTN", form)
    impl = _tilelang()("sparse_attn")
    from deepinfer_kernels.tilelang import attention
    before = attention.FORMS_RUN[form]
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
    assert attention.FORMS_RUN[form] == before + 1
    ref = REGISTRY["sparse_attn"].ref(q, kv, sink, idx, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all() and (out[0, 0] == 0).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 2e-3, rel
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["ws", "plain"])
def test_sparse_attn_empty_blocks(form, monkeypatch):
    """Whole 64-slot blocks of -1 (the model's prefill layout: a short window and few compressed entries early on,
    plus blocks emptied at random, the first and the middle ones included) contribute nothing: the output equals,
    bit for bit, the output over the same slots with the empty blocks removed (the ws form skips them; each is an
    exact no-op of the online softmax), and both match the reference."""
    monkeypatch.setenv("DEEPINFER_TL_ATTN", form)
    impl = _tilelang()("sparse_attn")
    S, H, D = 300, 64, 512
    g = torch.Generator().manual_seed(7)
    from deepinfer.debug.ab_cases import prefill_layout_idx

    idx, N = prefill_layout_idx(S, 128, 2, 192, g)  # K 320: 5 blocks, the last one filled from token 257 on
    idx = idx[0]
    K = idx.size(1)
    drop = torch.rand(S, K // 64, generator=g) < 0.25
    idx = idx.masked_fill(drop.repeat_interleave(64, 1), -1)
    blocks = idx.view(S, K // 64, 64)
    keep = (blocks >= 0).any(-1)  # [S, blocks]
    packed = torch.full_like(idx, -1)  # the non-empty blocks in order, then -1
    for t in range(S):
        kept = blocks[t, keep[t]].reshape(-1)
        packed[t, :kept.numel()] = kept
    assert (~keep).sum() > S  # many empty blocks, in every position
    assert (~keep[:, 0]).any() and (~keep[:, 3]).any() and keep[:, -1].any()
    gc = _g(S)
    q = torch.randn(1, S, H, D, device="cuda", generator=gc).bfloat16()
    kv = torch.randn(1, N, D, device="cuda", generator=gc).bfloat16()
    sink = torch.randn(H, device="cuda", generator=gc)
    idx, packed = idx.cuda().unsqueeze(0), packed.cuda().unsqueeze(0)
    out = impl(q, kv, sink, idx, D ** -0.5)
    out_packed = impl(q, kv, sink, packed, D ** -0.5)
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, out_packed)
    ref = REGISTRY["sparse_attn"].ref(q, kv, sink, idx, D ** -0.5)
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
    # one bf16 rounding apart, plus the fp32 summation order where the five terms cancel to near 0
    terms = (post.unsqueeze(-1) * x.float().unsqueeze(-2)).abs() + torch.einsum("bsjk,bsjd->bskd", comb,
                                                                                 res.float().abs())
    assert ((out.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 8 * 2 ** -24 * terms).all()
    assert (out == ref).float().mean() > 0.99


# ------------------------------------------------------------------------------ experts, indexer, mHC pre, routing
def _fp4_weights(E, N, K, g):
    from deepinfer.quant.formats import quant_fp4, scale_f32

    w = torch.randn(E * N, K, device="cuda", generator=g) * 0.05
    q, s = quant_fp4(w, 32)
    return q.view(E, N, K // 2), scale_f32(s).view(E, N, K // 32)


def _abs_fp4(w):
    """|w| of packed e2m1 (both nibbles' sign bits cleared), in w's dtype."""
    return (w.view(torch.uint8) & 0x77).view(w.dtype)


def _abs_e4m3(a):
    return (a.view(torch.uint8) & 0x7F).view(a.dtype)


def _forms_run(call):
    """call() and the grouped FP4 forms it ran ({"fold": n, "bf16": m}, calls of each)."""
    from deepinfer_kernels.tilelang import grouped_fp4

    before = dict(grouped_fp4.FORMS_RUN)
    out = call()
    return out, {f: n - before.get(f, 0) for f, n in grouped_fp4.FORMS_RUN.items() if n - before.get(f, 0)}


def _within_fp8_mma_sums(out, ref, ref_abs, out_dtype):
    """The folded form's bound: Hopper's FP8 wgmma sums keep ~14 significant bits, truncated (DeepSeek-V3 report,
    3.3.2; why DeepGEMM and kernel.py promote per 128-K block). A 128-K block is four 32-K products, each summed
    and added into the fragment that way: up to 7 truncations of at most 2^-13 of a partial sum <= sum|a w|, so
    |out - ref| <= 2^-10 sum|a w| per element, plus the output's rounding (bf16: one ulp, where the two round to
    neighbours). Measured on the H200 (2026-12-03): 2^-16.8 with quant_fp4 weights, 2^-10.9 at the spread-11 edge."""
    tol = 2 ** -10 * ref_abs.float() + (2 ** -7 * ref.float().abs() if out_dtype == torch.bfloat16 else 0)
    err = (out.float() - ref.float()).abs()
    worst = (err / ref_abs.float().clamp_min(1e-30)).max().item()
    assert torch.isfinite(out.float()).all() and (err <= tol).all(), f"max err / sum|a w| = {worst:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["fold", "bf16", "fp8"])
@pytest.mark.parametrize("P,E,N,K", [(6, 16, 256, 512), (384, 64, 512, 1024), (600, 8, 256, 512), (1000, 8, 128, 256),
                                     (40, 4, 192, 384), (600, 4, 192, 384)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_fp4(P, E, N, K, out_dtype, form, monkeypatch):
    """The FP4 forms: "fold" (the folded FP8 form at 64- and 128-row blocks: grouped_fp4_ws.py's warp-specialised
    kernel, or grouped_fp4.py's at N = 192, whose 64-row weight tiles it does not take), "bf16" (grouped_fp4.py:
    weights decoded to exact bf16 tiles, the split A, one fp32 accumulation in the tensor core; 16-row blocks at
    P <= 256, 64 or 128 beyond; N = 192 takes 64-row weight tiles) and
    "fp8" (kernel.py's fp4_gemm: e4m3 tiles, one FP8 MMA per 32-K step, scales in fp32). The reference's values but
    for the fp32 summation order; rows of no expert (e = -1) are 0; ue8m0 bytes and f32 scales give the same bits,
    and so does the producer's split form (a_split)."""
    monkeypatch.setenv("DEEPINFER_TL_FP4", form)
    impl = _tilelang()("grouped_gemm")
    g = _g(P + E)
    w, w_s = _fp4_weights(E, N, K, g)
    from deepinfer.ops.reference import act_quant, bf16_split

    a, a_s = act_quant(torch.randn(P, K, device="cuda", generator=g), 128)
    e = torch.randint(0, E, (P,), device="cuda", generator=g)
    e[::7] = -1
    out, ran = _forms_run(lambda: impl(a, a_s, e, w, w_s, out_dtype))
    ref = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, out_dtype)
    assert out.shape == (P, N) and out.dtype == out_dtype and torch.isfinite(out.float()).all()
    assert (out[e < 0] == 0).all()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    from deepinfer_kernels.tilelang import grouped_fp4

    folded = form == "fold" and grouped_fp4.block_rows(P, E) >= 64  # these weights' scales lie within 2^11
    assert ran == ({} if form == "fp8" else {"fold": 1} if folded else {"bf16": 1}), ran
    if folded:
        ref_abs = REGISTRY["grouped_gemm"].ref(_abs_e4m3(a), a_s, e, _abs_fp4(w), w_s, torch.float32)
        _within_fp8_mma_sums(out, ref, ref_abs, out_dtype)
        assert rel < (1e-3 if out_dtype == torch.float32 else 3e-3), rel
    else:
        assert rel < (1e-5 if out_dtype == torch.float32 else 3e-3), rel
    from deepinfer.quant.formats import float_to_e8m0

    out8 = impl(a, a_s, e, w, float_to_e8m0(w_s), out_dtype)  # ue8m0 bytes, as the checkpoint holds them
    assert torch.equal(out8, out)
    if form != "fp8":  # the producer's split form: the same bits (the folded form reads a itself)
        assert torch.equal(impl(a, a_s, e, w, w_s, out_dtype, a_split=bf16_split(a, a_s)), out)


@pytest.mark.gpu
def test_grouped_gemm_fp4_bf16_form_exact_for_any_scale_spread(monkeypatch):
    """Group scales 2^-40 .. 2^+29 side by side in one 128-K block, the weights of every group scaled above 1 zeroed:
    the output is the small groups' alone, and a form that folded a block's four scales into its largest (an e4m3
    tile with one scale per 128) would flush them. The bf16 form stays within fp32 summation order of the
    reference."""
    impl = _tilelang()("grouped_gemm")
    g = _g(11)
    P, E, N, K = 300, 4, 128, 512
    from deepinfer.ops.reference import act_quant

    w = torch.randint(-128, 128, (E, N, K // 2), device="cuda", generator=g, dtype=torch.int8)
    w_s = torch.randint(127 - 40, 127 + 30, (E, N, K // 32), device="cuda", generator=g).to(torch.uint8)
    w.view(E, N, K // 32, 16)[w_s > 127] = 0
    a, a_s = act_quant(torch.randn(P, K, device="cuda", generator=g), 128)
    e = torch.randint(0, E, (P,), device="cuda", generator=g)
    from deepinfer_kernels.tilelang import grouped_fp4

    assert not grouped_fp4.fold_ok(w_s)  # so even DEEPINFER_TL_FP4=fold runs bf16 at these 128-row blocks
    monkeypatch.setenv("DEEPINFER_TL_FP4", "fold")
    out = impl(a, a_s, e, w, w_s, torch.float32)
    ref = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, torch.float32)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("spread", [11, 12])
def test_grouped_gemm_fp4_fold_exact_to_its_spread(spread, monkeypatch):
    """The folded FP8 form at the edge of what it takes: in every 128-K block one group holds the largest scale and
    zero weights, the other three scales lie `spread` below it or less (one at the bottom), with every e2m1 code.
    The output is the small groups' alone, so a decode that flushed or rounded them shows. Spread 11 runs folded
    (each group's shift d >= -5: every value a normal e4m3), 12 runs the bf16 form; both match the reference."""
    monkeypatch.setenv("DEEPINFER_TL_FP4", "fold")
    impl = _tilelang()("grouped_gemm")
    g = _g(13 + spread)
    P, E, N, K = 600, 4, 128, 512
    from deepinfer.ops.reference import act_quant
    from deepinfer_kernels.tilelang import grouped_fp4

    w = torch.randint(-128, 128, (E, N, K // 2), device="cuda", generator=g, dtype=torch.int8)
    base = torch.randint(100, 130, (E, N, K // 128, 1), device="cuda", generator=g)
    off = torch.randint(0, spread + 1, (E, N, K // 128, 4), device="cuda", generator=g)
    off[..., 0] = spread  # the largest scale: its group's weights zeroed
    off[..., 1] = 0
    w_s = (base + off).view(E, N, K // 32).to(torch.uint8)
    w.view(E, N, K // 128, 4, 16)[..., 0, :] = 0
    assert grouped_fp4.fold_ok(w_s) == (spread <= grouped_fp4.FOLD_SPREAD)
    a, a_s = act_quant(torch.randn(P, K, device="cuda", generator=g), 128)
    e = torch.randint(0, E, (P,), device="cuda", generator=g)
    out, ran = _forms_run(lambda: impl(a, a_s, e, w, w_s, torch.float32))
    ref = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, torch.float32)
    assert ran == ({"fold": 1} if spread <= 11 else {"bf16": 1}), ran
    ref_abs = REGISTRY["grouped_gemm"].ref(_abs_e4m3(a), a_s, e, _abs_fp4(w), w_s, torch.float32)
    _within_fp8_mma_sums(out, ref, ref_abs, torch.float32)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.gpu
def test_grouped_gemm_fp8_and_fp4_gemm():
    impl = _tilelang()("grouped_gemm")
    g = _g(5)
    P, E, N, K = 200, 8, 256, 512
    from deepinfer.ops.reference import act_quant
    from deepinfer.quant.formats import quant_fp8_block, scale_f32

    a, a_s = act_quant(torch.randn(P, K, device="cuda", generator=g), 128)
    w, w_s = quant_fp8_block(torch.randn(E, N, K, device="cuda", generator=g) * 0.05)
    w_s = scale_f32(w_s)
    e = torch.randint(-1, E, (P,), device="cuda", generator=g)
    out = impl(a, a_s, e, w, w_s, torch.float32)
    ref = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, torch.float32)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    w4, s4 = _fp4_weights(1, N, K, g)
    o4 = _tilelang()("fp4_gemm")(a, a_s, w4[0], s4[0], torch.float32)
    r4 = REGISTRY["fp4_gemm"].ref(a, a_s, w4[0], s4[0], torch.float32)
    assert ((o4 - r4).norm() / r4.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,H,D,T_,rows", [(1, 37, 64, 128, 300, False), (3, 1, 64, 128, 1000, True),
                                               (2, 5, 4, 64, 70, False)])
def test_indexer_scores_bf16(B, S, H, D, T_, rows):
    """model.py's roundings (bf16 logits, bf16 w', bf16 products, one bf16 rounding of the fp32 head sum): equal
    to the reference but where the fp32 order of a sum lands on the other side of a bf16 rounding."""
    impl = _tilelang()("indexer_scores")
    g = _g(B * S + T_)
    q = torch.randn(B, S, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B + 2 if rows else B, T_, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, S, H, device="cuda", generator=g).bfloat16()
    r = torch.randperm(B + 2, device="cuda", generator=g)[:B] if rows else None
    out = impl(q, k, w, r, D ** -0.5 * H ** -0.5, "bf16")
    ref = REGISTRY["indexer_scores"].ref(q, k, w, r, D ** -0.5 * H ** -0.5, "bf16")
    assert out.shape == (B, S, T_) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out == ref).float().mean() > 0.98
    torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("T_,D", [(1, 4096), (300, 4096), (7, 256)])
def test_hc_pre_through_tile_kernels(T_, D):
    impl = _tilelang()("hc_pre")
    pytest.importorskip("tile_kernels")
    g = _g(T_ * 3 + D)
    hc = 4
    x = torch.randn(1, T_, hc, D, device="cuda", generator=g).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * D, device="cuda", generator=g) * 0.02
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn((2 + hc) * hc, device="cuda", generator=g) * 0.1
    y, post, comb = impl(x, fn, scale, base, 1e-6, 1e-6, 20)
    ry, rpost, rcomb = REGISTRY["hc_pre"].ref(x, fn, scale, base, 1e-6, 1e-6, 20)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    torch.testing.assert_close(post, rpost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, rcomb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.float(), ry.float(), rtol=2 ** -7, atol=1e-5)
    yq, q, s, pq, cq = _tilelang()("hc_pre_quant")(x, fn, scale, base, 1e-6, 1e-6, 20, None, 1e-6)
    assert torch.equal(yq, REGISTRY["rms_norm"].ref(y, None, 1e-6)) or (yq == REGISTRY["rms_norm"].ref(y, None, 1e-6)
                                                                         ).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("hash_layer", [False, True])
def test_moe_route_through_tile_kernels(hash_layer):
    impl = _tilelang()("moe_route")
    pytest.importorskip("tile_kernels")
    g = _g(11 + hash_layer)
    T_, D, E, k, V = 300, 1024, 64, 6, 1000
    x = torch.randn(T_, D, device="cuda", generator=g).bfloat16()
    gw = (torch.randn(E, D, device="cuda", generator=g) * 0.05).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.1
    tid2eid = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(V)]) if hash_layer else None
    ids = torch.randint(0, V, (T_,), device="cuda", generator=g)
    w, idx, sc = impl(x, gw, None if hash_layer else bias, tid2eid, ids, k, "sqrtsoftplus", 1.5)
    rw, ridx, rsc = REGISTRY["moe_route"].ref(x, gw, None if hash_layer else bias, tid2eid, ids, k, "sqrtsoftplus", 1.5)
    torch.testing.assert_close(sc, rsc, rtol=1e-4, atol=1e-5)
    same = (idx == ridx).all(-1)
    assert same.float().mean() > 0.99  # a near-tie of two biased scores may order differently
    torch.testing.assert_close(w[same], rw[same], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.full_like(w[:, 0], 1.5), rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_fp4_fake_quant_bit_exact_and_quant_compositions():
    impl = _tilelang()("fp4_fake_quant")
    g = _g(21)
    x = (torch.randn(37, 128, device="cuda", generator=g) * 3).bfloat16()
    x[0, :32] = 0  # an all-zero block: the amax floor
    assert torch.equal(impl(x, 32), REGISTRY["fp4_fake_quant"].ref(x, 32))
    y = torch.randn(5, 512, device="cuda", generator=g).bfloat16()
    assert torch.equal(_tilelang()("fp8_fake_quant")(y, 64), REGISTRY["fp8_fake_quant"].ref(y, 64))
    gate, up = (torch.randn(9, 256, device="cuda", generator=g) * 4).bfloat16(), torch.randn(9, 256, device="cuda", generator=g).bfloat16()
    q, s, sp = _tilelang()("swiglu_quant")(gate, up, 10.0, None, torch.bfloat16, 128, True)
    rq, rs, rsp = REGISTRY["swiglu_quant"].ref(gate, up, 10.0, None, torch.bfloat16, 128, True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs) and torch.equal(sp, rsp)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_sparse_attn_fp8_reads_the_fp8_layout():
    impl = _tilelang()("sparse_attn_fp8")
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
