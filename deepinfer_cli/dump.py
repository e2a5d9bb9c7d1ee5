"""`deepinfer dump`: run a prompt (+ K greedy decode steps) and write every tapped tensor to one HDF5 file."""

from __future__ import annotations

import datetime
import os
import re
import tempfile

import torch
import typer
from rich.console import Console

from deepinfer.debug.dumper import parse_layers, run_dump, save
from deepinfer.debug.fingerprint import run_fingerprint
from deepinfer.debug.h5schema import DumpReader
from deepinfer.ops.registry import op_map_str
from deepinfer.outpath import check_output
from deepinfer_cli import common
from deepinfer_cli.errors import UserError, handle_errors, refuse_given


def default_path(model: str, backend: str, numerics: str, dtype: str) -> str:
    """dumps/<model>_<backend>_<numerics>-<dtype>_<UTC time>.h5 (numerics by its name, e.g. official-60d8d707)"""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    safe, num = (re.sub(r"[^A-Za-z0-9_.-]+", "-", x) or "model" for x in (model, numerics))
    return os.path.join("dumps", f"{safe}_{backend}_{num}-{dtype}_{stamp}.h5")


def _save_or_rescue(run, path: str, attrs: dict, con: Console) -> str:
    """Write the dump; if the write fails after the run (disk full, the directory removed meanwhile), the
    computed tensors go to a file in the temporary directory instead, and the message names both."""
    try:
        save(run, path, attrs)
        return path
    except OSError as e:
        rescue = os.path.join(tempfile.gettempdir(), f"deepinfer-rescued-{os.getpid()}-{os.path.basename(path)}")
        try:
            save(run, rescue, attrs)
        except OSError:
            raise UserError(f"--out {path}: writing failed ({e.strerror or e}), and so did the rescue copy "
                            f"{rescue}") from None
        con.print(f"[yellow]warning:[/yellow] --out {path}: writing failed ({e.strerror or e}); the dump was "
                  f"saved to {rescue} instead", highlight=False)
        return rescue


def check_dump_fits(lm, prompt_len: int, steps: int, layers) -> None:
    """A dump keeps every prompt position's logits ([T, V] float32) and every tap in host memory: refuse,
    with the numbers, a prompt whose logits alone would not fit in the memory available."""
    from deepinfer.engine.memory import available_bytes, fmt_bytes

    need = prompt_len * lm.cfg.vocab_size * 4 * 2  # the logits on the device and their host copy
    have = available_bytes("cpu")
    if need > 0.8 * have:
        raise UserError(f"prompt of {prompt_len} tokens: a dump stores its {prompt_len} x {lm.cfg.vocab_size} "
                        f"float32 logits ({fmt_bytes(need)} with the host copy), more than the "
                        f"{fmt_bytes(have)} of memory available; dump a shorter prompt")


def _follow_tokens(path: str, steps: int, prompt: str, mode: str, fingerprint: str) -> list[int]:
    """The tokens another dump fed: the greedy pick after the prompt and each step's input. The dump must be of
    the same prompt (and layout) and model config: its tokens continue that prompt, not this one."""
    with DumpReader(path) as r:
        theirs = {"prompt": r.attrs.get("prompt"), "prompt layout": r.attrs.get("prompt_mode"),
                  "model config": r.attrs.get("config_fingerprint")}
        ours = {"prompt": prompt, "prompt layout": mode, "model config": fingerprint}
        for k, v in theirs.items():
            if v is not None and str(v) != str(ours[k]):
                shown = (lambda x: repr(str(x)[:40])) if k == "prompt" else str
                raise UserError(f"--follow {path}: its {k} is {shown(v)}, this run's is {shown(ours[k])}; teacher "
                                "forcing feeds the tokens that continued its prompt, so follow a dump of the same "
                                "prompt and model")
        toks = [int(r.tensor(f"step{k}.input_ids").reshape(-1)[0]) for k in range(1, steps + 1)
                if f"step{k}.input_ids" in r]
    if len(toks) < steps:
        raise UserError(f"--follow {path}: has {len(toks)} decode steps, --steps asks for {steps}")
    return toks


