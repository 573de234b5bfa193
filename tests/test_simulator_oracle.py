"""The executable reference as an oracle: defects it had, the richer model, and disagreement never silent.

Every simulation here is bit-for-bit (``Arithmetic.FIELD``) against single-device training of the
same reference model (``formal._reference.train_single_device``), which is the expected value.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from checker._parse import parse
from formal._program import StepProgram, derive_program
from formal._reference import ReferenceModel
from formal._simulator import reference_for, simulate_program
from formal._smt import decide
from formal._strategies import Composition
from formal._verdict import Status
from formal._vocab import OpKind, State


def _program(text: str, model: ReferenceModel | None = None) -> tuple[Composition, ReferenceModel, StepProgram]:
    composition = parse(text)
    model = model or reference_for(composition)
    transformer = model.transformer()
    return composition, model, derive_program(composition.placement(transformer), transformer)


def _all_reduce_as_reduce_scatter_then_all_gather(program: StepProgram) -> StepProgram:
    """Every gradient all-reduce written as a ring all-reduce is run: reduce-scatter, then all-gather."""
    ops = []
    for op in program.ops:
        if op.kind is OpKind.ALL_REDUCE and op.state is State.GRADIENTS:
            ops += [replace(op, kind=OpKind.REDUCE_SCATTER), replace(op, kind=OpKind.ALL_GATHER, reduce=None)]
        else:
            ops.append(op)
    return program.with_ops(ops)


@pytest.mark.parametrize("text", ["dp2", "dp2xtp2xsp", "pp2xdp2"])
def test_a_gradient_reduce_scatter_then_all_gather_trains_like_one_device(text: str) -> None:
    """An all-reduce is a reduce-scatter followed by an all-gather (the ring algorithm, Patarasuk and
    Yuan 2009; NCCL's ring all-reduce): the program is valid. The simulator's all-gather of G used to
    leave the gathered shards unmarked, and the free outside the holding zeroed them; z3 was right."""
    composition, model, program = _program(text)
    ring = _all_reduce_as_reduce_scatter_then_all_gather(program)
    assert any(op.kind is OpKind.ALL_GATHER and op.state is State.GRADIENTS for op in ring.ops)
    result = simulate_program(ring, model)
    assert result.matches, str(result.divergence)
    assert decide(composition, ring, model.transformer()).status is Status.PROVED


def test_a_gradient_all_gather_without_its_reduce_scatter_still_diverges() -> None:
    """The fix marks only what the sender held as current: gathering unreduced summands is wrong."""
    _, model, program = _program("dp2")
    ring = _all_reduce_as_reduce_scatter_then_all_gather(program)
    no_scatter = ring.with_ops(
        op for op in ring.ops if not (op.kind is OpKind.REDUCE_SCATTER and op.state is State.GRADIENTS)
    )
    assert not simulate_program(no_scatter, model).matches
