"""`deepinfer probe flaggems --screen`: the field notes' FlagGems allow-list method, automated.

1. Record every ATen op the model calls in a prefill and a few greedy decode steps (`AtenRecorder`, a
   TorchDispatchMode): the op with its overload (`add.Tensor`, `_softmax`), and per distinct call signature the
   shapes, dtypes and strides; the inputs themselves are captured (strides and all) for the ops FlagGems registers.
2. Resolve each recorded op against FlagGems' registration table (`_FULL_CONFIG`: ATen key -> function), run it in
   a worker subprocess on exactly the captured inputs with FlagGems enabled for that function alone
   (`only_enable(lib=<a Library destroyed after the call>, include=[fn])`), against PyTorch's result computed
   before enabling; each op has a time budget
   (compile included: the notes saw topk take > 180 s at k = 512), and an op past it kills the worker (a fresh one
   takes the rest), so a blow-up cannot hang the screen.
3. Classify (`classify`): pass / wrong (metric, FlagGems' own dtype tolerance) / wrong_shape (the mul broadcast
   defect) / error (signature, dtype such as e8m0) / too_slow / not_registered (never "pass"), and write the
   allow-list in FlagGems' `only_enable` form (`include:` function names), which `--flaggems @allow.yaml` reads.
   A function is allowed when every recorded key it registers passed.
4. Run the model with that allow-list, twice, against the tokens of the run without it: identical or not, first
   divergence, deterministic or not.

The parent never imports flag_gems before step 4 (its import creates a CUDA context); the worker does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.engine.flaggems_aten import allow_yaml, read_allow_yaml  # noqa: F401  (the allow-list file's form)

# FlagGems 5.0.2's flag_gems.testing.RESOLUTION (NVIDIA): the rtol its own tests use per dtype; atol 1e-4
# (their `assert_close(..., reduce_dim=1)`; they scale atol by the reduced size for reductions, which a generic
# screen cannot know: this is the stricter choice, and the metric is reported so a reader can judge).
RESOLUTION = {"bool": 0.0, "uint8": 0.0, "int8": 0.0, "int16": 0.0, "int32": 0.0, "int64": 0.0,
              "float8_e4m3fn": 1e-3, "float8_e5m2": 1e-3, "float16": 1e-3, "float32": 1.3e-6, "bfloat16": 0.016,
              "float64": 1e-7}
FG_ATOL = 1e-4

STATUSES = ("pass", "wrong", "wrong_shape", "error", "too_slow", "not_registered", "not_checked")


# ------------------------------------------------------------------------------------------ table
def copied_table() -> list[tuple[str, str]]:
    """FlagGems 5.0.2's table as copied into `flaggems_table.py` (no import of flag_gems): [(key, function)]."""
    from deepinfer.debug.flaggems_table import FULL_CONFIG

    return [(k, f) for k, f, _ in FULL_CONFIG]


def real_table(flag_gems) -> list[tuple[str, str]]:
    """[(key, function __name__)] from an imported flag_gems, entries whose torch-version condition fails left out."""
    out = []
    for e in flag_gems._FULL_CONFIG:
        if len(e) > 2 and not e[2]():
            continue
        out.append((str(e[0]), getattr(e[1], "__name__", str(e[1]))))
    return out


# --------------------------------------------------------------------------------------- recording
def op_key(func) -> str:
    """`aten::add.Tensor` -> `add.Tensor`; the default overload is the bare name (`cumsum`), as FlagGems keys it."""
    name = func._schema.name.split("::", 1)[-1]
    ov = func._overloadname
    return name if ov in ("default", "") else f"{name}.{ov}"


def _spec(v):
    if isinstance(v, torch.Tensor):
        return {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."), "stride": list(v.stride()),
                "device": v.device.type}
    if isinstance(v, (list, tuple)):
        return [_spec(x) for x in v]
    if isinstance(v, dict):
        return {k: _spec(x) for k, x in v.items()}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(v)
    return type(v).__name__


def _kw_device(kwargs: dict) -> str | None:
    """The device type a factory op (zeros, full, arange: no tensor argument) creates its result on."""
    d = kwargs.get("device")
    return None if d is None else torch.device(d).type


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)


