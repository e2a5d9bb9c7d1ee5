"""A step's static inputs and CUDA graphs per batch-size bucket: the one copy of what the decode runner
(`engine.runner.DecodeRunner`) and the speculative step (`engine.speculative.SpecStep`) share.

`StepGraphs(what, sizes, inputs, device, graphs)` holds, for each bucket b of `bucket_sizes(max_batch)`,
static buffers of the `inputs` ({name: (tail shape, dtype, padding value)}) with b rows, and in graph mode
one `torch.cuda.CUDAGraph` of `step(**buffers)`, after a warm-up on the capture stream (autotuning, lazily
built tables). All graphs share one memory pool; the largest bucket is captured first so the smaller ones
reuse its memory. `run(step, n, args)` copies n live rows into the smallest bucket >= n, pads the rest with
each input's padding value (the spare cache row, token 0, position 0: nothing live is touched) and replays
the graph, or, eager-bucketed, calls `step` on the padded buffers (the CPU tests check padding this way).

The step is issued inside the runner's `Lanes` (`deepinfer.model.branch`): the side streams the model's
forks run on, the same ones at warm-up, capture and in eager steps.

Nothing in a captured step may synchronise with the host (`.item()`, `.tolist()`, data-dependent shapes);
a failing capture raises `GraphCaptureError` naming the op (and backend) or the function that was running.
"""

from __future__ import annotations

import os
import traceback

import torch

from deepinfer.capture import is_active
from deepinfer.model.branch import Lanes
from deepinfer.ops import ops

CAPTURE_PRIORITY = -1
"""CUDA priority of the stream the graphs are captured on (lower is higher; 0, the default, is the lowest).
PyTorch instantiates graphs with the per-node priorities of their capture, so the main chain's kernels run at
this priority and the lanes' side streams (priority 0) below it: when both have blocks waiting for an SM, the
main chain's go first. At one priority, a batch-1 profile has the routing logits waiting behind the shared
expert's GEMM (more than twice as long as when issued ahead of it) and the routed w1|w3 running longer beside
it (docs/perf-log.md, "The batch-1 critical path: norm launches, routing, stream priority")."""


class GraphCaptureError(RuntimeError):
    """CUDA graph capture of a step failed (usually an op that synchronises with the host)."""


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


class Bucket:
    """Static input buffers [size, *tail] (and, in graph mode, the graph and its static output) of one size.
    The int64 row vectors share one [k, size] buffer: a full bucket loads them with one stack (one launch,
    not k copies)."""

    def __init__(self, size: int, inputs: dict, device):
        self.size, self.pads = size, {name: pad for name, (_, _, pad) in inputs.items()}
        packed = [name for name, (tail, dtype, _) in inputs.items() if tail == () and dtype == torch.long]
        self.io = torch.empty(len(packed), size, dtype=torch.long, device=device)
        self.bufs: dict[str, torch.Tensor] = {}
        for name, (tail, dtype, pad) in inputs.items():
            self.bufs[name] = self.io[packed.index(name)] if name in packed else \
                torch.empty(size, *tail, dtype=dtype, device=device)
            self.bufs[name].fill_(pad)
        self._packed = packed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None  # the graph's static output (a tensor or a tuple of them)

    def load(self, args: dict) -> None:
        """Live rows first (args: name -> [n, ...] tensors), each input's padding value after them."""
        n = next(iter(args.values())).size(0)
        if n == self.size and self._packed and all(
                args[k].dtype == torch.long and args[k].device == self.io.device for k in self._packed):
            torch.stack([args[k].reshape(n) for k in self._packed], out=self.io)
            rest = [k for k in args if k not in self._packed]
        else:
            rest = list(args)
        for k in rest:
            buf = self.bufs[k]
            buf[:n].copy_(args[k].reshape(buf[:n].shape))
            if n < self.size:
                buf[n:].fill_(self.pads[k])

    def pad_all(self) -> None:
        """Every row padding: warm-up and capture touch the spare row only."""
        for k, buf in self.bufs.items():
            buf.fill_(self.pads[k])


