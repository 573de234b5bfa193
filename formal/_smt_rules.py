"""The composition rules as one z3 obligation (``formal/_smt.py`` explains the encoding).

``_RuleTerms`` gives ``formal._rules``' rules their degrees and sizes as z3 terms pinned by
tracked facts; ``_decide_composition`` asks z3 for the rules that fail, re-checking each rule of
an unsat core alone so that every broken rule is reported.
"""

from __future__ import annotations

from typing import Any, cast

import z3

from formal._model import Model
from formal._rules import Provenance, Rule, applicable, setting_for
from formal._solver import Solver as _Solver
from formal._strategies import Composition
from formal._verdict import Condition, Obligation, Status, Violation
from formal._vocab import Axis
from formal.errors import SolverError


class _RuleTerms:
    """``formal._rules.Terms`` as z3 terms: degrees and sizes are integer variables pinned by
    tracked facts (``value[heads]``), so that an unsat core names the sizes a broken rule read."""

    def __init__(self, composition: Composition, solver: _Solver) -> None:
        self.facts: list[z3.BoolRef] = []
        self._solver = solver
        self._mesh = composition.mesh()
        self._degree = {axis: self.size(axis.value, d) for axis, d in self._mesh.items()}
        self._micro_batches = composition.options.micro_batches

    def _pinned(self, var: Any, name: str, value: int | bool) -> Any:
        self.facts.append(self._solver.track(f"value[{name}]", var == value))
        return var

    def size(self, name: str, value: int) -> z3.ArithRef:
        return cast(z3.ArithRef, self._pinned(z3.Int(name), name, value))

    def flag(self, name: str, value: bool) -> z3.BoolRef:
        return cast(z3.BoolRef, self._pinned(z3.Bool(name), name, value))

    def degree(self, axis: Axis) -> z3.ArithRef | int:
        return self._degree.get(axis, 1)

    def present(self, axis: Axis) -> z3.BoolRef:
        return self.flag(f"has_{axis.value}", axis in self._mesh)

    def implies(self, a: Any, b: Any) -> z3.BoolRef:
        return z3.Implies(a, b)

    @property
    def micro_batches(self) -> z3.ArithRef:
        return self.size("micro_batches", self._micro_batches)


def _composition_rules(
    composition: Composition, model: Model, devices: int | None, solver: _Solver
) -> tuple[list[z3.BoolRef], list[tuple[z3.BoolRef, Rule]]]:
    """Tracked facts (degrees, sizes) and the correctness rules of ``formal._rules`` that apply,
    tracked under their names (orthogonality first, in the composition's axis order)."""
    terms = _RuleTerms(composition, solver)
    setting = setting_for(composition, model, devices)
    order = {axis: i for i, axis in enumerate(composition.mesh())}
    rules = sorted(
        applicable(setting, Provenance.CORRECTNESS),
        key=lambda r: (0, order[r.axis]) if r.name.startswith("orthogonality[") and r.axis else (1, 0),
    )
    tracked = [(solver.track(r.name, r.holds(terms, setting)), r) for r in rules]
    return terms.facts, tracked


def _decide_composition(
    composition: Composition, model: Model, devices: int | None, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    solver = _Solver(timeout_ms)
    facts, rules = _composition_rules(composition, model, devices, solver)
    mesh, setting = composition.mesh(), setting_for(composition, model, devices)
    by_literal = {lit.decl().name(): (lit, rule) for lit, rule in rules}
    remaining = [lit for lit, _ in rules]
    violations: list[Violation] = []
    cores: list[str] = []
    seconds = 0.0
    status = Status.PROVED
    reason = ""
    while True:
        answer = solver.check(facts + remaining)
        seconds += answer.seconds
        if answer.result == "sat":
            break
        if answer.result == "unknown":
            status, reason = Status.UNKNOWN, answer.reason
            break
        in_core = [by_literal[name][0] for name in answer.core if name in by_literal]
        broken = []
        for lit in in_core:  # a core need not be minimal: each rule of it is re-checked alone
            alone = solver.check([*facts, lit])
            seconds += alone.seconds
            if alone.result == "unsat":
                broken.append(lit)
        broken = broken or in_core
        if not broken:  # the facts alone conflict: impossible for concrete values
            raise SolverError(f"composition facts are inconsistent: {answer.core}")
        cores.extend(answer.core)
        for lit in broken:
            rule = by_literal[lit.decl().name()][1]
            witness = rule.witness(mesh, setting)  # a placement rule's names its state and group
            violations.append(
                Violation(
                    rule.name,
                    Condition.COMPOSITION,
                    witness.get("state"),
                    witness.get("group"),
                    rule.axis.value if rule.axis is not None else None,
                    rule.explain(mesh, setting),
                    {**witness, "core": list(answer.core)},
                )
            )
            remaining.remove(lit)
        status = Status.REFUTED
    if violations and status is Status.UNKNOWN:
        status = Status.REFUTED
    return Obligation(
        "composition_rules", Condition.COMPOSITION, status, reason, seconds, tuple(dict.fromkeys(cores))
    ), violations
