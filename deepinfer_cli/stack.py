"""`deepinfer stack`: dump the Python (and native) stacks of running deepinfer processes with py-spy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import typer

from deepinfer_cli.errors import UserError, handle_errors


def _cmdline(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return None


def find_deepinfer_pids() -> list[tuple[int, str]]:
    """Processes whose command line contains `deepinfer`, except this one and its parent/children shells."""
    me = os.getpid()
    skip = {me, os.getppid()}
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in skip:
            continue
        cmd = _cmdline(pid)
        if not cmd or "deepinfer" not in cmd:
            continue
        toks = cmd.split()
        if "stack" in toks or any(t.endswith("py-spy") for t in toks[:1]):
            continue  # another `deepinfer stack`, or a py-spy it started
        out.append((pid, cmd))
    return out


def _one_line(s: str) -> str:
    lines = [ln.strip() for ln in s.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@handle_errors
def stack_cmd(
    pids: list[int] = typer.Argument(None, help="Process ids (default: every process whose command line contains "
                                     "`deepinfer`)."),
    native: bool = typer.Option(False, "--native", help="Include native (C/C++/CUDA) frames."),
    timeout: float = typer.Option(20.0, "--timeout", help="Seconds to wait for py-spy per process."),
):
    """Show where running deepinfer processes are stuck (hangs, compile blow-ups), via `py-spy dump`.

    Example: deepinfer stack --native
    """
    if not timeout > 0:
        raise UserError(f"--timeout {timeout:g}: must be > 0 seconds")
    targets: list[tuple[int, str]] = []
    if pids:
        for pid in pids:
            cmd = _cmdline(pid)
            if cmd is None:
                raise UserError(f"no process with pid {pid}")
            targets.append((pid, cmd))
    else:
        targets = find_deepinfer_pids()
        if not targets:
            raise UserError("no running deepinfer process found (pass PIDs explicitly)")
    # a dependency: installed beside this interpreter (a venv's bin/, on PATH or not)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if not spy:
        raise UserError("py-spy is not installed, so stacks cannot be dumped (pip install -e . installs it; "
                        "it also needs ptrace permission: root or CAP_SYS_PTRACE)")
    failed = 0
    for pid, cmd in targets:
        print(f"=== pid {pid}: {cmd[:200]}", flush=True)
        args = [spy, "dump", "--pid", str(pid)] + (["--native"] if native else [])
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"error: py-spy dump of pid {pid} timed out after {timeout:g} s", file=sys.stderr)
            failed += 1
            continue
        if p.returncode != 0:
            msg = _one_line(p.stderr) or _one_line(p.stdout) or f"exit {p.returncode}"
            low = msg.lower()
            hint = ""
            if "permission" in low or "ptrace" in low or "operation not permitted" in low:
                hint = " (hint: py-spy needs ptrace permission: run as root, with CAP_SYS_PTRACE, or set " \
                       "/proc/sys/kernel/yama/ptrace_scope to 0)"
            print(f"error: py-spy could not read pid {pid}: {msg}{hint}", file=sys.stderr)
            failed += 1
            continue
        print(p.stdout.rstrip(), flush=True)
    if failed == len(targets):
        raise typer.Exit(2)
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("stack")(stack_cmd)
