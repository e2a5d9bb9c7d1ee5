"""MTP speculative decoding (issue 26): the verify step's state rollback, greedy equality with plain decoding,
the rejection sampler's distribution, and bad input.

The oracles: (1) every cache tensor after verify + commit equals the caches of decode steps over exactly the
kept tokens (a verify that left a rejected token's trace -- a ring slot, a compressor's partial window or
overlap half, a compressed entry, an indexer key -- differs by O(1)); (2) greedy `--speculate K` gives plain
greedy decoding's tokens, in exact numerics / float32 on the CPU; (3) the emitted tokens of the rejection
sampler follow the target distribution (chi-square over many seeds), and the test's bound rejects a sampler
whose residual draw is wrong.

deepinfer-tiny: window 8, CSA ratio 4 (layers 1 and 3, with the indexer), HCA ratio 16 (layer 2), MTP SWA.
Random weights: the MTP block's drafts are almost never the target's argmax, so the generate tests also run
an oracle drafter (the plain run's tokens, every few positions deliberately wrong) to exercise acceptance.
"""

import math

import pytest
import torch

from deepinfer.engine.generate import SamplingParams, generate
from deepinfer.engine.loader import load_model
from deepinfer.engine.speculative import SpecScheduler, SpecStep, check_speculate
from deepinfer.engine.steps import steps_of
from deepinfer.model.spec_verify import Snapshot
from deepinfer.ops import ops
from deepinfer.ops.registry import REGISTRY

