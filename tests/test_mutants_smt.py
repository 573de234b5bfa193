"""Verdicts the mutation catalogue (``benchmarks/mutate.py``) showed no other test pins down.

Every expectation is derived apart from the engine: composition rules from the model's
published sizes and plain arithmetic; program verdicts from single-device training itself, by
running the same program on the numpy simulator beside one device (``simulate_program``: exact
field arithmetic, every read compared) where the simulator can run it, and otherwise from the
semantics stated beside the test. A test asserts the rule a concrete input breaks, not just
that something is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import pytest
import sympy as sp

from checker._parse import parse
from checker._toml import loads
from formal._model import Model, Transformer
from formal._presets import PRESETS
from formal._program import Op, derive_program
from formal._reference import ReferenceModel
from formal._simulator import reference_for, simulate_program
from formal._smt import decide
from formal._verdict import Condition, Status, Verdict
from formal._vocab import Axis, OpKind, Phase, Reduce, State

G, P, O = State.GRADIENTS, State.PARAMETERS, State.OPTIMIZER  # noqa: E741 (the paper's P/O/G)
Edit = Callable[[list[Op]], Iterable[Op]]


def rules(verdict: Verdict) -> set[str]:
    return {v.rule for v in verdict.violations}


def composition_verdict(text: str, model: Model) -> Verdict:
    composition = parse(text, devices=4096)
    return decide(composition, derive_program(composition.placement(model), model), model)


def judged(
    text: str, edit: Edit | None = None, *, strategies: str | None = None, tied: bool = True
) -> tuple[Verdict, bool]:
    """z3's verdict on the (edited) program of ``text`` over the smallest reference model its
    degrees divide, and whether the simulated mesh matches single-device training on it."""
    file = loads(strategies) if strategies is not None else None
    composition = parse(text, file.factories() if file is not None else None)
    reference = reference_for(composition, ReferenceModel(tied=tied))
    model = reference.transformer()
    placement = composition.placement(model)
    program = file.program_for(placement, model) if file is not None else derive_program(placement, model)
    if edit is not None:
        program = program.with_ops(edit(list(program.ops)))
    return decide(composition, program, model), simulate_program(program, reference, steps=1).matches


def after(selected: Callable[[Op], bool], extra: Callable[[Op], list[Op]]) -> Edit:
    """Insert ``extra(op)`` after every selected op."""

    def edit(ops: list[Op]) -> Iterable[Op]:
        for op in ops:
            yield op
            if selected(op):
                yield from extra(op)

    return edit


def changed(selected: Callable[[Op], bool], **fields: object) -> Edit:
    return lambda ops: [replace(op, **fields) if selected(op) else op for op in ops]  # type: ignore[arg-type]


def gradient(kind: OpKind, axis: Axis | None = None) -> Callable[[Op], bool]:
    return lambda op: op.state is G and op.kind is kind and (axis is None or op.axis is axis)


def optimizer_step(op: Op) -> bool:
    return op.kind is OpKind.OPTIMIZER_STEP


# --------------------------------------------------------------------------- composition rules


def test_tp16_on_llama2_70b_breaks_only_the_kv_head_rule() -> None:
    # Llama 2 70B (Touvron et al. 2023; HF config.json): 64 heads but 8 key/value heads (GQA),
    # hidden 8192, FFN 28672, vocabulary 32000. Every size but the kv heads divides by 16.
    model = PRESETS["llama2-70b"]
    assert isinstance(model, Transformer)
    assert model.kv_heads_ % 16 and not (model.heads % 16 or model.hidden % 16 or model.ffn_ % 16 or model.vocab % 16)
    verdict = composition_verdict("tp16", model)
    assert verdict.condition_status(Condition.COMPOSITION) is Status.REFUTED
    assert rules(verdict) == {"divides[kv_heads, tp]"}
    assert composition_verdict("tp8", model).status is Status.PROVED  # 8 kv heads, one per rank


def test_an_ffn_that_tp_cannot_split_is_refuted() -> None:
    # Hidden 512, 8 heads and vocabulary 1024 divide by 4; an FFN of 1002 does not (1002 = 250 x 4 + 2).
    model = Transformer("odd-ffn", layers=4, hidden=512, heads=8, vocab=1024, seq=256, ffn=1002)
    verdict = composition_verdict("tp4", model)
    assert rules(verdict) == {"divides[ffn, tp]"}
    assert composition_verdict("tp2", model).status is Status.PROVED  # 1002 = 501 x 2


def test_sequence_parallelism_needs_the_sequence_to_split_across_tp() -> None:
    # Korthikanti et al. 2022, 4.2.2: SP splits the sequence across the tp group, so 4097
    # tokens cannot go to 2 ranks; without SP the sequence is not split by tp at all.
    base = PRESETS["llama2-7b"]
    assert isinstance(base, Transformer)
    model = replace(base, seq=4097)
    assert rules(composition_verdict("tp2xsp", model)) == {"divides[seq, tp]"}
    assert composition_verdict("tp2", model).status is Status.PROVED
    # Under cp x tp with SP each cp chunk is split again across tp: 4098 tokens divide by cp 2
    # and by tp 2, but not into cp x tp = 4 pieces (4098 = 1024 x 4 + 2).
    model = replace(base, seq=4098)
    assert "divides[seq, tp]" in rules(composition_verdict("cp2xtp2xsp", model))
    assert composition_verdict("cp2xtp2", model).status is Status.PROVED


def test_uneven_stages_hold_at_least_one_layer_each() -> None:
    model = PRESETS["llama2-7b"]  # 32 layers (Touvron et al. 2023)
    assert isinstance(model, Transformer) and model.layers == 32
    assert rules(composition_verdict("pp33xuneven", model)) == {"stages_hold_layers[pp]"}  # 33 > 32
    assert composition_verdict("pp32xuneven", model).status is Status.PROVED  # one layer each
    assert composition_verdict("pp31xuneven", model).status is Status.PROVED  # ceil(32/31) = 2 on one
    # Interleaved: 16 devices x 3 chunks = 48 virtual stages for 32 layers; 16 x 2 = 32 fit.
    assert rules(composition_verdict("pp16xv3xuneven", model)) == {"stages_hold_layers[pp]"}
    assert composition_verdict("pp16xv2xuneven", model).status is Status.PROVED


def test_degrees_must_multiply_to_the_device_count_in_both_directions() -> None:
    composition = parse("tp2xdp8xpp4")  # 2 x 8 x 4 = 64 devices
    model = PRESETS["gpt3-1.3b"]
    program = derive_program(composition.placement(model), model)
    for devices in (32, 128):
        verdict = decide(composition, program, model, devices=devices)
        assert rules(verdict) == {"device_count"}, devices


# --------------------------------------------------------------------------- gradient integrity


def test_every_explicit_device_of_a_missing_reduction_keeps_its_own_contribution() -> None:
    # dp8 with the gradient all-reduce dropped: nothing combines the eight partial gradients, so
    # device i ends holding exactly its own contribution c_i, and each differs from their mean.
    verdict, matches = judged("dp8", lambda ops: [op for op in ops if not gradient(OpKind.ALL_REDUCE)(op)])
    assert not matches
    violation = next(v for v in verdict.violations if v.rule == "reduction_closure[G.attention, dp]")
    w = violation.witness
    assert set(w["devices"]) == set(w["contributions"]) == {str(i) for i in range(8)}  # all 8 explicit
    assert w["devices"] == w["contributions"]


def test_two_means_are_exact_beyond_eight_devices() -> None:
    # Averaging a gradient that every device already holds averaged leaves it unchanged, for any
    # degree: at dp16 eight devices are explicit and eight folded into one aggregate.
    verdict, matches = judged("dp16", after(gradient(OpKind.ALL_REDUCE), lambda op: [op]))
    assert matches and verdict.status is Status.PROVED


def test_sum_then_one_over_d_then_mean_is_exact_beyond_eight_devices() -> None:
    # sum over 16 devices, x 1/16, then a mean of 16 equal copies: the mean, on every device.
    def summed_scaled_averaged(op: Op) -> list[Op]:
        return [
            Op(OpKind.SCALE, G, op.group, Axis.DP, Phase.GRAD_SYNC, scale=sp.Rational(1, 16)),
            replace(op, reduce=Reduce.MEAN),
        ]

    verdict, matches = judged(
        "dp16",
        lambda ops: [
            new
            for op in ops
            for new in (
                [replace(op, reduce=Reduce.SUM), *summed_scaled_averaged(op)]
                if gradient(OpKind.ALL_REDUCE)(op)
                else [op]
            )
        ],
    )
    assert matches and verdict.status is Status.PROVED


def test_averaging_a_complete_replicated_gradient_beyond_eight_devices_is_exact() -> None:
    # A norm weight under tp is replicated and computed on whole activations: every rank holds
    # the same complete gradient, and their mean over 16 ranks is that gradient.
    def mean_of_norms(op: Op) -> list[Op]:
        if op.group.name in ("norm", "final_norm"):
            return [Op(OpKind.ALL_REDUCE, G, op.group, Axis.TP, Phase.GRAD_SYNC, reduce=Reduce.MEAN)]
        return []

    verdict, matches = judged(
        "tp16", after(lambda op: op.kind is OpKind.COMPUTE and op.phase is Phase.BACKWARD, mean_of_norms)
    )
    assert matches and verdict.status is Status.PROVED


def test_reducing_a_complete_tp_sharded_gradient_mixes_shards() -> None:
    # tp ranks hold different slices of a matrix's gradient, each complete: averaging them
    # across tp puts another slice's values into every rank's.
    verdict, matches = judged(
        "tp2",
        after(
            lambda op: op.kind is OpKind.COMPUTE and op.phase is Phase.BACKWARD and op.group.name == "attention",
            lambda op: [Op(OpKind.ALL_REDUCE, G, op.group, Axis.TP, Phase.GRAD_SYNC, reduce=Reduce.MEAN)],
        ),
    )
    assert not matches
    assert "reduction_closure[G.attention, tp]" in rules(verdict)


def test_a_reduction_in_the_forward_reduces_an_empty_buffer() -> None:
    verdict, matches = judged("dp2", changed(gradient(OpKind.ALL_REDUCE), phase=Phase.FORWARD))
    assert not matches
    assert "reduction_closure[G.attention, dp]" in rules(verdict)


def test_a_reduction_after_the_optimizer_step_comes_too_late() -> None:
    verdict, matches = judged("dp2", changed(gradient(OpKind.ALL_REDUCE), phase=Phase.REFRESH))
    assert not matches
    assert "reduction_closure[G.attention, dp]" in rules(verdict)


def test_a_reduce_scatter_in_the_optimizer_phase_finds_the_gradient_freed() -> None:
    # ZeRO-2 keeps only its shard of the gradient once synchronisation is over; a reduce-scatter
    # moved into the optimizer phase reduces what is left: one device's own partial value.
    verdict, matches = judged("zero22", changed(gradient(OpKind.REDUCE_SCATTER), phase=Phase.OPTIMIZER))
    assert not matches
    assert "reduction_closure[G.attention, dp]" in rules(verdict)


def test_the_tied_embedding_is_reduced_over_its_two_stages_not_the_pipeline() -> None:
    # A tied embedding lives on the first and the last stage (Narayanan et al. 2021, 3.2 /
    # Megatron's embedding group): a mean over those two, times two, is their sum.
    def mean_times_two(ops: list[Op]) -> Iterable[Op]:
        for op in ops:
            if gradient(OpKind.ALL_REDUCE, Axis.PP)(op):
                yield replace(op, reduce=Reduce.MEAN)
                yield Op(OpKind.SCALE, G, op.group, Axis.PP, Phase.GRAD_SYNC, scale=sp.Integer(2))
            else:
                yield op

    verdict, matches = judged("pp4", mean_times_two)
    assert matches and verdict.status is Status.PROVED


def test_an_axis_free_scale_is_applied_once() -> None:
    # The dp mean written as a sum and one axis-free x1/2: the gradient is scaled once, which
    # along dp makes the sum a mean and along tp (no reduction there) must leave it alone.
    def sum_then_half(ops: list[Op]) -> Iterable[Op]:
        for op in ops:
            if gradient(OpKind.ALL_REDUCE, Axis.DP)(op):
                yield replace(op, reduce=Reduce.SUM)
                yield Op(OpKind.SCALE, G, op.group, None, Phase.GRAD_SYNC, scale=sp.Rational(1, 2))
            else:
                yield op

    for text in ("tp2xdp2", "dp2xtp2"):  # the first axis of the mesh is tp, then dp
        verdict, matches = judged(text, sum_then_half)
        assert matches and verdict.status is Status.PROVED, text


def test_a_host_copy_made_before_the_reduction_misses_it() -> None:
    # ZeRO-Offload reads the gradient on the host: copied before its reduce-scatter, the copy
    # holds the unreduced value (Ren et al. 2021, section 4: the copy follows the reduction).
    def copy_first(ops: list[Op]) -> list[Op]:
        copies = {op.group: op for op in ops if op.kind is OpKind.DEVICE_TO_HOST}
        out = [op for op in ops if op.kind is not OpKind.DEVICE_TO_HOST]
        for group, copy in copies.items():
            at = next(i for i, op in enumerate(out) if op.group == group and op.phase is Phase.GRAD_SYNC)
            out.insert(at, copy)
        return out

    verdict, matches = judged("zero22xoffload", copy_first)
    assert not matches
    assert "transfer_after_reduction[G.attention, dp]" in rules(verdict)


@pytest.mark.parametrize(("text", "right"), [("tp2xoffload", True), ("tp2xoffloadxm2", False)])
def test_a_host_copy_in_the_backward_snapshots_one_micro_batch(text: str, right: bool) -> None:
    # Along tp the gradient is complete after backward and never reduced. A device-to-host copy in
    # the backward phase copies the fresh gradient of each micro-batch as it is produced (docs/
    # semantics.md, "Gradient buffers"), each copy overwriting the last: with one micro-batch that
    # is the whole gradient; with two the host keeps only the second's, half of single-device
    # training's sum. (z3 once took any copy in the backward for an empty one, and the simulator
    # copied .grad before the micro-batch's accumulation: both wrong for m = 1.)
    edit = changed(lambda op: op.kind is OpKind.DEVICE_TO_HOST, phase=Phase.BACKWARD)
    verdict, matches = judged(text, edit)
    assert matches is right
    assert ("transfer_after_reduction[G.attention, tp]" not in rules(verdict)) is right
    assert (verdict.status is Status.PROVED) is right


def test_per_micro_batch_reductions_run_before_the_copy_to_the_host() -> None:
    # ZeRO-2 under accumulation (m = 2) reduce-scatters each micro-batch's gradient as it is
    # produced; the one device-to-host copy per step comes after, even when listed first.
    def copy_listed_first(ops: list[Op]) -> list[Op]:
        copies = {op.group: op for op in ops if op.kind is OpKind.DEVICE_TO_HOST}
        out = [op for op in ops if op.kind is not OpKind.DEVICE_TO_HOST]
        for group, copy in copies.items():
            at = next(i for i, op in enumerate(out) if op.group == group and op.phase is Phase.GRAD_SYNC)
            out.insert(at, copy)
        return out

    verdict, matches = judged("zero22xoffloadxm2", copy_listed_first)
    assert matches and verdict.status is Status.PROVED


def test_gradient_ops_listed_in_the_backward_run_after_it() -> None:
    # A reduce-scatter listed in the backward runs once the backward has produced the gradient
    # (the simulator's order): with its shards rotated by one it is misaligned with the
    # optimizer's, as it would be in gradient synchronisation.
    def scatter_in_backward(offset: int) -> Edit:
        def edit(ops: list[Op]) -> list[Op]:
            scatters = {
                op.group: replace(op, phase=Phase.BACKWARD, offset=offset)
                for op in ops
                if gradient(OpKind.REDUCE_SCATTER)(op)
            }
            out: list[Op] = []
            for op in ops:
                if gradient(OpKind.REDUCE_SCATTER)(op):
                    continue
                if op.kind is OpKind.COMPUTE and op.phase is Phase.BACKWARD and op.group in scatters:
                    out.append(scatters[op.group])  # listed before the backward's read
                out.append(op)
            return out

        return edit

    verdict, matches = judged("zero24", scatter_in_backward(0))
    assert matches and verdict.status is Status.PROVED
    verdict, matches = judged("zero24", scatter_in_backward(1))
    assert not matches
    assert "alignment[O/G.attention, dp]" in rules(verdict)


# --------------------------------------------------------------------------- state consistency


def test_consistency_models_four_devices_at_degree_four() -> None:
    # Up to four devices along an axis are modelled one by one (docs/verdict.md, "Degrees").
    verdict, matches = judged("zero14", lambda ops: [op for op in ops if op.phase is not Phase.REFRESH])
    assert not matches
    witness = next(v for v in verdict.violations if v.rule == "refresh[P.attention, dp]").witness
    assert witness["degree"] == witness["modelled_devices"] == 4


def test_without_an_optimizer_step_nothing_is_updated() -> None:
    # Single-device training updates P and O every step; a program that never runs the update
    # leaves every copy of both at their initial values.
    verdict, matches = judged("dp2", lambda ops: [op for op in ops if not optimizer_step(op)])
    assert not matches
    assert {"coverage[P.attention, dp]", "coverage[O.attention, dp]"} <= rules(verdict)


def test_two_optimizer_steps_update_twice() -> None:
    verdict, matches = judged("dp2", after(optimizer_step, lambda op: [op]))
    assert not matches
    assert "coverage[P.attention, dp]" in rules(verdict)


def test_the_optimizer_reads_its_parameter_shard_where_it_updates() -> None:
    # ZeRO-3 whose parameter shards are rotated by one against the optimizer's (and gradient's):
    # rank i updates element i with parameter element i-1.
    skewed = '[strategies.zero3-skewp]\naxis = "dp"\nP = "S*@1"\nO = "S"\nG = "S"\n'
    verdict, matches = judged("zero3-skewp2", strategies=skewed)
    assert not matches
    assert "alignment[O/P.attention, dp]" in rules(verdict)


def test_the_optimizer_reads_its_own_state_shard() -> None:
    # ZeRO-1 with a full gradient (all-reduced) and the optimizer step's partition rotated by
    # one: rank i updates element i-1 from the optimizer state of element i that it holds.
    def rotated_step(ops: list[Op]) -> list[Op]:
        return [
            replace(op, offset=1)
            if optimizer_step(op)
            else replace(op, kind=OpKind.ALL_REDUCE)
            if gradient(OpKind.REDUCE_SCATTER)(op)
            else op
            for op in ops
        ]

    verdict, matches = judged("zero12", rotated_step)
    assert not matches
    assert "alignment[O.attention, dp]" in rules(verdict)
    # The step's own offset against aligned shards of O and G (ZeRO-2): misaligned as well.
    verdict, matches = judged("zero22", changed(optimizer_step, offset=1))
    assert not matches
    assert "alignment[O/G.attention, dp]" in rules(verdict)


def test_a_broadcast_overwrites_every_other_device() -> None:
    # Broadcasting ZeRO-2's reduce-scattered gradient from rank 0 gives rank 1 rank 0's shard.
    verdict, matches = judged(
        "zero22",
        after(
            gradient(OpKind.REDUCE_SCATTER), lambda op: [Op(OpKind.BROADCAST, G, op.group, Axis.DP, Phase.GRAD_SYNC)]
        ),
    )
    assert not matches
    assert "alignment[O/G.attention, dp]" in rules(verdict)
    # A broadcast of parameters every replica already holds updated changes nothing.
    verdict, matches = judged(
        "dp2", after(optimizer_step, lambda op: [Op(OpKind.BROADCAST, P, op.group, Axis.DP, Phase.REFRESH)])
    )
    assert matches and verdict.status is Status.PROVED


def test_a_sharded_gradient_is_kept_only_on_its_shard() -> None:
    # Gradients sharded along dp but the optimizer state replicated: even all-reduced in full,
    # each rank keeps only its gradient shard after synchronisation, and its optimizer, which
    # updates every element, reads the other elements' gradients from nowhere.
    strategies = (
        '[strategies.gshard]\naxis = "dp"\nP = "R"\nO = "R"\nG = "S"\n\n'
        '[[program]]\nop = "all_reduce"\nstate = "G"\naxis = "dp"\n'
    )
    verdict, matches = judged("gshard2", strategies=strategies)
    assert not matches
    assert "alignment[O/G.attention, dp]" in rules(verdict)


def test_fetched_offloaded_parameters_are_freed_after_the_backward() -> None:
    # FSDP shard-grad-op with parameter offload (ZeRO-Infinity): the fetched copy is held
    # through the backward and freed after it, so each step fetches the updated parameters.
    verdict, matches = judged("fsdp-sgo2xoffload-params")
    assert matches and verdict.status is Status.PROVED


def test_the_tied_embedding_is_computed_whole_on_its_two_stages() -> None:
    # Under pp the tied embedding is replicated on the first and the last stage, each of which
    # computes with (and gets a gradient for) the whole matrix.
    for text in ("pp2", "tp2xpp2"):
        verdict, matches = judged(text, tied=True)
        assert matches and verdict.status is Status.PROVED, text


# --------------------------------------------------------------------------- unknown answers


def test_a_timeout_is_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unknown answer says only that z3 ran out of time: asked again with time to answer,
    # the same obligations must be decided, not recalled as unknown. z3 is asked through
    # formal._solver.solve alone (as tests/conftest.py's z3_gives_up fixture patches it).
    import formal._smt as smt
    import formal._solver as solver

    real = solver.solve

    def gives_up(tracked: solver.Solver, assumptions: object) -> solver.Answer:
        answer = real(tracked, assumptions)  # type: ignore[arg-type]
        return solver.Answer("unknown", "timeout", (), None, answer.seconds)

    composition = parse("zero24")
    model = PRESETS["gpt3-1.3b"]
    program = derive_program(composition.placement(model), model)
    monkeypatch.setattr(smt, "_MEMO", {})  # this test's own cache, kept across both calls
    monkeypatch.setattr(solver, "solve", gives_up)
    assert decide(composition, program, model).status is Status.UNKNOWN
    monkeypatch.setattr(solver, "solve", real)
    assert decide(composition, program, model).status is Status.PROVED


def test_a_copy_to_the_host_in_the_forward_finds_the_gradient_buffer_empty_at_every_step() -> None:
    # Gradients are zeroed at the start of every step (PyTorch's optimizer.zero_grad; the
    # simulator's step): a device-to-host copy in the forward finds nothing to copy, at step 1
    # as at step 0, and never the previous step's gradient.
    verdict, matches = judged(
        "zero22xoffload", changed(lambda op: op.kind is OpKind.DEVICE_TO_HOST, phase=Phase.FORWARD)
    )
    assert not matches
    attention = {rule for rule in rules(verdict) if ".attention," in rule}
    assert {"transfer_after_reduction[G.attention, dp]", "alignment[O/G.attention, dp]"} <= attention
    assert "agreement[G.attention, dp]" not in attention  # no stale gradient is ever read


# --------------------------------------------------------------------------- activation exchange


def test_a_second_reduce_scatter_reads_freed_slots() -> None:
    # Sequence parallelism (Korthikanti et al. 2022, 4.2.2): after the reduce-scatter each rank
    # keeps only its sequence shard of the sum; a second reduce-scatter (even a mean, which
    # would undo a repeated sum) adds the other ranks' freed slots into it.
    def scattered_twice(ops: list[Op]) -> Iterable[Op]:
        for op in ops:
            yield op
            if (
                op.state is State.ACTIVATIONS
                and op.kind is OpKind.REDUCE_SCATTER
                and op.phase is Phase.FORWARD
                and op.group.name == "layer_io"
            ):
                yield replace(op, reduce=Reduce.MEAN)

    verdict, matches = judged("tp2xsp", scattered_twice)
    assert not matches
    assert "activation_exchange[A.layer_io, tp, forward, reduce_scatter]" in rules(verdict)


def test_the_activation_exchange_models_four_tp_ranks() -> None:
    # Up to four devices are explicit in an activation exchange (formal/_activation_flow.py):
    # tp4 without the forward all-reduce leaves each of the four ranks with its partial sum.
    verdict, matches = judged(
        "tp4",
        lambda ops: [
            op
            for op in ops
            if not (op.state is State.ACTIVATIONS and op.kind is OpKind.ALL_REDUCE and op.phase is Phase.FORWARD)
        ],
    )
    assert not matches
    violation = next(
        v for v in verdict.violations if v.rule == "activation_exchange[A.layer_io, tp, forward, all_reduce]"
    )
    assert violation.witness["degree"] == 4
    assert {key.split(".")[0] for key in violation.witness["start"]} == {"0", "1", "2", "3"}


def test_reducing_a_complete_gradient_over_one_device_is_the_identity() -> None:
    # Regression: tp has degree 1, so an all-reduce along it has one participant and returns its
    # input (the simulator matches single-device training). z3 refuted it: the gradient's folded
    # aggregate, meant for devices past the eighth, held an unconstrained value even with no
    # device folded into it, and the reduction added that value in.
    def reduced(how: Reduce) -> Callable[[Op], list[Op]]:
        return lambda op: [Op(OpKind.ALL_REDUCE, G, op.group, Axis.TP, Phase.GRAD_SYNC, reduce=how)]

    for reduce in (Reduce.SUM, Reduce.MEAN):
        verdict, matches = judged(
            "tp1xdp2",
            after(
                lambda op: op.kind is OpKind.COMPUTE and op.phase is Phase.BACKWARD and op.group.name == "attention",
                reduced(reduce),
            ),
        )
        assert matches and verdict.status is Status.PROVED, reduce
