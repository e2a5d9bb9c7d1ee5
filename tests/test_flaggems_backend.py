"""The FlagGems kernel backend on a CPU (flag_gems need not be installed): registration, the install hint, that
importing the backend never imports flag_gems (its import creates a CUDA context: only on the first kernel call,
on the tensor's device), and the visible fallback outside the kernels' contract."""

import importlib
import sys
import types

import pytest
import torch

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, BackendError, Dispatcher, load_backend


@pytest.fixture
def fake_installed(monkeypatch):
    """flag_gems 'installed' (find_spec answers) but importing it fails loudly: nothing may import it here."""
    real = importlib.util.find_spec

    def find_spec(name, *a, **k):
        return object() if name == "flag_gems" else real(name, *a, **k)

    class Trap:
        def find_spec(self, name, path=None, target=None):
            if name == "flag_gems" or name.startswith("flag_gems."):
                raise AssertionError(f"{name} imported")
            return None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(sys, "meta_path", [Trap(), *sys.meta_path])
    for m in [m for m in sys.modules if m.startswith("flag_gems")]:
        monkeypatch.delitem(sys.modules, m)
    for m in [m for m in sys.modules if m.startswith("deepinfer_kernels.flaggems")]:
        monkeypatch.delitem(sys.modules, m)
    for d in REGISTRY.values():
        if "flaggems" in d.impls:
            monkeypatch.delitem(d.impls, "flaggems")
    yield


def test_missing_package_is_one_line_with_the_install_hint(monkeypatch):
    if importlib.util.find_spec("flag_gems") is not None:
        pytest.skip("flag_gems is installed here")
    monkeypatch.delitem(sys.modules, "deepinfer_kernels.flaggems", raising=False)
    with pytest.raises(BackendError, match=r"needs the flag_gems package, which is not installed: "
                                           r"pip install -e '\.\[flaggems\]'"):
        load_backend("flaggems")


def test_loading_the_backend_does_not_import_flag_gems(fake_installed):
    load_backend("flaggems")
    assert "flag_gems" not in sys.modules
    assert {"act_quant", "fp8_gemm", "hc_pre", "hc_post", "sparse_attn"} <= {
        n for n, d in REGISTRY.items() if "flaggems" in d.impls}
    d = Dispatcher().configure("flaggems", strict=True, op_map={})  # every op wrapped or reference-only
    assert d.missing() == []


def test_off_contract_falls_back_visibly_and_strict_refuses(fake_installed, capsys):
    load_backend("flaggems")
    x = torch.randn(4, 256)
    ops.configure("flaggems", strict=False, op_map={})
    try:
        q, s = ops.act_quant(x, 128)  # a CPU tensor: outside the kernel's contract
        rq, rs = REGISTRY["act_quant"].ref(x, 128)
        assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)
        assert "FlagGems kernels run on CUDA" in ops.fallbacks["act_quant"]
        assert "op act_quant falls back to the torch reference" in capsys.readouterr().err
        assert "flag_gems" not in sys.modules
        ops.configure("flaggems", strict=True, op_map={})
        with pytest.raises(BackendError, match="--strict: op 'rms_norm': FlagGems kernels run on CUDA"):
            ops.rms_norm(x, None, 1e-6)
    finally:
        ops.configure("torch", strict=False, op_map={})


def test_bf16_only_kernels_name_the_dtype(fake_installed):
    load_backend("flaggems")
    from deepinfer_kernels.flaggems import attention, mhc

    ops.configure("flaggems", strict=False, op_map={})
    try:
        x, res = torch.randn(1, 2, 64), torch.randn(1, 2, 4, 64)
        post, comb = torch.rand(1, 2, 4), torch.rand(1, 2, 4, 4)
        assert torch.equal(mhc.hc_post(x, res, post, comb), REGISTRY["hc_post"].ref(x, res, post, comb))
        q, kv = torch.randn(1, 2, 16, 64), torch.randn(1, 8, 64)
        idx, sink = torch.randint(-1, 8, (1, 2, 4)), torch.zeros(16)
        assert torch.equal(attention.sparse_attn(q, kv, sink, idx, 0.1), REGISTRY["sparse_attn"].ref(q, kv, sink, idx, 0.1))
        assert "CUDA" in ops.fallbacks["hc_post"] and "CUDA" in ops.fallbacks["sparse_attn"]
    finally:
        ops.configure("torch", strict=False, op_map={})


