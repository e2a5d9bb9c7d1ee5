"""Known failures become one line with a hint and exit code 2; `--debug` shows the traceback."""

from __future__ import annotations

import functools
import os
import sys

import typer

# Exceptions whose message is already a complete, user-facing line.
from deepinfer.checkpoint import CheckpointError
from deepinfer.config import ConfigError
from deepinfer.engine.loader import OptionError
from deepinfer.ops.registry import BackendError
from deepinfer.tokenizer import TokenizerError

KNOWN = (CheckpointError, ConfigError, OptionError, BackendError, TokenizerError, FileNotFoundError, ValueError)
HINTS = {
    CheckpointError: "check the model directory, or run without --model to use deepinfer-tiny",
    ConfigError: "the model's config.json must describe a DeepSeek-V4 model",
    BackendError: "see `deepinfer probe kernels`; drop --strict to allow reference fallbacks",
}


def debug_enabled() -> bool:
    return os.environ.get("DEEPINFER_DEBUG", "") not in ("", "0")


class UserError(Exception):
    """Raised by commands for bad input; printed as one line, exit code 2."""


def fail(message: str, hint: str | None = None) -> "typer.Exit":
    line = f"error: {message}"
    if hint:
        line += f" (hint: {hint})"
    print(line, file=sys.stderr)
    return typer.Exit(2)


def handle_errors(fn):
    """Wrap a command: map known exceptions to one line + exit 2 unless --debug is on."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130)
        except (UserError, *KNOWN) as e:
            if debug_enabled():
                raise
            msg = str(e).strip()
            first, _, rest = msg.partition("\n")
            hint = next((h for t, h in HINTS.items() if isinstance(e, t)), None)
            if rest:  # multi-line reports (checkpoint validation) keep their list after the one-line summary
                print(f"error: {first}", file=sys.stderr)
                print(rest, file=sys.stderr)
                if hint:
                    print(f"hint: {hint}", file=sys.stderr)
                raise typer.Exit(2)
            raise fail(msg, hint)

    return wrapper
