"""Data assignment and split computation as correctness rules; the derived program of parameter
offload under ZeRO-1/2.

Every expected verdict is argued from single-device training on the global batch (one device
reads every sample of the step, computes the whole gradient of every parameter and updates all
of it), and the simulator (``formal._simulator``) runs each case beside that single device:

* activations replicated along a data axis put every rank there on the same samples; averaging
  their gradients is one device's gradient on 1/d of the global batch, not on the global batch,
  so the composition is refuted (``data_assignment``) and the simulation diverges;
* a group computed split along an axis has each rank differentiate its own slice only; with its
  gradient replicated there, the update leaves the rest of each replica stale: refuted
  (``split_compute_needs_sharded_gradient``), and the simulation diverges;
* ZeRO-1/2 with offloaded parameters: the placement is that of single-device training (every
  rank ends the step with the whole updated parameters) when the program moves the host copy
  through the device for the refresh gather: proved, and the simulation matches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checker._parse import parse
from checker._plan_rules import _ArrayTerms, family_rules
from checker._planner import AXES, DataParallel, Family, Offload
from formal._model import DEFAULT_PRECISION, Model
from formal._placement import Entry, Options, Recompute, Strategy
from formal._presets import PRESETS
from formal._program import StepProgram, derive_program
from formal._reference import Arithmetic, Batch, Numbers, Optimizer, initial_parameters, make_data, train_single_device
from formal._rules import RULES, setting_for
from formal._simulator import Simulator, reference_for, simulate_program
from formal._smt import decide
from formal._strategies import Composition
from formal._verdict import Condition, Status, Verdict
from formal._vocab import ATTENTION, MLP, Axis, Group, Mode, OpKind, Phase, State
from formal.errors import InputError

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741
GPT = PRESETS["gpt3-1.3b"]
ROOT = Path(__file__).resolve().parents[1]
# A tenth of the profile's examples: each draws a z3 verdict and a simulation (ci 10, thorough 200).
EXAMPLES = max(settings().max_examples // 10, 5)

MODES = {"R": Entry(Mode.REPLICATED), "S": Entry(Mode.SHARDED), "S*": Entry(Mode.SHARDED_GATHER)}
# P, O, G along a data axis as the data-parallel library places them: DDP, ZeRO-1, -2, -3.
DATA_PLACEMENTS = (("R", "R", "R"), ("R", "S", "R"), ("R", "S", "S"), ("S*", "S", "S"))


def verdict_of(composition: Composition, model: Model = GPT) -> Verdict:
    return decide(composition, derive_program(composition.placement(model), model), model)


def simulated(composition: Composition) -> bool:
    """Whether the derived program trains like one device on the global batch (reference model)."""
    model = reference_for(composition)
    program = derive_program(composition.placement(model.transformer()), model.transformer())
    return simulate_program(program, model, steps=1).matches


def fired(verdict: Verdict) -> set[str]:
    return {v.rule for v in verdict.violations}


# ---------------------------------------------------------------- data assignment


def data_strategy(axis: Axis, placement: tuple[str, str, str], activations: str) -> Strategy:
    p, o, g = (MODES[m] for m in placement)
    entries = (((P, None), p), ((O, None), o), ((G, None), g), ((A, None), MODES[activations]))
    return Strategy(f"user-{axis.value}", axis, None, entries)


@st.composite
def data_compositions(draw: st.DrawFn) -> tuple[Composition, Axis, bool]:
    """A user strategy on a data axis (dp, or cp beside a dp of degree 2), its activations split
    or replicated, at degree 2 or 4; and whether every rank there reads the same data."""
    axis = draw(st.sampled_from([Axis.DP, Axis.CP]))
    same = draw(st.booleans())
    degree = draw(st.sampled_from([2, 4]))
    placement = draw(st.sampled_from(DATA_PLACEMENTS)) if axis is Axis.DP else ("R", "R", "R")
    user = data_strategy(axis, placement, "R" if same else "S").with_degree(degree)
    strategies = (user,) if axis is Axis.DP else (user, data_strategy(Axis.DP, ("R", "R", "R"), "S").with_degree(2))
    options = Options(micro_batches=draw(st.sampled_from([1, 2])))
    return Composition(strategies, options), axis, same


@settings(max_examples=EXAMPLES, deadline=None)
@given(data_compositions())
def test_every_rank_on_the_same_data_is_refuted_and_diverges(case: tuple[Composition, Axis, bool]) -> None:
    """Replicated activations along a data axis: every rank computes on the same samples (cp: the
    same tokens of each sequence), so the averaged gradient is not the global batch's (refuted,
    diverges); split activations: each rank its own share, the single device's gradient (proved,
    matches)."""
    composition, axis, same = case
    verdict = verdict_of(composition)
    rule = f"data_assignment[{axis.value}]"
    assert (rule in fired(verdict)) is same, (str(composition), fired(verdict))
    assert (verdict.status is Status.PROVED) is (not same), (str(composition), fired(verdict))
    assert simulated(composition) is (not same), str(composition)


def test_the_same_samples_witness_names_devices_and_samples() -> None:
    """dp 2, 4 samples per rank (micro-batch 4): devices 0 and 1 both read samples 0-3 of the
    global batch's 8 (the example of examples/broken_same_samples.toml)."""
    model = GPT.with_micro_batch(4)
    composition = Composition((data_strategy(Axis.DP, ("R", "R", "R"), "R").with_degree(2),))
    verdict = verdict_of(composition, model)
    (v,) = [v for v in verdict.violations if v.rule == "data_assignment[dp]"]
    assert v.condition is Condition.COMPOSITION and (v.state, v.axis) == ("A", "dp")
    assert v.explanation.startswith("devices 0 and 1 both read samples 0-3")
    assert {k: v.witness[k] for k in ("devices", "samples", "of")} == {"devices": [0, 1], "samples": [0, 3], "of": 8}