class StepGraphs:
    """The buckets of one step (module docstring). graphs: capture CUDA graphs (else eager-bucketed)."""

    def __init__(self, what: str, max_batch: int, inputs: dict, device, graphs: bool, lanes: Lanes,
                 warmup_iters: int = 2):
        self.what, self.max_batch, self.graphs = what, max_batch, graphs
        self.device, self.lanes, self.warmup_iters = torch.device(device), lanes, warmup_iters
        self.buckets = {b: Bucket(b, inputs, device) for b in bucket_sizes(max_batch)}
        self.captured = False

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{self.what} of {n} rows exceeds max_batch {self.max_batch}")

    @torch.inference_mode()
    def capture(self, step) -> None:
        """Warm up and capture every bucket's `step(**buffers)` (largest first, one shared pool)."""
        if not self.graphs or self.captured:
            return
        if is_active():
            raise GraphCaptureError(f"CUDA graphs cannot capture the {self.what} while a debug capture "
                                    "(dump/taps) is active: run with --eager")
        dev = self.device
        torch.cuda.synchronize(dev)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev, priority=CAPTURE_PRIORITY)
        for b in sorted(self.buckets, reverse=True):
            bk = self.buckets[b]
            bk.pad_all()
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side), self.lanes.issuing():  # warm-up outside the capture
                for _ in range(self.warmup_iters):
                    step(**bk.bufs)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            main = torch.cuda.current_stream(dev)
            try:
                with torch.cuda.graph(g, pool=pool, stream=side), self.lanes.issuing():
                    bk.out = step(**bk.bufs)
            except Exception as e:  # noqa: BLE001 - re-raised as one clear error
                # a failing capture_end skips the graph context's stream restore: put the stream back
                torch.cuda.set_stream(main)
                self._clear()
                raise GraphCaptureError(describe_capture_failure(e, b, self.what)) from e
            bk.graph = g
        torch.cuda.synchronize(dev)
        self.captured = True

    def _clear(self) -> None:
        for bk in self.buckets.values():
            bk.graph = bk.out = None
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass

    @torch.inference_mode()
    def run(self, step, args: dict):
        """`step` on n live rows (args: name -> [n, ...]) through the smallest bucket >= n -> its output's
        first n rows (a tensor or a tuple; copies of a graph's static output, which the next replay
        overwrites)."""
        n = next(iter(args.values())).size(0)
        bk = self.buckets[self.bucket_for(n)]
        bk.load(args)
        if not self.graphs:
            with self.lanes.issuing():
                return _rows(step(**bk.bufs), n, copy=False)
        if not self.captured:
            self.capture(step)
        bk.graph.replay()
        return _rows(bk.out, n, copy=True)


class GraphedStep:
    """What the decode runner and the speculative step share: a weak reference to their model (`engine.steps`),
    the allocation and backend they were built for, the lanes they issue on, and their `StepGraphs` (`steps`,
    None unless bucketed). Subclasses build `steps` and say which settings they serve (`valid_for`)."""

    def __init__(self, model, max_batch: int, graphs: bool, pad_to_buckets: bool):
        from deepinfer.engine.steps import model_ref

        self._model = model_ref(model)
        self.max_batch = max_batch
        self.graphs = bool(graphs) and model.device.type == "cuda"
        self.bucketed = self.graphs or pad_to_buckets
        self.lanes = Lanes(model.device)
        self._allocation = model.rope  # `allocate` builds new RopeTables (and new caches)
        self._backend = ops.describe()  # the backend and the per-op map the graphs captured
        self.steps: StepGraphs | None = None

    @property
    def model(self):
        return self._model()

    @property
    def buckets(self) -> dict:
        return self.steps.buckets if self.steps is not None else {}

    @property
    def captured(self) -> bool:
        return self.steps is not None and self.steps.captured

    def same_build(self, model, graphs: bool) -> bool:
        """Built for this model's current allocation, the current backend and per-op map, and this mode."""
        want_graphs = bool(graphs) and model.device.type == "cuda"
        return (model is self.model and model.rope is self._allocation and ops.describe() == self._backend
                and want_graphs == self.graphs)


def _rows(out, n: int, copy: bool):
    if isinstance(out, tuple):
        return tuple(_rows(t, n, copy) for t in out)
    return out[:n].clone() if copy else out[:n]


# ---------------------------------------------------------------------------------------- capture errors
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


_PLUMBING = ("engine/graphs.py", "engine/runner.py", "engine/speculative.py", "engine/prefill_runner.py",
             "model/transformer.py")


def describe_capture_failure(e: BaseException, bucket: int | str, what: str = "decode step") -> str:
    """One line: where capture failed (registered op + backend, else the innermost deepinfer function). bucket:
    the batch bucket, or a description of what else keys the graph (a prefill chunk's length and start)."""
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
                     and not f.filename.endswith(_PLUMBING)), None)
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
    key = f"batch bucket {bucket}" if isinstance(bucket, int) else bucket
    # the known cause where it applies: the torch reference's grouped_gemm reads routing counts on the host
    hint = ("; the torch reference's grouped_gemm syncs: put it on a kernel backend (--backend triton)"
            if ops.backend_of("grouped_gemm") == "torch" else "")
    off = "run without --prefill-graphs" if "prefill" in what else "run with --eager to disable CUDA graphs"
    return (f"CUDA graph capture of the {what} ({key}) failed in "
            f"{where or f'the {what} (backend {ops.backend!r})'}: {type(original).__name__}: {msg.rstrip('.')}. "
            f"Graph mode needs every op of the {what} to run without a host sync or copy{hint}; {off}")


def _short(path: str, root: str) -> str:
    return os.path.relpath(path, root) if path.startswith(root) else path
