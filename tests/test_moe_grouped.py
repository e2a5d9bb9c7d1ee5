"""The host-sync-free routed-expert path: `grouped_gemm` (Triton, interpreter on CPU) vs its reference,
the `moe_align` row layout, `MoE.compute_experts` over stacked experts vs the old per-expert loop, the
engine end to end with the new path vs the old loop, and no host sync on the Triton backend.

Interpreter caveat (see test_triton_kernels.py): bf16 tl.dot is wrong there, so the float weight
format is tested with fp32/fp16 inputs; the quantised formats feed fp8.
"""

from __future__ import annotations

import os
import struct

# Compiled on a CUDA host, interpreted on CPU: tests/conftest.py sets TRITON_INTERPRET for CPU sessions
# before triton is imported (setting it here would leak into every later test module of the session).
COMPILED = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer.ops import REGISTRY, ops  # noqa: E402
from deepinfer.ops.reference import act_quant  # noqa: E402
from deepinfer.quant.formats import FP4_VALUES, e8m0_to_float, float_to_e8m0, quant_fp4, quant_fp8_block  # noqa: E402
from tc_bounds import abs_products, assert_tensor_core_bound  # noqa: E402

DEV = "cuda" if COMPILED else "cpu"


def _triton():
    pytest.importorskip("triton")
    import deepinfer_kernels.triton as tk  # noqa: F401  (registers the implementations)
    from deepinfer_kernels.triton import moe_grouped

    return moe_grouped


def _routing(g, P, E, n_pad, busy, busy_rows):
    """e [P]: random experts among 0..E-2 (expert E-1 never used: zero rows), `busy_rows` rows forced
    onto expert `busy` (more than one block), `n_pad` rows of -1."""
    e = torch.randint(0, E - 1, (P,), generator=g)
    perm = torch.randperm(P, generator=g)
    e[perm[:busy_rows]] = busy
    e[perm[busy_rows:busy_rows + n_pad]] = -1
    return e


# ------------------------------------------------------------------------------------------ moe_align
ALIGN_CASES = [(1, 4, 16, 0), (37, 5, 16, 1), (200, 3, 64, 2), (64, 64, 16, 3), (100, 7, 32, 4), (16, 1, 16, 5),
               (5, 256, 16, 6), (150, 256, 16, 7),
               (700, 256, 16, 8), (300, 1000, 16, 9),  # many chunks (decode batch ~128); chunks of 16 rows
               (3000, 256, 64, 10)]  # prefill-sized: the scatter walks the chunks' counts in several tiles


