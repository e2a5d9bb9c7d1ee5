"""Fused ops composed by the registry from a backend's own parts (`registry.composition`, `registry.compose`): the
reference is the composition over the parts' references; a backend's composition runs its parts; a composition
that would hide a fallback, or that has nothing of the backend's own, is refused at import."""

import pytest
import torch

from deepinfer.ops import registry
from deepinfer.ops.registry import COMPOSITIONS, REGISTRY, RefParts, _ensure_reference, compose


@pytest.fixture
def fake(monkeypatch):
    """A backend named "fake" that exists only for the test (registered impls and lists removed after)."""
    _ensure_reference()
    monkeypatch.setattr(registry, "BACKENDS", registry.BACKENDS + ("fake",))
    for d in REGISTRY.values():
        monkeypatch.setitem(d.impls, "fake", None)
        monkeypatch.delitem(d.impls, "fake")
    monkeypatch.setitem(registry.BY_DESIGN, "fake", {})
    monkeypatch.setitem(registry.COMPOSED, "fake", {})
    return "fake"


def test_every_composition_is_its_reference():
    """The reference of each fused op is its composition over the parts' references, on fresh random inputs."""
    _ensure_reference()
    assert {"rms_norm_quant", "hc_pre_quant", "swiglu_quant", "moe_combine_post", "fp8_fake_quant"} <= set(COMPOSITIONS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g)
    w = torch.rand(256, generator=g) + 0.5
    _, fn = COMPOSITIONS["rms_norm_quant"]
    for a, b in zip(fn(RefParts(), x, w, 1e-6, 128, True), REGISTRY["rms_norm_quant"].ref(x, w, 1e-6, 128, True)):
        assert torch.equal(a.float(), b.float())
    _, fn = COMPOSITIONS["fp8_fake_quant"]
    assert torch.equal(fn(RefParts(), x, 64), REGISTRY["fp8_fake_quant"].ref(x, 64))


def test_a_backend_composition_runs_its_own_part(fake):
    calls = []
    ref = REGISTRY["act_quant"].ref

    @registry.implement("act_quant", fake)
    def act_quant(x, block=128):
        calls.append(block)
        return ref(x, block)

    compose(fake, ["fp8_fake_quant"])
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1))
    got = REGISTRY["fp8_fake_quant"].impls[fake](x, 64)
    assert calls == [64] and torch.equal(got, REGISTRY["fp8_fake_quant"].ref(x, 64))
    assert registry.COMPOSED[fake] == {"fp8_fake_quant": ("act_quant",)}
    assert "composed from fake's act_quant" in REGISTRY["fp8_fake_quant"].impls[fake].__doc__
    # a dispatcher on the backend resolves it as the backend's, not as a fallback
    d = registry.Dispatcher()
    d.backend = fake
    assert d.resolve("fp8_fake_quant") is REGISTRY["fp8_fake_quant"].impls[fake] and "fp8_fake_quant" not in d.fallbacks


def test_reference_parts_only_by_design(fake):
    """A part the backend neither implements nor lists as reference-only would be a hidden fallback."""
    registry.implement("hc_post", fake)(REGISTRY["hc_post"].ref)
    with pytest.raises(ValueError, match="from 'moe_combine', which it neither implements nor lists"):
        compose(fake, ["moe_combine_post"])
    registry.reference_only(fake, {"moe_combine": "the sum stays in PyTorch"})
    compose(fake, ["moe_combine_post"])
    assert "moe_combine (reference)" in REGISTRY["moe_combine_post"].impls[fake].__doc__


def test_refused_compositions(fake):
    registry.reference_only(fake, {"act_quant": "no kernel"})
    with pytest.raises(ValueError, match="from no part of its own"):
        compose(fake, ["fp8_fake_quant"])
    with pytest.raises(ValueError, match="no registered composition"):
        compose(fake, ["rms_norm"])
    registry.implement("swiglu_quant", fake)(REGISTRY["swiglu_quant"].ref)
    with pytest.raises(ValueError, match="both implements 'swiglu_quant' and composes it"):
        compose(fake, ["swiglu_quant"])
