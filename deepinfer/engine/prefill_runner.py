"""Prefill with the host off the critical path: a prompt chunk replayed as a CUDA graph (opt-in).

`PrefillRunner.prefill(input_ids [1, S], rows [1], start) -> (logits [1, 1 or S, V] f32, streams [1, S, hc, D])`,
the same contract as `Transformer.prefill`.

A prefill is issued launch by launch from Python: at flash shapes its host issue time is nearly its device time,
so faster kernels cannot show (docs/perf-log.md). A graph replays the whole chunk with one launch. Its key is
(S, start, all_logits): the positions (start .. start+S-1), and with them which cache slots and compressed
entries the chunk reads and writes, are fixed per key; the tokens and the cache row are the graph's inputs. A
key is reused by every prompt chunk of that length at that start, on any row: whole prompts of a bucket's
length (start 0), and chunked prefill of long prompts (chunks of C tokens at 0, C, 2C, ...).

The first call of a key runs eagerly -- the real call, and the warm-up (autotuning, lazily built tables, the
one-time host reads of weight facts) -- then the key is captured: capture records the launches without running
them, so nothing is computed twice. Later calls of the key copy their tokens and row into the graph's inputs and
replay it; the outputs are copied out (the next replay overwrites them).

What runs eagerly, and says so once per reason on stderr: a chunk length outside `sizes`, more than one row, a
debug capture (taps), more keys than `max_graphs`, and everything after a failed capture (the error names the
op, as the decode runner's). Graphs need CUDA and a kernel backend (the torch reference's MoE reads routing
counts on the host); elsewhere the runner is a plain pass-through. The graphs bake in the model's cache
addresses and the backend: a runner serves one allocation and one op map (`valid_for`).
"""

from __future__ import annotations

import sys

import torch

from deepinfer.capture import is_active
from deepinfer.engine.graphs import CAPTURE_PRIORITY, GraphedStep, describe_capture_failure

PREFILL_SIZES = (256, 512, 1024, 2048, 4096, 8192)
"""Chunk lengths captured by default: powers of two, so a scheduler chunk of C = 2^k tokens and whole prompts of
those lengths replay."""


class _Graph:
    """One captured key: static inputs (ids [1, S], rows [1]) and outputs (logits, streams)."""

    def __init__(self, graph, ids, rows, out):
        self.graph, self.ids, self.rows, self.out = graph, ids, rows, out


class PrefillRunner(GraphedStep):
    """The prefill of one model allocation (module docstring).

    graphs: replay captured chunks (CUDA only; False: every call is `model.prefill`).
    sizes: the chunk lengths that are captured. max_graphs: at most this many keys are kept.
    """

    def __init__(self, model, graphs: bool = True, sizes: tuple = PREFILL_SIZES, max_graphs: int = 16):
        super().__init__(model, 1, graphs, False)
        if any(s < 1 for s in sizes) or max_graphs < 1:
            raise ValueError(f"prefill graph sizes {sizes} and max_graphs {max_graphs} must be >= 1")
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None
        self._side = None  # the stream a key's first (eager) call and its capture run on: the same one, so the
        # libraries' per-stream state (cuBLAS workspaces) exists before the capture, as StepGraphs warms up
        self.capture_error: str | None = None
        self.replays = self.eager_calls = 0
        self._said: set[str] = set()

    @property
    def keys(self) -> list[tuple]:
        """The captured keys (S, start, all_logits), in capture order."""
        return list(self._graphs)

    def valid_for(self, model, graphs: bool) -> bool:
        return self.same_build(model, graphs)

    def _eager_reason(self, B: int, S: int) -> str | None:
        if not self.graphs:
            return None  # a pass-through runner says nothing
        if self.capture_error is not None:
            return f"prefill graphs are off after a failed capture: {self.capture_error}"
        if B != 1:
            return f"prefill of {B} rows runs eagerly (graphs capture one row's chunk)"
        if S not in self.sizes:
            return (f"prefill chunks outside the captured lengths ({', '.join(map(str, self.sizes))} tokens) run "
                    f"eagerly, e.g. {S}")
        if is_active():
            return "prefill runs eagerly while a debug capture (dump/taps) is active"
        return None

    def _say(self, why: str) -> None:
        kind = why.split(",")[0].split(":")[0]
        if kind not in self._said:
            self._said.add(kind)
            print(f"deepinfer: {why}", file=sys.stderr)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, rows: torch.Tensor | None = None, all_logits: bool = False,
                start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        B, S = input_ids.shape
        rows = torch.arange(B, device=m.device) if rows is None else rows.to(m.device)
        why = self._eager_reason(B, S)
        key = (S, int(start), bool(all_logits))
        g = self._graphs.get(key)
        if why is None and self.graphs and g is None and len(self._graphs) >= self.max_graphs:
            why = f"prefill keys beyond the first {self.max_graphs} captured run eagerly, e.g. {S} tokens at {start}"
        if why is not None or not self.graphs:
            if why is not None:
                self._say(why)
            self.eager_calls += 1
            return m.prefill(input_ids, rows, all_logits, start)
        if g is None:
            dev = m.device
            if self._side is None:
                self._side = torch.cuda.Stream(device=dev, priority=CAPTURE_PRIORITY)
            main = torch.cuda.current_stream(dev)
            self._side.wait_stream(main)
            with torch.cuda.stream(self._side):
                out = m.prefill(input_ids, rows, all_logits, start)  # the real call, and the warm-up
            main.wait_stream(self._side)
            for t in out:
                t.record_stream(main)
            self.eager_calls += 1
            self._capture(key, input_ids, rows)
            return out
        g.ids.copy_(input_ids.to(m.device), non_blocking=True)
        g.rows.copy_(rows, non_blocking=True)
        g.graph.replay()
        self.replays += 1
        return tuple(t.clone() for t in g.out)

    def _capture(self, key: tuple, input_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Record `model.prefill` of key (S, start, all_logits) on static inputs; a failure turns graphs off,
        names the op once and leaves every later call eager (the call that was just made stands)."""
        m, dev = self.model, self.model.device
        S, start, all_logits = key
        ids = input_ids.to(dev).clone()
        rws = rows.clone()
        torch.cuda.synchronize(dev)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = self._side
        side.wait_stream(torch.cuda.current_stream(dev))
        g = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(dev)
        try:
            with torch.cuda.graph(g, pool=self._pool, stream=side):
                out = m.prefill(ids, rws, all_logits, start)
        except Exception as e:  # noqa: BLE001 - reported once, then eager
            torch.cuda.set_stream(main)  # a failing capture_end skips the context's stream restore
            try:
                torch.cuda.synchronize(dev)
            except Exception:  # noqa: BLE001 - the capture error is the one to report
                pass
            self.capture_error = describe_capture_failure(e, f"{S} tokens at position {start}", "prefill chunk")
            self._say(f"prefill graphs are off after a failed capture: {self.capture_error}")
            return
        torch.cuda.synchronize(dev)
        self._graphs[key] = _Graph(g, ids, rws, out)


def prefill_runner(model, graphs: bool, sizes: tuple = PREFILL_SIZES) -> PrefillRunner:
    """The model's prefill runner for these settings, kept beside its decode runner (`engine.steps`) and
    rebuilt when the allocation, the backend or the mode changed."""
    from deepinfer.engine.steps import steps_of

    held = steps_of(model)
    r = held.get("prefill")
    if r is None or not r.valid_for(model, graphs) or r.sizes != tuple(sorted(set(sizes))):
        r = held["prefill"] = PrefillRunner(model, graphs, sizes)
    return r
