"""Known failures become one line with a hint and exit code 2; `--debug` shows the traceback."""

from __future__ import annotations

import functools
import sys

import typer

# Exceptions whose message is already a complete, user-facing line.
from deepinfer.checkpoint import CheckpointError
from deepinfer.config import ConfigError
from deepinfer.engine.loader import OptionError
from deepinfer.outpath import OutputPathError
from deepinfer.ops.registry import BackendError
from deepinfer.tokenizer import TokenizerError
from deepinfer_cli.usage import UsageError

KNOWN = (CheckpointError, ConfigError, OptionError, BackendError, TokenizerError, OutputPathError,
         FileNotFoundError, ValueError)
INTERNAL_EXIT = 3  # a bug of ours, not the user's input: one line, and --debug shows where
HINTS = {
    CheckpointError: "check the model directory, or run without --model to use deepinfer-tiny",
    ConfigError: "the model's config.json must describe a DeepSeek-V4 model",
    BackendError: "see `deepinfer probe kernels`; drop --strict to allow reference fallbacks",
}


def debug_enabled() -> bool:
    from deepinfer import settings

    return settings.flag("DEEPINFER_DEBUG")


class UserError(Exception):
    """Raised by commands for bad input; printed as one line, exit code 2."""


def refuse_given(options, why: str) -> None:
    """Raise UserError when any of `options` ((name, given?) pairs: options this run would ignore) was given, naming
    them, then `why` (e.g. " with --compare: ...")."""
    given = [name for name, on in options if on]
    if given:
        raise UserError(f"{', '.join(given)}{why}")


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
        except UsageError as e:  # typer.BadParameter raised by a command's own check: bad input, one line
            if debug_enabled():
                raise
            plain = getattr(e, "param", None) is None and getattr(e, "param_hint", None) is None
            raise fail(" ".join((e.message if plain else e.format_message()).split())) from None
        except (UserError, *KNOWN) as e:
            if debug_enabled():
                raise
            msg = str(e).strip()
            first, _, rest = msg.partition("\n")
            hint = next((h for t, h in HINTS.items() if isinstance(e, t)), None)
            if isinstance(e, BackendError) and "--strict" not in msg:
                hint = "see `deepinfer probe kernels`"  # the --strict advice only where --strict refused
            if rest:  # multi-line reports (checkpoint validation) keep their list after the one-line summary
                print(f"error: {first}", file=sys.stderr)
                print(rest, file=sys.stderr)
                if hint:
                    print(f"hint: {hint}", file=sys.stderr)
                raise typer.Exit(2)
            raise fail(msg, hint)
        except MemoryError as e:
            if debug_enabled():
                raise
            raise fail(f"out of memory ({_first_line(e) or 'MemoryError'})", "a shorter prompt, fewer "
                       "--max-new-tokens or fewer rows") from None
        except OSError as e:  # a file or device problem the command did not anticipate: still the user's
            if debug_enabled():
                raise
            where = f"{e.filename}: " if e.filename else ""
            raise fail(f"{where}{e.strerror or _first_line(e)}") from None
        except Exception as e:
            if debug_enabled():
                raise
            if _is_oom(e):
                raise fail(f"out of memory: {_first_line(e)}", "a shorter prompt, fewer --max-new-tokens or "
                           "fewer rows") from None
            print(f"error: internal error: {type(e).__name__}: {_first_line(e)} (a bug in deepinfer; "
                  "run again with --debug for the traceback)", file=sys.stderr)
            raise typer.Exit(INTERNAL_EXIT) from None

    return wrapper


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0][:300] if s else ""


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e))
