"""Compare two dumps tensor by tensor: metrics, pass/fail, and the first tensor that diverges.

B is the reference. Per pair of same-named tensors (`compare_tensors`):

* float: max/mean |a-b|, rel_err ‖a-b‖/‖b‖, cosine, `1 - 2Σab/(Σa²+Σb²)`, the largest ULP distance in
  the coarser of the two dtypes, the worst coordinate with both values, NaN/Inf counts per side, and the
  fraction of failing elements. Continuous metrics use the elements finite on both sides (float64);
  non-finite elements are judged separately: NaN always fails, ±Inf passes only against the same ±Inf.
* index (top-k indices, selected experts; `index_like`): each row (last axis) is a set; the score is the
  overlap |A∩B| / |B| per row (-1 = empty slot, ignored), failing below `min_overlap` (default 1).
* other integers (token ids): element by element, exact.

An element fails only when |a-b| > atol AND |a-b| > rtol·|b| (so atol guards values near zero and rtol
large ones). `--stat max|mean|median|quantile` instead tests one statistic: S(|a-b|) > atol + rtol·S(|b|)
fails the tensor (S over the finite elements; non-finite mismatches still fail).

The verdicts are `deepinfer.debug.comparators`' (the core `deepinfer ab` uses too); this module adds the
report's metrics (cosine, ULPs, the worst coordinate), name-based kinds, tolerance rules and pairing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

import torch

from deepinfer.debug.comparators import STATS, judge_float, judge_int, judge_sets, mismatch, set_overlap, unravel
from deepinfer.debug.fingerprint import PAIRING_FIELDS, differing
from deepinfer.debug.h5schema import DumpError, DumpReader

# Tensors whose last axis is an unordered selection: compared as sets per row.
INDEX_PATTERN = re.compile(r"(\.topk|\.router\.experts)(#\d+)?$")
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7,
             torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
_BITS_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


class PairingError(ValueError):
    """Two dumps that cannot be compared (different models or prompts): exit code 2."""


# ------------------------------------------------------------------------------------ tolerances
@dataclass
class Tol:
    rtol: float = 1e-2
    atol: float = 1e-3
    stat: str = "elemwise"
    quantile: float = 0.99
    min_overlap: float = 1.0
    skip: bool = False

    def check(self, where: str = "") -> "Tol":
        """Raise ValueError naming the option (or the rule) for a tolerance that cannot mean anything."""
        pre = f"{where}: " if where else ""
        for k in ("rtol", "atol"):
            v = getattr(self, k)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{pre}--{k} {v}: must be a finite number >= 0")
        if not 0 < self.quantile < 1:
            raise ValueError(f"{pre}--quantile {self.quantile}: must be in (0, 1)")
        if not 0 <= self.min_overlap <= 1:
            raise ValueError(f"{pre}--min-overlap {self.min_overlap}: must be in [0, 1]")
        if self.stat not in STATS:
            raise ValueError(f"{pre}--stat {self.stat!r}: choose {' | '.join(STATS)}")
        return self


@dataclass
class Rule:
    pattern: re.Pattern
    values: dict


class Tolerances:
    """Defaults plus regex rules; the first rule whose pattern `re.search`es the name wins.

    File formats (see dumps/README.md):
      JSON: {"rules": [{"match": "indexer\\\\.topk$", "min_overlap": 0.75}, {"match": "logits", "rtol": 0.05}]}
            (or just the list)
      text: one rule a line, `REGEX key=value ...` with keys rtol atol stat quantile min_overlap skip;
            `#` starts a comment.
    """

    @staticmethod
    def _flag(v) -> bool:
        """skip's value: a JSON bool or 1/0/true/false/yes/no; anything else (`skip=ture`) is an error, not false."""
        if isinstance(v, bool):
            return v
        t = str(v).lower()
        if t in ("1", "true", "yes"):
            return True
        if t in ("0", "false", "no"):
            return False
        raise ValueError(v)

    KEYS = {"rtol": float, "atol": float, "stat": str, "quantile": float, "min_overlap": float,
            "skip": _flag.__func__}

    def __init__(self, default: Tol | None = None, rules: list[Rule] | None = None):
        self.default, self.rules = default or Tol(), rules or []

    def for_name(self, name: str) -> Tol:
        for r in self.rules:
            if r.pattern.search(name):
                return Tol(**{**asdict(self.default), **r.values})
        return self.default

    @classmethod
    def _rule(cls, pattern: str, values: dict, where: str) -> Rule:
        if not isinstance(pattern, str):
            raise ValueError(f"{where}: \"match\" must be a regex string, not {pattern!r}")
        try:
            pat = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: bad regex {pattern!r} ({e})") from None
        out = {}
        for k, v in values.items():
            if k not in cls.KEYS:
                raise ValueError(f"{where}: unknown key {k!r} (known: {', '.join(cls.KEYS)})")
            try:
                out[k] = cls.KEYS[k](v)
            except (TypeError, ValueError):
                raise ValueError(f"{where}: {k}={v!r} is not a valid value") from None
        if out.get("stat", "elemwise") not in STATS:
            raise ValueError(f"{where}: stat {out['stat']!r}: choose {'|'.join(STATS)}")
        Tol(**{k: v for k, v in out.items()}).check(where)
        return Rule(pat, out)

    @classmethod
    def load(cls, path: str, default: Tol) -> "Tolerances":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--tolerances {path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--tolerances {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                             f"{e.start})") from None
        rules = []
        if text.lstrip().startswith(("{", "[")):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--tolerances {path}: not valid JSON ({e})") from None
            if isinstance(data, dict):
                extra = sorted(set(data) - {"rules"})
                if extra or "rules" not in data:
                    raise ValueError(f"--tolerances {path}: a JSON object holds one key, \"rules\" (a list); found "
                                     f"{', '.join(map(repr, extra)) or 'no rules'}")
                items = data["rules"]
            else:
                items = data
            if not isinstance(items, list):
                raise ValueError(f"--tolerances {path}: \"rules\" must be a list of rules, not {type(items).__name__}")
            for i, item in enumerate(items):
                if not isinstance(item, dict) or "match" not in item:
                    raise ValueError(f"--tolerances {path}: rule {i} needs a \"match\" regex")
                vals = {k: v for k, v in item.items() if k != "match"}
                rules.append(cls._rule(item["match"], vals, f"{path} rule {i}"))
        else:
            for ln, line in enumerate(text.splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                pattern, *kvs = line.split()
                vals = {}
                for kv in kvs:
                    if "=" not in kv:
                        raise ValueError(f"{path}:{ln}: expected key=value, got {kv!r}")
                    k, v = kv.split("=", 1)
                    vals[k] = v
                rules.append(cls._rule(pattern, vals, f"{path}:{ln}"))
        return cls(default, rules)


# --------------------------------------------------------------------------------------- metrics
@dataclass
class Row:
    """The comparison of one name. `status`: pass | fail | shape | only_a | only_b | skip."""

    name: str
    order: int
    kind: str = "float"  # float | index | int
    status: str = "pass"
    shape_a: tuple = ()
    shape_b: tuple = ()
    dtype_a: str = ""
    dtype_b: str = ""
    max_abs: float | None = None
    mean_abs: float | None = None
    rel_err: float | None = None
    cosine: float | None = None
    dissim: float | None = None  # 1 - 2Σab/(Σa²+Σb²)
    max_ulp: int | None = None
    ulp_dtype: str = ""
    worst_index: list | None = None
    worst_a: float | None = None
    worst_b: float | None = None
    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    fail_frac: float = 0.0
    overlap: float | None = None  # index tensors: mean per-row overlap
    min_overlap: float | None = None
    stat_value: float | None = None  # --stat: S(|a-b|) and its bound atol + rtol·S(|b|)
    stat_bound: float | None = None
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "shape")

    def summary(self) -> str:
        """One phrase for 'first divergence: <name>, <summary>'."""
        if self.status == "shape":
            return f"shape {list(self.shape_a)} vs {list(self.shape_b)}"
        if self.kind == "index":
            return f"overlap {self.overlap:.2f} (worst row {self.min_overlap:.2f})"
        if self.kind == "int":
            return f"{self.fail_frac:.1%} of ids differ"
        s = f"rel_err {fmt(self.rel_err)}, max|Δ| {fmt(self.max_abs)}"
        if self.nan_a or self.nan_b:
            s += f", NaN {self.nan_a}/{self.nan_b}"
        return s


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.{digits}e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4) else f"{v:.{digits + 1}g}"
    return str(v)


