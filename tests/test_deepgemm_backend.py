"""The DeepGEMM backend on a CPU: registration, the missing-package line, that importing the backend never imports
deep_gemm, the reference-only list, and our side of every adapter -- the row sort into DeepGEMM's contiguous
layout, the scatter back, the FP4 experts requantised once -- against an emulated deep_gemm that computes what
DeepGEMM 2.6.1 documents (D = A Bᵀ with per-128 / 128 x 128 fp32 scales; the expert of each row from
`grouped_layout`, -1 rows skipped). DeepGEMM's own kernels run on a GPU (`ab --backend deepgemm`)."""

import importlib
import importlib.machinery
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY, BackendError, Dispatcher, load_backend
from deepinfer_cli.app import app

ALIGN = 128


def _expand(s, rows, cols, bn, bk):
    return s.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def _emulated():
    """A deep_gemm module computing what DeepGEMM's SM90 FP8 GEMMs compute, with its argument checks."""
    m = types.ModuleType("deep_gemm")
    m.calls = []

    def fp8_gemm_nt(a, b, d, c=None, **kw):
        (A, sa), (B, sb) = a, b
        assert A.dtype == B.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
        assert d.dtype == torch.bfloat16 and c is None
        M, K = A.shape
        N = B.shape[0]
        assert sa.shape == (M, K // 128) and sb.shape == (-(-N // 128), K // 128)
        af = A.float() * sa.repeat_interleave(128, 1)
        bf = B.float() * _expand(sb, N, K, 128, 128)
        d.copy_((af @ bf.t()).to(d.dtype))
        m.calls.append("fp8_gemm_nt")

    def m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, **kw):
        (A, sa), (B, sb) = a, b
        assert layout.dtype == torch.int32 and layout.shape == (A.shape[0],) and A.shape[0] % ALIGN == 0
        assert d.dtype == torch.bfloat16 and d.shape == (A.shape[0], B.shape[1])
        blocks = layout.view(-1, ALIGN)
        for blk in blocks:  # one expert per aligned block: the kernel takes it from the block's first row
            valid = blk[blk >= 0]
            assert valid.numel() == 0 or (bool((valid == valid[0]).all()) and int(blk[0]) >= 0)
        d.fill_(float("nan"))  # padding rows' output is garbage: the adapter must drop it
        for j in torch.unique(layout).tolist():
            if j < 0:
                continue
            (r,) = torch.where(layout == j)
            N, K = B.shape[1], B.shape[2]
            af = A[r].float() * sa[r].repeat_interleave(128, 1)
            bf = B[j].float() * _expand(sb[j], N, K, 128, 128)
            d[r] = (af @ bf.t()).to(d.dtype)
        m.calls.append("m_grouped_fp8_gemm_nt_contiguous")

    def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, **kw):
        (A, sa), (B, sb) = a, b
        E, max_m, K = A.shape
        assert masked_m.dtype == torch.int32 and masked_m.shape == (E,) and int(expected_m) > 0
        assert d.shape == (E, max_m, B.shape[1]) and d.dtype == torch.bfloat16 and sa.shape == (E, max_m, K // 128)
        d.fill_(float("nan"))  # rows past masked_m are not written: the adapter must not read them
        N = B.shape[1]
        for j in range(E):
            r = int(masked_m[j])
            if r:
                af = A[j, :r].float() * sa[j, :r].repeat_interleave(128, 1)
                d[j, :r] = (af @ (B[j].float() * _expand(sb[j], N, K, 128, 128)).t()).to(d.dtype)
        m.calls.append("m_grouped_fp8_gemm_nt_masked")

    m.fp8_gemm_nt = fp8_gemm_nt
    m.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
    m.m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
    m.get_mk_alignment_for_contiguous_layout = lambda: ALIGN
    return m


@pytest.fixture
def emulated(monkeypatch):
    """deep_gemm 'installed' as the emulation; the SM90 device check passes on the CPU tensors."""
    fake = _emulated()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: importlib.machinery.ModuleSpec(
        "deep_gemm", None) if name == "deep_gemm" else real(name, *a, **k))
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    for mname in [m for m in sys.modules if m.startswith("deepinfer_kernels.deepgemm")]:
        monkeypatch.delitem(sys.modules, mname)
    for d in REGISTRY.values():
        if "deepgemm" in d.impls:
            monkeypatch.delitem(d.impls, "deepgemm")
    load_backend("deepgemm")
    from deepinfer_kernels.deepgemm import _common, gemm

    monkeypatch.setattr(gemm, "sm90", lambda t: "")
    monkeypatch.setattr(_common, "_mod", [fake])
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    return fake


