"""Independent work of a decode step on a second CUDA stream.

A batch-1 decode step is ~170 small kernels in a row, most of them latency-bound (a few us of ramp and
drain each), so work that does not depend on its neighbours can run beside them: hc_pre's Sinkhorn comb
beside the sub-layer (only hc_post reads it), the shared expert beside the routing and the routed
experts, the compressors and the lightning indexer beside the q projections.

The model writes its order once and marks such work with `fork(x, lane=...)`, which gives a `Branch`:
inside `with br:` ops are issued on the lane's stream, which first waits for everything issued so far on
the current stream; `br.join(*outs)` makes the current stream wait for the branch. The streams belong to the
runner that issues the step, not to the model (as nano-vllm's runner owns its graphs): a `Lanes` holds one
device's side streams, and only inside `with lanes.issuing():` does a fork leave the current stream. Captured
into a CUDA graph this is a fork / join of graph nodes, so a replay runs both chains concurrently.
Outside a runner's `issuing` (a direct `model.decode`, the debug tools) every fork is a no-op and the model
runs its order on one stream.

The results do not depend on it: the same kernels read the same inputs. The Triton backend's split-K
tile counters are per stream (`_common.tile_counters`), so concurrent kernels never share them.

Memory: a tensor allocated on a branch and read on another stream is recorded for that stream (`join`,
and per-step memos made inside a branch: `Shared`, which also orders the read after the write), so the
caching allocator does not hand its memory to later branch work while the other stream may still read
it. Inputs allocated on the origin stream need nothing: they are freed after the join, behind it.

Off (every op on the current stream) on CPU, while a debug capture is active (taps stay in issue
order), or with DEEPINFER_BRANCHES=0 (read per fork: A/B in fresh processes, tests).
"""

from __future__ import annotations

import contextlib

import torch

from deepinfer import settings
from deepinfer.capture import is_active

ENV = "DEEPINFER_BRANCHES"
_issuing: "Lanes | None" = None  # the lanes of the step being issued (`Lanes.issuing`)
_open: list["Branch"] = []  # branches whose `with` block is being issued (innermost last)


def enabled(x: torch.Tensor) -> bool:
    """Could a fork of x run on a second stream: x on CUDA, no debug capture, DEEPINFER_BRANCHES not 0 (whether
    it does also needs a runner's `Lanes.issuing`)."""
    return x.is_cuda and not is_active() and settings.flag(ENV)


class Lanes:
    """The side streams a runner issues one device's steps on: one per `lane_stream` name, made on first use
    and kept, so a graph's warm-up and its capture use the same streams (and the same split-K counters)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._streams: dict[str, torch.cuda.Stream] = {}

    def stream(self, name: str) -> torch.cuda.Stream:
        s = self._streams.get(name)
        if s is None:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            s = self._streams[name] = torch.cuda.Stream(device=index)
        return s

    @contextlib.contextmanager
    def issuing(self):
        """Forks made inside run on these lanes' streams (those of a CUDA tensor on this device)."""
        global _issuing
        prev, _issuing = _issuing, self
        try:
            yield self
        finally:
            _issuing = prev


class Branch:
    """One fork of the current stream (see the module docstring); a no-op when `stream` is None."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self._ctx = None
        self._entered = False  # join waits only for a branch that was entered (issued work)

    @property
    def active(self) -> bool:
        """Work under `with` goes to a second stream (else it stays on the current one)."""
        return self.stream is not None

    def __enter__(self) -> "Branch":
        if self.stream is not None:
            # the branch sees everything issued before on the stream it forks from (at each entry)
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
            _open.append(self)
            self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            _open.pop()
            self._ctx.__exit__(*exc)
            self._ctx = None

    def join(self, *outs):
        """The current stream (the fork's origin, or another branch) waits for this branch's work; `outs`
        (tensors, tuples, None) are recorded for it. Returns outs[0] if one, else outs. A branch never entered
        (an op that ignored its `side`, e.g. the reference) is not waited for: in a graph capture that
        stream never joined the capture, and waiting on it fails ("dependency created on uncaptured work in
        another stream")."""
        if self.stream is not None and self._entered:
            cur = torch.cuda.current_stream(self.stream.device)
            cur.wait_stream(self.stream)
            for t in outs:
                _record(t, cur)
        return outs[0] if len(outs) == 1 else outs


def lane_stream(lane: str) -> str:
    """The stream a lane's branches run on: two side streams, hc's comb (one program per token running ~20
    Sinkhorn rounds, a long serial chain) on its own, every other lane on one side stream in issue order.
    On one stream with the rest, the comb, issued first, held back the shared expert queued behind it (a
    batch-1 profile: the shared expert's w1|w3 began only after the comb, and that chain then set the end of
    each MoE sub-layer; docs/perf-log.md, "The batch-1 critical path: norm launches, routing, stream
    priority"). A stream per lane was slower: the main chain is latency-bound, and every kernel running beside
    it slows it (docs/perf-log.md, "Decode on two streams")."""
    return "hc" if lane == "hc" else "side"


def fork(x: torch.Tensor, on: bool = True, lane: str = "side") -> Branch:
    """A branch for work on x's device: the stream of `lane` (`lane_stream`) of the lanes being issued when `on`,
    `enabled(x)` and a runner is issuing the step on x's device (`Lanes.issuing`), else a no-op branch."""
    lanes = _issuing
    if not (on and lanes is not None and enabled(x) and _same_device(lanes.device, x.device)):
        return Branch(None)
    return Branch(lanes.stream(lane_stream(lane)))


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def _record(obj, stream: torch.cuda.Stream) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, (tuple, list)):
        for t in obj:
            _record(t, stream)


class Shared:
    """A value (tensors, tuples of them) made once and read from several streams: a step's memo.

    Made inside a branch, it remembers that stream and an event recorded right after it; a read from any
    other stream waits for the event first (in a CUDA graph: an edge), and records the tensors for that
    stream (the allocator keeps their memory until its reads are done). Made on a fork's origin, nothing is
    needed: branches forked later see it, and it outlives every join."""

    __slots__ = ("value", "stream", "event")

    def __init__(self, value):
        self.value, self.stream, self.event = value, None, None
        if _open:
            self.stream = _open[-1].stream
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def get(self):
        if self.event is not None:
            cur = torch.cuda.current_stream(self.stream.device)
            if cur != self.stream:
                cur.wait_event(self.event)
                _record(self.value, cur)
        return self.value
