"""The one door every file the tool reads comes through.

``read_text`` takes regular files only (a FIFO, a device, a socket or a directory is refused
without being opened in a way that could block), at most ``MAX_FILE_BYTES``, decoded as strict
UTF-8. ``load_json`` and ``load_toml`` parse that text and bound what it may hold: nesting at
most ``MAX_DEPTH`` deep, integers at most ``MAX_INT`` in magnitude, floats finite.
``check_schema`` then holds a document to the declared type of every key its format gives a
meaning to. Every problem is one ``InputError`` line that names the file and, where there is
one, the key.

``printable`` is how text taken from a user's file reaches a terminal: control characters
(ANSI escapes included) are shown as escapes, never sent.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from formal.errors import InputError

MAX_FILE_BYTES = 4 * 2**20  # a configuration is pages of text, not a data set
MAX_DEPTH = 32  # no format read here nests tables more than a few levels deep
MAX_INT = 2**63 - 1  # the largest integer any framework's config parser would itself accept
_MAX_INT_DIGITS = len(str(MAX_INT))
MAX_SHOWN = 60  # characters of a user's value echoed in a message


def printable(text: str, limit: int | None = None) -> str:
    """``text`` with every control character (ESC, CR, NUL, ...) written as its escape.

    The result cannot move the cursor, change colours or start a new line; ``limit`` cuts it to
    that many characters (``...`` marks the cut).
    """
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if limit is not None and len(out) > limit:
        out = out[: max(limit - 3, 0)] + "..."
    return out


def show(value: object) -> str:
    """A user's value as a message echoes it: ``repr``, one line, cut to ``MAX_SHOWN`` characters."""
    if isinstance(value, dict):
        return "{...}" if value else "{}"
    if isinstance(value, list):
        return "[...]" if value else "[]"
    return printable(repr(value), MAX_SHOWN)


# --- reading --------------------------------------------------------------------------------


