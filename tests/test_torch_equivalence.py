"""Equivalence on a real engine: gloo processes against one device, bit for bit.

Valid compositions match single-device training exactly; faults injected into the PyTorch
run diverge; z3's verdict on the program the run executes says which is which.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from checker._parse import parse
from checker._torch._exact import EXACT, Fault, Outcome, equivalence, reference_is_exact
from formal._verdict import Status

_RUNS: dict[int, list[Outcome]] = {}


def outcomes(world: int) -> list[Outcome]:
    if world not in _RUNS:
        _RUNS[world] = equivalence(world)
    return _RUNS[world]


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_the_reference_arithmetic_is_exact(replicas: int) -> None:
    """The premise: float32 training equals float64 training, so no sum was rounded."""
    assert reference_is_exact(EXACT, replicas)


@pytest.mark.parametrize("world", [2, 4])
def test_valid_compositions_match_one_device_bit_for_bit(world: int) -> None:
    valid = [o for o in outcomes(world) if o.case.fault is Fault.NONE]
    names = {parse(o.case.composition, devices=world).strategies[0].name for o in valid}
    assert names >= {"dp", "fsdp", "fsdp-sgo", "zero1", "tp"}
    for o in valid:
        assert o.matches and o.ranks_agree and o.max_difference == 0.0, o
        assert o.z3 in (None, Status.PROVED), o


@pytest.mark.parametrize("world", [2, 4])
def test_injected_faults_diverge_as_z3_predicts(world: int) -> None:
    broken = [o for o in outcomes(world) if o.case.fault is not Fault.NONE]
    assert {o.case.fault for o in broken} == {Fault.SKIP_REDUCTION, Fault.NO_REFRESH}
    for o in broken:
        assert not o.matches and o.max_difference > 0, o
        assert not o.ranks_agree, o  # replicas drift apart: each rank kept its own value
        assert o.z3 in (None, Status.REFUTED), o
        assert o.expected, o
