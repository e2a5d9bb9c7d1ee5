"""A/B runner: a backend's ops against the reference, or against outputs saved on another host.

`run_ab` builds every case (`ab_cases.py`), computes ALL reference outputs first (before the backend's
implementations run, and before the backend's package is imported when the caller has not loaded it yet:
nothing a backend patches can leak into the reference), then runs the backend on fresh copies of the
same inputs and compares. In-place outputs (kv_store's cache) start poisoned (NaN) so unwritten elements
show.

Comparison per output (`compare_outputs`; the verdicts are `deepinfer.debug.comparators`'):
* floating outputs: relative error ‖a−b‖/‖b‖, max |a−b|, bitwise-equal flag; pass when every element
  satisfies |a−b| ≤ atol + rtol·|b| with (rtol, atol) = `REGISTRY[op].tol[<output dtype name>]`
  (`comparators.tolerance`; NaN only matches NaN: the poison must stay exactly where the reference left it);
* integer / bool outputs: exact equality; index-set outputs (`topk_indices`, `moe_route` indices)
  compared as sets per row, with aligned outputs (the route weights) re-ordered to match;
* float8 outputs compare their float values with the float8 tolerance (exact for act_quant); FP8 codes
  returned with their per-block scales are judged by their values q·s (`judge_scaled_fp8`).

`--dump DIR` writes one HDF5 file per case (`<op>__<shape>__<phase>__<variant>.h5`) with the toolkit's
generic writer (`deepinfer.debug.h5schema.DumpWriter`): tensors `in.<i>` / `kw.<name>`, reference outputs
`out.<i>` (and the tested backend's `got.<i>` when it differs from the reference), and a JSON description
of the call in the root attribute `ab_call`. `--compare DIR` replays the saved inputs on this host's
backend and compares with the saved `out.<i>` (no reference backend needed).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import torch

from deepinfer import settings
from deepinfer.debug import ab_cases
from deepinfer.debug.ab_cases import COMPARE, PHASES, SHAPES, CompareSpec, Variant
from deepinfer.debug.comparators import (bitwise_equal, judge_float, judge_int, judge_scaled_fp8, judge_sets, mismatch,
                                         raw_bits, tolerance)
from deepinfer.ops.registry import REGISTRY, BackendError, _ensure_reference, by_design, load_backend

AB_FORMAT = "deepinfer-ab-case"


@dataclass
class CaseResult:
    op: str
    shapes: str
    phase: str
    variant: str
    status: str  # pass | fail | skip | error
    summary: str = ""  # input shapes
    reason: str = ""
    outputs: list = field(default_factory=list)  # per-output metric dicts
    time_ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    of_roofline: float | None = None  # max(bytes / measured bandwidth, FLOPs / measured rate) / time
    ran_as: str = ""  # "float16": a bf16 case the interpreter ran in fp16 (its bf16 tl.dot is wrong)
    peer: "CaseResult | None" = None  # --against: the same case on the peer backend, judged the same way

    @property
    def case_id(self) -> str:
        return f"{self.op}__{self.shapes}__{self.phase}__{self.variant}"

    def worst(self) -> dict:
        """The output with the largest relative error (for the one-row table)."""
        if not self.outputs:
            return {}
        return max(self.outputs, key=lambda m: (not m["ok"], m.get("rel_err") or 0.0))

    def to_dict(self) -> dict:
        return {"op": self.op, "shapes": self.shapes, "phase": self.phase, "variant": self.variant,
                "case": self.case_id, "status": self.status, "inputs": self.summary, "reason": self.reason,
                "outputs": self.outputs, "time_ms": self.time_ms, "gbps": self.gbps,
                "tflops": self.tflops, "of_roofline": self.of_roofline, "ran_as": self.ran_as,
                "peer": self.peer.to_dict() if self.peer is not None else None,
                "peer_time_ratio": self.peer_time_ratio}

    @property
    def peer_time_ratio(self) -> float | None:
        """The peer's time over this backend's (> 1: this backend is faster), when both were timed."""
        if self.peer is None or not self.time_ms or not self.peer.time_ms:
            return None
        return self.peer.time_ms / self.time_ms


# --------------------------------------------------------------------------------------- comparison
def _as_list(out) -> list:
    if out is None:
        return []
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


_bits = raw_bits  # io_bytes' changed-element count


def _sort_sets(got_idx: torch.Tensor, ref_idx: torch.Tensor):
    """Sort index rows (last dim) so equal sets compare equal; returns (sorted got, sorted ref, perms)."""
    g_sorted, g_perm = torch.sort(got_idx.long(), dim=-1, stable=True)
    r_sorted, r_perm = torch.sort(ref_idx.long(), dim=-1, stable=True)
    return g_sorted, r_sorted, g_perm, r_perm


def compare_tensor(op: str, got, ref, label: str, as_set: bool = False, mag=None, tc_rel: float = 0.0,
                   k: int | None = None, bound=None) -> dict:
    """Metrics for one output (the verdict is `comparators`'). `ref` is the expectation; `mag` (Σ|terms|
    per element) with `tc_rel` widens an element's tolerance to the tensor-core accumulation bound
    (CompareSpec.abs_args); `k` (a float32 reduction's length) widens float32 rtol to `fp32_sum_rel(k)`;
    `bound` is a per-element |Δ| allowed (CompareSpec.bound). `worst_ratio`: the largest |Δ| / allowed
    (< 1 passes)."""
    m = {"output": label, "dtype": None, "shape": None, "rel_err": None, "max_abs": None, "bitwise": False,
         "tol": None, "ok": False, "detail": ""}
    if not isinstance(ref, torch.Tensor):
        ok = got == ref if not isinstance(got, torch.Tensor) else False
        m.update(ok=bool(ok), bitwise=bool(ok), detail="" if ok else f"got {got!r}, expected {ref!r}")
        return m
    m["dtype"], m["shape"] = str(ref.dtype).removeprefix("torch."), list(ref.shape)
    if not isinstance(got, torch.Tensor):
        m["detail"] = f"backend returned {type(got).__name__}, expected a tensor"
        return m
    got = got.detach().to(ref.device)
    bad = mismatch(got, ref)
    if bad is not None:
        m["detail"] = bad.note
        return m
    m["bitwise"] = bitwise_equal(got, ref)
    if not ref.is_floating_point():
        v = judge_sets(got, ref) if as_set else judge_int(got, ref)
        m.update(rel_err=v.n_bad / max(1, v.n), max_abs=v.max_abs if ref.dtype != torch.bool else 0.0,
                 tol=[0.0, 0.0], ok=v.ok, detail=v.note + (" (compared as sets per row)" if as_set else ""))
        if as_set and v.ok:
            m["detail"] = "equal as sets per row" + ("" if m["bitwise"] else " (order differs)")
        return m
    rtol, atol = tolerance(op, ref.dtype)  # float8 outputs without an entry: exact
    if k is not None and ref.dtype == torch.float32:
        rtol = max(rtol, ab_cases.fp32_sum_rel(k))
    m["tol"] = [rtol, atol]
    widen = None
    if mag is not None:
        b = ref.double()
        widen = tc_rel * mag.detach().double().to(b.device) + (2.0 ** -8 * b.abs() if ref.dtype == torch.bfloat16 else 0.0)
        m["tc_rel"] = tc_rel  # reported: the element bound also admits tc_rel x Σ|terms|
    if bound is not None:
        bd = bound.detach().double().to(ref.device)
        widen = bd if widen is None else torch.maximum(widen, bd)
        m["bounded"] = True
    # NaN matches NaN here: the poison must stay exactly where the reference left it
    v = judge_float(got, ref, (rtol, atol), nan_equal=True, widen=widen,
                    nan_hint=" (unwritten or overwritten poison)" if op in ("kv_store",) else "")
    m["max_abs"], m["rel_err"], m["worst_ratio"] = v.max_abs, v.rel_err, v.worst_ratio
    m["ok"], m["detail"] = v.ok, v.note
    return m


def compare_outputs(op: str, got: list, ref: list, args: tuple | None = None, kwargs: dict | None = None
                    ) -> list[dict]:
    spec = COMPARE.get(op, CompareSpec())
    mags = [None] * len(ref)
    if spec.abs_args is not None and args is not None:
        mags = _as_list(REGISTRY[op].ref(*spec.abs_args(args), **(kwargs or {})))
    tc_rel = spec.tc_rel(args) if callable(spec.tc_rel) and args is not None else (
        0.0 if callable(spec.tc_rel) else spec.tc_rel)
    k = spec.k_of(args) if spec.k_of is not None and args is not None else None
    bounds = spec.bound(args, list(ref)) if spec.bound is not None and args is not None else [None] * len(ref)
    if len(got) != len(ref):
        return [{"output": "outputs", "ok": False, "bitwise": False, "rel_err": None, "max_abs": None,
                 "dtype": None, "shape": None, "tol": None,
                 "detail": f"backend returned {len(got)} output(s), reference {len(ref)}"}]
    got, ref = list(got), list(ref)
    # aligned outputs follow the order of their set output: re-order both sides by sorted index
    for out_i, set_i in spec.aligned:
        gi, ri = got[set_i], ref[set_i]
        if isinstance(gi, torch.Tensor) and isinstance(ri, torch.Tensor) and gi.shape == ri.shape \
                and isinstance(got[out_i], torch.Tensor) and got[out_i].shape == gi.shape:
            _, _, gp, rp = _sort_sets(gi.to(ri.device), ri)
            got[out_i] = torch.gather(got[out_i].to(ri.device), -1, gp)
            ref[out_i] = torch.gather(ref[out_i], -1, rp)
    out = [compare_tensor(op, g, r, f"out{i}", as_set=i in spec.sets, mag=mg, tc_rel=tc_rel, k=k, bound=bd)
           for i, (g, r, mg, bd) in enumerate(zip(got, ref, mags, bounds))]
    for qi, si, block in _scaled_fp8(op, ref):
        out[qi], out[si] = compare_scaled_fp8(got[qi], ref[qi], got[si], ref[si], block, out[qi], out[si], op=op)
    return out


# FP8 codes with their per-block scales are judged by their values q·s (`comparators.judge_scaled_fp8`).
# Ops whose FP8 output the registry holds exact (act_quant) keep exact codes.
def _scaled_fp8(op: str, ref: list) -> list[tuple[int, int, int]]:
    if tolerance(op, torch.float8_e4m3fn) == (0.0, 0.0):
        return []
    pairs = []
    for i in range(len(ref) - 1):
        q, s = ref[i], ref[i + 1]
        if isinstance(q, torch.Tensor) and isinstance(s, torch.Tensor) and q.dtype == torch.float8_e4m3fn \
                and s.dtype == torch.float32 and q.dim() == s.dim() and q.shape[:-1] == s.shape[:-1] \
                and s.size(-1) and q.size(-1) % s.size(-1) == 0:
            pairs.append((i, i + 1, q.size(-1) // s.size(-1)))
    return pairs


def compare_scaled_fp8(qg, qr, sg, sr, block: int, mq: dict, ms: dict, op: str | None = None) -> tuple[dict, dict]:
    """The element-wise metrics `mq` (codes) and `ms` (scales) re-judged as values q·s and scales with
    power-of-two flips accepted (`judge_scaled_fp8`, rtol the registry's float8 rtol of `op`); tensors
    that cannot be paired keep their element-wise verdicts."""
    if not all(isinstance(t, torch.Tensor) for t in (qg, sg)):
        return mq, ms
    vq, vs = judge_scaled_fp8(qg, qr, sg, sr, block, op=op)
    if vq.kind in ("shape", "dtype"):
        return mq, ms
    mq = {**mq, "ok": vq.ok, "compared_as": "values q·s", "max_abs": vq.max_abs, "worst_ratio": vq.worst_ratio,
          "detail": vq.note}
    ms = {**ms, "ok": vs.ok, "worst_ratio": None if vs.ok and vs.n_excused else ms.get("worst_ratio"),
          "detail": vs.note}
    return mq, ms


# -------------------------------------------------------------------------------------------- calls
def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def call(op: str, fn, args: tuple, kwargs: dict) -> list:
    """Run `fn` on copies of the inputs; in-place ops return their return value (if any) and the written args."""
    args, kwargs = _clone(args), _clone(kwargs)
    out = fn(*args, **kwargs)
    spec = COMPARE.get(op, CompareSpec())
    if spec.inplace:  # the return value (if any), then the written args
        return ([] if out is None else _as_list(out)) + [args[i] for i in spec.inplace]
    return _as_list(out)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def io_bytes(op: str, args: tuple, kwargs: dict, outs: list) -> int:
    spec = COMPARE.get(op, CompareSpec())
    if spec.inplace:  # only what the kernel reads (non-buffer inputs) and writes (changed elements)
        n = sum(_nbytes(a) for i, a in enumerate(args) if i not in spec.inplace)
        n += _nbytes(outs[:len(outs) - len(spec.inplace)])  # a returned value
        for i, o in zip(spec.inplace, outs[len(outs) - len(spec.inplace):]):
            changed = ~(_bits(o) == _bits(args[i]))
            n += int(changed.sum().item()) * o.element_size()
        return n
    return _nbytes(args) + _nbytes(list(kwargs.values())) + _nbytes(outs)


_CEILINGS: dict = {}


def ceilings(device: torch.device) -> dict:
    """The device's measured ceilings, once per process: copy bandwidth (B/s), bf16 and fp8 matmul
    FLOP/s (`deepinfer bench`'s measurements)."""
    if not _CEILINGS:
        from deepinfer.bench.rates import measure_bandwidth, measure_fp8_matmul, measure_matmul

        _CEILINGS.update(bandwidth=measure_bandwidth(device), bf16=measure_matmul(device)[0],
                         fp8=measure_fp8_matmul(device))
    return _CEILINGS


def rate(cr: "CaseResult", args, kwargs, outs, ms: float) -> None:
    """Fill time, GB/s, TFLOP/s and the roofline fraction of a benched case: the achieved time against
    the larger of its bytes over the measured copy bandwidth and its FLOPs over the measured matmul
    rate of its MMA kind (FP8 for the FP8/FP4 GEMMs, bf16 otherwise)."""
    from deepinfer.bench.oprates import FP8_CEILING_OPS, op_flops

    c = ceilings(torch.device("cuda"))
    nbytes = io_bytes(cr.op, args, kwargs, outs)
    flops = op_flops(cr.op, tuple(args), kwargs)
    mma = c["fp8"] if cr.op in FP8_CEILING_OPS and c["fp8"] else c["bf16"]
    t = ms * 1e-3
    cr.time_ms, cr.gbps = ms, nbytes / t / 1e9
    cr.tflops = flops / t / 1e12 if flops else None
    cr.of_roofline = max(nbytes / c["bandwidth"], flops / mma) / t


def bench(op: str, fn, args, kwargs) -> float | None:
    """Milliseconds per call on CUDA (triton.testing.do_bench, else CUDA events); None on CPU."""
    if not torch.cuda.is_available() or not any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
        return None
    a, k = _clone(args), _clone(kwargs)
    try:
        from triton.testing import do_bench

        return float(do_bench(lambda: fn(*a, **k)))
    except ImportError:
        pass
    for _ in range(3):
        fn(*a, **k)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20
    start.record()
    for _ in range(n):
        fn(*a, **k)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


# ----------------------------------------------------------------------------------------- the run
@dataclass
class ABReport:
    backend: str
    ref: str | None
    seed: int | None
    device: str
    interpreter: bool
    results: list[CaseResult]
    not_implemented: list[str] = field(default_factory=list)
    source: str | None = None  # --compare DIR
    dumped: str | None = None
    against: str | None = None  # the peer backend each case also ran on

    def counts(self, peer: bool = False) -> tuple[int, int, int]:
        rs = [r.peer for r in self.results if r.peer is not None] if peer else self.results
        p = sum(r.status == "pass" for r in rs)
        f = sum(r.status in ("fail", "error") for r in rs)
        s = sum(r.status == "skip" for r in rs)
        return p, f, s

    @property
    def ok(self) -> bool:
        """No case failed, on the backend or (--against) on its peer."""
        return self.counts()[1] == 0 and self.counts(peer=True)[1] == 0

    def summary_line(self) -> str:
        p, f, s = self.counts()
        line = f"{p} passed, {f} failed, {s} skipped"
        if self.against:
            p, f, s = self.counts(peer=True)
            line += f"; {self.against}: {p} passed, {f} failed, {s} skipped"
        return line

    def dtype_note(self) -> str | None:
        """Says what was really tested when the interpreter ran bf16 cases in fp16."""
        n = sum(r.ran_as == "float16" for r in self.results if r.status != "skip")
        if not n:
            return None
        return (f"{n} case(s) written in bfloat16 ran in float16 on both sides (marked [bf16→fp16]): Triton's "
                "interpreter computes a bf16 tl.dot wrongly, so bfloat16 itself was not tested here; run on a "
                "GPU to test it")

    def to_dict(self) -> dict:
        p, f, s = self.counts()
        return {"backend": self.backend, "against": self.against, "ref": self.ref, "seed": self.seed,
                "device": self.device,
                "interpreter": self.interpreter, "source": self.source, "dump": self.dumped,
                "not_implemented": self.not_implemented, "cases": [r.to_dict() for r in self.results],
                "dtype_note": self.dtype_note(),
                "summary": {"passed": p, "failed": f, "skipped": s, "line": self.summary_line()}}


# ops whose Triton kernels multiply bf16 operands with tl.dot (wrong under the interpreter)
_DOT_OPS = {"indexer_scores", "linear", "sparse_attn", "moe_route", "grouped_gemm"}


def _no_bf16(v):
    """The variant with every bf16 tensor (and out_dtype) as fp16: same values, interpreter-safe."""
    def conv(x):
        if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
            return x.to(torch.float16)
        if x is torch.bfloat16:
            return torch.float16
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x
    return type(v)(v.name, conv(v.args), {k: conv(x) for k, x in v.kwargs.items()})


def _has_bf16(v) -> bool:
    def has(x):
        if isinstance(x, torch.Tensor):
            return x.dtype == torch.bfloat16
        if isinstance(x, (list, tuple)):
            return any(has(y) for y in x)
        return x is torch.bfloat16
    return has(v.args) or any(has(x) for x in v.kwargs.values())


def _ref_fn(op: str, ref: str):
    d = REGISTRY[op]
    if ref == "torch":
        return d.ref
    return d.impls.get(ref)


def _select_ops(pattern: str | None) -> list[str]:
    _ensure_reference()
    names = list(REGISTRY)
    if pattern:
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"--ops {pattern!r} is not a valid regular expression: {e}") from None
        names = [n for n in names if rx.search(n)]
        if not names:
            raise ValueError(f"--ops {pattern!r} matches no op; ops: {', '.join(REGISTRY)}")
    return names


def parse_shapes(shapes: str) -> list[str]:
    out = []
    for s in (shapes or "all").split(","):
        s = s.strip().lower()
        if s == "all":
            out += [k for k in SHAPES if k not in out]
        elif s in SHAPES:
            if s not in out:
                out.append(s)
        elif s:
            raise ValueError(f"--shapes {s!r}: choose from {', '.join(SHAPES)} or all (comma-separated)")
    return out


def _run_case(cr: CaseResult, fn, args: tuple, kwargs: dict, r_out: list, do_bench: bool,
              on_cuda: bool) -> list | None:
    """Run `fn` on the case's inputs: cr's status, its outputs judged against r_out and (do_bench) its rates.
    Returns the outputs (None when it raised)."""
    try:
        got = call(cr.op, fn, args, kwargs)
        if on_cuda:
            torch.cuda.synchronize()
    except Exception as e:
        cr.status, cr.reason = "error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:400]
        return None
    cr.outputs = compare_outputs(cr.op, got, r_out, args, kwargs)
    cr.status = "pass" if all(m["ok"] for m in cr.outputs) else "fail"
    if isinstance(r_out, _OwnReference):  # judged against the reference on the backend's own weight form
        cr.reason = (cr.reason + "; " if cr.reason else "") + r_out.note
    if do_bench:
        ms = bench(cr.op, fn, args, kwargs)
        if ms:
            rate(cr, args, kwargs, got, ms)
        else:
            cr.reason = (cr.reason + "; " if cr.reason else "") + "bench skipped (no CUDA)"
    return got


class _OwnReference(list):
    """Reference outputs computed on the weights as the backend holds them, with a note saying so."""

    note = ""


def _judged_against(cr: CaseResult, fn, v, ref: str, r_out: list) -> list | None:
    """The outputs `fn` is judged against on case v: the reference's `r_out`, or for a requantising backend the
    reference on its requantised weights (`_requantised_reference`); None when computing that raised, which is then
    the case's error (as a phase-1 reference error is: this case's, not the run's)."""
    if ref != "torch":
        return r_out
    try:
        own = _requantised_reference(cr, fn, v)
    except Exception as e:
        cr.status, cr.reason = "error", f"requantised reference raised {type(e).__name__}: {e}"[:400]
        return None
    return r_out if own is None else own


def _requantised_reference(cr: CaseResult, fn, v) -> "_OwnReference | None":
    """For a backend whose kernel takes FP4 weights requantised per 128 x 128 block (`fn.fp4_as == "fp8-per-128"`,
    DeepGEMM): the torch reference on those requantised weights, so the kernel is judged on what it computes and
    the requantisation's own error is measured apart (the issue's "the requantised path against the requantised
    reference, the lossless path against the lossless one"). None for every other case."""
    if getattr(fn, "fp4_as", None) != "fp8-per-128" or cr.op not in ("fp4_gemm", "grouped_gemm"):
        return None
    w_at = 2 if cr.op == "fp4_gemm" else 3  # (a, a_s, w, w_s, ...) / (a, a_s, e, w, w_s, ...)
    w, w_s = v.args[w_at], v.args[w_at + 1]
    if w.dtype not in (torch.int8, torch.uint8):
        return None
    from deepinfer.quant.requant import requant_fp4

    w8, s8, rep = requant_fp4(w, w_s, f"{cr.op} weight")
    args = (*v.args[:w_at], w8, s8, *v.args[w_at + 2:])
    op = "fp8_gemm" if cr.op == "fp4_gemm" else "grouped_gemm"  # an FP8 weight: the FP8 GEMM's reference
    out = _OwnReference(call(op, REGISTRY[op].ref, args, v.kwargs))
    out.note = ("judged against the reference on its per-128 requantised weights (requantisation "
                + ("lossless)" if rep.lossless else
                   f"lossy: {rep.lossy_values} values, rel err {rep.rel_err:.2e}, max |err| {rep.max_abs_err:.2e})"))
    return out


def run_ab(backend: str, ref: str = "torch", ops_regex: str | None = None, shapes: str = "all",
           seed: int | None = None, dump: str | None = None, do_bench: bool = False,
           device: str | None = None, progress=None, against: str | None = None) -> ABReport:
    """Cases -> all references -> load backend -> backend outputs -> compare (-> dump). `against`: each case
    also runs on that backend, judged against the same reference (and timed in the same run)."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = torch.device(dev).type == "cuda"
    names = _select_ops(ops_regex)
    shape_sets = parse_shapes(shapes)
    # Triton's interpreter computes a bf16 tl.dot wrongly: interpreted runs feed both sides fp16 instead.
    interp = settings.triton_interpreted() and "triton" in (backend, against)
    if against == backend:
        raise ValueError(f"--against {against}: the backend under test itself; name another backend")

    if ref != "torch":
        load_backend(ref)
    # 1. inputs and reference outputs, before the tested backend runs anything
    pending = []  # (CaseResult, Variant, ref outputs)
    results: list[CaseResult] = []
    for op in names:
        for sname in shape_sets:
            dims = SHAPES[sname]
            for phase in PHASES:
                if dims.big and not on_cuda:
                    results.append(CaseResult(op, sname, phase, "*", "skip",
                                              reason=f"V4-{sname.capitalize()} shapes need a CUDA device (device is {dev})"))
                    continue
                rfn = _ref_fn(op, ref)
                if rfn is None:
                    results.append(CaseResult(op, sname, phase, "*", "skip", reason=f"reference backend {ref!r} lacks {op}"))
                    continue
                try:
                    variants = ab_cases.build(op, dims, phase, seed, dev)
                except torch.OutOfMemoryError as e:
                    results.append(CaseResult(op, sname, phase, "*", "skip", reason=f"out of memory building inputs: {e}"))
                    continue
                for v in variants:
                    ran_as = ""
                    if interp and _has_bf16(v):
                        v, ran_as = _no_bf16(v), "float16"
                    cr = CaseResult(op, sname, phase, v.name, "pending", summary=ab_cases.shape_summary(v.args),
                                    ran_as=ran_as)
                    try:
                        r_out = call(op, rfn, v.args, v.kwargs)
                    except Exception as e:
                        cr.status, cr.reason = "error", f"reference raised {type(e).__name__}: {e}"
                        results.append(cr)
                        continue
                    if on_cuda:
                        torch.cuda.synchronize()
                    pending.append((cr, v, r_out))
                    results.append(cr)
    # 2. the backend (and its peer)
    load_backend(backend)
    if against:
        load_backend(against)
    not_impl = [op for op in names if backend not in REGISTRY[op].impls]
    writer_dir = None
    if dump:
        os.makedirs(dump, exist_ok=True)
        writer_dir = dump
    for cr, v, r_out in pending:
        fn = REGISTRY[cr.op].impls.get(backend)
        if fn is None:
            why = by_design(backend, cr.op)
            cr.status, cr.reason = "skip", (f"backend {backend!r} runs the reference by design: {why}" if why
                                            else f"backend {backend!r} has no implementation")
            results.remove(cr)
            continue
        if progress:
            progress(cr)
        target = _judged_against(cr, fn, v, ref, r_out)
        if target is None:
            continue
        got = _run_case(cr, fn, v.args, v.kwargs, target, do_bench, on_cuda)
        if against:
            cr.peer = CaseResult(cr.op, cr.shapes, cr.phase, cr.variant, "pending", summary=cr.summary,
                                 ran_as=cr.ran_as)
            pfn = REGISTRY[cr.op].impls.get(against)
            if pfn is None:
                cr.peer.status, cr.peer.reason = "skip", f"backend {against!r} has no implementation"
            else:
                target = _judged_against(cr.peer, pfn, v, ref, r_out)
                if target is not None:
                    _run_case(cr.peer, pfn, v.args, v.kwargs, target, do_bench, on_cuda)
        if writer_dir:
            write_case(os.path.join(writer_dir, cr.case_id + ".h5"), cr, v, r_out,
                       got if backend != ref else None, backend, ref, seed)
    # ops the backend does not implement are not cases: drop their skipped big-shape rows too
    results = [r for r in results if not (r.op in not_impl and r.status == "skip")]
    return ABReport(backend, ref, seed, dev, interp, results, not_impl, dumped=dump, against=against)


# ------------------------------------------------------------------------------------ dump/compare
def _encode_value(v, tensors: dict, key: str):
    """A call argument -> JSON description; tensors go to `tensors[key]`."""
    if isinstance(v, torch.Tensor):
        tensors[key] = v
        return {"tensor": key}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and not (v == v and abs(v) != float("inf")):
            return {"float": repr(v)}
        return {"value": v}
    raise TypeError(f"cannot store an argument of type {type(v).__name__}")


def _decode_value(d: dict, tensors: dict, device):
    if "tensor" in d:
        return tensors[d["tensor"]].to(device)
    if "dtype" in d:
        return getattr(torch, d["dtype"])
    if "float" in d:
        return float(d["float"])
    return d["value"]


def write_case(path: str, cr: CaseResult, v: Variant, ref_out: list, got: list | None, backend: str,
               ref: str, seed: int) -> None:
    from deepinfer.debug.h5schema import DumpWriter

    tensors: dict[str, torch.Tensor] = {}
    args = [_encode_value(a, tensors, f"in.{i}") for i, a in enumerate(v.args)]
    kwargs = {k: _encode_value(a, tensors, f"kw.{k}") for k, a in v.kwargs.items()}
    outs = [_encode_value(o, tensors, f"out.{i}") for i, o in enumerate(ref_out)]
    if got is not None:
        for i, o in enumerate(got):
            if isinstance(o, torch.Tensor):
                tensors[f"got.{i}"] = o
    call_desc = {"op": cr.op, "shapes": cr.shapes, "phase": cr.phase, "variant": cr.variant, "args": args,
                 "kwargs": kwargs, "outputs": outs}
    attrs = {"ab_format": AB_FORMAT, "ab_call": json.dumps(call_desc), "op": cr.op, "case": cr.case_id,
             "ref_backend": ref, "tested_backend": backend, "seed": seed, "status": cr.status,
             "torch": torch.__version__, "device": str(ref_out[0].device) if ref_out and isinstance(
                 ref_out[0], torch.Tensor) else "", "tol": json.dumps(REGISTRY[cr.op].tol)}
    with DumpWriter(path, attrs) as w:
        for name, t in tensors.items():
            w.add(name, t)


def compare_dir(directory: str, backend: str, ops_regex: str | None = None, do_bench: bool = False,
                device: str | None = None, progress=None) -> ABReport:
    """Replay every saved case in `directory` on `backend` here and compare with the saved outputs."""
    from deepinfer.debug.h5schema import DumpError, DumpReader

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--compare {directory}: no such directory")
    files = sorted(f for f in os.listdir(directory) if f.endswith(".h5"))
    if not files:
        raise ValueError(f"--compare {directory}: no .h5 case files (write them with `deepinfer ab --dump DIR`)")
    try:
        rx = re.compile(ops_regex) if ops_regex else None
    except re.error as e:
        raise ValueError(f"--ops {ops_regex!r}: not a regular expression ({e})") from None
    seen_ops: set[str] = set()
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    load_backend(backend)
    interp = settings.triton_interpreted() and backend == "triton"
    results, seeds = [], set()
    bad = []  # every file checked before any case runs: a file that is not a case is bad input (exit 2), not a
    for f in files:  # failed case
        try:
            with DumpReader(os.path.join(directory, f)) as r:
                if r.attrs.get("ab_format") != AB_FORMAT:
                    raise DumpError("a dump but not an `ab --dump` case file")
        except DumpError as e:
            bad.append(f"{f} ({str(e).strip().splitlines()[0][-120:]})")
    if bad:
        raise ValueError(f"--compare {directory}: {len(bad)} of {len(files)} .h5 files are not `ab --dump` case files: "
                         + "; ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))
    for f in files:
        path = os.path.join(directory, f)
        try:
            with DumpReader(path) as r:
                if r.attrs.get("ab_format") != AB_FORMAT:
                    raise DumpError(f"{path}: a dump but not an `ab --dump` case file")
                desc = json.loads(r.attrs["ab_call"])
                tensors = {n: r.tensor(n) for n in r.names()}
                seeds.add(r.attrs.get("seed"))
        except DumpError as e:
            results.append(CaseResult(f, "?", "?", "?", "error", reason=str(e)))
            continue
        op = desc["op"]
        seen_ops.add(op)
        if rx and not rx.search(op):
            continue
        cr = CaseResult(op, desc["shapes"], desc["phase"], desc["variant"], "pending")
        if op not in REGISTRY:
            cr.status, cr.reason = "skip", f"op {op!r} is not defined in this deepinfer"
            results.append(cr)
            continue
        fn = REGISTRY[op].impls.get(backend)
        if fn is None:
            why = by_design(backend, cr.op)
            cr.status, cr.reason = "skip", (f"backend {backend!r} runs the reference by design: {why}" if why
                                            else f"backend {backend!r} has no implementation")
            results.append(cr)
            continue
        if torch.device(dev).type != "cuda" and any(t.numel() > 64_000_000 for t in tensors.values()):
            cr.status, cr.reason = "skip", "saved inputs are big shapes; needs a CUDA device"
            results.append(cr)
            continue
        args = tuple(_decode_value(a, tensors, dev) for a in desc["args"])
        kwargs = {k: _decode_value(a, tensors, dev) for k, a in desc["kwargs"].items()}
        if interp and op in _DOT_OPS and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
            cr.status = "skip"
            cr.reason = "saved bf16 inputs: Triton's interpreter computes a bf16 tl.dot wrongly (run on a GPU)"
            results.append(cr)
            continue
        ref_out = [_decode_value(o, tensors, dev) for o in desc["outputs"]]
        cr.summary = ab_cases.shape_summary(args)
        if progress:
            progress(cr)
        _run_case(cr, fn, args, kwargs, ref_out, do_bench, torch.device(dev).type == "cuda")
        results.append(cr)
    if rx and not results:  # a filter that matches nothing compared nothing: not a pass
        ops_saved = sorted(seen_ops)
        raise ValueError(f"--ops {ops_regex!r}: matches none of the ops of the cases saved in {directory} "
                         f"({', '.join(ops_saved[:12])}{' ...' if len(ops_saved) > 12 else ''})")
    seed = next(iter(seeds)) if len(seeds) == 1 else None
    return ABReport(backend, None, seed, dev, interp, results, source=directory)


__all__ = ["run_ab", "compare_dir", "compare_outputs", "compare_tensor", "ABReport", "CaseResult", "BackendError",
           "parse_shapes"]
