"""`official` numerics round where DeepSeek's official inference code rounds (inference/model.py and
kernel.py of DeepSeek-V4-Flash, release 60d8d707: model.py sha256 ce962f1f...1d71, kernel.py 59b32508...c0c2;
`official@efc85512` the initial release, model.py 6380e70f...e818, kernel.py c4dc859a...93e4; which public copies
are which: docs/numerics.md).

Each rounding point is pinned by a test that fails when it moves; the official line it follows is quoted.
"""

import pytest
import torch

from deepinfer.ops import ops
from deepinfer.ops.reference import (act_quant, decode_slots, fp4_fake_quant, fp8_fake_quant, head_norm,
                                     kv_pack, kv_unpack, rms_norm_rope, sparse_attn)
from deepinfer.quant.kv_layout import kv_packed_width


def _q(seed=0, shape=(3, 5, 4, 512), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).bfloat16()


# ------------------------------------------------------------------------ the q head norm
def test_q_head_norm_follows_the_official_line():
    """model.py, Attention.forward: `q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps)` on
    wq_b's bf16 output: every step in bf16."""
    q = _q()
    official = q.clone()
    official *= torch.rsqrt(official.square().mean(-1, keepdim=True) + 1e-6)
    got = head_norm(q, 1e-6, "official_q")
    assert got.dtype == torch.bfloat16 and torch.equal(got, official)
    fp32 = head_norm(q, 1e-6, "module")
    assert not torch.equal(fp32, official), "the fp32 form must differ here, or this test could not fail"


def test_q_head_norm_transformers_form():
    """transformers' DeepseekV4UnweightedRMSNorm: `x * torch.rsqrt(x.float().square().mean(-1,
    keepdim=True) + self.eps).to(x.dtype)` -- what `exact` numerics follow."""
    q = _q(1)
    want = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + 1e-6).to(q.dtype)
    assert torch.equal(head_norm(q, 1e-6, "transformers_q"), want)


def test_forms_agree_in_float32():
    q = _q(2).float()
    a, b, c = (head_norm(q, 1e-6, f) for f in ("module", "official_q", "transformers_q"))
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-6) and torch.allclose(a, c, rtol=1e-6, atol=1e-6)


def test_rms_norm_rope_form_then_rope():
    """The rotation reads the norm's bf16 output (model.py: `apply_rotary_emb(q[..., -rd:], freqs_cis)`
    after the in-place norm)."""
    from deepinfer.ops.reference import rope

    q = _q(3, (2, 3, 4, 128))
    cos = torch.rand(2, 3, 32)
    sin = (1 - cos ** 2).sqrt()
    y = rms_norm_rope(q, None, 1e-6, cos, sin, 64, form="official_q")
    n = head_norm(q, 1e-6, "official_q")
    assert torch.equal(y[..., :-64], n[..., :-64])
    assert torch.equal(y[..., -64:], rope(n[..., -64:], cos, sin))
    with pytest.raises(ValueError):
        rms_norm_rope(q, torch.ones(128), 1e-6, cos, sin, 64, form="official_q")


def test_the_model_uses_each_numerics_form(tiny_dir):
    from deepinfer.engine.loader import load_model

    off = load_model(None, "official", "bfloat16", "cpu", progress=False).model
    ex = load_model(None, "exact", "bfloat16", "cpu", progress=False).model
    assert {a.q_norm_form for a in off.attentions()} == {"official_q"}
    assert {a.q_norm_form for a in ex.attentions()} == {"transformers_q"}


# ------------------------------------------------------------- quantisation blocks and scales
def _record(monkeypatch, name):
    """Every call of ops.<name> during a prefill + decode of the official tiny model: its block argument."""
    from deepinfer.engine.loader import load_model
    from deepinfer.ops import reference

    seen = []
    real = getattr(reference, name)

    def spy(x, block=None, *a, **k):
        seen.append(block)
        return real(x, block, *a, **k) if block is not None else real(x, *a, **k)

    lm = load_model(None, "official", "bfloat16", "cpu", progress=False)
    monkeypatch.setattr(type(ops), name, property(lambda self: spy), raising=False)
    m = lm.model
    m.allocate(1, 24)
    ids = torch.tensor([[0] + list(range(300, 320))])
    m.prefill(ids)
    m.decode(torch.tensor([[5]]), torch.tensor([21]))
    return seen


