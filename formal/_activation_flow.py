"""z3 decides the activation exchange a placement needs (part of gradient integrity).

A placement that splits a layer's computation along an axis leaves activations (or their
gradients) incomplete on each device; the step program must complete them, or the forward pass
computes a different loss and every gradient after it differs from single-device training:

* **tp** (matrices split): Megatron's ``g`` operator, the row-parallel output is a partial sum
  (forward), and ``f``'s backward, the column-parallel input gradient is one (backward). Each
  must be summed across tp: one all-reduce, or, when sequence parallelism splits the layer
  inputs (``A.layer_io`` sharded along tp), one reduce-scatter to sequence shards and an
  all-gather of those shards before the next column-parallel matrix reads them.
* **tp, vocabulary-parallel embedding and head** (rows split by vocabulary): the embedding's
  output is a partial sum (forward; under sequence parallelism reduce-scattered, and its
  gradient's shards all-gathered in backward); the head's input gradient is one (backward; under
  sequence parallelism its input's shards are all-gathered in forward).
* **cp** (sequence split): attention needs every position's keys and values (an all-gather in
  forward, and again in backward under full recomputation); their gradients are partial sums
  of every query shard (one reduce-scatter to their owners in backward).
* **ep** (experts split): tokens go to their expert's device and come back, an all-to-all each
  way, exactly once (a second one sends them on again).
* **pp** (layers split): each stage sends its output forward and its input gradient backward.

One op of the program denotes that collective at every site of its kind in its phase (the
simulator's reading, ``formal/_simulator.py``); ``count`` is cost, not meaning. Each site is an
obligation over z3 integers: devices start with partial contributions (or with their own
shard, or tokens addressed to others), the program's ops of the site's kind run in order, and
z3 is asked for values on which some device ends with something other than the single-device
value (the sum, its shard of the sum, the whole tensor, the tokens addressed to it). A freed
slot (outside a device's shard after a reduce-scatter, or not yet gathered) holds an
unconstrained value. Unsat: proved. Up to four devices are explicit (devices along an axis are
symmetric and every op is the same map on each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import z3

from formal import _num as num
from formal._exact import exact_int
from formal._exchanges import exchanges
from formal._model import Model
from formal._program import Op, StepProgram
from formal._solver import Solver
from formal._verdict import Condition, Obligation, Status, Violation
from formal._vocab import (
    Axis,
    Group,
    OpKind,
    Phase,
    Reduce,
    State,
)

MAX_DEVICES = 4


@dataclass(frozen=True)
class Site:
    """One kind of activation exchange the placement needs along an axis in a phase."""

    axis: Axis
    phase: Phase
    group: Group
    kind: OpKind  # the collective the site runs (ops of other kinds are not read here)
    need: str  # "sum" (every device the whole sum), "shard-sum", "gather", "all-to-all", "send"
    what: str  # the activation, in words

    @property
    def rule(self) -> str:
        return f"activation_exchange[A.{self.group.name}, {self.axis.value}, {self.phase.value}, {self.kind.value}]"


def required_sites(program: StepProgram, model: Model) -> list[Site]:
    """The exchanges the program's placement needs, read from the placement alone: the axis
    kinds' exchange table (``formal._axes``) as ``formal._exchanges`` reads it for a placement."""
    return [
        Site(axis, e.phase, e.group, e.kind, e.need, e.what)
        for axis, e in exchanges(program.placement, model, required=True)
    ]


def _degree(d: object) -> int:
    if num.is_number(d):
        return exact_int(d)
    return 2  # a symbolic degree: any split at all


def _site_ops(program: StepProgram, site: Site) -> list[Op]:
    return [
        op
        for op in program.ops
        if op.state is State.ACTIVATIONS
        and op.kind is site.kind
        and op.group == site.group
        and op.axis is site.axis
        and op.phase is site.phase
    ]


