"""`deepinfer verify`: our exact numerics against transformers (`--against transformers`), or our official numerics
against DeepSeek's own inference code module by module (`--against official --official-dir DIR`)."""

from __future__ import annotations

import json
import os
import tempfile

import typer

from deepinfer.debug.official import quirks
from deepinfer.debug.verify import verify
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors


@handle_errors
def verify_cmd(
    prompt: str = typer.Argument("北京是中国的首都，上海是", help="Prompt text, or - to read it from stdin."),
    against: str = typer.Option("transformers", "--against", help="The code to verify against: transformers "
                                "(our exact numerics, float32) | official (DeepSeek's model.py + kernel.py, "
                                "--official-dir; our official numerics of the same release, bf16, CUDA)."),
    official_dir: str = typer.Option(None, "--official-dir", help="--against official: the folder holding "
                                     "DeepSeek's inference/model.py and kernel.py (a known release, by sha256)."),
    model: str = common.MODEL,
    backend: str = common.BACKEND,
    op_map: str = common.OPS,
    steps: int = typer.Option(4, "--steps", "-k", help="Greedy decode steps after the prompt."),
    device: str = typer.Option(None, "--device", help="cpu | cuda | cuda:N (default: cpu for transformers, "
                               "cuda for official)."),
    out_dir: str = typer.Option(None, "--out-dir", help="--against transformers: keep both dumps (ours.h5, "
                                "transformers.h5) here (default: a temporary directory, removed after)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """One verdict line, exit 0 when they agree, 1 when not, 2 on bad input.

    --against transformers: our `exact` numerics in float32 and transformers' DeepseekV4ForCausalLM on the same
    checkpoint, both dumps compared tensor by tensor and the decode margins position by position.

    --against official: DeepSeek's model.py and kernel.py (identified by sha256; an unknown digest is refused)
    run module by module on our inputs to each -- attention with its compressor and indexer, the MoE with its
    gate, the block, the head -- at prefill and each decode step, per layer, against our official numerics of
    that release on --backend (needs CUDA and TileLang; docs/numerics.md).

    Example: deepinfer verify --against official --official-dir release/ --backend triton
    """
    if against not in ("transformers", "official"):
        raise ValueError(f"--against {against!r}: choose transformers or official")
    if steps < 0:
        raise ValueError(f"--steps {steps}: must be >= 0")
    from deepinfer.engine.loader import preset_name, resolve_model_dir

    if preset_name(model) is not None:
        resolve_model_dir(model)  # both checks read the checkpoint's files: refused in one line, before any work
    if against == "official":
        return _verify_official(prompt, official_dir, model, backend, op_map, steps, device, as_json)
    if official_dir is not None:
        raise ValueError("--official-dir is for --against official")
    if backend or op_map:  # verify() compares the torch reference's exact numerics with transformers
        raise ValueError(f"{'--backend' if backend else '--op'} with --against transformers: this check runs our "
                         "exact numerics on the torch reference against transformers; kernels are verified with "
                         "--against official (or `deepinfer ab` op by op)")
    from deepinfer.hf.model import require_transformers

    require_transformers()
    text = common.read_prompt(prompt)
    common.check_prompt(text, "raw")
    from deepinfer.engine.loader import resolve_model_dir
    from deepinfer.tokenizer import V4Tokenizer

    ids = V4Tokenizer.from_model_dir(resolve_model_dir(model, not as_json)).encode_prompt(text, "raw")
    with tempfile.TemporaryDirectory() as tmp:
        res = verify(model, ids, steps, out_dir or os.path.join(tmp, "verify"), device or "cpu",
                     progress=not as_json)
        if as_json:
            print(json.dumps(res.__dict__, ensure_ascii=False))
        else:
            con = console()
            style = "green" if res.passed else "bold red"
            con.print(f"[{style}]{res.line()}[/{style}]", highlight=False)
            for n in res.notes:
                con.print(f"note: {n}", highlight=False)
            if out_dir:
                con.print(f"dumps: {res.ours} {res.theirs}", highlight=False)
    if not res.passed:
        raise typer.Exit(1)


def _verify_official(prompt, official_dir, model, backend, op_map, steps, device, as_json) -> None:
    import importlib.util

    from deepinfer.debug.official import identify, verify_official
    from deepinfer.engine.loader import resolve_device

    if not official_dir:
        raise ValueError("--against official needs --official-dir DIR: DeepSeek's inference/model.py and kernel.py")
    found = identify(official_dir)  # before anything else: an unknown digest is refused here
    release = found[0]
    dev = resolve_device(device or "cuda")
    if dev.type != "cuda":
        raise ValueError(f"--device {device}: DeepSeek's kernel.py runs TileLang kernels on CUDA only")
    if importlib.util.find_spec("tilelang") is None:
        raise ValueError("--against official needs TileLang, which DeepSeek's kernel.py is written in: "
                         "pip install -e '.[tilelang]'")
    text = common.read_prompt(prompt)
    common.check_prompt(text, "raw")
    lm = common.setup(model, backend, False, f"official@{release.short}", "bfloat16", str(dev),
                      progress=not as_json, op_map=op_map)
    ids = lm.tokenizer.encode_prompt(text, "raw")
    res = verify_official(lm, official_dir, ids, steps, common.ops.backend, found=found)
    if as_json:
        print(json.dumps(res.to_dict(), ensure_ascii=False))
    else:
        con = console()
        for r in res.rows:
            cells = "  ".join(f"{k} {100 * v:.3f}%" for k, v in r.items() if k not in ("layer", "kind"))
            con.print(f"layer {r['layer']} ({r['kind']}): {cells}", highlight=False)
        con.print("logits: " + "  ".join(f"{k} {100 * v:.3f}%" for k, v in res.logits.items()), highlight=False)
        for q in quirks(release.short):
            con.print(f"note: {q}", highlight=False)
        style = "green" if res.passed else "bold red"
        con.print(f"[{style}]{res.line()}[/{style}]", highlight=False)
    if not res.passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_cmd)
