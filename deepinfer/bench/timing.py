"""The engine's timed runs for `deepinfer bench`: one prefill (TTFT), B-row decode steps (eager or as the
runner's CUDA graphs), the guided-decoding step in its three modes, and a profile of one eager decode step.
Each returns a JSON-able row; `deepinfer.bench.run` holds the rows against their floors."""

from __future__ import annotations

import statistics
import time

import torch

from deepinfer.bench.glue import counting
from deepinfer.bench.rates import sync
from deepinfer.bench.workload import WARMUP_STEPS, random_prompts
from deepinfer.config import ModelConfig
from deepinfer.model.transformer import Transformer
from deepinfer.ops import ops


def time_prefill(model: Transformer, cfg: ModelConfig, P: int, device, seed: int, repeats: int = 3,
                 graphs: bool = False) -> dict:
    """TTFT of one P-token prompt (row 0): cold (first call) and warm median, with the host's issue time (until
    the call returns, before the sync) and, on CUDA, the device time between events around the call.

    graphs: through a `PrefillRunner` (the first call eager and captured, the rest replayed); a failed capture
    is reported (`graph_error`) and the rows are eager."""
    from deepinfer.engine.prefill_runner import PrefillRunner

    ids = random_prompts(cfg, 1, P, seed).to(device)
    row = torch.zeros(1, dtype=torch.long, device=device)
    runner = PrefillRunner(model, graphs=graphs and device.type == "cuda", sizes=(P,))
    cuda = device.type == "cuda"

    def once() -> tuple[float, float, float | None]:
        sync(device)
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t = time.perf_counter()
        runner.prefill(ids, rows=row)
        host = time.perf_counter() - t
        if cuda:
            e1.record()
        sync(device)
        return time.perf_counter() - t, host, e0.elapsed_time(e1) if cuda else None

    cold = once()[0]
    runs = [once() for _ in range(repeats)]
    warm = statistics.median(r[0] for r in runs)
    out = {"prompt_len": P, "cold_ms": cold * 1e3, "ttft_ms": warm * 1e3, "tokens_per_s": P / warm,
           "host_issue_ms": statistics.median(r[1] for r in runs) * 1e3,
           "device_ms": statistics.median(r[2] for r in runs) if cuda else None,
           "mode": "graphs" if runner.replays else "eager", "graph_error": runner.capture_error}
    return out


def captured_or_eager(make, graphs: bool):
    """make(graphs) -> a runner (`DecodeRunner`, `SpecStep`); with graphs, captured -> (runner, graph_error,
    capture_s). A failed capture is kept in graph_error and an eager runner timed instead, never silently."""
    from deepinfer.engine.graphs import GraphCaptureError

    step = make(graphs)
    if not step.graphs:
        return step, None, None
    t = time.perf_counter()
    try:
        step.capture()
    except GraphCaptureError as e:
        return make(False), str(e), None
    return step, None, time.perf_counter() - t


def time_decode(model: Transformer, cfg: ModelConfig, B: int, P: int, K: int, device, seed: int,
                graphs: bool = False) -> dict:
    """Prefill B rows (P tokens each), then time K decode steps of the whole batch.

    graphs: replay the step as a captured CUDA graph (`DecodeRunner`); a capture failure is reported in
    the result (`graph_error`) and that row is timed eagerly instead -- never silently.
    """
    from deepinfer.engine.runner import DecodeRunner

    max_len = P + WARMUP_STEPS + K + 1
    model.allocate(B + 1, max_len)  # +1: the runner's spare row for bucket padding
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompts = random_prompts(cfg, B, P, seed + 1).to(device)
    rows = torch.arange(B, device=device)
    t = time.perf_counter()
    for i in range(B):  # the engine prefills per prompt
        model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
    sync(device)
    prefill_s = time.perf_counter() - t
    ids = random_prompts(cfg, (WARMUP_STEPS + K) * B, 1, seed + 2).view(WARMUP_STEPS + K, B, 1).to(device)
    pos = torch.full((B,), P, dtype=torch.long, device=device)
    runner, graph_error, capture_s = captured_or_eager(lambda g: DecodeRunner(model, B, graphs=g), graphs)
    for s in range(WARMUP_STEPS):
        runner.decode(ids[s], pos, rows)
        pos = pos + 1
    sync(device)
    t = time.perf_counter()
    for s in range(WARMUP_STEPS, WARMUP_STEPS + K):
        runner.decode(ids[s], pos, rows)
        pos = pos + 1
    sync(device)
    dt = (time.perf_counter() - t) / K
    out = {"batch": B, "ms_per_step": dt * 1e3, "tokens_per_s": B / dt, "prefill_rows_s": prefill_s,
           "mean_position": P + WARMUP_STEPS + (K - 1) / 2, "mode": runner.mode, "graph_error": graph_error,
           "capture_s": capture_s}
    if device.type == "cuda":
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    return out