PROMPTS = [
    [0, 6127, 389],
    [0, 17607, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [0, 5],
    [0, 99, 4321, 777, 5, 6, 7, 8, 9],
    [0, 1234, 31, 32, 33, 34],
]
# fp32: the verify's GEMMs and reductions run over B x S rows, decode's over B, by kernels that differ with the row
# count (a few ulp a layer), through up to four layers: relative to the cache tensor's largest magnitude. Measured
# 4e-6 absolute on one CPU; 3.0e-5 against a magnitude of 4.05 (7.4e-6 relative) on a 2-core Xeon with AMX
# (2026-12-03). A cache bug (a slot not written, a stale carry) is off by the values themselves.
CACHE_RTOL = 2e-5


@pytest.fixture(scope="module")
def lm():
    # the CPU on every host: exact numerics in float32 there is the oracle (the GPU tests are below)
    return load_model(None, numerics="exact", dtype="float32", device="cpu", progress=False)


def _live(model, rows):
    """The rows' cache tensors, FP8-layout ones (uint8) as the values they hold: compared by value, since a
    1-ulp difference in a bf16 RoPE dim shows as a difference of up to 255 in a byte."""
    hd, rd = model.cfg.head_dim, model.cfg.rope_head_dim
    dt = model.numerics.dtype  # the rope part's storage dtype (bf16 on the GPU test, float32 on the CPU one)
    return [ops.kv_unpack(t[rows], hd, rd, dt).float() if t.dtype == torch.uint8 else t[rows].clone()
            for t in model.cache_tensors()]


def _assert_caches(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(torch.isfinite(x), torch.isfinite(y)), f"{what}: cache tensor {i}: empty slots differ"
        f = torch.isfinite(y)
        err = (x - y).abs()[f].max().item() if f.any() else 0.0
        tol = CACHE_RTOL * (y[f].abs().max().item() if f.any() else 0.0)
        assert err <= tol, f"{what}: cache tensor {i} {tuple(y.shape)} off by {err} (bound {tol:.3g})"


# ------------------------------------------------------------------------------------ state rollback
KEEPS = [[2, 4], [1, 3], [4, 1], [3, 2], [2, 2], [1, 4], [4, 4], [3, 1], [1, 1], [4, 2]]  # n_keep per step, S = 4


def _verify_commit_then_decode(m, dev, logits_atol: float):
    """Ten verify steps of 4 tokens on two rows (prompts of 13 and 6 tokens), keeping 1-4 tokens per row and
    step (KEEPS): to position 40 / 30, across the window's wrap (8), CSA's blocks (4) and two HCA entries (16);
    the dropped tokens are arbitrary ids. Then the same caches rebuilt by decode steps over the kept tokens
    only. -> (the rows' cache tensors after verify + commit, the same after decode, [(row, kept token, max
    |decode logits - verify logits|)] where that exceeds `logits_atol`)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (13,), generator=g).tolist(), torch.randint(1, 1000, (6,), generator=g).tolist()]
    cont = [torch.randint(1, 1000, (40,), generator=g).tolist() for _ in prompts]
    t = lambda x: torch.tensor(x, device=dev)  # noqa: E731

    def setup():
        m.allocate(3, 64)  # rows 0, 1 live, row 2 the spare
        for i, p in enumerate(prompts):
            m.prefill(t([p]), rows=t([i]))

    S = 4
    setup()
    pos, used, vlogits = [len(p) for p in prompts], [0, 0], [[], []]
    for step in KEEPS:
        ids = t([[cont[b][used[b] + i] if i < step[b] else 900 + 7 * i + b for i in range(S)] for b in range(2)])
        logits, _, ctx = m.verify(ids, t(pos), torch.arange(2, device=dev))
        m.commit(ctx, t(step))
        for b in range(2):
            vlogits[b] += list(logits[b, :step[b]])
            pos[b] += step[b]
            used[b] += step[b]
    assert min(pos) >= 16 + 8 and max(pos) >= 32
    spec = _live(m, [0, 1])
    setup()
    pos = [len(p) for p in prompts]
    off = []
    for b in range(2):
        for i in range(used[b]):
            lg = m.decode(t([[cont[b][i]]]), t([pos[b]]), rows=t([b]))
            err = (lg[0, -1].float() - vlogits[b][i].float()).abs().max().item()
            if not err <= logits_atol:  # NaN included
                off.append((b, i, err))
            pos[b] += 1
    return spec, _live(m, [0, 1]), off


@pytest.mark.slow
@pytest.mark.parametrize("form", ["exact", "official-fp8-kv"])
def test_verify_commit_caches_equal_decode_of_kept_tokens(lm, form):
    """Every cache tensor after verify + commit equals decode over the kept tokens only, and the verify's logits
    at the kept positions equal decode's. Exact numerics, and official numerics with the KV QAT (the FP8 cache
    layout, packed on the way in), both float32."""
    if form == "exact":
        m = lm.model
    else:
        m = load_model(None, numerics="official", dtype="float32", device="cpu", progress=False).model
        assert m.numerics.kv_qat  # release 60d8d707's KV QAT: the FP8 cache layout
    spec, dec, off = _verify_commit_then_decode(m, "cpu", 1e-4)
    assert not off, off
    _assert_caches(spec, dec, "verify + commit vs decode")


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_gpu_verify_commit_caches_equal_decode_bf16():
    """The same on the H200 in official numerics, bf16, the Triton backend: bit for bit (the Triton kernels give a
    row the same bits whatever the batch's row count), every cache tensor that differs named with its error."""
    ops.configure("triton", strict=True)
    m = load_model(None, numerics="official", dtype="bfloat16", device="cuda", progress=False).model
    spec, dec, off = _verify_commit_then_decode(m, "cuda", 0.0)
    names = [n for n, _ in m.named_cache_tensors()]  # the order of _live's cache_tensors()
    assert len(names) == len(spec)
    bad = []
    for i, (x, y) in enumerate(zip(spec, dec)):
        same = torch.equal(torch.isfinite(x), torch.isfinite(y)) and torch.equal(x.nan_to_num(), y.nan_to_num())
        if not same:
            f = torch.isfinite(y) & torch.isfinite(x)
            err = (x.float() - y.float()).abs()[f].max().item() if f.any() else float("nan")
            bad.append(f"{names[i]} {tuple(y.shape)}: {err:.3g}")
    assert not bad, bad
    assert not off, off  # (row, kept token, logits error) where decode's logits are not verify's bits


@pytest.mark.slow
def test_mtp_verify_commit_and_snapshot(lm):
    """The MTP block's cache: mtp_verify + commit of kept prefixes equals the MTP prefill over the kept
    positions (chunk by chunk), and a Snapshot restores what a commit of draft positions changed."""
    m = lm.model
    g = torch.Generator().manual_seed(1)
    n0, total = 5, 23
    ids = torch.randint(1, 1000, (1, total + 1), generator=g)
    m.allocate(2, 64)
    _, h = m.prefill(ids[:, :total], rows=torch.tensor([0]), all_logits=True)
    attn = m.mtp[0].block.attn
    m.mtp_prefill(h[:, :n0], ids[:, 1:n0 + 1], rows=torch.tensor([0]))
    p = n0
    for keep in [2, 3, 1, 4, 4, 2, 2]:
        S = 4
        nxt = ids[:, p + 1:p + 1 + S].clone()
        nxt[:, keep:] = 777  # the dropped positions' inputs are arbitrary
        hs = h[:, p:p + S]
        if hs.size(1) < S:
            break
        before = attn.kv_cache[0].clone()
        snap = Snapshot(attn, torch.tensor([0]), torch.tensor([p]), S)
        _, _, ctx = m.mtp_verify(hs, nxt, torch.tensor([p]), torch.tensor([0]))
        m.commit(ctx, torch.tensor([S]))
        snap.restore()
        assert torch.equal(attn.kv_cache[0], before)
        _, _, ctx = m.mtp_verify(hs, nxt, torch.tensor([p]), torch.tensor([0]))
        m.commit(ctx, torch.tensor([keep]))
        p += keep
    spec = attn.kv_cache[0].clone()
    m.allocate(2, 64)
    m.prefill(ids[:, :total], rows=torch.tensor([0]))
    m.mtp_prefill(h[:, :n0], ids[:, 1:n0 + 1], rows=torch.tensor([0]))
    m.mtp_prefill(h[:, n0:p], ids[:, n0 + 1:p + 1], rows=torch.tensor([0]), start=n0)
    ref = attn.kv_cache[0]
    assert p > 8 + n0  # the ring wrapped
    assert (spec - ref).abs().max().item() <= CACHE_RTOL * ref.abs().max().item()


# ------------------------------------------------------------------------------------ greedy equality
def _oracle(monkeypatch, ref_completions, prompts, wrong=0.3):
    """Replace the drafter by the plain run's tokens, each wrong with probability `wrong` (a fixed random
    pattern per request: a periodic one would line up with the steps and only ever reject the same slot),
    with a one-hot q: acceptance runs of every length, rejections in between. The tokens sit in a device table
    [row, position] filled when a request takes its slot, so the drafter reads no host data (CUDA graphs
    capture it)."""
    orig_first = SpecScheduler._first
    tables = {}

    def table(m):  # one per allocation: a captured graph reads the same tensor at every replay
        t = tables.get(id(m))
        if t is None or t.shape != (m.rows, m.max_seq_len + 8):
            t = tables[id(m)] = torch.zeros(m.rows, m.max_seq_len + 8, dtype=torch.long, device=m.device)
        return t

    def first(self, req, tok):
        t = table(self.model)
        i, n = req.index, len(prompts[req.index])
        row = torch.zeros(t.size(1), dtype=torch.long)
        bad = torch.rand(len(ref_completions[i].token_ids), generator=torch.Generator().manual_seed(i)) < wrong
        for j, x in enumerate(ref_completions[i].token_ids):
            row[n + j] = (x + 1) % 1000 if bad[j] else x
        with torch.inference_mode():  # the table may be born inside the runner's inference mode (graph capture)
            t[req.slot].copy_(row)
        return orig_first(self, req, tok)

    def draft(self, logits, temp, top_k, top_p, seeds, pos, rows):
        t = table(self.model)
        d = t[rows, pos.clamp(max=t.size(1) - 1)]
        return torch.zeros_like(logits).scatter_(1, d.unsqueeze(1), 1.0), d

    monkeypatch.setattr(SpecScheduler, "_first", first)
    monkeypatch.setattr(SpecStep, "draft", draft)


GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(lm):
    """Plain greedy decoding of PROMPTS in 3 slots: the oracle."""
    return generate(lm.model, PROMPTS, GREEDY, eos_id=1, max_batch=3)


@pytest.mark.slow
def test_spec_step_mtp_state_matches_prefill(lm, plain):
    """SpecStep driven directly (K = 3, two rows, an oracle drafter: runs of 0-3 accepted drafts) until both rows
    are 16 tokens in: its tokens are plain greedy decoding's, and the MTP block's cache and the first-draft
    logits it carries equal an MTP prefill over the same kept sequence (the draft chain's writes rolled back,
    the catch-up fed the accepted tokens and the new one)."""
    m, K = lm.model, 3
    idx = [1, 3]
    prompts = [PROMPTS[i] for i in idx]
    ref = [prompts[b] + plain.completions[i].token_ids for b, i in enumerate(idx)]
    m.allocate(3, 64)
    rows = torch.arange(2)
    tok, mlg, mh = [], [], []
    for b, pr in enumerate(prompts):
        logits, h = m.prefill(torch.tensor([pr]), rows=rows[b:b + 1])
        t = logits[0, -1].argmax().view(1, 1)
        lg, out = m.mtp_prefill(h, torch.cat([torch.tensor([pr[1:]]), t], 1), rows=rows[b:b + 1], with_streams=True)
        tok.append(t.view(1))
        mlg.append(lg[0, -1])
        mh.append(out[0, -1])
    tok, mlg, mh = torch.cat(tok), torch.stack(mlg), torch.stack(mh)
    table = torch.zeros(2, 64, dtype=torch.long)
    wrong = torch.rand(2, 64, generator=torch.Generator().manual_seed(3)) < 0.35
    for b in range(2):
        for j, x in enumerate(ref[b]):
            table[b, j] = (x + 1) % 1000 if wrong[b, j] else x  # the target's tokens, a third of them wrong
    step = SpecStep(m, K, 2)
    step.draft = lambda lg, temp, top_k, top_p, seeds, pos, rows: (
        torch.zeros_like(lg).scatter_(1, table[rows, pos].unsqueeze(1), 1.0), table[rows, pos])
    pos = torch.tensor([len(p) for p in prompts])
    z, accepted, hist = torch.zeros(2, dtype=torch.long), 0, []
    while int(pos[1]) < len(prompts[1]) + 16 and int(pos[0]) < len(prompts[0]) + 19:  # the plain run has 24
        n_acc, nxt, drafts, _, mlg, mh = step(tok, pos, rows, mlg, mh, torch.zeros(2), z, torch.ones(2), z)
        for b in range(2):
            new = drafts[b, :n_acc[b]].tolist() + [int(nxt[b])]
            p0 = int(pos[b]) + 1
            assert new == ref[b][p0:p0 + len(new)], b
        accepted += int(n_acc.sum())
        hist.append(n_acc.tolist())
        pos, tok = pos + n_acc + 1, nxt
    # every run length, and a rejection in the last step
    assert {n for h in hist for n in h} == {0, 1, 2, 3} and hist[-1] != [K, K], hist
    attn = m.mtp[0].block.attn
    spec_ring = attn.kv_cache[:2].clone()
    m.allocate(3, 64)
    for b in range(2):
        p = int(pos[b])
        seq = torch.tensor([ref[b][:p + 1]])
        _, h = m.prefill(seq[:, :p], rows=rows[b:b + 1])
        lg = m.mtp_prefill(h, seq[:, 1:], rows=rows[b:b + 1])
        assert torch.allclose(mlg[b], lg[0, -1], atol=1e-3), b
        assert (spec_ring[b] - attn.kv_cache[b]).abs().max().item() < 1e-4, b


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_plain_decoding(lm, plain, monkeypatch, k):
    """Greedy --speculate K: the tokens (and logprobs) of plain greedy decoding, 5 prompts of different lengths
    in 3 slots (continuous batching), 24 tokens each (to position 40: across CSA / HCA blocks and the window),
    with the MTP block's own drafts and with an oracle drafter (acceptance runs of every length 0 .. K,
    rejections, rows finishing inside a run: max_new_tokens, EOS)."""
    m = lm.model
    out = generate(m, PROMPTS, GREEDY, eos_id=1, max_batch=3, speculate=k)
    for a, b in zip(plain.completions, out.completions):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert b.spec_drafted == k * b.spec_steps
    _oracle(monkeypatch, plain.completions, PROMPTS)
    out = generate(m, PROMPTS, GREEDY, eos_id=1, max_batch=3, speculate=k)
    acc = drafted = 0
    for a, b in zip(plain.completions, out.completions):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
        s = b.speculation()
        acc, drafted = acc + s["accepted"], drafted + s["drafted"]
        assert 1 <= s["mean_accepted_length"] <= k + 1
    assert 0.3 * drafted < acc < drafted  # acceptance and rejections
    # EOS inside an accepted run: the first prompt's 9th token ends every prompt that emits it
    eos = plain.completions[0].token_ids[8]
    sp_eos = SamplingParams(max_new_tokens=24)
    a = generate(m, PROMPTS, sp_eos, eos_id=eos, max_batch=3).completions
    b = generate(m, PROMPTS, sp_eos, eos_id=eos, max_batch=3, speculate=k).completions
    assert a[0].finish_reason == "eos"
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason


@pytest.mark.slow
def test_stop_string_inside_accepted_run(lm, plain, monkeypatch):
    """A stop string that completes inside an accepted run stops there, as in plain decoding."""
    m = lm.model
    _oracle(monkeypatch, plain.completions, PROMPTS, wrong=0.15)
    text = lambda ids: " ".join(map(str, ids))  # noqa: E731
    stop = SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(str(plain.completions[0].token_ids[9]),))
    a = generate(m, PROMPTS, stop, eos_id=1, decode_text=text, max_batch=3)
    b = generate(m, PROMPTS, stop, eos_id=1, decode_text=text, max_batch=3, speculate=3)
    assert a.completions[0].finish_reason == "stop"
    for x, y in zip(a.completions, b.completions):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason


@pytest.mark.slow
def test_chunked_prefill(lm, plain):
    """A prompt prefilled in chunks of 4 feeds the MTP block chunk by chunk (its last position once the first
    token is sampled): the same first-draft logits and MTP cache as the whole prompt; generation with chunks
    gives plain decoding's tokens."""
    from deepinfer.engine.generate import Completion
    from deepinfer.engine.scheduler import Request

    m = lm.model
    pr = torch.tensor([PROMPTS[1]])
    m.allocate(2, 64)
    _, h = m.prefill(pr, rows=torch.tensor([0]))
    ref = m.mtp_prefill(h, torch.cat([pr[:, 1:], torch.tensor([[77]])], 1), rows=torch.tensor([0]))[0, -1]
    ref_ring = m.mtp[0].block.attn.kv_cache[0].clone()
    got = []
    for chunk in (0, 4):
        m.allocate(2, 64)
        sch = SpecScheduler(m, SpecStep(m, 2, 1), 1, lambda *a: None, lambda *a: False, prefill_chunk=chunk)
        req = Request(0, PROMPTS[1], SamplingParams(max_new_tokens=4), Completion(PROMPTS[1]))
        sch.submit(req)
        while not sch._admit():
            pass
        sch._first(req, 77)
        got.append((req.mtp_logits.clone(), m.mtp[0].block.attn.kv_cache[0].clone()))
    for lg, ring in got:
        assert torch.allclose(lg, ref, atol=1e-4) and torch.allclose(ring, ref_ring, atol=1e-5)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    chunked = generate(m, PROMPTS, sp, eos_id=1, max_batch=3, speculate=2, prefill_chunk=4).completions
    for a, b in zip(plain.completions, chunked):
        assert a.token_ids[:10] == b.token_ids


@pytest.mark.slow
def test_sampled_same_seed_same_tokens(lm):
    """Sampled rows: the same seed (and place in the list: `Request.seed`) gives the same tokens, in another
    batch too; another seed other tokens."""
    m = lm.model
    sp = [SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, seed=s) for s in (3, 4)]
    a = generate(m, [PROMPTS[0], PROMPTS[0]], sp, eos_id=1, speculate=2).completions
    b = generate(m, [PROMPTS[0], PROMPTS[1]], [sp[0], sp[0]], eos_id=1, speculate=2).completions
    c = generate(m, [PROMPTS[0]], sp[:1], eos_id=1, speculate=2, max_batch=1).completions
    assert a[0].token_ids == b[0].token_ids == c[0].token_ids
    assert a[1].token_ids != a[0].token_ids