def _not_regular(mode: int) -> str | None:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def read_text(path: str | Path, label: str, limit: int = MAX_FILE_BYTES) -> str:
    """The text of a regular file of at most ``limit`` bytes, strict UTF-8 (a leading BOM dropped).

    ``label`` begins every message (``--from deepspeed.json``). The file is checked before it
    is opened and again once open (it may have been swapped in between), and opened
    non-blocking, so a FIFO or device never stalls the reader.
    """
    try:
        kind = _not_regular(os.stat(path).st_mode)
    except (OSError, ValueError) as err:  # ValueError: a NUL in the path
        reason = _reason(err) if isinstance(err, OSError) else "not a path"
        raise InputError(f"{label}: cannot read ({reason})") from None
    if kind is not None:
        raise InputError(f"{label}: {kind}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        raise InputError(f"{label}: cannot read ({_reason(err)})") from None
    try:
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind is not None:
            raise InputError(f"{label}: {kind}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise InputError(f"{label}: larger than {limit:,} bytes (not a configuration file?)")
    except OSError as err:
        raise InputError(f"{label}: cannot read ({_reason(err)})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{label}: not UTF-8 text (byte {err.start}: a binary file?)") from None
    if "\x00" in text:
        raise InputError(f"{label}: holds a NUL byte (at character {text.index(chr(0))}): a binary file, not text")
    return text.removeprefix("\ufeff")


# --- parsing with bounds --------------------------------------------------------------------


@dataclass(frozen=True)
class _Refused:
    """A literal the parser met but no value may hold (a 400-digit integer, 1e400, NaN)."""

    text: str
    why: str


def _json_int(text: str) -> int | _Refused:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:  # int() of a 5000-digit string is itself an error
        return _Refused(printable(text, 24) + f" ({len(text.lstrip('-'))} digits)", f"at most {MAX_INT}")
    return int(text)


def _json_float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(printable(text, 24), "a finite number")


def _json_constant(text: str) -> _Refused:
    return _Refused(text, "a finite number (JSON has no NaN or Infinity)")


def load_json(text: str, label: str) -> Any:
    """``text`` as JSON, within the bounds of ``check_bounds``."""
    try:
        doc = json.loads(text, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
    except json.JSONDecodeError as err:
        raise InputError(f"{label}: not JSON (line {err.lineno}: {err.msg})") from None
    except RecursionError:
        raise InputError(f"{label}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    check_bounds(doc, label)
    return doc


def load_toml(text: str, label: str) -> dict[str, Any]:
    """``text`` as TOML, within the bounds of ``check_bounds``."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{label}: not valid TOML ({printable(' '.join(str(err).split()), 200)})") from None
    except RecursionError:
        raise InputError(f"{label}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as err:  # tomllib's int() of an integer literal over 4300 digits
        raise InputError(f"{label}: not valid TOML ({printable(str(err), 120)})") from None
    check_bounds(doc, label)
    return doc


def _walk(doc: Any) -> Iterator[tuple[str, int, Any]]:
    """Every value of a document with its dotted path and depth, without recursion."""
    stack: list[tuple[str, int, Any]] = [("", 0, doc)]
    while stack:
        path, depth, value = stack.pop()
        yield path, depth, value
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), depth + 1, v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", depth + 1, v) for i, v in enumerate(value))


def check_bounds(doc: Any, label: str) -> None:
    """Nesting at most ``MAX_DEPTH``, integers at most ``MAX_INT`` in magnitude, floats finite."""
    for path, depth, value in _walk(doc):
        where = printable(path, 120) or "the document"
        if depth > MAX_DEPTH:
            raise InputError(f"{label}: {printable(path, 80)}...: nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, _Refused):
            raise InputError(f"{label}: {where}={value.text}: out of range (expected {value.why})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise InputError(f"{label}: {where}: integer out of range (at most {MAX_INT})")
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{label}: {where}={value}: expected a finite number")


# --- schemas ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What one key of a format must hold: one of ``types`` (``bool`` is never an ``int``), or
    one of ``words``; integers within ``low``..``high``; list items each an ``items``."""

    label: str
    types: tuple[type, ...] = ()
    words: tuple[str, ...] = ()
    low: int | None = None
    high: int | None = None
    items: Expect | None = None
    nullable: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, str) and value in self.words:
            return True
        if isinstance(value, bool):
            return bool in self.types
        if not isinstance(value, self.types):
            return False
        if isinstance(value, int):
            if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
                return False
        if isinstance(value, list) and self.items is not None:
            return all(self.items.accepts(v) for v in value)
        return True


def integer(
    low: int | None = None, high: int | None = None, words: tuple[str, ...] = (), nullable: bool = False
) -> Expect:
    """An integer from ``low`` to ``high`` (or one of ``words``)."""
    if low is not None and high is not None:
        text = f"an integer from {low:,} to {high:,}"
    elif low is not None:
        text = f"an integer of at least {low:,}"
    else:
        text = "an integer"
    if words:
        text += " or " + " or ".join(f'"{w}"' for w in words)
    return Expect(text, (int,), words, low, high, nullable=nullable)


BOOL = Expect("true or false", (bool,))
TEXT = Expect("a string", (str,))
NUMBER = Expect("a number", (int, float))
OBJECT = Expect("an object {...}", (dict,))
TABLE = Expect("a table", (dict,))
TEXT_LIST = Expect("a list of strings", (list,), items=TEXT)


Schema = Mapping[str, Expect]


def _find(doc: Any, parts: list[str], path: str) -> Iterator[tuple[str, Any]]:
    if not parts:
        yield path, doc
        return
    if not isinstance(doc, dict):
        return
    head, rest = parts[0], parts[1:]
    keys = list(doc) if head == "*" else [head] if head in doc else []
    for key in keys:
        yield from _find(doc[key], rest, f"{path}.{key}" if path else str(key))


def check_schema(doc: Any, schema: Schema, label: str) -> None:
    """Every key ``schema`` declares (dotted paths, ``*`` for any key) holds what it expects.

    Keys the schema does not name are left to the format's reader (unknown keys are its
    business). A parent is checked before its children, so a list where a table belongs is
    named as such rather than skipped.
    """
    for pattern in sorted(schema, key=lambda p: p.count(".")):
        expect = schema[pattern]
        for path, value in _find(doc, pattern.split("."), ""):
            if not expect.accepts(value):
                raise InputError(f"{label}: {printable(path, 120)}={show(value)}: expected {expect.label}")


def read_document(path: str | Path, label: str, kind: str, schema: Schema | None = None) -> Any:
    """Read, parse (``kind`` is ``"json"`` or ``"toml"``), bound and schema-check one file."""
    text = read_text(path, label)
    if not text.strip():
        raise InputError(f"{label}: empty file")
    match kind:
        case "json":
            doc = load_json(text, label)
        case "toml":
            doc = load_toml(text, label)
        case _:
            raise AssertionError(kind)
    if schema is not None:
        check_schema(doc, schema, label)
    return doc


__all__ = [
    "BOOL",
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_INT",
    "NUMBER",
    "OBJECT",
    "TABLE",
    "TEXT",
    "TEXT_LIST",
    "Expect",
    "Schema",
    "check_bounds",
    "check_schema",
    "integer",
    "load_json",
    "load_toml",
    "printable",
    "read_document",
    "read_text",
    "show",
]
