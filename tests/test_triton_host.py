"""The Triton backend's host side: what a wrapper spends before its kernel launches.

Triton makes `triton.cdiv` and `triton.next_power_of_2` constexpr functions, each host call unwrapping its
arguments as constexprs (~5 us on a 2-core Xeon against ~0.1 us of arithmetic). The wrappers compute grids and
block sizes with `_common.cdiv` / `next_power_of_2` instead; an eager step issues every launch from the host, so
these were a third of a prefill's wrapper time.
"""

from __future__ import annotations

import pytest
import torch

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
    m = load_model(None, "official", "bfloat16", "cpu", progress=False).model
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