# ------------------------------------------------------------------------------------ rejection sampler
CHI2_BOUND = 30.0  # df = 5: P(chi2 > 30) = 1.5e-5 for a correct sampler


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def _synthetic(seed=0, V=6, K=2):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=g) ** 2 + 0.02
    q = torch.rand(K, V, generator=g) ** 2 + 0.02
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _run_sampler(fn, p, q, N=20000):
    """N rows (seeds 0 .. N-1): drafts from q with `sample`'s Gumbel-max (their own noise), then fn ->
    (the first emitted token's counts, the second's among rows that accepted the first draft)."""
    K, V = q.shape
    dev = p.device
    seeds = torch.arange(N, device=dev)
    pos = torch.full((N,), 40, device=dev)
    draw = REGISTRY["sample"].ref
    drafts = torch.stack([draw(q[j].log().expand(N, V), torch.ones(N, device=dev), torch.zeros(N, dtype=torch.long,
                               device=dev), torch.ones(N, device=dev), seeds + 12345, pos + j) for j in range(K)], 1)
    n, tok = fn(p.expand(N, K + 1, V).contiguous(), q.expand(N, K, V).contiguous(), drafts, seeds, pos)
    first = torch.where(n > 0, drafts[:, 0], tok)
    second = torch.where(n > 1, drafts[:, 1], tok)[n >= 1]
    return (torch.bincount(first, minlength=V).float().cpu(), torch.bincount(second, minlength=V).float().cpu())


