"""A routing shared by several expert GEMMs: the scope in which a backend may sort the pairs once.

A MoE layer's routed experts run two or three `grouped_gemm`s (w1|w3, or w1 and w3, then w2) on the same (row,
expert) pairs `e`. A kernel backend that sorts the pairs into expert blocks before its GEMM (Triton's `align`: 3
launches, on the layer's critical path) would sort them once per GEMM. Inside `same_routing(e)` the caller promises
that this very tensor is not changed, so `routing_memo(e, key, make)` makes a value once per key and scope. Outside
a scope, or for another tensor, it makes it every call: nothing is assumed about an `e` nobody vouched for (an
inference tensor has no version counter to check). A scope may also vouch that every row has a local expert
(`every_row_local`: all experts on this process), so a backend need not zero rows no expert computes.

    with same_routing(e):
        h = ops.grouped_gemm(a, a_s, e, w13, w13_s)
        y = ops.swiglu_grouped_gemm(h, limit, weights, e, w2, w2_s)

Under a CUDA graph capture the GEMMs then read the one captured sort.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

import torch


class _Scope:
    __slots__ = ("e", "local", "memo")

    def __init__(self, e: torch.Tensor, local: bool):
        self.e, self.local, self.memo = e, local, {}


class _Scopes(threading.local):
    """Each thread's scopes, innermost last (a server thread's MoE does not see, or pop, another's)."""

    def __init__(self):
        self.stack: list[_Scope] = []


_SCOPES = _Scopes()


@contextmanager
def same_routing(e: torch.Tensor, every_row_local: bool = False):
    """The expert GEMMs issued inside read `e` [P] unchanged (module docstring). every_row_local: every id in e
    is a local expert (0 <= e < the GEMMs' E: all experts on this process, no padding rows), so no output row is
    left for a backend to zero."""
    _SCOPES.stack.append(_Scope(e, bool(every_row_local)))
    try:
        yield
    finally:
        _SCOPES.stack.pop()


def routing_memo(e: torch.Tensor, key: tuple, make: Callable):
    """make() once per key and CUDA stream inside the innermost `same_routing` scope over this very tensor e (a
    value made on one stream is that stream's); elsewhere every call, with nothing looked up."""
    s = _SCOPES.stack[-1] if _SCOPES.stack else None
    if s is None or s.e is not e:
        return make()
    key = (*key, torch.cuda.current_stream(e.device) if e.is_cuda else None)
    if key not in s.memo:
        s.memo[key] = make()
    return s.memo[key]


def every_row_local(e: torch.Tensor) -> bool:
    """Whether the innermost `same_routing` scope over this very tensor e vouches that every row has a local
    expert (False outside a scope: a backend then zeroes the rows it does not compute)."""
    s = _SCOPES.stack[-1] if _SCOPES.stack else None
    return s is not None and s.e is e and s.local
