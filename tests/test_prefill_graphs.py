"""Prefill replayed as CUDA graphs per (length, start) (`engine.prefill_runner`, opt-in).

CPU: the runner passes through where graphs cannot run; what runs eagerly says why once; the prefill the graphs
capture issues no host sync (the Triton backend, interpreted). GPU: a replayed chunk equals the eager call bit
for bit (logits, streams, every cache), whole prompts and chunks of a long one, and generate gives the same
tokens with and without prefill graphs.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend_device import device_for
from deepinfer.engine.generate import SamplingParams, generate
from deepinfer.engine.loader import load_model
from deepinfer.engine.prefill_runner import PrefillRunner, prefill_runner
from deepinfer.ops import ops


def _tiny(device="cpu", backend="torch", numerics="official", dtype="float32"):
    ops.configure(backend, strict=backend != "torch")
    return load_model(None, numerics=numerics, dtype=dtype, device=device, progress=False).model


def _ids(n, seed, vocab, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (1, n), generator=g).to(device)


def test_pass_through_where_graphs_cannot_run(capsys):
    m = _tiny()
    m.allocate(2, 64)
    r = PrefillRunner(m, graphs=True)
    assert not r.graphs  # a CPU model: graphs are off, the runner is model.prefill
    ids = _ids(20, 0, m.cfg.vocab_size)
    got = r.prefill(ids, torch.tensor([1]))
    m2 = _tiny()
    m2.allocate(2, 64)
    want = m2.prefill(ids, torch.tensor([1]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert r.eager_calls == 1 and r.replays == 0 and capsys.readouterr().err == ""
    r0 = prefill_runner(m, True)
    assert prefill_runner(m, True) is r0  # kept beside the model's other steps
    m.allocate(2, 64)  # a new allocation: a new runner (graphs bake in cache addresses)
    assert not r0.valid_for(m, True) and prefill_runner(m, True) is not r0


def test_generate_asked_for_prefill_graphs_where_they_cannot_run_says_so(capsys):
    """Asked for prefill graphs on a CPU (or with eager decode), generate prefills eagerly and says why once."""
    m = _tiny()
    ids = _ids(12, 3, m.cfg.vocab_size)[0].tolist()
    p = SamplingParams(max_new_tokens=3, temperature=0.0)
    on = generate(m, [ids, ids[:7]], p, eos_id=-1, graphs=False, prefill_graphs=True)
    err = capsys.readouterr().err
    assert err.count("prefill graphs need CUDA") == 1 and "the device is cpu" in err and "eagerly" in err
    off = generate(m, [ids, ids[:7]], p, eos_id=-1, graphs=False, prefill_graphs=False)
    assert "prefill graphs" not in capsys.readouterr().err
    assert [c.token_ids for c in on.completions] == [c.token_ids for c in off.completions]


def test_eager_reasons_are_said_once(capsys):
    m = _tiny()
    m.allocate(3, 64)
    r = PrefillRunner(m, graphs=False, sizes=(16,))
    r.graphs = True  # what a CUDA runner decides before it captures anything
    assert "2 rows" in r._eager_reason(2, 16)
    assert "outside the captured lengths (16 tokens)" in r._eager_reason(1, 9)
    assert r._eager_reason(1, 16) is None
    for n in (9, 10):  # two calls off the captured lengths: one line
        r.prefill(_ids(n, n, m.cfg.vocab_size), torch.tensor([0]))
    err = capsys.readouterr().err
    assert err.count("outside the captured lengths") == 1 and "e.g. 9" in err and r.eager_calls == 2
    r.capture_error = "op 'x' failed"
    assert r._eager_reason(1, 16).startswith("prefill graphs are off after a failed capture: op 'x'")
    with pytest.raises(ValueError, match="must be >= 1"):
        PrefillRunner(m, graphs=False, sizes=(0,))


class _HostSyncs(TorchDispatchMode):
    """Records the ATen ops that make the host wait for the device (a scalar read, data-dependent shapes)."""

    SYNCS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique",
             "aten::_unique2", "aten::repeat_interleave.Tensor", "aten::item")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name + ("." + func._overloadname if func._overloadname != "default" else "")
        if any(name == s or func._schema.name == s for s in self.SYNCS):
            self.seen.append(name)
        # a Python scalar stored by index (`t[rows] = 0.0`) or a tensor made from host data: on a CUDA tensor both
        # copy from the host, which a graph capture refuses (a CPU run cannot see the copy, so the pattern is named)
        if func._schema.name in ("aten::index_put_", "aten::index_put") and args[2].dim() == 0:
            self.seen.append(f"{name} of a 0-dim value")
        if func._schema.name == "aten::lift_fresh":
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_triton_prefill_issues_no_host_sync():
    """What a prefill graph captures must not read the device from the host: after a warm-up call (which may
    read weight facts once), a Triton-backend prefill -- whole prompt and a later chunk -- calls no ATen op that
    synchronises or copies from the host (a scalar stored by index failed the capture on an H100, 2026-12-06). The torch reference's MoE does (the check sees it), which is why graphs need a kernel backend."""
    dev = device_for("triton")  # interpreted on a CPU, compiled on a CUDA host
    m = _tiny(dev, backend="triton")
    m.allocate(2, 64)
    ids = _ids(24, 3, m.cfg.vocab_size, dev)
    m.prefill(ids[:, :16], torch.tensor([0], device=dev))  # warm-up
    # made outside the check: a graph's inputs are device tensors
    row0, row1 = torch.tensor([0]), torch.tensor([1], device=dev)
    with _HostSyncs() as d:
        m.prefill(ids[:, :16], row1)
        m.prefill(ids[:, 16:], row1, start=16)
    assert d.seen == [], d.seen
    ref = _tiny(backend="torch")
    ref.allocate(1, 64)
    with _HostSyncs() as d:
        ref.prefill(ids[:, :16].cpu(), row0)
    assert d.seen, "the check no longer sees the reference MoE's host reads"


