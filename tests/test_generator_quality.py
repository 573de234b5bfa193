"""The exploring generators reach every known class of disagreement (tests/strategies_explore.py).

One bounded sweep over ``explorations()`` (a fixed seed, at most ``BUDGET`` draws, generation
only: nothing is shrunk) must produce a member of each class 1-8, checked by the class's
membership predicate, which is written from the class's definition, and must apply every change
``programs()`` registers. The predicates are themselves checked against programs
whose membership follows from their definition alone: the derived programs of library
compositions belong to no class (except ZeRO-2 with parameter offload, class 8), and one
hand-made program per class belongs to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import Phase as HPhase
from strategies_explore import KNOWN_CLASSES, Explored, explorations, known_classes
from strategies_sim import CHANGES

from checker._parse import parse
from checker._toml import loads
from formal._program import Op, StepProgram, derive_program
from formal._reference import ReferenceModel
from formal._simulator import reference_for
from formal._vocab import ATTENTION, Axis, OpKind, Phase, Reduce, State
from formal.errors import StrategyFileError

BUDGET = 1_500


@dataclass
class Sweep:
    members: dict[str, Explored] = field(default_factory=dict)
    changes: set[str] = field(default_factory=set)
    drawn: int = 0

    @property
    def complete(self) -> bool:
        return set(self.members) == set(KNOWN_CLASSES) and self.changes == set(CHANGES)


class _Done(Exception):
    pass


@pytest.fixture(scope="module")
def sweep() -> Sweep:
    out = Sweep()

    @settings(
        max_examples=BUDGET,
        database=None,
        derandomize=True,
        deadline=None,
        phases=[HPhase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(explorations())
    def draw(e: Explored) -> None:
        out.drawn += 1
        for name in known_classes(e):
            out.members.setdefault(name, e)
        out.changes.update(e.changes)
        if out.complete:
            raise _Done

    with contextlib.suppress(_Done):
        draw()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(KNOWN_CLASSES))
def test_the_exploring_generators_produce_a_member_of_each_known_class(sweep: Sweep, name: str) -> None:
    description, member = KNOWN_CLASSES[name]
    assert name in sweep.members, f"class {name} ({description}) not reached in {sweep.drawn} draws"
    assert member(sweep.members[name])


def test_every_change_is_drawn(sweep: Sweep) -> None:
    """Each registered change of ``programs()`` applies to some explored program."""
    assert sweep.changes == set(CHANGES), (set(CHANGES) - sweep.changes, sweep.drawn)


def _explored(text: str, toml: str = "", change: Callable[[StepProgram], StepProgram] | None = None) -> Explored:
    factories = loads(toml).factories() if toml else None
    composition = parse(text, factories)
    model = reference_for(composition, ReferenceModel())
    transformer = model.transformer()
    program = derive_program(composition.placement(transformer), transformer)
    if change is None:
        return Explored(composition, model, program, toml=toml)
    return Explored(composition, model, change(program), ("hand-made",), "hand-made", toml)


LIBRARY_DERIVED = [
    "dp2xm2",
    "zero22xm2",
    "zero32xtp2xm2",
    "fsdp2xtp2xpp2xm2",
    "tp2xspxdp2xm2",
    "cp2xdp2xm2",
    "hsdp2xdpr2xm2",
    "zero12xoffload",
    "zero32xoffload-params",
]


@pytest.mark.parametrize("text", LIBRARY_DERIVED)
def test_derived_library_programs_belong_to_no_known_class(text: str) -> None:
    assert known_classes(_explored(text)) == ()


def test_zero2_with_parameter_offload_is_class_8_only_when_derived() -> None:
    derived = _explored("zero22xoffload-params")
    assert known_classes(derived) == ("8",)
    assert "8" not in known_classes(replace(derived, changes=("drop",)))


def _with(program: StepProgram, op: Op, at: int | None = None) -> StepProgram:
    ops = list(program.ops)
    ops.insert(len(ops) if at is None else at, op)
    return program.with_ops(ops)


def _first(program: StepProgram, kind: OpKind, state: State = State.GRADIENTS) -> int:
    return next(i for i, op in enumerate(program.ops) if op.kind is kind and op.state is state)


def _gradient_broadcast_before_reduction(program: StepProgram) -> StepProgram:
    i = _first(program, OpKind.ALL_REDUCE)
    return _with(program, Op(OpKind.BROADCAST, State.GRADIENTS, ATTENTION, Axis.DP, Phase.GRAD_SYNC), i)


def _gradient_op_in(phase: Phase) -> Callable[[StepProgram], StepProgram]:
    def change(program: StepProgram) -> StepProgram:
        ops = list(program.ops)
        i = _first(program, OpKind.ALL_REDUCE)
        ops[i] = replace(ops[i], phase=phase)
        return program.with_ops(ops)

    return change


def _parameter_scale(program: StepProgram) -> StepProgram:
    return _with(program, Op(OpKind.SCALE, State.PARAMETERS, ATTENTION, None, Phase.OPTIMIZER, scale=sp.Integer(2)))


def _one_scale_for_two_sums(program: StepProgram) -> StepProgram:
    ops = [
        replace(op, reduce=Reduce.SUM) if op.kind is OpKind.ALL_REDUCE and op.group == ATTENTION else op
        for op in program.ops
    ]
    scale = Op(OpKind.SCALE, State.GRADIENTS, ATTENTION, None, Phase.GRAD_SYNC, scale=sp.Rational(1, 4))
    return _with(program.with_ops(ops), scale, _first(program, OpKind.OPTIMIZER_STEP, State.OPTIMIZER))


def _tp_gradient_all_reduce(program: StepProgram) -> StepProgram:
    op = Op(OpKind.ALL_REDUCE, State.GRADIENTS, ATTENTION, Axis.TP, Phase.GRAD_SYNC, reduce=Reduce.SUM)
    return _with(program, op, _first(program, OpKind.OPTIMIZER_STEP, State.OPTIMIZER))


def _scale_without_axis(program: StepProgram) -> StepProgram:
    ops = list(program.ops)
    i = _first(program, OpKind.ALL_REDUCE)
    ops[i] = replace(ops[i], reduce=Reduce.SUM)
    ops.insert(i + 1, Op(OpKind.SCALE, State.GRADIENTS, ops[i].group, None, Phase.GRAD_SYNC, scale=sp.Rational(1, 2)))
    return program.with_ops(ops)


REPLICATED_COMPUTE = '[strategies.rep-tp]\naxis = "tp"\nP = "R"\ncompute_sharded = ["attention", "mlp"]\n'
SAME_SAMPLES = '[strategies.same-dp]\naxis = "dp"\nP = "R"\nA = "R"\n'
HAND_MADE = {
    "1": ("dp2", "", _gradient_broadcast_before_reduction),
    "2": ("dp2xm2", "", _gradient_op_in(Phase.FORWARD)),
    "3": ("dp2xm2", "", _gradient_op_in(Phase.BACKWARD)),
    "4": ("rep-tp2", REPLICATED_COMPUTE, None),
    "5": ("same-dp2", SAME_SAMPLES, None),
    "6": ("dp2", "", _parameter_scale),
    "7": ("dp2xcp2", "", _one_scale_for_two_sums),
    "9": ("m-dp2", '[strategies.m-dp]\naxis = "dp"\nP = "M"\n', None),
    "11": ("dp2", "", _scale_without_axis),
    "14": ("tp2", "", _tp_gradient_all_reduce),
}


@pytest.mark.parametrize("name", sorted(HAND_MADE))
def test_a_hand_made_member_of_each_class_is_recognised(name: str) -> None:
    text, toml, change = HAND_MADE[name]
    assert name in known_classes(_explored(text, toml, change))


def test_class_10_is_gone_at_its_source() -> None:
    """Class 10 (tp activation sums over blocks no rank splits) came from the derived program; a
    step-program file cannot add activation collectives, so it has no hand-made member. The
    derivation now emits no tp sums when nothing is computed split along tp."""
    explored = _explored("plain-tp2", '[strategies.plain-tp]\naxis = "tp"\nP = "R"\nO = "R"\n', None)
    assert "10" not in known_classes(explored)
    assert not [op for op in explored.program.ops if op.state is State.ACTIVATIONS and op.axis is not None]


def test_class_12_is_gone_at_its_source() -> None:
    """Class 12 (a sequence-region group computed split along tp under sp) needs a norm or a
    row-parallel bias computed split along tp, which has no tensor-parallel dimension: a
    strategy file's "all" along tp now means the splittable groups, and naming a norm is
    refused."""
    toml = '[strategies.sp-tp]\naxis = "tp"\nP = "S"\nO = "S"\nG = "S"\ncompute_sharded = "all"\n'
    assert "12" not in known_classes(_explored("sp-tp2xsp", toml, None))
    with pytest.raises(StrategyFileError, match="norm cannot be computed split along tp"):
        loads(toml.replace('"all"', '["attention", "mlp", "norm"]'))


def test_the_gradient_op_classes_need_several_micro_batches() -> None:
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert known_classes(_explored("dp2", "", _gradient_op_in(phase))) == ()
