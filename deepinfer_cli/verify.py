"""`deepinfer verify --against transformers`: our exact numerics against transformers on one checkpoint."""

from __future__ import annotations

import json
import os
import tempfile

import typer

from deepinfer.debug.verify import verify
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import handle_errors


@handle_errors
def verify_cmd(
    prompt: str = typer.Argument("北京是中国的首都，上海是", help="Prompt text, or - to read it from stdin."),
    against: str = typer.Option("transformers", "--against", help="The engine to verify against: transformers."),
    model: str = common.MODEL,
    steps: int = typer.Option(4, "--steps", "-k", help="Greedy decode steps after the prompt."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N."),
    out_dir: str = typer.Option(None, "--out-dir", help="Keep both dumps (ours.h5, transformers.h5) here "
                                "(default: a temporary directory, removed after)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """Our `exact` numerics in float32 and transformers' DeepseekV4ForCausalLM on the same checkpoint: both
    dumps compared tensor by tensor and the decode margins position by position, one verdict line. Exit 0
    when they agree, 1 when not, 2 on bad input.

    Example: deepinfer verify --against transformers --model DIR
    """
    if against != "transformers":
        raise ValueError(f"--against {against!r}: transformers is the one engine verify knows")
    if steps < 0:
        raise ValueError(f"--steps {steps}: must be >= 0")
    from deepinfer.engine.peer import require_transformers

    require_transformers()
    text = common.read_prompt(prompt)
    common.check_prompt(text, "raw")
    from deepinfer.engine.loader import resolve_model_dir
    from deepinfer.tokenizer import V4Tokenizer

    ids = V4Tokenizer.from_model_dir(resolve_model_dir(model, not as_json)).encode_prompt(text, "raw")
    with tempfile.TemporaryDirectory() as tmp:
        res = verify(model, ids, steps, out_dir or os.path.join(tmp, "verify"), device, progress=not as_json)
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


def register(app: typer.Typer) -> None:
    app.command("verify")(verify_cmd)