def _caches(m):
    return [t.clone() for t in m.cache_tensors()]


@pytest.mark.gpu
@pytest.mark.parametrize("numerics,dtype", [("official", "bfloat16"), ("exact", "float32")])
def test_replayed_prefill_equals_eager(numerics, dtype):
    a = _tiny("cuda", "triton", numerics, dtype)
    b = _tiny("cuda", "triton", numerics, dtype)
    for m in (a, b):
        m.allocate(3, 160)
    r = PrefillRunner(a, graphs=True, sizes=(32, 64))
    V = a.cfg.vocab_size
    # row 1: a whole 64-token prompt twice (eager + capture, then replay); row 2: 32-token chunks at 0, 32, 64
    # of two different prompts (the second prompt replays every key the first captured)
    for p, row in ((_ids(64, 1, V, "cuda"), 1), (_ids(64, 2, V, "cuda"), 1)):
        got, want = r.prefill(p, torch.tensor([row], device="cuda")), b.prefill(p, torch.tensor([row], device="cuda"))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for seed in (3, 4):
        p = _ids(96, seed, V, "cuda")
        for start in (0, 32, 64):
            chunk = p[:, start:start + 32]
            got = r.prefill(chunk, torch.tensor([2], device="cuda"), start=start)
            want = b.prefill(chunk, torch.tensor([2], device="cuda"), start=start)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, start)
    assert r.replays == 1 + 3 and r.capture_error is None and len(r.keys) == 4
    for x, y in zip(_caches(a), _caches(b)):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_generate_with_prefill_graphs_same_tokens():
    """generate with prefill graphs gives what the same chunked prefill gives eagerly: the same tokens and
    logprobs, bit for bit (a replay is the eager call's launches). Against whole-prompt prefill the tokens may
    differ here: official numerics' FP8 activation rounding turns a chunk's last-bit difference into ~1e-2 in the
    logits (tests/test_scheduler.py, chunked prefill), and an H100 run on 2026-12-06 saw one such flip."""
    a = _tiny("cuda", "triton", "official", "bfloat16")
    V = a.cfg.vocab_size
    prompts = [[0] + _ids(n, n, V)[0].tolist() for n in (255, 256, 511, 256)]
    p = SamplingParams(max_new_tokens=6, temperature=0.0)
    on = generate(a, prompts, p, eos_id=-1, graphs=True, prefill_graphs=True, prefill_chunk=256)
    runner = prefill_runner(a, True)
    assert runner.capture_error is None and runner.replays > 0, (runner.capture_error, runner.replays)
    plain = generate(a, prompts, p, eos_id=-1, graphs=True, prefill_graphs=False, prefill_chunk=256)
    assert [c.token_ids for c in on.completions] == [c.token_ids for c in plain.completions]
    assert [c.logprobs for c in on.completions] == [c.logprobs for c in plain.completions]


def test_chunks_and_memory_with_prefill_graphs():
    """With prefill graphs a memory-sized chunk becomes a captured length (chunks at 0, C, 2C, ... replay across
    prompts), never larger than memory allowed; and the graphs' pool counts in the up-front memory check."""
    from deepinfer.config import tiny_config
    from deepinfer.engine.generate import graph_chunk
    from deepinfer.engine.memory import MemoryRefused, check_fits, prefill_token_bytes

    assert graph_chunk(0, 3000) == 2048  # whole prompts would fit: the largest captured length within the prompt
    assert graph_chunk(0, 9000) == 8192 and graph_chunk(3000, 9000) == 2048
    assert graph_chunk(0, 100) == 0 and graph_chunk(100, 5000) == 100  # nothing captured fits: as it was
    cfg = tiny_config()
    one = 4096 * prefill_token_bytes(cfg, 4096)
    import deepinfer.engine.memory as mem

    real = mem.available_bytes
    try:
        mem.available_bytes = lambda device="cpu": int(1.5 * one / 0.9)  # one chunk's transients fit, two do not
        check_fits(cfg, 1, 4096, torch.float32, False, 4096, "cpu")
        with pytest.raises(MemoryRefused, match="twice: eager and the graph pool"):
            check_fits(cfg, 1, 4096, torch.float32, False, 4096, "cpu", prefill_graphs=True)
    finally:
        mem.available_bytes = real
