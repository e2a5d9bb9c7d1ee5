"""Every Triton launch the model and the `ab` cases make, compiled for sm_90a without a GPU.

A CPU session checks its kernels in Triton's interpreter, which is lenient where the compiler is not (a constexpr
used as a runtime value, a layout the backend cannot lower, an op a Triton version lacks). This records each
distinct launch of deepinfer-tiny's runs (prefill, chunked prefill, decode at batch 1 and 4, speculative
verify, `exact` and `official`, the decode fusions on and off) and of `deepinfer ab --shapes tiny`, with the
specialisation a compiled launch would get, and compiles each one for sm_90a with this environment's Triton:

    python tools/triton_launches.py                       # record, then compile; a line per failure, a summary
    python tools/triton_launches.py --json launches.json  # also keep the record
    python tools/triton_launches.py --from launches.json  # compile a record (e.g. under another Triton:
                                                          # PYTHONPATH=DIR_WITH_TRITON_3_6 python ...)

Exit 1 when any launch fails to compile. The specialisation follows Triton's JIT: an integer equal to 1 is the
constant 1, an integer divisible by 16 and a 16-byte-aligned pointer are marked divisible by 16, bools are i1,
floats fp32; constexprs compile at the launch's values; on sm_90 every launch takes `launch_pdl` (`_common.pdl`).
The shapes are deepinfer-tiny's, so block sizes chosen from flash shapes are `tools/triton_ptx.py`'s cases; this
covers the code paths (a kernel's branches per constexpr), not every shape's tile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int8": "i8",
           "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1",
           "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "enable_fp_fusion")


def encode_arg(v, constexpr: bool = False):
    """A launch argument as the JIT specialises it: ["ptr", type, aligned] | ["int", value] | ["float", value] |
    ["const", value] for what else a constexpr may hold (bool, None, str) | ["tl_dtype", name]. A runtime
    integer is kept only as far as it specialises the launch (1, a multiple of 16, or neither: 1, 16, 0 or 2**31
    for i64) and a runtime float as 0.0, so launches that compile alike are recorded once."""
    import torch

    if not constexpr and isinstance(v, int) and not isinstance(v, bool):
        wide = not -2 ** 31 <= v < 2 ** 31
        return ["int", 1 if v == 1 else (16 if v % 16 == 0 else 3) + (2 ** 32 if wide else 0)]
    if not constexpr and isinstance(v, float):
        return ["float", 0.0]

    if isinstance(v, torch.Tensor):
        t = _DTYPES.get(str(v.dtype).removeprefix("torch."))
        if t is None:
            raise TypeError(f"tensor of dtype {v.dtype}: no Triton pointer type")
        return ["ptr", t, v.data_ptr() % 16 == 0]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return ["const", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v]
    name = type(v).__name__
    if name == "dtype" and type(v).__module__.startswith("triton"):
        return ["tl_dtype", str(v)]
    if name == "constexpr":
        return encode_arg(v.value, constexpr)
    raise TypeError(f"launch argument of type {type(v).__qualname__}")


def record(scenarios: list[str]) -> list[dict]:
    """Run the scenarios under the interpreter (this process must have TRITON_INTERPRET=1 before triton is
    imported) and return the distinct launches: {module, kernel, args {name: encoded}, options}."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction

    seen, out = set(), []
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAUNCH_OPTIONS}
        params = inspect.signature(fn).parameters
        bound = inspect.signature(fn).bind(*args, **kwargs)
        enc = {k: encode_arg(v, "constexpr" in str(params[k].annotation)) for k, v in bound.arguments.items()}
        consts = [k for k in bound.arguments if "constexpr" in str(params[k].annotation)]
        item = {"module": fn.__module__, "kernel": fn.__name__, "args": enc, "constexprs": consts, "options": opts}
        key = json.dumps(item, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(item)
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs, **opts)

    InterpretedFunction.run = run
    try:
        for s in scenarios:
            t0, n0 = time.perf_counter(), len(out)
            SCENARIOS[s]()
            print(f"{s}: {len(out) - n0} new distinct launches, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    finally:
        InterpretedFunction.run = orig
    return out


def _cli(*argv: str) -> None:
    from typer.testing import CliRunner

    from deepinfer_cli.app import app

    r = CliRunner().invoke(app, list(argv))
    if r.exit_code != 0:
        raise RuntimeError(f"deepinfer {' '.join(argv)}: exit {r.exit_code}\n{r.output[-2000:]}")


def _model_steps() -> None:
    """Prefill, a chunk continuing it, decode at batch 1 and 4 (official bf16), the decode steps again with the
    fused decode ops off, and a prefill and batch-1 decode under exact fp32."""
    import torch

    from deepinfer import settings
    from deepinfer.engine.loader import load_model
    from deepinfer.ops import ops

    ops.configure("triton")
    g = torch.Generator().manual_seed(3)
    m = load_model(None, "official", "bfloat16", "cpu", progress=False).model
    B, P = 4, 20
    m.allocate(B, 48)
    toks = torch.randint(2, m.cfg.vocab_size, (1, P), generator=g)
    m.prefill(toks[:, :12], torch.tensor([0]))
    m.prefill(toks[:, 12:], torch.tensor([0]), start=12)
    for b in range(1, B):
        m.prefill(toks, torch.tensor([b]))
    for p, fusions in ((P, "on"), (P + 2, "off")):
        with settings.applied({"DEEPINFER_DECODE_FUSIONS": fusions}):
            m.decode(torch.full((1, 1), 5), torch.tensor([p]), torch.tensor([0]))
            m.decode(torch.full((B, 1), 7), torch.full((B,), p + 1), torch.arange(B))
    m = load_model(None, "exact", "float32", "cpu", progress=False).model
    m.allocate(1, 48)
    m.prefill(toks, torch.tensor([0]))
    m.decode(torch.full((1, 1), 5), torch.tensor([P]), torch.tensor([0]))


def _generate() -> None:
    """The CLI's paths: sampling, speculative verify, continuous batching with chunked prefill."""
    common = ("--backend", "triton", "--device", "cpu", "--eager", "--dtype", "float32")  # the interpreter's bf16
    # dot is refused (wrong there); the launches differ from bf16's in their pointer types only
    _cli("generate", "北京是", "-n", "3", *common)
    _cli("generate", "北京是", "-n", "4", "--speculate", "2", *common)
    _cli("generate", "北京是", "-n", "3", "--temperature", "0.7", "--seed", "1", *common)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prompts.txt")
        with open(path, "w") as f:
            f.write("北京是\n一二三四五六七八九十一二三四五六七八九十\n")
        _cli("generate", "--input-file", path, "-n", "3", "--prefill-chunk", "8", *common)


def _ab() -> None:
    """Every op's `ab` cases at tiny shapes (the prefill- and decode-sized forms of each kernel)."""
    _cli("ab", "--backend", "triton", "--shapes", "tiny", "--seed", "0", "--device", "cpu")


SCENARIOS = {"model": _model_steps, "generate": _generate, "ab": _ab}


def _tl_value(enc):
    import triton.language as tl

    kind = enc[0]
    if kind == "tl_dtype":
        return getattr(tl, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64",
                            "fp8e4nv": "float8e4nv", "fp8e5": "float8e5"}.get(enc[1], enc[1]))
    return enc[1]


