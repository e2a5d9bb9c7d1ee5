"""The op registry: the one seam between the model and its kernels.

Every numerically significant op the model calls is defined once here: its name, its plain-PyTorch
reference (the spec, in `deepinfer/ops/reference.py`), a tolerance justified by the dtype, and zero or
more backend implementations (`torch`, `triton`, `tilelang`). The model calls `ops.<name>(...)`; the
active `Dispatcher` resolves each name to the chosen backend's implementation or, when that backend
lacks one, to the reference -- recorded, announced once on stderr, and an error under `strict`.
A per-op map (`--op grouped_gemm=tilelang,...`, `DEEPINFER_OPS`) sends single ops to other backends:
the one mechanism every per-op choice goes through (`Dispatcher.backend_of`). A fused op the reference
writes as a composition of other ops (`composition`) is composed for a backend from that backend's own parts
(`compose`), so a backend never writes out the same composition again.

Backends are imported only when chosen (`deepinfer_kernels/triton` as `deepinfer_kernels.triton`, ...), so
importing deepinfer never imports Triton, TileLang, FlagGems or DeepGEMM.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, field
from typing import Callable

BACKENDS = ("torch", "triton", "tilelang", "flaggems", "deepgemm")
_BACKEND_MODULES = {"triton": "deepinfer_kernels.triton", "tilelang": "deepinfer_kernels.tilelang",
                    "flaggems": "deepinfer_kernels.flaggems", "deepgemm": "deepinfer_kernels.deepgemm"}
# what a backend needs installed, for the one line that says so: (package, how to install it)
_BACKEND_PACKAGES = {"triton": ("triton", "pip install -e '.[triton]'"),
                     "tilelang": ("tilelang", "pip install -e '.[tilelang]'"),
                     "flaggems": ("flag_gems", "pip install -e '.[flaggems]'"),
                     # DeepGEMM has no PyPI release: it is built from its source (JIT kernels, nvcc, CUTLASS headers)
                     "deepgemm": ("deep_gemm", "build it from its source, tools/device/DEEPGEMM.md")}


class BackendError(RuntimeError):
    """A backend that cannot be used (not importable, or strict mode met a missing implementation)."""


@dataclass
class OpDef:
    """One op: the reference is the spec; `tol` maps a dtype name to (rtol, atol) for A/B checks."""

    name: str
    ref: Callable
    doc: str
    tol: dict
    impls: dict = field(default_factory=dict)


REGISTRY: dict[str, OpDef] = {}

BY_DESIGN: dict[str, dict[str, str]] = {}
"""backend -> {op: reason}: ops a backend leaves to the torch reference on purpose (`reference_only`). They
resolve to the reference without counting as a fallback, and `--strict` accepts them."""

# Relative-error budgets per output dtype. fp32 references agree to rounding (~1e-6 relative
# after a reduction); bf16 carries 8 mantissa bits, so 2^-8 per element grows to ~1e-2 over a sum.
DEFAULT_TOL = {"float32": (1e-5, 1e-6), "bfloat16": (2e-2, 1e-2), "float16": (5e-3, 1e-3)}


def defop(name: str, tol: dict | None = None):
    """Register `fn` as the reference (and the `torch` implementation) of op `name`."""

    def wrap(fn):
        if name in REGISTRY:
            raise ValueError(f"op {name!r} defined twice")
        REGISTRY[name] = OpDef(name, fn, (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
                               {**DEFAULT_TOL, **(tol or {})}, {"torch": fn})
        return fn

    return wrap


def implement(name: str, backend: str):
    """Register `fn` as `backend`'s implementation of op `name` (which must be defined)."""

    def wrap(fn):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}")
        _ensure_reference()
        if name not in REGISTRY:
            raise ValueError(f"{backend} implements unknown op {name!r}")
        REGISTRY[name].impls[backend] = fn
        return fn

    return wrap


COMPOSITIONS: dict[str, tuple[tuple[str, ...], Callable]] = {}
"""fused op -> (its parts, fn(p, *args, **kwargs)): how the op is computed from its parts, `p` mapping each part to
an implementation. The reference of the op is this composition over the parts' references."""

