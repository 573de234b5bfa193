"""The reference trainer and the N-device simulator on their own (no z3).

Comparisons: ``Arithmetic.FIELD`` tests are bit-for-bit (exact residues); the ``FLOAT64`` tests say
so, and compare within ``FLOAT_TOLERANCE`` (relative, 2^-30).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from hypothesis import given
from strategies_sim import compositions

from checker._parse import parse
from formal._program import Op, StepProgram, derive_program
from formal._reference import (
    PRIME,
    Arithmetic,
    Numbers,
    Optimizer,
    OptimizerKind,
    ReferenceModel,
    initial_parameters,
    loss_and_gradients,
    make_data,
    train_single_device,
)
from formal._simulator import reference_for, simulate, simulate_program
from formal._vocab import EMBEDDING_IO, OUTPUT_IO, Axis, Group, OpKind, Phase, Reduce, State
from formal.errors import InputError, SimulationError

FIELD, FLOAT = Numbers(Arithmetic.FIELD), Numbers(Arithmetic.FLOAT64)


def test_reference_gradients_are_the_derivative_of_the_loss() -> None:
    """float64, central differences on random real weights (tolerance 1e-6)."""
    model = ReferenceModel(layers=2, hidden=4, heads=2, ffn=4, vocab=4, seq=4, tied=True)
    rng = np.random.default_rng(1)
    p = {g: rng.normal(size=model.size(g)) * 0.5 for g in model.groups()}
    batch = make_data(model, 2, 1, FLOAT, 0)[0]
    _, grads = loss_and_gradients(model, p, batch, FLOAT)
    for g in model.groups():
        for i in rng.choice(model.size(g), size=min(6, model.size(g)), replace=False):
            up = {k: v.copy() for k, v in p.items()}
            down = {k: v.copy() for k, v in p.items()}
            up[g][i] += 1e-6
            down[g][i] -= 1e-6
            rise = loss_and_gradients(model, up, batch, FLOAT)[0] - loss_and_gradients(model, down, batch, FLOAT)[0]
            numeric = cast(float, rise / 2e-6)  # the loss is a scalar, a numpy float64
            assert abs(numeric - grads[g][i]) < 1e-6 * max(1.0, abs(numeric))


def test_field_arithmetic_is_exact_rational_arithmetic() -> None:
    """Bit-for-bit: step 1's float64 gradients (exact: integer data, dyadic 1/tokens) map to the field's."""
    model = ReferenceModel(layers=1, hidden=4, heads=2, ffn=4, vocab=8, seq=4)
    p_field = initial_parameters(model, FIELD, 3)
    p_int = {g: np.where(v > PRIME // 2, v - PRIME, v).astype(np.float64) for g, v in p_field.items()}
    batch_f = make_data(model, 4, 1, FLOAT, 3)[0]
    batch_z = replace(batch_f, targets=FIELD.encode(batch_f.targets.astype(np.int64)))
    _, g_float = loss_and_gradients(model, p_int, batch_f, FLOAT)
    _, g_field = loss_and_gradients(model, p_field, batch_z, FIELD)
    for g in model.groups():
        expected = [Fraction(x).numerator % PRIME * pow(Fraction(x).denominator, -1, PRIME) % PRIME for x in g_float[g]]
        assert list(g_field[g]) == expected


def test_single_device_training_moves_the_parameters() -> None:
    model = ReferenceModel()
    records = train_single_device(model, make_data(model, 2, 3, FIELD, 0), Optimizer(), FIELD)
    assert len(records) == 3
    assert any((records[0].parameters[g] != records[2].parameters[g]).any() for g in model.groups())


LIBRARY_CASES = [
    "dp2",
    "zero12",
    "zero22",
    "zero32",
    "fsdp2",
    "fsdp-sgo2",
    "distopt2",
    "hsdp2xdpr2",
    "tp2",
    "pp2",
    "cp2",
    "tp2xsp",
    "tp2xzero32xpp2",
    "tp2xspxcp2xpp2",
    "pp2xv2xm2",
    "pp2xgpipexm4",
    "zero22xm2",
    "dp2xoffload",
    "zero32xoffload-params",
    "zero12xoffload",
    "tp2xrecompute",
    "cp2xrecompute",
    "tp2xspxselective",
    "tp2xpp2xzero12xm2",
]


@pytest.mark.parametrize("text", LIBRARY_CASES)
@pytest.mark.parametrize("tied", [True, False])
def test_library_compositions_train_like_one_device_and_cost_what_the_model_says(text: str, tied: bool) -> None:
    """Bit-for-bit (field), two checked steps; memory per stage and traffic per op equal the cost model."""
    composition = parse(text)
    result = simulate(composition, reference_for(composition, ReferenceModel(tied=tied)), steps=2)
    assert result.matches, str(result.divergence)
    assert result.complete and result.traffic
    assert not result.cost_mismatches, result.cost_mismatches


@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.MOMENTUM])
def test_float64_dyadic_training_matches(kind: OptimizerKind) -> None:
    """float64, within FLOAT_TOLERANCE (relative)."""
    composition = parse("tp2xzero22xm2")
    result = simulate(
        composition, reference_for(composition), arithmetic=Arithmetic.FLOAT64, optimizer=Optimizer(kind), steps=2
    )
    assert result.matches, str(result.divergence)


def test_adam_matches_within_tolerance_and_still_sees_a_doubled_gradient() -> None:
    """float64 Adam, within FLOAT_TOLERANCE. Adam's update is nearly scale-free, so a doubled gradient
    barely moves the parameters, but the optimizer's read of G is compared too."""
    composition = parse("tp2xspxdp2")
    model = reference_for(composition)
    adam = Optimizer(OptimizerKind.ADAM)
    assert simulate(composition, model, arithmetic=Arithmetic.FLOAT64, optimizer=adam).matches
    program = _derived(composition, model)
    ops = list(program.ops)
    i = next(
        k
        for k, op in enumerate(ops)
        if op.kind is OpKind.ALL_REDUCE and op.axis is Axis.TP and op.state is State.GRADIENTS
    )
    ops.insert(i, ops[i])
    result = simulate_program(program.with_ops(ops), model, arithmetic=Arithmetic.FLOAT64, optimizer=adam)
    assert not result.matches and result.divergence is not None
    assert result.divergence.state is State.GRADIENTS and not result.divergence.exact


