"""Exact numbers that need sympy only where a symbol is: the cost formulas' arithmetic.

The cost formulas (``formal._costs``, ``formal._schedules``, the step program's sizes) serve two
callers. A concrete composition (every check) has whole-number degrees and sizes, and its costs
are exact rationals: Python ``int`` and ``fractions.Fraction`` compute them exactly, and sympy,
about a third of a second to import, is not needed. The planner and the proofs derive the same
formulas with symbolic degrees and sizes (sympy symbols): there the same functions build sympy
expressions. Each helper here looks at its arguments: plain numbers get plain exact arithmetic,
anything from sympy goes to sympy's function of the same name. Nothing here imports sympy unless
a sympy value is passed in (a sympy value exists only once sympy is imported).

A division of two plain numbers is a ``Fraction`` (``ratio``), never a float; a ``Fraction``
that is whole is returned as an ``int`` (``canonical``), so that whole numbers stay usable as
counts and indices. A float anywhere is refused (``InexactError``).
"""

from __future__ import annotations

import math
import numbers
import sys
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypeAlias

from formal.errors import InexactError

if TYPE_CHECKING:
    import sympy as sp

Num: TypeAlias = "int | Fraction | sp.Expr"  # an exact number, or a sympy expression with symbols


def is_sympy(value: object) -> bool:
    """Whether ``value`` is a sympy object (only possible once sympy has been imported)."""
    sympy = sys.modules.get("sympy")
    return sympy is not None and isinstance(value, sympy.Basic)


def is_plain(value: object) -> bool:
    """An exact plain number: an ``int`` (not a truth value) or a ``Fraction``."""
    return isinstance(value, int | Fraction) and not isinstance(value, bool)


def canonical(value: Any) -> Any:
    """A plain number in its one form (a whole ``Fraction`` as an ``int``), a sympy value as it
    is; anything else (a float, a truth value, a string) is refused."""
    if isinstance(value, Fraction):
        return value.numerator if value.denominator == 1 else value
    if is_sympy(value):  # before Integral: sympy registers its integers as numbers.Integral
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # int, numpy integers
        return int(value)
    raise InexactError(f"{value!r}: not an exact number ({type(value).__name__})")


def ratio(numerator: Any, denominator: Any) -> Any:
    """``numerator / denominator`` exactly: a ``Fraction`` (or ``int``) for plain numbers."""
    if is_plain(numerator) and is_plain(denominator):
        return canonical(Fraction(numerator) / Fraction(denominator))
    return canonical(numerator) / canonical(denominator)


def is_number(value: object) -> bool:
    """Whether ``value`` is a number (no free symbol): sympy's ``is_number`` for sympy values."""
    if is_plain(value):
        return True
    if is_sympy(value):
        return bool(value.is_number)  # type: ignore[attr-defined]
    return False


def minimum(*values: Any) -> Any:
    """``min`` of plain numbers; ``sympy.Min`` when any is symbolic."""
    if all(is_plain(v) for v in values):
        return canonical(min(values))
    import sympy as sp

    return sp.Min(*values)


def maximum(*values: Any) -> Any:
    """``max`` of plain numbers; ``sympy.Max`` when any is symbolic (the units of a symbolic
    placement may not be comparable)."""
    if all(is_plain(v) for v in values):
        return canonical(max(values))
    import sympy as sp

    return sp.Max(*values)


def ceiling(value: Any) -> Any:
    """The least integer at or above ``value``: ``math.ceil`` of a plain number (exact for a
    ``Fraction``), ``sympy.ceiling`` of a symbolic one."""
    if is_plain(value):
        return math.ceil(value)
    import sympy as sp

    return sp.ceiling(value)


def expand(value: Any) -> Any:
    """A plain number as it is; a sympy expression expanded (one canonical form for symbols)."""
    if is_plain(value):
        return canonical(value)
    import sympy as sp

    return sp.expand(value)


def to_sympy(value: Any) -> sp.Expr:
    """The sympy value of an exact number (imports sympy): for symbolic output and comparisons."""
    import sympy as sp

    if isinstance(value, Fraction):
        return sp.Rational(value.numerator, value.denominator)
    return sp.sympify(value)


__all__ = [
    "Num",
    "canonical",
    "ceiling",
    "expand",
    "is_number",
    "is_plain",
    "is_sympy",
    "maximum",
    "minimum",
    "ratio",
    "to_sympy",
]
