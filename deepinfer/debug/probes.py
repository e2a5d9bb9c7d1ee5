"""Environment probes behind `deepinfer probe`: kernel coverage, Triton/FlagTree, FlagGems, TileLang, env.

Every probe returns a plain dict (the `--json` output); `rows` / `checks` entries carry a `status` of
pass | fail | skip | info so the CLI can render them and choose the exit code. Nothing here imports
Triton, TileLang, FlagGems, DeepGEMM or DeepEP unless the probe is about that package; versions come from
`importlib.metadata`.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import torch

from deepinfer.engine.flaggems_aten import enable_only, resolve_op_names
from deepinfer.ops.registry import (
    BACKENDS,
    BY_DESIGN,
    REGISTRY,
    _ensure_reference,
    backend_available,
    backend_facts,
    default_backend,
)


def _first_line(e: BaseException | str) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else (type(e).__name__ if isinstance(e, BaseException) else "")


def _dist_version(*names: str) -> tuple[str | None, str | None]:
    """(distribution name, version) of the first installed distribution among `names`."""
    for n in names:
        try:
            return n, md.version(n)
        except md.PackageNotFoundError:
            continue
    return None, None


# ------------------------------------------------------------------------------------------- kernels
_IMPL_RX = re.compile(r"""implement\(\s*["'](\w+)["']\s*,\s*["'](\w+)["']""")
_COMPOSE_RX = re.compile(r"""compose\(\s*["'](\w+)["']\s*,\s*[(\[]([^)\]]*)[)\]]""")  # registry.compose(backend, (ops))


def _static_impls(backend: str) -> set[str]:
    """Op names a backend's sources register (`@implement("op", "backend")`, and the fused ops it has the registry
    compose, `registry.compose("backend", (...))`), found without importing."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepinfer_kernels", backend)
    found = set()
    if not os.path.isdir(root):
        return found
    for dp, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(".py"):
                try:
                    src = open(os.path.join(dp, f), encoding="utf-8", errors="replace").read()
                except OSError:
                    continue
                found |= {op for op, b in _IMPL_RX.findall(src) if b == backend}
                for b, names in _COMPOSE_RX.findall(src):
                    if b == backend:
                        found |= set(re.findall(r"""["'](\w+)["']""", names))
    return found


def _static_by_design(backend: str) -> dict[str, str]:
    """A backend's reference-only list (`deepinfer_kernels/<backend>/reference_only.py`, plain data), read without
    importing the backend: what `probe kernels` shows where the backend's package is not installed."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deepinfer_kernels",
                        backend, "reference_only.py")
    if not os.path.isfile(path):
        return {}
    spec = importlib.util.spec_from_file_location(f"_reference_only_{backend}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return dict(getattr(mod, "REFERENCE_ONLY", {}))


def probe_kernels(op_map: str | None = None) -> dict:
    """Coverage matrix op x backend, and what a run here would use: default_backend(), with the per-op map
    (`--op` text; None: DEEPINFER_OPS) sending single ops elsewhere."""
    from deepinfer import settings
    from deepinfer.ops.registry import choice_str, op_map_str, parse_op_map

    _ensure_reference()
    omap = parse_op_map(settings.path("DEEPINFER_OPS") if op_map is None else op_map,
                        "DEEPINFER_OPS" if op_map is None else "--op")
    backends = {}
    for b in BACKENDS:
        ok, reason = backend_available(b)
        registered = {op for op, d in REGISTRY.items() if b in d.impls}
        static = _static_impls(b) if b != "torch" else set()
        backends[b] = {"importable": ok, "reason": reason, "registered": sorted(registered),
                       "in_source": sorted(static)}
    chosen = default_backend()
    design = {b: {**_static_by_design(b), **BY_DESIGN.get(b, {})} for b in BACKENDS if b != "torch"}
    rows = []
    for op, d in REGISTRY.items():
        row = {"op": op, "doc": d.doc, "backends": {}}
        for b in BACKENDS:
            reg = b in d.impls
            src = op in backends[b]["in_source"]
            row["backends"][b] = {"implemented": reg or src, "registered": reg,
                                  "importable": backends[b]["importable"]}
            why = design.get(b, {}).get(op)
            if why:
                row["backends"][b]["reference_by_design"] = why
        here = omap.get(op, chosen)

        def use_of(b: str) -> str:
            info = backends.get(b)
            if info is None:
                return "unknown backend"
            if not info["importable"]:
                return "fallback (backend not importable)"
            if b in d.impls:
                return "used"
            if design.get(b, {}).get(op):
                return "reference (by design)"
            return "fallback (no implementation)"
        if isinstance(here, dict):  # a phase split: what each phase runs
            use = "; ".join(f"{ph}: {use_of(b)}" for ph, b in here.items())
            here = choice_str(here)
        else:
            use = use_of(here)
        row["backend_here"], row["here"] = here, use
        rows.append(row)
    return {"probe": "kernels", "default_backend": chosen, "op_map": op_map_str(omap),
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "backends": {b: {k: v for k, v in info.items()} for b, info in backends.items()}, "ops": rows,
            "ok": True}


# -------------------------------------------------------------------------------------------- triton
def triton_install() -> dict:
    """Which Triton is installed, without importing it: distribution, version, path, flavour."""
    info = {"installed": False, "distribution": None, "version": None, "path": None, "flavor": None,
            "backend_tag": None, "gpu_backends": []}
    try:
        dists = md.packages_distributions().get("triton", [])
    except Exception:
        dists = []
    dists = list(dict.fromkeys(dists))
    spec = importlib.util.find_spec("triton")
    if spec is None and not dists:
        return info
    info["installed"] = spec is not None
    info["path"] = os.path.dirname(spec.origin) if spec and spec.origin else None
    info["all_distributions"] = dists
    name = None
    for cand in dists + ["triton", "pytorch-triton", "flagtree"]:
        try:
            ver = md.version(cand)
            name = cand
            break
        except md.PackageNotFoundError:
            continue
    if name:
        info["distribution"], info["version"] = name, ver
        low = name.lower()
        local = ver.split("+", 1)[1] if "+" in ver else None
        if "flagtree" in low or (local and "flagtree" in local.lower()):
            info["flavor"] = "FlagTree"
            tag = low.replace("flagtree", "").strip("-_") or None
            info["backend_tag"] = tag or local
        else:
            info["flavor"] = "upstream" if low in ("triton", "pytorch-triton", "triton-nightly") else f"other ({name})"
            info["backend_tag"] = local
    if info["path"]:
        bdir = os.path.join(info["path"], "backends")
        if os.path.isdir(bdir):
            info["gpu_backends"] = sorted(d for d in os.listdir(bdir)
                                          if os.path.isdir(os.path.join(bdir, d)) and not d.startswith("_"))
    return info


def _kernels_mode() -> bool | None:
    """Interpreter mode of `triton_probe_kernels` in this process: True/False once imported, else what it
    would be if imported now (from the environment)."""
    mod = sys.modules.get("deepinfer.debug.triton_probe_kernels")
    if mod is not None:
        return bool(mod.INTERPRET)
    from deepinfer import settings

    return settings.triton_interpreted()


def _subprocess_checks(what: str, device: str, interpret: bool, timeout: float = 300.0) -> tuple[list[dict], str]:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "deepinfer.debug.triton_probe_kernels", what, device]
    how = f"subprocess, TRITON_INTERPRET={'1' if interpret else 'unset'}"
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"check": f"{what} checks", "status": "fail", "value": None,
                 "detail": f"subprocess timed out after {timeout:.0f} s"}], how
    line = next((ln for ln in reversed(p.stdout.strip().splitlines()) if ln.startswith("{")), None)
    if p.returncode != 0 or line is None:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"check": f"{what} checks", "status": "fail", "value": None,
                 "detail": f"subprocess exit {p.returncode}: {tail}"[:300]}], how
    return json.loads(line)["checks"], how


def _pdl_check(cuda: bool) -> dict:
    """Whether the Triton kernels launch with programmatic dependent launch here (`registry.backend_facts`):
    needs grid dependency control in this Triton, an sm_90+ CUDA device, DEEPINFER_PDL != 0."""
    row = {"check": "programmatic dependent launch", "mode": "in process", "value": False}
    try:
        f = backend_facts("triton", torch.device("cuda") if cuda else torch.device("cpu"))
    except Exception as e:  # noqa: BLE001 - reported as the row's failure
        return {**row, "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"}
    if not f["pdl_triton"]:
        return {**row, "status": "skip",
                "detail": "this Triton has no grid dependency control (gdc_wait / launch_pdl): kernels launch plainly"}
    if not f["pdl_enabled"]:
        return {**row, "status": "skip", "detail": f"supported, turned off by {f['pdl_env']}=0"}
    if cuda and f["pdl"]:
        cap = "sm_%d%d" % torch.cuda.get_device_capability()
        return {**row, "status": "pass", "value": True, "detail": f"every kernel launch on this {cap} device uses it"}
    here = "no CUDA device"
    if cuda:
        here = "ROCm" if torch.version.hip else "sm_%d%d" % torch.cuda.get_device_capability()
    return {**row, "status": "pass", "value": True,
            "detail": f"supported by this Triton; used on sm_90+ CUDA devices (here: {here})"}


def _vendor_gemm_check(cuda: bool) -> dict:
    """Which GEMM the Triton backend's `fp8_gemm` runs at prefill-sized M here (`registry.backend_facts`):
    cuBLASLt's block-scaled FP8 GEMM on sm_90, else the Triton TMA kernel, with the reason."""
    row = {"check": "prefill FP8 GEMM", "mode": "in process", "value": None}
    try:
        f = backend_facts("triton", torch.device("cuda") if cuda else torch.device("cpu"))
        used, min_m = f["fp8_prefill_gemm"], f["fp8_prefill_min_m"]
    except Exception as e:  # noqa: BLE001 - reported as the row's failure
        return {**row, "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"}
    if used == "cublaslt":
        return {**row, "status": "pass", "value": used,
                "detail": "cuBLASLt block-scaled FP8 (1x128 / 128x128 scales) for M >= %d" % min_m}
    why = used.split(': ', 1)[1]
    if not cuda:  # nothing was chosen or run here: which GEMM a GPU would take is not known on this machine
        return {**row, "status": "skip", "value": None, "detail": f"not run: {why}"}
    return {**row, "status": "pass", "value": "triton", "detail": f"Triton TMA kernel: {why}"}


def probe_triton() -> dict:
    inst = triton_install()
    out = {"probe": "triton", "install": inst, "checks": [], "ok": False}
    if not inst["installed"]:
        out["checks"].append({"check": "import triton", "status": "fail", "value": None, "detail": "triton is not installed"})
        return out
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    out["device"] = device
    mode = _kernels_mode()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default warning
    # numeric checks: on the GPU, else under the interpreter (needs TRITON_INTERPRET at import time)
    need_interp = not cuda
    if mode == need_interp:
        try:
            from deepinfer.debug import triton_probe_kernels as k

            checks, how = k.numeric_checks(device), "in process"
        except Exception as e:
            checks, how = [{"check": "numeric checks", "status": "fail", "value": None,
                            "detail": f"{type(e).__name__}: {_first_line(e)}"}], "in process"
    else:
        checks, how = _subprocess_checks("numeric", device, need_interp)
    for c in checks:
        c["mode"] = ("interpreter" if need_interp else "gpu") + f" ({how})"
    out["checks"] += checks
    # compile target: always a real compile (not interpreted), no device needed
    if not _kernels_mode():
        try:
            from deepinfer.debug import triton_probe_kernels as k

            cc, how = [k.compile_check()], "in process"
        except Exception as e:
            cc, how = [{"check": "compile target sm_90a", "status": "fail", "value": None,
                        "detail": f"{type(e).__name__}: {_first_line(e)}"}], "in process"
    else:
        cc, how = _subprocess_checks("compile", "cpu", False)
    for c in cc:
        c["mode"] = f"compile only ({how})"
    out["checks"] += cc
    out["checks"].append(_pdl_check(cuda))
    out["checks"].append(_vendor_gemm_check(cuda))
    out["interpreter"] = need_interp
    out["ok"] = all(c["status"] != "fail" for c in out["checks"])
    return out


# ------------------------------------------------------------------------------------------ flaggems
def _fg_cases():
    """Known test inputs for common FlagGems op names: name -> (make inputs, torch call)."""
    import torch.nn.functional as F

    def r(*s, dtype=torch.float16):
        return lambda dev: (torch.randn(*s, generator=torch.Generator().manual_seed(0)).to(dev, dtype),)

    def r2(*s, dtype=torch.float16):
        def f(dev):
            g = torch.Generator().manual_seed(1)
            return torch.randn(*s, generator=g).to(dev, dtype), torch.randn(*s, generator=g).to(dev, dtype)
        return f

    def mm_in(dev):
        g = torch.Generator().manual_seed(2)
        return torch.randn(64, 96, generator=g).to(dev, torch.float16), torch.randn(96, 80, generator=g).to(dev, torch.float16)

    return {
        "add": (r2(1024), lambda a, b: a + b), "mul": (r2(1024), lambda a, b: a * b),
        "sub": (r2(1024), lambda a, b: a - b), "div": (r2(1024), lambda a, b: a / (b.abs() + 1)),
        "exp": (r(1024), torch.exp), "silu": (r(1024), F.silu), "gelu": (r(1024), F.gelu),
        "relu": (r(1024), torch.relu), "sigmoid": (r(1024), torch.sigmoid), "rsqrt": (r(1024), lambda x: torch.rsqrt(x.abs() + 1)),
        "softmax": (r(32, 512), lambda x: torch.softmax(x, -1)), "_softmax": (r(32, 512), lambda x: torch.softmax(x, -1)),
        "log_softmax": (r(32, 512), lambda x: torch.log_softmax(x, -1)),
        "_log_softmax": (r(32, 512), lambda x: torch.log_softmax(x, -1)),
        "sum": (r(32, 512), lambda x: x.sum(-1)), "mean": (r(32, 512), lambda x: x.mean(-1)),
        "amax": (r(32, 512), lambda x: x.amax(-1)), "argmax": (r(32, 512), lambda x: x.argmax(-1)),
        "cumsum": (r(32, 512, dtype=torch.float32), lambda x: x.cumsum(-1)),
        "mm": (mm_in, torch.mm), "bmm": (lambda d: tuple(t.unsqueeze(0) for t in mm_in(d)), torch.bmm),
        "topk": (r(32, 512), lambda x: torch.topk(x, 8, -1).values),
        "sort": (r(32, 512), lambda x: torch.sort(x, -1).values),
        "layer_norm": (r(32, 512), lambda x: F.layer_norm(x, (512,))),
        # FlagGems' rms_norm(x, normalized_shape, weight, eps) requires the weight (a GPU probe's TypeError)
        "rms_norm": (r2(32, 512), lambda x, w: F.rms_norm(x, (512,), w[0], 1e-6)),
        "embedding": (lambda d: (torch.randint(0, 100, (64,), device=d), torch.randn(100, 32).to(d, torch.float16)),
                      F.embedding),
    }


def probe_flaggems(include: list[str] | None = None) -> dict:
    out = {"probe": "flaggems", "installed": False, "version": None, "requested": include or [], "resolved": {},
           "unresolved": {}, "registered": [], "rows": [], "ok": True}
    dist, ver = _dist_version("flag_gems", "flag-gems", "FlagGems", "flaggems")
    out["version"] = ver
    if importlib.util.find_spec("flag_gems") is None:
        out["rows"].append({"check": "flag_gems", "status": "skip", "detail": "not installed (pip install flag-gems)"})
        return out
    out["installed"] = True
    if not torch.cuda.is_available():
        # FlagGems registers Triton kernels for the CUDA dispatch key: nothing to check on CPU
        out["rows"].append({"check": "flag_gems", "status": "skip", "detail": "installed, but no CUDA device to run it on"})
        return out
    try:
        import flag_gems
    except Exception as e:
        out["rows"].append({"check": "import flag_gems", "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"})
        out["ok"] = False
        return out
    cfg = getattr(flag_gems, "_FULL_CONFIG", None)
    table = sorted({str(e[0]) for e in cfg}) if cfg else []
    fnames = sorted({getattr(e[1], "__name__", str(e[1])) for e in cfg if len(e) > 1}) if cfg else []
    known = sorted(set(table) | set(fnames))
    out["table_size"] = len(known)
    cases = _fg_cases()
    wanted = include or [n for n in cases if n in known] or list(cases)
    resolved, out["unresolved"] = resolve_op_names(wanted, known)
    out["resolved"] = {n: n for n in resolved}
    # references BEFORE enabling anything (FlagGems patches aten)
    dev = "cuda"
    refs = {}
    for n in resolved:
        case = cases.get(n) or cases.get(n.lstrip("_"))
        if case is None:
            continue
        make, fn = case
        inp = make(dev)
        refs[n] = (inp, fn(*inp).float())
    torch.cuda.synchronize()
    try:
        how = enable_only(flag_gems, resolved, known)
    except Exception as e:
        out["rows"].append({"check": "enable", "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"})
        out["ok"] = False
        return out
    out["enable"] = how
    reg = []
    for getter in ("all_registered_ops", "all_ops"):
        if hasattr(flag_gems, getter):
            try:
                reg = sorted(map(str, getattr(flag_gems, getter)()))
                break
            except Exception:
                continue
    if not reg:
        r = getattr(flag_gems, "current_work_registrar", None)
        if r is not None and hasattr(r, "get_all_ops"):
            reg = sorted(map(str, r.get_all_ops()))
    out["registered"] = reg
    for n in wanted:
        if n in out["unresolved"]:
            close = out["unresolved"][n]
            out["rows"].append({"check": n, "status": "skip",
                                "detail": "not in FlagGems' table" + (f"; did you mean {', '.join(close)}?" if close else "")})
            continue
        if reg and n not in reg:
            out["rows"].append({"check": n, "status": "skip", "detail": "resolved but not registered by FlagGems"})
            continue
        if n not in refs:
            out["rows"].append({"check": n, "status": "skip", "detail": "registered; no test input for this op here"})
            continue
        inp, ref = refs[n]
        make, fn = cases.get(n) or cases.get(n.lstrip("_"))
        try:
            with flag_gems.use_gems() if hasattr(flag_gems, "use_gems") and not hasattr(flag_gems, "only_enable") \
                    else _nullctx():
                got = fn(*inp).float()
            torch.cuda.synchronize()
            err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            ok = err <= 1e-2
            out["rows"].append({"check": n, "status": "pass" if ok else "fail", "value": err,
                                "detail": "relative error vs PyTorch (computed before enabling)"})
            out["ok"] &= ok
        except Exception as e:
            out["rows"].append({"check": n, "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"})
            out["ok"] = False
    return out


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ------------------------------------------------------------------------------------------ tilelang
def probe_tilelang() -> dict:
    """TileLang and DeepSeek's TileKernels: versions (without importing), the import, the CUDA arch a kernel is
    built for here, and one small kernel compiled and run against torch."""
    dist, ver = _dist_version("tilelang")
    _, tk_ver = _dist_version("tile-kernels")
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    out = {"probe": "tilelang", "installed": importlib.util.find_spec("tilelang") is not None, "version": ver,
           "tile_kernels_version": tk_ver, "arch": f"sm_{cap[0]}{cap[1]}" if cap else None, "rows": [], "ok": True}
    out["rows"].append({"check": "tile-kernels", "status": "pass" if tk_ver else "skip",
                        "detail": f"version {tk_ver}" if tk_ver else "not installed (pip install -e '.[tilelang]')"})
    if not out["installed"]:
        out["rows"].append({"check": "tilelang", "status": "skip",
                            "detail": "not installed (pip install -e '.[tilelang]')"})
        return out
    try:
        import tilelang
        import tilelang.language as T
    except Exception as e:
        out["rows"].append({"check": "import tilelang", "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"})
        out["ok"] = False
        return out
    out["rows"].append({"check": "import tilelang", "status": "pass", "detail": getattr(tilelang, "__file__", "")})
    if not torch.cuda.is_available():
        out["rows"].append({"check": "compile + run", "status": "skip", "detail": "no CUDA device"})
        return out
    try:
        N, BLOCK = 4096, 256

        @T.prim_func
        def add(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32"), C: T.Tensor((N,), "float32")):
            with T.Kernel(T.ceildiv(N, BLOCK), threads=BLOCK) as bx:
                for i in T.Parallel(BLOCK):
                    C[bx * BLOCK + i] = A[bx * BLOCK + i] + B[bx * BLOCK + i]

        kernel = tilelang.compile(add, out_idx=[2])
        out["rows"].append({"check": "compile", "status": "pass",
                            "detail": f"elementwise add, 4096 x fp32, for {out['arch']}"})
        a, b = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
        c = kernel(a, b)
        err = (c - (a + b)).abs().max().item()
        out["rows"].append({"check": "run", "status": "pass" if err == 0 else "fail", "value": err,
                            "detail": "max abs error vs torch"})
        out["ok"] = err == 0
    except Exception as e:
        out["rows"].append({"check": "compile + run", "status": "fail", "detail": f"{type(e).__name__}: {_first_line(e)}"})
        out["ok"] = False
    return out


# ----------------------------------------------------------------------------------------------- env
def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+([\d.]+)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20)
            return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None
        except Exception:
            return None
    return None


def py_spy() -> tuple[str | None, str | None]:
    exe = shutil.which("py-spy")
    if not exe:
        return None, None
    try:
        p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
        return exe, p.stdout.strip() or None
    except Exception:
        return exe, None


def probe_env() -> dict:
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                         "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count})
    packages = {}
    for label, names in (("torch", ("torch",)), ("triton", ("triton", "pytorch-triton")), ("flagtree", ("flagtree",)),
                         ("tilelang", ("tilelang",)), ("flag_gems", ("flag_gems", "flag-gems")),
                         ("deep_gemm", ("deep_gemm", "deep-gemm")), ("deep_ep", ("deep_ep", "deep-ep")),
                         ("nvshmem", ("nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13")), ("h5py", ("h5py",)),
                         ("numpy", ("numpy",))):
        d, v = _dist_version(*names)
        packages[label] = v
    ib = os.path.isdir("/dev/infiniband")
    ib_devs = sorted(os.listdir("/dev/infiniband")) if ib else []
    if ib:
        ep = (f"/dev/infiniband present ({len(ib_devs)} entries): RDMA is visible, DeepEP's internode (RDMA/GIN via "
              "NVSHMEM) path can be used across hosts, as well as the intranode NVLink path")
    else:
        ep = ("no /dev/infiniband: DeepEP's internode/GIN (RDMA) path is unavailable; only the intranode NVLink path "
              "(expert parallelism within one host) can be used")
    spy, spy_ver = py_spy()
    return {"probe": "env", "python": sys.version.split()[0], "platform": sys.platform,
            "cuda_available": torch.cuda.is_available(), "gpus": gpus, "driver": _driver_version(),
            "cuda_runtime": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
            "packages": packages, "infiniband": ib, "infiniband_devices": ib_devs, "expert_parallel": ep,
            "py_spy": spy, "py_spy_version": spy_ver, "default_backend": default_backend(),
            "cpu_count": os.cpu_count(), "ok": True}


# ------------------------------------------------------------------------------------------- requant
def probe_requant(model: str | None = None, progress: bool = False) -> dict:
    """The FP4 routed experts of a checkpoint (None: deepinfer-tiny) requantised to per-128 FP8, as a per-128 GEMM
    (DeepGEMM on SM90) needs them (`deepinfer.quant.requant`): per layer and projection (the experts stacked), the
    blocks and values that change and the error, so the drift of that path is known per tensor before any run."""
    import re

    from deepinfer.checkpoint.reader import routed_expert, scale_name
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.quant.requant import requant_fp4

    cfg, state, model_dir, _ = load_checkpoint(model, torch.device("cpu"), progress)
    groups: dict[tuple[str, str], list[str]] = {}
    for name, t in state.items():
        if routed_expert(name) is None or not name.endswith(".weight") or t.dtype not in (torch.int8, torch.uint8):
            continue
        layer = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
        groups.setdefault((layer, name.rsplit(".", 2)[-2]), []).append(name)
    rows = []
    for (layer, _), names in sorted(groups.items()):
        names.sort(key=routed_expert)
        packed = torch.stack([state[n] for n in names])
        scale = torch.stack([state[scale_name(n)] for n in names])  # ue8m0, or decoded by the loader
        _, _, rep = requant_fp4(packed, scale, layer)
        rows.append({**rep.to_dict(), "experts": len(names)})
    lossy = [r for r in rows if not r["lossless"]]
    worst = max(rows, key=lambda r: r["rel_err"], default=None)
    return {"probe": "requant", "model": cfg.name, "model_dir": str(model_dir), "tensors": rows,
            "lossless": not lossy, "lossy_tensors": len(lossy),
            "worst": None if worst is None else {"name": worst["name"], "rel_err": worst["rel_err"],
                                                  "max_abs_err": worst["max_abs_err"]}}