COMPOSED: dict[str, dict[str, tuple[str, ...]]] = {}
"""backend -> {fused op: parts}: the ops `compose` built for the backend from its own parts."""


def composition(name: str, parts: tuple[str, ...]):
    """Register `fn(p, *args, **kwargs)` as how fused op `name` is computed from `parts` (`p`: {part: impl})."""

    def wrap(fn):
        COMPOSITIONS[name] = (tuple(parts), fn)
        return fn

    return wrap


class RefParts(dict):
    """{part: its reference}, looked up on use: the `p` a composition's reference runs with."""

    def __missing__(self, part: str) -> Callable:
        return REGISTRY[part].ref


def compose(backend: str, names) -> None:
    """Register `backend`'s implementation of each fused op in `names` as the op's composition (`COMPOSITIONS`)
    over the backend's own parts: a part it implements runs its implementation (with whatever fallbacks that
    one announces), a part it leaves to the reference on purpose (`reference_only`) runs the reference. A part
    that is neither is an error at import: a composition never hides a fallback. Call after `reference_only`."""
    _ensure_reference()
    for name in names:
        if name not in COMPOSITIONS:
            raise ValueError(f"{backend} composes {name!r}, which has no registered composition")
        if backend in REGISTRY[name].impls:
            raise ValueError(f"{backend} both implements {name!r} and composes it")
        parts, fn = COMPOSITIONS[name]
        p, own = {}, set()
        for part in parts:
            impl = REGISTRY[part].impls.get(backend)
            if impl is not None:
                own.add(part)
            else:
                if by_design(backend, part) is None:
                    raise ValueError(f"{backend} composes {name!r} from {part!r}, which it neither implements "
                                     "nor lists as reference-only")
                impl = REGISTRY[part].ref
            p[part] = impl
        if not own:
            raise ValueError(f"{backend} composes {name!r} from no part of its own: list it as reference-only")

        def composed(*args, _p=p, _fn=fn, **kwargs):
            return _fn(_p, *args, **kwargs)

        functools.update_wrapper(composed, fn)
        composed.__doc__ = f"{name} composed from {backend}'s " + ", ".join(
            part + ("" if part in own else " (reference)") for part in parts)
        REGISTRY[name].impls[backend] = composed
        COMPOSED.setdefault(backend, {})[name] = parts


def reference_only(backend: str, reasons: dict[str, str]) -> None:
    """Declare that `backend` runs these ops as the torch reference on purpose, each with its reason (e.g. the
    stack it stands for runs that op in PyTorch). An op the backend also implements cannot be on the list."""
    _ensure_reference()
    for name, why in reasons.items():
        if name not in REGISTRY:
            raise ValueError(f"{backend} lists unknown op {name!r} as reference-only")
        if backend in REGISTRY[name].impls:
            raise ValueError(f"{backend} both implements {name!r} and lists it as reference-only")
        if not why.strip():
            raise ValueError(f"{backend} lists {name!r} as reference-only without a reason")
    BY_DESIGN.setdefault(backend, {}).update(reasons)


def by_design(backend: str, name: str) -> str | None:
    """The reason `backend` leaves op `name` to the reference on purpose, or None."""
    return BY_DESIGN.get(backend, {}).get(name)


def _ensure_reference():
    import deepinfer.ops.reference  # noqa: F401  (defines every op)


_import_errors: dict[str, str] = {}


def load_backend(backend: str) -> None:
    """Import `backend`'s kernel package (which registers its implementations)."""
    _ensure_reference()
    if backend == "torch":
        return
    if backend not in _BACKEND_MODULES:
        raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    try:
        importlib.import_module(_BACKEND_MODULES[backend])
    except Exception as e:  # ImportError, or a compiler that fails at import
        _import_errors[backend] = f"{type(e).__name__}: {e}"
        pkg, how = _BACKEND_PACKAGES[backend]
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == pkg:
            raise BackendError(f"backend {backend!r} needs the {pkg} package, which is not installed: {how}") from None
        raise BackendError(f"backend {backend!r} is unavailable: {type(e).__name__}: {e}") from None


