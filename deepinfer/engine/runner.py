"""The decode step: eager, or CUDA graphs captured per batch-size bucket.

`DecodeRunner.decode(input_ids [n, 1], positions [n], rows [n]) -> logits [n, V] float32`.

* eager (default): calls `model.decode` on the live batch as it is.
* graphs (CUDA only): for each bucket b in 1, 2, 4, ..., up to `max_batch` (and `max_batch` itself when
  it is not a power of two) static buffers input_ids [b, 1], positions [b], rows [b] are allocated and
  one `model.decode` is captured into a `torch.cuda.CUDAGraph`, after a warm-up on a side stream
  (autotuning, lazily built tables). All graphs share one memory pool (`graph_pool_handle`); the
  largest bucket is captured first so the smaller ones reuse its memory. A step of n live rows replays
  the smallest bucket >= n after copying the batch into the buffers' first n entries.
* padding: the remaining b - n entries decode token 0 at position 0 into a dedicated spare cache row
  (the model's last row: allocate `max_batch + 1` rows), so they never touch a live sequence; their
  logits are ignored. Warm-up and capture also run only on the spare row.
* `pad_to_buckets=True` without graphs runs the same bucket / padding / spare-row path eagerly (how the
  CPU tests check that padding does not change the live rows' logits).

Nothing in the captured step may synchronise with the host (`.item()`, `.tolist()`, `torch.unique`,
data-dependent shapes). If capture fails, `GraphCaptureError` names the op (and backend) or the model
function that was running and suggests `--eager`. Sampling and logprobs run outside the graph on its
output logits.

The graphs bake in the addresses of the model's caches: a runner belongs to one `model.allocate` (see
`valid_for`); re-allocating the model needs a new runner.
"""

from __future__ import annotations

import os
import traceback

import torch

from deepinfer.capture import is_active
from deepinfer.ops import ops

CAPTURE_PRIORITY = -1
"""CUDA priority of the stream the decode graphs are captured on (lower is higher; 0, the default, is the
lowest). PyTorch instantiates graphs with the per-node priorities of their capture, so the main chain's kernels
run at this priority and the branch streams' (`deepinfer.model.branch`, priority 0) below it: when both have
blocks waiting for an SM, the main chain's go first. At one priority, a batch-1 profile has the routing
logits waiting behind the shared expert's GEMM (more than twice as long as when issued ahead of it) and the
routed w1|w3 running longer beside it (docs/perf-log.md, "The batch-1 critical path: norm launches, routing,
stream priority")."""


class GraphCaptureError(RuntimeError):
    """CUDA graph capture of the decode step failed (usually an op that synchronises with the host)."""


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch, plus max_batch itself when it is not a power of two."""
    if max_batch < 1:
        raise ValueError(f"max_batch {max_batch}: must be at least 1")
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b *= 2
    if out[-1] != max_batch:
        out.append(max_batch)
    return out


class _Bucket:
    """Static buffers (and, in graph mode, the captured graph) for one batch size."""

    def __init__(self, size: int, spare_row: int, device):
        self.size = size
        # one [3, size] buffer: a full bucket loads its inputs with one stack (one launch, not three copies)
        self.io = torch.zeros(3, size, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.rows = self.io[0].view(size, 1), self.io[1], self.io[2]
        self.rows.fill_(spare_row)
        self.spare_row = spare_row
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # [size, V] static output of the graph

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Live rows first, padding (token 0, position 0, the spare row) after them."""
        n = input_ids.size(0)
        parts = (input_ids.view(n), positions.view(n), rows.view(n))
        if n == self.size and all(t.dtype == torch.long and t.device == self.io.device for t in parts):
            torch.stack(parts, out=self.io)
            return
        self.input_ids[:n].copy_(input_ids.view(n, 1))
        self.positions[:n].copy_(positions.view(n))
        self.rows[:n].copy_(rows.view(n))
        if n < self.size:
            self.input_ids[n:].zero_()
            self.positions[n:].zero_()
            self.rows[n:].fill_(self.spare_row)