def _fg_sparse_attn_emulated(q, kv, sink, idx, scale):
    """FlagGems 5.0.2's sparse_attn_triton in PyTorch, as its kernel computes: all heads at once (H a power of two
    >= 16 for tl.arange/tl.dot), slots in blocks of 64, only -1 masked, an online softmax that starts from
    exp(-inf - -inf) = NaN when a first block holds no valid slot, the sink added at the end, bf16 out."""
    B, S, H, D = q.shape
    assert H >= 16 and not H & (H - 1) and idx.dtype == torch.int32
    o = torch.empty_like(q)
    for b in range(B):
        for m in range(S):
            acc = torch.zeros(H, D)
            mx = torch.full((H,), float("-inf"))
            se = torch.zeros(H)
            for t in range(0, idx.size(-1), 64):
                ids = idx[b, m, t:t + 64].long()
                valid = ids != -1
                blk = torch.where(valid[:, None], kv[b, ids.clamp_min(0)].float(), 0.0)
                s_ = (q[b, m].float() @ blk.t()) * scale + torch.where(valid, 0.0, float("-inf"))
                new = torch.maximum(mx, s_.amax(1))
                corr = torch.exp(mx - new)
                p = torch.exp(s_ - new[:, None])
                acc = acc * corr[:, None] + p.bfloat16().float() @ blk
                se = se * corr + p.sum(1)
                mx = new
            se = se + torch.exp(sink - mx)
            o[b, m] = (acc / se[:, None]).to(q.dtype)
    return o