def test_indexer_fp4_blocks_of_32(monkeypatch, tiny_dir):
    """model.py, Indexer / Compressor(rotate=True): `fp4_act_quant(..., 32)` on the Hadamard-rotated indexer
    queries and keys: FP4 e2m1 with one power-of-two scale per 32 -- here the rotation's own op,
    `hadamard(x, fp4_block=32)` (one launch), at every call: queries and keys, prefill and decode."""
    blocks = _record(monkeypatch, "hadamard")
    assert blocks and set(blocks) == {32}, blocks


def test_kv_nope_fp8_blocks_of_64(monkeypatch, tiny_dir):
    """60d8d707 model.py, Attention.forward (line 506): `act_quant(kv[..., :-rd], 64, scale_fmt, scale_dtype, True)`,
    and Compressor.forward (line 372) on the compressed entries: the cache's no-RoPE dims rounded to FP8 per 64 --
    in that release's kernel.py the inplace branch casts through FP8 (line 88, `T.Cast(compute_dtype, T.Cast(FP8,
    T.clamp(`). Default official numerics hold the cache in its FP8 layout, so the rounding is the packing
    (`kv_pack`: the codes and scales of act_quant(kv_nope, 64)); decode packs inside `kv_store`."""
    monkeypatch.delenv("DEEPINFER_KV_QAT", raising=False)
    rope_dims = _record(monkeypatch, "kv_pack")
    assert rope_dims and set(rope_dims) == {64}, rope_dims
    kv = _q(4, (6, 512)).float()
    # each 64-block: a first half 1000x smaller than its second, so blocks of 32 and of 64 scale it apart
    kv[:, :448].unflatten(-1, (7, 2, 32))[:, :, 0] *= 1e-3
    packed = kv_pack(kv.bfloat16(), 64)
    un = kv_unpack(packed, 512, 64, torch.bfloat16)
    assert torch.equal(un[..., :-64], fp8_fake_quant(kv.bfloat16()[..., :-64], 64))
    assert not torch.equal(un[..., :-64], fp8_fake_quant(kv.bfloat16()[..., :-64], 32))
    assert not torch.equal(un[..., :-64], fp8_fake_quant(kv.bfloat16()[..., :-64], 448))


def test_activation_blocks_of_128(monkeypatch, tiny_dir):
    """kernel.py act_quant with block_size 128 before every FP8 / FP4 GEMM (Linear's forward): a Linear whose
    input no producer quantised (wo_b) runs `act_quant_fp8_gemm`, whose act_quant is per 128 (a block of 64 or
    32 gives other scales on an input whose 128-blocks hold halves 1000x apart)."""
    blocks = _record(monkeypatch, "act_quant")
    assert set(blocks) <= {128, 64}, blocks
    assert _record(monkeypatch, "act_quant_fp8_gemm")  # called (its second argument, the weight, is recorded)
    from deepinfer.ops.reference import act_quant, act_quant_fp8_gemm, fp8_gemm

    x = _q(5, (3, 256)).float()
    w = (_q(6, (128, 256)).float() * 50).to(torch.float8_e4m3fn)
    w_s = torch.ones(1, 2)
    got = act_quant_fp8_gemm(x, w, w_s, torch.float32)
    assert torch.equal(got, fp8_gemm(*act_quant(x, 128), w, w_s, torch.float32))


def test_ue8m0_scales_round_up_to_a_power_of_two():
    """kernel.py act_quant (scale_fmt ue8m0): s = 2^ceil(log2(amax / 448)), amax floored at 1e-4; the codes
    are x / s, so a block whose amax is exactly 448·2^k keeps s = 2^k and its amax codes to 448."""
    x = torch.zeros(4, 128)
    x[0, 0] = 448.0  # amax on a power-of-two boundary: s = 1
    x[1, 0] = 448.0 * 1.001  # just above: s = 2, the code 224.2 -> 224
    x[2, 0] = 3.0
    q, s = act_quant(x, 128)
    assert s[:, 0].tolist() == [1.0, 2.0, 2.0 ** -7, 2.0 ** -22]  # row 3: amax 0 floored at 1e-4
    assert float(q[0, 0].float()) == 448.0 and float(q[1, 0].float()) == 224.0
    assert float(q[2, 0].float()) == 384.0
    assert s.shape == (4, 1)


