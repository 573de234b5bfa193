"""Necessity obligations (proofs/necessity.md).

For each kind of violation: a library program mutated to commit exactly that violation (the
mutation is on the derived ``StepProgram`` or its placement, then translated), z3 constructs
data and initial weights for linear regression trained with plain SGD on which the distributed
step differs from the single-device step, and the numpy check (``proofs/_numeric.py``) replays
the counterexample in exact arithmetic and confirms the difference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import sympy as sp
import z3

from formal._placement import Entry, Options
from formal._program import Op, StepProgram, derive_program
from formal._strategies import LIBRARY, Composition
from formal._verdict import Status
from formal._vocab import (
    EMBEDDING,
    EXPERTS,
    MLP,
    NORM,
    Axis,
    Group,
    Mode,
    OpKind,
    Phase,
    Reduce,
    State,
)
from proofs._machine import (
    AxisClass,
    Coords,
    Junk,
    Mesh,
    MeshAxis,
    Program,
    constant_features,
    devices,
    elements,
    run,
)
from proofs._numeric import LR, LinearModel, distributed
from proofs._obligation import Obligation, Outcome
from proofs._solver import Answer, check
from proofs._translate import translate
from proofs.sufficiency import DENSE, MOE

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741


NO_OPTIONS = Options()


@dataclass(frozen=True)
class Violation:
    """One kind of violation: the condition it breaks and a program that commits it."""

    key: str
    condition: str
    description: str
    build: Callable[[], tuple[Mesh, Program]]


def _program(
    names: tuple[tuple[str, int], ...],
    group: Group,
    options: Options = NO_OPTIONS,
    mutate: Callable[[StepProgram], StepProgram] | None = None,
    entry: tuple[str, State, Entry] | None = None,
) -> tuple[Mesh, Program]:
    strategies = []
    for name, degree in names:
        s = LIBRARY[name]().with_degree(degree)
        if entry is not None and entry[0] == name:
            s = s.with_entry(entry[1], None, entry[2])
        strategies.append(s)
    model = MOE if any(n == "ep" for n, _ in names) else DENSE
    pl = Composition(tuple(strategies), options).placement(model)
    prog = derive_program(pl, model)
    if mutate is not None:
        prog = mutate(prog)
    t = translate(prog, group)
    return t.mesh, t.program


def _without(pred: Callable[[Op], bool]) -> Callable[[StepProgram], StepProgram]:
    def mutate(prog: StepProgram) -> StepProgram:
        kept = [op for op in prog.ops if not pred(op)]
        assert len(kept) < len(prog.ops), "the mutation must remove an op"
        return prog.with_ops(kept)

    return mutate


def _plus(make: Callable[[StepProgram], Op]) -> Callable[[StepProgram], StepProgram]:
    def mutate(prog: StepProgram) -> StepProgram:
        return prog.with_ops((*prog.ops, make(prog)))

    return mutate


def _duplicate(pred: Callable[[Op], bool]) -> Callable[[StepProgram], StepProgram]:
    def mutate(prog: StepProgram) -> StepProgram:
        ops: list[Op] = []
        for op in prog.ops:
            ops.append(op)
            if pred(op):
                ops.append(op)
        assert len(ops) > len(prog.ops)
        return prog.with_ops(ops)

    return mutate


def _grad_op(kind: OpKind, group: Group, axis: Axis) -> Callable[[Op], bool]:
    return lambda op: op.kind is kind and op.state is G and op.group == group and op.axis is axis


VIOLATIONS: tuple[Violation, ...] = (
    Violation(
        "missing_reduction",
        "gradient integrity",
        "LayerNorm gradients under sequence parallelism not all-reduced across tp (Megatron-LM #1446)",
        lambda: _program(
            (("tp", 2),), NORM, Options(sequence_parallel=True), _without(_grad_op(OpKind.ALL_REDUCE, NORM, Axis.TP))
        ),
    ),
    Violation(
        "duplicated_reduction",
        "gradient integrity",
        "the tied-embedding all-reduce between first and last pipeline stage issued twice",
        lambda: _program(
            (("pp", 2),), EMBEDDING, Options(), _duplicate(_grad_op(OpKind.ALL_REDUCE, EMBEDDING, Axis.PP))
        ),
    ),
    Violation(
        "reduction_on_complete_axis",
        "gradient integrity",
        "LayerNorm gradients (complete on every tp rank without sequence parallelism) summed across tp",
        lambda: _program(
            (("tp", 2),),
            NORM,
            Options(),
            _plus(
                lambda prog: Op(OpKind.ALL_REDUCE, G, NORM, Axis.TP, Phase.GRAD_SYNC, sp.Integer(1), reduce=Reduce.SUM)
            ),
        ),
    ),
    Violation(
        "double_averaging",
        "gradient integrity",
        "data-parallel gradients all-reduced with mean and then divided by the degree again",
        lambda: _program(
            (("dp", 2),),
            MLP,
            Options(),
            _plus(lambda prog: Op(OpKind.SCALE, G, MLP, Axis.DP, Phase.GRAD_SYNC, scale=sp.Rational(1, 2))),
        ),
    ),
    Violation(
        "expert_not_normalised",
        "gradient integrity",
        "expert gradients not divided by the ep size (Megatron-LM PR #5956)",
        lambda: _program(
            (("ep", 2),), EXPERTS, Options(), _without(lambda op: op.kind is OpKind.SCALE and op.group == EXPERTS)
        ),
    ),
    Violation(
        "stale_replica_read",
        "state consistency (agreement)",
        "ZeRO-1 without the all-gather that refreshes parameter replicas after the sharded update",
        lambda: _program(
            (("zero1", 2),),
            MLP,
            Options(),
            _without(lambda op: op.kind is OpKind.ALL_GATHER and op.state is P and op.phase is Phase.REFRESH),
        ),
    ),
    Violation(
        "misaligned_shards",
        "state consistency (alignment)",
        "ZeRO-2 with optimizer shards cut at another offset than gradient shards",
        lambda: _program((("zero2", 2),), MLP, Options(), None, ("zero2", O, Entry(Mode.SHARDED, offset=1))),
    ),
    Violation(
        "sharded_read_without_gather",
        "state consistency (gather before use)",
        "ZeRO-3 parameters read in the forward without the all-gather",
        lambda: _program(
            (("zero3", 2),),
            MLP,
            Options(),
            _without(lambda op: op.kind is OpKind.ALL_GATHER and op.state is P and op.phase is Phase.FORWARD),
        ),
    ),
    Violation(
        "offloaded_not_fetched",
        "state consistency (coverage)",
        "offloaded parameters read in the forward without the host-to-device copy",
        lambda: _program(
            (("dp", 2),),
            MLP,
            Options(offload_parameters=True),
            _without(lambda op: op.kind is OpKind.HOST_TO_DEVICE and op.state is P and op.phase is Phase.FORWARD),
        ),
    ),
    Violation(
        "missing_kv_exchange",
        "gradient integrity (the loss itself)",
        "context parallelism without the key/value exchange: each block attends only to itself",
        lambda: _program(
            (("cp", 2),),
            MLP,
            Options(),
            _without(lambda op: op.state is A and op.axis is not None and op.axis.kind.splits_sequence),
        ),
    ),
    Violation(
        "indivisible_shards",
        "state consistency (coverage)",
        "a tp-sharded tensor whose size does not divide by tp: floor-sized shards lose the remainder "
        "(Megatron-LM #1754)",
        lambda: ((MeshAxis(AxisClass.COMPUTE, 2, elements=3),), _program((("tp", 2),), MLP, Options())[1]),
    ),
)


def _fraction(value: z3.ExprRef) -> Fraction:
    assert z3.is_rational_value(value), value
    return Fraction(value.numerator_as_long(), value.denominator_as_long())


def counterexample(
    mesh: Mesh, program: Program
) -> tuple[Answer, str, dict[tuple[Coords, Coords], Fraction], dict[Coords, Fraction]]:
    """z3: targets and initial weights on which one SGD step of ``program`` differs somewhere."""
    model = LinearModel(mesh)
    elems = elements(mesh)
    y = {(k, j): z3.Real(f"y{list(k)}{list(j)}") for k in model.samples() for j in model.parts()}
    w = {e: z3.Real(f"w0{list(e)}") for e in elems}
    zero = {e: z3.RealVal(0) for e in elems}
    every = {(i, e): w[e] for i in devices(mesh) for e in elems}
    zeros = {(i, e): z3.RealVal(0) for i in devices(mesh) for e in elems}

    def contribution(k, e, j, vf, vb, block, visible):  # type: ignore[no-untyped-def]
        return model.contribution(k, e, j, vf, vb, block, visible, y)

    def sgd(p: z3.ArithRef, o: z3.ArithRef, g: z3.ArithRef) -> tuple[z3.ArithRef, z3.ArithRef]:
        return p - z3.RealVal(LR) * g, o

    step = run(mesh, constant_features(program), contribution, sgd, Junk(free=False), w, zero, every, zeros, dict(w))
    result = check({"distributed_differs_from_single_device": z3.Not(step.goal())})
    if result.answer is not Answer.SAT or result.model is None:
        return result.answer, result.reason_unknown, {}, {}
    m = result.model
    ys = {key: _fraction(m.eval(v, model_completion=True)) for key, v in y.items()}
    ws = {e: _fraction(m.eval(v, model_completion=True)) for e, v in w.items()}
    return Answer.SAT, "", ys, ws


def necessity_obligation(violation: Violation) -> Outcome:
    mesh, program = violation.build()
    answer, reason, ys, ws = counterexample(mesh, program)
    if answer is Answer.UNKNOWN:
        return Outcome(Status.UNKNOWN, reason_unknown=reason)
    if answer is Answer.UNSAT:
        return Outcome(Status.REFUTED, "z3 found no data on which the violating program differs")
    outcome = distributed(LinearModel(mesh), program, ys, ws)
    if outcome.differs is None:
        return Outcome(Status.REFUTED, "z3's counterexample did not reproduce in the numpy check")
    data = ", ".join(f"w0{list(e)}={v}" for e, v in ws.items())
    return Outcome(Status.PROVED, f"{mesh_label(mesh)}; {data}; numpy: {outcome.differs}")


def mesh_label(mesh: Mesh) -> str:
    return "x".join(str(a) for a in mesh)


def obligations() -> list[Obligation]:
    return [
        Obligation(
            f"necessity.{v.key}",
            f"{v.condition} is necessary: {v.description}; some model, data and SGD step make the result differ",
            "z3+numpy-check",
            functools.partial(necessity_obligation, v),
        )
        for v in VIOLATIONS
    ]


def violation_programs() -> dict[str, tuple[Mesh, Program]]:
    return {v.key: v.build() for v in VIOLATIONS}