GUIDED_MODES = ("off", "all_ones", "json")


def time_guided(model: Transformer, cfg: ModelConfig, B: int, P: int, K: int, device, seed: int, compiler,
                graphs: bool = False) -> dict:
    """The per-step cost of guided decoding at batch B: K steps (after WARMUP_STEPS) of decode -> [mask] ->
    sample (temperature 1) + logprobs -> tokens to the host -> matchers accept, fed back, in each mode:
    off (no mask), all_ones (every row unconstrained: fill + copy + apply of all-ones masks), json (an
    xgrammar builtin-JSON matcher per row, reset when it terminates). The host fill runs right after the
    decode step is launched, as in the scheduler; `json_fill_ms` is its host time per step (hidden behind the
    step while shorter than it), `json_accept_ms` the matchers' accept after the tokens are back (serial:
    on the step's critical path)."""
    from deepinfer.engine.guided import MaskBuffer
    from deepinfer.engine.runner import DecodeRunner

    V = cfg.vocab_size
    model.allocate(B + 1, P + WARMUP_STEPS + K + 1)
    rows = torch.arange(B, device=device)
    prompts = random_prompts(cfg, B, P, seed + 1).to(device)
    for i in range(B):
        model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
    runner, graph_error, _ = captured_or_eager(lambda g: DecodeRunner(model, B, graphs=g), graphs)
    json_guide = compiler.compile_builtin_json()
    temp = torch.ones(B, device=device)
    top_k = torch.zeros(B, dtype=torch.long, device=device)
    top_p = torch.ones(B, device=device)
    seeds = torch.arange(B, dtype=torch.long, device=device)
    first = random_prompts(cfg, B, 1, seed + 2).to(device)
    masks = MaskBuffer(B, V, device)
    out = {"batch": B, "mode": runner.mode, "graph_error": graph_error}
    for mode in GUIDED_MODES:
        matchers = [json_guide.matcher() if mode == "json" else None for _ in range(B)]
        ids, pos = first, torch.full((B,), P, dtype=torch.long, device=device)
        fill_s = accept_s = 0.0
        for s in range(WARMUP_STEPS + K):
            if s == WARMUP_STEPS:
                sync(device)
                t0, fill_s, accept_s = time.perf_counter(), 0.0, 0.0
            logits = runner.decode(ids, pos, rows)
            if mode != "off":
                tf = time.perf_counter()
                masks.fill(matchers)  # on the host while the device runs the step
                fill_s += time.perf_counter() - tf
                logits = ops.apply_token_bitmask(logits, masks.to_device(B))
            toks = ops.sample(logits, temp, top_k, top_p, seeds, pos)
            ops.logprobs(logits)
            toks_l = toks.tolist()
            ta = time.perf_counter()
            for j, m in enumerate(matchers):
                if m is not None:
                    if not m.accept_token(toks_l[j]):
                        raise RuntimeError(f"bench --guided: the matcher refused token {toks_l[j]} the mask allowed")
                    if m.is_terminated():
                        m.reset()
            accept_s += time.perf_counter() - ta
            ids, pos = toks.view(B, 1), pos + 1
        sync(device)
        out[f"{mode}_ms"] = (time.perf_counter() - t0) / K * 1e3
        if mode != "off":
            out[f"{mode}_overhead_ms"] = out[f"{mode}_ms"] - out["off_ms"]
            out[f"{mode}_fill_ms"] = fill_s / K * 1e3
            out[f"{mode}_accept_ms"] = accept_s / K * 1e3
    return out


