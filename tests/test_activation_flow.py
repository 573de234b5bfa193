"""z3 judges the activation exchange a placement needs (formal/_activation_flow.py).

Regression for a soundness gap found on real gloo (docs/torch-validation.md): z3 used to prove a
pipeline program without its backward send, which leaves every stage but the last untrained,
and likewise tp without its partial-sum reductions, cp without its key/value exchange and ep
without its all-to-all. The simulator agrees with each verdict (tests/test_differential.py
mutates activation ops too).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import compositions, models

from checker._parse import parse
from formal._activation_flow import required_sites
from formal._exchanges import exchanges
from formal._model import Transformer
from formal._program import Op, StepProgram, derive_program
from formal._smt import decide
from formal._verdict import Condition, Status
from formal._vocab import EMBEDDING_IO, LAYER_IO, OUTPUT_IO, Axis, OpKind, Phase, Reduce, State

SMALL = Transformer("small", layers=4, hidden=16, heads=4, vocab=32, seq=8)
MOE = Transformer("moe", layers=2, hidden=16, heads=2, vocab=32, seq=8, experts=4, top_k=2)
SPLIT = ["tp2", "tp4xsp", "cp2", "cp2xrecompute", "ep2xdp2", "pp2xm4", "pp4xm8xgpipe", "tp2xpp2xm2", "tp2xcp2xsp"]


def program_of(text: str) -> tuple[Transformer, StepProgram]:
    model = MOE if "ep" in text else SMALL
    comp = parse(text)
    return model, derive_program(comp.placement(model), model)


def exchange_violations(text: str, program: StepProgram, model: Transformer) -> list[str]:
    verdict = decide(parse(text), program, model)
    return [v.rule for v in verdict.violations if v.rule.startswith("activation_exchange")]


@settings(max_examples=40, deadline=None)
@given(models(), st.data())
def test_derived_programs_complete_every_activation(model: Transformer, data: st.DataObject) -> None:
    comp = data.draw(compositions(model))
    program = derive_program(comp.placement(model), model)
    verdict = decide(comp, program, model)
    assert not [v for v in verdict.violations if v.rule.startswith("activation_exchange")], str(comp)
    sites = required_sites(program, model)
    exchanges = [o for o in verdict.obligations if o.name.startswith("activation_exchange")]
    assert len(exchanges) == len(sites) and all(o.status is Status.PROVED for o in exchanges)


@pytest.mark.parametrize("text", SPLIT)
def test_every_split_axis_needs_its_exchange_both_ways(text: str) -> None:
    model, program = program_of(text)
    sites = required_sites(program, model)
    split = {a for a, d in program.placement.mesh if int(d) > 1 and a is not Axis.DP}
    assert {s.axis for s in sites} == split
    for axis in split:
        assert {s.phase for s in sites if s.axis is axis} == {Phase.FORWARD, Phase.BACKWARD}, axis


def kernel_statistics(program: StepProgram, model: Transformer) -> set[tuple[OpKind, Axis, Phase, str]]:
    """The exchanges inside a kernel the program costs but the activation flow does not read
    (``Exchange.verified`` false: the cross-entropy's statistics over vocabulary shards)."""
    found = exchanges(program.placement, model, required=False)
    return {(e.kind, a, e.phase, e.group.name) for a, e in found if not e.verified}


def key(op: Op) -> tuple[OpKind, Axis | None, Phase, str]:
    return (op.kind, op.axis, op.phase, op.group.name)


@pytest.mark.parametrize("text", SPLIT)
def test_dropping_any_activation_collective_is_refuted(text: str) -> None:
    model, program = program_of(text)
    assert decide(parse(text), program, model).status is Status.PROVED
    kernel = kernel_statistics(program, model)
    activation_ops = [i for i, op in enumerate(program.ops) if op.state is State.ACTIVATIONS and key(op) not in kernel]
    assert activation_ops
    for i in activation_ops:
        dropped = program.with_ops(op for j, op in enumerate(program.ops) if j != i)
        op = program.ops[i]
        rules = exchange_violations(text, dropped, model)
        assert op.axis is not None
        assert rules == [
            f"activation_exchange[A.{op.group.name}, {op.axis.value}, {op.phase.value}, {op.kind.value}]"
        ], (text, op)


@pytest.mark.parametrize("text", ["tp2", "tp4xsp", "tp2xpp2xm2", "tp2xcp2xsp"])
def test_the_cross_entropy_statistics_are_costed_not_an_activation_site(text: str) -> None:
    """A vocabulary-split head's loss all-reduces three fp32 values per token (Megatron-LM's
    ``_VocabParallelCrossEntropy``): ops of the program, in the traffic table, but no site of the
    activation flow: the logits themselves are never summed, and the reference's squared-error
    loss reads no statistic. Dropping them changes no activation verdict; what the kernel must
    reduce is the scalar program's ``cross_entropy`` obligation (tests/test_scalars.py)."""
    model, program = program_of(text)
    ops = [op for op in program.ops if key(op) in kernel_statistics(program, model)]
    assert [(op.kind, op.axis, op.phase, op.group.name) for op in ops] == [
        (OpKind.ALL_REDUCE, Axis.TP, Phase.FORWARD, "logits")
    ]
    assert not any(s.group.name == "logits" for s in required_sites(program, model))
    dropped = program.with_ops(op for op in program.ops if key(op) not in kernel_statistics(program, model))
    assert exchange_violations(text, dropped, model) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "tp2",
            {
                (EMBEDDING_IO.name, Phase.FORWARD, OpKind.ALL_REDUCE, "sum"),
                (OUTPUT_IO.name, Phase.BACKWARD, OpKind.ALL_REDUCE, "sum"),
            },
        ),
        (
            "tp4xsp",
            {
                (EMBEDDING_IO.name, Phase.FORWARD, OpKind.REDUCE_SCATTER, "shard-sum"),
                (EMBEDDING_IO.name, Phase.BACKWARD, OpKind.ALL_GATHER, "gather"),
                (OUTPUT_IO.name, Phase.FORWARD, OpKind.ALL_GATHER, "gather"),
                (OUTPUT_IO.name, Phase.BACKWARD, OpKind.REDUCE_SCATTER, "shard-sum"),
            },
        ),
        (
            "tp2xpp2xm2",
            {
                (EMBEDDING_IO.name, Phase.FORWARD, OpKind.ALL_REDUCE, "sum"),
                (OUTPUT_IO.name, Phase.BACKWARD, OpKind.ALL_REDUCE, "sum"),
            },
        ),
        ("pp2xm4", set()),
    ],
)
def test_the_vocabulary_parallel_embedding_and_head_need_their_exchanges(
    text: str, expected: set[tuple[str, Phase, OpKind, str]]
) -> None:
    """tp splits the embedding's and the head's rows by vocabulary: the embedding's output and
    the head's input gradient are partial sums (Shoeybi et al. 2019, section 3); with sequence
    parallelism they are reduce-scattered and their shards gathered (Korthikanti et al. 2022,
    section 4.3)."""
    model, program = program_of(text)
    sites = {
        (s.group.name, s.phase, s.kind, s.need)
        for s in required_sites(program, model)
        if s.group is not LAYER_IO and s.axis is Axis.TP
    }
    assert sites == expected
    for group in (EMBEDDING_IO, OUTPUT_IO):
        without = program.with_ops(op for op in program.ops if op.group != group)
        rules = exchange_violations(text, without, model)
        assert sorted(rules) == sorted(
            f"activation_exchange[A.{g}, tp, {ph.value}, {k.value}]" for g, ph, k, _ in expected if g == group.name
        ), (text, group)


