"""Continuous batching (engine.scheduler) and the decode runner's bucket padding, on the tiny model (on the
CPU, or on the GPU where CUDA is available: `load_model`'s default device).

A prompt's tokens and logprobs must not depend on what else is in the batch: its slot, the other
prompts' lengths and parameters, how many slots there are, when it is admitted, or the padding entries
of a bucket.
"""

import pytest
import torch

from deepinfer.engine.generate import Completion, SamplingParams, _record, generate
from deepinfer.engine.loader import load_model
from deepinfer.engine.graphs import bucket_sizes, describe_capture_failure
from deepinfer.engine.runner import DecodeRunner
from deepinfer.engine.scheduler import Request, Scheduler
from deepinfer.ops import ops

PROMPTS = [
    [0, 6127, 389],
    [0, 17607, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [0, 5],
    [0, 99, 4321, 777, 5, 6, 7, 8, 9],
    [0, 1234, 31, 32, 33, 34],
]


@pytest.fixture(scope="module")
def lm():
    return load_model(None, numerics="official", dtype="float32", progress=False)


# A GEMM's result is not bit-identical across batch sizes: M=1 and M=2 (or a padded bucket) take different
# paths (CPU BLAS blocking, which depends on the host CPU and the torch build; on CUDA the Triton backend's
# GEMV vs tiled kernels), summing in different orders. In `exact` numerics that is ~1e-7 relative, so
# batched and single runs agree to EXACT_ATOL (1-ulp noise on every GEMM output moves these logprobs by
# <2e-6; the smallest greedy top-1/top-2 margin is 2.6e-3). In `official` numerics activations are rounded
# to FP8 (e4m3, 3 mantissa bits) or FP4 before GEMMs, and a last-bit difference can flip one element's
# rounding, which moves later logprobs: 7e-4 seen on the H200 host (-7.979503 vs -7.978781, first prompt,
# 4th token, 2 slots vs alone; GPU, triton backend, torch 2.11), 0 on the CPU hosts tried, and up to 3e-2
# at a decode step with the same tokens when 1-ulp noise is injected into the GEMMs on CPU. So in `official`
# the tokens and finish reasons are compared exactly and the logprobs to OFFICIAL_ATOL, and each test that
# compares a batched run with another composition or with single runs also runs in `exact` numerics
# (`lm_exact`, EXACT_ATOL): there a leak of 1e-4 of another row's logits fails, which OFFICIAL_ATOL misses.
EXACT_ATOL = 1e-5
OFFICIAL_ATOL = 5e-2
# Logits and cache values of a padded decode bucket against the unpadded step, `official` numerics: 3.5e-5 seen on
# a 2-core Xeon with AMX (2026-12-03; 0 on the CPU hosts tried before), where MKL computes a float32 GEMM of fewer
# than 16 rows by another kernel than the same rows in a larger one.
PADDING_OFFICIAL_TOL = 1e-3


@pytest.fixture(scope="module")
def lm_exact():
    return load_model(None, numerics="exact", dtype="float32", progress=False)


def assert_same(a, b, atol=EXACT_ATOL):
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol)


