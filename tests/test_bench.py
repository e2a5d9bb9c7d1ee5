"""`deepinfer bench` on CPU: presets and slices, random official-format weights, floors, the CLI's JSON.

Flash/Pro presets are checked at the config level only (their weights are tens of GB); random weights and
the benchmark itself run on `tiny_config()` and its 3-layer slice.
"""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.checkpoint.reader import expected_storage
from deepinfer.config import ConfigError, tiny_config
from deepinfer.bench.run import BenchOptions, run_bench
from deepinfer.bench.floor import expected_distinct, floors, model_bytes
from deepinfer.hf.model import hf_name
from deepinfer.engine.random_weights import random_state
from deepinfer.model.transformer import Transformer
from deepinfer.model.weights import Numerics
from deepinfer.presets import PresetError, flash_config, preset_config, pro_config, slice_config
from deepinfer.checkpoint.schema import fp32_in_release
from deepinfer_cli.app import app

KINDS = {"swa", "csa", "hca"}


@pytest.fixture(autouse=True)
def _one_thread():
    # The tiny model's ops are too small to gain from threads, and a busy machine makes torch's
    # spinning worker threads 30x slower: one thread keeps these tests fast and steady.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_preset_parsing():
    assert preset_config("tiny") == tiny_config()
    assert preset_config("flash") == flash_config() and preset_config("pro") == pro_config()
    s = preset_config("flash-slice:4")
    assert s.n_layers == 4 and s.n_mtp_layers == 1 and s.dim == 4096 and s.name == "v4-flash-slice4"
    assert preset_config("pro-slice:3").dim == 7168
    for bad in ("flash-slice:0", "flash-slice:44", "pro-slice:x", "llama", ""):
        with pytest.raises(PresetError, match="--preset"):
            preset_config(bad)
    with pytest.raises(ConfigError):  # the library call names the slice, not an option
        slice_config(flash_config(), 0)


def test_release_shapes():
    f, p = flash_config(), pro_config()
    assert (f.n_layers, len(f.attn_kinds), f.n_heads, f.head_dim) == (43, 44, 64, 512)
    assert (f.q_lora_rank, f.o_groups, f.o_lora_rank, f.window_size) == (1024, 8, 1024, 128)
    assert f.compress_ratios[:4] == (0, 0, 4, 128) and f.compress_ratios[-2:] == (4, 0)
    assert (f.n_routed_experts, f.moe_inter_dim, f.n_activated_experts) == (256, 2048, 6)
    assert (f.index_n_heads, f.index_head_dim, f.index_topk, f.route_scale) == (64, 128, 512, 1.5)
    assert (f.rope_factor, f.original_seq_len, f.compress_rope_theta, f.n_hash_layers) == (16.0, 65536, 160000.0, 3)
    assert (p.dim, p.n_layers, len(p.attn_kinds), p.n_heads, p.q_lora_rank, p.o_groups) == (7168, 61, 62, 128, 1536, 16)
    assert p.compress_ratios[:3] == (128, 128, 4) and p.compress_ratios[-2:] == (4, 0)
    assert (p.n_routed_experts, p.moe_inter_dim, p.index_topk, p.route_scale) == (384, 3072, 1024, 2.5)


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_flash_slice_keeps_every_kind(n):
    s = slice_config(flash_config(), n)
    main = s.attn_kinds[:n]
    assert set(main) == KINDS and len(s.attn_kinds) == n + 1 and s.attn_kinds[-1] == "swa"
    assert s.n_hash_layers == min(3, n - 1) and not all(s.hash_layers)
    assert all(r == (0 if k == "swa" else 4 if k == "csa" else 128) for k, r in zip(s.attn_kinds, s.compress_ratios))


def test_pro_and_tiny_slices():
    p = slice_config(pro_config(), 4)  # Pro has no SWA main layer: SWA only in its MTP block, as released
    assert set(p.attn_kinds[:4]) == {"csa", "hca"} and set(p.attn_kinds) == KINDS
    t = slice_config(tiny_config(), 3)
    assert set(t.attn_kinds[:3]) == KINDS and t.hash_layers == (True, False, False)
    assert slice_config(flash_config(), 1).hash_layers == (False,)  # the one layer routes by top-k