def snapshot(t: torch.Tensor) -> dict:
    """A copy of `t` that keeps its exact strides and storage offset pattern (overlapping/expanded ones included):
    the storage span it reads, copied, with the size and strides to view it again (`restore`)."""
    t = t.detach()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    flat = torch.as_strided(t, (extent,), (1,)).clone() if extent else t.new_empty(0)
    return {"__tensor__": True, "flat": flat, "size": list(t.shape), "stride": list(t.stride())}


def restore(d: dict, device=None) -> torch.Tensor:
    """A fresh copy each call (the reference and FlagGems each get their own: in-place ops mutate them)."""
    flat = d["flat"].clone() if device is None else d["flat"].to(device, copy=True)
    return torch.as_strided(flat, d["size"], d["stride"])


def _capture(v):
    if isinstance(v, torch.Tensor):
        return snapshot(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_capture(x) for x in v)
    if isinstance(v, dict):
        return {k: _capture(x) for k, x in v.items()}
    return v


def rebuild(v, device=None):
    if isinstance(v, dict) and v.get("__tensor__"):
        return restore(v, device)
    if isinstance(v, (list, tuple)):
        return type(v)(rebuild(x, device) for x in v)
    if isinstance(v, dict):
        return {k: rebuild(x, device) for k, x in v.items()}
    return v


@dataclasses.dataclass
class OpCall:
    """One distinct call signature of an ATen op: specs of its arguments, how often it was called, and (where
    captured) the inputs themselves."""

    key: str
    spec: dict
    count: int = 0
    inputs: tuple | None = None  # (args, kwargs) snapshots, or None when not captured
    why_not: str = ""


class AtenRecorder(TorchDispatchMode):
    """Records every ATen op called under it: `calls[key]` -> distinct signatures (first `max_sigs` of them),
    capturing the inputs of those in `capture` (None: all) whose arguments are on `devices` (None: any), up to
    `max_bytes` of copies in all. Inputs are captured before the op runs (in-place ops mutate them)."""

    def __init__(self, capture: set[str] | None = None, devices: tuple | None = ("cuda",), max_sigs: int = 6,
                 max_bytes: int = 4 << 30):
        super().__init__()
        self.capture, self.devices, self.max_sigs, self.max_bytes = capture, devices, max_sigs, max_bytes
        self.calls: dict[str, dict[str, OpCall]] = {}
        self.order: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = op_key(func)
        spec = {"args": _spec(list(args)), "kwargs": _spec(kwargs)}
        sig = json.dumps(spec, sort_keys=True, default=str)
        sigs = self.calls.get(key)
        if sigs is None:
            sigs = self.calls[key] = {}
            self.order.append(key)
        c = sigs.get(sig)
        if c is None and len(sigs) < self.max_sigs:
            c = sigs[sig] = OpCall(key, spec)
            ts = list(_tensors((args, kwargs)))
            if self.capture is not None and key not in self.capture:
                c.why_not = "not in FlagGems' table"
            elif self.devices is not None and not (any(t.device.type in self.devices for t in ts)
                                                   or _kw_device(kwargs) in self.devices):
                c.why_not = f"no argument on {'/'.join(self.devices)} (FlagGems registers CUDA kernels)"
            else:
                nbytes = sum(t.numel() * t.element_size() for t in ts)
                if self.bytes + nbytes > self.max_bytes:
                    c.why_not = f"capture budget of {self.max_bytes >> 20} MiB spent"
                else:
                    self.bytes += nbytes
                    c.inputs = (_capture(list(args)), _capture(kwargs))
        if c is not None:
            c.count += 1
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
            # under inference_mode (the model's) a composite op (softmax.int, linear) reaches this mode whole: run
            # its decomposition under the mode too, so the ops with kernels it calls (_softmax, mm) are recorded
            with self:
                r = func.decompose(*args, **kwargs)
            if r is not NotImplemented:
                return r
        return func(*args, **kwargs)

    def signatures(self) -> list[OpCall]:
        return [c for k in self.order for c in self.calls[k].values()]