class DecodeRunner:
    """Owns the decode step of one model allocation.

    model: a `Transformer` allocated with at least `max_batch + 1` rows (the last one is the spare row).
    graphs: capture CUDA graphs (needs a CUDA model; ignored with a reason in `mode` otherwise).
    pad_to_buckets: bucket and pad like graph mode but run eagerly (testing / debugging).
    """

    def __init__(self, model, max_batch: int, graphs: bool = False, pad_to_buckets: bool = False,
                 warmup_iters: int = 2):
        self.model, self.max_batch = model, max_batch
        self.graphs = bool(graphs) and model.device.type == "cuda"
        self.bucketed = self.graphs or pad_to_buckets
        self.warmup_iters = warmup_iters
        self.buckets: dict[int, _Bucket] = {}
        self._allocation = model.rope  # `allocate` builds new RopeTables (and new caches)
        self._backend = ops.describe()  # the backend and the per-op map the graphs captured
        self.captured = False
        if self.bucketed:
            if model.rows < max_batch + 1:
                raise ValueError(f"bucketed decode needs {max_batch + 1} cache rows (max_batch + 1 spare); "
                                 f"the model has {model.rows}")
            self.spare_row = model.rows - 1
            for b in bucket_sizes(max_batch):
                self.buckets[b] = _Bucket(b, self.spare_row, model.device)

    @property
    def mode(self) -> str:
        return "graphs" if self.graphs else "eager-bucketed" if self.bucketed else "eager"

    def valid_for(self, model, max_batch: int, graphs: bool, pad_to_buckets: bool = False) -> bool:
        """Can this runner serve these settings (same allocation, backend and mode; graphs: up to the
        captured max_batch, so a smaller batch does not re-capture; otherwise the same max_batch)?"""
        want_graphs = bool(graphs) and model.device.type == "cuda"
        if not (model is self.model and model.rope is self._allocation and ops.describe() == self._backend
                and want_graphs == self.graphs):
            return False
        if self.graphs:
            return max_batch <= self.max_batch
        return max_batch == self.max_batch and pad_to_buckets == self.bucketed

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} rows exceeds max_batch {self.max_batch}")

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket (largest first, one shared pool). No-op unless graphs."""
        if not self.graphs or self.captured:
            return
        if is_active():
            raise GraphCaptureError("CUDA graphs cannot capture the decode step while a debug capture "
                                    "(dump/taps) is active: run with --eager")
        dev = self.model.device
        torch.cuda.synchronize(dev)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev, priority=CAPTURE_PRIORITY)
        for b in sorted(self.buckets, reverse=True):
            bk = self.buckets[b]
            bk.load(bk.input_ids[:0], bk.positions[:0], bk.rows[:0])  # all padding: the spare row only
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up (autotuning, lazy tables) outside the capture
                for _ in range(self.warmup_iters):
                    self.model.decode(bk.input_ids, bk.positions, bk.rows)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            main = torch.cuda.current_stream(dev)
            try:
                with torch.cuda.graph(g, pool=pool, stream=side):
                    out = self.model.decode(bk.input_ids, bk.positions, bk.rows)
                    bk.logits = out[:, -1]
            except Exception as e:  # noqa: BLE001 - re-raised as one clear error
                # a failing capture_end skips the graph context's stream restore: put the stream back
                torch.cuda.set_stream(main)
                self._clear()
                raise GraphCaptureError(_describe_capture_failure(e, b)) from e
            bk.graph = g
        torch.cuda.synchronize(dev)
        self.captured = True

    def _clear(self) -> None:
        for bk in self.buckets.values():
            bk.graph = bk.logits = None
        try:
            torch.cuda.synchronize(self.model.device)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """input_ids [n, 1] int64, positions [n], rows [n] (device tensors) -> logits [n, V] float32."""
        n = input_ids.size(0)
        if not self.bucketed:
            return self.model.decode(input_ids.view(n, 1), positions, rows=rows)[:, -1]
        if self.model.rope is not self._allocation:
            raise RuntimeError("the model was re-allocated after this DecodeRunner was built: make a new one")
        bk = self.buckets[self.bucket_for(n)]
        bk.load(input_ids, positions, rows)
        if not self.graphs:
            return self.model.decode(bk.input_ids, bk.positions, rows=bk.rows)[:n, -1]
        if not self.captured:
            self.capture()
        bk.graph.replay()
        # the static output is overwritten by the next replay: hand out a copy
        return bk.logits[:n].clone()


def _op_codes() -> dict:
    """code object -> (op name, backend) for every registered op implementation."""
    from deepinfer.ops.registry import REGISTRY, _ensure_reference

    _ensure_reference()
    out = {}
    for name, d in REGISTRY.items():
        for backend, fn in d.impls.items():
            code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
            if code is not None:
                out.setdefault(code, (name, backend))
    return out


def _chain(e: BaseException) -> list[BaseException]:
    """The exception and the ones it happened while handling, oldest first."""
    seen, out = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out[::-1]


def _describe_capture_failure(e: BaseException, bucket: int) -> str:
    """One line: where capture failed (registered op + backend, else the innermost deepinfer function)."""
    codes = _op_codes()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    where = None
    original = e
    for ex in _chain(e):  # the oldest exception is the one raised inside the captured step
        frames = traceback.extract_tb(ex.__traceback__)
        tb = ex.__traceback__
        codes_in_tb = []
        while tb is not None:
            codes_in_tb.append(tb.tb_frame.f_code)
            tb = tb.tb_next
        pairs = list(zip(codes_in_tb, frames))[::-1]  # innermost first
        op = next(((codes[c], f) for c, f in pairs if c in codes), None)
        ours = next(((c, f) for c, f in pairs
                     if ("deepinfer" in f.filename or "kernels" in f.filename)
                     and not f.filename.endswith(("engine/runner.py", "model/transformer.py"))), None)
        if op is not None:
            (name, backend), f = op
            where = f"op {name!r} (backend {backend!r}, {_short(f.filename, root)}:{f.lineno})"
        elif ours is not None:
            c, f = ours
            qual = getattr(c, "co_qualname", f.name)
            where = f"{qual} ({_short(f.filename, root)}:{f.lineno}; backend {ops.backend!r})"
        if where is not None:
            original = ex
            break
    msg = str(original).strip().splitlines()[0] if str(original).strip() else type(original).__name__
    return (f"CUDA graph capture of the decode step (batch bucket {bucket}) failed in "
            f"{where or f'the decode step (backend {ops.backend!r})'}: {type(original).__name__}: {msg}. "
            "Graph mode needs every op of the decode step to run without a host sync (the torch "
            "reference MoE, grouped_gemm, syncs: use a kernel backend, --backend triton); "
            "run with --eager to disable CUDA graphs")


def _short(path: str, root: str) -> str:
    return os.path.relpath(path, root) if path.startswith(root) else path
