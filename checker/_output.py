"""Where the tool's answers go: files written all or nothing, and the terminal.

Files (``--report``, ``plan --csv``, ``--chart``) are written all or nothing.

``output_path`` checks a destination before the long computation that fills it: the directory
exists and is writable, the name is not a directory or a device. ``write_atomic`` writes to a
temporary file beside the destination and renames it into place (``os.replace``), so a failure
part-way (a full disk, an interrupt) leaves the previous file as it was and no half-written one.
Every problem is one ``InputError`` line naming the option and the path.

``terminal`` is the console tables print through; a closed pipe on it raises ``BrokenPipeError``
for the command line to end quietly with the verdict's exit code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from rich.console import Console

from formal._input import printable
from formal.errors import InputError

__all__ = ["PipeClosed", "output_path", "terminal", "write_atomic"]


def _label(option: str, path: str | Path) -> str:
    return f"{option} {printable(str(path), 200)}"


def output_path(text: str, option: str) -> Path:
    """``text`` as a destination the tool can write, checked now rather than after the work."""
    label = _label(option, text)
    if not text or not text.strip():
        raise InputError(f"{option} '': expected a file name")
    if "\x00" in text:
        raise InputError(f"{label}: not a path (NUL character)")
    path = Path(text)
    parent = path.parent
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except OSError as err:
        raise InputError(f"{label}: cannot write ({err.strerror or type(err).__name__})") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise InputError(f"{label}: {kind} (give a file name to write)")
    if not parent.is_dir():
        raise InputError(f"{label}: no such directory {printable(str(parent), 200)}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{label}: cannot write in {printable(str(parent), 200)} (permission denied)")
    return path


def write_atomic(path: Path, data: str | bytes, option: str) -> None:
    """Write ``data`` to ``path`` all or nothing: a temporary file beside it, then a rename."""
    label = _label(option, path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    parent = path.parent
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        raise InputError(
            f"{label}: cannot write ({err.strerror or type(err).__name__}); any previous file is unchanged"
        ) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class PipeClosed(Exception):
    """The reader of stdout went away (``| head``): the command's answer stands, quietly."""


class _Terminal(Console):
    """A rich console that reports a closed pipe as ``BrokenPipeError`` (rich itself would exit 1,
    the code that means "invalid")."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def terminal(width: int | None = None) -> Console:
    """The console every table and report prints through; ``width`` is a minimum."""
    console = _Terminal()
    if width is not None:
        console.width = max(console.width, width)
    return console
