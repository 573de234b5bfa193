"""Where the tool's answers go: files written all or nothing, and the terminal.

Files (``--report``, ``plan --csv``, ``--chart``) are written all or nothing.

``output_path`` checks a destination before the long computation that fills it: the directory
exists and is writable, the name is not a directory or a device. ``write_atomic`` writes to a
temporary file beside the destination and renames it into place (``os.replace``), so a failure
part-way (a full disk, an interrupt) leaves the previous file as it was and no half-written one.
Every problem is one ``InputError`` line naming the option and the path.

``terminal`` is the console tables print through; a closed pipe on it raises ``BrokenPipeError``
for the command line to end quietly with the verdict's exit code. Its width is the terminal's
(rich reads ``COLUMNS`` and the terminal size; 80 columns when stdout is not a terminal), never
forced wider: ``fitted_table`` drops the least important columns of a table until every number
is shown whole in that width, rather than letting rich cut a number short with an ellipsis.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from formal._input import printable
from formal.errors import InputError

__all__ = ["Column", "PipeClosed", "fitted_table", "output_path", "terminal", "write_atomic"]


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
    """The console every table and report prints through, as wide as the terminal; ``width``
    (tests) sets the width instead of reading the terminal's."""
    return _Terminal() if width is None else _Terminal(width=width)


@dataclass(frozen=True)
class Column:
    """One column of a ``fitted_table``: its header, whether its cells are numbers (never wrapped
    or cut: shown whole or the column dropped), and ``keep``: the higher, the longer the column
    stays when the terminal is narrow (a column with ``keep`` None is never dropped); ``wrap``
    False keeps a text cell (a composition) on one line, like a number."""

    header: str
    numeric: bool = False
    keep: int | None = None
    wrap: bool = True

    @property
    def whole(self) -> bool:
        """Whether a cell is shown on one line, whole (numbers, and text that must not wrap)."""
        return self.numeric or not self.wrap


_FOLD = 24  # a word longer than this (a config key) folds inside its column rather than widen it


def _longest_word(text: str) -> int:
    return min(max((len(word) for word in text.split()), default=1), _FOLD)


def _needed(columns: Sequence[Column], cells: Sequence[Sequence[str]], whole: Sequence[bool]) -> int:
    """Columns the table needs: whole cells on one line, text wrapped at spaces (rich's heavy box:
    one space of padding either side of each cell and one rule between and around the cells)."""
    total = 1
    for i, col in enumerate(columns):
        texts = [col.header, *(row[i] for row in cells)]
        total += 3 + max(len(t) if whole[i] else _longest_word(t) for t in texts)
    return total


def fitted_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> Table:
    """A table of ``rows`` (plain text, escaped here) that fits ``width`` columns.

    While the numbers cannot all be shown whole, the column with the lowest ``keep`` is left out
    (the JSON and CSV outputs keep every column); the caption names what was left out. If the
    table is still too wide, text kept on one line (a composition) wraps at its spaces. Text cells
    wrap at spaces, or fold a word longer than its column; no cell is ever cut with an ellipsis."""
    shown = list(range(len(columns)))
    dropped: list[str] = []
    whole = [col.whole for col in columns]

    def need() -> int:
        return _needed(
            [columns[i] for i in shown], [[row[i] for i in shown] for row in rows], [whole[i] for i in shown]
        )

    while need() > width:
        droppable = [i for i in shown if columns[i].keep is not None]
        if not droppable:
            break
        least = min(droppable, key=lambda i: (columns[i].keep or 0, -i))
        shown.remove(least)
        dropped.append(columns[least].header)
    if need() > width:
        whole = [col.numeric for col in columns]
    caption = f"(narrow terminal: left out {', '.join(dropped)}; --json has every column)" if dropped else None
    table = Table(title=escape(title), caption=escape(caption) if caption else None)
    for i in shown:
        col = columns[i]
        table.add_column(
            escape(col.header),
            justify="right" if col.numeric else "left",
            no_wrap=whole[i],
            overflow="fold",
            min_width=max([len(col.header), *(len(row[i]) for row in rows)]) if whole[i] else None,
        )
    for row in rows:
        table.add_row(*[escape(row[i]) for i in shown])
    return table