def test_the_devices_of_a_group_are_numbered_as_the_mesh_numbers_them() -> None:
    """tp2 x dp4 (dp the inner axis, the last one fastest): device 0's dp group is 0, 1, 2, 3;
    dp4 x tp2: 0, 2, 4, 6 (device = dp coordinate x 2 + tp coordinate)."""
    for text, devices in (("tp2xuser-dp4", [0, 1, 2, 3]), ("user-dp4xtp2", [0, 2, 4, 6])):
        strategies = tuple(
            data_strategy(Axis.DP, ("R", "R", "R"), "R").with_degree(4)
            if term == "user-dp4"
            else parse(term).strategies[0]
            for term in text.split("x")
        )
        verdict = verdict_of(Composition(strategies))
        (v,) = [v for v in verdict.violations if v.rule == "data_assignment[dp]"]
        assert v.witness["devices"] == devices, text


def test_same_samples_averaged_train_one_device_on_a_dth_of_the_batch() -> None:
    """The replicated-data program is not wrong arithmetic but wrong data: beside single-device
    training on the first 1/d of each global batch (computed by ``train_single_device`` alone,
    not by the simulator) it matches bit for bit, while against the global batch it diverges."""
    d, m = 2, 2
    composition = Composition((data_strategy(Axis.DP, ("R", "R", "R"), "R").with_degree(d),), Options(micro_batches=m))
    model = reference_for(composition)
    program = derive_program(composition.placement(model.transformer()), model.transformer())
    numbers, optimizer = Numbers(Arithmetic.FIELD), Optimizer()
    sim = Simulator(program, model, optimizer, numbers, DEFAULT_PRECISION)
    sequences = d * m * model.micro_batch  # the global batch of the step
    data = make_data(model, sequences, 2, numbers, 0)
    p0 = initial_parameters(model, numbers, 0)
    share = tuple(Batch(b.tokens[: sequences // d], b.targets[: sequences // d]) for b in data)
    divergence, complete = sim.run(data, train_single_device(model, share, optimizer, numbers, parameters=p0), p0)
    assert divergence is None and complete
    divergence, _ = sim.run(data, train_single_device(model, data, optimizer, numbers, parameters=p0), p0)
    assert divergence is not None


# ---------------------------------------------------------------- split computation


@st.composite
def tensor_compositions(draw: st.DrawFn) -> tuple[Composition, bool, bool, bool]:
    """A user tp strategy splitting the computation of attention and mlp, of neither, or of one
    only, each split group's P, O and G sharded or replicated, at degree 1, 2 or 4; whether some
    split group's gradient and optimizer state are both replicated (the stale-replica case);
    whether some split group's optimizer state is replicated (the program is then wrong); and
    whether the model represents it (a layer's blocks split together, Megatron's f/g pairs, or at
    degree 1)."""
    split = draw(st.sampled_from([frozenset({ATTENTION, MLP}), frozenset(), frozenset({ATTENTION}), frozenset({MLP})]))
    entries: list[tuple[tuple[State, Group | None], Entry]] = [((s, None), MODES["R"]) for s in (P, O, G)]
    stale = broken = False
    for group in sorted(split):
        p, o, g = (draw(st.sampled_from(["R", "S"])) for _ in range(3))
        entries += [((P, group), MODES[p]), ((O, group), MODES[o]), ((G, group), MODES[g])]
        # The rule's case: neither G nor O sharded (the update reads the replica whole). A
        # replicated O over a sharded G is wrong too, by alignment (the update reads G outside
        # the rank's shard); a sharded O reads G on the rank's own slice only, where it is whole.
        stale = stale or (o == "R" and g == "R")
        broken = broken or o == "R"
    degree = draw(st.sampled_from([1, 2, 4]))
    user = Strategy("user-tp", Axis.TP, degree, (*entries, ((A, None), MODES["R"])), frozenset(split))
    return Composition((user,)), stale and degree > 1, broken and degree > 1, len(split) != 1 or degree == 1


@settings(max_examples=EXAMPLES, deadline=None)
@given(tensor_compositions())
def test_split_computation_over_a_replicated_gradient_is_refuted_and_diverges(
    case: tuple[Composition, bool, bool, bool],
) -> None:
    """Each tp rank differentiates its own slice of a split group: a replicated gradient is that
    slice's alone on every rank, and the update leaves the rest of the replica stale (refuted,
    diverges); a sharded gradient is exactly the slice (proved, matches). At degree 1 the one
    slice is the whole group; with neither block split every rank computes the whole layer, and
    summing block outputs across tp would count it d times, so the derived program sums nothing
    (proved, matches; the derivation summed them, and z3, whose activation obligations ask for
    the sums a split needs, not against sums nothing needs, proved it while the simulator
    diverged). One block split alone is refused, not guessed."""
    composition, stale, broken, representable = case
    if not representable:
        with pytest.raises(InputError, match="attention and mlp"):
            derive_program(composition.placement(GPT), GPT)
        return
    verdict = verdict_of(composition)
    assert ("split_compute_needs_sharded_gradient[tp]" in fired(verdict)) is stale, (str(composition), fired(verdict))
    assert (verdict.status is Status.PROVED) is (not broken), (str(composition), fired(verdict))
    assert simulated(composition) is (not broken), str(composition)


def test_the_split_computation_witness_names_group_axis_and_devices() -> None:
    """The audit's case: P, O, G replicated along tp, attention and mlp computed split."""
    entries = tuple(((s, None), MODES["R"]) for s in (P, O, G, A))
    user = Strategy("tp-replicated", Axis.TP, 2, entries, frozenset({ATTENTION, MLP}))
    verdict = verdict_of(Composition((user,)))
    (v,) = [v for v in verdict.violations if v.rule == "split_compute_needs_sharded_gradient[tp]"]
    assert (v.state, v.group, v.axis) == ("G", "attention", "tp")
    assert v.witness["devices"] == [0, 1] and v.witness["groups"] == ["attention", "mlp"]
    assert "devices 0, 1 each compute the gradient of their own slice only" in v.explanation


# ---------------------------------------------------------------- the planner reads the same rules


def test_the_planner_reads_the_placement_rules_and_its_library_keeps_them() -> None:
    """The planner's families place with library strategies: every placement rule applies to
    them and holds on every candidate mesh."""
    family = Family(DataParallel.ZERO2, Offload.NONE, None, False, Recompute.NONE)
    deg = np.array([[2, 2, 1, 4, 1, 1], [4, 1, 1, 2, 1, 1]], dtype=np.int64)
    rules = family_rules(family, GPT, False, deg, np.array([1, 1], dtype=np.int64))
    placement_rules = [n for n in rules if n.startswith(("data_assignment[", "split_compute_needs_sharded_gradient["))]
    assert {"data_assignment[dp]", "split_compute_needs_sharded_gradient[tp]"} <= set(placement_rules)
    assert all(bool(rules[n].all()) for n in placement_rules)


def test_z3_and_the_planners_terms_agree_on_a_broken_placement() -> None:
    """The same predicate over the planner's arrays: false exactly where the degree exceeds 1."""
    user = data_strategy(Axis.DP, ("R", "R", "R"), "R")
    rule = next(r for r in RULES if r.name == "data_assignment[dp]")
    setting = setting_for(Composition((user.with_degree(2),)), GPT)
    deg = np.ones((3, len(AXES)), dtype=np.int64)
    deg[:, AXES.index(Axis.DP)] = [1, 2, 4]
    holds = np.broadcast_to(rule.holds(_ArrayTerms(deg, np.ones(3, dtype=np.int64)), setting), (3,))
    assert holds.tolist() == [True, False, False]
    for d, expected in zip([1, 2, 4], holds.tolist(), strict=True):
        verdict = verdict_of(Composition((user.with_degree(d),)))
        assert (verdict.condition_status(Condition.COMPOSITION) is Status.PROVED) is expected, d


# ---------------------------------------------------------------- parameter offload under ZeRO-1/2

OFFLOADED = [
    f"{z}{d}x{o}" for z in ("zero1", "zero2") for o in ("offload-params", "offloadxoffload-params") for d in (2, 4)
]


@pytest.mark.parametrize("text", OFFLOADED)
def test_zero12_with_offloaded_parameters_is_proved_and_trains_like_one_device(text: str) -> None:
    """Was refuted (``refresh``) with the derived program: the step updated each rank's host copy
    on its shard, the refresh gathered stale device buffers and the next fetch read the host's
    old shards. Every rank must end the step with all of the single device's updated parameters,
    which the host-device-host refresh gives."""
    composition = parse(text)
    assert verdict_of(composition).status is Status.PROVED, text
    assert simulated(composition), text


def _without_refresh_transfers(program: StepProgram) -> StepProgram:
    keep = [op for op in program.ops if not (op.phase is Phase.REFRESH and op.kind.is_transfer)]
    return program.with_ops(keep)


@pytest.mark.parametrize("text", ["zero22xoffload-params", "zero14xoffloadxoffload-params"])
def test_the_old_refresh_without_transfers_is_refuted_and_diverges(text: str) -> None:
    """The previous derivation (gathers alone in the refresh) is wrong for this placement, not
    the placement: refuted by z3 (``refresh[P.*]``) and diverging in the simulator at a read of P."""
    composition = parse(text)
    program = _without_refresh_transfers(derive_program(composition.placement(GPT), GPT))
    verdict = decide(composition, program, GPT)
    assert "refresh[P.attention, dp]" in fired(verdict)
    model = reference_for(composition)
    small = _without_refresh_transfers(derive_program(composition.placement(model.transformer()), model.transformer()))
    result = simulate_program(small, model, steps=1)
    assert not result.matches and result.divergence is not None and result.divergence.state is P


def test_the_refresh_order_is_to_the_device_gather_to_the_host() -> None:
    composition = parse("zero22xoffload-params")
    program = derive_program(composition.placement(GPT), GPT)
    refresh = [(op.kind, op.axis) for op in program.ops if op.phase is Phase.REFRESH and op.group == ATTENTION]
    assert refresh == [(OpKind.HOST_TO_DEVICE, None), (OpKind.ALL_GATHER, Axis.DP), (OpKind.DEVICE_TO_HOST, None)]


def test_the_cli_proves_zero2_with_parameter_offload_and_the_simulator_agrees() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-c", "from checker.cli import main; main()"]
    args = ["zero2xoffload-params", "--devices", "2", "--model", "gpt3-1.3b", "--simulate", "--json"]
    result = subprocess.run([*cli, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["verdict"]["status"] == "proved"
    assert doc["simulation"]["matches"] is True


@pytest.mark.parametrize("text", ["zero32xoffload-params", "zero22xoffload-params"])
def test_a_copy_to_the_host_of_parameters_the_device_does_not_hold_is_refuted(text: str) -> None:
    """Was a z3 false proof, found by the differential run once the refresh above went through
    the device: a device-to-host copy of offloaded parameters before the step's first fetch
    writes the device buffer's junk over the host copy, so the fetch then reads junk where one
    device reads its parameters. z3 took it for a no-op (the simulator diverged): now refuted."""
    composition = parse(text)
    for model in (GPT, reference_for(composition).transformer()):
        program = derive_program(composition.placement(model), model)
        early = replace(next(op for op in program.ops if op.kind is OpKind.HOST_TO_DEVICE), kind=OpKind.DEVICE_TO_HOST)
        mutated = program.with_ops([early, *program.ops])
        assert decide(composition, mutated, model).status is Status.REFUTED, text
    result = simulate_program(mutated, reference_for(composition), steps=1)
    assert not result.matches and result.divergence is not None and result.divergence.state is P


def test_an_optimizer_on_the_device_updates_offloaded_parameters_where_they_live() -> None:
    """Was a z3 false refutation, found by the same run: FSDP SHARD_GRAD_OP with offloaded
    parameters, the backward's (redundant) fetch moved after the backward. The device then holds
    a transient copy of its shard at the optimizer step; the parameters live on the host, so the
    update goes there, the next forward fetches the updated values, and one device's training is
    reproduced (the simulator matched). z3 updated the device copy and left the host stale."""
    composition = parse("fsdp-sgo2xoffload-params")
    model = reference_for(composition).transformer()
    program = derive_program(composition.placement(model), model)
    ops = list(program.ops)
    i = next(k for k, op in enumerate(ops) if op.kind is OpKind.HOST_TO_DEVICE and op.phase is Phase.BACKWARD)
    fetch = ops.pop(i)
    j = next(k for k, op in enumerate(ops) if op.phase is Phase.GRAD_SYNC)
    ops.insert(j, replace(fetch, phase=Phase.GRAD_SYNC))
    mutated = program.with_ops(ops)
    assert decide(composition, mutated, model).status is Status.PROVED
    assert simulate_program(mutated, reference_for(composition), steps=1).matches
