"""The one comparator core behind `deepinfer compare` (dump against dump) and `deepinfer ab` (a backend's op
against the reference): given a tensor under test `got` and its reference `ref`, a verdict.

* floating tensors (`judge_float`): element by element, |Δ| = |got − ref| against an allowed error built
  from (rtol, atol) -- `combine="sum"`: atol + rtol·|ref| (`ab`, numpy's isclose); `combine="max"`:
  max(atol, rtol·|ref|), i.e. an element fails only beyond both (`compare`) -- optionally widened per
  element (`widen`: ab's tensor-core and propagated bounds). Reported: max |Δ|, max |Δ|/|ref|, the norm
  ratio ‖Δ‖/‖ref‖, the worst element's |Δ| / allowed (`worst_ratio`, < 1 passes). Non-finite elements are
  judged apart: NaN never passes (`nan_equal=True` lets NaN match NaN, for poisoned buffers whose unwritten
  elements must stay NaN), ±Inf only against the same ±Inf. `stat=` judges one statistic instead:
  S(|Δ|) ≤ atol + rtol·S(|ref|) over the finite elements (non-finite mismatches still fail).
* integer / bool tensors (`judge_int`): exact.
* index sets (`judge_sets`, top-k indices, selected experts): each row (the last axis) is a set, -1 an
  empty slot. Exact (the default): a row holds the same indices as the reference's, order free (the same
  multiset: holes and duplicates count). `min_overlap=x`: a row passes when |A∩B|/|B| ≥ x (the recall of
  the reference's set, -1 ignored; the widths may differ; an empty reference row needs an empty row).
  Rows with no slot at all (k = 0) are empty sets.
* FP8 codes with their per-block scales (`judge_scaled_fp8`): the codes are judged by their values q·s
  within one e4m3 step, the scales exactly but for a power-of-two boundary flip.

A shape mismatch is a failure (kind "shape"), and so is a dtype mismatch unless `strict_dtype=False`
(compare pairs a bf16 dump with a float32 one). Tolerances come from one place: the caller's (rtol, atol),
else the op registry's per-op, per-dtype `OpDef.tol` (`tolerance`), else its `DEFAULT_TOL`, else exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# One e4m3 step is 2^-3 relative (3 mantissa bits): the scaled comparison's rtol when no op names one.
E4M3_STEP_REL = 0.13
E4M3_SUBNORMAL = 2.0 ** -9  # the smallest e4m3 subnormal, in units of the block's scale
# a ue8m0 boundary flip: the finer side's block reaches code >= 416, the coarser side's stays <= 240
FLIP_HI, FLIP_LO = 416, 240
COMBINES = ("sum", "max")
STATS = ("elemwise", "max", "mean", "median", "quantile")


# ------------------------------------------------------------------------------------------ verdict
@dataclass
class Verdict:
    """One comparison. `n_bad` of `n` units failed (elements; rows for `min_overlap` sets; for a `stat`
    verdict the element-wise count is still reported). `worst`: flat index of the deciding element (the
    first non-finite mismatch, else the largest violation; the worst row for sets), None when none
    failed. `n_excused`: differences a rule accepted (FP8 scale flips). `stats`: the per-element detail
    (`ElementStats`, `SetStats`) for reports."""

    ok: bool
    max_abs: float | None = None
    max_rel: float | None = None
    worst_ratio: float | None = None
    n_bad: int = 0
    note: str = ""
    kind: str = "float"  # float | int | set | fp8 | fp8-scale | shape | dtype
    n: int = 0
    rel_err: float | None = None  # ‖Δ‖ / ‖ref‖
    worst: int | None = None
    n_excused: int = 0
    stats: object = field(default=None, repr=False, compare=False)


@dataclass
class ElementStats:
    """Floating comparison detail: flat float64 views, masks, and |Δ| / allowed over the finite pairs."""

    a: torch.Tensor  # got, float64, flat
    b: torch.Tensor  # ref, float64, flat
    shape: tuple
    finite: torch.Tensor  # both finite
    nan_a: torch.Tensor
    nan_b: torch.Tensor
    nonfinite_bad: torch.Tensor  # flat: a non-finite element that fails
    diff: torch.Tensor  # |Δ| over the finite pairs (compressed)
    allowed: torch.Tensor  # the allowed |Δ| over the finite pairs
    bad: torch.Tensor  # flat: every element failing the element-wise rule (non-finite ones included)
    norm_a: float = 0.0
    norm_b: float = 0.0
    norm_d: float = 0.0
    n_nan_mismatch: int = 0
    n_inf_mismatch: int = 0
    stat_value: float | None = None
    stat_bound: float | None = None

    @property
    def fa(self) -> torch.Tensor:
        return self.a[self.finite]

    @property
    def fb(self) -> torch.Tensor:
        return self.b[self.finite]

    def largest(self) -> int | None:
        """Flat index of the element to show: the first non-finite mismatch, else the largest |Δ|."""
        if bool(self.nonfinite_bad.any()):
            return int(self.nonfinite_bad.nonzero()[0])
        if self.diff.numel():
            return int(self.finite.nonzero()[int(self.diff.argmax())])
        return None

    def worst_violation(self) -> int | None:
        """Flat index of the finite element furthest outside its allowed error (|Δ| − allowed), if any."""
        viol = self.diff > self.allowed
        if not bool(viol.any()):
            return None
        i = int(torch.argmax(torch.where(viol, self.diff - self.allowed, -1.0)))
        return int(self.finite.nonzero()[i])


@dataclass
class SetStats:
    overlap: torch.Tensor | None = None  # per row |A∩B| / |B| (min_overlap mode)


# --------------------------------------------------------------------------------------- tolerances
def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tolerance(op: str | None, dtype) -> tuple:
    """(rtol, atol) for `op`'s outputs of `dtype`: the registry's `OpDef.tol[dtype]`, else `DEFAULT_TOL`,
    else exact (0, 0) -- float8 outputs without an entry, integers. The one table of tolerances."""
    from deepinfer.ops.registry import DEFAULT_TOL, REGISTRY, _ensure_reference

    name = dtype_name(dtype)
    tol = None
    if op is not None:
        _ensure_reference()
        if op not in REGISTRY:
            raise KeyError(f"no op named {op!r} in the registry")
        tol = REGISTRY[op].tol.get(name)
    if tol is None:
        tol = DEFAULT_TOL.get(name)
    return (0.0, 0.0) if tol is None else tuple(tol)


def _resolve_tol(tol, op, dtype) -> tuple:
    if tol is None:
        return tolerance(op, dtype)
    rtol, atol = tol
    for k, v in (("rtol", rtol), ("atol", atol)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{k} {v}: must be a finite number >= 0")
    return rtol, atol


def allowed_error(ref: torch.Tensor, rtol: float, atol: float, combine: str = "sum") -> torch.Tensor:
    """Per element |Δ| allowed: atol + rtol·|ref| ("sum") or max(atol, rtol·|ref|) ("max")."""
    if combine == "sum":
        return atol + rtol * ref.abs()
    if combine == "max":
        return (rtol * ref.abs()).clamp_min(atol)
    raise ValueError(f"combine {combine!r}: choose {' | '.join(COMBINES)}")


# ------------------------------------------------------------------------------------------ helpers
def rows(x: torch.Tensor) -> torch.Tensor:
    """[..., k] -> [rows, k] int64. k may be 0 (a CSA layer before its first compressed entry selects
    nothing), which `reshape(-1, 0)` cannot infer: the row count comes from the leading axes."""
    if x.dim() == 0:
        return x.reshape(1, 1).long()
    return x.reshape(math.prod(x.shape[:-1]), x.size(-1)).long()


def unravel(flat: int, shape) -> list[int]:
    return [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(shape))] if len(shape) else []


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as an integer tensor of its width (bool as is)."""
    t = t.contiguous()
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    return t.view(raw) if raw is not None and t.dtype != torch.bool else t


