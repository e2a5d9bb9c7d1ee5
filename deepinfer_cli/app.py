"""Assemble the Typer app from the command modules. Entry point: `deepinfer` / `python -m deepinfer`."""

from __future__ import annotations

import os

import typer

from deepinfer_cli import generate

app = typer.Typer(
    name="deepinfer",
    help="DeepSeek-V4 inference engine and numerics toolkit.\n\n"
    "Example: deepinfer generate \"北京是\" --max-new-tokens 16",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    if debug:
        os.environ["DEEPINFER_DEBUG"] = "1"


generate.register(app)

for _mod in ("dump", "show", "compare", "margin", "ab", "probe", "stack", "bench"):
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
