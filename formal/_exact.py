"""Exact arithmetic: one place that turns a cost result into its canonical or numeric value.

A concrete composition's costs are plain exact numbers (``int`` and ``fractions.Fraction``,
``formal._num``); a symbolic derivation's are sympy expressions. Never ``sp.nsimplify`` an exact
value: it searches for a "simpler" form through floating point and returns wrong answers for
some rationals (sympy 1.14: ``nsimplify(Rational(9850880, 3))`` gives
``53593750*2**(114/127)*3**(31/127)*5**(57/127)*7**(71/127)/243``). Our expressions are built
from integers, rationals and symbols only, so sympy's automatic evaluation is already exact:
``exact`` only puts a value in its canonical form, and ``exact_fraction`` / ``exact_int`` read
the number off a value that already is one, refusing (``InexactError``) anything else instead of
rounding it.
"""

from __future__ import annotations

import numbers
from fractions import Fraction
from typing import Any

from formal._num import Num, canonical, is_sympy
from formal.errors import InexactError


def exact(value: Any) -> Num:
    """The exact value of ``value``: a plain number (``int``, whole ``Fraction`` as ``int``) as it
    is, a sympy value sympified; no floats (an internal invariant: no float enters a cost)."""
    if isinstance(value, float):
        raise AssertionError(f"inexact cost {value!r}")
    if is_sympy(value):
        import sympy as sp

        out = sp.sympify(value)
        assert not out.has(sp.Float), f"inexact cost {out}"
        return out
    return canonical(value)


def exact_fraction(value: object) -> Fraction:
    """``value`` as a ``Fraction``: an int, a ``Fraction``, or a sympy ``Rational``/``Integer``.

    Floats (Python, numpy or sympy), symbols and any expression sympy did not evaluate to a
    rational raise ``InexactError``: a value that went through floating point is refused, not
    rounded.
    """
    if isinstance(value, bool):
        raise InexactError(f"{value!r}: a truth value, not a number")
    if is_sympy(value):
        import sympy as sp

        if isinstance(value, sp.Rational):  # sp.Integer included
            return Fraction(int(value.p), int(value.q))
        raise InexactError(f"{value}: not an exact rational (a float or a symbolic expression)")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return Fraction(int(value))
    raise InexactError(f"{value!r}: not an exact rational ({type(value).__name__})")


def exact_int(value: object) -> int:
    """``value`` as an ``int``: an exact rational (see ``exact_fraction``) whose denominator is 1."""
    frac = exact_fraction(value)
    if frac.denominator != 1:
        raise InexactError(f"{value}: not an integer")
    return frac.numerator


__all__ = ["exact", "exact_fraction", "exact_int"]
