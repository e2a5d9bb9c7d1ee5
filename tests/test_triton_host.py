"""The Triton backend's host side: what a wrapper spends before its kernel launches.

Triton makes `triton.cdiv` and `triton.next_power_of_2` constexpr functions, each host call unwrapping its
arguments as constexprs (~5 us on a 2-core Xeon against ~0.1 us of arithmetic). The wrappers compute grids and
block sizes with `_common.cdiv` / `next_power_of_2` instead; an eager step issues every launch from the host, so
these were a third of a prefill's wrapper time.
"""

from __future__ import annotations

import pytest
import torch
from backend_device import device_for

DEV = device_for("triton")  # compiled on a CUDA host (the tests then run there), interpreted on a CPU

triton = pytest.importorskip("triton")

from deepinfer.engine.loader import load_model  # noqa: E402
from deepinfer.ops import ops  # noqa: E402
from deepinfer_kernels.triton._common import cdiv, next_power_of_2, p2  # noqa: E402


def test_host_integers_as_triton_computes_them():
    for n in [*range(-3, 70), 127, 128, 129, 1023, 1024, 1025, 2**20 + 1, 2**40 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        assert p2(n) == triton.next_power_of_2(max(n, 1)), n
        for d in (1, 3, 16, 128, 4096):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.slow
def test_an_eager_step_never_calls_tritons_constexpr_helpers(monkeypatch, tiny_dir):
    """Triton-backend prefills (a whole prompt, a chunk after another) and a decode step of two rows of
    deepinfer-tiny call neither helper (with one reintroduced in a wrapper, this fails); their logits are finite."""
    ops.configure("triton")
    m = load_model(None, "official", "bfloat16", DEV, progress=False).model
    m.allocate(2, 24)
    ids = torch.randint(2, m.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))

    def refuse(*a, **k):
        raise AssertionError("a host call of triton.cdiv / triton.next_power_of_2")

    monkeypatch.setattr(triton, "cdiv", refuse)
    monkeypatch.setattr(triton, "next_power_of_2", refuse)
    a, _ = m.prefill(ids, torch.tensor([0]))
    b, _ = m.prefill(ids[:, :5], torch.tensor([1]))
    c, _ = m.prefill(ids[:, 5:], torch.tensor([1]), start=5)
    d = m.decode(ids[:, -1:].expand(2, 1).contiguous(), torch.tensor([9, 9]), torch.tensor([0, 1]))
    assert all(torch.isfinite(t).all() for t in (a, b, c, d))


def _calls(monkeypatch, name: str) -> list:
    """The argument tuples (less the first) of every call of deepinfer_kernels.triton.moe_grouped.`name` from now on;
    each call still runs."""
    from deepinfer_kernels.triton import moe_grouped

    seen, real = [], getattr(moe_grouped, name)
    monkeypatch.setattr(moe_grouped, name, lambda *a: seen.append(a[1:]) or real(*a))
    return seen


def _fp8_experts(seed: int, E: int = 4, N: int = 128, K: int = 128, P: int = 24):
    """A grouped GEMM's operands on DEV: P act_quant'ed rows [P, K], FP8 expert stacks [E, N, K] with their block
    scales, and random routing e [P] over the E experts -> (a, a_s, e, w, w_s)."""
    from deepinfer.ops.reference import act_quant
    from deepinfer.quant.formats import e8m0_to_float, quant_fp8_block

    g = torch.Generator().manual_seed(seed)
    w, w_s = quant_fp8_block(torch.randn(E * N, K, generator=g) * 0.05)
    w, w_s = w.view(E, N, K).to(DEV), e8m0_to_float(w_s).view(E, N // 128, K // 128).to(DEV)
    a, a_s = (t.to(DEV) for t in act_quant(torch.randn(P, K, generator=g), 128))
    return a, a_s, torch.randint(0, E, (P,), generator=g).to(DEV), w, w_s


def test_a_layers_expert_gemms_sort_their_pairs_once(monkeypatch):
    """grouped_gemm past IDENT_MAX_P pairs sorts them (`align`, 3 launches). Inside `same_routing(e)` the GEMMs of
    that very tensor sort once; outside the scope, or for another tensor of the same values inside it, every
    call sorts. The outputs equal a fresh sort's."""
    from deepinfer.ops import REGISTRY
    from deepinfer.ops.routing import same_routing

    sorts = _calls(monkeypatch, "align")
    a, a_s, e, w, w_s = _fp8_experts(7)
    gg = REGISTRY["grouped_gemm"].impls["triton"]
    alone = gg(a, a_s, e, w, w_s)
    gg(a, a_s, e, w, w_s)
    assert len(sorts) == 2  # no scope: each call sorts
    with same_routing(e):
        first, second = gg(a, a_s, e, w, w_s), gg(a, a_s, e, w, w_s)
        assert len(sorts) == 3 and torch.equal(first, alone) and torch.equal(second, alone)
        gg(a, a_s, e.clone(), w, w_s)  # same values, another tensor: sorted again
        assert len(sorts) == 4
    gg(a, a_s, e, w, w_s)
    assert len(sorts) == 5  # the scope is over


def test_rows_are_zeroed_unless_the_scope_vouches_every_one_is_local(monkeypatch):
    """grouped_gemm zeroes the output rows no local expert computes (e = -1 or >= E: expert parallelism) with one
    launch; inside `same_routing(e, every_row_local=True)` it skips that launch. Without the vouching, -1 rows
    come out 0 (the output is poisoned with NaN first)."""
    from deepinfer.ops import REGISTRY
    from deepinfer.ops.routing import same_routing

    zeroed = _calls(monkeypatch, "_zero_dead_rows")
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype", torch.float32).is_floating_point else real_empty(*a, **k))
    a, a_s, e, w, w_s = _fp8_experts(8)
    gg = REGISTRY["grouped_gemm"].impls["triton"]
    with same_routing(e, every_row_local=True):
        local = gg(a, a_s, e, w, w_s)
    assert len(zeroed) == 0 and torch.isfinite(local).all()
    assert torch.equal(local, gg(a, a_s, e, w, w_s)) and len(zeroed) == 1
    e[::5] = -1  # another rank's experts
    with same_routing(e):
        c = gg(a, a_s, e, w, w_s)
    assert len(zeroed) == 2 and (c[e < 0] == 0).all() and torch.equal(c[e >= 0], local[e >= 0])


@pytest.mark.slow
def test_a_moe_layer_sorts_once(monkeypatch, tiny_dir):
    """A 20-token Triton prefill of deepinfer-tiny (4 MoE layers, each a w1|w3 and a w2 grouped GEMM of 120 pairs):
    4 sorts, one a layer, where each GEMM sorted (8), and no zeroing of rows (8 launches before): every expert is
    local."""
    ops.configure("triton")
    m = load_model(None, "official", "bfloat16", DEV, progress=False).model
    m.allocate(1, 24)
    ids = torch.randint(2, m.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    sorts, zeroed = _calls(monkeypatch, "align"), _calls(monkeypatch, "_zero_dead_rows")
    logits, _ = m.prefill(ids, torch.tensor([0]))
    assert torch.isfinite(logits).all()
    assert len(sorts) == 4, sorts
    assert len(zeroed) == 0  # all experts local: no row is left for a zeroing launch
