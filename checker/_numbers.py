"""Parsing the numbers users type: counts (7.5e9, 70B) and sizes (80GB, 80GiB)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from formal.errors import InputError

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_SIZE_SUFFIX = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
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


def parse_count(text: str, option: str = "--params") -> int:
    """``7.5e9``, ``7500000000``, ``7.5B``, ``70b`` -> an exact positive integer."""
    match = re.fullmatch(r"\s*([0-9.eE+_-]+?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise InputError(f"{option} {text}: not a count (e.g. 7.5e9 or 70B)")
    value = _decimal(option, text, match.group(1).replace("_", "")) * _COUNT_SUFFIX[match.group(2).lower()]
    if value != value.to_integral_value():
        raise InputError(f"{option} {text}: not a whole number")
    if value <= 0:
        raise InputError(f"{option} {text}: must be positive")
    if value > 10**15:
        raise InputError(f"{option} {text}: absurd (over 1e15)")
    return int(value)


def parse_bytes(text: str, option: str = "--device-memory") -> int:
    """``80GB`` (1e9 bytes), ``80GiB`` (2^30), ``8e10`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+_-]+?)\s*([kKmMgGtT]?[iI]?[bB]?)\s*", text)
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