def test_fp4_scale_is_a_power_of_two_over_6():
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0
    x[0, 1] = 1.0
    y = fp4_fake_quant(x, 32)
    assert float(y[0, 0]) == 6.0 and float(y[0, 1]) == 1.0
    x[0, 0] = 6.5  # scale 2: 1.0 codes to 0.5 -> 0.5 * 2 = 1.0, 6.5 -> 3 * 2 = 6
    y = fp4_fake_quant(x, 32)
    assert float(y[0, 0]) == 6.0 and float(y[0, 1]) == 1.0


def _prefill_records(numerics, ids):
    from deepinfer.capture import capturing
    from deepinfer.engine.loader import load_model

    m = load_model(None, numerics, "bfloat16", "cpu", progress=False).model
    m.allocate(1, 48)
    with capturing() as cap:
        logits, _ = m.prefill(ids)
    return m, dict(cap.records), logits


def test_kv_cache_follows_each_release(monkeypatch, tiny_dir):
    """The one kernel.py hunk between the releases, act_quant_kernel's inplace branch: 60d8d707 (the default)
    casts `T.Cast(compute_dtype, T.Cast(FP8, T.clamp(...)))`, so the window's kv and the compressed entries land
    on the FP8 grid per 64 (our cache holds them in the FP8 layout); efc85512 cast `T.Cast(out_dtype, ...)` with
    `out_dtype = in_dtype` (bf16) for inplace, a no-op (H200: 0 of 28 672 elements changed), so
    `official@efc85512` keeps them as computed in a bf16 cache. Everything else of a CSA layer's first q is
    the same."""
    monkeypatch.delenv("DEEPINFER_KV_QAT", raising=False)
    ids = torch.tensor([[0] + list(range(300, 340))])
    m_cur, rec_cur, logits_cur = _prefill_records("official", ids)
    m_ini, rec_ini, logits_ini = _prefill_records("official@efc85512", ids)
    assert m_cur.numerics.name == "official@60d8d707" and m_ini.numerics.name == "official@efc85512"
    a_cur, a_ini = m_cur.attentions()[1], m_ini.attentions()[1]  # a CSA layer: window kv and entries
    assert a_cur.kv_cache.dtype == torch.uint8 and a_ini.kv_cache.dtype == torch.bfloat16
    assert a_cur.kv_qat and a_cur.compressor.kv_qat and not a_ini.kv_qat and not a_ini.compressor.kv_qat
    for name in ("layers.1.attn.kv", "layers.1.attn.compressed_kv"):
        ini = rec_ini[name].float()[..., :-64]
        assert not torch.equal(fp8_fake_quant(ini, 64), ini), f"{name} is on the FP8 grid under efc85512"
        cur = rec_cur[name].float()[..., :-64]
        assert torch.equal(fp8_fake_quant(cur, 64), cur), f"{name} is off the FP8 grid under 60d8d707"
        rope = rec_cur[name].float()[..., -64:]
        assert not torch.equal(fp8_fake_quant(rope, 64), rope), f"{name}'s RoPE dims must stay bf16"
    assert torch.equal(rec_cur["layers.0.attn.q"], rec_ini["layers.0.attn.q"])  # the first layer's q: untouched
    assert not torch.equal(logits_cur, logits_ini)
    with pytest.raises(ValueError, match="KV QAT"):
        m_ini.set_kv_layout("fp8")


@pytest.mark.parametrize("numerics,clamped", [("official", True), ("official@60d8d707", True),
                                              ("official@efc85512", False), ("exact", True)])
def test_shared_expert_clamp_per_release(tiny_dir, numerics, clamped):
    """The one model.py hunk, MoE.__init__: 60d8d707 builds `Expert(args.dim, args.moe_inter_dim,
    swiglu_limit=args.swiglu_limit)`, efc85512 `Expert(args.dim, args.moe_inter_dim)` after `# no swiglu_limit`
    (Expert.forward clamps only where swiglu_limit > 0: `up` to +-limit, `gate` from above); transformers'
    DeepseekV4MLP clamps it (exact). Checked on what the shared expert computes, with inputs large enough that
    the clamp binds."""
    from deepinfer.engine.loader import load_model
    from deepinfer.ops.reference import swiglu

    lm = load_model(None, numerics, "float32", "cpu", progress=False)
    limit = lm.cfg.swiglu_limit
    assert limit > 0
    sh = lm.model.layers[0].ffn.shared
    x = torch.randn(16, lm.cfg.dim, generator=torch.Generator().manual_seed(5)) * 40
    h1, h3 = sh.w1(x), sh.w3(x)
    assert float(h3.abs().max()) > limit, "the inputs must reach the clamp, or this test could not fail"
    got = sh(x)
    want = {c: sh.w2(swiglu(h1, h3, limit if c else 0.0, out_dtype=x.dtype)) for c in (True, False)}
    assert torch.equal(got, want[clamped]) and not torch.equal(got, want[not clamped])