def test_adam_needs_float64() -> None:
    with pytest.raises(InputError, match="adam"):
        simulate(parse("dp2"), optimizer=Optimizer(OptimizerKind.ADAM))


def _derived(composition: object, model: ReferenceModel) -> StepProgram:
    transformer = model.transformer()
    return derive_program(composition.placement(transformer), transformer)  # type: ignore[attr-defined]


def test_zero1_without_refresh_reports_the_stale_read() -> None:
    composition = parse("zero12")
    model = reference_for(composition)
    program = _derived(composition, model)
    broken = program.with_ops(op for op in program.ops if op.phase is not Phase.REFRESH)
    d = simulate_program(broken, model).divergence
    assert d is not None
    assert (d.step, d.phase, d.state) == (2, "forward", State.PARAMETERS)
    assert d.expected != d.got and d.device in (0, 1) and "dp=" in d.coordinates


def _mutate_activation(text: str, pick: object, change: str) -> bool:
    composition = parse(text)
    model = reference_for(composition)
    program = _derived(composition, model)
    ops = list(program.ops)
    i = next(k for k, op in enumerate(ops) if pick(op))  # type: ignore[operator]
    match change:
        case "drop":
            del ops[i]
        case "duplicate":
            ops.insert(i, ops[i])
        case "mean":
            ops[i] = replace(ops[i], reduce=Reduce.MEAN)
    return simulate_program(program.with_ops(ops), model).matches


def _act(kind: OpKind, axis: Axis, phase: Phase) -> object:
    return lambda op: op.state is State.ACTIVATIONS and op.kind is kind and op.axis is axis and op.phase is phase


@pytest.mark.parametrize(
    ("text", "kind", "axis", "phase", "change", "matches"),
    [
        ("tp2", OpKind.ALL_REDUCE, Axis.TP, Phase.FORWARD, "drop", False),  # row-parallel partial sums left
        ("tp2", OpKind.ALL_REDUCE, Axis.TP, Phase.BACKWARD, "drop", False),
        ("tp2", OpKind.ALL_REDUCE, Axis.TP, Phase.FORWARD, "duplicate", False),  # summed twice
        ("tp2", OpKind.ALL_REDUCE, Axis.TP, Phase.FORWARD, "mean", False),
        ("tp2xsp", OpKind.ALL_GATHER, Axis.TP, Phase.FORWARD, "duplicate", True),  # idempotent
        ("tp2xsp", OpKind.ALL_GATHER, Axis.TP, Phase.FORWARD, "drop", False),
        ("cp2", OpKind.ALL_GATHER, Axis.CP, Phase.FORWARD, "drop", False),  # keys/values of earlier chunks
        ("cp2", OpKind.REDUCE_SCATTER, Axis.CP, Phase.BACKWARD, "drop", False),
        ("pp2", OpKind.SEND_RECV, Axis.PP, Phase.FORWARD, "drop", False),
        ("pp2", OpKind.SEND_RECV, Axis.PP, Phase.BACKWARD, "drop", False),
        ("pp2", OpKind.SEND_RECV, Axis.PP, Phase.FORWARD, "duplicate", True),
    ],
)
def test_activation_collectives_are_executed_as_the_program_says(
    text: str, kind: OpKind, axis: Axis, phase: Phase, change: str, matches: bool
) -> None:
    assert _mutate_activation(text, _act(kind, axis, phase), change) is matches