def _fp8(g, shape, scale_shape):
    from deepinfer.quant.formats import quant_fp8_block, scale_f32

    w, s = quant_fp8_block(torch.randn(*shape, generator=g) * 0.05)
    return w, scale_f32(s)


def _act(g, M, K):
    from deepinfer.ops.reference import act_quant

    return act_quant(torch.randn(M, K, generator=g), 128)


def test_missing_package_is_one_line():
    if importlib.util.find_spec("deep_gemm") is not None:
        pytest.skip("deep_gemm is installed here")
    with pytest.raises(BackendError, match=r"needs the deep_gemm package, which is not installed: build it from "
                                           r"its source, tools/device/DEEPGEMM.md"):
        load_backend("deepgemm")
    r = CliRunner().invoke(app, ["generate", "x", "-n", "1", "--backend", "deepgemm"])
    assert r.exit_code == 2 and "deep_gemm package" in r.output and "Traceback" not in r.output


def test_registration_and_the_reference_only_list(emulated):
    assert "deep_gemm" in sys.modules  # the emulation, never re-imported by loading the backend
    assert {"fp8_gemm", "fp4_gemm", "grouped_gemm"} <= {n for n, d in REGISTRY.items() if "deepgemm" in d.impls}
    d = Dispatcher().configure("deepgemm", strict=True, op_map={})  # every op wrapped or reference-only
    assert d.missing() == []
    from deepinfer.debug.probes import _static_by_design, _static_impls

    impl, ref = _static_impls("deepgemm"), _static_by_design("deepgemm")
    from deepinfer.ops.registry import COMPOSED

    # its three GEMMs; the FP8 Linear on an unquantised input composed from its fp8_gemm, the routed w2 on w1|w3's
    # output from its grouped_gemm
    assert impl == {"fp8_gemm", "fp4_gemm", "grouped_gemm", "act_quant_fp8_gemm", "swiglu_grouped_gemm"} \
        and not impl & set(ref)
    assert COMPOSED["deepgemm"] == {"act_quant_fp8_gemm": ("act_quant", "fp8_gemm"),
                                    "swiglu_grouped_gemm": ("swiglu_quant", "grouped_gemm")}
    assert set(REGISTRY) - impl - set(ref) == set() and all(len(w) > 20 for w in ref.values())


def test_fp8_and_fp4_gemm_against_the_reference(emulated):
    g = torch.Generator().manual_seed(0)
    a, a_s = _act(g, 40, 512)
    w, w_s = _fp8(g, (384, 512), None)
    got = REGISTRY["fp8_gemm"].impls["deepgemm"](a, a_s, w, w_s)
    want = REGISTRY["fp8_gemm"].ref(a, a_s, w, w_s)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    from deepinfer.quant.formats import quant_fp4, scale_f32

    w4, s4 = quant_fp4(torch.randn(256, 512, generator=g) * 0.05)
    got = REGISTRY["fp4_gemm"].impls["deepgemm"](a, a_s, w4, scale_f32(s4))
    want = REGISTRY["fp4_gemm"].ref(a, a_s, w4, scale_f32(s4))
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert emulated.calls == ["fp8_gemm_nt", "fp8_gemm_nt"]


