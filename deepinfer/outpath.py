"""Output paths: checked before any work, written atomically, never a device node or a directory.

Every file a command writes (`dump -o`, `margin --plot`, `compare --report`, `bench --record`, `ab --dump`)
goes through `check_output` first, so a bad path costs one line and no computation, and through
`atomic_write` / a temporary file renamed over the target, so a reader sees the old file or the new one.

Temporary files are `.<name>.tmp-<pid>` beside the target. A process killed with SIGKILL cannot remove its
own; `check_output` removes those of the same target whose process no longer runs.
"""

from __future__ import annotations

import os
import re
import stat


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the option and the path."""


def real_path(path: str) -> str:
    """The file a write to `path` lands in: absolute, `~` expanded, every symlink resolved. The rename that
    completes an atomic write replaces this file, never a symlink on the way to it (`-o /dev/stdout` with stdout
    sent to a file must fill that file, not turn the /dev/stdout link into a regular file)."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(str(path))))


def temp_path(path: str) -> str:
    """The temporary name `path` is written under before the rename: `.<name>.tmp-<pid>` beside the file it
    resolves to (`real_path`)."""
    d, base = os.path.split(real_path(path))
    return os.path.join(d, f".{base}.tmp-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def clean_stale_temps(path: str) -> list[str]:
    """Remove `.<name>.tmp-<pid>` files of `path` whose process is gone; -> the removed paths."""
    d, base = os.path.split(os.path.abspath(path))
    rx = re.compile(rf"^\.{re.escape(base)}\.tmp-(\d+)$")
    removed = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for n in names:
        m = rx.match(n)
        if m and int(m[1]) != os.getpid() and not _alive(int(m[1])):
            try:
                os.unlink(os.path.join(d, n))
                removed.append(os.path.join(d, n))
            except OSError:
                pass
    return removed


def check_output(path: str, what: str, create_parents: bool = False, inputs: tuple = ()) -> str:
    """Refuse, before any work, a path that cannot take a new regular file -> the file it resolves to
    (`real_path`: a symlink's target is what gets replaced, and is what is checked).

    Accepted: an existing regular file (it will be replaced) or a new name in an existing, writable
    directory. Refused: a directory, or a name ending in a path separator (a directory meant, even where none
    exists yet), a device node, FIFO or socket (`-o /dev/full` must never replace the device), a missing parent
    directory (created only with `create_parents`), a directory this process cannot create files in (tried for
    real: root passes `os.access` on a read-only filesystem), one of the command's own `inputs` (`dump -o
    ref.h5 --follow ref.h5` would replace the file it reads), and an existing file inside an input directory
    (`dump -o MODEL/config.json --model MODEL` would break the checkpoint). `what` names the option in the message, e.g.
    "--out".
    """
    if not path or not str(path).strip():
        raise OutputPathError(f"{what}: the path is empty")
    if str(path).endswith((os.sep, "/")) or os.path.basename(str(path)) in (".", ".."):
        raise OutputPathError(f"{what} {path}: names a directory; give a file name")
    a = os.path.abspath(os.path.expanduser(path))
    if os.path.islink(a) and not os.path.exists(a):
        raise OutputPathError(f"{what} {path}: a symlink to nothing ({os.readlink(a)}); give a file name")
    p = real_path(a)
    for src in inputs:
        if src and _same_file(p, real_path(str(src))):
            raise OutputPathError(f"{what} {path}: is also an input of this command ({src}); write elsewhere")
        if src and os.path.isdir(real_path(str(src))) and os.path.lexists(p) \
                and os.path.commonpath([p, real_path(str(src))]) == real_path(str(src)):
            raise OutputPathError(f"{what} {path}: would replace a file of {src}, an input of this command (a "
                                  "checkpoint's files are read, never written); write elsewhere")
    if os.path.lexists(p):
        try:
            st = os.stat(p)
        except OSError as e:
            raise OutputPathError(f"{what} {path}: cannot use it ({e.strerror})") from None
        if stat.S_ISDIR(st.st_mode):
            raise OutputPathError(f"{what} {path}: is a directory; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise OutputPathError(f"{what} {path}: is not a regular file (a device, FIFO or socket); "
                                  "refusing to replace it")
    d = os.path.dirname(p)
    if not os.path.isdir(d):
        if os.path.lexists(d):
            raise OutputPathError(f"{what} {path}: {d} is not a directory")
        if not create_parents:
            raise OutputPathError(f"{what} {path}: directory {d} does not exist (create it first)")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise OutputPathError(f"{what} {path}: cannot create directory {d} ({e.strerror})") from None
    probe = temp_path(p)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        pass  # our own temp file from this process: the directory is writable
    except OSError as e:
        raise OutputPathError(f"{what} {path}: cannot write in {d} ({e.strerror})") from None
    clean_stale_temps(p)
    return p


def _same_file(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def check_output_dir(path: str, what: str) -> str:
    """A directory to write files into (`ab --dump DIR`): existing and writable, or new under an existing,
    writable parent (created now). -> the absolute path."""
    if not path or not str(path).strip():
        raise OutputPathError(f"{what}: the path is empty")
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.lexists(p) and not os.path.isdir(p):
        raise OutputPathError(f"{what} {path}: exists and is not a directory")
    if not os.path.isdir(p):
        parent = os.path.dirname(p)
        if not os.path.isdir(parent):
            raise OutputPathError(f"{what} {path}: directory {parent} does not exist (create it first)")
        try:
            os.mkdir(p)
        except OSError as e:
            raise OutputPathError(f"{what} {path}: cannot create it ({e.strerror})") from None
    check_output(os.path.join(p, ".deepinfer-write-check"), what)
    return p


def atomic_write(path: str, data: str | bytes, append: bool = False) -> None:
    """Write `data` to `path` through a temporary file and a rename; `append` keeps the old content first
    (the whole file is rewritten, so a crash never leaves half a row). A symlink's target is written."""
    p = real_path(path)
    tmp = temp_path(p)
    old = b""
    if append and os.path.isfile(p):
        with open(p, "rb") as f:
            old = f.read()
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(old + raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
