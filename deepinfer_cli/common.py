"""Options and set-up shared by the commands that run the model."""

from __future__ import annotations

import sys

import typer

from deepinfer import settings
from deepinfer.engine.loader import LoadedModel, load_model, resolve_device
from deepinfer.ops import ops
from deepinfer_cli.errors import UserError

MODEL = typer.Option(None, "--model", "-m", help="Checkpoint directory (official or transformers layout), or "
                     "preset:NAME for random weights at a preset's shapes (as bench --preset: tiny, flash-slice:4, ...; "
                     "seed 0, made on the device). Default: the embedded deepinfer-tiny.")
BACKEND = typer.Option(None, "--backend", help="Kernel backend: torch | triton | tilelang | flaggems | deepgemm (tilelang, flaggems and deepgemm implement a "
                       "subset of the ops so far, listed by `deepinfer probe kernels`: every other op falls back to the "
                       "torch reference, visibly, and --strict refuses it; --op puts single ops on it) "
                       "(default: $DEEPINFER_BACKEND, else triton on CUDA, else torch).")
STRICT = typer.Option(False, "--strict", help="Any op without a kernel in the backend is an error.")
OPS = typer.Option(None, "--op", help="Per-op backends, op=backend,... (e.g. grouped_gemm=tilelang,"
                   "sparse_attn_fp8=tilelang): those ops run there, the rest on --backend "
                   "(default: $DEEPINFER_OPS).")
NUMERICS = typer.Option("official", "--numerics", help="official (DeepSeek's inference code, release 60d8d707: FP8/FP4 "
                        "weights, FP8 activations and KV cache) | official@efc85512 (its initial release) | exact "
                        "(transformers: dequantised, nothing simulated).")
DTYPE = typer.Option("bfloat16", "--dtype", help="Compute dtype: bfloat16 | float32 | float16.")
DEVICE = typer.Option(None, "--device", help="cpu | cuda | cuda:N (default: cuda when available).")
SEED = typer.Option(0, "--seed", help="Sampling seed: the same seed and inputs give the same tokens.")
FLAGGEMS = typer.Option(None, "--flaggems", help="Enable FlagGems for this comma-separated allow-list of ops "
                        "(resolved against its registration table; needs CUDA).")


def read_prompt(prompt: str | None) -> str:
    """`-` reads the prompt from stdin."""
    if prompt == "-":  # bytes, decoded here: a locale's surrogateescape would fail later, far from the cause
        raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
        try:
            return raw.decode("utf-8").replace("\r\n", "\n").rstrip("\n")  # as text mode read it
        except UnicodeDecodeError as e:
            raise UserError(f"PROMPT - (stdin): not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") \
                from None
    if prompt is None:
        raise typer.BadParameter("a PROMPT argument is required (or - for stdin)")
    return prompt


def check_prompt(text: str, mode: str = "raw", where: str = "PROMPT") -> None:
    """An empty raw prompt would run from BOS alone: refuse it rather than answer a question nobody asked
    (a chat prompt still has its template around an empty message)."""
    if mode == "raw" and text == "":
        raise UserError(f"{where}: the prompt is empty (nothing but BOS would be fed); give some text, or - "
                        "to read it from stdin")


def setup(model: str | None, backend: str | None, strict: bool, numerics: str, dtype: str,
          device: str | None, progress: bool = True, flaggems: str | None = None,
          op_map: dict[str, str] | str | None = None, kv: str | None = None,
          experts: str | None = None) -> LoadedModel:
    """Choose the backend and per-op map (before any compute, so --strict fails early), enable a FlagGems
    allow-list once the device is chosen, then load the model."""
    from deepinfer.engine.flaggems_aten import enable_flaggems, parse_names

    dev = resolve_device(device)
    ops.configure(backend or None, strict if strict else None, op_map)
    ops.check_device(dev, dtype)
    enable_flaggems(parse_names(flaggems), dev)
    unused = settings.unused_on_the_reference() if dev.type == "cpu" and ops.backends() == ["torch"] else []
    if unused and not flaggems:
        print(f"deepinfer: {', '.join(unused)}: kernel settings; this run is the torch reference on a CPU, where they "
              "change nothing", file=sys.stderr)
    return load_model(model, numerics, dtype, str(dev), progress=progress, kv=kv, experts=experts)


def setup_spec(model: str | None, spec: dict, progress: bool = True) -> LoadedModel:
    """`setup` for a `--ref` / `--test` SPEC (`deepinfer.debug.margin.parse_spec`), its kv= applied."""
    return setup(model, spec["backend"], False, spec["numerics"], spec["dtype"], spec["device"], progress=progress,
                 op_map=spec.get("ops") or None, kv=spec.get("kv"), experts=spec.get("experts"))

def check_spec_here(opt: str, raw: str, spec: dict) -> None:
    """A SPEC's device and backend exist on this machine, refused naming the option that gave them (not a
    `--device` the user never passed) before either side loads."""
    import re

    from deepinfer.engine.loader import resolve_device
    from deepinfer.ops.registry import BACKENDS

    if spec.get("backend") and spec["backend"] not in BACKENDS:
        raise UserError(f"{opt} {raw}: unknown backend {spec['backend']!r}; choose one of {', '.join(BACKENDS)}")
    try:
        resolve_device(spec.get("device"))
    except ValueError as e:
        raise UserError(f"{opt} {raw}: {re.sub(r'^--device [^:]+(:[0-9]+)?: ', '', str(e))}") from None