def test_sparse_attn_adapter_against_the_kernels_semantics(fake_installed, monkeypatch):
    """The adapter around an emulation of FlagGems' kernel (CPU): 4 heads padded to 16, negative slots mapped to -1,
    a first block of 64 all empty (the kernel alone: NaN), a query with no valid slot (0): the reference's result
    within the bf16 tolerance."""
    load_backend("flaggems")
    from deepinfer_kernels.flaggems import attention

    raw = torch.randn(1, 1, 16, 32).bfloat16(), torch.randn(1, 8, 32).bfloat16()
    idx0 = torch.full((1, 1, 70), -1, dtype=torch.int32)
    idx0[..., 66] = 3
    assert torch.isnan(_fg_sparse_attn_emulated(*raw, torch.zeros(16), idx0, 0.1)).all()  # the defect adapted away

    monkeypatch.setattr(attention, "fg", lambda mod, dev=None: types.SimpleNamespace(
        sparse_attn_triton=_fg_sparse_attn_emulated))
    monkeypatch.setattr(attention, "cuda", lambda *ts: True)
    g = torch.Generator().manual_seed(0)
    B, S, H, D, N, K = 2, 3, 4, 32, 50, 100
    q = torch.randn(B, S, H, D, generator=g).bfloat16()
    kv = torch.randn(B, N, D, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    idx = torch.randint(0, N, (B, S, K), generator=g)
    idx[torch.rand(B, S, K, generator=g) < 0.2] = -7  # any negative is empty in our contract
    idx[0, 0] = -1
    idx[1, 2, :64] = -1
    ops.configure("flaggems", strict=True, op_map={})
    try:
        out = attention.sparse_attn(q, kv, sink, idx, D ** -0.5)
    finally:
        ops.configure("torch", strict=False, op_map={})
    ref = REGISTRY["sparse_attn"].ref(q, kv, sink, idx, D ** -0.5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all() and (out[0, 0] == 0).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.slow
def test_the_tiny_model_runs_through_every_wrapper_on_a_cpu(fake_installed):
    """deepinfer-tiny through the flaggems backend on a CPU: every wrapper is called with the model's own
    arguments (a wrong signature fails here) and, off CUDA, runs the reference visibly: the torch tokens."""
    from deepinfer.engine.distributed import greedy_run
    from deepinfer.engine.loader import load_model

    ops.configure("torch", strict=False, op_map={})
    lm = load_model(None, "official", "bfloat16", "cpu", progress=False)
    ids = torch.tensor([lm.tokenizer.encode("北京是中国的首都")])
    want = greedy_run(lm.model, ids, 2)[1]
    load_backend("flaggems")
    ops.configure("flaggems", strict=False, op_map={})
    try:
        got = greedy_run(lm.model, ids, 2)[1]
        wrapped = {n for n, d in REGISTRY.items() if "flaggems" in d.impls}
        assert set(ops.fallbacks) <= wrapped and all("CUDA" in why for why in ops.fallbacks.values())
        assert {"hc_pre", "act_quant", "rms_norm"} <= set(ops.fallbacks), ops.fallbacks
        # hc_post runs inside the fused post-mix ops (composed from FlagGems' hc_post and hc_pre_quant)
        assert {"hc_pre_quant", "hc_post_pre_quant", "moe_combine_post", "moe_combine_post_pre_quant",
                "moe_combine_post_head", "swiglu_grouped_gemm", "q_norm_sparse_attn_fp8", "rms_norm_quant",
                "swiglu_quant", "fp8_gemm", "sparse_attn"} <= ops.used
    finally:
        ops.configure("torch", strict=False, op_map={})
    assert torch.equal(got, want)


def test_fp8_gemm_weight_scales_in_every_checkpoint_form(fake_installed):
    load_backend("flaggems")
    from deepinfer_kernels.flaggems.quant import _f32_scales

    f = torch.exp2(torch.randint(-9, 3, (3, 4)).float())
    e8 = f.to(torch.float8_e8m0fnu)
    assert torch.equal(_f32_scales(f), f) and torch.equal(_f32_scales(e8), f)
    assert torch.equal(_f32_scales(e8.view(torch.uint8)), f)
    assert _f32_scales(f.bfloat16()) is None


def test_single_ops_on_flaggems_through_the_per_op_map(fake_installed):
    d = Dispatcher().configure("torch", strict=False, op_map="hc_post=flaggems,sparse_attn=flaggems")
    assert d.backends() == ["torch", "flaggems"] and d.describe() == "torch; hc_post=flaggems,sparse_attn=flaggems"
    assert d.resolve("hc_post") is REGISTRY["hc_post"].impls["flaggems"]
    assert d.resolve("rms_norm") is REGISTRY["rms_norm"].ref
    assert "flag_gems" not in sys.modules


def test_a_flaggems_failure_falls_back_visibly_once_per_shape(fake_installed, capsys):
    load_backend("flaggems")
    from deepinfer_kernels.flaggems import _common

    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    ops.configure("torch", strict=False, op_map={})
    try:
        assert _common.run("sparse_attn", (64, 512), boom, lambda: "ref") == "ref"
        assert _common.run("sparse_attn", (64, 512), boom, lambda: "ref") == "ref" and len(calls) == 1  # remembered
        assert "FlagGems failed for (64, 512): RuntimeError: out of resource" in ops.fallbacks["sparse_attn"]
        assert "op sparse_attn falls back to the torch reference" in capsys.readouterr().err
        assert _common.run("sparse_attn", (16, 128), lambda: "kernel", lambda: "ref") == "kernel"
        ops.configure("torch", strict=True, op_map={})
        with pytest.raises(BackendError, match="--strict: op 'sparse_attn': FlagGems failed for"):
            _common.run("sparse_attn", (64, 512), boom, lambda: "ref")
    finally:
        ops.configure("torch", strict=False, op_map={})


# --------------------------------------------------------------- the adapters against FlagGems' own signatures
def _fg_emulated():
    """FlagGems 5.0.2's entry points as their sources define them -- signatures, argument order and the shape
    asserts they make -- computing in PyTorch (its own torch references where it ships one: mhc_split_sinkhorn_
    torch_ref, mhc_post_ref), so the adapters' plumbing is checked on a CPU."""
    import torch.nn.functional as F

    def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
        mix_hc = (2 + hc_mult) * hc_mult
        assert mixes.shape[-1] == mix_hc and hc_scale.shape == (3,) and hc_base.shape == (mix_hc,)
        outer = mixes.shape[:-1]
        pre = torch.sigmoid(mixes[..., :hc_mult] * hc_scale[0] + hc_base[:hc_mult]) + eps
        post = 2 * torch.sigmoid(mixes[..., hc_mult:2 * hc_mult] * hc_scale[1] + hc_base[hc_mult:2 * hc_mult])
        comb = mixes[..., 2 * hc_mult:].view(*outer, hc_mult, hc_mult) * hc_scale[2] + \
            hc_base[2 * hc_mult:].view(hc_mult, hc_mult)
        comb = (comb - comb.max(dim=-1, keepdim=True).values).exp()
        comb = comb / comb.sum(dim=-1, keepdim=True) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return pre, post, comb

    def mhc_post(x, residual, post_layer_mix, comb_res_mix):
        N, hc, H = residual.shape
        assert x.shape == (N, H) and post_layer_mix.shape in ((N, hc, 1), (N, hc)) and comb_res_mix.shape == (N, hc, hc)
        c = post_layer_mix.reshape(N, hc, 1)
        return (x.unsqueeze(-2) * c + torch.bmm(comb_res_mix.mT, residual.float())).type_as(x)

    def act_quant_triton(x, block_size=128, scale_fmt=None):
        assert x.is_contiguous() and x.size(-1) % block_size == 0 and scale_fmt is not None
        return REGISTRY["act_quant"].ref(x, block_size)

    def w8a8_block_fp8_matmul(A, B, As, Bs, block_size, output_dtype=torch.float16):
        import triton

        assert list(block_size) == [128, 128] and A.shape[-1] == B.shape[-1] and A.shape[:-1] == As.shape[:-1]
        assert A.is_contiguous() and triton.cdiv(A.shape[-1], 128) == As.shape[-1] and B.ndim == 2 and Bs.ndim == 2
        N, K = B.shape
        assert triton.cdiv(N, 128) == Bs.shape[0] and triton.cdiv(K, 128) == Bs.shape[1] and Bs.dtype == torch.float32
        return REGISTRY["fp8_gemm"].ref(A, As, B, Bs, output_dtype)

    def rms_norm(x, normalized_shape, weight, eps=1e-5):
        return F.rms_norm(x.float(), normalized_shape, weight.float(), eps).to(x.dtype)

    mods = {"flag_gems.fused.mhc": types.SimpleNamespace(hc_split_sinkhorn=hc_split_sinkhorn, mhc_post=mhc_post),
            "flag_gems.ops.act_quant": types.SimpleNamespace(act_quant_triton=act_quant_triton),
            "flag_gems": types.SimpleNamespace(w8a8_block_fp8_matmul=w8a8_block_fp8_matmul),
            "flag_gems.ops.rms_norm": types.SimpleNamespace(rms_norm=rms_norm)}
    return lambda module, device=None: mods[module]


def test_every_adapter_calls_flaggems_as_its_source_defines_it(fake_installed, monkeypatch):
    load_backend("flaggems")
    from deepinfer_kernels.flaggems import attention, mhc, norm, quant

    fg = _fg_emulated()
    for m in (mhc, norm, quant, attention):
        monkeypatch.setattr(m, "fg", fg)
        monkeypatch.setattr(m, "cuda", lambda *ts: True)
    impl = {n: d.impls["flaggems"] for n, d in REGISTRY.items() if "flaggems" in d.impls}
    g = torch.Generator().manual_seed(3)
    ops.configure("flaggems", strict=True, op_map={})  # any fallback raises
    try:
        B, S, hc, D = 1, 5, 4, 256
        x = torch.randn(B, S, hc, D, generator=g).bfloat16()
        fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.02
        scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g) * 0.1
        got, want = impl["hc_pre"](x, fn, scale, base, 1e-6, 1e-6, 20), REGISTRY["hc_pre"].ref(x, fn, scale, base, 1e-6,
                                                                                                1e-6, 20)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
        w = torch.rand(D, generator=g) + 0.5
        got = impl["hc_pre_quant"](x, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6, split=True)
        assert len(got) == 6 and got[1].dtype == torch.float8_e4m3fn and got[3].dtype == torch.bfloat16
        y = torch.randn(B, S, D, generator=g).bfloat16()
        post, comb = torch.rand(B, S, hc, generator=g) * 2, torch.rand(B, S, hc, hc, generator=g)
        torch.testing.assert_close(impl["hc_post"](y, x, post, comb), REGISTRY["hc_post"].ref(y, x, post, comb))
        routed, shared = torch.randn(B * S, 2, D, generator=g), torch.randn(B * S, D, generator=g)
        torch.testing.assert_close(impl["moe_combine_post"](routed, shared, x, post, comb),
                                   REGISTRY["moe_combine_post"].ref(routed, shared, x, post, comb))
        xs = torch.randn(3, 7, 512, generator=g).bfloat16()
        q, s = impl["act_quant"](xs[:, :, ::2].contiguous(), 128)
        assert q.shape == (3, 7, 256) and s.shape == (3, 7, 2)
        q, s = impl["act_quant"](xs[:, :, ::2], 128)  # strided: the adapter's copy
        assert torch.equal(q.view(torch.uint8), REGISTRY["act_quant"].ref(xs[:, :, ::2], 128)[0].view(torch.uint8))
        for wt in (None, (torch.rand(512, generator=g) + 0.5).bfloat16()):  # V4's unweighted form: ones passed
            torch.testing.assert_close(impl["rms_norm"](xs, wt, 1e-6).float(), REGISTRY["rms_norm"].ref(xs, wt, 1e-6).float(),
                                       rtol=2 ** -7, atol=0)
        y2, q2, s2 = impl["rms_norm_quant"](xs, None, 1e-6)
        assert torch.equal(q2.view(torch.uint8), REGISTRY["act_quant"].ref(y2, 128)[0].view(torch.uint8))
        M, N, K = 9, 300, 512
        a, a_s = REGISTRY["act_quant"].ref(torch.randn(M, K, generator=g), 128)
        wq = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn)
        ws = torch.exp2(torch.randint(-9, -3, (3, 4), generator=g).float())
        for scales in (ws, ws.to(torch.float8_e8m0fnu)):
            torch.testing.assert_close(impl["fp8_gemm"](a, a_s, wq, scales, torch.float32),
                                       REGISTRY["fp8_gemm"].ref(a, a_s, wq, ws, torch.float32))
        gate, up = torch.randn(6, 256, generator=g), torch.randn(6, 256, generator=g)
        got = impl["swiglu_quant"](gate, up, 7.0, None, torch.bfloat16, split=True)
        want = REGISTRY["swiglu_quant"].ref(gate, up, 7.0, None, torch.bfloat16, split=True)
        assert all(torch.equal(a_.view(torch.uint8) if a_.dtype == torch.float8_e4m3fn else a_,
                               b_.view(torch.uint8) if b_.dtype == torch.float8_e4m3fn else b_) for a_, b_ in zip(got, want))
    finally:
        ops.configure("torch", strict=False, op_map={})