def test_kv_qat_setting_is_a_deprecated_alias(monkeypatch, tiny_dir, capsys):
    """DEEPINFER_KV_QAT, the former switch, still names the KV form (0: bf16, 1: fp8) with one warning line;
    the model's numerics name the override (`+kv=bf16`), so a dump's fingerprint says what ran."""
    from deepinfer.engine import loader

    monkeypatch.setattr(loader, "_warned_kv_qat", False)
    monkeypatch.setenv("DEEPINFER_KV_QAT", "0")
    num = loader.resolve_numerics("official", "bfloat16")
    assert not num.kv_qat and num.name == "official@60d8d707+kv=bf16"
    assert loader.resolve_numerics("official", "bfloat16").name == num.name
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DEEPINFER_KV_QAT is deprecated" in err[0]
    monkeypatch.setenv("DEEPINFER_KV_QAT", "1")
    assert loader.resolve_numerics("official@efc85512", "bfloat16").name == "official@efc85512+kv=fp8"
    assert loader.resolve_numerics("exact", "float32").name == "exact"  # exact has no KV QAT to switch
    monkeypatch.delenv("DEEPINFER_KV_QAT")
    assert loader.resolve_numerics("official", "bfloat16").kv_qat


def test_indexer_scores_round_as_model_py(tiny_dir):
    """model.py, Indexer.forward: `index_score = torch.einsum("bshd,btd->bsht", q, self.kv_cache[...])` on bf16
    q and keys (bf16 logits), `weights = self.weights_proj(x) * (self.softmax_scale * self.n_heads ** -0.5)`
    (bf16), `index_score = (index_score.relu_() * weights.unsqueeze(-1)).sum(dim=2)` (bf16). The reference's
    rounding="bf16" is those lines on fresh random inputs, and official numerics use it (exact: fp32)."""
    from deepinfer.engine.loader import load_model
    from deepinfer.ops.reference import indexer_scores

    g = torch.Generator().manual_seed(31)
    q = torch.randn(1, 9, 8, 64, generator=g).bfloat16()
    kv = torch.randn(1, 13, 64, generator=g).bfloat16()
    w = torch.randn(1, 9, 8, generator=g).bfloat16()
    scale = 64 ** -0.5 * 8 ** -0.5
    weights = w * scale
    want = (torch.einsum("bshd,btd->bsht", q, kv).relu_() * weights.unsqueeze(-1)).sum(dim=2)
    assert want.dtype == torch.bfloat16
    got = indexer_scores(q, kv, w, w_scale=scale, rounding="bf16")
    assert got.dtype == torch.float32 and torch.equal(got, want.float())
    assert not torch.equal(indexer_scores(q, kv, w, w_scale=scale), want.float())  # fp32 rounds elsewhere
    with pytest.raises(ValueError, match="rounding"):
        indexer_scores(q, kv, w, w_scale=scale, rounding="fp16")
    off = load_model(None, "official", "bfloat16", "cpu", progress=False).model
    ex = load_model(None, "exact", "bfloat16", "cpu", progress=False).model
    assert {a.indexer.rounding for a in off.attentions() if a.indexer} == {"bf16"}
    assert {a.indexer.rounding for a in ex.attentions() if a.indexer} == {"fp32"}


