"""The decode step's second stream (`deepinfer.model.branch`): the shared expert, the compressors and the
indexer beside the main chain.

CPU: a fork is a no-op (no second stream), the memo records nothing, the switch is read per fork.
GPU (H200): the branch really is another stream; split-K kernels on two streams at once each count into
their own tile counters (with one shared set they race and sum the wrong partials); and a decode step gives
the same logits and tokens bit for bit with the branch on and off, eagerly and replayed from CUDA graphs.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from deepinfer.model import branch


def test_fork_on_cpu_is_a_no_op(monkeypatch):
    x = torch.randn(2, 3)
    br = branch.fork(x)
    assert br.stream is None and not branch.enabled(x)
    with br:
        y = x * 2
    assert br.join(y) is y and br.join(y, x) == (y, x)
    m = branch.Shared(y)  # a memo made outside any branch: no event, read as is
    assert m.event is None and m.get() is y and branch._open == []


def test_switch_is_read_per_fork(monkeypatch):
    class FakeCuda(torch.Tensor):
        is_cuda = True  # enabled() looks at the device only

    x = torch.randn(2).as_subclass(FakeCuda)
    monkeypatch.setenv(branch.ENV, "1")
    assert branch.enabled(x)
    monkeypatch.setenv(branch.ENV, "0")
    assert not branch.enabled(x)
    assert branch.fork(x, on=True).stream is None  # off: no stream asked for (none exists on CPU)


def test_lane_streams():
    """hc's comb on a stream of its own, every other lane on the one side stream."""
    assert [branch.lane_stream(n) for n in ("hc", "shared_expert", "indexer")] == ["hc", "side", "side"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_branch_runs_on_its_own_stream_and_joins(monkeypatch):
    monkeypatch.setenv(branch.ENV, "1")
    x = torch.randn(1 << 20, device="cuda")
    main = torch.cuda.current_stream()
    assert branch.fork(x).stream is None  # no runner issuing: forks stay on the current stream
    lanes = branch.Lanes(x.device)
    with lanes.issuing():
        br = branch.fork(x)
        with br:
            assert torch.cuda.current_stream() == br.stream != main
            torch.cuda._sleep(20_000_000)  # ~10 ms: a read that did not wait for the memo would see ones
            memo = branch.Shared(x.sin())  # made in the branch, read on main before any join
        assert torch.cuda.current_stream() == main and branch._open == []
        assert memo.stream is br.stream and memo.event is not None
        torch.testing.assert_close(memo.get().cpu(), x.sin().cpu(), rtol=0, atol=0)
        with br:
            y = x.cos()
        y = br.join(y)
        torch.testing.assert_close(y.cpu(), x.cos().cpu(), rtol=0, atol=0)
        # the same stream every time (graph warm-up and capture share it, and its tile counters); one stream for
        # every lane but hc's
        assert branch.fork(x).stream is br.stream and branch.fork(x, lane="other").stream is br.stream
        assert branch.fork(x, lane="hc").stream is not br.stream


@pytest.mark.gpu
@cuda
def test_join_of_a_branch_never_entered_inside_a_capture(monkeypatch):
    """An op may ignore the branch it is handed (the reference hc_pre does): joining it must not make the
    capture depend on a stream that never joined it."""
    monkeypatch.setenv(branch.ENV, "1")
    x = torch.randn(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with branch.Lanes(x.device).issuing(), torch.cuda.graph(g, stream=s):
        br = branch.fork(x)
        assert br.active  # a real second stream: the case this test is about
        z = br.join(x + 1)  # before anything joined the branch stream to this capture
        used = branch.fork(x)
        with used:
            y = x * 2
        y = used.join(y)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, x + 1) and torch.equal(y, x * 2)


@pytest.mark.gpu
@cuda
def test_split_k_on_two_streams_at_once():
    """Two streams launch split-K FP8 GEMMs concurrently, many times; every output equals the serial one
    bit for bit (shared tile counters would let one launch's programs complete the other's tiles)."""
    common = importlib.import_module("deepinfer_kernels.triton._common")
    gemm = importlib.import_module("deepinfer_kernels.triton.gemm")
    from deepinfer.ops import ops

    ops.configure("triton", strict=True)
    dev = torch.device("cuda")
    M, N, K = 1, 4096, 4096
    assert gemm._config(M, N, K, dev)[3] > 1, "shape must split K"
    g = torch.Generator(device="cuda").manual_seed(0)
    ins = []
    for _ in range(2):
        a = torch.randn(M, K, device=dev, generator=g).to(torch.float8_e4m3fn)
        a_s = torch.exp2(torch.randint(-4, 2, (M, K // 128), device=dev, generator=g).float())
        w = (torch.randn(N, K, device=dev, generator=g) * 0.5).to(torch.float8_e4m3fn)
        w_s = torch.exp2(torch.randint(-4, 2, (N // 128, K // 128), device=dev, generator=g).float())
        ins.append((a, a_s, w, w_s))
    want = [ops.fp8_gemm(*i, out_dtype=torch.float32) for i in ins]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    with torch.cuda.stream(streams[0]):
        c0 = common.tile_counters(dev, 1)
    with torch.cuda.stream(streams[1]):
        c1 = common.tile_counters(dev, 1)
    assert c0.data_ptr() != c1.data_ptr() != common.tile_counters(dev, 1).data_ptr()
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(50):
        for s, i, o in zip(streams, ins, outs):
            with torch.cuda.stream(s):
                o.append(ops.fp8_gemm(*i, out_dtype=torch.float32))
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        for y in o:
            assert torch.equal(y, w)
    assert not c0.any() and not c1.any()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_decode_same_bits_with_and_without_branch(monkeypatch, graphs):
    from deepinfer.engine.generate import SamplingParams, generate
    from deepinfer.engine.loader import load_model
    from deepinfer.ops import ops

    ops.configure("triton", strict=True)
    lm = load_model(None, numerics="official", dtype="bfloat16", device="cuda", progress=False)
    kinds = set(lm.cfg.attn_kinds)
    assert {"csa", "hca", "swa"} <= kinds  # every branch kind: compressor, indexer, shared expert
    prompts = [[0, 6127, 389], [0, 17607, 11, 12, 13, 14, 15, 16, 17], [0, 5]]
    plist = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 7, 9)]
    runs = {}
    for on in ("1", "0"):  # side streams, one stream
        monkeypatch.setenv(branch.ENV, on)
        runs[on] = generate(lm.model, prompts, plist, eos_id=1, max_batch=4, graphs=graphs,
                            pad_to_buckets=not graphs).completions
    for a, b in zip(runs["1"], runs["0"]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