@pytest.mark.parametrize("cfg", [tiny_config(), slice_config(tiny_config(), 3)], ids=["tiny", "tiny-slice3"])
def test_random_state_is_the_official_layout(cfg):
    want = expected_storage(cfg)
    st = random_state(cfg, "cpu", seed=1)
    assert list(st) == list(want)
    for name, (kind, shape) in want.items():
        t = st[name]
        assert tuple(t.shape) == shape, name
        if kind == "fp8":
            assert t.dtype == torch.float8_e4m3fn and torch.isfinite(t.float()).all()
        elif kind == "fp4":
            assert t.dtype == torch.int8
        elif kind == "scale":
            assert t.dtype == torch.float32
            assert torch.equal(torch.exp2(torch.log2(t).round()), t), f"{name}: not powers of two"
        elif kind == "int":
            assert t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < cfg.n_routed_experts
            assert (t.sort(1).values.diff(dim=1) > 0).all(), "tid2eid rows must be distinct experts"
        else:
            assert t.dtype == (torch.float32 if fp32_in_release(name) else torch.bfloat16), name


def test_random_state_is_deterministic():
    cfg = slice_config(tiny_config(), 1)
    a, b, c = (random_state(cfg, "cpu", seed=s) for s in (1, 1, 2))
    for n in ("layers.0.ffn.experts.3.w1.weight", "layers.0.attn.wq_b.scale", "embed.weight"):
        assert torch.equal(a[n], b[n]) and not torch.equal(a[n], c[n])


def test_random_weights_have_fan_in_spread_and_run():
    cfg = tiny_config()
    st = random_state(cfg, "cpu", seed=0)
    model = Transformer(cfg, st, Numerics("exact", torch.float32), "cpu")  # every tensor used, none unknown
    for lin in (model.layers[1].attn.wq_b, model.layers[1].ffn.experts[0].w1):
        std = lin.weight.std().item() * lin.weight.size(1) ** 0.5
        assert 0.5 < std < 2.0
    mb = model_bytes(cfg, model)  # before allocate: caches must not count as weights
    one, eight = (floors(cfg, mb, [20] * b, bandwidth=1e10, flops_rate=1e11, cache_elem=2) for b in (1, 8))
    assert one["distinct_experts_per_layer"] == pytest.approx(cfg.n_activated_experts)
    assert eight["distinct_experts_per_layer"] > one["distinct_experts_per_layer"]
    assert 0 < one["bytes_ckpt"] < eight["bytes_ckpt"] and 0 < one["flops"] < eight["flops"]
    assert one["floor_ms"] == max(one["t_bytes_ckpt_ms"], one["t_flops_ms"]) > 0
    model.allocate(1, 32)
    logits, _ = model.prefill(torch.randint(2, 1000, (1, 20)))
    assert torch.isfinite(logits).all()


def test_expected_distinct_experts():
    assert expected_distinct(256, 6, 1) == pytest.approx(6)
    assert expected_distinct(256, 6, 8) < 48 and expected_distinct(256, 6, 10_000) == pytest.approx(256)


def test_hf_names():
    idx = "model.layers.2.self_attn.compressor.indexer."
    assert hf_name("layers.2.attn.indexer.compressor.wkv.weight") == idx + "kv_proj.weight"
    assert hf_name("layers.2.attn.indexer.weights_proj.weight") == idx + "scorer.weights_proj.weight"
    assert hf_name("layers.0.attn.compressor.norm.weight") == "model.layers.0.self_attn.compressor.kv_norm.weight"
    assert hf_name("layers.0.hc_ffn_fn") == "model.layers.0.ffn_hc.fn"
    assert hf_name("layers.1.ffn.gate.bias") == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert hf_name("layers.1.ffn.experts.0.w1.weight") is None and hf_name("mtp.0.attn.wq_a.weight") is None


def _finite_positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_bench_tiny_cpu_with_peer():
    pytest.importorskip("transformers")
    r = run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=8, gen_len=1, device="cpu",
                               peer="transformers", progress=False))
    assert r["eager"] is True and r["cuda_graphs"] is False
    assert _finite_positive(r["bandwidth_Bps"]) and _finite_positive(r["matmul_flops"])
    pf = r["prefill"]
    assert _finite_positive(pf["ttft_ms"]) and _finite_positive(pf["tokens_per_s"]) and _finite_positive(pf["ratio"])
    assert [d["batch"] for d in r["decode"]] == [1]
    for d in r["decode"]:
        f = d["floor"]
        for v in (d["ms_per_step"], d["tokens_per_s"], d["ratio"], d["ratio_engine_bytes"], f["floor_ms"],
                  f["bytes_ckpt"], f["bytes_engine"], f["flops"]):
            assert _finite_positive(float(v))
        assert f["bytes_engine"] > f["bytes_ckpt"]  # fp32 head and scales held by the engine
    peer = r["peer"]
    assert "error" not in peer, peer.get("error")
    assert [p["batch"] for p in peer["decode"]] == [1]
    assert all(_finite_positive(p["speedup_ours"]) for p in peer["decode"])


