"""The rooted ``reduce`` collective (torch.distributed.reduce): readable in the TOML op language,
costed as (n-1)/n of the buffer per device, and refused in one line by the z3 verdict and the
simulator, which do not model a reduction that only its destination receives.

The cost is the bandwidth lower bound of reduce-to-one in Chan, Heimlich, Purkayastha and van de
Geijn 2007 ("Collective communication: theory, practice, and experience", Concurrency and
Computation 19(13), the lower bounds table: (p-1)/p n beta), the same share as a reduce-scatter.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from checker._parse import parse
from checker._simulate import reference_model
from checker._toml import loads
from checker.cli import main
from formal._costs import communication, ring_factor
from formal._model import PRECISIONS
from formal._program import Op, StepProgram, derive_program
from formal._reference import ReferenceModel
from formal._simulator import simulate_program
from formal._smt import decide
from formal._strategies import Composition
from formal._verdict import Status
from formal._vocab import Axis, OpKind, Phase, Reduce, State
from formal.errors import InputError

pytestmark = pytest.mark.timeout(120)

REDUCE_DP = """
[[program]]
op = "reduce"
axis = "dp"
"""


def degrees() -> st.SearchStrategy[int]:
    return st.integers(2, 64)


def compositions() -> st.SearchStrategy[str]:
    return st.sampled_from(["dp2", "dp4", "zero12", "zero24", "fsdp2", "tp2xdp2"])


@given(degrees())
def test_reduce_moves_n_minus_one_over_n(n: int) -> None:
    # Chan et al. 2007: reduce-to-one's bandwidth term is (p-1)/p n, as a reduce-scatter's.
    assert ring_factor(OpKind.REDUCE, n) == Fraction(n - 1, n)
    assert ring_factor(OpKind.REDUCE, n) == ring_factor(OpKind.REDUCE_SCATTER, n)
    assert ring_factor(OpKind.REDUCE, n) * 2 == ring_factor(OpKind.ALL_REDUCE, n)


def test_reduce_is_a_rooted_collective_not_a_reduction() -> None:
    assert OpKind.REDUCE.is_collective and OpKind.REDUCE.is_rooted
    assert not OpKind.REDUCE.is_reduction  # only the destination receives the reduced value
    assert not any(k.is_rooted for k in OpKind if k is not OpKind.REDUCE)


def test_toml_reads_a_reduce_op() -> None:
    user = loads(REDUCE_DP)
    comp = parse("dp4")
    model = reference_model(comp).transformer()
    program = user.program_for(comp.placement(model), model)
    ops = [op for op in program.ops if op.kind is OpKind.REDUCE]
    assert ops and all(op.state is State.GRADIENTS and op.axis is Axis.DP for op in ops)
    assert all(op.phase is Phase.GRAD_SYNC and op.reduce is Reduce.MEAN for op in ops)  # mean along dp
    # Its traffic: (4-1)/4 of each group's gradient bytes per device.
    precision = PRECISIONS["fp32-adam"]
    for t in communication(program, precision):
        if t.kind is OpKind.REDUCE:
            assert t.bytes == t.elements * precision.wire_bytes_of(State.GRADIENTS) * Fraction(3, 4) * t.count


def test_toml_reduce_needs_an_axis() -> None:
    from formal.errors import StrategyFileError

    with pytest.raises(StrategyFileError, match="a reduce needs axis"):
        loads('[[program]]\nop = "reduce"\n')


def _with_reduce(text: str, at: int) -> tuple[Composition, ReferenceModel, StepProgram]:
    """``text``'s derived program on the reference model with a gradient reduce inserted at ``at``."""
    comp = parse(text)
    ref = reference_model(comp)
    model = ref.transformer()
    program = derive_program(comp.placement(model), model)
    reduce = Op(OpKind.REDUCE, State.GRADIENTS, program.ops[-1].group, Axis.DP, Phase.GRAD_SYNC, 8)
    k = at % (len(program.ops) + 1)
    return comp, ref, program.with_ops((*program.ops[:k], reduce, *program.ops[k:]))


@given(compositions(), st.integers(0, 10**6))
def test_z3_verdict_refuses_a_reduce(text: str, at: int) -> None:
    comp, ref, program = _with_reduce(text, at)
    with pytest.raises(InputError, match="reduce to one destination rank is not modelled by the z3 verdict"):
        decide(comp, program, ref.transformer())


@given(compositions(), st.integers(0, 10**6))
def test_simulator_refuses_a_reduce(text: str, at: int) -> None:
    _, ref, program = _with_reduce(text, at)
    with pytest.raises(InputError, match="not modelled by the simulator"):
        simulate_program(program, ref)


def test_programs_without_a_reduce_are_judged_as_before() -> None:
    # The refusal fires on the rooted kind only: the derived dp2 program is still proved.
    comp = parse("dp2")
    model = reference_model(comp).transformer()
    program = derive_program(comp.placement(model), model)
    assert not any(op.kind is OpKind.REDUCE for op in program.ops)
    assert decide(comp, program, model).status is Status.PROVED


def test_cli_refuses_a_reduce_program_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "reduce.toml"
    path.write_text(REDUCE_DP, encoding="utf-8")
    r = CliRunner().invoke(main, ["check", "dp2", "--strategies", str(path)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert "reduce" in r.output and "not modelled" in r.output
