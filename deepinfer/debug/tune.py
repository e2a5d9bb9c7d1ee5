"""`deepinfer tune`: the fastest correct kernel per op and phase on this GPU, written as a per-op map file.

For every op (or those matching `--ops`) and each phase (decode, prefill: `ab`'s cases at those shapes), each
candidate backend that implements the op runs every case of `deepinfer ab`: its outputs are judged against the
torch reference with the op's tolerances (the `official` policy), and a candidate that fails any case, raises, or
falls back to the reference inside its implementation (tuning runs strict) is not eligible -- the reason is
kept. The eligible candidates are timed on the same inputs (`ab.bench`: triton.testing.do_bench, each case's ms
summed over the phase's cases), and the fastest is the phase's choice. An op whose two phases pick the same
backend gets one entry; otherwise `{decode: ..., prefill: ...}`. The baseline backend (default triton) keeps
an op wherever no candidate is measured faster, so the tuned map is never slower than the baseline alone at the
measured points. Every tuned op is named in the map, so it means the same under any `--backend`.

Policies: `official` keeps only kernels that accumulate as the official ones, so a candidate whose FP8 sums are
promoted to fp32 once per 128-K block (its backend's `per_128k_ops` fact: cuBLASLt, FlagGems' block-FP8 GEMM,
DeepGEMM) is not eligible for that op; `fast` takes them too. Either way every candidate's measured drift against
the reference (the worst relative error over the phase's cases) is recorded beside its time.

The map file (`deepinfer.ops.op_map_file`) records this GPU, the candidates with their versions and the policy;
`--op @map.yaml` refuses it anywhere else, and under another DEEPINFER_POLICY.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch

from deepinfer import settings
from deepinfer.debug import ab, ab_cases
from deepinfer.ops import ops
from deepinfer.ops.registry import (BACKENDS, PHASES, REGISTRY, BackendError, _ensure_reference, backend_available,
                                     by_design, check_runs_on)

POLICIES = ("official", "fast")


@dataclass
class Candidate:
    """One backend's standing for one op and phase."""

    backend: str
    ms: float | None = None  # summed over the phase's cases (None: not timed)
    eligible: bool = False
    reason: str = ""  # why not eligible
    drift: float | None = None  # the worst relative error against the reference over the phase's cases

    def to_dict(self) -> dict:
        d = {"ms": self.ms} if self.eligible else {"not_eligible": self.reason}
        return {**d, "drift": self.drift} if self.drift is not None else d


@dataclass
class OpChoice:
    op: str
    phase: str
    backend: str
    candidates: dict = field(default_factory=dict)  # backend -> Candidate


def candidates_here() -> list[str]:
    """Every backend importable here (the torch reference included: it may be the fastest for an op)."""
    return [b for b in BACKENDS if b == "torch" or backend_available(b)[0]]


@contextlib.contextmanager
def _strict():
    """Tuning runs strict: an implementation that falls back to the reference at run time raises (a fallback
    timed under the backend's name would be the reference's time)."""
    prev, ops.strict = ops.strict, True
    try:
        yield
    finally:
        ops.strict = prev


def tune(baseline: str = "triton", candidates: list[str] | None = None, ops_regex: str | None = None,
         shapes: str = "flash", seed: int = 0, device: str | None = None, policy: str = "official",
         timer=None, progress=None) -> dict:
    """Measure and choose (module docstring) -> {"ops": {op: choice}, "choices": [OpChoice], "baseline",
    "candidates", "shapes", "seed", "device"}. timer(op, fn, args, kwargs) -> ms or None (default `ab.bench`,
    CUDA only); with no timings every eligible choice is the baseline's."""
    if policy not in POLICIES:
        raise ValueError(f"--policy {policy!r}: choose {' or '.join(POLICIES)}")
    _ensure_reference()
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(dev).type == "cuda"
    cands = list(candidates or candidates_here())
    for b in cands:
        if b not in BACKENDS:
            raise ValueError(f"--candidates: unknown backend {b!r}; backends: {', '.join(BACKENDS)}")
        ok, why = backend_available(b)
        if not ok:
            raise ValueError(f"--candidates {b}: {why}")
    if baseline not in cands:
        raise ValueError(f"--baseline {baseline!r} is not among the candidates ({', '.join(cands)})")
    if shapes not in ab_cases.SHAPES:
        raise ValueError(f"--shapes {shapes!r}: one of {', '.join(ab_cases.SHAPES)}")
    dims = ab_cases.SHAPES[shapes]
    if dims.big and not on_cuda:
        raise ValueError(f"--shapes {shapes}: V4 shapes need a CUDA device (device is {dev})")
    for b in cands if candidates else ():  # named by the user: one that cannot run here is refused, not tabled
        try:
            check_runs_on(b, dev, None, "--candidates")
        except BackendError as e:
            raise ValueError(str(e)) from None
    timer = timer or ab.bench
    # the policy's own defaults while measuring (settings.FAST_DEFAULTS): under fast, Triton's prefill fp8_gemm is
    # the per-128 one a fast run will call, so the map is chosen among the kernels that run under it
    with settings.applied({"DEEPINFER_POLICY": policy}):
        choices, names = _measure_all(baseline, cands, ops_regex, dims, seed, dev, policy, on_cuda, timer, progress)
    ops_map = {}  # every tuned op named, so the map means the same under any --backend
    for op in names:
        per = {c.phase: c.backend for c in choices if c.op == op}
        ops_map[op] = per[PHASES[0]] if len(set(per.values())) == 1 else per
    return {"ops": ops_map, "choices": choices, "baseline": baseline, "candidates": cands, "shapes": shapes,
            "seed": seed, "device": dev, "policy": policy}