def source(item: dict):
    """The ASTSource of a recorded launch, specialised as Triton's JIT specialises it."""
    import importlib

    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(item["module"]), item["kernel"])
    names = fn.arg_names
    args = item["args"]
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        n = p.name
        if n not in args:  # a constexpr left at its default
            if not (p.is_constexpr and p.has_default):
                raise ValueError(f"{item['kernel']}: argument {n} missing from the record")
            sig[n], consts[(i,)] = "constexpr", p.default
            continue
        enc = args[n]
        kind = enc[0]
        if p.is_constexpr or kind in ("const", "tl_dtype"):
            value = _tl_value(enc)
            if kind == "const" and not p.is_constexpr and isinstance(value, bool):
                sig[n] = "i1"  # a runtime bool
                continue
            sig[n], consts[(i,)] = "constexpr", value
        elif kind == "ptr":
            sig[n] = "*" + enc[1]
            if enc[2]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "int":
            v = enc[1]
            if v == 1 and not p.do_not_specialize:
                sig[n], consts[(i,)] = "constexpr", 1
                continue
            sig[n] = "i32" if -2 ** 31 <= v < 2 ** 31 else ("u64" if v >= 2 ** 63 else "i64")
            if v % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind == "float":
            sig[n] = "fp32"
    assert list(sig) == names
    return ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)


def compile_all(items: list[dict], target=None) -> list[tuple[dict, str]]:
    """Compile each recorded launch for sm_90a (launch_pdl on, as `pdl()` launches there); the failures as
    (item, one-line error)."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = target or GPUTarget("cuda", 90, 32)
    failures = []
    for item in items:
        try:
            triton.compile(source(item), target=target, options={"launch_pdl": True, **item["options"]})
        except Exception as e:  # noqa: BLE001 - every launch is tried; each failure is one line
            failures.append((item, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"))
    return failures


def _describe(item: dict) -> str:
    consts = {k: _tl_value(v) for k, v in item["args"].items()
              if k in item.get("constexprs", ()) or v[0] in ("const", "tl_dtype")}
    ints1 = [k for k, v in item["args"].items() if v[0] == "int" and v[1] == 1]
    return f"{item['module'].rsplit('.', 1)[-1]}.{item['kernel']} {consts} ones={ints1} {item['options']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the recorded launches here")
    ap.add_argument("--from", dest="src", help="compile this record instead of recording")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.record_only:  # the child: under the interpreter
        items = record(a.scenarios.split(","))
        with open(a.json, "w") as f:
            json.dump(items, f)
        return 0
    if a.src:
        with open(a.src) as f:
            items = json.load(f)
    else:
        with tempfile.TemporaryDirectory() as d:
            path = a.json or os.path.join(d, "launches.json")
            env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_BACKEND": "torch",
                   "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
            subprocess.run([sys.executable, os.path.abspath(__file__), "--record-only", "--json", path,
                            "--scenarios", a.scenarios], check=True, env=env)
            with open(path) as f:
                items = json.load(f)
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    failures = compile_all(items)
    kernels = {(i["module"], i["kernel"]) for i in items}
    for item, err in failures:
        print(f"FAILED {_describe(item)}\n  {err}")
    print(f"triton {triton.__version__}: {len(items)} distinct launches of {len(kernels)} kernels compiled for "
          f"sm_90a, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
