"""The one exact-number helper: rationals come back exactly, anything inexact is refused.

``sp.nsimplify`` went through floating point and turned 9850880/3 bytes (an MLP over three
pipeline stages) into an irrational expression; ``exact_fraction`` never rounds.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
from hypothesis import example, given
from hypothesis import strategies as st

from formal._exact import exact_fraction, exact_int
from formal.errors import InexactError, PlacementError

rationals = st.fractions(max_denominator=10**15) | st.builds(
    Fraction, st.integers(-(10**30), 10**30), st.integers(1, 10**30)
)


@given(rationals)
@example(Fraction(9850880, 3))
@example(Fraction(2, 7))
def test_sympy_rationals_round_trip_exactly(value: Fraction) -> None:
    as_sympy = sp.Rational(value.numerator, value.denominator)
    assert exact_fraction(as_sympy) == value
    assert exact_fraction(value) == value
    # arithmetic on the sympy side stays exact too
    assert exact_fraction(as_sympy * 3 - as_sympy) == 2 * value


@given(st.integers(-(10**40), 10**40))
def test_integers_round_trip_exactly(value: int) -> None:
    assert exact_int(value) == value
    assert exact_int(sp.Integer(value)) == value
    assert exact_int(Fraction(value)) == value
    assert exact_int(sp.Rational(3 * value, 3)) == value
    assert type(exact_int(sp.Integer(value))) is int


def test_the_rational_nsimplify_got_wrong() -> None:
    assert exact_fraction(sp.Rational(9850880, 3)) == Fraction(9850880, 3)
    assert exact_fraction(sp.Integer(9850880) / 3) == Fraction(9850880, 3)


def test_numpy_integers_are_exact() -> None:
    assert exact_int(np.int64(12)) == 12


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_floats_are_refused_not_rounded(value: float) -> None:
    with pytest.raises(InexactError):
        exact_fraction(value)
    with pytest.raises(InexactError):
        exact_fraction(sp.Float(value))


@pytest.mark.parametrize(
    "value",
    [sp.Symbol("d_dp"), sp.sqrt(2), sp.Integer(1) / sp.Symbol("d"), sp.oo, sp.nan, np.float64(0.5), True, "1/2", None],
)
def test_non_rationals_are_refused(value: object) -> None:
    with pytest.raises(InexactError):
        exact_fraction(value)


def test_non_integers_are_not_truncated() -> None:
    with pytest.raises(InexactError, match="not an integer"):
        exact_int(sp.Rational(7, 2))
    with pytest.raises(InexactError):
        exact_int(Fraction(1, 3))


def test_the_error_is_the_projects() -> None:
    assert issubclass(InexactError, PlacementError)