def _wrong_residual(p, q, drafts, seeds, positions):
    """The rejection sampler with a wrong draw after a rejection: from p_n instead of max(0, p_n - q_n)."""
    n, _ = REGISTRY["spec_verify"].ref(p, q, drafts, seeds, positions)
    u = torch.rand(p.size(0), p.size(-1), generator=torch.Generator().manual_seed(5)).clamp_min(1e-12)
    tok = (p[torch.arange(p.size(0)), n].log() - torch.log(-torch.log(u))).argmax(-1)
    return n, tok


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.gpu)])
def test_rejection_sampler_preserves_the_target(backend):
    """The first emitted token ~ p_0 and the second (given the first draft accepted) ~ p_1, chi-square over 20000
    seeds at three synthetic (p, q); the same bound rejects the wrong residual draw. The Triton kernel on a GPU
    (the CPU interpreter runs 20000 programs one by one; there `test_triton_spec_ops_match_reference` checks it
    token for token against the reference)."""
    if backend == "triton":
        pytest.importorskip("triton")
        if "triton" not in REGISTRY["spec_verify"].impls:
            import deepinfer_kernels.triton  # noqa: F401
        fn = REGISTRY["spec_verify"].impls["triton"]
    else:
        fn = REGISTRY["spec_verify"].ref
    dev = "cuda" if backend == "triton" else "cpu"
    for seed in range(3):
        p, q = (t.to(dev) for t in _synthetic(seed))
        c1, c2 = _run_sampler(fn, p, q)
        assert _chi2(c1, p[0].cpu()) < CHI2_BOUND, (seed, c1, p[0])
        assert _chi2(c2, p[1].cpu()) < CHI2_BOUND, (seed, c2, p[1])
        if backend == "torch":
            w1, _ = _run_sampler(_wrong_residual, p, q)
            assert _chi2(w1, p[0]) > CHI2_BOUND