LIBRARY_BACKENDS = ("deepgemm",)
"""Backends that are a library of a few ops (DeepGEMM: its GEMMs), not a whole stack: as a peer configuration
(`bench --against deepgemm`) they mean their own ops over the run's backend, not every other op on the reference."""


def library_op_map(backend: str) -> dict[str, str]:
    """{op: backend} for every op a library backend implements (loading it: a missing package is a BackendError)."""
    load_backend(backend)
    return {name: backend for name, d in REGISTRY.items() if backend in d.impls}


def backend_facts(backend: str, device) -> dict:
    """What `backend` chose for `device` (its package's `facts(device)`, e.g. the Triton backend's prefill
    FP8 GEMM), for reports; {} for the torch reference and for a backend without facts. Callers above the
    registry read backend choices here, never from a backend's modules."""
    if backend == "torch":
        return {}
    load_backend(backend)
    fn = getattr(importlib.import_module(_BACKEND_MODULES[backend]), "facts", None)
    return fn(device) if fn is not None else {}


def backend_available(backend: str) -> tuple[bool, str]:
    """(importable here, reason if not)."""
    try:
        load_backend(backend)
        return True, ""
    except BackendError as e:
        return False, str(e)


def check_runs_on(backend: str, device, dtype: str | None = None, what: str = "--backend") -> None:
    """The one rule for "can `backend` run on `device` in `dtype`", a BackendError naming `what` if not: the torch
    reference runs anywhere; a kernel backend needs CUDA, except Triton under TRITON_INTERPRET=1 on a CPU, whose
    interpreter computes a bf16 tl.dot wrongly (logits off by 70-140 %), so a bf16 run there would lie."""
    from deepinfer import settings

    dev_type = getattr(device, "type", str(device).split(":")[0])
    if backend == "torch" or dev_type == "cuda":
        return
    if backend != "triton" or not settings.triton_interpreted():
        raise BackendError(f"{what} {backend} needs a CUDA device (device is {device}; on a CPU, "
                           "TRITON_INTERPRET=1 runs Triton kernels in the interpreter)")
    if dtype in ("bfloat16", "bf16"):
        raise BackendError(f"{what} triton under TRITON_INTERPRET=1 with --dtype bfloat16: Triton's interpreter "
                           "computes a bf16 tl.dot wrongly (logits off by 70-140 %), so this run would lie; use "
                           "--dtype float32 or float16 here, or run bf16 on a GPU")


PHASES = ("decode", "prefill")
"""The phases a per-op map entry may split by (`op=decode:triton/prefill:tilelang`): the model step that calls the
op (`Dispatcher.phase`, set by the model); a tuned map picks a kernel per phase (`deepinfer tune`)."""


def parse_op_map(text: str | None, what: str = "--op") -> dict:
    """`grouped_gemm=tilelang,sparse_attn_fp8=tilelang` -> {op: backend}; an entry may split by phase,
    `grouped_gemm=decode:triton/prefill:tilelang` -> {op: {phase: backend}}; `@FILE` reads a tuned map
    (`deepinfer.ops.op_map_file`, checked against this machine). An unknown op, backend or phase, or a malformed
    entry, is a ValueError naming the valid choices."""
    _ensure_reference()
    text = (text or "").strip()
    if text.startswith("@"):
        from deepinfer.ops.op_map_file import load_op_map

        return load_op_map(text[1:], what)
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        op, eq, b = (x.strip() for x in part.partition("="))
        if not eq or not op or not b:
            raise ValueError(f"{what} {part!r}: expected op=backend, e.g. grouped_gemm=tilelang")
        if op not in REGISTRY:
            raise ValueError(f"{what} {part!r}: unknown op {op!r}; ops: {', '.join(REGISTRY)}")
        out[op] = _parse_choice(b, f"{what} {part!r}")
    return out


