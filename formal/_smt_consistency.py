"""State consistency decided by z3, root causes and witnesses (``formal/_smt.py`` explains it).

``_decide_consistency`` translates the checks of an ``_AxisRun`` (``formal/_smt_holdings.py``)
into z3 (``_Z3Terms``), asks whether any read can differ from single-device training and, if
one can, finds every rule that fails first (``_root_causes``), each with a decoded counterexample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import z3

from formal._smt_common import _number, _real, _status
from formal._smt_holdings import _T, _AxisRun, _Check
from formal._solver import Solver as _Solver
from formal._verdict import Condition, Obligation, Status, Violation


class _Z3Terms:
    """Translation of ``_T`` values into z3 (Reals and two uninterpreted functions)."""

    def __init__(self) -> None:
        real = z3.RealSort()
        self.upd = {
            "upd_p": z3.Function("upd_p", real, real, real, real),
            "upd_o": z3.Function("upd_o", real, real, real, real),
        }
        self.cache: dict[_T, z3.ArithRef] = {}

    def __call__(self, t: _T) -> z3.ArithRef:
        hit = self.cache.get(t)
        if hit is not None:
            return hit
        match t.head:
            case "upd_p" | "upd_o":
                out = self.upd[t.head](*[self(a) for a in t.args])
            case "P0" | "O0" | "g" | "junk":
                out = z3.Real(str(t))
            case "scale":
                out = _real(t.factor) * self(t.args[0])
            case _:
                raise AssertionError(t.head)
        self.cache[t] = out
        return out


def _classify_read(check: _Check, value: _T) -> tuple[str, str]:
    """The rule a differing read breaks (and its label), from the provenance of the value."""
    target = check.target
    if check.rule == "coverage":
        return check.rule, check.label
    if value.head == "junk":  # nothing was written where the read looked
        if check.rule in ("gather_before_use", "fetch_before_use", "alignment"):
            return check.rule, check.label
        return "coverage", f"coverage{target}"
    if value.chunks() != check.expected.chunks():  # another element's value
        return "alignment", check.label if check.rule == "alignment" else f"alignment{target}"
    if any(t.head == "scale" for t in value.subterms()):  # single-device training scales no P or O
        return "scaled_state", f"scaled_state{target}"
    if any(value == t for t in check.expected.subterms()):  # an earlier version of this element
        return "refresh", f"refresh{target}"
    return "agreement", f"agreement{target}"


_EXPLAIN = {
    "coverage": "no device or host holds the single-device value",
    "agreement": "a copy read differs from the single-device value",
    "alignment": "the update reads another element's state (shards cut differently)",
    "gather_before_use": "a sharded parameter is read in full without being gathered",
    "fetch_before_use": "an offloaded parameter is read without being copied to the device",
    "refresh": "a stale copy (from before an update) is read",
    "scaled_state": "a parameter or optimizer state scaled by a constant (one device scales neither) is read",
}


def _time(check: _Check) -> tuple[int, int]:
    where = dict(check.where)
    return int(where["step"]), int(where["op"])


def _root_causes(
    run: _AxisRun,
    solver: _Solver,
    terms: _Z3Terms,
    distinct: list[_Check],
    indicator: dict[int, z3.BoolRef],
    define: Callable[[_Check], z3.BoolRef],
    goal: z3.BoolRef,
    found: dict[str, tuple[str, dict[str, Any], int]],
) -> float:
    """Fill ``found`` with every rule that can fail first, each with a decoded counterexample."""
    checks = [(indicator[id(c)] if id(c) in indicator else define(c), c) for c in distinct]
    definitions = [lit for lit in solver.literals if not lit.eq(goal)]
    rule_of = {id(c): (_classify_read(c, c.values[0]) if c.values else ("coverage", c.label)) for _, c in checks}
    earlier_ok: dict[tuple[int, int], z3.BoolRef] = {}
    previous: list[z3.BoolRef] = []
    for t in sorted({_time(c) for _, c in checks}):  # earlier_ok[t]: no read before t fails
        earlier_ok[t] = z3.Bool(f"ok_before_{t[0]}_{t[1]}")
        solver.solver.add(earlier_ok[t] == (z3.And(*previous) if previous else z3.BoolVal(True)))
        previous = [earlier_ok[t], *[z3.Not(lit) for lit, c in checks if _time(c) == t]]
    first_failure = {id(c): z3.And(lit, earlier_ok[_time(c)]) for lit, c in checks}
    seconds = 0.0
    while True:
        open_ = [first_failure[id(c)] for _, c in checks if rule_of[id(c)][1] not in found]
        if not open_:
            break
        answer = solver.check([*definitions, solver.track("root_cause", z3.Or(*open_))])
        seconds += answer.seconds
        if answer.model is None:
            break
        model = answer.model
        for _, check in checks:
            if not z3.is_true(model.eval(first_failure[id(check)], model_completion=True)):
                continue
            rule, label = rule_of[id(check)]
            if label in found:
                r, w, count = found[label]
                found[label] = (r, w, count + 1)
                continue
            read = check.values[0] if check.values else None
            witness: dict[str, Any] = {
                **dict(check.where),
                "state": check.state.value,
                "degree": run.degree,
                "modelled_devices": run.d,
                "single_device": str(check.expected),
                "single_device_value": _number(model.eval(terms(check.expected), model_completion=True)),
            }
            if check.rule == "coverage":
                witness["holders"] = [str(v) for v in check.values]
            elif read is not None:
                witness["read"] = str(read)
                witness["read_value"] = _number(model.eval(terms(read), model_completion=True))
            found[label] = (rule, witness, 1)
    return seconds


def _decide_consistency(run: _AxisRun, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    """One obligation for P, O and G of a group along an axis; each check keeps its state's name.

    First z3 decides whether any read can differ from single-device training (checks that
    differ only by a renaming of chunks, the devices of a symmetric program, are asked once:
    satisfiability of a disjunct is invariant under renaming). If one can, every failing rule
    is named with its own counterexample, root causes only: a failure counts when it can happen
    while every earlier read (in program time: step, then op) is correct, so the knock-on
    effects of one bug (an update that read the wrong gradient corrupts every later read) are
    not reported as more bugs, while a second, independent bug is.
    """
    name = f"{run.group.name}, {run.axis.value}"
    solver = _Solver(timeout_ms)
    terms = _Z3Terms()
    distinct: list[_Check] = []  # up to the same read on another device
    representatives: list[_Check] = []  # up to a renaming of chunks
    seen_exact: set[tuple[str, tuple[_T, ...], _T]] = set()
    seen_renamed: set[tuple[str, tuple[int, ...], int, tuple[int, ...]]] = set()
    for check in run.checks:
        if (check.label, check.values, check.expected) in seen_exact:
            continue
        seen_exact.add((check.label, check.values, check.expected))
        distinct.append(check)
        names: dict[tuple[str, int], int] = {}
        renaming = tuple(
            names.setdefault(leaf, len(names)) for t in (*check.values, check.expected) for leaf in t.leaves
        )
        key = (check.label, tuple(v.shape for v in check.values), check.expected.shape, renaming)
        if key not in seen_renamed:
            seen_renamed.add(key)
            representatives.append(check)
    indicator: dict[int, z3.BoolRef] = {}  # id(check) -> "this read differs"

    def define(check: _Check) -> z3.BoolRef:
        literal = z3.Bool(f"fails{len(indicator)}")
        expected = terms(check.expected)
        differs = z3.And(*[terms(v) != expected for v in check.values]) if check.values else z3.BoolVal(True)
        solver.track(check.label, literal == differs)
        indicator[id(check)] = literal
        return literal

    goal = solver.track(
        f"state_consistency[{name}]", z3.Or(*[define(c) for c in representatives]) if representatives else False
    )
    first = solver.check()
    seconds = first.seconds
    found: dict[str, tuple[str, dict[str, Any], int]] = {}
    if first.model is not None:
        seconds += _root_causes(run, solver, terms, distinct, indicator, define, goal, found)
    status = Status.REFUTED if found else _status(first, violated_when="sat")
    obligation = Obligation(
        f"state_consistency[{name}]", Condition.STATE_CONSISTENCY, status, first.reason, seconds, first.core
    )
    violations = []
    for label, (rule, witness, count) in found.items():
        state = witness["state"]
        witness["failing_reads"] = count
        where_text = (
            f"step {witness['step']}, {witness.get('phase', 'end of step')}, device {witness['device']}"
            if "device" in witness
            else f"end of step {witness['step']}"
        )
        explanation = (
            f"{_EXPLAIN[rule]}: {state}.{run.group.name} chunk {witness['chunk']} along "
            f"{run.axis.value} ({where_text}) reads {witness.get('read', 'nothing current')} "
            f"where single-device training has {witness['single_device']}"
        )
        axis = None if rule == "fetch_before_use" else run.axis.value
        violations.append(
            Violation(label, Condition.STATE_CONSISTENCY, state, run.group.name, axis, explanation, witness)
        )
    return obligation, violations
