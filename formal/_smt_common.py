"""Helpers shared by the z3 verdict engine's modules (``formal/_smt.py`` explains the encoding).

The state names ``P``, ``O``, ``G``; the erased group ``PLACEHOLDER`` of a case; the device
limits of the encodings; numbers (z3 numerals out, exact fractions and degrees in); an answer's
status; and the execution order and by-group index of a program's ops (``_execution_order``,
``_Index``), which gradient integrity (``formal/_smt_integrity.py``) and state consistency
(``formal/_smt_holdings.py``, ``formal/_smt_consistency.py``) both read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from fractions import Fraction

import z3

from formal._exact import exact_fraction, exact_int
from formal._num import Num
from formal._placement import Entry
from formal._program import Op, StepProgram
from formal._solver import Answer as _Answer
from formal._verdict import Status
from formal._vocab import Axis, Group, Mode, Phase, State
from formal.errors import InexactError, SolverError

P, O, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS  # noqa: E741 (the paper's P/O/G)
PLACEHOLDER = Group("\u00a7")  # "§": the group of a case, renamed to the real group in the verdict

MAX_EXPLICIT_DEVICES = 8  # gradient integrity: devices modelled one by one (module docstring)
MAX_CONSISTENCY_DEVICES = 4  # state consistency: devices and chunks modelled (module docstring)


# --------------------------------------------------------------------------- numbers and answers


def _number(value: z3.ExprRef) -> int | str:
    """A z3 numeral as an int, or an exact fraction ``"3/2"``."""
    if z3.is_int_value(value):
        return int(value.as_long())
    if z3.is_rational_value(value):
        frac = Fraction(int(value.numerator_as_long()), int(value.denominator_as_long()))
        return int(frac) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"
    if z3.is_algebraic_value(value):
        return str(value.approx(12))
    return str(value)


def _real(x: Fraction | int) -> z3.ArithRef:
    f = Fraction(x)
    return z3.RealVal(f"{f.numerator}/{f.denominator}")


def _fraction(x: Num | None) -> Fraction:
    if x is None:
        return Fraction(1)
    try:
        return exact_fraction(x)
    except InexactError as err:
        raise SolverError(f"scale {x}: z3 needs a rational constant") from err


def _int_degree(pl_degree: Num) -> int:
    try:
        return exact_int(pl_degree)
    except InexactError as err:
        raise SolverError(f"degree {pl_degree}: decide needs a concrete placement") from err


def _status(answer: _Answer, *, violated_when: str) -> Status:
    if answer.result == "unknown":
        return Status.UNKNOWN
    return Status.REFUTED if answer.result == violated_when else Status.PROVED


# --------------------------------------------------------------------------- execution order and the index


def _scale_home(axes: Sequence[Axis]) -> Axis:
    """The axis an axis-free SCALE op is charged to: the first data axis, else the first axis."""
    return next((a for a in axes if a.splits_data), axes[0])


PHASE_ORDER: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.GRAD_SYNC, Phase.OPTIMIZER, Phase.REFRESH)


def _execution_order(ops: Sequence[Op], micro_batches: object = 1) -> list[Op]:
    """The order a step runs a program's ops in (the simulator's, ``formal/_simulator.py``).

    Phases run in ``PHASE_ORDER``, each phase's ops in program order, except that gradient ops
    of the backward phase run after the backward computation has produced the gradient, and
    that, with ``m > 1`` micro-batches, gradient-synchronisation ops done once per micro-batch
    (``count == m``) run with each micro-batch, before the ones done once per step.
    """
    rank = {phase: i for i, phase in enumerate(PHASE_ORDER)}
    m = micro_batches if isinstance(micro_batches, int) and micro_batches > 1 else None

    def per_micro_batch(op: Op) -> bool:
        return m is not None and op.phase is Phase.GRAD_SYNC and op.count == m

    def key(item: tuple[int, Op]) -> tuple[int, int, int]:
        i, op = item
        if op.phase is Phase.GRAD_SYNC:
            return rank[op.phase], int(not per_micro_batch(op)), i
        return rank[op.phase], int(op.phase is Phase.BACKWARD and op.state is G), i

    return [op for _, op in sorted(enumerate(ops), key=key)]


class _Index:
    """A program's placement and ops looked up by group once (not rescanned per obligation)."""

    def __init__(self, program: StepProgram) -> None:
        pl = program.placement
        self.placement = pl
        self.modes = {key: dict(row) for key, row in pl.modes}
        self.local = dict(pl.local)
        self.origins = dict(program.origins)
        self.degrees = {axis: _int_degree(d) for axis, d in pl.mesh}
        self.home = _scale_home(pl.axes)
        m = pl.options.micro_batches
        self.micro_batches = m if isinstance(m, int) and m > 1 else 1
        self.ops: dict[Group, list[Op]] = {}  # group -> its ops in execution order, group erased
        for op in _execution_order(program.ops, pl.options.micro_batches):
            self.ops.setdefault(op.group, []).append(_erased(op))

    def entry(self, state: State, group: Group, axis: Axis) -> Entry:
        return self.modes.get((state, group), {}).get(axis, Entry(Mode.REPLICATED))


def _erased(op: Op) -> Op:
    """The op with its group erased and its size dropped (neither matters to a verdict)."""
    return replace(op, group=PLACEHOLDER, elements=0, note="")
