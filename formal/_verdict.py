"""Verdicts: ordered, three-valued (REFUTED < UNKNOWN < PROVED). Unknown is never proved."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class _Named(IntEnum):
    """An ordered enum that prints its name (``PROVED``), not its number; ``label`` is the JSON
    spelling (``proved``)."""

    def __str__(self) -> str:
        return self.name

    @property
    def label(self) -> str:
        return self.name.lower()


class Status(_Named):
    """A verdict's status, ordered so that ``min`` of several is the weakest."""

    REFUTED = 0
    UNKNOWN = 1
    PROVED = 2


class Condition(_Named):
    """The condition a rule belongs to (docs/semantics.md, "Correctness" and "Composition rules")."""

    GRADIENT_INTEGRITY = 0
    STATE_CONSISTENCY = 1
    COMPOSITION = 2  # orthogonality, divisibility, prerequisites (the composition rules)


@dataclass(frozen=True)
class Violation:
    """One broken rule, with a witness decoded from the z3 model (values a person can re-run)."""

    rule: str  # the tracked constraint name, e.g. "reduction_closure[G.norm, tp]"
    condition: Condition
    state: str | None = None
    group: str | None = None
    axis: str | None = None
    explanation: str = ""
    witness: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "condition": self.condition.label,
            "state": self.state,
            "group": self.group,
            "axis": self.axis,
            "explanation": self.explanation,
            "witness": self.witness,
        }


@dataclass(frozen=True)
class Obligation:
    """One z3 query: its name, status, z3's reason when unknown, and its time."""

    name: str
    condition: Condition
    status: Status
    reason_unknown: str = ""
    seconds: float = 0.0
    core: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    obligations: tuple[Obligation, ...]
    violations: tuple[Violation, ...]
    notes: tuple[str, ...] = ()  # cost remarks that are not validity rules (e.g. DeepSpeed refuses ZeRO-2 + PP)
    units: int = 0  # z3 resource units the run spent (deterministic; formal/_solver.py)
    rlimit: int = 0  # the run's budget of them

    def condition_status(self, condition: Condition) -> Status:
        statuses = [o.status for o in self.obligations if o.condition is condition]
        if any(v.condition is condition for v in self.violations):
            return Status.REFUTED
        return min(statuses, default=Status.PROVED)

    @property
    def status(self) -> Status:
        return min((self.condition_status(c) for c in Condition), default=Status.PROVED)

    def as_json(self) -> dict[str, Any]:
        return {
            "status": self.status.label,
            "gradient_integrity": self.condition_status(Condition.GRADIENT_INTEGRITY).label,
            "state_consistency": self.condition_status(Condition.STATE_CONSISTENCY).label,
            "composition_rules": self.condition_status(Condition.COMPOSITION).label,
            "violations": [v.as_json() for v in self.violations],
            "unknown": [
                {"obligation": o.name, "reason": o.reason_unknown}
                for o in self.obligations
                if o.status is Status.UNKNOWN
            ],
            "obligations": len(self.obligations),
            "notes": list(self.notes),
            "solver": {"resource_units": self.units, "resource_budget": self.rlimit},
        }