def is_index(name: str) -> bool:
    return bool(INDEX_PATTERN.search(name))


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Float tensor -> int64 where consecutive representable values differ by 1 (±0 both map to 0)."""
    bits = x.element_size() * 8
    u = x.view(_BITS_INT[bits]).to(torch.int64)
    if bits < 64:
        u = u & ((1 << bits) - 1)  # unsigned view of the raw bits
        sign = 1 << (bits - 1)
        return torch.where(u >= sign, -(u - sign), u)
    return torch.where(u < 0, -(u & ((1 << 63) - 1)), u)


def coarser(da: torch.dtype, db: torch.dtype) -> torch.dtype:
    return min((da, db), key=lambda d: _MANTISSA.get(d, 52))


def max_ulp(a: torch.Tensor, b: torch.Tensor, finite: torch.Tensor) -> tuple[int | None, str]:
    """Largest ULP distance over `finite` elements after rounding both to the coarser float dtype."""
    if not (a.is_floating_point() and b.is_floating_point()):
        return None, ""
    dt = coarser(a.dtype, b.dtype)
    if not bool(finite.any()):
        return 0, str(dt).removeprefix("torch.")
    # Rounding into the coarser type is what a reader of that type would see; ULPs are counted there.
    qa, qb = a[finite].to(dt), b[finite].to(dt)
    d = (_ordered_bits(qa) - _ordered_bits(qb)).abs()
    return int(d.max()), str(dt).removeprefix("torch.")


def compare_float(row: Row, a: torch.Tensor, b: torch.Tensor, tol: Tol) -> Row:
    """The core's element-wise verdict (fail beyond both atol and rtol·|b|; dtypes may differ) plus the
    report's metrics: mean |Δ|, cosine, dissimilarity, ULPs and the largest |Δ|'s coordinate."""
    v = judge_float(a, b, (tol.rtol, tol.atol), combine="max", strict_dtype=False, stat=tol.stat,
                    quantile=tol.quantile)
    s = v.stats
    row.nan_a, row.nan_b = int(s.nan_a.sum()), int(s.nan_b.sum())
    row.inf_a, row.inf_b = int(s.a.isinf().sum()), int(s.b.isinf().sum())
    row.max_abs, row.rel_err = v.max_abs, v.rel_err
    row.mean_abs = float(s.diff.mean()) if s.diff.numel() else 0.0
    ab, na, nb = float((s.fa * s.fb).sum()), s.norm_a, s.norm_b
    row.cosine = ab / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    row.dissim = 1 - 2 * ab / (na * na + nb * nb) if na * na + nb * nb > 0 else 0.0
    row.max_ulp, row.ulp_dtype = max_ulp(a.reshape(-1), b.reshape(-1), s.finite)
    row.fail_frac = v.n_bad / v.n if v.n else 0.0
    # worst coordinate: a non-finite mismatch first (it is what breaks things), else the largest |Δ|
    flat = s.largest()
    if flat is not None:
        row.worst_index = unravel(flat, a.shape)
        row.worst_a, row.worst_b = float(s.a[flat]), float(s.b[flat])
    row.stat_value, row.stat_bound = s.stat_value, s.stat_bound
    row.status = "pass" if v.ok else "fail"
    return row


def compare_tensors(name: str, a: torch.Tensor, b: torch.Tensor, tol: Tol, order: int = 0) -> Row:
    """One pair (b = reference) -> Row with metrics and status."""
    row = Row(name, order, shape_a=tuple(a.shape), shape_b=tuple(b.shape),
              dtype_a=str(a.dtype).removeprefix("torch."), dtype_b=str(b.dtype).removeprefix("torch."))
    floating = a.is_floating_point() or b.is_floating_point()
    row.kind = "index" if is_index(name) and not floating else ("float" if floating else "int")
    if tol.skip:
        row.status = "skip"
        return row
    if row.kind == "float":
        if mismatch(a, b, strict_dtype=False) is not None:
            row.status = "shape"
            return row
        return compare_float(row, a, b, tol)
    # the set width may differ (k' = min(topk, T)); the rows may not
    v = judge_sets(a, b, tol.min_overlap) if row.kind == "index" else judge_int(a, b, strict_dtype=False)
    if v.kind == "shape":
        row.status = "shape"
        return row
    if row.kind == "index":
        ov = v.stats.overlap
        row.overlap = float(ov.mean()) if ov.numel() else 1.0
        row.min_overlap = float(ov.min()) if ov.numel() else 1.0
        if v.worst is not None:
            row.worst_index = unravel(v.worst, b.shape[:-1]) if b.dim() > 1 else [v.worst]
            row.note = v.note
    else:
        row.max_abs = v.max_abs
        if v.worst is not None:
            row.worst_index = unravel(v.worst, a.shape)
            row.worst_a, row.worst_b = float(a.reshape(-1)[v.worst]), float(b.reshape(-1)[v.worst])
    row.fail_frac = v.n_bad / v.n if v.n else 0.0
    row.status = "pass" if v.ok else "fail"
    return row


# ---------------------------------------------------------------------------------------- report
@dataclass
class Report:
    path_a: str
    path_b: str
    rows: list[Row] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    fingerprint_diff: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what could not be checked (missing taps, attributes)

    @property
    def compared(self) -> list[Row]:
        return [r for r in self.rows if r.status not in ("only_a", "only_b")]

    @property
    def first_divergence(self) -> Row | None:
        return next((r for r in self.compared if r.failed), None)

    @property
    def n_failed(self) -> int:
        return sum(r.failed for r in self.compared)

    @property
    def passed(self) -> bool:
        return self.n_failed == 0 and not (self.settings.get("require_all") and (self.only_a or self.only_b))

    def first_line(self) -> str:
        r = self.first_divergence
        if r is None:
            n = [x for x in self.compared if x.status != "skip"]
            skipped = len(self.compared) - len(n)
            return f"all {len(n)} compared tensors pass" + (f" ({skipped} skipped by rule)" if skipped else "")
        return f"first divergence: {r.name}, {r.summary()}"

    def to_dict(self) -> dict:
        fd = self.first_divergence
        return {
            "a": self.path_a, "b": self.path_b, "reference": "b", "pass": self.passed,
            "first_divergence": None if fd is None else {"name": fd.name, "summary": fd.summary()},
            "n_compared": len(self.compared), "n_failed": self.n_failed,
            "only_in_a": self.only_a, "only_in_b": self.only_b,
            "fingerprint_diff": {k: list(v) for k, v in self.fingerprint_diff.items()},
            "settings": self.settings, "warnings": self.warnings,
            "rows": [_json_row(r) for r in self.rows],
        }


def _json_row(r: Row) -> dict:
    d = asdict(r)
    d["shape_a"], d["shape_b"] = list(r.shape_a), list(r.shape_b)
    for k, v in d.items():  # JSON has no NaN/Inf
        if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
            d[k] = str(v)
    return d


class NothingCompared(ValueError):
    """No tensor pair was compared (an empty dump, a filter that matches nothing, disjoint names): not a
    pass, and not a verdict either, so exit code 2."""


# what a dump made by `deepinfer dump` always holds: without them the pairing cannot be checked
EXPECTED_TENSORS = ("input_ids", "logits")
EXPECTED_ATTRS = ("config_fingerprint", "prompt", "backend", "numerics", "dtype")


def unchecked(ra: DumpReader, rb: DumpReader) -> list[str]:
    """One warning per tensor or fingerprint attribute that a `deepinfer dump` file has and one of these
    lacks: the comparison goes on, but says what it could not check."""
    out = []
    for side, r in (("A", ra), ("B", rb)):
        miss_t = [n for n in EXPECTED_TENSORS if n not in r]
        miss_a = [k for k in EXPECTED_ATTRS if r.attrs.get(k) in (None, "")]
        if miss_t:
            out.append(f"{side} ({r.path}) has no {' or '.join(miss_t)} tensor"
                       + (": the prompts cannot be checked to be the same" if "input_ids" in miss_t else ""))
        if miss_a:
            out.append(f"{side} ({r.path}) lacks fingerprint attribute(s) {', '.join(miss_a)}: "
                       "not a `deepinfer dump` file, or written by hand")
    return out


def check_pairable(ra: DumpReader, rb: DumpReader) -> None:
    """Different models or prompts make every comparison meaningless: refuse (exit 2)."""
    for k in PAIRING_FIELDS:
        va, vb = ra.attrs.get(k), rb.attrs.get(k)
        if va is not None and vb is not None and va != vb:
            what = "models" if k == "config_fingerprint" else "prompts"
            raise PairingError(f"cannot pair the dumps: different {what} ({k} {va!r} vs {vb!r})")
    if "input_ids" in ra and "input_ids" in rb:
        ia, ib = ra.tensor("input_ids"), rb.tensor("input_ids")
        if ia.shape != ib.shape or not torch.equal(ia.long(), ib.long()):
            raise PairingError("cannot pair the dumps: their prompts tokenise differently (input_ids differ)")


def compare_dumps(path_a: str, path_b: str, tolerances: Tolerances | None = None, name_filter: str | None = None,
                  require_all: bool = False) -> Report:
    """A vs B (reference) -> Report. Raises DumpError (unreadable) or PairingError (exit 2)."""
    tolerances = tolerances or Tolerances()
    try:
        flt = re.compile(name_filter) if name_filter else None
    except re.error as e:
        raise ValueError(f"--filter {name_filter!r}: bad regex ({e})") from None
    with DumpReader(path_a) as ra, DumpReader(path_b) as rb:
        check_pairable(ra, rb)
        rep = Report(path_a, path_b, fingerprint_diff=differing(ra.attrs, rb.attrs),
                     settings={**asdict(tolerances.default), "filter": name_filter or "",
                               "rules": len(tolerances.rules), "require_all": require_all},
                     warnings=unchecked(ra, rb))
        # Forward-pass order: B's capture order (the reference), A-only names by A's order after them.
        names = [n for n in rb.names() if flt is None or flt.search(n)]
        extra = [n for n in ra.names() if n not in rb and (flt is None or flt.search(n))]
        for n in names:
            mb = rb.meta(n)
            if n not in ra:
                rep.only_b.append(n)
                rep.rows.append(Row(n, mb["order"], status="only_b", shape_b=mb["shape"], dtype_b=mb["dtype"]))
                continue
            rep.rows.append(compare_tensors(n, ra.tensor(n), rb.tensor(n), tolerances.for_name(n), mb["order"]))
        for n in extra:
            ma = ra.meta(n)
            rep.only_a.append(n)
            rep.rows.append(Row(n, ma["order"], status="only_a", shape_a=ma["shape"], dtype_a=ma["dtype"]))
        if not any(r.status != "skip" for r in rep.compared):
            na, nb = len(ra.names()), len(rb.names())
            why = (f"A has {na} and B {nb} tensors" if not (na and nb) else
                   f"--filter {name_filter!r} matches none of their names" if flt is not None and not names + extra
                   else "every shared name is skipped by a tolerance rule" if rep.compared
                   else "the two dumps share no tensor name")
            raise NothingCompared(f"nothing compared ({why}): no comparison is not a pass")
    return rep


__all__ = ["DumpError", "NothingCompared", "PairingError", "Report", "Row", "Tol", "Tolerances", "compare_dumps",
           "compare_tensors", "set_overlap", "max_ulp"]
