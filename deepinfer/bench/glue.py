"""The torch ops a model step runs between its registry ops: each one a kernel launch of its own on a GPU (a
boundary a decode step pays, ~2-4 us on the critical path), invisible to the registry's op count.

`TorchGlue` is a dispatch mode that counts, while `ops.count_calls` is on (which marks each registry op's span),
the ATen ops called outside any registry op that launch work: an op that writes one of its inputs (`copy_`,
`index_put_`, `clamp_min_`) or returns a tensor in fresh memory (a gather, an arithmetic result, `zeros`). Views,
no-op conversions (`x.to(x.dtype)`) and bare allocations (`empty`) launch nothing and are not counted. Each op is
counted by the model line that called it, so a count names what to fuse.
"""

from __future__ import annotations

import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.ops import ops

ALLOCATIONS = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                         "aten::new_empty_strided", "aten::lift_fresh"})
"""Ops that return fresh memory without running a kernel."""


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def launches(func, args, kwargs, out) -> bool:
    """Does ATen op `func`, called with args / kwargs and returning out, run a kernel of its own?"""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return True  # in place or out=: it writes
    if schema.name in ALLOCATIONS:
        return False
    outs = _tensors(out)
    if not outs:
        return False  # a scalar read (a host sync, not a launch the step issues)
    ins = {_storage(t) for t in _tensors(args) + _tensors(list((kwargs or {}).values())) if t.numel()}
    return any(t.numel() and _storage(t) not in ins for t in outs)


def _site() -> str:
    """The innermost deepinfer line outside this module and the registry: where the model called the op."""
    for f in reversed(traceback.extract_stack()):
        fn = f.filename.replace("\\", "/")
        if "/deepinfer/" in fn and not fn.endswith(("/bench/glue.py", "/ops/registry.py")):
            return f"{fn.rsplit('/deepinfer/', 1)[1]}:{f.lineno}"
    return "?"


class TorchGlue(TorchDispatchMode):
    """Counts the launching ATen ops called outside registry ops: `.counts` {(site, op): calls}. Use inside
    `ops.count_calls(True)` ... `ops.count_calls(False)`, which marks the registry ops' spans."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if ops.depth == 0 and launches(func, args, kwargs, out):
            self.counts[(_site(), func._schema.name.removeprefix("aten::"))] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_site(self) -> dict[str, int]:
        """{"site op": calls}, most first."""
        return {f"{s} {o}": n for (s, o), n in self.counts.most_common()}


class Launches:
    """What `counting()` saw: `ops` {registry op: calls} (filled when the block ends) and `glue`, the TorchGlue."""

    def __init__(self):
        self.ops: dict = {}
        self.glue = TorchGlue()


@contextmanager
def counting():
    """Count the block's registry ops (`ops.count_calls`) and the torch launches between them (`TorchGlue`):
    `with counting() as n: step()`, then n.ops and n.glue. Counting is off again when the block ends."""
    n = Launches()
    ops.count_calls(True)
    try:
        with n.glue:
            yield n
    finally:
        n.ops = ops.count_calls(False) or {}