def _parse_choice(b: str, where: str):
    """`triton` -> "triton"; `decode:triton/prefill:tilelang` -> {"decode": "triton", "prefill": "tilelang"}."""
    if ":" not in b:
        if b not in BACKENDS:
            raise ValueError(f"{where}: unknown backend {b!r}; backends: {', '.join(BACKENDS)}")
        return b
    phased = {}
    for item in b.split("/"):
        ph, colon, be = (x.strip() for x in item.partition(":"))
        if not colon or ph not in PHASES:
            raise ValueError(f"{where}: {item!r} is not phase:backend with a phase of {', '.join(PHASES)}")
        if be not in BACKENDS:
            raise ValueError(f"{where}: unknown backend {be!r}; backends: {', '.join(BACKENDS)}")
        phased[ph] = be
    if set(phased) != set(PHASES):
        raise ValueError(f"{where}: a phase split names every phase ({', '.join(PHASES)})")
    return phased


def choice_str(choice) -> str:
    """An op map entry as `--op` takes it: "triton", or "decode:triton/prefill:tilelang"."""
    if isinstance(choice, dict):
        return "/".join(f"{ph}:{choice[ph]}" for ph in PHASES)
    return choice


def map_backends(op_map: dict) -> set[str]:
    """Every backend an op map names (phase splits included)."""
    out = set()
    for v in op_map.values():
        out |= set(v.values()) if isinstance(v, dict) else {v}
    return out


def backend_versions(backends=None) -> dict[str, str | None]:
    """{backend: its package's installed version, or None} for the kernel backends (read from the package
    metadata, importing nothing): what a tuned map records and is checked against."""
    import importlib.metadata as md

    out = {}
    for b in backends or [b for b in BACKENDS if b != "torch"]:
        if b == "torch":
            import torch

            out[b] = str(torch.__version__)
            continue
        pkg = _BACKEND_PACKAGES[b][0]
        ver = None
        for name in (pkg, pkg.replace("_", "-")):
            try:
                ver = md.version(name)
                break
            except md.PackageNotFoundError:
                continue
        out[b] = ver
    return out


def op_map_str(op_map: dict) -> str:
    """The map as `--op` takes it (sorted, so equal maps print alike); "" for none."""
    return ",".join(f"{op}={choice_str(b)}" for op, b in sorted(op_map.items()))


def default_backend() -> str:
    """`DEEPINFER_BACKEND`, else triton on CUDA when Triton imports, else torch."""
    from deepinfer import settings

    env = settings.choice("DEEPINFER_BACKEND")
    if env:
        return env
    try:
        import torch

        if torch.cuda.is_available():
            import triton  # noqa: F401

            return "triton"
    except Exception:
        pass
    return "torch"


