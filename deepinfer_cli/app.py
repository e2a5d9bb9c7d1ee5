"""Assemble the Typer app from the command modules. Entry point: `deepinfer` / `python -m deepinfer`."""

from __future__ import annotations

import os
import sys

import typer

from deepinfer import settings
from deepinfer_cli import generate
from deepinfer_cli.errors import fail
from deepinfer_cli.usage import OneLineUsageGroup

EXAMPLES = """[bold]Examples[/bold]

  deepinfer generate "北京是" --max-new-tokens 16 --json

  deepinfer generate --input-file prompts.jsonl --max-batch 32 --json

  deepinfer dump "北京是" --layers 0-3 --steps 4 -o a.h5

  deepinfer show a.h5

  deepinfer compare a.h5 b.h5 --rtol 1e-2 --json

  deepinfer margin "北京是" --steps 16 --ref numerics=exact,dtype=float32 --test numerics=official

  deepinfer ab --backend triton --shapes tiny,flash --bench

  deepinfer probe triton --json   (also: probe kernels | flagtree | flaggems | tilelang | env)

  deepinfer stack --native

  deepinfer bench --preset flash-slice:4 --batch 1,8,32,64 --peer transformers
"""

app = typer.Typer(
    name="deepinfer",
    help="DeepSeek-V4 inference engine and numerics toolkit. Without --model every command uses the "
    "embedded deepinfer-tiny.",
    epilog=EXAMPLES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=OneLineUsageGroup,
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    if debug:
        os.environ["DEEPINFER_DEBUG"] = "1"
    # a bad DEEPINFER_* value is refused before any work (a kernel may read it only minutes into a run, or
    # never on this backend); an unknown name is said once
    try:
        for line in settings.check_environment():
            print(f"warning: {line}", file=sys.stderr)
    except ValueError as e:
        if debug:
            raise
        raise fail(str(e), "the README's Settings table lists each variable's values") from None


generate.register(app)

for _mod in ("dump", "show", "compare", "margin", "bisect", "graft", "verify", "ab", "probe", "stack", "bench", "tune",
             "dist"):
    try:  # commands of later milestones register themselves when their module exists
        __import__(f"deepinfer_cli.{_mod}")
        getattr(__import__(f"deepinfer_cli.{_mod}", fromlist=["register"]), "register")(app)
    except ModuleNotFoundError as e:
        if e.name != f"deepinfer_cli.{_mod}":
            raise


def main() -> None:
    app()


if __name__ == "__main__":
    main()
