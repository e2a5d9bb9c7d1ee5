"""Independent work of a decode step on a second CUDA stream.

A batch-1 decode step is ~170 small kernels in a row, most of them latency-bound (a few us of ramp and
drain each), so work that does not depend on its neighbours can run beside them: the shared expert
beside the routing and the routed experts, the compressors and the lightning indexer beside the q
projection. `fork(x)` gives a `Branch`: inside `with br:` ops are issued on the device's branch stream,
which first waits for everything issued so far on the current stream; `br.join(*outs)` makes the
current stream wait for the branch. Captured into a CUDA graph this is a fork / join of graph nodes, so
a replay runs both chains concurrently.

The results do not depend on it: the same kernels read the same inputs. The Triton backend's split-K
tile counters are per stream (`_common.tile_counters`), so concurrent kernels never share them.

Memory: a tensor allocated on the branch and read on the current stream is recorded for that stream
(`join`, and `memo` values created inside a branch: `record`), so the caching allocator does not hand
its memory to later branch work while the current stream may still read it. Inputs allocated on the
current stream need nothing: they are freed after the join, behind it on that stream.

Off (every op on the current stream) on CPU, while a debug capture is active (taps stay in issue
order), or with DEEPINFER_BRANCHES=0 (read per fork: A/B in fresh processes, tests).
"""

from __future__ import annotations

import os

import torch

from deepinfer.debug.capture import is_active

ENV = "DEEPINFER_BRANCHES"
_streams: dict[int, torch.cuda.Stream] = {}
_open: list["Branch"] = []  # branches whose `with` block is being issued (innermost last)


def enabled(x: torch.Tensor) -> bool:
    """Would `fork(x)` run on a second stream: x on CUDA, no debug capture, DEEPINFER_BRANCHES not 0."""
    return x.is_cuda and not is_active() and os.environ.get(ENV, "1") != "0"


def _stream(device: torch.device) -> torch.cuda.Stream:
    """The device's branch stream: one per device for the process, so a graph's warm-up and its capture
    use the same one (and the same split-K counters)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _streams.get(index)
    if s is None:
        s = _streams[index] = torch.cuda.Stream(device=index)
    return s


class Branch:
    """One fork of the current stream (see the module docstring); a no-op when `stream` is None."""

    def __init__(self, stream: torch.cuda.Stream | None):
        self.stream = stream
        self.origin: torch.cuda.Stream | None = None
        self._ctx = None

    @property
    def active(self) -> bool:
        """Work under `with` goes to a second stream (else it stays on the current one)."""
        return self.stream is not None

    def __enter__(self) -> "Branch":
        if self.stream is not None:
            origin = torch.cuda.current_stream(self.stream.device)
            if self.origin is None:
                self.origin = origin
            self.stream.wait_stream(origin)  # the branch sees everything issued before (each entry)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
            _open.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            _open.pop()
            self._ctx.__exit__(*exc)
            self._ctx = None

    def join(self, *outs):
        """The current stream waits for the branch's work; `outs` (tensors, tuples, None) are recorded for
        it. Returns outs[0] if one, else outs."""
        if self.stream is not None and self.origin is not None:
            self.origin.wait_stream(self.stream)
            for t in outs:
                _record(t, self.origin)
        return outs[0] if len(outs) == 1 else outs


def fork(x: torch.Tensor, on: bool = True) -> Branch:
    """A branch for work on x's device: a second stream when `on` and `enabled(x)`, else a no-op branch."""
    return Branch(_stream(x.device) if on and enabled(x) else None)


def _record(obj, stream: torch.cuda.Stream) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, (tuple, list)):
        for t in obj:
            _record(t, stream)


def record(obj):
    """Mark tensors made inside an open branch (e.g. a per-step memo another layer reads on the current
    stream) as used by the stream the branch forked from. No-op outside a branch. Returns obj."""
    if _open:
        _record(obj, _open[-1].origin)
    return obj