def test_triton_spec_ops_match_reference():
    """The Triton kernels (interpreted on the CPU) against the reference: spec_probs with greedy (a tie),
    temperature, top-k and top-p rows; spec_verify with acceptance runs of every length and rejections."""
    pytest.importorskip("triton")
    import os

    import deepinfer_kernels.triton  # noqa: F401

    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not interpreted and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dev = "cpu" if interpreted else "cuda"
    g = torch.Generator().manual_seed(0)
    B, V, K = 6, 300, 3
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, 5] = logits[0, 7] = logits[0].max() + 1
    args = (logits, torch.tensor([0.0, 0.7, 1.0, 1.3, 1.0, 0.5]), torch.tensor([0, 50, 0, 100, 1, 0]),
            torch.tensor([1.0, 1.0, 0.9, 0.95, 1.0, 0.3]))
    args = tuple(t.to(dev) for t in args)
    a, b = REGISTRY["spec_probs"].impls["triton"](*args), REGISTRY["spec_probs"].ref(*args)
    assert torch.equal(a > 0, b > 0) and torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert a[0, 5] == 1.0
    p = (torch.randn(B, K + 1, V, generator=g) * 4).softmax(-1)
    q = (torch.randn(B, K, V, generator=g) * 4).softmax(-1)
    d = torch.randint(0, V, (B, K), generator=g)
    for i in range(B):  # row i: the first i % (K + 1) drafts are the target's argmax
        d[i, :i % (K + 1)] = p[i, :i % (K + 1)].argmax(-1)
    p, q, d = p.to(dev), q.to(dev), d.to(dev)
    for s in range(4):
        seeds, pos = (torch.arange(B) * 7 + s).to(dev), (torch.arange(B) * 3).to(dev)
        n1, t1 = REGISTRY["spec_verify"].impls["triton"](p, q, d, seeds, pos)
        n2, t2 = REGISTRY["spec_verify"].ref(p, q, d, seeds, pos)
        assert n1.tolist() == n2.tolist() and t1.tolist() == t2.tolist()


