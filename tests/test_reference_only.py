"""A backend's reference-only list: ops it leaves to the torch reference on purpose. They resolve to the reference
without counting as a fallback and `--strict` accepts them; the TileLang backend decides every op either way."""

import pytest

from deepinfer.debug.probes import _static_by_design, _static_impls, probe_kernels
from deepinfer.ops.registry import BY_DESIGN, REGISTRY, BackendError, Dispatcher, reference_only


@pytest.fixture
def triton_lacks_swiglu(monkeypatch):
    from deepinfer.ops.registry import load_backend

    load_backend("triton")
    monkeypatch.delitem(REGISTRY["swiglu"].impls, "triton")
    monkeypatch.setitem(BY_DESIGN, "triton", dict(BY_DESIGN.get("triton", {})))


def test_by_design_resolves_to_the_reference_and_strict_accepts_it(triton_lacks_swiglu, capsys):
    d = Dispatcher()
    with pytest.raises(BackendError, match="lacks 1 op.*swiglu"):
        d.configure("triton", strict=True)
    reference_only("triton", {"swiglu": "a test's reason"})
    d.configure("triton", strict=True)
    assert d.missing() == []
    assert d.resolve("swiglu") is REGISTRY["swiglu"].ref
    assert d.fallbacks == {} and "falls back" not in capsys.readouterr().err
    d.configure("triton", strict=False)
    assert d.resolve("rms_norm") is REGISTRY["rms_norm"].impls["triton"]


def test_reference_only_refuses_what_it_cannot_mean(triton_lacks_swiglu):
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        reference_only("triton", {"nope": "x"})
    with pytest.raises(ValueError, match="both implements 'rms_norm'"):
        reference_only("triton", {"rms_norm": "x"})
    with pytest.raises(ValueError, match="without a reason"):
        reference_only("triton", {"swiglu": " "})


def test_tilelang_decides_every_op():
    """Every op is either implemented in deepinfer_kernels/tilelang or on its reference-only list, never both: a new op
    fails here until the backend decides it."""
    impl, ref = _static_impls("tilelang"), _static_by_design("tilelang")
    assert not impl & set(ref), impl & set(ref)
    assert set(REGISTRY) - impl - set(ref) == set()
    assert all(len(why) > 20 for why in ref.values())
    assert {"grouped_gemm", "sparse_attn", "fp8_gemm", "act_quant", "hc_pre", "moe_route", "indexer_scores"} <= impl


def test_probe_kernels_shows_the_list_without_the_backend_installed():
    rows = {r["op"]: r for r in probe_kernels("")["ops"]}
    assert "model.py" in rows["rms_norm"]["backends"]["tilelang"]["reference_by_design"]
    assert "reference_by_design" not in rows["grouped_gemm"]["backends"]["tilelang"]
    assert "reference_by_design" not in rows["rms_norm"]["backends"]["triton"]


def test_flaggems_decides_every_op():
    """Every op is either wrapped in deepinfer_kernels/flaggems or on its reference-only list with a reason, never both."""
    impl, ref = _static_impls("flaggems"), _static_by_design("flaggems")
    assert not impl & set(ref), impl & set(ref)
    assert set(REGISTRY) - impl - set(ref) == set()
    assert all(len(why) > 20 for why in ref.values())
    assert {"act_quant", "rms_norm", "hc_pre", "hc_post", "sparse_attn"} <= impl