@handle_errors
def dump_cmd(
    prompt: str = typer.Argument(None, help="Prompt text, or - to read it from stdin."),
    model: str = common.MODEL,
    layer: list[int] = typer.Option([], "--layer", "-l", help="Layer to capture (repeatable). Default: all."),
    layers: str = typer.Option(None, "--layers", help="Layers to capture: all | N-M | N,M,..."),
    out: str = typer.Option(None, "--out", "-o", help="Output .h5 (default: dumps/<model>_<backend>_<numerics>-<dtype>_<time>.h5)."),
    steps: int = typer.Option(0, "--steps", "-k", help="Greedy decode steps to capture after the prompt."),
    follow: str = typer.Option(None, "--follow", help="Feed the decode steps the tokens of this dump "
                               "(teacher forcing: positions line up with a reference run)."),
    chat: bool = typer.Option(False, "--chat", help="V4 chat layout around the prompt."),
    backend: str = common.BACKEND,
    strict: bool = common.STRICT,
    op_map: str = common.OPS,
    flaggems: str = common.FLAGGEMS,
    numerics: str = common.NUMERICS,
    dtype: str = common.DTYPE,
    device: str = common.DEVICE,
    seed: int = common.SEED,
    engine: str = typer.Option("deepinfer", "--engine", help="deepinfer | transformers: its "
                               "DeepseekV4ForCausalLM on the same checkpoint (exact numerics, hooks writing our "
                               "tap names where it has seams; deepinfer/debug/hf_dump.py)."),
):
    """Capture named tensors (per layer: hc mixes, sub-layer inputs, q, kv, compressed kv, indexer,
    attention output, router, MoE output) plus input_ids and logits, into one HDF5 file.

    Example: deepinfer dump "北京是" --layers 0-1 --steps 4 --out dumps/ref.h5
    """
    if engine not in ("deepinfer", "transformers"):
        raise UserError(f"--engine {engine!r}: deepinfer | transformers")
    if engine == "transformers":  # its own modules in exact numerics: our kernel options would be ignored
        refuse_given((("--backend", backend), ("--op", op_map), ("--strict", strict), ("--flaggems", flaggems),
                      (f"--numerics {numerics}", numerics not in ("official", "exact"))),
                     " with --engine transformers: transformers runs its own modules in exact numerics; these apply "
                     "to --engine deepinfer")
    text = common.read_prompt(prompt)
    common.check_prompt(text, "chat" if chat else "raw")
    if steps < 0:
        raise UserError(f"--steps {steps}: must be >= 0")
    if out is not None:  # checked before any work; the default path's dumps/ is created when missing
        check_output(out, "--out", inputs=(follow, model))
    torch.manual_seed(seed)
    if engine == "transformers":
        return _dump_transformers(text, chat, model, layer, layers, out, steps, follow, dtype, device, seed)
    lm = common.setup(model, backend, strict, numerics, dtype, device, flaggems=flaggems, op_map=op_map)
    sel = parse_layers(layer, layers, lm.cfg.n_layers)
    ids = lm.tokenizer.encode_prompt(text, "chat" if chat else "raw")
    check_dump_fits(lm, len(ids), steps, sel)
    forced = _follow_tokens(follow, steps, text, "chat" if chat else "raw", lm.cfg.fingerprint()) if follow else None
    # forced[i] is what the reference fed to decode step i+1, i.e. its token i
    run = run_dump(lm.model, ids, steps, sel, force_tokens=forced)
    path = out or default_path(lm.cfg.name, common.ops.backend, lm.model.numerics.name, dtype)
    if out is None:
        check_output(path, "--out", create_parents=True)
    attrs = run_fingerprint(device=lm.model.device, backend=common.ops.backend, numerics=lm.model.numerics.name,
                            dtype=dtype,
                            model_path=lm.model_dir, model_name=lm.cfg.name,
                            config_fingerprint=lm.cfg.fingerprint(), prompt=text, seed=seed,
                            steps=steps, layers="all" if sel is None else ",".join(map(str, sel)),
                            prompt_mode="chat" if chat else "raw", followed=follow or "",
                            fallback_ops=",".join(sorted(common.ops.fallbacks)),
                            op_map=op_map_str(common.ops.op_map))
    con = Console(stderr=True)
    path = _save_or_rescue(run, path, attrs, con)
    size = os.path.getsize(path)
    con.print(f"wrote {path}: {len(run.records) + 1} tensors, {size / 1e6:.1f} MB; "
              f"{len(ids)} prompt tokens, {steps} decode steps, generated {run.tokens}", highlight=False)
    print(path)


def _dump_transformers(text, chat, model, layer, layers, out, steps, follow, dtype, device, seed) -> None:
    """`dump --engine transformers`: the same prompt, steps and schema from transformers (exact numerics)."""
    from deepinfer.debug.hf_dump import MISSING_TAPS, run_hf_dump
    from deepinfer.engine.loader import load_checkpoint, resolve_device
    from deepinfer.hf.model import build_hf_peer, require_transformers
    from deepinfer.model.weights import DTYPES
    from deepinfer.tokenizer import V4Tokenizer

    transformers = require_transformers()
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    dev = resolve_device(device)
    cfg, state, d, _ = load_checkpoint(model, dev)
    forced = _follow_tokens(follow, steps, text, "chat" if chat else "raw", cfg.fingerprint()) if follow else None
    sel = parse_layers(layer, layers, cfg.n_layers)
    ids = V4Tokenizer.from_model_dir(d).encode_prompt(text, "chat" if chat else "raw")
    hf = build_hf_peer(cfg, state, dev, dtype=DTYPES[dtype])
    del state
    run = run_hf_dump(hf, ids, steps, sel, force_tokens=forced)
    path = out or default_path(cfg.name, "transformers", "exact", dtype)
    if out is None:
        check_output(path, "--out", create_parents=True)
    attrs = run_fingerprint(device=dev, backend="transformers", numerics="exact", dtype=dtype, model_path=d,
                            model_name=cfg.name, config_fingerprint=cfg.fingerprint(), prompt=text, seed=seed,
                            steps=steps, layers="all" if sel is None else ",".join(map(str, sel)),
                            prompt_mode="chat" if chat else "raw", followed=follow or "", engine="transformers",
                            transformers_version=transformers.__version__, missing_taps=",".join(MISSING_TAPS))
    con = Console(stderr=True)
    path = _save_or_rescue(run, path, attrs, con)
    con.print(f"wrote {path}: {len(run.records) + 1} tensors (transformers {transformers.__version__}); "
              f"{len(ids)} prompt tokens, {steps} decode steps, generated {run.tokens}", highlight=False)
    print(path)


def register(app: typer.Typer) -> None:
    app.command("dump")(dump_cmd)
