"""Exact arithmetic for costs: one place that turns a sympy result into its canonical value.

Never ``sp.nsimplify`` an exact value: it searches for a "simpler" form through floating point
and returns wrong answers for some rationals (sympy 1.14: ``nsimplify(Rational(9850880, 3))``
gives ``53593750*2**(114/127)*3**(31/127)*5**(57/127)*7**(71/127)/243``). Our expressions are
built from integers, rationals and symbols only, so sympy's automatic evaluation is already
exact; ``exact`` only sympifies.
"""

from __future__ import annotations

from typing import Any

import sympy as sp


def exact(value: Any) -> sp.Expr:
    """The exact sympy value of ``value`` (an int, a Rational or an expression): no floats."""
    out = sp.sympify(value)
    assert not out.has(sp.Float), f"inexact cost {out}"  # internal invariant: no float enters
    return out
