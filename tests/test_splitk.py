"""Split-K reduction inside the GEMMs (`_common.splitk_store`): the tile's last split sums the partials.

Each case picks shapes whose launch *does* split K (asserted through the kernels' own config helpers),
runs the Triton op twice on fresh random inputs -- outputs allocated NaN-poisoned, so an element no
program reduced shows up -- and checks: the reference within fp32 tolerance (partials are fp32, the
sum order differs from the reference's), bitwise-equal outputs across the two launches (the sum is in
split order whichever program finishes last; a counter not re-armed to 0 would skip or repeat the
reduction on the second launch), and every tile counter back at 0 afterwards.
On CPU the kernels run under the Triton interpreter (one program at a time); on the H200 compiled, where
programs race for the counter.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.ops import REGISTRY  # noqa: E402
from deepinfer.quant.formats import fp4_pack  # noqa: E402

COMPILED = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEV = "cuda" if COMPILED else "cpu"
TK = importlib.import_module("deepinfer_kernels.triton")
common = importlib.import_module("deepinfer_kernels.triton._common")
gemm = importlib.import_module("deepinfer_kernels.triton.gemm")
grouped = importlib.import_module("deepinfer_kernels.triton.moe_grouped")
FP4_VALS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _poisoned_empty():
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t
    return real, empty


def _run_twice(name, *args):
    """The Triton op twice with NaN-poisoned torch.empty: (first, second) outputs."""
    real, empty = _poisoned_empty()
    torch.empty = empty
    try:
        return REGISTRY[name].impls["triton"](*args), REGISTRY[name].impls["triton"](*args)
    finally:
        torch.empty = real


def _check(name, args, atol_rel=1e-6):
    ref = REGISTRY[name].ref(*args)
    out1, out2 = _run_twice(name, *args)
    assert not torch.isnan(out1).any(), f"{name}: elements no split reduced"
    assert torch.equal(out1, out2), f"{name}: second launch differs (counter not re-armed, or order not fixed)"
    scale = ref.abs().max().item()
    err = (out1.double() - ref.double()).abs().max().item()
    assert err <= 1e-5 * scale + atol_rel * scale, f"{name}: max error {err:.3e} at output scale {scale:.3e}"
    counters = common.tile_counters(out1.device, 1)  # the current stream's: the set the launches used
    assert int(counters.abs().sum()) == 0, "tile counters not left at 0"
    return out1, ref


def _pow2(g, *shape):
    return torch.exp2(torch.randint(-6, 2, shape, generator=g).float()).to(DEV)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("M,N,K", [(1, 130, 1024), (3, 200, 2048)])
def test_fp8_gemm_split(seed, M, N, K):
    assert gemm._config(M, N, K, torch.device(DEV))[3] > 1, "shape must split K"
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    _check("fp8_gemm", (a, _pow2(g, M, K // 128), w, _pow2(g, -(-N // 128), K // 128), torch.float32))


@pytest.mark.parametrize("seed", [0, 1])
def test_fp4_gemm_split(seed):
    M, N, K = 2, 70, 1024
    assert gemm._config(M, N, K, torch.device(DEV))[3] > 1
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    w = fp4_pack(FP4_VALS[torch.randint(0, 16, (N, K), generator=g)]).to(DEV)
    _check("fp4_gemm", (a, _pow2(g, M, K // 128), w, _pow2(g, N, K // 32), torch.float32))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("M,N,K", [(1, 70, 2048), (4, 33, 1000), (24, 64, 1024)])  # GEMV x2, tiled
def test_linear_split(seed, M, N, K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEV)
    _check("linear", (x, w))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("P,E", [(6, 8), (20, 4)])  # IDENT rows (one token's top-k) / sorted blocks
def test_grouped_fp4_split(seed, P, E):
    N, K = 256, 1024
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(P, K, generator=g) * 50).to(torch.float8_e4m3fn).to(DEV)
    a_s = _pow2(g, P, K // 128)
    w = fp4_pack(FP4_VALS[torch.randint(0, 16, (E * N, K), generator=g)]).view(E, N, K // 2).to(DEV)
    w_s = _pow2(g, E, N, K // 32)
    e = torch.randperm(E, generator=g)[:P] if P <= E else torch.randint(0, E, (P,), generator=g)
    e[1] = -1  # a row with no local expert: exactly 0 (IDENT stores it; c is not zero-filled there)
    e = e.to(DEV)
    BM = 16 if P <= grouped.IDENT_MAX_P else grouped._block_m(P, E)
    nb = P if P <= grouped.IDENT_MAX_P else grouped.align_max_blocks(P, E, BM)
    assert grouped._fp4_config(nb, N, K, BM, False, torch.device(DEV))[1] > 1, "shape must split K"
    out, _ = _check("grouped_gemm", (a, a_s, e, w, w_s, torch.float32))
    assert torch.equal(out[1], torch.zeros_like(out[1]))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _sum_splits_kernel(x_ptr, p_ptr, c_ptr, cnt_ptr, slab, BN: tl.constexpr):
    """Split s contributes x[s]; the tile's last split sums them (`splitk_store`)."""
    s = tl.program_id(0)
    r = tl.arange(0, BN)
    m = r < slab
    v = tl.load(x_ptr + s * slab + r, mask=m, other=0.0)
    common.splitk_store(v, p_ptr + r, c_ptr + r, m, s, tl.num_programs(0), slab, cnt_ptr)


@pytest.mark.parametrize("splits", [2, 3, 4, 5, 8, 9, 11])
def test_splitk_store_sums_in_split_order(splits):
    """The last split's sum is ((x0 + x1) + x2) + ... in fp32, bit for bit, for even and odd split counts: values
    spread over 2^±20 so any other order rounds differently."""
    g = torch.Generator().manual_seed(splits)
    n = 50
    x = (torch.randn(splits, n, generator=g) * torch.exp2(torch.randint(-20, 20, (splits, n), generator=g).float()))
    expect = torch.zeros(n)
    for s in range(splits):
        expect = expect + x[s]
    x = x.to(DEV)
    part = torch.full((splits, n), float("nan"), device=DEV)
    c = torch.full((n,), float("nan"), device=DEV)
    cnt = common.tile_counters(torch.device(DEV), 1)
    _sum_splits_kernel[(splits,)](x, part, c, cnt, n, BN=64)
    assert torch.equal(c.cpu(), expect), f"{(c.cpu() != expect).sum().item()} of {n} sums not in split order"
    assert int(cnt[0]) == 0, "the tile counter was not re-armed"