class Dispatcher:
    """Resolves `ops.<name>` to the active backend's implementation, with visible fallbacks."""

    def __init__(self):
        self.backend = "torch"
        self.op_map: dict = {}  # op -> the backend that runs it instead of `backend` (or {phase: backend})
        self._phased: set[str] = set()  # ops whose map entry splits by phase
        # the model step calling the ops ("decode" | "prefill"), set by the model; a phase-split entry resolves by
        # it (outside a model step it keeps the last step's phase: sampling follows the decode that made the logits)
        self.phase: str = "decode"
        self.strict = False
        self.fallbacks: dict[str, str] = {}  # op -> reason, for every op that fell back
        self.used: set[str] = set()
        self._cache: dict[str, Callable] = {}
        self._announced: set[str] = set()
        # Sites (op, layer): the model marks the block it runs (`layer`, None outside the blocks); `bisect`
        # records which sites a run calls and swaps single sites to another implementation.
        self.layer: int | None = None
        self._sites: dict[tuple[str, int | None], Callable] | None = None
        self._seen: set[tuple[str, int | None]] | None = None
        self._counts: dict[str, int] | None = None  # op -> calls, while `count_calls` is on
        self.depth = 0  # while counting: > 0 inside a registry op's call
        self._siting = False  # sites, recording or counting is on: the one check `resolve` makes on its fast path
        self._composed_by_map: set[str] = set()

    def configure(self, backend: str | None = None, strict: bool | None = None,
                  op_map: dict[str, str] | str | None = None) -> "Dispatcher":
        """Choose the backend, strictness and per-op map (None: `DEEPINFER_OPS`; a string is parsed as `--op`)."""
        from deepinfer import settings

        # where each came from, for the messages that refuse them (a user who set DEEPINFER_BACKEND gave no --backend)
        self.backend_source = "--backend" if backend or not settings.choice("DEEPINFER_BACKEND") else "DEEPINFER_BACKEND"
        self.op_map_source = "DEEPINFER_OPS" if op_map is None and settings.path("DEEPINFER_OPS") else "--op"
        backend = backend or default_backend()
        strict = settings.flag("DEEPINFER_STRICT") if strict is None else strict
        if op_map is None:
            op_map = parse_op_map(settings.path("DEEPINFER_OPS"), "DEEPINFER_OPS")
        elif isinstance(op_map, str):
            op_map = parse_op_map(op_map)
        for b in (backend, *sorted(map_backends(op_map))):
            load_backend(b)
        self.backend, self.strict, self.op_map = backend, strict, dict(op_map)
        self._phased = {op for op, v in self.op_map.items() if isinstance(v, dict)}
        # a fused op the map leaves out while mapping one of its parts runs composed from the parts as mapped
        # (`resolve`): `--op fp8_gemm=deepgemm` reaches the FP8 GEMM inside act_quant_fp8_gemm too
        _ensure_reference()
        self._composed_by_map = {f for f, (parts, _) in COMPOSITIONS.items()
                                 if f not in self.op_map and set(parts) & set(self.op_map)}
        self._phased |= {f for f in self._composed_by_map if set(COMPOSITIONS[f][0]) & self._phased}
        self._cache.clear()
        self.fallbacks.clear()
        self.used.clear()
        self._announced.clear()
        if strict:
            missing = self.missing()
            if missing:
                raise BackendError(
                    f"--strict: backend {self.backend!r}" + (f" with --op {op_map_str(self.op_map)}" if self.op_map
                                                             else "") + f" lacks {len(missing)} op(s): {', '.join(missing)}"
                )
        return self

    def backend_of(self, name: str, phase: str | None = None) -> str:
        """The backend chosen for op `name`: its entry in the per-op map (a phase split: the entry of `phase`, else
        of the current phase), else the backend."""
        b = self.op_map.get(name, self.backend)
        return b[phase or self.phase] if isinstance(b, dict) else b

    def backends(self) -> list[str]:
        """Every backend this configuration runs ops on (the backend first)."""
        return [self.backend] + sorted(map_backends(self.op_map) - {self.backend})

    def check_device(self, device, dtype: str | None = None, what: str | None = None) -> None:
        """`check_runs_on` for every backend of this configuration (`what`: the option to name, default
        `--backend` for the backend and `--op backend` for the per-op map's)."""
        for b in self.backends():
            check_runs_on(b, device, dtype, what or (getattr(self, "backend_source", "--backend") if b == self.backend
                                                     else f"{getattr(self, 'op_map_source', '--op')} backend"))

    def describe(self) -> str:
        """`triton` or `triton; grouped_gemm=tilelang,...`: what fingerprints and bench rows record."""
        m = op_map_str(self.op_map)
        return self.backend + (f"; {m}" if m else "")

    def missing(self) -> list[str]:
        """Ops the configuration has no implementation for (reference-only ops by design are not missing)."""
        _ensure_reference()
        return [n for n, d in REGISTRY.items()
                if any(self.backend_of(n, ph) not in d.impls and by_design(self.backend_of(n, ph), n) is None
                       for ph in (PHASES if n in self._phased else (None,)))]

    def override_sites(self, sites: dict | None) -> None:
        """Run op `name` at layer `layer` with sites[(name, layer)] (a callable with the op's signature)
        wherever given; a fused op one of whose parts is given at its layer runs composed from its parts there
        (`hc_post` at layer 2 reaches the `hc_post_pre_quant` that computes it). None restores plain dispatch."""
        self._sites = dict(sites) if sites else None
        self._siting = self._sites is not None or self._seen is not None or self._counts is not None

    def _part_sited(self, name: str) -> bool:
        """Is a part of fused op `name` (or of a fused part, recursively) overridden at the current layer?"""
        if name not in COMPOSITIONS:
            return False
        return any((part, self.layer) in self._sites or self._part_sited(part) for part in COMPOSITIONS[name][0])

    @property
    def sited(self) -> bool:
        """Sites are overridden or recorded (`override_sites`, `record_sites`: bisect, graft): the model then keeps
        each op at its own layer (no block's post-mix is deferred into the next block's launch)."""
        return self._sites is not None or self._seen is not None

    def record_sites(self, on: bool = True) -> set | None:
        """Start (on) or stop recording the (op, layer) sites called; stopping returns them."""
        seen, self._seen = self._seen, (set() if on else None)
        self._siting = self._sites is not None or self._seen is not None or self._counts is not None
        return seen

    def count_calls(self, on: bool = True) -> dict | None:
        """Start (on) or stop counting the op calls made; stopping returns {op: calls} (what `bench` reports as
        the registry ops per decode step: each one at least one kernel boundary)."""
        counts, self._counts = self._counts, ({} if on else None)
        self._siting = self._sites is not None or self._seen is not None or self._counts is not None
        return counts

    def runtime_fallback(self, name: str, reason: str) -> None:
        """A backend's implementation of `name` could not run this call (e.g. a kernel that failed to compile
        for this shape): under `strict` a BackendError naming op and reason; otherwise the call is the
        reference's (the implementation returns it), recorded in `fallbacks` and announced once."""
        if self.strict:
            raise BackendError(f"--strict: op {name!r}: {reason}")
        self.fallbacks[name] = reason
        if (name, reason) not in self._announced:
            self._announced.add((name, reason))
            print(f"deepinfer: op {name} falls back to the torch reference ({reason})", file=sys.stderr)

    def resolve(self, name: str) -> Callable:
        fn = self._resolve(name)
        if self._counts is not None:  # counting: mark the op's span, which `bench.glue` leaves out of its count
            return functools.partial(self._in_op, fn)
        return fn

    def _in_op(self, fn: Callable, *args, **kwargs):
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1

    def _resolve(self, name: str) -> Callable:
        if self._siting:
            if self._seen is not None:
                self._seen.add((name, self.layer))
            if self._counts is not None:
                self._counts[name] = self._counts.get(name, 0) + 1
            fn = self._sites.get((name, self.layer)) if self._sites is not None else None
            if fn is not None:
                return fn
            if self._sites is not None and self._part_sited(name):  # a part overridden here: the fused op
                return self._composed(name)  # runs composed, the part as the site says
        key = (name, self.phase) if name in self._phased else name
        fn = self._cache.get(key)
        if fn is not None:
            return fn
        _ensure_reference()
        if name not in REGISTRY:
            raise AttributeError(f"no op named {name!r}")
        if name in self._composed_by_map and self._map_moves_a_part(name):
            fn = self._composed(name)
            self.used.add(name)
            self._cache[key] = fn
            return fn
        d = REGISTRY[name]
        b = self.backend_of(name)
        fn = d.impls.get(b)
        if fn is None and by_design(b, name) is not None:
            fn = d.ref  # the backend's choice, not a fallback
        if fn is None:
            reason = f"backend {b!r} has no implementation"
            if self.strict:
                raise BackendError(f"--strict: op {name!r}: {reason}")
            self.fallbacks[name] = reason
            if name not in self._announced:
                self._announced.add(name)
                print(f"deepinfer: op {name} falls back to the torch reference ({reason})", file=sys.stderr)
            fn = d.ref
        self.used.add(name)
        self._cache[key] = fn
        return fn

    def _composed(self, name: str) -> Callable:
        """Fused op `name` as its registered composition over its parts, each resolved as this dispatcher resolves
        it now (map, phase, sites)."""
        parts, comp = COMPOSITIONS[name]
        p = {part: self.resolve(part) for part in parts}

        def fn(*args, _p=p, _comp=comp, **kwargs):
            return _comp(_p, *args, **kwargs)

        return fn

    def _map_moves_a_part(self, name: str) -> bool:
        """Does the map send a part of fused op `name` to another backend than the fused op's own in this phase? If
        not (a tuned map naming grouped_gemm=triton on the Triton backend), the fused implementation runs."""
        own = self.backend_of(name)
        return any(self.backend_of(part) != own for part in COMPOSITIONS[name][0] if part in self.op_map)

    def __getattr__(self, name: str) -> Callable:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.resolve(name)


ops = Dispatcher()
