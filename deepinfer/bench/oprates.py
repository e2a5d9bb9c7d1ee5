"""Per-op device time and achieved FLOP rate inside a real forward pass (`deepinfer bench --profile`).

While `op_rates()` is active, the compute-heavy ops of the dispatcher (`ops.fp8_gemm`, `ops.grouped_gemm`,
`ops.sparse_attn`, ...) are wrapped: each call is bracketed by two CUDA events and its useful FLOPs are
computed from its arguments (padding rows of a grouped GEMM and -1 slots of an attention index do not
count). After the pass, one synchronisation reads the events. Events are recorded on the stream around
the launches and never synchronise, so the pass runs as it would unwrapped (minus graph capture).

This answers "what fraction of the FP8 matmul rate do the prefill GEMMs reach" with the shapes and
routing of the actual model, not a synthetic benchmark.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from deepinfer.bench.glue import _tensors
from deepinfer.ops import ops


def _gemm_flops(a: torch.Tensor, n: int) -> float:
    return 2.0 * a.numel() * n  # a [M, K]: 2 M N K


def op_flops(name: str, args: tuple, kwargs: dict) -> float:
    """Useful FLOPs of one call (float: reads index tensors, so call after the pass)."""
    if name in ("fp8_gemm", "fp4_gemm"):
        return _gemm_flops(args[0], args[2].size(0))
    if name == "act_quant_fp8_gemm":  # x [M, K] (quantised inside), w [N, K]
        return _gemm_flops(args[0], args[1].size(0))
    if name == "linear":
        return _gemm_flops(args[0], args[1].size(0))
    if name == "fp8_grouped_linear":  # x [T, G, K], w [G·R, K]: each group T x R x K
        return 2.0 * args[0].size(0) * args[1].size(0) * args[1].size(1)
    if name == "grouped_gemm":
        a, e, w = args[0], args[2], args[3]
        return 2.0 * float((e >= 0).sum()) * a.size(1) * w.size(1)
    if name == "swiglu_grouped_gemm":  # h [P, 2I] (w2's K is I), e [P], w [E, N, ·]
        h, e, w = args[0], args[3], args[4]
        return 2.0 * float((e >= 0).sum()) * (h.size(1) // 2) * w.size(1)
    if name in ("sparse_attn", "sparse_attn_fp8"):  # q [B, S, H, D], idx [B, S, K]: QK^T, PV over valid entries
        q, idx = args[0], args[3]
        return 4.0 * float((idx >= 0).sum()) * q.size(-2) * q.size(-1)
    if name == "indexer_scores":  # q [B, S, H, D], k [B, T, D]
        q, k = args[0], args[1]
        return 2.0 * q.numel() * k.size(-2)
    return 0.0


def op_shape(name: str, args: tuple) -> str:
    """The call's problem size as text: M x N x K for GEMMs (P rows x N x K over E experts for the grouped
    one), tokens x heads x D over K slots for attention, tokens x heads x D over T keys for the indexer."""
    if name in ("fp8_gemm", "fp4_gemm", "linear", "act_quant_fp8_gemm"):
        a, w = args[0], args[1] if name in ("linear", "act_quant_fp8_gemm") else args[2]
        return f"{a.numel() // max(a.size(-1), 1)}x{w.size(0)}x{a.size(-1)}"
    if name == "grouped_gemm":  # P pairs (e's rows; with topk > 1 a holds one row per token)
        a, e, w = args[0], args[2], args[3]
        return f"{e.numel()}x{w.size(1)}x{a.size(1)} E{w.size(0)}"
    if name == "swiglu_grouped_gemm":
        h, e, w = args[0], args[3], args[4]
        return f"{e.numel()}x{w.size(1)}x{h.size(1) // 2} E{w.size(0)}"
    if name == "fp8_grouped_linear":
        x, w = args[0], args[1]
        return f"{x.size(0)}x{w.size(0) // x.size(1)}x{x.size(2)} G{x.size(1)}"
    if name in ("sparse_attn", "sparse_attn_fp8"):
        q, idx = args[0], args[3]
        return f"{q.numel() // (q.size(-1) * q.size(-2))}t {q.size(-2)}h D{q.size(-1)} K{idx.size(-1)}"
    if name == "indexer_scores":
        q, k = args[0], args[1]
        return f"{q.numel() // (q.size(-1) * q.size(-2))}t {q.size(-2)}h D{q.size(-1)} T{k.size(-2)}"
    return ""


def _view_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


def op_bytes(args: tuple, kwargs: dict, out) -> int:
    """Bytes one call's tensors hold: each distinct argument view once (the same view passed twice counts once),
    then each result that is not one of them, at numel x element size (a strided view counts the elements it
    addresses, not the memory it spans). Read from the tensors' metadata only (no device sync).

    The time to move these bytes once at the copy bandwidth is what a single pass over the op's operands takes.
    It bounds the op's own bytes floor from above where the op reads all of its inputs (elementwise ops, norms,
    the mHC mixes), so the op's time over it is then at most its times-floor: a row at 4x is at least 4x its
    floor. An op that reads a few rows of a large argument (a cache it gathers from or writes a few slots of)
    counts the whole argument and looks faster than it is; one that reads and rewrites a buffer in place
    counts it once."""
    seen: set = set()
    total = 0
    for t in _tensors(args) + _tensors(kwargs) + _tensors(out):
        k = _view_key(t)
        if k not in seen:
            seen.add(k)
            total += t.numel() * t.element_size()
    return total


OPS = ("fp8_gemm", "fp4_gemm", "grouped_gemm", "fp8_grouped_linear", "linear", "sparse_attn", "sparse_attn_fp8",
       "indexer_scores", "act_quant_fp8_gemm", "swiglu_grouped_gemm")

FP8_CEILING_OPS = ("fp8_gemm", "fp4_gemm", "grouped_gemm", "act_quant_fp8_gemm", "swiglu_grouped_gemm")
"""Ops held against the measured FP8 matmul rate (the issue's yardstick, even where a kernel runs bf16
MMAs); every other op against the bf16 rate. `summarize` and `ab --bench` both use this."""


@contextlib.contextmanager
def op_rates(names: tuple[str, ...] | None = OPS):
    """Wrap `names` in the dispatcher; yields a list that `summarize` turns into per-op rows. names=None wraps
    every op the dispatcher has resolved for a prefill so far (run one first): the whole pass, op by op.

    Only the outermost op of a nest is timed: an op whose implementation calls other ops through the dispatcher
    counts once, with their time inside its own, so the rows add up to the ops' share of the pass."""
    calls: list[tuple[str, torch.cuda.Event, torch.cuda.Event, tuple, dict]] = []
    if names is None:  # the resolved ops, each under its prefill key (a phase-split entry: its prefill backend)
        keys = {k if isinstance(k, str) else k[0]: k for k in ops._cache
                if isinstance(k, str) or k[1] == "prefill"}
        saved = {n: ops._cache[k] for n, k in keys.items()}
        if not saved:
            raise RuntimeError("op_rates(None): the dispatcher has resolved no op yet; run the pass once first")
    else:
        prev, ops.phase = ops.phase, "prefill"  # what it times; a phase-split map entry resolves as in a prefill
        try:
            saved = {n: ops.resolve(n) for n in names}
        finally:
            ops.phase = prev
        keys = {n: (n, "prefill") if n in ops._phased else n for n in names}
    depth = [0]

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if depth[0]:  # inside another timed op: part of its time
                return fn(*args, **kwargs)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            depth[0] += 1
            try:
                s.record()
                out = fn(*args, **kwargs)
                e.record()
            finally:
                depth[0] -= 1
            # only the compute ops' arguments are kept (FLOPs, shape): the others' are not kept alive to the end
            nbytes = op_bytes(args, kwargs, out)
            calls.append((name, s, e, args, kwargs, nbytes) if name in OPS else (name, s, e, (), {}, nbytes))
            return out
        return timed

    for n, fn in saved.items():
        ops._cache[keys[n]] = wrap(n, fn)
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            ops._cache[keys[n]] = fn