def test_spec_probs_matches_sample():
    """spec_probs is the distribution `sample` draws from: sample's token is in its support, greedy rows one-hot."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g) * 3
    temp, top_k = torch.tensor([0.0, 1.0, 0.7, 1.3]), torch.tensor([0, 0, 5, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8])
    pr = REGISTRY["spec_probs"].ref(logits, temp, top_k, top_p)
    assert torch.allclose(pr.sum(-1), torch.ones(4))
    assert pr[0, logits[0].argmax()] == 1.0
    assert int((pr[2] > 0).sum()) == 5
    for s in range(50):
        tok = ops.sample(logits, temp, top_k, top_p, torch.full((4,), s), torch.zeros(4, dtype=torch.long))
        assert bool((pr[torch.arange(4), tok] > 0).all())


def test_spec_verify_greedy_is_argmax():
    """One-hot p and q: accepted while the draft is the target's argmax, then the target's argmax."""
    V = 10
    tgt = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [1, 4, 5]])
    p = torch.nn.functional.one_hot(tgt, V).float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    n, tok = REGISTRY["spec_verify"].ref(p, q, drafts, torch.arange(3), torch.zeros(3, dtype=torch.long))
    assert n.tolist() == [3, 1, 0] and tok.tolist() == [6, 4, 3]


# ------------------------------------------------------------------------------------ bad input
def test_check_speculate(lm):
    m = lm.model
    for k in (0, -1, m.cfg.window_size):
        with pytest.raises(ValueError, match="--speculate"):
            check_speculate(m, k)
    check_speculate(m, m.cfg.window_size - 1)
    mtp, m.mtp = m.mtp, []
    try:
        with pytest.raises(ValueError, match="no MTP block"):
            check_speculate(m, 1)
    finally:
        m.mtp = mtp


# ------------------------------------------------------------------------------------ GPU (H200)
LENS = [9, 3, 6, 12, 5]  # rows finish at different steps: the batch walks through the buckets


@pytest.mark.gpu
@pytest.mark.parametrize("numerics,dtype", [("exact", "float32"), ("official", "bfloat16")])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gpu_speculate_with_graphs(numerics, dtype, k, monkeypatch):
    """Triton backend, CUDA graphs per bucket, with the MTP block's drafts and with the oracle drafter
    (acceptance runs): the speculative step's replay equals the same step run eagerly in the same padded
    buckets (tokens and logprobs), and its greedy tokens equal plain greedy decoding's (graphs), in batches of
    3 slots and, bf16, in one slot too.

    In bf16 this needs every kernel of the step to give a token the same bits whether it is alone (a decode
    step at batch 1), one of B rows, or one of B x (K + 1) verify tokens: up to 16 rows the Triton GEMMs keep one
    tile shape, and the mHC mix one split (`deepinfer_kernels/triton/mhc.py`); here 3 x 4 = 12 rows at most."""
    ops.configure("triton", strict=True)
    lm = load_model(None, numerics=numerics, dtype=dtype, device="cuda", progress=False)
    plist = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in [24] * 5]
    plain = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=1, graphs=True).completions
    plain3 = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=3, graphs=True).completions
    assert [c.token_ids for c in plain3] == [c.token_ids for c in plain]

    for oracle in (False, True):
        if oracle:
            _oracle(monkeypatch, plain, PROMPTS)
            steps_of(lm.model).pop("speculative", None)  # its graphs hold the drafter they were captured with
        for slots in ((1, 3) if dtype == "bfloat16" else (3,)):
            g = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=slots, graphs=True, speculate=k).completions
            e = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=slots, pad_to_buckets=True,
                         speculate=k).completions
            for i, (a, b) in enumerate(zip(g, e)):
                assert a.token_ids == b.token_ids, ("replay vs eager", oracle, slots, i)
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5, ("replay vs eager", oracle,
                                                                                         slots, i)
            assert [c.token_ids for c in g] == [c.token_ids for c in plain], (oracle, k, slots)
            if oracle:
                assert sum(c.spec_accepted for c in g) > 0
            steps_of(lm.model).pop("speculative", None)


@pytest.mark.gpu
@pytest.mark.parametrize("S", [2, 3, 4])
def test_gpu_verify_logits_equal_decode_bf16(S):
    """Official numerics, bf16, Triton, one row: the verify step's logits at its S positions are bit for bit
    the logits of S decode steps over the same tokens (the same kernels on the same row: the premise of the
    one-slot greedy equality above)."""
    ops.configure("triton", strict=True)
    m = load_model(None, numerics="official", dtype="bfloat16", device="cuda", progress=False).model
    g = torch.Generator().manual_seed(S)
    prompt = torch.randint(1, 1000, (1, 11), generator=g).cuda()
    toks = torch.randint(1, 1000, (1, S), generator=g).cuda()
    row = torch.tensor([0], device="cuda")
    m.allocate(2, 64)
    m.prefill(prompt, rows=row)
    vl, _, _ = m.verify(toks, torch.tensor([11], device="cuda"), torch.arange(1, device="cuda"))
    m.allocate(2, 64)
    m.prefill(prompt, rows=row)
    for i in range(S):
        dl = m.decode(toks[:, i:i + 1], torch.tensor([11 + i], device="cuda"), rows=row)[0, -1]
        assert torch.equal(vl[0, i], dl), (i, ((vl[0, i].float() - dl.float()).norm() / dl.float().norm()).item())


@pytest.mark.gpu
def test_gpu_bench_speculate(tmp_path):
    """bench --speculate 2 on the H200 (tiny preset, graphs): the report's speculative rows and projection."""
    import json

    from typer.testing import CliRunner

    from deepinfer_cli.app import app

    r = CliRunner().invoke(app, ["bench", "--preset", "tiny", "--batch", "1,8", "--prompt-len", "32", "--gen-len", "8",
                                 "--device", "cuda", "--backend", "triton", "--speculate", "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    spec = rep["speculative"]
    assert [d["batch"] for d in spec] == [1, 8] and all(d["mode"] == "graphs" and not d["graph_error"] for d in spec)
    assert all(len(d["projected"]) == 3 and d["step_vs_plain"] > 0 for d in spec)


# ------------------------------------------------------------------------------------ command line
def _no_mtp_checkpoint(src, d):
    """A copy of deepinfer-tiny without its MTP block (tensors and config)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, d)
    idx_path = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(idx_path))
    for shard in set(idx["weight_map"].values()):
        t = load_file(os.path.join(d, shard))
        keep = {k: v for k, v in t.items() if not k.startswith("mtp.")}
        if len(keep) != len(t):
            save_file(keep, os.path.join(d, shard))
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.startswith("mtp.")}
    json.dump(idx, open(idx_path, "w"))
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["num_nextn_predict_layers"] = 0
    cfg["compress_ratios"] = cfg["compress_ratios"][:-1]
    json.dump(cfg, open(cfg_path, "w"))


@pytest.mark.slow
def test_cli_speculate(tiny_dir, tmp_path):
    """--json reports drafted / accepted / rate / mean accepted length, greedy tokens as without --speculate;
    bad input (K < 1, K beyond the window, no MTP block) is one line, exit 2."""
    import json

    from typer.testing import CliRunner

    from deepinfer_cli.app import app

    runner = CliRunner()
    args = ["generate", "北京是", "-n", "5", "--json", "--numerics", "exact", "--dtype", "float32",
            "--device", "cpu"]
    plain = json.loads(runner.invoke(app, args).stdout.strip().splitlines()[-1])
    r = runner.invoke(app, args + ["--speculate", "2"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == plain["token_ids"] and "speculative" not in plain
    s = out["speculative"]
    assert s["drafted"] == 2 * s["steps"] and 0 <= s["acceptance_rate"] <= 1 and s["mean_accepted_length"] >= 1
    r = runner.invoke(app, ["generate", "北京是", "-n", "3", "--speculate", "1", "--device", "cpu"])
    assert r.exit_code == 0 and "mean accepted length" in r.stdout
    d = tmp_path / "nomtp"
    _no_mtp_checkpoint(tiny_dir, str(d))
    for bad, msg in ([["--speculate", "0"], "must be at least 1"], [["--speculate", "8"], "between 1 and 7"],
                     [["--speculate", "1", "--model", str(d)], "no MTP block"]):
        r = runner.invoke(app, ["generate", "x", "-n", "2"] + bad)
        assert r.exit_code == 2, (bad, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], r.output


@pytest.mark.slow
def test_cli_bench_speculate():
    """bench --speculate K: per batch size the step against plain decode, the measured acceptance, and the
    projection at 0.5 / 0.7 / 0.9 (E(a) = 1 + a + ... + a^K tokens per step); random weights say so."""
    import json

    from typer.testing import CliRunner

    from deepinfer.bench.speculative import expected_tokens
    from deepinfer_cli.app import app

    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(0.0, 3) == 1.0 and expected_tokens(1.0, 3) == 4.0
    runner = CliRunner()
    args = ["bench", "--preset", "tiny", "--batch", "1,2", "--prompt-len", "12", "--gen-len", "2",
            "--numerics", "exact", "--dtype", "float32", "--device", "cpu"]
    r = runner.invoke(app, args + ["--speculate", "2", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    spec = rep["speculative"]
    assert [d["batch"] for d in spec] == [1, 2] and all(d["k"] == 2 for d in spec)
    for d in spec:
        assert d["plain_ms_per_step"] == next(x["ms_per_step"] for x in rep["decode"] if x["batch"] == d["batch"])
        assert [x["acceptance"] for x in d["projected"]] == [0.5, 0.7, 0.9]
        assert d["projected"][0]["tokens_per_s"] == pytest.approx(d["batch"] * 1.75 / (d["ms_per_step"] / 1e3))
        assert 0 <= d["acceptance_measured"] <= 1
    assert any("random weights" in n for n in rep["notes"])
    r = runner.invoke(app, args + ["--speculate", "2"])
    assert r.exit_code == 0 and "PROJECTION" in r.stdout and "step / plain" in r.stdout
    for bad in ("8", "-1"):
        r = runner.invoke(app, args + ["--speculate", bad, "--json"])  # --json: no progress lines
        assert r.exit_code == 2 and r.output.strip().startswith("error:") and len(r.output.strip().splitlines()) == 1