# ------------------------------------------------------------------- the sparse attention
def _kernel_py_sparse_attn(q, kv, sink, idx, scale):
    """kernel.py `sparse_attn_kernel`, one query token at a time, its loop over blocks of 64 slots written
    out: `acc_s` fp32 logits (-inf on empty slots), `scores_max` a running max of the logits alone,
    `acc_s = exp(acc_s - scores_max)`, `sum_exp = sum_exp * scores_scale + reduce_sum(acc_s)` on the fp32
    p, `acc_s_cast` = p in bf16 for `T.gemm(acc_s_cast, kv_shared, acc_o)`, and at the end `sum_exp +=
    exp(attn_sink - scores_max)`, `acc_o /= sum_exp`, bf16 out."""
    B, S, H, D = q.shape
    out = torch.empty_like(q)
    for b in range(B):
        for t in range(S):
            qs = q[b, t].float()
            acc_o = torch.zeros(H, D)
            sum_exp = torch.zeros(H)
            scores_max = torch.full((H,), float("-inf"))
            for k0 in range(0, idx.size(-1), 64):
                ids = idx[b, t, k0:k0 + 64]
                kv_s = torch.where((ids >= 0)[:, None], kv[b, ids.clamp_min(0)].float(), 0.0)
                acc_s = torch.where(ids >= 0, 0.0, float("-inf")).expand(H, -1) + qs @ kv_s.T
                acc_s = acc_s * scale
                prev = scores_max
                scores_max = torch.maximum(prev, acc_s.amax(-1))
                scores_scale = torch.exp(prev - scores_max)
                acc_s = torch.exp(acc_s - scores_max[:, None])
                sum_exp = sum_exp * scores_scale + acc_s.sum(-1)
                acc_o = acc_o * scores_scale[:, None] + acc_s.bfloat16().float() @ kv_s
            sum_exp = sum_exp + torch.exp(sink - scores_max)
            out[b, t] = (acc_o / sum_exp[:, None]).to(q.dtype)
    return out