def _align_input(P, E, seed):
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-1, E, (P,), generator=g)
    if P > 3:
        e[: P // 2] = E - 1  # one expert with many rows
    if P > 10:
        e[5] = E + 3  # out of range: dropped like -1
    return e.to(DEV)


@pytest.mark.parametrize("impl", ["torch", "kernel"])
@pytest.mark.parametrize("P,E,BM,seed", ALIGN_CASES)
def test_moe_align_invariants(P, E, BM, seed, impl):
    mg = _triton()
    e = _align_input(P, E, seed)
    rows, bexp = (mg.moe_align if impl == "torch" else mg.align)(e, E, BM)
    e = torch.where(e < E, e, -1)
    nb = mg.align_max_blocks(P, E, BM)
    assert rows.shape == (nb * BM,) and bexp.shape == (nb,) and rows.dtype == bexp.dtype == torch.int64
    blocks = rows.view(nb, BM)
    counts = torch.bincount(e[e >= 0], minlength=E)
    used = int(((counts + BM - 1) // BM).sum())
    assert used <= nb
    # used blocks first, expert ids non-decreasing; the rest -1 and all padding
    assert (bexp[:used] >= 0).all() and (bexp[used:] == -1).all() and (bexp[:used].diff() >= 0).all()
    assert (blocks[used:] == P).all()
    # every valid row exactly once, in its expert's blocks, ascending (stable); padding only at run ends
    seen = rows[rows < P]
    assert torch.equal(seen.sort().values, torch.nonzero(e >= 0).flatten())
    for b in range(used):
        r = blocks[b][blocks[b] < P]
        assert len(r) > 0 and (e[r] == bexp[b]).all() and (r.diff() > 0).all()
    for x in range(E):
        bs = torch.nonzero(bexp == x).flatten()
        assert len(bs) == (int(counts[x]) + BM - 1) // BM
        if len(bs):
            run = blocks[bs].flatten()
            assert torch.equal(run[: counts[x]], torch.nonzero(e == x).flatten())
            assert (run[counts[x]:] == P).all()


@pytest.mark.parametrize("P,E,BM,seed", ALIGN_CASES)
def test_align_kernel_equals_torch_layout(P, E, BM, seed):
    mg = _triton()
    e = _align_input(P, E, seed)
    assert P <= mg.ALIGN_KERNEL_MAX_P
    a, b = mg.align(e, E, BM), mg.moe_align(e, E, BM)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_moe_align_shapes_depend_on_sizes_only():
    mg = _triton()
    a = mg.moe_align(torch.zeros(50, dtype=torch.long), 8, 16)
    b = mg.moe_align(torch.arange(50) % 8, 8, 16)
    c = mg.moe_align(torch.full((50,), -1), 8, 16)
    assert a[0].shape == b[0].shape == c[0].shape and a[1].shape == b[1].shape == c[1].shape
    assert (c[1] == -1).all() and (c[0] == 50).all()


@pytest.mark.parametrize("P,E,BM,seed", [(37, 5, 16, 1), (150, 256, 16, 7), (700, 256, 16, 8), (3000, 256, 64, 10)])
def test_align_kernels_write_their_own_padding(P, E, BM, seed, monkeypatch):
    """The count launch fills the rows' padding (P) itself, so no fill launch precedes it: with every new tensor
    poisoned, the kernels' layout equals moe_align's (the torch form) entry for entry."""
    mg = _triton()
    e = _align_input(P, E, seed)
    want = mg.moe_align(e, E, BM)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(
        -(2**40) + 7 if k.get("dtype") == torch.int64 else -7))
    rows, bexp = mg.align(e, E, BM)
    assert torch.equal(rows, want[0]) and torch.equal(bexp, want[1])


# --------------------------------------------------------------------------------------- grouped_gemm
def _weights(g, fmt, E, N, K, wdtype=torch.float32):
    if fmt == "fp8":
        ws = [quant_fp8_block(torch.randn(N, K, generator=g) * 0.02 * 10 ** (torch.rand(N, 1, generator=g) - 0.5))
              for _ in range(E)]
        return torch.stack([w for w, _ in ws]), torch.stack([e8m0_to_float(s) for _, s in ws])
    if fmt == "fp4":
        ws = [quant_fp4(torch.randn(N, K, generator=g) * 0.02) for _ in range(E)]
        return torch.stack([w for w, _ in ws]), torch.stack([e8m0_to_float(s) for _, s in ws])
    return (torch.randn(E, N, K, generator=g) * 0.05).to(wdtype), None


CASES = [  # fmt, P, E, N, K, n_pad, busy_rows, a dtype (float fmt), out dtype
    ("fp8", 37, 5, 200, 384, 4, 20, None, torch.float32),     # N not a multiple of the tile, 2 scale rows
    ("fp8", 12, 6, 64, 256, 3, 3, None, torch.bfloat16),
    ("fp8", 200, 3, 96, 128, 9, 120, None, torch.float32),    # BM = 64, one expert with 2 blocks
    ("fp4", 37, 5, 80, 384, 4, 20, None, torch.float32),
    ("fp4", 150, 4, 130, 256, 7, 100, None, torch.float32),   # BM = 64
    ("fp4", 9, 8, 64, 128, 2, 2, None, torch.bfloat16),
    ("fp4", 520, 4, 72, 256, 10, 300, None, torch.float32),   # BM = 128 (prefill tiles)
    ("fp4", 6, 16, 256, 1024, 0, 1, None, torch.float32),     # decode: 6 rows, K split over programs
    ("fp8", 300, 3, 256, 384, 9, 150, None, torch.float32),   # prefill: TMA weight tiles (BM 128)
    ("fp4", 300, 3, 256, 384, 9, 150, None, torch.float32),   # prefill: BM 128, 128x128 transposed tiles
    ("fp4", 150, 4, 128, 256, 7, 100, None, torch.bfloat16),  # BM 64, 64x64 tiles
    ("float", 37, 5, 72, 100, 4, 20, torch.float32, torch.float32),  # K not a multiple of BK
    ("float", 41, 4, 64, 96, 5, 25, torch.float16, torch.float16),
]


def _bf16(h: int) -> float:
    """bf16 bits -> value."""
    return struct.unpack("<f", struct.pack("<I", (h & 0xFFFF) << 16))[0]


def _to_bf16(x: float) -> int:
    """value -> bf16 bits, round to nearest even (via float32, as the hardware's fp32 product is exact here)."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _run_ptx(asm: str, regs: dict) -> dict:
    """A host model of the few PTX instructions the FP4 decode uses, run over its text: b32 registers as
    Python ints, mul.rn.bf16x2 per 16-bit half."""
    def val(x):
        return regs[x] if x in regs else int(x, 0)

    for stmt in asm.replace("{", ";").replace("}", ";").split(";"):
        op, _, rest = stmt.strip().partition(" ")
        if not op or op == ".reg":
            continue
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "prmt.b32":
            a, b, c = (val(t) for t in src)
            by = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
            regs[d] = sum(by[(c >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op in ("shl.b32", "shr.b32", "or.b32", "and.b32"):
            a, b = val(src[0]), val(src[1])
            if op == "shl.b32":
                regs[d] = (a << b) & 0xFFFFFFFF
            else:
                regs[d] = a >> b if op == "shr.b32" else (a | b if op == "or.b32" else a & b)
        elif op == "mul.rn.bf16x2":
            a, b = val(src[0]), val(src[1])
            regs[d] = _to_bf16(_bf16(a) * _bf16(b)) | _to_bf16(_bf16(a >> 16) * _bf16(b >> 16)) << 16
        else:
            raise AssertionError(f"the host model lacks {op!r}: extend _run_ptx")
    return regs


@pytest.mark.parametrize("folded", [False, True])
def test_fp4_ptx_decode_bit_logic_every_byte(folded):
    """`_ASM_DECODE`, run by a host model of its PTX text: every byte gives the e2m1 values of its low and
    high nibbles times the scale -- 1, 2^-127 (a bf16 subnormal scale) and 2^120. `_ASM_DECODE_FOLDED`
    (one multiply, by scale x 2^126) for the scales it is used with, <= 2: 2, 1 and 2^-127."""
    mg = _triton()
    for scale in ((2.0, 1.0, 2.0 ** -127) if folded else (1.0, 2.0 ** -127, 2.0 ** 120)):
        sb = _to_bf16(scale * 2.0 ** 126 if folded else scale)
        assert _bf16(sb) == (scale * 2.0 ** 126 if folded else scale)
        asm = (mg._ASM_DECODE_FOLDED if folded else mg._ASM_DECODE).value
        for b0 in range(256):
            b1 = (b0 * 37 + 11) % 256
            out = _run_ptx(asm, {"$2": b0 | b1 << 8, "$3": sb | sb << 16})
            got = [_bf16(out["$0"]), _bf16(out["$0"] >> 16), _bf16(out["$1"]), _bf16(out["$1"] >> 16)]
            want = [FP4_VALUES[c] * scale for c in (b0 & 15, b1 & 15, b0 >> 4, b1 >> 4)]
            assert got == want, (hex(b0), hex(b1), scale, got, want)


def test_grouped_gemm_fp4_every_code():
    """Random bytes: all 16 e2m1 codes (incl. -0) through the in-kernel bit decode."""
    _triton()
    g = torch.Generator().manual_seed(5)
    P, E, N, K = 20, 3, 64, 256
    e = torch.tensor([0, 1, 2, -1] * 5)
    a, a_s = act_quant(torch.randn(P, K, generator=g), 128)
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    w_s = torch.exp2(torch.randint(-12, -4, (E, N, K // 32), generator=g).float())
    d = REGISTRY["grouped_gemm"]
    args = [t.to(DEV) for t in (a, a_s, e, w, w_s)]
    torch.testing.assert_close(d.impls["triton"](*args, out_dtype=torch.float32),
                               d.ref(*args, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("P", [6, 40])
def test_fp4_decode_a_preconverted_is_bitwise_the_in_kernel_form(P, monkeypatch):
    """Decode-sized FP4 blocks (one row per block at P <= 8, sorted 16-row blocks with K splits above) read A
    pre-converted by `a_bf16_split` (A_BF16_DECODE): the same bits as converting A in every program, and
    the reference within the op tolerance."""
    _triton()
    from deepinfer_kernels.triton import moe_grouped
    g = torch.Generator().manual_seed(P)
    E, N, K = 6, 64, 512
    e = torch.randint(-1, E, (P,), generator=g)
    a, a_s = act_quant(torch.randn(P, K, generator=g), 128)
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    w_s = float_to_e8m0(torch.exp2(torch.randint(-12, -4, (E, N, K // 32), generator=g).float()))
    args = [t.to(DEV) for t in (a, a_s, e, w, w_s)]
    d = REGISTRY["grouped_gemm"]
    outs = []
    for flag in (False, True):
        monkeypatch.setattr(moe_grouped, "A_BF16_DECODE", flag)
        outs.append(d.impls["triton"](*args, out_dtype=torch.float32))
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[1], d.ref(*args, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("P", [6, 70])
def test_grouped_gemm_fp4_reads_a_split_form_given(P):
    """a_split (the producer's `a_bf16_split(a, a_s)`, `swiglu_quant(split=True)`) is read instead of converting
    a: the same bits at decode (one row a block) and prefill-sized blocks; with a wrong split form (one column
    off) the result changes, so the given one is what the kernel read."""
    mg = _triton()
    g = torch.Generator().manual_seed(5)
    E, N, K = 8, 128, 512
    a, a_s = act_quant(torch.randn(P, K, generator=g) * 3, 128)
    e = torch.randint(0, E, (P,), generator=g)
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    w_s = float_to_e8m0(torch.exp2(torch.randint(-12, -4, (E, N, K // 32), generator=g).float()))
    a, a_s, e, w, w_s = (t.to(DEV) for t in (a, a_s, e, w, w_s))
    impl = REGISTRY["grouped_gemm"].impls["triton"]
    split = mg.a_bf16_split(a, a_s)
    plain = impl(a, a_s, e, w, w_s, out_dtype=torch.float32)
    assert torch.equal(impl(a, a_s, e, w, w_s, out_dtype=torch.float32, a_split=split), plain)
    assert not torch.equal(impl(a, a_s, e, w, w_s, out_dtype=torch.float32, a_split=split.roll(1, -1)), plain)
    ref = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, out_dtype=torch.float32, a_split=split)
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_grouped_gemm_one_token_rows_as_a_stride0_view(fmt):
    """Batch-1 decode passes one token's k rows of A and its scales as an expanded (stride-0) view instead of
    repeat_interleave copies (`MoE.dispatch_local`): the same bits as the copied rows, for the FP4 path
    (read in place by `a_bf16_split`, or its split form given as a stride-0 view) and the FP8 one (copied by
    the op); -1 rows stay 0."""
    mg = _triton()
    g = torch.Generator().manual_seed(3)
    E, N, K, k = 8, 128, 512, 6
    a1, s1 = act_quant(torch.randn(1, K, generator=g) * 3, 128)
    e = torch.randperm(E, generator=g)[:k]
    e[2] = -1
    if fmt == "fp4":
        w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
        w_s = float_to_e8m0(torch.exp2(torch.randint(-12, -4, (E, N, K // 32), generator=g).float()))
    else:
        w = (torch.randn(E, N, K, generator=g) * 40).to(torch.float8_e4m3fn)
        w_s = torch.exp2(torch.randint(-12, -4, (E, N // 128, K // 128), generator=g).float())
    a1, s1, e, w, w_s = (t.to(DEV) for t in (a1, s1, e, w, w_s))
    d = REGISTRY["grouped_gemm"]
    view = d.impls["triton"](a1.expand(k, -1), s1.expand(k, -1), e, w, w_s, out_dtype=torch.float32)
    copied = d.impls["triton"](a1.repeat_interleave(k, 0), s1.repeat_interleave(k, 0), e, w, w_s,
                               out_dtype=torch.float32)
    assert torch.equal(view, copied), "the stride-0 rows were not read as the copied rows"
    if fmt == "fp4":  # the producer's split form as a stride-0 view too (`MoE.wants_split`): read in place
        split = mg.a_bf16_split(a1, s1)
        assert torch.equal(d.impls["triton"](a1.expand(k, -1), s1.expand(k, -1), e, w, w_s, out_dtype=torch.float32,
                                             a_split=split.expand(k, -1)), view)
    assert torch.equal(view[2], torch.zeros_like(view[2])) and (view[0] != 0).any()
    torch.testing.assert_close(view, d.ref(a1.repeat_interleave(k, 0), s1.repeat_interleave(k, 0), e, w, w_s,
                                           out_dtype=torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("P", [1, 6, 8])
def test_grouped_gemm_fp8_one_block_per_row(P, monkeypatch):
    """FP8 experts at <= IDENT_MAX_P rows (batch-1 decode, e.g. experts=fp8) run one block per row, unsorted, as FP4
    does: no align or zero-fill launches. Rows of -1 or of an expert past E (another rank's) are exactly 0; the
    rest equal the sorted path's bits (the same rows one more than IDENT_MAX_P apart) and the reference."""
    mg = _triton()
    assert P <= mg.IDENT_MAX_P
    g = torch.Generator().manual_seed(7)
    E, N, K = 8, 192, 384
    a, a_s = act_quant(torch.randn(mg.IDENT_MAX_P + 1, K, generator=g) * 3, 128)
    e = torch.randint(0, E, (mg.IDENT_MAX_P + 1,), generator=g)
    if P > 1:
        e[0], e[P - 1] = -1, E + 2
    w, w_s = _weights(g, "fp8", E, N, K)
    a, a_s, e, w, w_s = (t.to(DEV) for t in (a, a_s, e, w, w_s))
    d = REGISTRY["grouped_gemm"]
    sorted_ = d.impls["triton"](a, a_s, e, w, w_s, out_dtype=torch.float32)[:P]  # 9 rows: the sorted path
    monkeypatch.setattr(mg, "align", lambda *a, **k: pytest.fail("one block per row needs no sort"))
    monkeypatch.setattr(mg, "_zero_dead_rows", lambda *a, **k: pytest.fail("nor a zero-fill launch"))
    got = d.impls["triton"](a[:P], a_s[:P], e[:P], w, w_s, out_dtype=torch.float32)
    dead = (e[:P] < 0) | (e[:P] >= E)
    assert (got[dead] == 0).all() and (got[~dead] != 0).any()
    assert torch.equal(got, sorted_)
    ref = d.ref(a[:P], a_s[:P], torch.where(dead, -1, e[:P]), w, w_s, out_dtype=torch.float32)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# (fmt, tokens T, experts E, N, K): decode-sized blocks (BM 16) and prefill-sized ones (T * k / E > 80: BM 128, the
# FP4 path's A conversion and N-fast grid, the FP8 TMA kernel)
TOPK_CASES = [("fp4", 5, 8, 128, 512), ("fp4", 120, 8, 128, 256), ("fp8", 5, 8, 128, 256), ("fp8", 120, 8, 128, 256),
              ("float", 9, 4, 64, 64)]


@pytest.mark.parametrize("fmt,T,E,N,K", TOPK_CASES)
def test_grouped_gemm_topk_reads_each_token_row_for_its_pairs(fmt, T, E, N, K):
    """grouped_gemm(topk=k) with one A row per token (the model's prefill and batch > 1 decode: no [T*k, K] copy)
    gives the same bits as the rows repeated k times, padding rows (-1) 0; the reference agrees; and A's rows are
    what the kernel read (a token's row changed changes exactly its k pairs)."""
    _triton()
    g = torch.Generator().manual_seed(11)
    k = 6
    P = T * k
    e = _routing(g, P, E, n_pad=min(5, P // 4), busy=1, busy_rows=P // 3)
    x = torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-4, 4, (T, 1), generator=g).float())
    w, w_s = _weights(g, fmt, E, N, K)
    if fmt == "float":
        a, a_s = x, None
    else:
        a, a_s = act_quant(x, 128)
    a, e, w = a.to(DEV), e.to(DEV), w.to(DEV)
    a_s = None if a_s is None else a_s.to(DEV)
    w_s = None if w_s is None else w_s.to(DEV)
    rep = lambda t: None if t is None else t.repeat_interleave(k, 0)  # noqa: E731
    d = REGISTRY["grouped_gemm"]
    impl = d.impls["triton"]
    got = impl(a, a_s, e, w, w_s, out_dtype=torch.float32, topk=k)
    want = impl(rep(a), rep(a_s), e, w, w_s, out_dtype=torch.float32)
    assert got.shape == (P, N) and torch.equal(got, want)
    assert (got[e < 0] == 0).all() and (got[e >= 0] != 0).any()
    torch.testing.assert_close(d.ref(a, a_s, e, w, w_s, out_dtype=torch.float32, topk=k),
                               d.ref(rep(a), rep(a_s), e, w, w_s, out_dtype=torch.float32), rtol=0, atol=0)
    if fmt == "fp4":  # the producer's split form of the token rows, read the same way
        mg = _triton()
        assert torch.equal(impl(a, a_s, e, w, w_s, out_dtype=torch.float32, a_split=mg.a_bf16_split(a, a_s),
                                topk=k), got)
    a2 = a.clone()
    a2[1] = a[2]  # token 1's row: only pairs k..2k-1 (and not their padding rows) move
    moved = (impl(a2, a_s, e, w, w_s, out_dtype=torch.float32, topk=k) != got).any(-1)
    live = e >= 0
    assert moved[k:2 * k].any() and not moved[:k].any() and not moved[2 * k:].any() and not moved[~live].any()
    with pytest.raises((AssertionError, ValueError)):
        impl(a[:-1], None if a_s is None else a_s[:-1], e, w, w_s, out_dtype=torch.float32, topk=k)
    with pytest.raises(ValueError, match="e has"):
        d.ref(a[:-1], None if a_s is None else a_s[:-1], e, w, w_s, out_dtype=torch.float32, topk=k)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fmt,P,E,N,K,n_pad,busy,adt,odt", CASES)
def test_grouped_gemm_triton_vs_reference(seed, fmt, P, E, N, K, n_pad, busy, adt, odt):
    _triton()
    g = torch.Generator().manual_seed(seed)
    e = _routing(g, P, E, n_pad, busy=1, busy_rows=busy)
    x = torch.randn(P, K, generator=g) * torch.exp2(torch.randint(-4, 4, (P, 1), generator=g).float())
    w, w_s = _weights(g, fmt, E, N, K)
    if fmt == "fp4" and seed == 1:  # as the model holds them: raw ue8m0 bytes, decoded in-kernel
        w_s = float_to_e8m0(w_s)
    if fmt == "float":
        a, a_s = x.to(adt), None
    else:
        a, a_s = act_quant(x, 128)
    args = [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in (a, a_s, e, w, w_s)]
    d = REGISTRY["grouped_gemm"]
    ref = d.ref(*args, out_dtype=odt)
    out = d.impls["triton"](*args, out_dtype=odt)
    assert out.shape == ref.shape == (P, N) and out.dtype == ref.dtype == odt
    assert not torch.isnan(out).any()
    assert (out[args[2] < 0] == 0).all(), "padding rows must be exactly 0"
    if DEV == "cuda" and fmt == "fp8" and _prefill_path(args[0], args[3], P, E):
        # the compiled prefill kernels promote to fp32 once per 128-K block (tc_bounds)
        assert_tensor_core_bound(out, ref, abs_products("grouped_gemm", *args, out_dtype=torch.float32))
        return
    rtol, atol = d.tol[str(odt).removeprefix("torch.")]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


def _prefill_path(a, w, P, E) -> bool:
    from deepinfer_kernels.triton import moe_grouped, moe_prefill
    return moe_prefill.usable(a, w, moe_grouped._block_m(P, E))


@pytest.mark.parametrize("P,busy", [(300, 150), (6, 1)])
@pytest.mark.parametrize("spread", [14, 15, 40])
def test_fp4_any_scale_spread_exact(spread, P, busy):
    """The in-kernel FP4 -> bf16 decode is exact for every scale pattern: a 128-K block whose group scales
    lie 2^14, 2^15 (past where an FP4 -> FP8 per-block rescale would lose e2m1's 0.5) or 2^40 apart gives
    the reference's values, at prefill (BM 128) and batch-1 decode sizes."""
    _triton()
    g = torch.Generator().manual_seed(3)
    E, N, K = 3, 128, 256
    e = _routing(g, P, E, min(9, P // 2), busy=1, busy_rows=busy)
    x = torch.zeros(P, K)
    x[:, 32:64] = torch.randn(P, 32, generator=g)  # only group 1 contributes: its values are not drowned
    a, a_s = act_quant(x, 128)
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)  # every code, incl. 0.5s
    sb = torch.randint(118, 122, (E, N, K // 32), generator=g).to(torch.uint8)
    sb[:, :, 0] = sb[:, :, :4].amax(-1) + 20  # group 0: block 0's largest scale
    sb[:, :, 1] = sb[:, :, 0] - spread  # group 1: `spread` binades under it
    args = [t.to(DEV) for t in (a, a_s, e, w, sb)]
    d = REGISTRY["grouped_gemm"]
    out, ref = d.impls["triton"](*args, out_dtype=torch.float32), d.ref(*args, out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("P,busy", [(300, 150), (6, 1)])
@pytest.mark.parametrize("lo_s,a_exp", [(3, 120), (232, -10)])
def test_fp4_extreme_scales_exact(lo_s, a_exp, P, busy):
    """Group scales near both ends of ue8m0 (2^-124 .. 2^-120 and 2^105 .. 2^109) with activations ~2^120
    (the products stay normal) or ~2^-10 (act_quant floors a block's amax at 1e-4): the decode's two
    power-of-two multiplies (x 2^126, x scale) keep every code exact, where one multiply by
    scale x 2^126 would overflow bf16."""
    _triton()
    g = torch.Generator().manual_seed(4)
    E, N, K = 3, 128, 256
    e = _routing(g, P, E, min(9, P // 2), busy=1, busy_rows=busy)
    a, a_s = act_quant(torch.randn(P, K, generator=g) * 2.0 ** a_exp, 128)
    w = torch.randint(-128, 128, (E, N, K // 2), generator=g, dtype=torch.int8)
    sb = torch.randint(lo_s, lo_s + 5, (E, N, K // 32), generator=g).to(torch.uint8)
    args = [t.to(DEV) for t in (a, a_s, e, w, sb)]
    d = REGISTRY["grouped_gemm"]
    out, ref = d.impls["triton"](*args, out_dtype=torch.float32), d.ref(*args, out_dtype=torch.float32)
    assert ref.abs().max() > 1e-3 and torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_grouped_gemm_reference_is_the_per_expert_gemms():
    """The spec restated: row p of the reference equals the single-expert GEMM of that row."""
    g = torch.Generator().manual_seed(3)
    P, E, N, K = 10, 3, 64, 256
    e = torch.tensor([0, 2, -1, 2, 0, 0, 1, -1, 2, 2])
    a, a_s = act_quant(torch.randn(P, K, generator=g), 128)
    w, w_s = _weights(g, "fp4", E, N, K)
    out = REGISTRY["grouped_gemm"].ref(a, a_s, e, w, w_s, out_dtype=torch.float32)
    for p in range(P):
        if e[p] < 0:
            assert (out[p] == 0).all()
        else:
            y = REGISTRY["fp4_gemm"].ref(a[p:p + 1], a_s[p:p + 1], w[e[p]], w_s[e[p]], out_dtype=torch.float32)
            torch.testing.assert_close(out[p:p + 1], y, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------ MoE.compute_experts
def _old_compute_experts(moe, x_rows, w, e):
    """The per-expert loop `compute_experts` was before the stacked path (the oracle)."""
    out = torch.zeros(x_rows.shape, dtype=torch.float32, device=x_rows.device)
    for j in torch.unique(e).tolist():
        if j < 0:
            continue
        (p,) = torch.where(e == j)
        out[p] = moe.experts[j](x_rows[p], w[p, None]).float()
    return out


_MODELS: dict = {}


def _model(tiny_dir, numerics):
    if numerics not in _MODELS:
        from deepinfer.engine.loader import load_model

        _MODELS[numerics] = load_model(None, numerics=numerics, dtype="float32", device=DEV, progress=False)
    return _MODELS[numerics]


def _pairs(moe, seed, P=40):
    g = torch.Generator().manual_seed(seed)
    E = len(moe.experts)
    D = moe.gate_w.size(1)
    x = torch.randn(P, D, generator=g)
    w = torch.rand(P, generator=g) * 1.5
    e = torch.randint(0, E - 1, (P,), generator=g)  # expert E-1 gets no rows
    e[:20] = 3  # one expert with more rows than a block
    e[torch.randperm(P, generator=g)[:5]] = -1
    return x.to(DEV), w.to(DEV), e.to(DEV)


@pytest.mark.parametrize("numerics", ["official", "exact"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compute_experts_matches_the_per_expert_loop(tiny_dir, numerics, backend):
    if backend == "triton":
        _triton()
    moe = _model(tiny_dir, numerics).model.layers[1].ffn
    fmt = moe.experts.w13.fmt
    assert fmt == ("fp4" if numerics == "official" else "float")
    assert moe.experts.w13.weight.dim() == 3 and moe.experts.w13.weight.size(0) == len(moe.experts)
    if fmt == "fp4":
        assert moe.experts.w13.scale.dtype == torch.uint8, "FP4 expert scales are held as ue8m0 bytes"
    x, w, e = _pairs(moe, 0)
    ops.configure("torch", strict=False)
    old = _old_compute_experts(moe, x, w, e)
    ops.configure(backend, strict=backend == "triton")
    new = moe.compute_experts(x, w, e)
    assert new.dtype == torch.float32 and new.shape == x.shape
    assert (new[e < 0] == 0).all() and old.abs().max() > 0
    if backend == "torch" and DEV == "cpu":
        assert torch.equal(new, old), "same references on the same rows: bitwise equal"
    else:  # CUDA: cuBLAS picks its reduction order by shape, and w1|w3 is one [P, 2I] GEMM here
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)


def test_stacked_w1_w3_are_the_checkpoint_tensors(tiny_dir):
    """w1|w3 concatenated per expert: each half is that expert's checkpoint weight, scales as e8m0 bytes."""
    from deepinfer.checkpoint.reader import load_state, open_checkpoint
    from deepinfer.quant.formats import e8m0_to_float
    m = _model(tiny_dir, "official")
    moe = m.model.layers[1].ffn
    st = load_state(open_checkpoint(str(tiny_dir)), m.model.cfg, progress=False)
    I = moe.experts.inter
    for j in (0, len(moe.experts) - 1):
        for half, name in ((slice(0, I), "w1"), (slice(I, 2 * I), "w3")):
            pre = f"layers.1.ffn.experts.{j}.{name}"
            assert torch.equal(moe.experts.w13.weight[j, half].cpu(), st[pre + ".weight"].view(torch.int8))
            assert torch.equal(e8m0_to_float(moe.experts.w13.scale[j, half]).cpu(), st[pre + ".scale"].float())


def test_stacked_experts_are_views_not_copies(tiny_dir):
    moe = _model(tiny_dir, "official").model.layers[1].ffn
    ex = moe.experts[2]
    st = moe.experts.w13
    I = moe.experts.inter
    assert ex.w1.weight.untyped_storage().data_ptr() == st.weight.untyped_storage().data_ptr()
    assert torch.equal(ex.w1.weight, st.weight[2, :I]) and torch.equal(ex.w1.scale, st.scale[2, :I])
    assert torch.equal(ex.w3.weight, st.weight[2, I:]) and torch.equal(ex.w3.scale, st.scale[2, I:])
    assert len(list(moe.experts)) == len(moe.experts) == moe.n_experts
    with pytest.raises(IndexError):
        moe.experts[len(moe.experts)]


@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_engine_end_to_end_matches_the_per_expert_loop(tiny_dir, numerics, monkeypatch):
    """The whole tiny model (prefill + decode, torch backend) through the stacked path -- official numerics:
    the routed w1|w3 input is the shared expert's act_quant rows, repeated -- and through the old loop on
    the repeated rows: identical logits (bitwise on CPU)."""
    from deepinfer.model.moe import MoE

    net = _model(tiny_dir, numerics).model
    ids = torch.randint(2, 1000, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEV)

    def run():
        net.allocate(2, 16)
        logits, _ = net.prefill(ids)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        step = net.decode(nxt, torch.full((2,), 12, device=DEV))
        return logits, step

    new = run()
    # the old path: every pair's row quantised on its own (no reuse of the shared expert's act_quant), then
    # the per-expert loop
    monkeypatch.setattr(MoE, "compute_experts", lambda self, x, w, e: _old_compute_experts(self, x, w, e))
    for moe in [b.ffn for b in net.layers] + [m.block.ffn for m in net.mtp]:
        monkeypatch.setattr(moe, "dispatch", lambda xt, w, i, xq=None, moe=moe: MoE.dispatch_local(moe, xt, w, i))
    old = run()
    for a, b in zip(new, old):
        if DEV == "cpu":
            assert torch.equal(a, b)
        else:  # cuBLAS reduction order depends on the GEMM shape (w1|w3 fused: N = 2I)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- no host sync
@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_triton_compute_experts_has_no_host_sync(tiny_dir, numerics, monkeypatch):
    _triton()
    moe = _model(tiny_dir, numerics).model.layers[1].ffn
    x, w, e = _pairs(moe, 1)
    ops.configure("triton", strict=True)
    expect = moe.compute_experts(x, w, e)

    def boom(name):
        def f(*a, **k):
            raise AssertionError(f"host sync: {name} called in the routed-expert path")
        return f

    with monkeypatch.context() as m:
        for name in ("tolist", "item", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
            m.setattr(torch.Tensor, name, boom(f"Tensor.{name}"))
        for name in ("unique", "nonzero", "bincount", "unique_consecutive"):
            m.setattr(torch, name, boom(f"torch.{name}"))
        got = moe.compute_experts(x, w, e)
        T = 8
        ids = torch.randint(2, 1000, (1, T)).to(DEV)
        xt = torch.randn(1, T, x.size(1)).to(DEV)
        moe(xt, ids)  # the whole MoE call: router, dispatch, experts, shared expert
    assert torch.equal(got, expect)



def test_moe_passes_token_rows_with_topk_beyond_one_token(monkeypatch):
    """Past one token (prefill, batch > 1 decode) the routed w1|w3 GEMM gets the tokens' act_quant rows once and
    topk = k (no [T*k, D] copy); one token keeps its stride-0 view; w2 gets per-pair rows. The tokens equal
    those of the rows repeated by hand (what the model computed before)."""
    import deepinfer.model.moe as moe_mod
    from deepinfer.engine.loader import load_model

    calls = []
    real = moe_mod.ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def grouped_gemm(self, a, a_s, e, w, w_s, out_dtype=torch.bfloat16, a_split=None, topk=1):
            calls.append((a.size(0), e.numel(), topk, a.stride(0)))
            return real.grouped_gemm(a, a_s, e, w, w_s, out_dtype=out_dtype, a_split=a_split, topk=topk)

        def swiglu_grouped_gemm(self, h, limit, weight, e, w, w_s, out_dtype=torch.bfloat16):  # w2: per-pair rows
            calls.append((h.size(0), e.numel(), 1, h.stride(0)))
            return real.swiglu_grouped_gemm(h, limit, weight, e, w, w_s, out_dtype=out_dtype)

    ops.configure("torch")
    m = load_model(None, numerics="official", dtype="float32", device="cpu", progress=False).model
    k = m.cfg.n_activated_experts
    m.allocate(2, 32)
    ids = torch.randint(2, m.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(moe_mod, "ops", Spy())
    logits, _ = m.prefill(ids, rows=torch.tensor([0]))
    w13 = calls[0::2]
    assert w13 and all(c == (9, 9 * k, k, c[3]) for c in w13), w13
    assert all(c[:3] == (9 * k, 9 * k, 1) for c in calls[1::2])
    calls.clear()
    m.decode(ids[:, :1], torch.tensor([9]), rows=torch.tensor([0]))
    assert calls[0][:3] == (k, k, 1) and calls[0][3] == 0  # one token: its k rows as a stride-0 view

    def repeated(a, a_s, e, w, w_s, out_dtype=torch.bfloat16, a_split=None, topk=1):
        rep = (lambda t: t.repeat_interleave(topk, 0)) if topk > 1 else (lambda t: t)
        return real.grouped_gemm(rep(a), None if a_s is None else rep(a_s), e, w, w_s, out_dtype=out_dtype)

    m2 = load_model(None, numerics="official", dtype="float32", device="cpu", progress=False).model
    m2.allocate(2, 32)
    monkeypatch.setattr(Spy, "grouped_gemm", lambda self, *a, **kw: repeated(*a, **kw))
    want, _ = m2.prefill(ids, rows=torch.tensor([0]))
    assert torch.equal(logits, want)


def _fp4_routed_case(g, T, P, E, N, K, raw, dead) -> list:
    """[a, a_s, e, w, w_s] on DEV for a routed FP4 grouped GEMM: T token rows of per-row magnitudes 2^-4..2^3
    act_quanted, E experts' FP4 weights [N, K] (scales as raw ue8m0 bytes or floats), P pairs with pair `dead`
    routed to no expert (-1)."""
    x = torch.randn(T, K, generator=g) * torch.exp2(torch.randint(-4, 4, (T, 1), generator=g).float())
    a, a_s = act_quant(x, 128)
    w, w_s = _weights(g, "fp4", E, N, K)
    if raw:
        w_s = float_to_e8m0(w_s)
    e = torch.randint(0, E, (P,), generator=g)
    e[dead] = -1
    return [t.to(DEV) for t in (a, a_s, e, w, w_s)]


def _tool(name: str):
    """A module of tools/ (imported by path: tools/ is not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ksub", [2, 4])
@pytest.mark.parametrize("P,E,N,K,topk,raw", [(6, 8, 256, 1024, 6, True),    # batch 1: one token's row, K split
                                              (6, 8, 128, 512, 1, False),    # one row a pair
                                              (40, 4, 128, 384, 2, True)])   # 16-row sorted blocks
def test_fp4_decode_sub_steps_against_the_reference(ksub, P, E, N, K, topk, raw, monkeypatch):
    """DECODE_KSUB > 1: each 128-K step of a decode-sized block decoded and multiplied in sub-steps -- the same
    exact products as one step, summed in fp32 in another grouping: within the reference's tolerance of it and of
    the one-step form; rows routed to -1 are 0."""
    mg = _triton()
    args = _fp4_routed_case(torch.Generator().manual_seed(P * 31 + K + ksub), P // topk, P, E, N, K, raw, P // 2)
    d = REGISTRY["grouped_gemm"]
    one = d.impls["triton"](*args, out_dtype=torch.float32, topk=topk)
    monkeypatch.setattr(mg, "DECODE_KSUB", ksub)
    got = d.impls["triton"](*args, out_dtype=torch.float32, topk=topk)
    assert not torch.isnan(got).any() and (got[P // 2] == 0).all()
    torch.testing.assert_close(got, d.ref(*args, out_dtype=torch.float32, topk=topk), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5)  # compiled: the tensor core's fp32 adds regrouped


@pytest.mark.parametrize("raw", [True, False])
def test_fp4_prefill_one_dot_form(raw, monkeypatch):
    """DEEPINFER_FP4_ONE_DOT: prefill-sized blocks (BM >= 64, A in its split form) multiply each 128-K step as one
    dot of the joined low / high nibble tile. The same products in the same K order: compiled, the same bits as
    the two-dot form; interpreted (fp32 dots, summed otherwise), within fp32 rounding of it. Both within the
    reference's tolerance; rows routed to -1 are 0. The launch recorded shows the form ran (ONE_DOT, A_BF16,
    N_FAST), so a flag the wrapper ignored fails this."""
    _triton()
    P, E, N, K = 300, 4, 128, 384  # 75 rows an expert: 64-row blocks, 3 K steps
    args = _fp4_routed_case(torch.Generator().manual_seed(11 + raw), P, P, E, N, K, raw, 7)
    d = REGISTRY["grouped_gemm"]
    two = d.impls["triton"](*args, out_dtype=torch.float32)
    monkeypatch.setenv("DEEPINFER_FP4_ONE_DOT", "1")
    got = d.impls["triton"](*args, out_dtype=torch.float32)
    assert not torch.isnan(got).any() and (got[7] == 0).all()
    torch.testing.assert_close(got, d.ref(*args, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)
    if COMPILED:
        assert torch.equal(got, two)
    else:
        torch.testing.assert_close(got, two, rtol=2e-6, atol=1e-6)
        triton_launches = _tool("triton_launches")

        monkeypatch.setitem(triton_launches.SCENARIOS, "one_dot",
                            lambda: d.impls["triton"](*args, out_dtype=torch.float32))
        (launch,) = [i for i in triton_launches.record(["one_dot"]) if i["kernel"] == "_gg_fp4_kernel"]
        assert [launch["args"][k][1] for k in ("ONE_DOT", "A_BF16", "N_FAST")] == [True, True, True]