def _measure_all(baseline, cands, ops_regex, dims, seed, dev, policy, on_cuda, timer, progress):
    """Every op and phase on every candidate -> ([OpChoice], op names)."""
    from deepinfer.ops.registry import COMPOSITIONS, backend_facts

    per_128k = {b: set(backend_facts(b, torch.device(dev)).get("per_128k_ops", ())) for b in cands}
    for b, ops_b in per_128k.items():  # a fused op built on a per-128 part promotes as that part does
        ops_b |= {f for f, (parts, _) in COMPOSITIONS.items() if ops_b & set(parts)}
    interp = settings.triton_interpreted() and "triton" in cands and not on_cuda
    names = ab._select_ops(ops_regex)
    choices: list[OpChoice] = []
    for op in names:
        for phase in PHASES:
            variants = ab_cases.build(op, dims, phase, seed, dev)
            if interp:  # Triton's interpreter computes a bf16 tl.dot wrongly: every candidate gets fp16 inputs
                variants = [ab._no_bf16(v) if ab._has_bf16(v) else v for v in variants]
            refs = [ab.call(op, REGISTRY[op].ref, v.args, v.kwargs) for v in variants]
            ch = OpChoice(op, phase, baseline)
            for b in cands:
                if progress:
                    progress(op, phase, b)
                c = ch.candidates[b] = _measure(op, b, variants, refs, timer, on_cuda)
                if c.eligible and policy == "official" and op in per_128k.get(b, ()):
                    c.eligible, c.reason = False, ("promotes FP8 sums to fp32 once per 128-K block, not as the official "
                                                   "kernels (--policy fast takes it)")
            best = _fastest(ch.candidates, baseline)
            if best is not None:
                ch.backend = best
            choices.append(ch)
    return choices, names


def _measure(op: str, b: str, variants, refs, timer, on_cuda: bool) -> Candidate:
    c = Candidate(b)
    fn = REGISTRY[op].ref if b == "torch" else REGISTRY[op].impls.get(b)
    if fn is None:
        why = by_design(b, op)
        c.reason = f"the reference by design ({why})" if why else "no implementation"
        if why:  # the backend runs the reference: eligible as the reference's time
            fn = REGISTRY[op].ref
        else:
            return c
    total = 0.0
    timed = True
    for v, r_out in zip(variants, refs):
        cr = ab.CaseResult(op, "", "", v.name, "pending")
        with _strict():
            got = ab._run_case(cr, fn, v.args, v.kwargs, r_out, False, on_cuda)
        errs = [m.get("rel_err") for m in cr.outputs if m.get("rel_err") is not None]
        if errs:
            c.drift = max([c.drift or 0.0, *errs])
        if got is None or cr.status != "pass":
            worst = cr.worst()
            c.reason = cr.reason or (f"case {v.name}: output {worst.get('output')} off by "
                                     f"{worst.get('rel_err')} relative ({worst.get('detail') or 'beyond tolerance'})")
            return c
        with _strict():
            ms = timer(op, fn, v.args, v.kwargs)
        if ms is None:
            timed = False
        else:
            total += ms
    c.eligible, c.ms = True, total if timed else None
    return c


def _fastest(cands: dict, baseline: str) -> str | None:
    """The eligible candidate with the least time; the baseline unless another is measured faster."""
    timed = {b: c.ms for b, c in cands.items() if c.eligible and c.ms is not None}
    if not timed:
        return baseline if cands.get(baseline) and cands[baseline].eligible else \
            next((b for b, c in cands.items() if c.eligible), None)
    best = min(timed, key=timed.get)
    if baseline in timed and timed[baseline] <= timed[best]:
        return baseline
    return best


def measured(result: dict) -> dict:
    """The report's measurements, as the map file keeps them: {op: {phase: {backend: {ms} or {not_eligible}}}}."""
    out: dict = {}
    for c in result["choices"]:
        out.setdefault(c.op, {})[c.phase] = {"choice": c.backend,
                                            **{b: cand.to_dict() for b, cand in c.candidates.items()}}
    return out


def write_map(path: str, result: dict, command: str = "") -> None:
    """The tuned map file for this machine (`deepinfer.ops.op_map_file`)."""
    from deepinfer.ops.op_map_file import device_name, dump_op_map
    from deepinfer.ops.registry import backend_versions

    dump_op_map(path, result["ops"], device_name(), result["policy"], backend_versions(result["candidates"]),
                measured(result), command or f"deepinfer tune (pid {os.getpid()})",
                {k: result[k] for k in ("baseline", "shapes", "seed")})
