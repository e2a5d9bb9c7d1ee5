"""The registry's reference ops against independent formulas, and the registry semantics."""

import pytest
import torch

from deepinfer.ops import REGISTRY
from deepinfer.ops.registry import BackendError, Dispatcher


def test_topk_tie_break_lower_index():
    s = torch.tensor([[[0.0, 1.0, 0.0, 1.0, 0.0, 0.5]]])
    idx = REGISTRY["topk_indices"].ref(s, 4, torch.tensor([[6]]))
    assert idx.tolist() == [[[1, 3, 5, 0]]]
    idx = REGISTRY["topk_indices"].ref(s, 4, torch.tensor([[2]]))  # only 2 entries complete
    assert idx.tolist() == [[[1, 0, -1, -1]]]


def test_sparse_attn_matches_dense_softmax_with_sink():
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    sink = torch.randn(3, generator=g)
    idx = torch.tensor([[[0, 2, -1, 4], [1, -1, -1, -1]]])
    o = REGISTRY["sparse_attn"].ref(q, kv, sink, idx, 0.3)
    for s, rows in enumerate([[0, 2, 4], [1]]):
        k = kv[0, rows]
        logit = q[0, s] @ k.T * 0.3  # [H, n]
        full = torch.cat([logit, sink[:, None]], 1).softmax(-1)[:, :-1]
        assert torch.allclose(o[0, s], full @ k, atol=1e-6)
    empty = REGISTRY["sparse_attn"].ref(q, kv, sink, torch.full((1, 2, 4), -1), 0.3)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_act_quant_power_of_two_scales():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)) * 3
    q, s = REGISTRY["act_quant"].ref(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 2)
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    deq = (q.float().view(4, 2, 128) * s[..., None]).view(4, 256)
    assert ((deq - x).norm() / x.norm()) < 0.05
    assert (q.float().abs().amax(-1) <= 448).all()


def test_hadamard_is_orthonormal():
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    y = REGISTRY["hadamard"].ref(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(REGISTRY["hadamard"].ref(y), x, atol=1e-5)


def test_hc_pre_comb_doubly_stochastic():
    g = torch.Generator().manual_seed(3)
    hc, D = 4, 16
    x = torch.randn(1, 2, hc, D, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.1
    y, post, comb = REGISTRY["hc_pre"].ref(x, fn, torch.ones(3), torch.randn((2 + hc) * hc, generator=g), 1e-6, 1e-6, 20)
    assert torch.allclose(comb.sum(-1), torch.ones(1, 2, hc), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(1, 2, hc), atol=1e-3)
    assert ((post > 0) & (post < 2)).all()


def test_sample_greedy_and_deterministic():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 1000, generator=g)
    t = torch.tensor([0.0, 1.0, 1.0])
    k, p = torch.tensor([0, 0, 5]), torch.tensor([1.0, 0.9, 1.0])
    seeds, pos = torch.tensor([1, 2, 3]), torch.tensor([10, 10, 10])
    a = REGISTRY["sample"].ref(logits, t, k, p, seeds, pos)
    assert a[0] == logits[0].argmax()
    assert torch.equal(a, REGISTRY["sample"].ref(logits, t, k, p, seeds, pos))
    assert a[2] in logits[2].topk(5).indices


def test_top_p_one_cuts_nothing():
    """top_p >= 1 keeps every token: over a V4-sized vocabulary with peaked logits the fp32 cumsum of the sorted
    probabilities reaches 1.0 long before the tail (~126k of 129280 tokens sit after it), and the rule
    `mass above < top_p` alone would drop them. top_p 0.999 still cuts."""
    from deepinfer.ops.reference import _kept_logits

    g = torch.Generator().manual_seed(0)
    lf = torch.randn(2, 129280, generator=g) * 8
    t, k = torch.ones(2), torch.zeros(2, dtype=torch.long)
    assert torch.isfinite(_kept_logits(lf, t, k, torch.tensor([1.0, 1.5]))).all()
    assert not torch.isfinite(_kept_logits(lf, t, k, torch.tensor([0.999, 0.999]))).all()


def test_sample_distribution_follows_softmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    n = 4000
    toks = REGISTRY["sample"].ref(logits.expand(n, 3), torch.ones(n), torch.zeros(n, dtype=torch.long),
                                  torch.ones(n), torch.zeros(n, dtype=torch.long), torch.arange(n))
    freq = torch.bincount(toks, minlength=3).float() / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_registry_fallback_notice_once_and_strict(capsys):
    from deepinfer.ops.registry import OpDef

    d = Dispatcher()
    d.configure("torch")
    assert d.missing() == []
    d.backend = "tilelang"  # pretend a backend with no kernels (without importing it)
    d.resolve("rms_norm")
    d.resolve("rms_norm")
    err = capsys.readouterr().err
    assert err.count("op rms_norm falls back") == 1
    assert "rms_norm" in d.fallbacks
    d.strict = True
    d._cache.clear()
    with pytest.raises(BackendError, match="rms_norm"):
        d.resolve("rms_norm")
    assert isinstance(REGISTRY["rms_norm"], OpDef)


def test_unknown_backend_is_an_error():
    with pytest.raises(BackendError, match="unknown backend"):
        Dispatcher().configure("cuda-magic")


def test_import_deepinfer_imports_no_backend():
    import subprocess
    import sys

    code = ("import sys, deepinfer, deepinfer.model.transformer, deepinfer.engine.generate, deepinfer_cli.app;"
            "bad=[m for m in ('triton','tilelang','flag_gems','deep_gemm','deep_ep') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_decode_slots_by_hand():
    """Ring of 4 over a 6-slot row (2 entries): row 1 at position 2 (ring not full: slots 0..2), row 0 at 9
    (full ring: positions 6..9, oldest first, at slots 2, 3, 0, 1); CSA entries offset past the ring of their
    row, HCA (ratio 4) entries complete at pos."""
    pos, rows = torch.tensor([2, 9]), torch.tensor([1, 0])
    ref = REGISTRY["decode_slots"].ref
    assert ref(pos, rows, 4, 6).tolist() == [[[6, 7, 8, -1], [2, 3, 0, 1]]]
    ent = torch.tensor([[[1, -1]], [[0, 1]]])
    assert ref(pos, rows, 4, 6, ent).tolist() == [[[6, 7, 8, -1, 11, -1], [2, 3, 0, 1, 4, 5]]]
    assert ref(pos, rows, 4, 6, None, 2, 4).tolist() == [[[6, 7, 8, -1, -1, -1], [2, 3, 0, 1, 4, 5]]]