def summarize(calls: list, fp8_rate: float | None, bf16_rate: float, bandwidth: float | None = None) -> list[dict]:
    """Per op: calls, ms, TFLOP/s and the ratio to the measured ceiling of its kind (`FP8_CEILING_OPS`), and
    the same per problem size under "shapes" (which GEMM of a layer falls short). "bytes": what its calls'
    tensors hold (`op_bytes`); with the copy `bandwidth` (bytes/s), "x_bytes": its time over the time to move
    those bytes once (for an op that reads all its inputs, at least its times-floor)."""
    torch.cuda.synchronize()
    rows: dict[str, dict] = {}
    for name, s, e, args, kwargs, nbytes in calls:
        ms, flops = s.elapsed_time(e), op_flops(name, args, kwargs)
        r = rows.setdefault(name, {"op": name, "calls": 0, "ms": 0.0, "flops": 0.0, "bytes": 0, "shapes": {}})
        sh = r["shapes"].setdefault(op_shape(name, args), {"shape": op_shape(name, args), "calls": 0, "ms": 0.0,
                                                           "flops": 0.0, "bytes": 0})
        for x in (r, sh):
            x["calls"] += 1
            x["ms"] += ms
            x["flops"] += flops
            x["bytes"] += nbytes
    out = []
    for r in sorted(rows.values(), key=lambda r: -r["ms"]):
        fp8 = r["op"] in FP8_CEILING_OPS and fp8_rate
        ceiling = fp8_rate if fp8 else bf16_rate
        r["shapes"] = sorted(r["shapes"].values(), key=lambda x: -x["ms"])
        for x in [r] + r["shapes"]:
            x["tflops"] = x["flops"] / (x["ms"] * 1e-3) / 1e12 if x["ms"] > 0 else 0.0
            x["of_ceiling"] = x["tflops"] * 1e12 / ceiling if ceiling else None
            x["x_bytes"] = x["ms"] * 1e-3 / (x["bytes"] / bandwidth) if bandwidth and x["bytes"] else None
        r["ceiling"] = "fp8" if fp8 else "bf16"
        r["compute"] = r["op"] in OPS  # an op with a FLOP count and a rate; the others are timed only
        out.append(r)
    return out