def record_run(model, ids: torch.Tensor, steps: int, recorder: AtenRecorder) -> torch.Tensor:
    """A prefill of `ids` [B, S] and `steps` greedy decode steps under `recorder` -> the tokens [B, steps + 1].
    Under no_grad, not inference_mode: with autograd's keys live, composite ops (softmax.int, linear) decompose
    before the recorder sees them, so it records the ops that have kernels -- _softmax, mm -- which are what
    FlagGems registers."""
    from deepinfer.engine.distributed import greedy_run

    with torch.no_grad(), recorder:
        _, toks = greedy_run(model, ids, steps)
    return toks


# ------------------------------------------------------------------------------------- classification
def _flat_out(v) -> list:
    if isinstance(v, (list, tuple)):
        return [y for x in v for y in _flat_out(x)]
    return [v]


def compare_outputs(out, ref, resolution: dict | None = None, atol: float = FG_ATOL) -> tuple[str, str, dict]:
    """FlagGems' output against PyTorch's -> (status, detail, metric). Shapes, dtypes and output count first
    (wrong_shape), then values: floats within FlagGems' own rtol for the dtype and `atol` (wrong otherwise),
    everything else exactly."""
    res = resolution or RESOLUTION
    outs, refs = _flat_out(out), _flat_out(ref)
    if len(outs) != len(refs):
        return "wrong_shape", f"{len(outs)} outputs, PyTorch gives {len(refs)}", {}
    metric = {"max_abs": 0.0, "max_rel": 0.0, "mismatched": 0}
    for i, (o, r) in enumerate(zip(outs, refs)):
        if isinstance(r, torch.Tensor) != isinstance(o, torch.Tensor):
            return "wrong_shape", f"output {i}: {type(o).__name__}, PyTorch gives {type(r).__name__}", {}
        if not isinstance(r, torch.Tensor):
            if o != r:
                return "wrong", f"output {i}: {o!r}, PyTorch gives {r!r}", {}
            continue
        if tuple(o.shape) != tuple(r.shape):
            return "wrong_shape", f"output {i}: shape {tuple(o.shape)}, PyTorch gives {tuple(r.shape)}", {}
        if o.dtype != r.dtype:
            return "wrong_shape", f"output {i}: dtype {o.dtype}, PyTorch gives {r.dtype}", {}
        name = str(r.dtype).removeprefix("torch.")
        if r.is_floating_point():
            of, rf = o.detach().float().cpu(), r.detach().float().cpu()
            rtol = res.get(name, 1.3e-6)
            bad = ~torch.isclose(of, rf, rtol=rtol, atol=atol, equal_nan=True)
            diff = (of - rf).abs().nan_to_num(nan=float("inf"))
            fin = torch.isfinite(rf) & torch.isfinite(of)
            if fin.any():
                metric["max_abs"] = max(metric["max_abs"], diff[fin].max().item())
                metric["max_rel"] = max(metric["max_rel"], (diff[fin] / rf[fin].abs().clamp_min(1e-30)).max().item())
            metric["mismatched"] += int(bad.sum())
            if bad.any():
                return "wrong", (f"output {i} ({name}): {int(bad.sum())} of {bad.numel()} outside FlagGems' tolerance "
                                 f"rtol {rtol:g}, atol {atol:g}; max abs err {metric['max_abs']:.3g}"), metric
        else:
            eq = o.detach().cpu().view(torch.uint8) == r.detach().cpu().view(torch.uint8) if o.element_size() == 1 \
                else o.detach().cpu() == r.detach().cpu()
            if not bool(eq.all()):
                metric["mismatched"] += int((~eq).sum())
                return "wrong", f"output {i} ({name}): {int((~eq).sum())} of {eq.numel()} differ (exact dtype)", metric
    return "pass", f"within FlagGems' tolerance (rtol per dtype, atol {atol:g})", metric