@pytest.mark.parametrize("fp4,P", [(False, 300), (True, 300), (False, 40), (True, 12)])
def test_grouped_gemm_layout_and_scatter(emulated, fp4, P):
    """Rows in any expert order, -1 rows among them: sorted into 128-aligned expert segments (prefill-sized P) or
    into the masked layout's per-expert slots (decode-sized P), the padding's garbage dropped, every row back in
    place; FP4 experts requantised once (cached on the weight)."""
    from deepinfer.quant.formats import quant_fp4, scale_f32
    from deepinfer_kernels.deepgemm.gemm import MASKED_MAX_P

    g = torch.Generator().manual_seed(1)
    E, N, K = 5, 256, 256
    a, a_s = _act(g, P, K)
    e = torch.randint(0, E, (P,), generator=g)
    e[torch.randperm(P, generator=g)[:P // 15 + 1]] = -1
    e[e == 3] = 1  # an expert with no rows
    if fp4:
        qs = [quant_fp4(torch.randn(N, K, generator=g) * 0.05) for _ in range(E)]
        w, w_s = torch.stack([q for q, _ in qs]), scale_f32(torch.stack([s for _, s in qs]))
    else:
        ws = [_fp8(g, (N, K), None) for _ in range(E)]
        w, w_s = torch.stack([x for x, _ in ws]), torch.stack([s for _, s in ws])
    fn = REGISTRY["grouped_gemm"].impls["deepgemm"]
    got = fn(a, a_s, e, w, w_s)
    want = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s)
    assert not torch.isnan(got).any() and bool((got[e < 0] == 0).all())
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert emulated.calls[-1] == ("m_grouped_fp8_gemm_nt_masked" if P <= MASKED_MAX_P
                                  else "m_grouped_fp8_gemm_nt_contiguous")
    if fp4:
        cached = w._deepinfer_dg_fp8
        fn(a, a_s, e, w, w_s)
        assert w._deepinfer_dg_fp8 is cached  # requantised once per weight


def test_off_contract_is_visible_and_strict_refuses(emulated, capsys):
    g = torch.Generator().manual_seed(2)
    a, a_s = _act(g, 8, 256)
    w, w_s = _fp8(g, (128, 256), None)
    ops.configure("deepgemm", strict=False, op_map={})
    try:
        out = REGISTRY["fp8_gemm"].impls["deepgemm"](a, a_s, w, w_s, torch.float32)
        assert out.dtype == torch.float32 and "writes bf16" in ops.fallbacks["fp8_gemm"]
        assert "falls back to the torch reference" in capsys.readouterr().err
        ops.configure("deepgemm", strict=True, op_map={})
        with pytest.raises(BackendError, match="--strict: op 'fp8_gemm'"):
            REGISTRY["fp8_gemm"].impls["deepgemm"](a, a_s, w, w_s, torch.float32)
    finally:
        ops.configure("torch", strict=False, op_map={})


@pytest.mark.gpu
def test_deepgemm_on_the_gpu():
    """DeepGEMM's own kernels (where deep_gemm is built, on sm_90) against the reference, judged as `ab` judges
    them: its FP8 sums are promoted to fp32 once per 128-K block, so the tensor-core bound applies."""
    if not torch.cuda.is_available() or importlib.util.find_spec("deep_gemm") is None:
        pytest.skip("needs CUDA and deep_gemm (tools/device/DEEPGEMM.md)")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the adapter drives DeepGEMM's SM90 kernels")
    from deepinfer.debug.ab import call, compare_outputs
    from deepinfer.debug.ab_cases import SHAPES, build

    load_backend("deepgemm")
    for op in ("fp8_gemm", "grouped_gemm"):
        for phase in ("decode", "prefill"):
            for v in build(op, SHAPES["flash"], phase, 0, "cuda"):
                got = call(op, REGISTRY[op].impls["deepgemm"], v.args, v.kwargs)
                ref = call(op, REGISTRY[op].ref, v.args, v.kwargs)
                bad = [m for m in compare_outputs(op, got, ref, v.args, v.kwargs) if not m["ok"]]
                assert not bad, (op, phase, v.name, bad)


def test_ab_judges_the_requantised_path_against_the_requantised_reference(emulated):
    """`ab --backend deepgemm`: its FP4 ops are judged against the reference on the per-128 requantised weights,
    and the case says whether the requantisation itself was lossless; fp8_gemm keeps the plain reference."""
    from deepinfer.debug.ab import run_ab

    rep = run_ab("deepgemm", ops_regex="^(fp4_gemm|fp8_gemm|grouped_gemm)$", shapes="tiny", seed=3, device="cpu")
    cases = [r for r in rep.results if r.status != "skip"]
    assert cases and all(r.status == "pass" for r in cases), [(r.case_id, r.status, r.reason) for r in cases]
    for r in cases:
        own = "judged against the reference on its per-128 requantised weights (requantisation lossless)"
        assert (own in r.reason) == (r.op != "fp8_gemm"), (r.case_id, r.reason)


def test_requantised_reference_measures_a_lossy_requantisation(emulated):
    """Half the rows of each 128-row block 2^24 below the others: beyond e4m3's reach, so the requantisation
    flushes them. The requantised reference is what DeepGEMM computes (the emulation agrees with it); the lossless
    reference is far from both on those rows; the note gives the measured loss."""
    from deepinfer.debug.ab import CaseResult, _requantised_reference
    from deepinfer.debug.ab_cases import Variant
    from deepinfer.quant.formats import quant_fp4, scale_f32

    g = torch.Generator().manual_seed(1)
    a, a_s = _act(g, 8, 256)
    w4, s4 = quant_fp4(torch.randn(256, 256, generator=g) * 0.05)
    ws = scale_f32(s4).clone()
    ws.view(2, 128, -1)[:, :64] *= 2.0 ** -24
    v = Variant("wide", (a, a_s, w4, ws), {"out_dtype": torch.bfloat16})
    fn = REGISTRY["fp4_gemm"].impls["deepgemm"]
    own = _requantised_reference(CaseResult("fp4_gemm", "t", "decode", "wide", "pending"), fn, v)
    assert own is not None and "lossy" in own.note and "rel err" in own.note
    got = fn(a, a_s, w4, ws).float()
    lossless = REGISTRY["fp4_gemm"].ref(a, a_s, w4, ws).float()
    torch.testing.assert_close(got, own[0].float(), rtol=2 ** -7, atol=1e-30)
    small = lossless.view(8, 2, 128)[:, :, :64]
    assert float(small.abs().max()) > 0 and float(got.view(8, 2, 128)[:, :, :64].abs().max()) < float(small.abs().max())
    assert _requantised_reference(CaseResult("fp8_gemm", "t", "decode", "x", "pending"),
                                  REGISTRY["fp8_gemm"].impls["deepgemm"], v) is None


def test_bench_against_deepgemm_is_its_gemms_over_the_main_configuration(emulated):
    """`bench --against deepgemm`: DeepGEMM's GEMMs over the run's backend and op map, not every other op on the
    torch reference; a map named with it is taken as given."""
    from deepinfer.bench.run import BenchOptions, peer_configs

    o = BenchOptions(preset="tiny", device="cpu", backend="torch", op_map="rms_norm=torch",
                     against=("deepgemm", "torch:grouped_gemm=deepgemm", "deepgemm:policy=fast"))
    (s1, b1, m1, v1), (s2, b2, m2, v2), (s3, b3, m3, v3) = peer_configs(o)
    assert (s1, b1, v1) == ("deepgemm", "torch", {})
    # act_quant_fp8_gemm: the FP8 Linear on an unquantised input, composed from DeepGEMM's fp8_gemm; likewise the
    # routed w2 on w1|w3's output (swiglu_grouped_gemm) from its grouped_gemm
    assert m1 == {"rms_norm": "torch", "fp8_gemm": "deepgemm", "fp4_gemm": "deepgemm", "grouped_gemm": "deepgemm",
                  "act_quant_fp8_gemm": "deepgemm", "swiglu_grouped_gemm": "deepgemm"}
    assert (s2, b2, m2, v2) == ("torch:grouped_gemm=deepgemm", "torch", {"grouped_gemm": "deepgemm"}, {})
    # settings alone leave the library's ops over the main configuration, with the settings around them
    assert (b3, m3, v3) == ("torch", m1, {"DEEPINFER_POLICY": "fast"})