def _attn_case(seed, S=6, H=8, D=64, N=300, K=200):
    """Logits of spread ~4 so that the running max grows from block to block; slots in a random order with
    empties; sinks of the logits' size and more."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, S, H, D, generator=g) * 2).bfloat16()
    kv = torch.randn(2, N, D, generator=g).bfloat16()
    idx = torch.randint(0, N, (2, S, K), generator=g)
    idx[torch.rand(2, S, K, generator=g) < 0.2] = -1
    sink = torch.randn(H, generator=g) * 3 + 4  # above the max logit in some heads: where the max starts matters
    return q, kv, sink, idx, D ** -0.5


def test_sparse_attn_rounds_like_kernel_py():
    """The reference's probabilities round where kernel.py's do: its output is the loop above's to fp32
    summation order (bf16 out: a few 1-ulp elements); P unrounded, or the max seeded with the sink, or
    blocks of 32, round elsewhere and differ in many more."""
    from deepinfer.ops import reference

    q, kv, sink, idx, scale = _attn_case(0)
    want = _kernel_py_sparse_attn(q, kv, sink, idx, scale)
    got = sparse_attn(q, kv, sink, idx, scale)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    ulp = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert ulp.max() <= 2 ** -7 and (got != want).float().mean() < 0.01
    fp32_p = sparse_attn(q.float(), kv.float(), sink, idx, scale).bfloat16()  # no cast of P
    assert (fp32_p != want).float().mean() > 3 * (got != want).float().mean() + 0.01
    old = reference.SPARSE_ATTN_BLOCK
    try:
        reference.SPARSE_ATTN_BLOCK = 32
        b32 = sparse_attn(q, kv, sink, idx, scale)
    finally:
        reference.SPARSE_ATTN_BLOCK = old
    assert (b32 != want).float().mean() > 2 * (got != want).float().mean()


def test_sparse_attn_empty_slots_and_float32():
    """A query with no valid slot gets 0 (kernel.py's loop makes NaN of it, exp(-inf - -inf), as of any
    query whose first 64 slots are empty; model.py's slot order never makes one: its window comes first); in
    float32 the rounding points vanish and the result is softmax(logits ++ sink) V."""
    q, kv, sink, idx, scale = _attn_case(1, K=130)
    idx[0, 2] = -1
    idx[1, 3, :64] = -1  # a whole first block empty (kernel.py: NaN); here the blocks after it count alone
    got = sparse_attn(q, kv, sink, idx, scale)
    assert torch.isfinite(got).all() and torch.all(got[0, 2] == 0)
    want = _kernel_py_sparse_attn(q, kv, sink, idx[..., 64:], scale)
    assert torch.allclose(got[1, 3].float(), want[1, 3].float(), rtol=2 ** -7, atol=1e-6)
    qf, kvf = q.float(), kv.float()
    g = kvf[torch.arange(2)[:, None, None], idx.clamp_min(0)]  # [B, S, K, D]
    logits = torch.einsum("bshd,bskd->bshk", qf, g) * scale
    logits = logits.masked_fill((idx < 0).unsqueeze(2), float("-inf"))
    full = torch.cat([logits, sink.view(1, 1, -1, 1).expand(2, q.size(1), -1, 1)], -1).softmax(-1)
    plain = torch.einsum("bshk,bskd->bshd", full[..., :-1], g)
    assert torch.allclose(sparse_attn(qf, kvf, sink, idx, scale), plain, rtol=1e-5, atol=1e-6)


def _window_topk_idxs(win, start_pos):
    """model.py `get_window_topk_idxs(window_size, 1, 1, start_pos)` for one decode step."""
    if start_pos >= win - 1:
        s = start_pos % win
        return torch.cat([torch.arange(s + 1, win), torch.arange(0, s + 1)])
    return torch.nn.functional.pad(torch.arange(start_pos + 1), (0, win - start_pos - 1), value=-1)


@pytest.mark.parametrize("win", [8, 128])
def test_decode_window_slots_oldest_first(win):
    """Decode attends the ring in model.py's order, oldest position first: the order the blocks of 64 are
    taken in, so where the probabilities round (ring-slot order would pass every set-based check)."""
    pos = torch.tensor([0, 1, win - 2, win - 1, win, win + 5, 3 * win + 7])
    rows = torch.arange(pos.numel())
    got = decode_slots(pos, rows, win, win + 4)[0]
    for i, p in enumerate(pos.tolist()):
        want = _window_topk_idxs(win, p)
        assert torch.equal(got[i], torch.where(want >= 0, want + i * (win + 4), -1)), p


# --------------------------------------------------------------------- the FP8 KV entry layout
def test_fp8_kv_entry_layout_width():
    """The FP8 KV cache entry of V4 (head_dim 512, rope 64): 448 e4m3 codes, 7 ue8m0 scales (one per 64)
    zero-padded to 16 bytes, then the 64 RoPE dims in bf16: 448 + 16 + 128 = 592 bytes per token."""
    assert kv_packed_width(512, 64, torch.bfloat16) == 592
    kv = _q(5, (3, 512))
    p = kv_pack(kv, 64)
    assert p.shape == (3, 592) and p.dtype == torch.uint8
    assert torch.all(p[:, 448 + 7:448 + 16] == 0), "the scale padding bytes are zero"
    assert torch.equal(p[:, 464:].view(torch.bfloat16), kv[:, -64:])


@pytest.mark.gpu
def test_triton_head_norm_forms_on_gpu():
    """The Triton q head norm in each form against the reference's (on the H200 2026-12-01 `ab` found them
    equal but for a few 1-ulp elements); the official form must not be the module's."""
    import deepinfer_kernels.triton.norm as tn

    q = _q(6, (4, 16, 8, 512)).cuda()
    cos = torch.rand(4, 16, 32, device="cuda")
    sin = (1 - cos ** 2).sqrt()
    for form in ("official_q", "transformers_q"):
        r = rms_norm_rope(q, None, 1e-6, cos, sin, 64, form=form)
        t = tn.rms_norm_rope(q, None, 1e-6, cos, sin, 64, form=form)
        assert (r != t).float().mean() < 0.01, form
    official = tn.rms_norm_rope(q, None, 1e-6, cos, sin, 64, form="official_q")
    module = rms_norm_rope(q, None, 1e-6, cos, sin, 64)
    assert (official != module).float().mean() > 0.05


@pytest.mark.gpu
def test_triton_sparse_attn_rounds_like_kernel_py():
    """The Triton kernel in bf16 on tensor cores against kernel.py's loop, prefill-sized (one program walks
    all of a token's slots): closer than the unrounded-P form. Its tiles are 32 slots, not 64, so the
    running max can differ inside a block. Decode-sized calls split the slots over programs, each with a
    running max of its own: p rounds against that, so they are held to the op's tolerance only."""
    import deepinfer_kernels.triton.attention as ta

    def frac(a, b):
        return float((a != b).float().mean())

    q, kv, sink, idx, scale = _attn_case(2, S=300, H=64, D=512, N=700, K=256)
    want = _kernel_py_sparse_attn(q, kv, sink, idx, scale)
    got = ta.sparse_attn(q.cuda(), kv.cuda(), sink.cuda(), idx.cuda(), scale).cpu()
    fp32_p = sparse_attn(q.float(), kv.float(), sink, idx, scale).bfloat16()
    assert torch.isfinite(got).all()
    assert frac(got, want) < 0.5 * frac(fp32_p, want), (frac(got, want), frac(fp32_p, want))