def classify(key: str, table: dict[str, str], result: dict | None) -> dict:
    """One recorded signature's verdict. `table` key -> function; `result` the worker's report for its check
    ({"registered", "status", "detail", ...}), None when it was not run."""
    if key not in table:
        return {"status": "not_registered", "detail": "not in FlagGems' registration table"}
    if result is None:
        return {"status": "not_checked", "detail": "no captured inputs"}
    if result.get("timed_out"):
        return {"status": "too_slow", "detail": f"over the budget of {result['budget']:g} s (compile included)"}
    if result.get("status") == "not_checked":
        return {"status": "not_checked", "detail": result.get("detail", "")}
    if result.get("registered") is False:
        return {"status": "not_registered", "detail": f"{table[key]} registered no kernel for {key} "
                "(a torch-version condition or a C++-patched op)"}
    return {k: result[k] for k in ("status", "detail", "metric", "seconds") if k in result}


def allow_list(verdicts: list[dict], table: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Function names (only_enable form) whose every recorded key passed -> (allowed, {function: why not})."""
    by_fn: dict[str, list[dict]] = {}
    for v in verdicts:
        if v["key"] in table:
            by_fn.setdefault(table[v["key"]], []).append(v)
    allowed, refused = [], {}
    for fn, vs in sorted(by_fn.items()):
        bad = [v for v in vs if v["status"] != "pass"]
        if bad:
            refused[fn] = "; ".join(f"{v['key']}: {v['status']}" for v in bad[:3])
        else:
            allowed.append(fn)
    return allowed, refused


# ------------------------------------------------------------------------------------------ worker
def worker_main(device: str = "cuda") -> None:
    """The worker: import flag_gems, report its table, then check one case file per stdin line (one JSON line
    back per case on the original stdout; everything else goes to stderr)."""
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # before the import: its CUDA context lands here
    import flag_gems

    resolution = {str(k).removeprefix("torch."): v for k, v in getattr(flag_gems.testing, "RESOLUTION", {}).items()}
    table = real_table(flag_gems)
    chan.write(json.dumps({"table": table, "version": getattr(flag_gems, "__version__", None)}) + "\n")
    fn_of = dict(table)
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        case = torch.load(path, weights_only=False)
        rep = {"id": case["id"]}
        try:
            rep.update(_check(case, fn_of, dev, flag_gems, resolution))
        except Exception as e:  # noqa: BLE001  (any failure is this op's verdict)
            rep.update({"status": "error", "detail": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"})
        chan.write(json.dumps(rep) + "\n")
        if "CUDA error" in rep.get("detail", "") or "illegal memory" in rep.get("detail", ""):
            sys.exit(3)  # a poisoned context: the parent starts a fresh worker


def _check(case: dict, fn_of: dict, dev, flag_gems, resolution: dict) -> dict:
    key = case["key"]
    name, _, ov = key.partition(".")
    op = getattr(getattr(torch.ops.aten, name), ov or "default")
    args, kwargs = case["inputs"]
    with torch.inference_mode():
        try:
            ref = op(*rebuild(args, dev), **rebuild(kwargs, dev))  # PyTorch, before FlagGems is enabled
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (not FlagGems' fault: say so rather than blame it)
            return {"status": "not_checked", "detail": f"PyTorch itself fails on the replayed inputs: "
                                                       f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"}
        fa, fk = rebuild(args, dev), rebuild(kwargs, dev)
        t0 = time.perf_counter()
        # only_enable into a Library of our own, destroyed right after the call (FlagGems' use_gems leaves that to
        # the garbage collector where its version-string compare `torch.__version__ >= "2.5"` is False: "2.11")
        lib = torch.library.Library("aten", "IMPL")
        try:
            flag_gems.current_work_registrar = None
            flag_gems.only_enable(lib=lib, include=[fn_of[key]])
            reg = getattr(flag_gems, "current_work_registrar", None)
            if reg is None or key not in set(reg.get_all_keys()):
                return {"registered": False}
            try:
                out = op(*fa, **fk)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                return {"registered": True, "status": "error", "seconds": time.perf_counter() - t0,
                        "detail": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"}
        finally:
            lib._destroy()
        secs = time.perf_counter() - t0
    status, detail, metric = compare_outputs(out, ref, resolution)
    return {"registered": True, "status": status, "detail": detail, "metric": metric, "seconds": secs}


class Worker:
    """A worker subprocess, restarted after a timeout or a death. `cmd` is overridable (tests use a fake)."""

    def __init__(self, cmd: list[str], env: dict | None = None, startup: float = 300.0):
        self.cmd, self.env, self.startup = cmd, env, startup
        self.p = None
        self.hello: dict | None = None

    def _start(self):
        self.p = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=self.env, start_new_session=True)
        self.hello = self._read(self.startup)
        if self.hello is None or "__eof__" in self.hello:
            self.stop()
            raise RuntimeError(f"the screen's worker did not start within {self.startup:g} s")

    def _read(self, timeout: float) -> dict | None:
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return None
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if not r:
                return None
            line = self.p.stdout.readline()
            if not line:
                return {"__eof__": True}  # the worker closed its end: it died (poll() may not know yet)
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue

    def check(self, path: str, budget: float) -> dict | None:
        """The worker's report for one case, or {"timed_out": True} past `budget` s, {"died": ...} on a crash."""
        if self.p is None or self.p.poll() is not None:
            self._start()
        self.p.stdin.write(path + "\n")
        self.p.stdin.flush()
        rep = self._read(budget)
        if rep is None or "__eof__" in rep:
            self.stop()
            return {"timed_out": True, "budget": budget} if rep is None else {"died": True}
        return rep

    def stop(self):
        if self.p is not None and self.p.poll() is None:
            try:
                os.killpg(self.p.pid, 9)  # the worker's own session: it and its compiler children
            except (ProcessLookupError, PermissionError):
                self.p.kill()
            self.p.wait()
        self.p = None


def worker_cmd(device: str = "cuda") -> list[str]:
    """The worker's command line, for `device` (the parent's chosen one: the worker sets it before importing
    flag_gems)."""
    return [sys.executable, "-c", f"from deepinfer.debug.flaggems_screen import worker_main; worker_main({str(device)!r})"]


def check_all(calls: list[OpCall], workdir: str, budget: float, worker: Worker, progress=None,
              deadline: float | None = None) -> tuple[list[dict], dict]:
    """Run every captured signature through the worker -> (verdicts, the worker's hello: table and version).
    `deadline` (s, None: none): signatures not started by then are not_checked."""
    verdicts = []
    end = None if deadline is None else time.monotonic() + deadline
    worker._start() if worker.p is None else None
    hello = worker.hello or {}
    table = dict((k, f) for k, f in hello.get("table", []))
    for i, c in enumerate(calls):
        v = {"key": c.key, "count": c.count, "spec": c.spec, "function": table.get(c.key)}
        if c.key not in table or c.inputs is None:
            v.update(classify(c.key, table, None) if c.key not in table else
                     {"status": "not_checked", "detail": c.why_not or "no captured inputs"})
            verdicts.append(v)
            continue
        if end is not None and time.monotonic() > end:
            v.update({"status": "not_checked", "detail": f"the screen's deadline of {deadline:g} s was reached"})
            verdicts.append(v)
            continue
        path = os.path.join(workdir, f"case{i}.pt")
        try:
            torch.save({"id": i, "key": c.key, "inputs": c.inputs}, path)
        except Exception as e:  # noqa: BLE001  (e.g. a torch.Generator argument does not pickle)
            v.update({"status": "not_checked", "detail": f"its inputs cannot be handed to the worker: "
                                                         f"{type(e).__name__}: {str(e)[:200]}"})
            verdicts.append(v)
            continue
        if progress:
            progress(c)
        rep = worker.check(path, budget)
        if rep and rep.get("died"):
            rep = {"registered": True, "status": "error", "detail": "the worker died on this op (a crash or a "
                   "poisoned CUDA context)"}
        v.update(classify(c.key, table, rep))
        verdicts.append(v)
        try:
            os.unlink(path)
        except OSError:
            pass
    worker.stop()
    return verdicts, hello


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ------------------------------------------------------------------------------------------ the screen
def run_screen(model: str | None = None, backend: str | None = None, device: str | None = None,
               prompt: str = "北京是中国的首都", steps: int = 3, budget: float = 120.0, out: str | None = None,
               log=lambda msg: None, per_op: int = 3, deadline: float | None = None,
               require_cuda: bool = True, worker: Worker | None = None) -> dict:
    """Steps 1-4 on the device (see the module doc) -> the report; writes the allow-list to `out` if given.
    `require_cuda=False` and `worker` are for tests (a CPU run against a fake FlagGems)."""
    import importlib.util
    import tempfile

    from deepinfer.engine.distributed import greedy_run
    from deepinfer.engine.loader import OptionError, load_model, resolve_device
    from deepinfer.ops import ops
    from deepinfer.outpath import atomic_write, check_output

    dev = resolve_device(device)
    if dev.type != "cuda" and require_cuda:
        raise OptionError(f"--screen needs a CUDA device (device is {dev}): FlagGems registers CUDA kernels")
    if importlib.util.find_spec("flag_gems") is None:
        raise OptionError("--screen: flag_gems is not installed (pip install -e '.[flaggems]')")
    if budget <= 0 or steps < 0 or per_op < 1 or (deadline is not None and deadline <= 0):
        raise OptionError("--budget and --deadline must be > 0 s, --steps >= 0, --per-op >= 1")
    out = check_output(out, "--out") if out else None
    ops.configure(backend or None, False, None)
    lm = load_model(model, "official", "bfloat16", str(dev), progress=False)
    ids = torch.tensor([lm.tokenizer.encode(prompt)], dtype=torch.long)
    copy = dict(copied_table())
    rec = AtenRecorder(capture=set(copy), max_sigs=per_op, devices=("cuda",) if require_cuda else None)
    log(f"recording ATen ops: prefill of {ids.size(1)} tokens + {steps} decode steps (backend {ops.describe()})")
    toks_rec = record_run(lm.model, ids, steps, rec)
    calls = rec.signatures()
    log(f"{len(rec.calls)} ATen ops, {len(calls)} distinct call signatures; checking those FlagGems registers")
    with tempfile.TemporaryDirectory(prefix="deepinfer-screen-") as wd:
        verdicts, hello = check_all(calls, wd, budget, worker or Worker(worker_cmd(str(dev))),
                                    progress=lambda c: log(f"  {c.key} x{c.count}"), deadline=deadline)
    table = dict((k, f) for k, f in hello.get("table", []))
    allowed, refused = allow_list(verdicts, table)
    rep = {"probe": "flaggems-screen", "flag_gems_version": hello.get("version"), "device": str(dev),
           "backend": ops.describe(), "prompt": prompt, "steps": steps, "budget_s": budget,
           "table_size": len(table), "table_copy_matches": sorted(copy.items()) == sorted(table.items()),
           "ops_recorded": len(rec.calls), "signatures": len(calls), "verdicts": verdicts,
           "counts": {s: sum(v["status"] == s for v in verdicts) for s in STATUSES},
           "allowed": allowed, "refused": refused, "out": out, "ok": True}
    if out:
        header = [f"deepinfer probe flaggems --screen: FlagGems {hello.get('version')} functions whose every ATen key",
                  f"this model called passed on the model's own inputs ({lm.model_dir}, backend {ops.describe()},",
                  f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}).",
                  "Read by `--flaggems @FILE` and by flag_gems.only_enable(include=FILE)."]
        atomic_write(out, allow_yaml(allowed, header))
    # 4. the model with the allow-list against the run without it (flag_gems is imported here, on `dev`)
    def tokens() -> list[int]:
        with torch.inference_mode():
            return greedy_run(lm.model, ids, steps)[1][0].tolist()

    plain = tokens()
    rep["tokens_without"] = plain
    rep["recording_transparent"] = plain == toks_rec[0].tolist()
    if not allowed:
        rep["with_allow_list"] = "skipped: nothing passed"
        return rep
    from deepinfer.engine.flaggems_aten import enable_flaggems

    rep["enabled"] = enable_flaggems(allowed, dev, require_cuda=require_cuda)
    a, b = tokens(), tokens()
    div = first_divergence(plain, a)
    rep.update({"tokens_with": a, "token_identical": div is None, "first_divergence": div,
                "deterministic": a == b})
    return rep
