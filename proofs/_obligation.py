"""Obligations: a name, the statement it checks, the method, and a function that decides it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from formal._verdict import Status
from proofs._solver import Answer, Check


@dataclass(frozen=True)
class Outcome:
    status: Status
    detail: str = ""
    reason_unknown: str = ""


@dataclass(frozen=True)
class Obligation:
    name: str
    statement: str
    method: str  # "z3", "z3+numpy-check", "sympy"
    decide: Callable[[], Outcome]


@dataclass(frozen=True)
class Result:
    name: str
    statement: str
    method: str
    status: Status
    seconds: float
    detail: str = ""
    reason_unknown: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "statement": self.statement,
            "method": self.method,
            "status": self.status.label,
            "seconds": round(self.seconds, 3),
            "detail": self.detail,
            "reason_unknown": self.reason_unknown,
        }


def discharge(obligation: Obligation) -> Result:
    start = time.perf_counter()
    try:
        outcome = obligation.decide()
    except Exception as exc:  # a crash is not a proof
        outcome = Outcome(Status.UNKNOWN, reason_unknown=f"{type(exc).__name__}: {exc}")
    return Result(
        obligation.name,
        obligation.statement,
        obligation.method,
        outcome.status,
        time.perf_counter() - start,
        outcome.detail,
        outcome.reason_unknown,
    )


def proved_if_unsat(check: Check, what: str = "") -> Outcome:
    """A validity query: unsat proves it, sat refutes it, unknown stays unknown."""
    match check.answer:
        case Answer.UNSAT:
            return Outcome(Status.PROVED, f"{what}unsat core of {len(check.core)} named assertions")
        case Answer.SAT:
            return Outcome(Status.REFUTED, f"{what}z3 found a counterexample")
        case Answer.UNKNOWN:
            return Outcome(Status.UNKNOWN, reason_unknown=check.reason_unknown)
        case _:
            raise AssertionError(check.answer)


def combine(outcomes: list[Outcome], detail: str) -> Outcome:
    """Several checks behind one obligation: the weakest status wins."""
    worst = min(outcomes, key=lambda o: o.status)
    if worst.status is Status.PROVED:
        return Outcome(Status.PROVED, detail)
    return Outcome(worst.status, worst.detail, worst.reason_unknown)
