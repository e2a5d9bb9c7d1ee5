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

Two kinds of site, one axis at a time:
* (op, layer), when reference and test differ in backend only: one model, each site's op dispatched to
  the test backend's implementation;
* ("numerics", layer), when they differ in numerics only (e.g. exact -> official, same dtype): the
  reference model with those layers' blocks taken from a model built in the test's numerics (`hybrid`),
  so the search names the layers whose quantisation points matter. The KV layout goes with a layer's
  numerics (official: the FP8 layout).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from deepinfer.debug.comparators import rel_norm
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
    # the culprits switched together (a minimal set of more than one site: each alone stays within the metric)
    joint_position: int | None = None
    joint_logits_rel_err: float | None = None

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
    """One prompt; `run_with(sites, force) -> (logits, tokens)` runs the reference with `sites` switched to
    the test (`op_runner`, `numerics_runner`); force: teacher-forced tokens, or None (greedy)."""

    def __init__(self, run_with: Callable, steps: int, metric: str, dtype: str = "bfloat16"):
        self.run_with, self.steps = run_with, steps
        self.kind, self.rtol = parse_metric(metric)
        self.u = UNIT_ROUNDOFF.get(dtype, 2.0 ** -8)
        self.runs = 0
        self.ref_tokens = None
        self.ref_logits, self.ref_tokens = self._run([])

    def _run(self, sites: list[Site]) -> tuple[list[torch.Tensor], list[int]]:
        self.runs += 1
        return self.run_with(sites, self.ref_tokens if self.kind == "logits" else None)

    def first_difference(self, logits: list[torch.Tensor], tokens: list[int]) -> int | None:
        if self.kind == "tokens":
            return next((i for i, (a, b) in enumerate(zip(tokens, self.ref_tokens)) if a != b), None)
        return next((i for i, (a, b) in enumerate(zip(logits, self.ref_logits)) if rel_norm(a, b) > self.rtol), None)

    def diverges(self, sites: list[Site]) -> bool:
        logits, tokens = self._run(sites)
        return self.first_difference(logits, tokens) is not None

    def culprit(self, site: Site) -> Culprit:
        logits, tokens = self._run([site])
        pos = self.first_difference(logits, tokens)
        errs = [rel_norm(a, b) for a, b in zip(logits, self.ref_logits)]
        at = pos if pos is not None else max(range(len(errs)), key=errs.__getitem__)
        ref = self.ref_logits[at]
        _, m = top2(ref)
        band = 2.0 * math.sqrt(2) * self.u * float(ref.abs().max())
        flipped = self.kind == "tokens" and pos is not None
        return Culprit(site[0], site[1], pos, errs[at], m, (m <= band) if flipped else None)




def search(b: Bisector, cand: list[Site], ref: str, test: str, metric: str, steps: int) -> BisectResult:
    """ddmin over `cand` with `b`'s runs (the reference run already made)."""
    cand = sorted(cand, key=lambda s: (s[1] is None, s[1] or 0, s[0]))
    res = BisectResult(ref, test, metric, steps, len(cand), 0, agree=True)
    if not b.diverges(cand):
        res.runs = b.runs
        return res
    res.agree = False
    minimal = ddmin(cand, b.diverges)
    res.culprits = [b.culprit(s) for s in minimal]
    res.runs = b.runs
    if len(minimal) > 1:
        logits, tokens = b._run(minimal)
        res.runs = b.runs  # this run too
        res.joint_position = b.first_difference(logits, tokens)
        res.joint_logits_rel_err = max(rel_norm(x, y) for x, y in zip(logits, b.ref_logits))
        res.note = (f"no single site diverges alone: these switch together (together: logits rel_err "
                    f"{res.joint_logits_rel_err:.2e}, first position {res.joint_position})")
    return res


def op_runner(model, prompt_ids: list[int], steps: int, test_impl: Callable[[str], Callable]) -> Callable:
    """Runs of `model` with sites (op, layer) dispatched to `test_impl(op)` (`Dispatcher.override_sites`)."""
    from deepinfer.ops import ops

    def run(sites, force):
        ops.override_sites({s: test_impl(s[0]) for s in sites})
        try:
            return decode_logits(model, list(prompt_ids), steps, force=force)
        finally:
            ops.override_sites(None)
    return run


def bisect(model, prompt_ids: list[int], steps: int, metric: str, test_impl: Callable[[str], Callable],
           ref: str = "", test: str = "", dtype: str = "bfloat16", sites: list[Site] | None = None) -> BisectResult:
    """Op sites: the minimal set of (op, layer) whose swap to `test_impl` makes the run diverge."""
    from deepinfer.ops import ops

    run = op_runner(model, prompt_ids, steps, test_impl)
    ops.record_sites(True)
    try:
        b = Bisector(run, steps, metric, dtype)
    finally:
        seen = ops.record_sites(False)
    return search(b, list(sites if sites is not None else seen), ref, test, metric, steps)


def hybrid(ref_model, test_model, from_test: set[int]):
    """The reference model with the blocks `from_test` taken from `test_model` (the same config and compute
    dtype; each block keeps its numerics: its weights' form, its QAT points, its cache layout)."""
    m = copy.copy(ref_model)
    m.layers = [test_model.layers[i] if i in from_test else blk for i, blk in enumerate(ref_model.layers)]
    return m


def numerics_runner(ref_model, test_model, prompt_ids: list[int], steps: int) -> Callable:
    """Runs with the layers of the sites ("numerics", L) in the test model's numerics."""
    def run(sites, force):
        return decode_logits(hybrid(ref_model, test_model, {s[1] for s in sites}), list(prompt_ids), steps,
                             force=force)
    return run


def bisect_numerics(ref_model, test_model, prompt_ids: list[int], steps: int, metric: str, ref: str = "",
                    test: str = "", dtype: str = "bfloat16", site: str = "numerics") -> BisectResult:
    """Layer sites (site, L): the minimal set of layers whose switch to the test model's blocks makes the run
    diverge -- its numerics (site "numerics": e.g. exact -> official), its KV format (site "kv_format":
    `Transformer.set_kv_qat`) or its routed experts' form (site "experts": FP4 as stored against requantised per
    128, `deepinfer.quant.requant`). Both models: the same checkpoint, config and dtype."""
    if ref_model.numerics.dtype != test_model.numerics.dtype:
        raise ValueError("bisect over numerics needs one compute dtype on both sides")
    b = Bisector(numerics_runner(ref_model, test_model, prompt_ids, steps), steps, metric, dtype)
    return search(b, [(site, L) for L in range(len(ref_model.layers))], ref, test, metric, steps)


def check_no_split(op_map: dict) -> None:
    """bisect swaps one implementation per (op, layer) site: a phase-split map entry is refused, naming it."""
    split = sorted(op for op, b in (op_map or {}).items() if isinstance(b, dict))
    if split:
        raise ValueError(f"bisect swaps one implementation per (op, layer) site: give {', '.join(split)} one backend, "
                         "not a phase split (decode:.../prefill:...)")


def backend_impls(backend: str, op_map: dict[str, str] | None = None) -> Callable[[str], Callable]:
    """op -> the implementation of its backend: `op_map`'s entry, else `backend` (the reference where that
    backend has none)."""
    from deepinfer.ops.registry import REGISTRY, _ensure_reference, load_backend

    _ensure_reference()
    op_map = dict(op_map or {})
    check_no_split(op_map)
    for b in {backend, *op_map.values()}:
        load_backend(b)
    return lambda op: REGISTRY[op].impls.get(op_map.get(op, backend), REGISTRY[op].ref)
