"""The stdout console of the commands that print tables."""

from __future__ import annotations

import os
import sys

from rich.console import Console

PIPED_WIDTH = 200
"""Columns when stdout is a file or a pipe and $COLUMNS is unset. Rich's default there is 80, which
squeezed `ab`'s 12-column table into truncated cells ("496…") in every log a GPU run wrote."""


def console() -> Console:
    """A rich Console on stdout: the terminal's width, or PIPED_WIDTH columns when redirected."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=PIPED_WIDTH)