def _spin_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep` (a spin kernel), measured."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    s.record()
    torch.cuda._sleep(2_000_000)
    e.record()
    torch.cuda.synchronize(device)
    return 2_000_000 / max(s.elapsed_time(e), 1e-3)


HEAD_START = 1.5
"""The timed pass starts behind a spin of this many times the host's issue time of one prefill."""


def profile_prefill(model, cfg, P: int, device: torch.device, seed: int, fp8_rate: float | None,
                    bf16_rate: float, bandwidth: float | None = None) -> dict:
    """One warm P-token prefill with every op timed: {"total_ms", "ops": summarize(...) (each row's "compute": an op
    with a FLOP count; with the copy `bandwidth`, its "x_bytes"), "compute_ms" / "other_ops_ms" (the two kinds' sums), "outside_ops_ms" (the pass's time
    outside every op: torch glue between them), "host_issue_ms", "head_start_ms", "timed_issue_ms" (the host's
    issue of the timed pass, events included) and "host_caught_up" (it took longer than the head start: the GPU
    waited on the host, so the op times include launch gaps)}. The pass runs on one stream (no runner's lanes),
    so the rows add up.

    The prefill is host-bound (its Python side issues launches more slowly than the GPU runs them), so events
    around an op would time the host's launch gaps as well as the kernels. The timed pass is therefore queued
    behind a GPU spin of HEAD_START x the host's issue time of one prefill (measured on an untimed pass with the
    same events): the
    host has issued it all before the GPU gets there, and the events time the device. The pass never waits on
    the GPU (no host syncs in the prefill), so that holds unless the launch queue fills."""
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.randint(2, cfg.vocab_size, (1, P), generator=g).to(device)
    row = torch.zeros(1, dtype=torch.long, device=device)
    model.allocate(1, P + 1)
    model.prefill(ids, rows=row)  # warm-up: compiles every kernel at these shapes
    torch.cuda.synchronize()
    with op_rates(None):  # the host's issue time as the timed pass issues it: every op bracketed by its events
        t = time.perf_counter()
        model.prefill(ids, rows=row)
        host_ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    head_ms = HEAD_START * host_ms
    torch.cuda._sleep(int(head_ms * _spin_cycles_per_ms(device)))
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with op_rates(None) as calls:  # every op of the pass (the warm-up above resolved them)
        t = time.perf_counter()
        t0.record()
        model.prefill(ids, rows=row)
        t1.record()
        timed_issue_ms = (time.perf_counter() - t) * 1e3
    rows = summarize(calls, fp8_rate, bf16_rate, bandwidth)
    total = t0.elapsed_time(t1)
    return {"prompt_len": P, "total_ms": total, "ops": rows, "bandwidth_Bps": bandwidth, "host_issue_ms": host_ms, "head_start_ms": head_ms,
            "timed_issue_ms": timed_issue_ms, "host_caught_up": timed_issue_ms > head_ms,
            "compute_ms": sum(r["ms"] for r in rows if r["compute"]),
            "other_ops_ms": sum(r["ms"] for r in rows if not r["compute"]),
            "outside_ops_ms": total - sum(r["ms"] for r in rows)}