@pytest.mark.parametrize(
    ("text", "group", "kind", "phase", "change", "matches"),
    [
        ("tp2", EMBEDDING_IO, OpKind.ALL_REDUCE, Phase.FORWARD, "drop", False),  # each rank's rows only
        ("tp2", EMBEDDING_IO, OpKind.ALL_REDUCE, Phase.FORWARD, "duplicate", False),
        ("tp2", OUTPUT_IO, OpKind.ALL_REDUCE, Phase.BACKWARD, "drop", False),  # head input gradient partial
        ("tp2", OUTPUT_IO, OpKind.ALL_REDUCE, Phase.BACKWARD, "mean", False),
        ("tp2xsp", EMBEDDING_IO, OpKind.REDUCE_SCATTER, Phase.FORWARD, "drop", False),
        ("tp2xsp", EMBEDDING_IO, OpKind.ALL_GATHER, Phase.BACKWARD, "drop", False),
        ("tp2xsp", OUTPUT_IO, OpKind.ALL_GATHER, Phase.FORWARD, "drop", False),
        ("tp2xsp", OUTPUT_IO, OpKind.ALL_GATHER, Phase.FORWARD, "duplicate", True),  # idempotent
        ("tp2xsp", OUTPUT_IO, OpKind.REDUCE_SCATTER, Phase.BACKWARD, "drop", False),
    ],
)
def test_vocabulary_parallel_collectives_are_ops_of_the_program(
    text: str, group: Group, kind: OpKind, phase: Phase, change: str, matches: bool
) -> None:
    """The embedding's and head's exchanges run as the program says (they used to be run
    always, apart from the program, so a program without them still trained correctly)."""

    def pick(op: Op) -> bool:
        return op.state is State.ACTIVATIONS and op.group == group and op.kind is kind and op.phase is phase

    assert _mutate_activation(text, pick, change) is matches


def test_sequence_parallel_norm_gradients_are_partial_along_tp() -> None:
    composition = parse("tp2xsp")
    model = reference_for(composition)
    program = _derived(composition, model)
    broken = program.with_ops(op for op in program.ops if not (op.state is State.GRADIENTS and op.axis is Axis.TP))
    d = simulate_program(broken, model).divergence
    assert d is not None and d.state is State.GRADIENTS and d.group.name in ("norm", "final_norm", "row_bias")


def test_the_host_store_is_separate() -> None:
    """Offloaded optimizer: without the copy back, the device keeps the old parameters."""
    composition = parse("dp2xoffload")
    model = reference_for(composition)
    program = _derived(composition, model)
    broken = program.with_ops(
        op for op in program.ops if not (op.kind is OpKind.HOST_TO_DEVICE and op.phase is Phase.REFRESH)
    )
    d = simulate_program(broken, model).divergence
    assert d is not None and (d.step, d.state) == (2, State.PARAMETERS)


def test_a_model_that_does_not_split_is_reported_as_not_modelled() -> None:
    with pytest.raises(SimulationError, match="do not split"):
        simulate(parse("ep3"), ReferenceModel(experts=4))


@given(compositions(max_devices=4))
def test_every_generated_composition_trains_like_one_device(case: tuple[object, ReferenceModel]) -> None:
    """Bit-for-bit (field); also the cost model's memory and traffic figures."""
    composition, model = case
    program = _derived(composition, model)
    result = simulate_program(program, model, steps=1)
    assert result.matches, str(result.divergence)
    assert not result.cost_mismatches, result.cost_mismatches


def _cli(*args: str) -> dict[str, object]:
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "checker.cli", *args, "--simulate", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    simulation = json.loads(done.stdout)["simulation"]
    assert isinstance(simulation, dict)
    return simulation


def test_cli_simulate_reports_a_match_with_the_cost_model() -> None:
    sim = _cli("tp2xzero32xpp2")
    assert sim["matches"] is True and sim["cost_model_agrees"] is True and sim["comparison"] == "bit-for-bit"


def test_cli_simulate_reports_the_first_divergence_of_a_user_program() -> None:
    sim = _cli("zero14", "--model", "gpt3-1.3b", "--strategies", "examples/broken_zero1_no_refresh.toml")
    divergence = sim["divergence"]
    assert sim["matches"] is False and isinstance(divergence, dict)
    assert (divergence["step"], divergence["phase"], divergence["state"]) == (2, "forward", "P")
    assert divergence["expected"] != divergence["got"] and "dp=" in str(divergence["coordinates"])


def test_cli_simulate_says_why_it_did_not_run() -> None:
    sim = _cli("dp256")  # beyond the simulator's device limit
    assert sim["matches"] is None and "at most 128" in str(sim["not_run"])
