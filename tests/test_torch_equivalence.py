"""Equivalence on a real engine: gloo processes against one device, bit for bit.

Valid compositions match single-device training exactly; faults injected into the PyTorch
run diverge; z3's verdict on the program the run executes says which is which.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from checker._parse import parse
from checker._torch._engine import Engine, engine_for
from checker._torch._exact import (
    EXACT,
    Fault,
    Outcome,
    Setup,
    cases,
    config_for,
    equivalence,
    reference_is_exact,
    setup_for,
)
from formal._placement import Schedule
from formal._verdict import Status

_RUNS: dict[int, list[Outcome]] = {}


def outcomes(world: int) -> list[Outcome]:
    if world not in _RUNS:
        _RUNS[world] = equivalence(world)
    return _RUNS[world]


def _setups() -> list[Setup]:
    found = {setup_for(parse(c.composition, devices=w), w) for w in (2, 4) for c in cases(w)}
    return sorted(found, key=lambda s: (s.cfg.layers, s.replicas, s.micro_batches))


@pytest.mark.parametrize("setup", _setups(), ids=lambda s: f"layers{s.cfg.layers}-r{s.replicas}-m{s.micro_batches}")
def test_the_reference_arithmetic_is_exact(setup: Setup) -> None:
    """The premise, for every reference a run is compared with: float32 training equals
    float64 training, so no sum was rounded."""
    assert reference_is_exact(setup.cfg, setup.replicas, setup.micro_batches)


@pytest.mark.parametrize("world", [2, 4])
def test_every_case_parses_to_its_engine(world: int) -> None:
    """The case list covers every engine the world size allows (FSDP+TP, HSDP, PP+DDP, PP+FSDP need 4
    ranks; FSDP1 is asked for by a case, never chosen by ``engine_for``), sequence parallelism and
    both pipeline schedules."""
    valid = [c for c in cases(world) if c.fault is Fault.NONE]
    comps = [parse(c.composition, devices=world) for c in valid]
    engines = {Engine.FSDP1 if case.fsdp1 else engine_for(c) for case, c in zip(valid, comps, strict=True)}
    two_d = {Engine.FSDP_TP, Engine.HSDP, Engine.PIPELINE_FSDP, Engine.PIPELINE_DDP}
    assert engines == (set(Engine) if world == 4 else set(Engine) - two_d)
    assert any(c.options.sequence_parallel and engine_for(c) is Engine.TP for c in comps)
    pipes = [c for c in comps if engine_for(c) is Engine.PIPELINE]
    assert {c.options.schedule for c in pipes} == {Schedule.GPIPE, Schedule.ONE_F_ONE_B}
    for c in pipes:  # several micro-batches, whole layers per stage, the exact premise kept
        assert c.options.micro_batches > 1 and config_for(c).layers % world == 0
        assert config_for(c).exact and config_for(c).hidden == EXACT.hidden


@pytest.mark.parametrize("world", [2, 4])
def test_valid_compositions_match_one_device_bit_for_bit(world: int) -> None:
    valid = [o for o in outcomes(world) if o.case.fault is Fault.NONE]
    assert len(valid) == sum(c.fault is Fault.NONE for c in cases(world))
    for o in valid:
        assert o.premise, o
        assert o.matches and o.ranks_agree and o.max_difference == 0.0, o
        assert o.z3 in (None, Status.PROVED), o
        # Every parameter lives on several ranks except in a pipeline (one stage each).
        pipeline = engine_for(parse(o.case.composition, devices=world)) is Engine.PIPELINE
        assert o.shared != pipeline, o


@pytest.mark.parametrize("world", [2, 4])
def test_injected_faults_diverge_as_z3_predicts(world: int) -> None:
    broken = [o for o in outcomes(world) if o.case.fault is not Fault.NONE]
    expected = {Fault.SKIP_REDUCTION, Fault.NO_REFRESH, Fault.SKIP_SP_REDUCTION, Fault.NO_BACKWARD_SEND}
    assert {o.case.fault for o in broken} == (expected | {Fault.SKIP_DPR_REDUCTION} if world == 4 else expected)
    for o in broken:
        assert o.premise, o
        assert not o.matches and o.max_difference > 0, o
        if o.shared:  # a pipeline's stages hold different parameters: nothing to drift apart
            assert not o.ranks_agree, o  # replicas drift apart: each rank kept its own value
        assert o.z3 in (None, Status.REFUTED), o
        assert o.expected, o
