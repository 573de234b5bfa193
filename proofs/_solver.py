"""The one z3 wrapper every obligation goes through (style.md, solver hygiene).

One fresh solver per query; every assertion tracked under a stable readable name; ``unknown``
keeps z3's ``reason_unknown()``; a timeout is unknown, never proved.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import z3

DEFAULT_TIMEOUT_MS = 300_000  # per query; the largest (two-axis, every program) take ~15 s


class Answer(StrEnum):
    SAT = "sat"
    UNSAT = "unsat"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Check:
    """z3's answer to one query, with the names of an unsat core or the model of a sat one."""

    answer: Answer
    seconds: float
    reason_unknown: str = ""
    core: tuple[str, ...] = ()
    model: z3.ModelRef | None = None


def check(
    assertions: Mapping[str, z3.BoolRef], timeout_ms: int = DEFAULT_TIMEOUT_MS, logic: str | None = None
) -> Check:
    """Is the conjunction of the named ``assertions`` satisfiable? A fresh solver each call.

    ``logic``: a z3 logic whose own solver decides the query (``QF_NRA``: nonlinear real
    arithmetic, complete through nlsat), for products of unknowns that the general solver's
    heuristics may chase past the timeout."""
    # simplify first: the step terms are deep if-then-else trees over constant features; measured
    # 2-3x faster than the default solver and SimpleSolver on the two-axis obligations
    solver = z3.SolverFor(logic) if logic else z3.Then("simplify", "smt").solver()
    solver.set(timeout=timeout_ms)
    solver.set(unsat_core=True)
    for name, formula in assertions.items():
        solver.assert_and_track(formula, z3.Bool(name))
    start = time.perf_counter()
    result = solver.check()
    seconds = time.perf_counter() - start
    if result == z3.unsat:
        core = tuple(sorted(str(c) for c in solver.unsat_core()))
        return Check(Answer.UNSAT, seconds, core=core)
    if result == z3.sat:
        return Check(Answer.SAT, seconds, model=solver.model())
    return Check(Answer.UNKNOWN, seconds, reason_unknown=solver.reason_unknown() or "unknown")


def prove(
    hypotheses: Mapping[str, z3.BoolRef],
    goal: z3.BoolRef,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    logic: str | None = None,
) -> Check:
    """Is ``goal`` implied by the hypotheses? UNSAT of hypotheses and not-goal means proved."""
    assertions = dict(hypotheses)
    assertions["negated_goal"] = z3.Not(goal)
    return check(assertions, timeout_ms, logic)