def profile_decode(model: Transformer, cfg: ModelConfig, B: int, P: int, device, seed: int, steps: int = 3,
                   top: int = 40, out_counts: dict | None = None) -> list[dict]:
    """Where a decode step's time goes: torch.profiler over `steps` eager steps (graphs would hide the
    kernels), the `top` kernels by total device time -> [{name, calls, total_ms, share}] per step.
    out_counts (CUDA): receives "kernels_per_step", every kernel launch of a step (the boundaries a step pays)."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer.engine.runner import DecodeRunner

    model.allocate(B, P + steps + 4)
    prompts = random_prompts(cfg, B, P, seed + 1).to(device)
    rows = torch.arange(B, device=device)
    for i in range(B):
        model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
    ids = random_prompts(cfg, (steps + 1) * B, 1, seed + 2).view(steps + 1, B, 1).to(device)
    pos = torch.full((B,), P, dtype=torch.long, device=device)
    runner = DecodeRunner(model, B)  # eager, on the runner's side streams as the engine issues it
    runner.decode(ids[0], pos, rows)  # warm-up (compiles)
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for s in range(1, steps + 1):
            runner.decode(ids[s], pos + s, rows)
        sync(device)
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    evs = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    if device.type == "cuda":  # kernels only (CPU-side ops also carry device time of their children)
        kernels = [e for e in evs if "CUDA" in str(getattr(e, "device_type", ""))]
        evs = kernels or evs
        if out_counts is not None:
            out_counts["kernels_per_step"] = sum(e.count for e in kernels) / steps
    total = sum(getattr(e, key) for e in evs) or 1.0
    evs.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"name": e.key[:90], "calls_per_step": e.count / steps, "ms_per_step": getattr(e, key) / 1e3 / steps,
             "share": getattr(e, key) / total} for e in evs[:top]]


def count_prefill_ops(model: Transformer, cfg: ModelConfig, P: int, device, seed: int) -> dict:
    """The registry ops one eager P-token prefill into row 0 calls (after a warm-up prefill), and the torch ops it
    launches between them (`bench.glue`): {"tokens", "ops", "by_op": {op: calls}, "torch_ops", "torch_by_site":
    {"site op": calls}}. On a GPU each is a kernel and, eagerly, a host issue of its own: what a prefill graph
    replays without the host, and what the eager TTFT's host issue is made of."""
    model.allocate(1, P + 4)
    rows = torch.zeros(1, dtype=torch.long, device=device)
    prompt = random_prompts(cfg, 1, P, seed + 3).to(device)
    model.prefill(prompt, rows=rows)  # warm-up: first-call paths stay out
    with counting() as n:
        model.prefill(prompt, rows=rows)
    sync(device)
    return {"tokens": P, "ops": sum(n.ops.values()), "by_op": dict(sorted(n.ops.items(), key=lambda kv: -kv[1])),
            "torch_ops": n.glue.total, "torch_by_site": n.glue.by_site()}


def count_decode_ops(model: Transformer, cfg: ModelConfig, B: int, P: int, device, seed: int) -> dict:
    """The registry ops one eager decode step of B rows calls (after a warm-up step): {"ops_per_step",
    "by_op": {op: calls}}, and the torch ops it launches between them (`bench.glue`): {"torch_ops_per_step",
    "torch_ops": {"site op": calls}}. Each is at least one kernel boundary on a GPU; the CUDA kernel count of the
    step is `--profile`'s `kernels_per_step`."""
    from deepinfer.engine.runner import DecodeRunner

    model.allocate(B + 1, P + 4)
    rows = torch.arange(B, device=device)
    prompts = random_prompts(cfg, B, P, seed + 1).to(device)
    for i in range(B):
        model.prefill(prompts[i:i + 1], rows=rows[i:i + 1])
    ids = random_prompts(cfg, 2 * B, 1, seed + 2).view(2, B, 1).to(device)
    pos = torch.full((B,), P, dtype=torch.long, device=device)
    runner = DecodeRunner(model, B)
    runner.decode(ids[0], pos, rows)  # warm-up: first-call paths stay out
    step_pos = pos + 1  # made outside the count: the runner's caller owns it
    with counting() as n:
        runner.decode(ids[1], step_pos, rows)
    sync(device)
    return {"batch": B, "ops_per_step": sum(n.ops.values()),
            "by_op": dict(sorted(n.ops.items(), key=lambda kv: -kv[1])),
            "torch_ops_per_step": n.glue.total, "torch_ops": n.glue.by_site()}