def bitwise_equal(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return got.shape == ref.shape and got.dtype == ref.dtype and bool(torch.equal(raw_bits(got), raw_bits(ref)))


def mismatch(got: torch.Tensor, ref: torch.Tensor, strict_dtype: bool = True, shape_of=None) -> Verdict | None:
    """A failure verdict for tensors that cannot be compared element by element, else None. `shape_of`:
    the part of the shapes that must agree (default all of it)."""
    sg, sr = (shape_of(got), shape_of(ref)) if shape_of else (tuple(got.shape), tuple(ref.shape))
    if tuple(sg) != tuple(sr):
        return Verdict(False, kind="shape", note=f"shape {list(got.shape)} != reference {list(ref.shape)}")
    if strict_dtype and got.dtype != ref.dtype:
        return Verdict(False, kind="dtype",
                       note=f"dtype {dtype_name(got.dtype)} != reference {dtype_name(ref.dtype)}")
    return None


def rel_norm(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got - ref‖ / ‖ref‖ in float64 (on got's device): 0 when equal, inf when not finite or against a zero
    reference."""
    ref = ref.to(got.device, torch.float64)
    d = (got.double() - ref).norm()
    n = ref.norm()
    if not n > 0:
        return 0.0 if d == 0 else math.inf
    r = float(d / n)
    return r if math.isfinite(r) else math.inf


def _max_rel(d: torch.Tensor, ref: torch.Tensor) -> float:
    """max |Δ| / |ref| (an element with ref 0 counts 0 when equal, inf when not)."""
    if not d.numel():
        return 0.0
    r = ref.abs()
    rel = torch.where(r > 0, d / torch.where(r > 0, r, 1.0), torch.where(d > 0, math.inf, 0.0))
    return float(rel.max())


def _stat(x: torch.Tensor, stat: str, q: float) -> float:
    if x.numel() == 0:
        return 0.0
    if stat == "max":
        return float(x.max())
    if stat == "mean":
        return float(x.mean())
    if stat == "median":
        return float(x.median())
    return float(torch.quantile(x, q)) if x.numel() <= 16_000_000 else float(x.kthvalue(
        max(1, math.ceil(q * x.numel()))).values)


# ------------------------------------------------------------------------------------------- floats
def judge_float(got: torch.Tensor, ref: torch.Tensor, tol: tuple | None = None, *, op: str | None = None,
                combine: str = "sum", nan_equal: bool = False, widen: torch.Tensor | None = None,
                strict_dtype: bool = True, stat: str = "elemwise", quantile: float = 0.99,
                nan_hint: str = "") -> Verdict:
    """Element-wise float comparison (see the module's doc). `tol` (rtol, atol), else the registry's for
    (`op`, ref's dtype). `widen`: a per-element |Δ| also allowed (the larger of the two bounds holds).
    `nan_hint` follows the NaN count in the note."""
    bad = mismatch(got, ref, strict_dtype)
    if bad is not None:
        return bad
    if stat not in STATS:
        raise ValueError(f"stat {stat!r}: choose {' | '.join(STATS)}")
    rtol, atol = _resolve_tol(tol, op, ref.dtype)
    a, b = got.detach().double().reshape(-1), ref.detach().to(got.device).double().reshape(-1)
    nan_a, nan_b = a.isnan(), b.isnan()
    finite = a.isfinite() & b.isfinite()
    # non-finite on either side: NaN fails (unless it meets NaN under nan_equal); ±Inf needs the same ±Inf
    if nan_equal:
        nonfin_bad = ~finite & ~(nan_a & nan_b) & ((a != b) | nan_a | nan_b)
        n_nan = int((nan_a ^ nan_b).sum())
    else:
        nonfin_bad = ~finite & ((a != b) | nan_a | nan_b)
        n_nan = int((nan_a | nan_b).sum())
    n_inf = int(nonfin_bad.sum()) - n_nan
    fa, fb = a[finite], b[finite]
    diff = (fa - fb).abs()
    allowed = allowed_error(fb, rtol, atol, combine)
    if widen is not None:
        allowed = torch.maximum(allowed, widen.detach().to(b.device).double().reshape(-1)[finite])
    elem_bad = torch.zeros(a.numel(), dtype=torch.bool, device=a.device)
    elem_bad[finite] = diff > allowed
    elem_bad |= nonfin_bad
    nd, nb, na = (float(diff.square().sum().sqrt()), float(fb.square().sum().sqrt()),
                  float(fa.square().sum().sqrt()))
    s = ElementStats(a, b, tuple(ref.shape), finite, nan_a, nan_b, nonfin_bad, diff, allowed, elem_bad,
                     norm_a=na, norm_b=nb, norm_d=nd, n_nan_mismatch=n_nan, n_inf_mismatch=n_inf)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    n_bad = int(elem_bad.sum())
    if stat == "elemwise":
        ok = n_bad == 0
    else:
        s.stat_value = _stat(diff, stat, quantile)
        s.stat_bound = atol + rtol * _stat(fb.abs(), stat, quantile)
        ok = s.stat_value <= s.stat_bound and not bool(nonfin_bad.any())
    worst = None
    if n_bad:
        worst = int(nonfin_bad.nonzero()[0]) if bool(nonfin_bad.any()) else s.worst_violation()
    parts = []
    n_viol = n_bad - int(nonfin_bad.sum())
    if n_viol and not ok:
        i = s.worst_violation()
        parts.append(f"{n_viol} of {a.numel()} element(s) outside tol (rtol {rtol:g}, atol {atol:g}); worst at "
                     f"{unravel(i, ref.shape)}: got {a[i].item():.6g}, expected {b[i].item():.6g}")
    if stat != "elemwise" and not ok and s.stat_value > s.stat_bound:
        parts.append(f"{stat} |Δ| {s.stat_value:.6g} > {s.stat_bound:.6g}")
    if n_nan:
        parts.append(f"{n_nan} NaN mismatch(es)" + nan_hint)
    if n_inf:
        parts.append(f"{n_inf} inf mismatch(es)")
    return Verdict(ok, max_abs=max_abs, max_rel=_max_rel(diff, fb),
                   worst_ratio=float((diff / allowed.clamp_min(1e-300)).max()) if diff.numel() else 0.0,
                   n_bad=n_bad, note="; ".join(parts), kind="float", n=a.numel(),
                   rel_err=nd / nb if nb > 0 else (0.0 if nd == 0 else math.inf), worst=worst, stats=s)


# ----------------------------------------------------------------------------------------- integers
def _int_verdict(ne: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kind: str) -> Verdict:
    """From the element mismatch mask `ne` (shape of a) and the compared integer tensors."""
    n, n_bad = ne.numel(), int(ne.sum())
    rows_bad = int(rows(ne).any(-1).sum())
    max_abs = float((a.long() - b.long()).abs().max()) if n else 0.0
    worst = int(ne.reshape(-1).nonzero()[0]) if n_bad else None
    return Verdict(n_bad == 0, max_abs=max_abs, n_bad=n_bad, n=n, kind=kind, worst=worst,
                   note="" if n_bad == 0 else f"{n_bad} element(s) differ in {rows_bad} row(s)")


def judge_int(got: torch.Tensor, ref: torch.Tensor, strict_dtype: bool = True) -> Verdict:
    """Integer (or bool) tensors: exact, element by element."""
    bad = mismatch(got, ref, strict_dtype)
    if bad is not None:
        return bad
    ref = ref.to(got.device)
    return _int_verdict(got.long() != ref.long(), got, ref, "int")


# -------------------------------------------------------------------------------------- index sets
def set_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row (all leading axes), |A∩B| / |B| with -1 entries ignored; 1 where B's row is empty and A's
    too, 0 where only B's is. a, b [..., k] (k may differ) -> [rows] float64."""
    A, B = rows(a), rows(b)
    out = torch.empty(B.size(0), dtype=torch.float64)
    for i in range(B.size(0)):
        sa = set(A[i].tolist()) - {-1}
        sb = set(B[i].tolist()) - {-1}
        out[i] = len(sa & sb) / len(sb) if sb else (1.0 if not sa else 0.0)
    return out


def judge_sets(got: torch.Tensor, ref: torch.Tensor, min_overlap: float | None = None,
               strict_dtype: bool = True) -> Verdict:
    """Index tensors [..., k], each row a set (-1 = empty slot). Exact (`min_overlap` None): every row
    holds the same indices as the reference's row, in any order (n, n_bad count elements, in sorted
    order). Else a row passes when |A∩B|/|B| ≥ min_overlap (n, n_bad count rows; the widths may differ)."""
    if min_overlap is None:
        bad = mismatch(got, ref, strict_dtype)
        if bad is not None:
            return bad
        ref = ref.to(got.device)
        ga, rb = torch.sort(got.long(), -1).values, torch.sort(ref.long(), -1).values
        return _int_verdict(ga != rb, ga, rb, "set")
    if not 0 <= min_overlap <= 1:
        raise ValueError(f"min_overlap {min_overlap}: must be in [0, 1]")
    bad = mismatch(got, ref, False, shape_of=lambda t: t.shape[:-1])  # the set width may differ
    if bad is not None:
        return bad
    ov = set_overlap(got.cpu(), ref.cpu())
    fail = ov < min_overlap
    n_bad = int(fail.sum())
    v = Verdict(n_bad == 0, n_bad=n_bad, n=ov.numel(), kind="set", stats=SetStats(ov))
    if n_bad:
        r = int(ov.argmin())
        v.worst = r
        where = unravel(r, ref.shape[:-1]) if ref.dim() > 1 else [r]
        v.note = f"row {where}: {sorted(set(rows(got)[r].tolist()) - {-1})} vs " \
                 f"{sorted(set(rows(ref)[r].tolist()) - {-1})}"
    return v


# ------------------------------------------------------------------------------------ scaled FP8
# An FP8 code means nothing without its scale: where an op returns codes q [..., K] and their per-block
# float32 scales s [..., K/block] side by side, the codes are judged by their values q·s. A ue8m0 scale is
# 2^ceil(log2(amax/448)), so a block whose amax sits on a power-of-two boundary takes 2^k on one side and
# 2^(k+1) on the other for a last-bit difference of amax: its codes are then ~448 against ~224 and its
# values equal to one e4m3 step of the coarser grid.
def judge_scaled_fp8(q_got: torch.Tensor, q_ref: torch.Tensor, s_got: torch.Tensor, s_ref: torch.Tensor,
                     block: int, tol: tuple | None = None, *, op: str | None = None) -> tuple[Verdict, Verdict]:
    """(values verdict, scales verdict). Values q·s within rtol·|ref| + 2^-9·scale (rtol: `tol`'s, else the
    registry's float8_e4m3fn rtol of `op`, else one e4m3 step `E4M3_STEP_REL`; 2^-9 is one subnormal step);
    scales exact but for power-of-two-boundary flips (a factor 2 where the finer side's block reaches code
    >= 416 and the coarser side's stays <= 240). NaN never passes."""
    bad = mismatch(q_got, q_ref) or mismatch(s_got, s_ref)
    if bad is not None:
        return bad, bad
    rtol = tol[0] if tol is not None else (tolerance(op, torch.float8_e4m3fn)[0] if op is not None
                                           else E4M3_STEP_REL)
    q_got, s_got = q_got.to(q_ref.device), s_got.to(s_ref.device)
    fg, fr = q_got.float().unflatten(-1, (-1, block)), q_ref.float().unflatten(-1, (-1, block))
    sgx, srx = s_got.unsqueeze(-1), s_ref.unsqueeze(-1)
    vg, vr = fg * sgx, fr * srx
    d = (vg - vr).abs()
    allowed = rtol * vr.abs() + E4M3_SUBNORMAL * torch.maximum(sgx, srx)
    viol = (d > allowed) | vg.isnan() | vr.isnan()
    n = int(viol.sum())
    values = Verdict(n == 0, max_abs=float(d.max()) if d.numel() else 0.0, max_rel=_max_rel(d, vr),
                     worst_ratio=float((d / allowed).max()) if d.numel() else 0.0, n_bad=n, n=vr.numel(),
                     kind="fp8", worst=int(viol.reshape(-1).nonzero()[0]) if n else None,
                     note="" if n == 0 else f"{n} of {vr.numel()} value(s) q·s outside one e4m3 step (rtol "
                     f"{rtol:g}, atol 2^-9·scale)")
    amax_g, amax_r = fg.abs().amax(-1), fr.abs().amax(-1)
    ratio = s_got / s_ref
    flip = ((ratio == 2) & (amax_r >= FLIP_HI) & (amax_g <= FLIP_LO)) | \
           ((ratio == 0.5) & (amax_g >= FLIP_HI) & (amax_r <= FLIP_LO))
    sbad = (s_got != s_ref) & ~flip
    nb, nf = int(sbad.sum()), int(((s_got != s_ref) & flip).sum())
    scales = Verdict(nb == 0, n_bad=nb, n=s_ref.numel(), kind="fp8-scale", n_excused=nf,
                     worst=int(sbad.reshape(-1).nonzero()[0]) if nb else None,
                     note=("" if nb == 0 else f"{nb} scale(s) differ beyond a power-of-two boundary flip")
                     + (f"; {nf} block(s) flipped at a power-of-two boundary" if nf else ""))
    return values, scales


# ---------------------------------------------------------------------------------------- dispatch
def judge(got: torch.Tensor, ref: torch.Tensor, tol: tuple | None = None, *, op: str | None = None,
          as_set: bool = False, min_overlap: float | None = None, strict_dtype: bool = True, **float_kw) -> Verdict:
    """Any pair: index sets when `as_set` (or `min_overlap` is given) and neither side is floating,
    floating tensors element-wise (`judge_float`, its keywords pass through), other integers exactly."""
    floating = got.is_floating_point() or ref.is_floating_point()
    if (as_set or min_overlap is not None) and not floating:
        return judge_sets(got, ref, min_overlap, strict_dtype)
    if floating:
        return judge_float(got, ref, tol, op=op, strict_dtype=strict_dtype, **float_kw)
    return judge_int(got, ref, strict_dtype)


__all__ = ["Verdict", "ElementStats", "SetStats", "tolerance", "allowed_error", "judge", "judge_float",
           "judge_int", "judge_sets", "judge_scaled_fp8", "set_overlap", "rows", "mismatch", "bitwise_equal",
           "raw_bits", "unravel", "E4M3_STEP_REL"]
