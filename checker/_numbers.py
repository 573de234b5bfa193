"""Parsing the numbers users type: whole numbers (8), counts (7.5e9, 70B) and sizes (80GB, 80GiB).

``parse_int`` is the one reader of a whole number a user types, on the command line or in a
Megatron script: ASCII digits only (no sign, exponent, separator, superscript or other
script's digit), within stated bounds, so that no later arithmetic meets a number it cannot
hold. ``WholeNumber`` is the same rule as a click option type.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

import click

from formal._model import MAX_MICRO_BATCH, MAX_SEQ
from formal.errors import InputError

MAX_DEGREE = 1_000_000  # a mesh axis (or a whole mesh) wider than a million devices is a typo
MAX_BATCH = 1_000_000_000  # sequences per step
__all__ = [
    "MAX_BATCH",
    "MAX_DEGREE",
    "MAX_MICRO_BATCH",
    "MAX_SEQ",
    "WholeNumber",
    "gb",
    "parse_bytes",
    "parse_count",
    "parse_int",
]


def parse_int(text: str, option: str, low: int = 1, high: int = MAX_DEGREE) -> int:
    """``text`` as a whole number from ``low`` to ``high``; ``option`` begins the message."""
    digits = text.strip(" \t")
    if not (digits.isascii() and digits.isdigit()):
        raise InputError(f"{option} {text}: expected a whole number from {low} to {high:,} (digits 0-9 only)")
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(high)) or int(significant) > high:
        raise InputError(f"{option} {text}: too large (at most {high:,})")
    value = int(significant)
    if value < low:
        raise InputError(f"{option} {text}: must be at least {low}")
    return value


if TYPE_CHECKING:  # click 8.2+ types its ParamType by the value it converts to; older ones do not
    _IntType = click.ParamType[int]
else:
    _IntType = click.ParamType


class WholeNumber(_IntType):
    """A click option type that reads its value with ``parse_int``; a bad value is one usage line."""

    name = "integer"

    def __init__(self, low: int = 1, high: int = MAX_DEGREE) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a default given as a number
        option = param.opts[0] if param is not None and param.opts else "value"
        try:
            return parse_int(str(value), option, self.low, self.high)
        except InputError as err:
            raise click.UsageError(str(err), ctx) from None


_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_SIZE_SUFFIX = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


_MAX_EXPONENT = 30  # any count or size beyond 1e30 is a typo; keeps Decimal arithmetic in range


def _decimal(option: str, text: str, number: str) -> Decimal:
    try:
        value = Decimal(number)
    except InvalidOperation:
        raise InputError(f"{option} {text}: not a number") from None
    if not value.is_finite():
        raise InputError(f"{option} {text}: not a finite number")
    # Decimal parses 1e999999999 exactly but overflows when scaled: refuse absurd exponents first.
    if value and value.adjusted() > _MAX_EXPONENT:
        raise InputError(f"{option} {text}: absurd (over 1e{_MAX_EXPONENT})")
    if value and value.adjusted() < -_MAX_EXPONENT:
        raise InputError(f"{option} {text}: absurdly small (under 1e-{_MAX_EXPONENT})")
    return value


def _power(n: int) -> str:
    """``10**15`` as ``1e15``; other bounds with thousands separators."""
    text = str(n)
    return f"1e{len(text) - 1}" if text.strip("0") == "1" else f"{n:,}"


def parse_count(text: str, option: str = "--params", high: int = 10**15) -> int:
    """``7.5e9``, ``7500000000``, ``7.5B``, ``70b`` -> an exact positive integer, at most ``high``."""
    match = re.fullmatch(r"[ \t]*([0-9.eE+_-]+?)[ \t]*([kKmMbBgGtT]?)[ \t]*", text)  # ASCII only
    if not match:
        raise InputError(f"{option} {text}: not a count (e.g. 7.5e9 or 70B)")
    value = _decimal(option, text, match.group(1).replace("_", "")) * _COUNT_SUFFIX[match.group(2).lower()]
    if value != value.to_integral_value():
        raise InputError(f"{option} {text}: not a whole number")
    if value <= 0:
        raise InputError(f"{option} {text}: must be positive")
    if value > high:
        raise InputError(f"{option} {text}: absurd (over {_power(high)})")
    return int(value)


def parse_bytes(text: str, option: str = "--device-memory") -> int:
    """``80GB`` (1e9 bytes), ``80GiB`` (2^30), ``8e10`` -> bytes."""
    match = re.fullmatch(r"[ \t]*([0-9.eE+_-]+?)[ \t]*([kKmMgGtT]?[iI]?[bB]?)[ \t]*", text)  # ASCII only
    if not match:
        raise InputError(f"{option} {text}: not a size (e.g. 80GB or 80GiB)")
    suffix = match.group(2).lower()
    if suffix not in _SIZE_SUFFIX:
        raise InputError(f"{option} {text}: unknown unit {match.group(2)!r} (GB = 1e9 bytes, GiB = 2^30)")
    value = _decimal(option, text, match.group(1).replace("_", "")) * _SIZE_SUFFIX[suffix]
    if value <= 0 or value > 10**18:
        raise InputError(f"{option} {text}: must be positive and below 1e18 bytes")
    nbytes = int(value.to_integral_value())
    if nbytes < 1:  # 0.4 bytes would round to a device with no memory
        raise InputError(f"{option} {text}: less than one byte")
    return nbytes


def gb(nbytes: int | float) -> str:
    """Bytes as GB (1e9 bytes), one decimal: the ZeRO paper's convention."""
    return f"{nbytes / 1e9:,.1f} GB"
