"""z3 verdicts of mutated step programs: every derived collective is needed, and the rule that
fires names what was broken (a quality test: the mutation generator finds known-bad programs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import compositions, models, mutations

from checker._parse import parse
from formal._presets import PRESETS
from formal._program import Op, StepProgram, derive_program
from formal._smt import decide
from formal._strategies import Composition
from formal._verdict import Condition, Status, Verdict
from formal._vocab import OpKind, Phase, Reduce, State

GPT = PRESETS["gpt3-1.3b"]
G, P = State.GRADIENTS, State.PARAMETERS


def program_of(text: str) -> tuple[Composition, StepProgram]:
    composition = parse(text)
    return composition, derive_program(composition.placement(GPT), GPT)


def judged(composition: Composition, program: StepProgram) -> Verdict:
    return decide(composition, program, GPT)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_dropping_any_needed_collective_is_refuted(data: st.DataObject) -> None:
    model = data.draw(models())
    composition = data.draw(compositions(model))
    program = derive_program(composition.placement(model), model)
    pl = program.placement
    if not any(
        op.state is not State.ACTIVATIONS
        and (op.kind.is_collective or op.kind.is_transfer)
        and (op.axis is None or pl.degree(op.axis) > 1)
        for op in program.ops
    ):
        return
    mutated, index = data.draw(mutations(program))
    dropped = program.ops[index]
    verdict = decide(composition, mutated, model)
    if dropped.axis is not None and pl.degree(dropped.axis) == 1:
        return  # a collective over one device moves nothing: dropping it may be harmless
    assert verdict.status is Status.REFUTED, (str(composition), str(dropped))
    assert any(v.group == dropped.group.name for v in verdict.violations), str(dropped)


def test_each_kind_of_dropped_op_fires_its_rule() -> None:
    cases: list[tuple[str, Callable[[Op], bool], str]] = [
        ("zero14", lambda op: op.phase is Phase.REFRESH, "refresh[P.attention, dp]"),
        (
            "zero34",
            lambda op: op.kind is OpKind.ALL_GATHER and op.phase is Phase.FORWARD,
            "gather_before_use[P.attention, dp]",
        ),
        (
            "fsdp4",
            lambda op: op.kind is OpKind.ALL_GATHER and op.phase is Phase.BACKWARD,
            "gather_before_use[P.attention, dp]",
        ),
        (
            "zero34xoffload-params",
            lambda op: op.kind is OpKind.HOST_TO_DEVICE and op.phase is Phase.FORWARD,
            "fetch_before_use[P.attention]",
        ),
        ("zero24xoffload", lambda op: op.kind is OpKind.HOST_TO_DEVICE, "refresh[P.attention, dp]"),
        (
            "tp2xspxdp2",
            lambda op: op.state is G and op.axis is not None and op.axis.value == "tp",
            "reduction_closure[G.norm, tp]",
        ),
        (
            "dp2xpp2",
            lambda op: op.state is G and op.axis is not None and op.axis.value == "pp",
            "reduction_closure[G.embedding, pp]",
        ),
        (
            "cp2xdp2",
            lambda op: op.state is G and op.axis is not None and op.axis.value == "cp",
            "reduction_closure[G.attention, cp]",
        ),
    ]
    for text, drop, rule in cases:
        composition, program = program_of(text)
        verdict = judged(composition, program.with_ops(op for op in program.ops if not drop(op)))
        assert rule in {v.rule for v in verdict.violations}, (text, [v.rule for v in verdict.violations])


def test_duplicated_and_renormalised_reductions() -> None:
    composition, program = program_of("dp4")
    ops = list(program.ops)
    at = next(i for i, op in enumerate(ops) if op.kind is OpKind.ALL_REDUCE and op.state is G)
    twice = [*ops[: at + 1], replace(ops[at], reduce=Reduce.SUM), *ops[at + 1 :]]
    verdict = judged(composition, program.with_ops(twice))
    violation = next(v for v in verdict.violations if v.group == ops[at].group.name)
    assert violation.rule == f"reduction_closure[G.{ops[at].group.name}, dp]"
    assert violation.witness["defect"].startswith("duplicated reduction")
    summed = [*ops[:at], replace(ops[at], reduce=Reduce.SUM), *ops[at + 1 :]]
    violation = next(v for v in judged(composition, program.with_ops(summed)).violations)
    assert violation.rule.startswith("normalisation[") and violation.condition is Condition.GRADIENT_INTEGRITY
    # Two means in a row are wasteful but exact: the verdict judges values, not traffic.
    means = [*ops[: at + 1], ops[at], *ops[at + 1 :]]
    assert judged(composition, program.with_ops(means)).status is Status.PROVED


def test_integrity_witness_is_a_concrete_counterexample() -> None:
    composition, program = program_of("tp2xspxdp2")
    verdict = judged(
        composition,
        program.with_ops(
            op for op in program.ops if not (op.state is G and op.axis is not None and op.axis.value == "tp")
        ),
    )
    violation = next(v for v in verdict.violations if v.rule == "reduction_closure[G.norm, tp]")
    w = violation.witness
    contributions = [w["contributions"][k] for k in ("0", "1")]
    assert w["single_device"] == sum(contributions)  # tp does not split data: the reference is the sum
    assert w["devices"] == {"0": contributions[0], "1": contributions[1]}  # unreduced partial sums
    assert w["disagreeing_devices"]


def test_reads_are_judged_not_snapshots() -> None:
    composition, program = program_of("zero14")
    refresh = [op for op in program.ops if op.phase is Phase.REFRESH]
    rest = [op for op in program.ops if op.phase is not Phase.REFRESH]
    first_read = next(i for i, op in enumerate(rest) if op.kind is OpKind.COMPUTE)
    before_forward = [replace(op, phase=Phase.FORWARD) for op in refresh]
    lazy = rest[:first_read] + before_forward + rest[first_read:]
    assert judged(composition, program.with_ops(lazy)).status is Status.PROVED
    backward = next(i for i, op in enumerate(rest) if op.kind is OpKind.COMPUTE and op.phase is Phase.BACKWARD)
    too_late = rest[:backward] + before_forward + rest[backward:]  # the next forward reads stale copies
    verdict = judged(composition, program.with_ops(too_late))
    assert "refresh[P.attention, dp]" in {v.rule for v in verdict.violations}
    witness = next(v for v in verdict.violations if v.rule == "refresh[P.attention, dp]").witness
    assert witness["step"] == 1 and witness["phase"] == "forward"
    assert witness["read_value"] != witness["single_device_value"]


def test_misaligned_partitions() -> None:
    composition, program = program_of("zero24")
    shifted: list[Op] = [replace(op, offset=1) if op.kind is OpKind.REDUCE_SCATTER else op for op in program.ops]
    verdict = judged(composition, program.with_ops(shifted))
    assert "alignment[O/G.attention, dp]" in {v.rule for v in verdict.violations}
    composition, program = program_of("zero14")
    gathered = [replace(op, offset=1) if op.phase is Phase.REFRESH else op for op in program.ops]
    verdict = judged(composition, program.with_ops(gathered))
    # Gathering chunk k from rank k+1, a replica that rank did not update, overwrites the only
    # current copy: the root cause is lost coverage at the end of step 0 (the stale reads of
    # step 1 follow from it and are not reported as another bug).
    attention = {v.rule: v for v in verdict.violations if v.group == "attention"}
    assert set(attention) == {"coverage[P.attention, dp]"}
    assert attention["coverage[P.attention, dp]"].witness["step"] == 0


def test_independent_bugs_are_each_reported_and_knock_on_effects_are_not() -> None:
    composition, program = program_of("zero24")
    no_refresh = [op for op in program.ops if op.phase is not Phase.REFRESH]
    shifted = [replace(op, offset=1) if op.kind is OpKind.REDUCE_SCATTER else op for op in no_refresh]
    rules = {v.rule for v in judged(composition, program.with_ops(shifted)).violations if v.group == "attention"}
    # Two independent bugs: misaligned gradient shards and no refresh. The corrupted updates
    # that the misalignment causes later are consequences, not a third bug.
    assert rules == {"alignment[O/G.attention, dp]", "refresh[P.attention, dp]"}


def test_expert_gradients_not_divided_by_ep() -> None:
    # Megatron-LM PR #5956: each expert receives every rank's tokens, so its gradient is the sum
    # of rank-normalised contributions and must be divided by the ep degree.
    from test_smt import MOE

    composition = parse("ep4xdp2")
    program = derive_program(composition.placement(MOE), MOE)
    unscaled = program.with_ops(op for op in program.ops if op.kind is not OpKind.SCALE)
    verdict = decide(composition, unscaled, MOE)
    violation = next(v for v in verdict.violations if v.rule == "normalisation[G.experts, ep]")
    assert violation.witness["origin"] == "summed"
    assert decide(composition, program, MOE).status is Status.PROVED