def decide_site(program: StepProgram, site: Site, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    """One site: run its ops symbolically and ask z3 for a device that ends wrong."""

    ops = _site_ops(program, site)
    d = min(_degree(program.placement.degree(site.axis)), MAX_DEVICES)
    solver = Solver(timeout_ms)
    fresh = iter(range(10**6))

    def junk() -> z3.ArithRef:
        return z3.Real(f"freed{next(fresh)}")

    # value[i][c]: what device i holds of chunk c (a chunk is 1/d of the tensor along the split).
    start = [[z3.Real(f"x_{i}_{c}") for c in range(d)] for i in range(d)]
    value: list[list[z3.ArithRef]] = [list(row) for row in start]
    expected: list[list[z3.ArithRef | None]]
    match site.need:
        case "sum" | "shard-sum":  # partial contributions: the single device holds their sum
            total = [z3.Sum(*(start[j][c] for j in range(d))) for c in range(d)]
            expected = [[total[c] if site.need == "sum" or c == i else None for c in range(d)] for i in range(d)]
        case "gather":  # device i owns chunk i (complete); everyone must read every chunk
            value = [[start[c][c] if c == i else junk() for c in range(d)] for i in range(d)]
            expected = [[start[c][c] for c in range(d)] for _ in range(d)]
        case "all-to-all":  # device i holds tokens addressed to device c; c must receive them
            expected = [[start[c][i] for c in range(d)] for i in range(d)]
        case "send":
            value = [[start[i][c] if ops else junk() for c in range(d)] for i in range(d)]
            expected = [[start[i][c] for c in range(d)] for i in range(d)]
        case _:
            raise AssertionError(site.need)
    for op in ops if site.need != "send" else ():
        value = _apply(op, value, d, junk)
    wrong = [value[i][c] != want for i in range(d) for c in range(d) if (want := expected[i][c]) is not None]
    name = site.rule
    solver.track(name, z3.Or(*wrong) if wrong else z3.BoolVal(False))
    answer = solver.check()
    if answer.result == "unknown":
        return Obligation(name, Condition.GRADIENT_INTEGRITY, Status.UNKNOWN, answer.reason, answer.seconds), []
    if answer.result == "unsat" or answer.model is None:
        return Obligation(name, Condition.GRADIENT_INTEGRITY, Status.PROVED, "", answer.seconds, answer.core), []
    model = answer.model
    bad = next(
        (i, c)
        for i in range(d)
        for c in range(d)
        if (e := expected[i][c]) is not None and z3.is_true(model.eval(value[i][c] != e, model_completion=True))
    )
    i, c = bad
    got = _show(model.eval(value[i][c], model_completion=True))
    target = expected[i][c]
    assert target is not None
    want = _show(model.eval(target, model_completion=True))
    listed = [str(op) for op in ops]
    defect = _defect(site, ops)
    witness: dict[str, Any] = {
        "defect": defect,
        "phase": site.phase.value,
        "activation": site.what,
        "degree": d,
        "device": i,
        "chunk": c,
        "device_value": got,
        "single_device": want,
        "start": {
            f"{j}.{k}": _show(model.eval(start[j][k], model_completion=True)) for j in range(d) for k in range(d)
        },
        "ops": listed,
    }
    where = f"device {i} reads {got}" if site.need == "send" else f"device {i} holds {got} of chunk {c}"
    explanation = (
        f"A.{site.group.name} along {site.axis.value} in {site.phase.value}: {site.what}: {defect}; "
        f"{where} where single-device training has {want}"
    )
    return (
        Obligation(name, Condition.GRADIENT_INTEGRITY, Status.REFUTED, "", answer.seconds),
        [
            Violation(
                name,
                Condition.GRADIENT_INTEGRITY,
                State.ACTIVATIONS.value,
                site.group.name,
                site.axis.value,
                explanation,
                witness,
            )
        ],
    )


def _apply(op: Op, value: list[list[z3.ArithRef]], d: int, junk: Any) -> list[list[z3.ArithRef]]:
    scale = z3.RealVal(1) / d if op.reduce is Reduce.MEAN else z3.RealVal(1)
    match op.kind:
        case OpKind.ALL_REDUCE:
            sums = [z3.Sum(*(value[j][c] for j in range(d))) * scale for c in range(d)]
            return [list(sums) for _ in range(d)]
        case OpKind.REDUCE_SCATTER:
            return [
                [z3.Sum(*(value[j][c] for j in range(d))) * scale if c == i else junk() for c in range(d)]
                for i in range(d)
            ]
        case OpKind.ALL_GATHER:
            return [[value[c][c] for c in range(d)] for _ in range(d)]
        case OpKind.ALL_TO_ALL:
            return [[value[c][i] for c in range(d)] for i in range(d)]
        case _:
            raise AssertionError(op.kind)


def _defect(site: Site, ops: Sequence[Op]) -> str:
    kind = site.kind.value.replace("_", "-")
    if not ops:
        return f"the program has no {kind} of A.{site.group.name} along {site.axis.value} in {site.phase.value}"
    if any(op.reduce is Reduce.MEAN for op in ops):
        return f"the {kind} averages partial sums that must be added"
    if len(ops) > 1:
        return f"{len(ops)} {kind}s of A.{site.group.name} run at each site: the exchange is applied again"
    return f"the {kind} does not complete the value"


def _show(v: z3.ExprRef) -> int | str:
    text = str(v)
    try:
        return int(text)
    except ValueError:
        return text


def decide_activation_exchange(
    program: StepProgram, model: Model, timeout_ms: int
) -> tuple[list[Obligation], list[Violation]]:
    """Every site the placement needs; one obligation each."""
    obligations: list[Obligation] = []
    violations: list[Violation] = []
    for site in required_sites(program, model):
        ob, found = decide_site(program, site, timeout_ms)
        obligations.append(ob)
        violations += found
    return obligations, violations


__all__ = ["MAX_DEVICES", "Site", "decide_activation_exchange", "decide_site", "required_sites"]
