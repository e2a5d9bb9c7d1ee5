"""Named tensor taps: the model calls `tap(name, tensor)` at stable points of the forward pass.

With no capture active, `tap` is one global load and a `None` check: the model runs exactly as without
the tool. Inside `capturing()`, each tapped tensor is copied (detached, cloned) at capture time, so later
in-place writes cannot change what was recorded. Names are documented in `dumps/README.md`.
"""

from __future__ import annotations

import contextlib
import re

import torch

_active: "Capture | None" = None


class Capture:
    """Collects tapped tensors in call order: `records` is a list of (name, tensor-on-CPU)."""

    def __init__(self, include: re.Pattern | None = None, prefix: str = ""):
        self.include = include
        self.prefix = prefix
        self.records: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        name = self.prefix + name
        if self.include is not None and not self.include.search(name):
            return
        self.records.append((name, t.detach().to("cpu", copy=True)))


def tap(name: str, t: torch.Tensor) -> None:
    """Record `t` under `name` when a capture is active; otherwise do nothing."""
    if _active is not None:
        _active.add(name, t)


def is_active() -> bool:
    return _active is not None


@contextlib.contextmanager
def capturing(include: str | re.Pattern | None = None, prefix: str = ""):
    """Activate a Capture for the block; nested captures are not supported (one at a time)."""
    global _active
    if _active is not None:
        raise RuntimeError("a tensor capture is already active")
    pat = re.compile(include) if isinstance(include, str) else include
    cap = Capture(pat, prefix)
    _active = cap
    try:
        yield cap
    finally:
        _active = None


def set_prefix(prefix: str) -> None:
    """Change the name prefix of the active capture (e.g. `step3.` for decode steps)."""
    if _active is not None:
        _active.prefix = prefix