def test_cli_json_and_record(tmp_path):
    doc = tmp_path / "perf.md"
    args = ["bench", "--preset", "tiny", "--batch", "1", "--prompt-len", "6", "--gen-len", "2", "--device", "cpu",
            "--json", "--eager", "--record", str(doc)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["model"] == "deepinfer-tiny" and out["backend"] == "torch" and out["gen_len"] == 2
    assert {"prefill", "decode", "bandwidth_Bps", "matmul_flops", "engine_weight_bytes", "cuda_graphs"} <= set(out)
    assert out["cuda_graphs"] is False and all(d["mode"] == "eager" for d in out["decode"])
    assert out["decode"][0]["batch"] == 1 and out["decode"][0]["ratio"] > 0
    text = doc.read_text()
    assert "How to read this table" in text
    rows = [line for line in text.splitlines() if line.startswith("| 20")]
    assert len(rows) == 1 and "deepinfer bench --preset tiny" in rows[0] and "B=1:" in rows[0]


def test_prefill_host_issue_and_graphs_row():
    """Every prefill row reports the host's issue time (CPU: no device time); --prefill-graphs adds a row, or says
    why it was skipped (graphs need CUDA and a kernel backend), in the report and the printed table."""
    args = ["bench", "--preset", "tiny", "--batch", "1", "--prompt-len", "6", "--gen-len", "1", "--device", "cpu",
            "--prefill-graphs"]
    res = CliRunner().invoke(app, args + ["--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    pf = out["prefill"]
    assert 0 < pf["host_issue_ms"] <= pf["ttft_ms"] * 1.05 and pf["device_ms"] is None and pf["mode"] == "eager"
    assert out["prefill_graphs"] == {"skipped": "prefill graphs need CUDA, a kernel backend and no --eager"}
    # the registry ops of one decode step: each a kernel boundary on a GPU
    do = out["decode_ops"]
    assert do["batch"] == 1 and do["ops_per_step"] == sum(do["by_op"].values()) > 50
    assert do["by_op"]["fp8_gemm"] > 0 and "hc_pre_quant" in do["by_op"]
    # and of one eager prefill of the prompt: its registry ops and the torch ops between them, by site
    pl = out["prefill_launches"]
    assert pl["tokens"] == 6 and pl["ops"] == sum(pl["by_op"].values()) > 50 and "grouped_gemm" in pl["by_op"]
    assert pl["torch_ops"] == sum(pl["torch_by_site"].values()) > 0
    from deepinfer.ops import ops
    assert ops._counts is None and not ops._siting  # counting is off again
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and "host issue" in res.output and "prefill as a CUDA graph: skipped" in res.output
    assert "registry ops" in res.output and "prefill of 6 tokens:" in res.output


def test_bench_against_same_run_same_floors(tmp_path):
    """--against times other configurations in the same run: one row per configuration against the main rows'
    floors, the per-op map recorded, the main dispatch restored afterwards; the table prints them."""
    from deepinfer.ops import ops

    r = run_bench(BenchOptions(preset="tiny", batches=(1, 2), prompt_len=6, gen_len=1, device="cpu", progress=False,
                               against=("torch", "torch:rms_norm=torch")))
    assert [a["spec"] for a in r["against"]] == ["torch", "torch:rms_norm=torch"]
    assert [a["op_map"] for a in r["against"]] == ["", "rms_norm=torch"]
    for a in r["against"]:
        assert [d["batch"] for d in a["decode"]] == [1, 2]
        pf = a["prefill"]
        assert pf["ratio"] == pytest.approx(pf["ttft_ms"] / r["prefill"]["floor"]["floor_ms"])
        assert pf["vs_main"] == pytest.approx(pf["ttft_ms"] / r["prefill"]["ttft_ms"])
        for d, m in zip(a["decode"], r["decode"]):
            assert _finite_positive(d["ms_per_step"])
            assert d["ratio"] == pytest.approx(d["ms_per_step"] / m["floor"]["floor_ms"])
            assert d["vs_main"] == pytest.approx(d["ms_per_step"] / m["ms_per_step"])
    assert ops.op_map == {}  # the main configuration is back
    doc = tmp_path / "perf.md"
    args = ["bench", "--preset", "tiny", "--batch", "1", "--prompt-len", "6", "--gen-len", "1", "--device", "cpu",
            "--against", "torch:rms_norm=torch", "--record", str(doc)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "same run, same floors" in res.output and "torch:rms_norm=torch" in res.output
    rows = [ln for ln in doc.read_text().splitlines() if ln.startswith("| 20")]
    assert len(rows) == 2 and "--against torch:rms_norm=torch" in rows[0]
    assert "torch:rms_norm=torch · official@60d8d707 (same run as torch)" in rows[1] and "B=1:" in rows[1]


def test_cli_bad_options():
    for args in (["bench", "--against", "nope"], ["bench", "--against", "triton:foo=tilelang"],
                 ["bench", "--against", "torch:rms_norm"], ["bench", "--against", "tilelang", "--device", "cpu"],
                 ["bench", "--batch", "0"], ["bench", "--preset", "nope"], ["bench", "--batch", "a,b"],
                 ["bench", "--peer", "vllm", "--device", "cpu", "--batch", "1"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, (args, res.output)
    res = CliRunner().invoke(app, ["bench", "--preset", "flash-slice:0", "--device", "cpu"])
    # one line naming the option and the range, no hint about a config.json the user never gave
    assert res.exit_code == 2 and "--preset 'flash-slice:0': N must be 1..43" in res.output, res.output
    assert "config.json" not in res.output


def test_op_flops_count_useful_work_only():
    """FLOPs per op call from its arguments: padding rows (e = -1) and empty index slots (-1) count 0."""
    from deepinfer.bench.oprates import op_flops, op_shape

    a = torch.zeros(6, 256)
    assert op_flops("fp8_gemm", (a, None, torch.zeros(64, 256), None), {}) == 2 * 6 * 64 * 256
    assert op_flops("linear", (torch.zeros(2, 3, 256), torch.zeros(10, 256)), {}) == 2 * 6 * 10 * 256
    e = torch.tensor([0, -1, 3, 3, -1, 1])
    assert op_flops("grouped_gemm", (a, None, e, torch.zeros(4, 32, 128), None), {}) == 2 * 4 * 256 * 32
    q, idx = torch.zeros(1, 5, 8, 64), torch.tensor([[[0, 1, -1]] * 5])
    assert op_flops("sparse_attn", (q, None, None, idx, 1.0), {}) == 4 * 10 * 8 * 64
    assert op_flops("rms_norm", (a,), {}) == 0
    assert op_shape("linear", (torch.zeros(2, 3, 256), torch.zeros(10, 256))) == "6x10x256"
    assert op_shape("grouped_gemm", (a, None, e, torch.zeros(4, 32, 128), None)) == "6x32x256 E4"
    assert op_shape("sparse_attn", (q, None, None, idx, 1.0)) == "5t 8h D64 K3"
    # one A row per token for its 3 pairs (topk): the pairs are the GEMM's rows
    a2 = torch.zeros(2, 256)
    assert op_shape("grouped_gemm", (a2, None, e, torch.zeros(4, 32, 128), None)) == "6x32x256 E4"
    assert op_flops("grouped_gemm", (a2, None, e, torch.zeros(4, 32, 128), None), {"topk": 3}) == 2 * 4 * 256 * 32
    # the FP8 Linear on an unquantised input (x, w, w_s)
    assert op_flops("act_quant_fp8_gemm", (a, torch.zeros(64, 256), None), {}) == 2 * 6 * 64 * 256
    assert op_shape("act_quant_fp8_gemm", (a, torch.zeros(64, 256), None)) == "6x64x256"
    # the routed w2 on w1|w3's output h [P, 2I] (h, limit, weight, e, w, w_s): K is I, padding rows count 0
    h, w2 = torch.zeros(6, 512), torch.zeros(4, 32, 256)
    assert op_flops("swiglu_grouped_gemm", (h, 10.0, None, e, w2, None), {}) == 2 * 4 * 256 * 32
    assert op_shape("swiglu_grouped_gemm", (h, 10.0, None, e, w2, None)) == "6x32x256 E4"


def test_op_bytes_count_each_view_once_and_the_results():
    """op_bytes: every distinct tensor view of the arguments (nested, keyword) once, then the results not among
    them; a strided view counts the elements it addresses. summarize turns them into x_bytes per op."""
    from deepinfer.bench.oprates import op_bytes, summarize

    x = torch.randn(64, 32)  # 8192 B
    w = torch.randn(16, 32, dtype=torch.bfloat16)  # 1024 B
    y = torch.empty(64, 16)  # 4096 B
    assert op_bytes((x, w), {}, y) == 8192 + 1024 + 4096
    assert op_bytes((x, x, [w, (w,)]), {"bias": None}, None) == 8192 + 1024  # the same views count once
    assert op_bytes((x,), {"out": y}, y) == 8192 + 4096  # a result written into an argument: once
    assert op_bytes((x[:, ::2],), {}, x[:8]) == 64 * 16 * 4 + 8 * 32 * 4  # two views of x: each its elements
    assert op_bytes((x, 3.0, "s"), {}, (y, 7)) == 8192 + 4096

    class Ev:  # host-side events: each call took 2 ms
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return other.t - self.t

    calls = [("rms_norm", Ev(0.0), Ev(2.0), (), {}, 10**9), ("rms_norm", Ev(5.0), Ev(7.0), (), {}, 10**9)]
    orig = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a: None
    try:
        (r,) = summarize(calls, None, 1e15, bandwidth=2e12)  # 2 GB at 2 TB/s: 1 ms for 4 ms measured
        (r0,) = summarize(calls, None, 1e15)
    finally:
        torch.cuda.synchronize = orig
    assert r["bytes"] == 2 * 10**9 and r["x_bytes"] == pytest.approx(4.0) and not r["compute"]
    assert r0["x_bytes"] is None  # no bandwidth: no ratio


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_op_rates_time_a_real_gemm():
    from deepinfer.bench.oprates import op_rates, summarize
    from deepinfer.ops import ops

    ops.configure("torch")
    x = torch.randn(512, 1024, device="cuda")
    w = torch.randn(2048, 1024, device="cuda")
    with op_rates(("linear",)) as calls:
        ops.linear(x, w)
        ops.linear(x, w)
        ops.linear(x[:256], w)
    rows = summarize(calls, None, 1e15)
    assert len(rows) == 1 and rows[0]["calls"] == 3 and rows[0]["flops"] == 2.5 * 2 * 512 * 1024 * 2048
    assert [(x["shape"], x["calls"]) for x in rows[0]["shapes"]] == [("512x2048x1024", 2), ("256x2048x1024", 1)]
    assert rows[0]["ms"] > 0 and rows[0]["tflops"] > 0
    assert ops.linear is not None and ops._cache["linear"].__name__ != "timed", "wrappers removed on exit"


class _HostEvent:
    """torch.cuda.Event's interface on the host clock (a CPU test of the event bookkeeping)."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


def test_op_rates_of_every_op_time_the_outermost_call(monkeypatch):
    """op_rates(None) wraps every op the dispatcher has resolved (a phase split: its prefill entry only), times an op
    that calls another through the dispatcher once, and restores the dispatcher on exit; over a tiny prefill the
    rows cover the ops called and add up to at most the pass."""
    from deepinfer.bench.oprates import op_rates, summarize
    from deepinfer.ops import ops

    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    inner, dec = (lambda x: x + 1), (lambda x: x)
    cache = {"inner": inner, "outer": lambda x: ops.inner(x) * 2, ("split", "decode"): dec,
             ("split", "prefill"): lambda x: x - 1}
    monkeypatch.setattr(ops, "_cache", dict(cache))
    with op_rates(None) as calls:
        assert ops._cache[("split", "decode")] is dec  # the decode entry is not the prefill's: left alone
        assert (ops.outer(1), ops.inner(1), ops._cache[("split", "prefill")](5)) == (4, 2, 4)
    assert [c[0] for c in calls] == ["outer", "inner", "split"]  # inner inside outer is outer's time
    assert ops._cache == cache

    monkeypatch.undo()
    cfg = tiny_config()
    model = Transformer(cfg, random_state(cfg, torch.device("cpu"), 0), Numerics("exact", torch.float32), "cpu")
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    ids = torch.randint(2, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    row = torch.zeros(1, dtype=torch.long)
    model.allocate(1, 41)
    ops.phase = "prefill"
    model.prefill(ids, rows=row)  # resolves the pass's ops
    ops.count_calls()
    t0, t1 = _HostEvent(), _HostEvent()
    with op_rates(None) as calls:
        t0.record()
        model.prefill(ids, rows=row)
        t1.record()
    called = ops.count_calls(False)
    rows = summarize(calls, None, 1e15)
    assert {"rms_norm", "linear", "sparse_attn"} <= {r["op"] for r in rows} <= set(called)
    assert sum(r["ms"] for r in rows) <= t0.elapsed_time(t1)
    assert [r["compute"] for r in rows if r["op"] in ("rms_norm", "linear")] in ([False, True], [True, False])
    assert all(type(v).__name__ != "function" or v.__name__ != "timed" for v in ops._cache.values())


def test_captured_or_eager_keeps_the_capture_error():
    """A failed capture is reported and the eager runner is what gets timed (decode, guided and speculative rows)."""
    from deepinfer.bench.timing import captured_or_eager
    from deepinfer.engine.graphs import GraphCaptureError

    class Step:
        def __init__(self, graphs, fail):
            self.graphs, self.fail = graphs, fail

        def capture(self):
            if self.fail:
                raise GraphCaptureError("op 'x' synced")

    s, err, t = captured_or_eager(lambda g: Step(g, True), True)
    assert not s.graphs and err == "op 'x' synced" and t is None
    s, err, t = captured_or_eager(lambda g: Step(g, False), True)
    assert s.graphs and err is None and t >= 0
    s, err, t = captured_or_eager(lambda g: Step(g, True), False)
    assert not s.graphs and err is None and t is None


def test_drift_counts_flips_and_their_margins():
    """drift(): relative error, top-1 agreement and, for flips, the main side's margin there; NaN never agrees."""
    from deepinfer.bench.drift import drift

    g = torch.Generator().manual_seed(3)
    main = torch.randn(8, 50, generator=g)
    same = drift(main.clone(), main)
    assert same["rel_err"] == 0.0 and same["top1_agree"] == 1.0 and same["flips"] == 0
    assert same["max_flip_margin"] is None and same["positions"] == 8
    test = main.clone()
    top = main.topk(2, dim=-1)
    for p in (1, 5):  # flip positions 1 and 5: raise their second choice above the first
        test[p, top.indices[p, 1]] = top.values[p, 0] + 1.0
    d = drift(test, main)
    assert d["flips"] == 2 and d["top1_agree"] == pytest.approx(6 / 8)
    assert d["max_flip_margin"] == pytest.approx(float((top.values[[1, 5], 0] - top.values[[1, 5], 1]).max()))
    assert d["rel_err"] == pytest.approx(float((test - main).norm() / main.norm()))
    assert d["max_abs"] == pytest.approx(float((test - main).abs().max()))
    test[3, 0] = float("nan")
    d = drift(test, main)
    assert d["flips"] == 3 and math.isnan(d["rel_err"]) and math.isnan(d["max_abs"])
    with pytest.raises(ValueError, match="shapes"):
        drift(main[:4], main)


def test_bench_against_with_settings_and_drift(monkeypatch):
    """An --against entry sets per-call settings around its own calls (policy=fast), reports them and its drift
    from the main configuration's logits, and the environment is back afterwards."""
    import os

    monkeypatch.delenv("DEEPINFER_POLICY", raising=False)
    r = run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=6, gen_len=1, device="cpu", progress=False,
                               against=("torch:policy=fast", "torch:rms_norm=torch,DEEPINFER_TL_FP4=fold")))
    assert r["settings"]["DEEPINFER_POLICY"] == "official" and r["settings"]["DEEPINFER_FP8_GEMM"] == "exact"
    fast, fold = r["against"]
    assert fast["settings"] == {"DEEPINFER_POLICY": "fast"} and fold["settings"] == {"DEEPINFER_TL_FP4": "fold"}
    assert fold["op_map"] == "rms_norm=torch"
    from deepinfer.bench.run import parse_against

    one_off = parse_against("triton:DEEPINFER_DECODE_FUSIONS=-Q_NORM_SPARSE_ATTN_FP8+hc_post_pre_quant")[2]
    assert one_off == {"DEEPINFER_DECODE_FUSIONS": "-q_norm_sparse_attn_fp8+hc_post_pre_quant"}
    for a in (fast, fold):  # the torch reference computes the same numbers under either policy
        d = a["drift"]
        assert d["positions"] == 6 and d["rel_err"] == 0.0 and d["top1_agree"] == 1.0 and d["flips"] == 0
    assert "DEEPINFER_POLICY" not in os.environ and "DEEPINFER_TL_FP4" not in os.environ
    res = CliRunner().invoke(app, ["bench", "--preset", "tiny", "--batch", "1", "--prompt-len", "6", "--gen-len", "1",
                                   "--device", "cpu", "--against", "torch:policy=fast"])
    assert res.exit_code == 0, res.output
    assert "rel 0.00e+00, top-1 100% of 6" in res.output


def test_bench_against_decode_drift_sees_a_decode_only_difference(monkeypatch):
    """Each entry's decode drift compares DRIFT_DECODE_STEPS batch-1 decode steps' logits with the main ones: an
    entry whose only difference is in a decode-only op (here the q-norming decode attention, made 1 % larger while
    DEEPINFER_DECODE_FUSIONS=off is set) shows it there, while its prompt drift stays 0; an identical entry
    shows 0 in both."""
    import os

    from deepinfer.bench.drift import DRIFT_DECODE_STEPS
    from deepinfer.ops import REGISTRY, ops

    from deepinfer.ops.registry import _ensure_reference

    _ensure_reference()
    d = REGISTRY["q_norm_sparse_attn_fp8"]
    real = d.impls["torch"]

    def skewed(*a, **k):
        out = real(*a, **k)
        return out * 1.01 if os.environ.get("DEEPINFER_DECODE_FUSIONS") == "off" else out

    monkeypatch.setitem(d.impls, "torch", skewed)
    ops._cache.clear()
    try:
        r = run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=6, gen_len=1, device="cpu",
                                   progress=False, against=("torch:DEEPINFER_DECODE_FUSIONS=off", "torch")))
    finally:
        ops._cache.clear()
    skew, same = r["against"]
    assert skew["drift"]["rel_err"] == 0.0 and same["drift"]["rel_err"] == 0.0
    assert same["decode_drift"]["rel_err"] == 0.0 and same["decode_drift"]["positions"] == DRIFT_DECODE_STEPS
    assert skew["decode_drift"]["rel_err"] > 1e-4, skew["decode_drift"]


def test_bench_against_bad_settings_one_line():
    for spec, msg in (("triton:DEEPINFER_PDL=0", "DEEPINFER_PDL is not a setting read per call"),
                      ("torch:policy=slow", "choose policy=official|fast"),
                      ("torch:DEEPINFER_TL_FP4", "choose DEEPINFER_TL_FP4=bf16|fold|fp8"),
                      ("triton:DEEPINFER_DECODE_FUSIONS=-hc_post", "expected on, off or -OP[+OP...]"),
                      ("triton:DEEPINFER_DECODE_FUSIONS", "give DEEPINFER_DECODE_FUSIONS=VALUE")):
        res = CliRunner().invoke(app, ["bench", "--device", "cpu", "--batch", "1", "--against", spec])
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, (spec, res.output)


def test_drift_cell_with_only_nan_flips():
    """A kernel that gives NaN everywhere it flips still prints a cell (no margin to name), never a crash."""
    from deepinfer.bench.drift import drift
    from deepinfer_cli.bench import drift_cell

    main = torch.randn(4, 10)
    test = main.clone()
    test[1] = float("nan")
    d = drift(test, main)
    assert d["flips"] == 1 and d["max_flip_margin"] is None
    assert "1 flips" in drift_cell(d) and "margin" not in drift_cell(d)


def test_an_entrys_tuned_map_is_checked_under_its_own_policy(tmp_path, monkeypatch):
    """`--against torch:@fast.yaml,policy=fast`: the map measured under fast is read under the entry's policy."""
    from deepinfer.bench.run import parse_against
    from deepinfer.debug.tune import tune, write_map

    monkeypatch.delenv("DEEPINFER_POLICY", raising=False)
    m = tmp_path / "fast.yaml"
    write_map(str(m), tune("torch", ["torch"], "rms_norm$", "tiny", 0, "cpu", "fast"))
    backend, op_map, values = parse_against(f"torch:@{m},policy=fast")
    assert op_map == {"rms_norm": "torch"} and values == {"DEEPINFER_POLICY": "fast"}
    with pytest.raises(ValueError, match="policy"):
        parse_against(f"torch:@{m}")  # the run's official policy refuses a fast map


def test_drift_logits_are_the_heads_of_the_last_positions():
    """prefill_logits computes the head on the last positions only, equal to those rows of all-position logits."""
    from deepinfer.bench.drift import prefill_logits
    from deepinfer.bench.workload import random_prompts

    cfg = tiny_config()
    model = Transformer(cfg, random_state(cfg, torch.device("cpu"), 0), Numerics("exact", torch.float32), "cpu")
    got = prefill_logits(model, cfg, 70, torch.device("cpu"), 0)
    model.allocate(1, 71)
    full, _ = model.prefill(random_prompts(cfg, 1, 70, 0), rows=torch.zeros(1, dtype=torch.long), all_logits=True)
    assert got.shape == (64, cfg.vocab_size) and not got.isnan().any()
    # fp32 GEMMs of 64 and of 70 rows may block the K sum differently: equal to fp32 reordering, not bit for bit
    torch.testing.assert_close(got, full[0, -64:].float(), rtol=1e-5, atol=1e-5)


def test_the_prefill_profile_table_lists_every_op_and_the_gaps():
    """The CLI's prefill table: compute ops with their rate, other ops timed only, the time between ops last, and a
    warning where the host caught up with the GPU."""
    import io

    from rich.console import Console

    from deepinfer_cli.bench import _print

    r = run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=6, gen_len=1, device="cpu", progress=False))
    r["matmul_fp8_flops"] = 1.5e15
    gg = {"op": "grouped_gemm", "calls": 8, "ms": 16.9, "flops": 5e12, "tflops": 296.0, "of_ceiling": 0.2,
          "ceiling": "fp8", "compute": True, "shapes": []}
    hp = {"op": "hc_post", "calls": 8, "ms": 1.04, "flops": 0.0, "tflops": 0.0, "of_ceiling": 0.0, "ceiling": "bf16",
          "compute": False, "bytes": 2.1e9, "x_bytes": 3.46,
          "shapes": [{"shape": "", "calls": 8, "ms": 1.04, "tflops": 0.0, "of_ceiling": 0.0}] * 2}
    r["prefill_ops"] = {"prompt_len": 4096, "total_ms": 20.0, "host_issue_ms": 30.0, "head_start_ms": 45.0,
                        "timed_issue_ms": 50.0, "host_caught_up": True, "ops": [gg, hp], "outside_ops_ms": 2.06}
    buf = io.StringIO()
    _print(r, Console(file=buf, width=200))
    out = buf.getvalue()
    lines = {ln.split("│")[1].strip(): ln for ln in out.splitlines() if ln.count("│") > 3}
    assert "296" in lines["grouped_gemm"] and "20% fp8" in lines["grouped_gemm"]
    cells = [c.strip() for c in lines["hc_post"].split("│")[1:-1]]
    assert cells == ["hc_post", "8", "1.04", "5.2%", "-", "-", "2100", "3.5x"]  # timed only: no rate
    assert [c.strip() for c in lines["grouped_gemm"].split("│")[1:-1]][-2:] == ["-", "-"]  # no bytes recorded
    assert "x bytes: an op's time over the time to move" in " ".join(out.split())
    assert "" not in lines  # no per-shape rows under hc_post (their shape cells would be empty)
    assert "2.06" in lines["(between ops: torch glue)"] and "10.3%" in lines["(between ops: torch glue)"]
    assert "50.0 ms, past its 45.0 ms head start" in " ".join(out.split())