def test_the_pipeline_without_its_backward_send_is_refuted() -> None:
    """The bug of the gloo runs: stages got no input gradient, so only the last one trained."""
    model, program = program_of("pp2xm4")
    no_backward = program.with_ops(
        op for op in program.ops if not (op.kind is OpKind.SEND_RECV and op.phase is Phase.BACKWARD)
    )
    verdict = decide(parse("pp2xm4"), no_backward, model)
    assert verdict.condition_status(Condition.GRADIENT_INTEGRITY) is Status.REFUTED
    (v,) = verdict.violations
    assert v.rule == "activation_exchange[A.layer_io, pp, backward, send_recv]"
    assert v.witness["device_value"] != v.witness["single_device"]
    assert "input gradient" in v.explanation


@pytest.mark.parametrize(
    ("text", "kind", "refuted"),
    [
        ("tp2", OpKind.ALL_REDUCE, True),  # the partial sums summed again: t times too large
        ("tp4xsp", OpKind.REDUCE_SCATTER, True),  # the second sums other devices' freed slots
        ("tp4xsp", OpKind.ALL_GATHER, False),  # gathering whole shards again changes nothing
        ("ep2xdp2", OpKind.ALL_TO_ALL, True),  # the tokens are sent on again
        ("pp2xm4", OpKind.SEND_RECV, False),  # sending the same value twice changes nothing
    ],
)
def test_a_duplicated_exchange(text: str, kind: OpKind, refuted: bool) -> None:
    model, program = program_of(text)
    ops = list(program.ops)
    i = next(i for i, op in enumerate(ops) if op.state is State.ACTIVATIONS and op.kind is kind)
    ops.insert(i + 1, ops[i])
    assert bool(exchange_violations(text, program.with_ops(ops), model)) is refuted


@pytest.mark.parametrize("text", ["tp2", "tp4xsp", "cp2"])
def test_averaging_partial_sums_is_refuted(text: str) -> None:
    model, program = program_of(text)
    ops = [
        replace(op, reduce=Reduce.MEAN) if op.state is State.ACTIVATIONS and op.kind.is_reduction else op
        for op in program.ops
    ]
    rules = exchange_violations(text, program.with_ops(ops), model)
    assert rules and all("backward" in r or "forward" in r for r in rules)
