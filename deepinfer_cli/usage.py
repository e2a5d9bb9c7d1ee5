"""Usage errors (a missing argument, an unknown option, a value of the wrong type) as one line, exit 2.

Click prints a usage error as a boxed block of five lines. The app's group runs Click in non-standalone mode and
prints such an error as `error: <what> (see `deepinfer CMD --help`)` instead, the form every other bad input
takes (`deepinfer_cli.errors`); `--debug` keeps Click's own block. Running with no arguments still prints the
help."""

from __future__ import annotations

import sys

from typer import Abort
from typer.core import TyperGroup

try:  # typer >= 0.20 carries its own copy of Click, whose exceptions are not click's
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError
try:
    from typer._click.exceptions import NoArgsIsHelpError
except ImportError:
    try:
        from click.exceptions import NoArgsIsHelpError
    except ImportError:  # click < 8.2 prints the help itself and never raises this
        class NoArgsIsHelpError(Exception):
            pass


def repeated_options(command, args: list[str]) -> list[str]:
    """The options of `command` that `args` give more than once although they take one value (not `multiple`, not a
    count): Click keeps the last in silence, so `--op @map.yaml --op rms_norm=torch` dropped the map. A flag's
    on and off names (`--noise` / `--no-noise`) are one option. Tokens after `--` are arguments."""
    seen: dict[str, int] = {}
    names: dict[str, str] = {}
    for p in getattr(command, "params", []):
        if getattr(p, "param_type_name", "") != "option" or getattr(p, "multiple", False) or getattr(p, "count", False):
            continue
        for o in list(p.opts) + list(getattr(p, "secondary_opts", [])):
            names[o] = p.opts[0]
    for tok in args:
        if tok == "--":
            break
        name = tok.split("=", 1)[0] if tok.startswith("--") else tok
        if name in names:
            seen[names[name]] = seen.get(names[name], 0) + 1
    return [o for o, n in seen.items() if n > 1]


class OneLineUsageGroup(TyperGroup):
    """The app's top-level group (`typer.Typer(cls=...)`): Click's `main` with one-line usage errors, and an option
    given twice refused (`repeated_options`)."""

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        twice = repeated_options(cmd, rest) if cmd is not None else []
        if twice:
            sub = cmd.context_class(cmd, info_name=name, parent=ctx)  # names `deepinfer CMD --help`; parses nothing
            raise UsageError(f"{', '.join(twice)} given more than once; each takes one value (the last would "
                             "silently win)", ctx=sub)
        return name, cmd, rest

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:  # a caller that handles Click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:  # the framework has printed the help already
            sys.exit(e.exit_code)
        except UsageError as e:
            from deepinfer_cli.errors import debug_enabled

            if debug_enabled():
                e.show()
            else:
                where = e.ctx.command_path if e.ctx is not None else (prog_name or "deepinfer")
                msg = " ".join(e.format_message().split())
                print(f"error: {msg} (see `{where} --help`)", file=sys.stderr)
            sys.exit(e.exit_code)
        except ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)