def test_a_bench_cut_off_returns_what_finished():
    """BenchCutOff during the measurements (the CLI raises it on SIGTERM): the report holds the prefill and the
    decode rows that finished, and "cut_off" names the step it stopped in."""
    from deepinfer.bench.run import BenchCutOff

    def log(msg):
        if msg.startswith("decode: batch 2"):
            raise BenchCutOff("SIGTERM")

    r = run_bench(BenchOptions(preset="tiny", batches=(1, 2), prompt_len=6, gen_len=1, device="cpu", progress=False),
                  log=log)
    assert r["cut_off"] == "SIGTERM during: decode: batch 2, 1 steps ..."
    assert r["prefill"]["ttft_ms"] > 0 and [d["batch"] for d in r["decode"]] == [1]
    with pytest.raises(BenchCutOff):  # before any measurement there is nothing to report
        run_bench(BenchOptions(preset="tiny", batches=(1,), prompt_len=6, gen_len=1, device="cpu", progress=False),
                  log=lambda m: (_ for _ in ()).throw(BenchCutOff("SIGTERM")))


def test_sigterm_prints_the_report_so_far(tmp_path, monkeypatch):
    """`timeout` sends SIGTERM at its limit: bench prints the JSON of what finished, records no perf-log row, says
    where it stopped and exits 143; the SIGTERM handler is the previous one afterwards."""
    import os
    import signal

    import deepinfer.bench.run as run_mod

    real, calls = run_mod.time_decode, []

    def time_decode(*a, **k):
        calls.append(a[2])
        if len(calls) == 3:  # the untimed warm-up, batch 1, then batch 2: stop there
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "time_decode", time_decode)
    before = signal.getsignal(signal.SIGTERM)
    doc = tmp_path / "perf.md"
    res = CliRunner().invoke(app, ["bench", "--preset", "tiny", "--batch", "1,2", "--prompt-len", "6", "--gen-len",
                                   "1", "--device", "cpu", "--json", "--record", str(doc)])
    assert res.exit_code == 143, res.output
    report = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("{")))
    assert report["cut_off"].startswith("SIGTERM during: decode: batch 2") and len(report["decode"]) == 1
    assert "stopped by SIGTERM" in res.stderr and "no row recorded" in res.stderr and not doc.exists()
    assert signal.getsignal(signal.SIGTERM) == before
