"""Where a divergence is born: delta debugging over the op sites (op, layer) of one model.

The reference configuration runs every op on its backend; the test configuration swaps a set of sites to
the test's implementation (`Dispatcher.override_sites`; layer None = outside the blocks: embedding, head,
sampling). A set *diverges* when its run differs from the reference's:

* metric "tokens": the greedy tokens of prefill + steps-1 decode steps (free-running) differ;
* metric "logits[:rtol]": teacher-forced on the reference's tokens, some position's logits differ from
  the reference's by more than rtol relative (‖Δ‖ / ‖ref‖, default 1e-3).

`ddmin` (Zeller & Hildebrandt's delta debugging) then shrinks the set of all sites the test run calls to a
1-minimal one: switching it alone reproduces the divergence, removing any one of its sites does not. Each
culprit is then run alone to say where it first matters (position, logits' relative error there, and
whether the flipped token was a near-tie: the reference's margin within the rounding band of
`deepinfer.debug.margin`).

Only backend sites are bisected: reference and test must share numerics, dtype and device (one model, the
kernels swapped op by op). Switching numerics per layer is not a site here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from deepinfer.debug.margin import UNIT_ROUNDOFF, decode_logits, top2

Site = tuple  # (op name, layer index or None)


@dataclass
class Culprit:
    op: str
    layer: int | None
    position: int | None  # first position whose token flips (tokens) or whose logits exceed rtol (logits)
    logits_rel_err: float  # at that position (its worst position when none)
    ref_margin: float | None  # the reference's top1 - top2 at that position
    near_tie: bool | None  # ref_margin within the logits' rounding band (a flip there is noise)


@dataclass
class BisectResult:
    ref: str
    test: str
    metric: str
    steps: int
    sites: int  # sites the test run calls
    runs: int  # model runs the search took (the two baselines included)
    agree: bool  # the whole test configuration agrees with the reference
    culprits: list[Culprit] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def parse_metric(metric: str) -> tuple[str, float]:
    """"tokens" | "logits" | "logits:RTOL" -> (kind, rtol)."""
    kind, _, tol = (metric or "tokens").partition(":")
    if kind not in ("tokens", "logits") or (tol and kind == "tokens"):
        raise ValueError(f"--metric {metric!r}: tokens | logits[:rtol]")
    try:
        rtol = float(tol) if tol else 1e-3
    except ValueError:
        raise ValueError(f"--metric {metric!r}: rtol must be a number") from None
    if not (rtol > 0 and math.isfinite(rtol)):
        raise ValueError(f"--metric {metric!r}: rtol must be a positive number")
    return kind, rtol


def ddmin(items: list, fails: Callable[[list], bool]) -> list:
    """A 1-minimal subset of `items` for which `fails` holds (`fails(items)` must hold): Zeller's ddmin,
    splitting into n chunks, keeping a failing chunk or a failing complement, else refining."""
    n = 2
    while len(items) >= 2:
        size = math.ceil(len(items) / n)
        chunks = [items[i:i + size] for i in range(0, len(items), size)]
        for c in chunks:
            if fails(c):
                items, n = c, 2
                break
        else:
            for i in range(len(chunks)):
                comp = [x for j, c in enumerate(chunks) if j != i for x in c]
                if comp and len(chunks) > 2 and fails(comp):
                    items, n = comp, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    break
                n = min(2 * n, len(items))
    return items


class Bisector:
    """One model, one prompt: runs of the reference with some sites swapped to `test_impl(op)`."""

    def __init__(self, model, prompt_ids: list[int], steps: int, metric: str, test_impl: Callable[[str], Callable],
                 dtype: str = "bfloat16"):
        from deepinfer.ops import ops

        self.ops, self.model, self.prompt, self.steps = ops, model, list(prompt_ids), steps
        self.kind, self.rtol = parse_metric(metric)
        self.test_impl, self.u = test_impl, UNIT_ROUNDOFF.get(dtype, 2.0 ** -8)
        self.runs = 0
        ops.record_sites(True)
        try:
            self.ref_logits, self.ref_tokens = self._run({})
        finally:
            self.ref_sites = ops.record_sites(False)

    def _run(self, sites: dict) -> tuple[list[torch.Tensor], list[int]]:
        self.runs += 1
        self.ops.override_sites(sites)
        try:
            force = self.ref_tokens if self.kind == "logits" and hasattr(self, "ref_tokens") else None
            return decode_logits(self.model, self.prompt, self.steps, force=force)
        finally:
            self.ops.override_sites(None)

    def swap(self, sites: list[Site]) -> dict:
        return {s: self.test_impl(s[0]) for s in sites}

    def first_difference(self, logits: list[torch.Tensor], tokens: list[int]) -> int | None:
        if self.kind == "tokens":
            return next((i for i, (a, b) in enumerate(zip(tokens, self.ref_tokens)) if a != b), None)
        return next((i for i, (a, b) in enumerate(zip(logits, self.ref_logits)) if _rel(a, b) > self.rtol), None)

    def diverges(self, sites: list[Site]) -> bool:
        logits, tokens = self._run(self.swap(sites))
        return self.first_difference(logits, tokens) is not None

    def culprit(self, site: Site) -> Culprit:
        logits, tokens = self._run(self.swap([site]))
        pos = self.first_difference(logits, tokens)
        errs = [_rel(a, b) for a, b in zip(logits, self.ref_logits)]
        at = pos if pos is not None else max(range(len(errs)), key=errs.__getitem__)
        ref = self.ref_logits[at]
        _, m = top2(ref)
        band = 2.0 * math.sqrt(2) * self.u * float(ref.abs().max())
        flipped = self.kind == "tokens" and pos is not None
        return Culprit(site[0], site[1], pos, errs[at], m, (m <= band) if flipped else None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)
    return float(d) if torch.isfinite(d) else math.inf


def bisect(model, prompt_ids: list[int], steps: int, metric: str, test_impl: Callable[[str], Callable],
           ref: str = "", test: str = "", dtype: str = "bfloat16", sites: list[Site] | None = None) -> BisectResult:
    """The minimal set of sites whose swap to `test_impl` makes the run diverge (module docstring)."""
    b = Bisector(model, prompt_ids, steps, metric, test_impl, dtype)
    cand = sorted(sites if sites is not None else b.ref_sites, key=lambda s: (s[1] is None, s[1] or 0, s[0]))
    res = BisectResult(ref, test, metric, steps, len(cand), 0, agree=True)
    if not b.diverges(cand):
        res.runs = b.runs
        return res
    res.agree = False
    minimal = ddmin(cand, b.diverges)
    res.culprits = [b.culprit(s) for s in minimal]
    res.runs = b.runs
    if len(minimal) > 1:
        res.note = "no single site diverges alone: these switch together"
    return res


def backend_impls(backend: str) -> Callable[[str], Callable]:
    """op -> `backend`'s implementation (the reference where it has none)."""
    from deepinfer.ops.registry import REGISTRY, _ensure_reference, load_backend

    _ensure_reference()
    load_backend(backend)
    return lambda op: REGISTRY[op].impls.get(backend, REGISTRY[op].ref)
