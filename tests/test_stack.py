"""`deepinfer stack`: one clear line and exit 2 without py-spy, for a bogus PID, or without ptrace permission."""

import os
import subprocess
import sys

from typer.testing import CliRunner

from deepinfer_cli.app import app

runner = CliRunner()


def _err_lines(r):
    return [ln for ln in r.stderr.strip().splitlines() if ln.strip()]


def test_py_spy_comes_with_the_install():
    """A dependency (pyproject), so `stack` works after the README's set-up: found beside this interpreter."""
    import shutil

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    assert spy, "py-spy is not installed beside " + sys.executable
    p = subprocess.run([spy, "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("py-spy"), (p.stdout, p.stderr)


def test_stack_without_py_spy(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy anywhere: not on PATH, not beside the interpreter
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    r = runner.invoke(app, ["stack", str(os.getpid())])
    assert r.exit_code == 2
    lines = _err_lines(r)
    assert len(lines) == 1 and "py-spy is not installed" in lines[0]


def test_stack_bogus_pid():
    r = runner.invoke(app, ["stack", "999999999"])
    assert r.exit_code == 2
    lines = _err_lines(r)
    assert len(lines) == 1 and "no process with pid 999999999" in lines[0]


def _fake_py_spy(tmp_path, body: str):
    exe = tmp_path / "py-spy"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return exe


def test_stack_permission_denied_is_one_line(monkeypatch, tmp_path):
    _fake_py_spy(tmp_path, 'echo "Error: Permission Denied (os error 1)" >&2; exit 1')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    r = runner.invoke(app, ["stack", str(os.getpid())])
    assert r.exit_code == 2
    lines = _err_lines(r)
    assert len(lines) == 1 and "Permission Denied" in lines[0] and "ptrace" in lines[0]


def test_stack_finds_deepinfer_processes(monkeypatch, tmp_path):
    _fake_py_spy(tmp_path, 'echo "Thread 1 (idle): MainThread"; echo "    sleep (<string>:1) args $*"')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "deepinfer-stack-test-target"])
    try:
        r = runner.invoke(app, ["stack", "--native", "--timeout", "5"])
        assert r.exit_code == 0, r.output
        assert f"=== pid {p.pid}" in r.stdout and "MainThread" in r.stdout and "--native" in r.stdout
        assert f"=== pid {os.getpid()}:" not in r.stdout
    finally:
        p.kill()
        p.wait()