def alone(lm, prompts, params, eos_id, **kw):
    """Each prompt run by itself (one slot)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    return [generate(lm.model, [pr], p, eos_id, max_batch=1, **kw).completions[0] for pr, p in zip(prompts, plist)]


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(100)[-2:] == [64, 100]
    with pytest.raises(ValueError):
        bucket_sizes(0)


@pytest.fixture(scope="module")
def greedy_ref(lm):
    """Each prompt alone (one slot), greedy, 6 tokens."""
    return alone(lm, PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True), eos_id=1)


@pytest.fixture(scope="module")
def greedy_ref_exact(lm_exact):
    """`greedy_ref` in exact numerics."""
    return alone(lm_exact, PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True), eos_id=1)


def model_ref_atol(request, numerics):
    """(model, greedy reference, logprob tolerance) for `numerics`."""
    if numerics == "official":
        return request.getfixturevalue("lm"), request.getfixturevalue("greedy_ref"), OFFICIAL_ATOL
    return request.getfixturevalue("lm_exact"), request.getfixturevalue("greedy_ref_exact"), EXACT_ATOL


@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_fewer_slots_than_prompts_matches_single_runs(request, numerics):
    """5 prompts of different lengths through 2 slots: admission as slots free up, same results."""
    lm, greedy_ref, atol = model_ref_atol(request, numerics)
    got = generate(lm.model, PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True), eos_id=1,
                   max_batch=2).completions
    for a, b in zip(got, greedy_ref):
        assert_same(a, b, atol=atol)


@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_early_finish_frees_slot_and_matches_single_runs(request, numerics):
    """EOS forced (the first prompt's first token is "EOS"): that sequence ends after one token, its slot
    is reused at once, and every other sequence is what it is alone (its greedy tokens up to that id)."""
    lm, greedy_ref, atol = model_ref_atol(request, numerics)
    eos = greedy_ref[0].token_ids[0]
    got = generate(lm.model, PROMPTS, SamplingParams(max_new_tokens=6), eos_id=eos, max_batch=2).completions
    assert got[0].finish_reason == "eos" and got[0].token_ids == [eos]
    for a, ref in zip(got, greedy_ref):
        ids = ref.token_ids
        n = ids.index(eos) + 1 if eos in ids else len(ids)
        assert a.token_ids == ids[:n]
        assert a.finish_reason == ("eos" if eos in ids else "length")
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(ref.logprobs[:n]), atol=atol)
    assert any(c.finish_reason == "length" for c in got)


def test_scheduler_admits_as_slots_free(lm):
    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    lens = [1, 6, 2, 3, 5]  # different lengths: sequences finish at different steps
    plist = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    lm.model.allocate(3, 64)
    runner = DecodeRunner(lm.model, 2)
    comps = [Completion(list(pr)) for pr in PROMPTS]
    sched = Scheduler(lm.model, runner, 1, _record, lambda c, s: False)
    for i, (pr, pp, c) in enumerate(zip(PROMPTS, plist, comps)):
        sched.submit(Request(i, pr, pp, c))
    st = sched.run()
    assert [len(c.token_ids) for c in comps] == lens
    assert all(c.finish_reason == "length" for c in comps)
    assert st.prefills == 5 and st.max_running == 2
    assert st.decode_tokens == sum(n - 1 for n in lens)  # the last token of each is never decoded
    assert sorted(sched.free) == [0, 1] and not sched.running
    with pytest.raises(ValueError, match="max_seq_len"):
        sched.submit(Request(9, [0] * 62, p, Completion([0] * 62)))
    del p


@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_per_request_sampling_params(request, numerics):
    lm, greedy_ref, atol = model_ref_atol(request, numerics)
    plist = [
        SamplingParams(max_new_tokens=6, ignore_eos=True),  # greedy
        SamplingParams(max_new_tokens=3, temperature=1.0, top_k=50, top_p=0.9, seed=5, logprobs=2, ignore_eos=True),
        SamplingParams(max_new_tokens=5, temperature=0.7, top_k=1, seed=9, ignore_eos=True),  # = greedy
        SamplingParams(max_new_tokens=4, temperature=1.3, seed=11, ignore_eos=True),
        SamplingParams(max_new_tokens=2, temperature=1.0, top_p=0.5, seed=2, ignore_eos=True),
    ]
    got = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=3).completions
    assert [len(c.token_ids) for c in got] == [6, 3, 5, 4, 2]
    assert len(got[1].top_logprobs) == 3 and all(len(t) == 2 for t in got[1].top_logprobs)
    assert got[0].top_logprobs == [] and got[3].top_logprobs == []
    assert_same(got[0], greedy_ref[0], atol=atol)
    assert got[2].token_ids == greedy_ref[2].token_ids[:5]  # top_k 1 samples greedily
    assert got[3].token_ids != greedy_ref[3].token_ids[:4]  # temperature 1.3 really samples
    # the seed is (request seed, index in the list), never the slot: one slot gives the same results
    one_slot = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=1).completions
    for a, b in zip(got, one_slot):
        assert_same(a, b, atol=atol)
    with pytest.raises(ValueError, match="one per prompt"):
        generate(lm.model, PROMPTS, plist[:2], eos_id=1)


@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_deterministic_across_batch_compositions(request, numerics):
    """Sampled generation: same seeds and inputs -> same tokens for every slot count and padding mode."""
    lm, greedy_ref, atol = model_ref_atol(request, numerics)
    p = SamplingParams(max_new_tokens=5, temperature=1.0, top_k=40, seed=3, ignore_eos=True)
    runs = [generate(lm.model, PROMPTS, p, eos_id=1, max_batch=s, pad_to_buckets=pad).completions
            for s, pad in ((5, False), (2, False), (3, True))]
    for other in runs[1:]:
        for a, b in zip(other, runs[0]):
            assert_same(a, b, atol=atol)
    # the first prompt's greedy tokens do not depend on the others' sampling settings or lengths
    g = SamplingParams(max_new_tokens=6, ignore_eos=True)
    mixed = generate(lm.model, PROMPTS, [g, p, p, p, p], eos_id=1, max_batch=4).completions
    assert_same(mixed[0], greedy_ref[0], atol=atol)
    for a, b in zip(mixed[1:], runs[0][1:]):
        assert_same(a, b, atol=atol)


@pytest.mark.parametrize("numerics", ["official", "exact"])
def test_generate_with_bucket_padding_equals_eager(request, numerics):
    """Sequences of different lengths: the live batch shrinks 5 -> 4 -> 3 ... and most steps run padded
    (5 slots: buckets 1, 2, 4, 5; 3 slots: buckets 1, 2, 3 with admissions)."""
    lm, greedy_ref, atol = model_ref_atol(request, numerics)
    lens = [6, 2, 4, 3, 5]
    plist = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    for slots in (3, 5):
        got = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=slots, pad_to_buckets=True).completions
        for a, b, n in zip(got, greedy_ref, lens):
            assert a.token_ids == b.token_ids[:n] and a.finish_reason == "length"
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs[:n]), atol=atol)
    # graphs=True: CUDA graphs on a CUDA model only (built here, not captured); a CPU model runs plain eager
    r = DecodeRunner(lm.model, 5, graphs=True)
    if lm.model.device.type == "cuda":
        assert r.mode == "graphs" and list(r.buckets) == [1, 2, 4, 5]
    else:
        assert r.mode == "eager" and not r.buckets


def _state(model):
    """Every per-row cache tensor, as values: an FP8-layout KV cache (official numerics: uint8 rows,
    `ops.kv_pack`) unpacked, so a last-bit difference in a RoPE dim (stored as the compute dtype's bytes)
    compares as ~1e-7, not as a low byte off by up to 255."""
    attn = {id(a.kv_cache): a for a in model.attentions() if a.kv_cache.dtype == torch.uint8}
    return [ops.kv_unpack(t, attn[id(t)].hd, attn[id(t)].rd, model.numerics.dtype) if id(t) in attn else t
            for t in model.cache_tensors()]


@pytest.mark.parametrize("numerics", ["exact", "official"])
def test_runner_padding_matches_unpadded_decode_and_spares_live_rows(lm, lm_exact, numerics):
    """Decode steps through bucket padding (n live rows in a bigger bucket, padding on the spare row)
    give the same logits and the same live-row cache contents as the unpadded eager step: to 1e-5 in `exact`
    numerics, where a padded row leaking into a live one fails; in `official` to PADDING_OFFICIAL_TOL, since a
    bucket's GEMMs run over more rows than the unpadded step's and FP8 requantization amplifies their last-bit
    differences (see the note above EXACT_ATOL)."""
    model = (lm_exact if numerics == "exact" else lm).model
    tol = 1e-5 if numerics == "exact" else PADDING_OFFICIAL_TOL
    slots = 6  # buckets 1, 2, 4, 6
    model.allocate(slots + 1, 48)
    eager = DecodeRunner(model, slots)
    padded = DecodeRunner(model, slots, pad_to_buckets=True)
    assert padded.mode == "eager-bucketed" and padded.spare_row == slots
    assert list(padded.buckets) == [1, 2, 4, 6]
    live = [0, 2, 3, 4, 5]  # not contiguous, not starting at the bucket size

    def prefill():
        for r in live:
            pr = PROMPTS[r % len(PROMPTS)]
            model.prefill(torch.tensor([pr]), rows=torch.tensor([r]))
        return torch.tensor([len(PROMPTS[r % len(PROMPTS)]) for r in live])

    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(2, 129280, (12, len(live)), generator=gen)
    results = {}
    for name, runner in (("eager", eager), ("padded", padded)):
        pos = prefill()
        logits = []
        for t in range(12):
            n = [5, 3, 1, 5, 2, 4, 5, 3, 5, 5, 1, 5][t]  # 5 -> bucket 6, 3 -> 4, 2 -> 2, 1 -> 1
            idx = torch.arange(n)
            out = runner.decode(toks[t, :n].view(n, 1), pos[idx], torch.tensor(live)[idx])
            assert out.shape == (n, 129280)
            logits.append(out)
            pos[idx] += 1
        live_state = [s[live].clone() for s in _state(model)]
        results[name] = (logits, live_state)
    for a, b in zip(results["eager"][0], results["padded"][0]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for a, b in zip(results["eager"][1], results["padded"][1]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="max_batch"):
        padded.decode(torch.zeros(7, 1, dtype=torch.long), torch.zeros(7, dtype=torch.long),
                      torch.zeros(7, dtype=torch.long))
    with pytest.raises(ValueError, match="cache rows"):
        DecodeRunner(model, slots + 1, pad_to_buckets=True)  # no room for the spare row
    model.allocate(slots + 1, 48)
    with pytest.raises(RuntimeError, match="re-allocated"):
        padded.decode(toks[0, :1].view(1, 1), torch.tensor([3]), torch.tensor([0]))


def test_capture_failure_names_the_op_or_function(lm, monkeypatch):
    """The capture error message points at the host-syncing code (simulated on CPU: the exception an op
    raises inside a CUDA capture, then the one `capture_end` raises while handling it)."""
    def fail_in(fn):
        try:
            try:
                fn()
            except Exception:
                raise RuntimeError("operation failed due to a previous error during capture")
        except RuntimeError as e:
            return describe_capture_failure(e, 4)

    msg = fail_in(lambda: ops.sample(torch.zeros(2, 5), torch.zeros(3), torch.zeros(2, dtype=torch.long),
                                     torch.ones(2), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)))
    assert "op 'sample'" in msg and "backend 'torch'" in msg and "--eager" in msg and "bucket 4" in msg

    def sync(*a, **k):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    model = lm.model
    model.allocate(2, 16)
    model.prefill(torch.tensor([[0, 5, 6]]), rows=torch.tensor([0]))
    monkeypatch.setattr(torch, "unique", sync)  # the reference MoE's host sync
    msg = fail_in(lambda: model.decode(torch.tensor([[7]]), torch.tensor([3]), torch.tensor([0])))
    # the reference MoE's sync: the grouped_gemm op's loop over experts (or, before that op, the loop
    # in MoE.compute_experts)
    assert "op 'grouped_gemm'" in msg or "MoE.compute_experts" in msg, msg
    assert "not permitted when stream is capturing" in msg and "--eager" in msg


# ---------------------------------------------------------------------------------- chunked prefill
# Chunked and whole prefills sum in different orders (GEMMs over S rows, attention over differently laid out
# slots): ~1e-7 relative in fp32. In `official` numerics such a last-bit difference can flip one FP8
# activation rounding (act_quant before wo_b: ~1e-2 in the logits), so the tight checks run in `exact`
# numerics (`lm_exact`) and `official` is checked on the tokens.
@pytest.mark.parametrize("chunk", [1, 4, 5])
def test_chunked_prefill_gives_the_same_tokens_and_interleaves_decode(lm_exact, chunk):
    """--prefill-chunk C: at most C prompt tokens per step, so the 17-token prompt's chunks alternate with
    decode steps of the sequences already running -- and every completion is what whole prefills give."""
    m = lm_exact.model
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = generate(m, PROMPTS, params, eos_id=1, max_batch=2).completions
    m.allocate(3, 64)
    runner = DecodeRunner(m, 2)
    comps = [Completion(list(pr)) for pr in PROMPTS]
    sched = Scheduler(m, runner, 1, _record, lambda c, s: False, prefill_chunk=chunk)
    steps_at_call = []
    real_prefill = m.prefill

    def spy(ids, rows=None, all_logits=False, start=0):
        assert ids.size(1) <= chunk, "a step prefills at most `chunk` tokens"
        steps_at_call.append(sched.stats.decode_steps)
        return real_prefill(ids, rows=rows, all_logits=all_logits, start=start)

    m.prefill = spy
    try:
        for i, (pr, c) in enumerate(zip(PROMPTS, comps)):
            sched.submit(Request(i, pr, params, c))
        st = sched.run()
    finally:
        del m.prefill
    for a, b in zip(comps, ref):
        assert_same(a, b, atol=1e-4)
    assert st.prefills == len(PROMPTS) and st.prefill_calls > len(PROMPTS), "long prompts took several calls"
    assert len(set(steps_at_call)) > 2, "decode steps ran between the chunks"


def test_chunked_prefill_official_numerics_same_tokens(lm, greedy_ref):
    got = generate(lm.model, PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True), eos_id=1,
                   max_batch=2, prefill_chunk=4).completions
    assert [c.token_ids for c in got] == [c.token_ids for c in greedy_ref]


def test_model_prefill_in_chunks_equals_one_prefill(lm_exact):
    """Transformer.prefill(start=...) over chunks that cut windows (SWA 8) and compression windows (CSA 4,
    HCA 16) at every offset: the logits of every position and the next decode step match one prefill."""
    m = lm_exact.model
    assert {"swa", "csa", "hca"} <= set(m.cfg.attn_kinds[:m.cfg.n_layers])
    ids = torch.randint(2, 1000, (1, 45), generator=torch.Generator().manual_seed(0))
    m.allocate(2, 64)
    whole, _ = m.prefill(ids, rows=torch.tensor([0]), all_logits=True)
    nxt = whole[:, -1].argmax(-1, keepdim=True)
    ref_step = m.decode(nxt, torch.tensor([45]), torch.tensor([0]))
    for chunks in ([7, 13, 25], [1, 3, 41], [4, 5, 36], [16, 16, 13], [44, 1], [9] * 5):
        outs, s0 = [], 0
        for c in chunks:
            lg, _ = m.prefill(ids[:, s0:s0 + c], rows=torch.tensor([1]), all_logits=True, start=s0)
            outs.append(lg)
            s0 += c
        step = m.decode(nxt, torch.tensor([45]), torch.tensor([1]))
        scale = whole.abs().max().item()
        torch.testing.assert_close(torch.cat(outs, 1), whole, rtol=1e-5, atol=1e-5 * scale, msg=str(chunks))
        torch.testing.assert_close(step, ref_step, rtol=1e-5, atol=1e-5 * scale, msg=str(chunks))
    with pytest.raises(ValueError, match="one row"):
        m.prefill(ids.repeat(2, 1)[:, :4], start=4)


def test_generate_steps_are_freed_with_their_model():
    """The decode runner and the speculative step (with their CUDA graphs) are the engine's (`engine.steps`), not
    the model's: the model holds none of them, and a model that generated is freed with them once nothing else
    refers to it (a map keyed by the model would keep every model, its caches and graphs alive if a runner
    referred to its model strongly)."""
    import gc
    import weakref

    from deepinfer.engine.runner import DecodeRunner
    from deepinfer.engine.speculative import SpecStep
    from deepinfer.engine.steps import steps_of

    m = load_model(None, numerics="exact", dtype="float32", device="cpu", progress=False).model
    generate(m, PROMPTS[:2], SamplingParams(max_new_tokens=2), eos_id=1, max_batch=2)
    generate(m, PROMPTS[:1], SamplingParams(max_new_tokens=3), eos_id=1, max_batch=1, speculate=1)
    held = steps_of(m)
    assert isinstance(held["decode"], DecodeRunner) and isinstance(held["speculative"], SpecStep)
    assert not any(isinstance(v, (DecodeRunner, SpecStep, dict)) for v in vars(m).values()), \
        "the model holds engine state"
    runner = held["decode"]
    gone = weakref.ref(m)
    del m, held
    gc.collect()
    assert gone() is None
    with pytest.raises(RuntimeError, match="has been freed"):
        runner.model


def test_capture_failure_hint_fits_the_backend():
    """The torch reference's grouped_gemm sync is named only where that op runs on the reference; a prefill
    capture's way out is to leave --prefill-graphs off (an H100 run on 2026-12-06 printed the torch hint under
    --backend triton)."""
    e = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture.")
    try:
        ops.configure("torch")
        msg = describe_capture_failure(e, 4)
        assert "torch reference's grouped_gemm" in msg and "--eager" in msg and "capture.." not in msg
        ops.configure("triton")
        msg = describe_capture_failure(e, "256 tokens at position 0", "prefill chunk")
        assert "grouped_gemm" not in msg and "without --prefill-graphs" in msg and "--eager" not in msg
    finally:
        ops.configure("torch")
