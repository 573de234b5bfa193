"""The executable reference as an oracle: defects it had, the richer model, and disagreement never silent.

Every simulation here is bit-for-bit (``Arithmetic.FIELD``) against single-device training of the
same reference model (``formal._reference.train_single_device``), which is the expected value.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies_sim import mutations

from checker._parse import parse
from checker._toml import loads
from formal._program import Op, StepProgram, derive_program
from formal._reference import (
    PRIME,
    Arithmetic,
    Numbers,
    ReferenceModel,
    initial_parameters,
    loss_and_gradients,
    make_data,
)
from formal._sim_mesh import _Layout, _Mesh
from formal._simulator import reference_for, simulate, simulate_program
from formal._smt import decide
from formal._strategies import Composition
from formal._verdict import Status
from formal._vocab import EXPERTS, HEAD, ROUTER, ROW_BIAS, Axis, Group, OpKind, Phase, Reduce, State

FIELD, FLOAT = Numbers(Arithmetic.FIELD), Numbers(Arithmetic.FLOAT64)


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


# --- the row-parallel bias (Megatron's RowParallelLinear adds it after the reduction) ----------


def _without(program: StepProgram, kind: OpKind, state: State, group: Group, axis: Axis) -> StepProgram:
    kept = [
        op
        for op in program.ops
        if not (op.kind is kind and op.state is state and op.group == group and op.axis is axis)
    ]
    assert len(kept) < len(program.ops)
    return program.with_ops(kept)


@pytest.mark.parametrize("text", ["tp2xsp", "tp2xspxdp2"])
def test_forgetting_the_row_parallel_bias_reduction_diverges_and_z3_refutes_it(text: str) -> None:
    """Under sequence parallelism each tp rank adds the row-parallel bias to its sequence shard, so
    its gradient is a partial sum across tp (Korthikanti et al. 2022, section 4.2.2; Megatron-LM
    all-reduces it with the LayerNorm gradients). A model without biases could not see this."""
    composition, model, program = _program(text)
    assert model.bias and ROW_BIAS in model.groups()
    broken = _without(program, OpKind.ALL_REDUCE, State.GRADIENTS, ROW_BIAS, Axis.TP)
    result = simulate_program(broken, model)
    assert result.divergence is not None
    assert (result.divergence.state, result.divergence.group) == (State.GRADIENTS, ROW_BIAS)
    verdict = decide(composition, broken, model.transformer())
    assert verdict.status is Status.REFUTED and any("row_bias" in v.rule for v in verdict.violations)
    # the corrected (derived) program: both sides say valid
    assert simulate_program(program, model).matches
    assert decide(composition, program, model.transformer()).status is Status.PROVED


def test_without_sequence_parallelism_the_row_bias_gradient_is_complete_on_every_tp_rank() -> None:
    """Without SP the bias is added to the whole (all-reduced) output on every rank: no reduction."""
    _, model, program = _program("tp2")
    assert not any(op.group == ROW_BIAS and op.axis is Axis.TP and op.state is State.GRADIENTS for op in program.ops)
    assert simulate_program(program, model).matches


# --- the reference model itself ---------------------------------------------------------------


@pytest.mark.parametrize("experts", [0, 4])
def test_every_gradient_of_the_richer_model_is_the_derivative_of_its_loss(experts: int) -> None:
    """float64 central differences on random real weights, twelve elements of every group
    (biases, router and experts included), of the squared-error loss."""
    model = ReferenceModel(layers=2, hidden=4, heads=2, ffn=4, vocab=8, seq=4, tied=experts == 0, experts=experts)
    rng = np.random.default_rng(1)
    p = {g: rng.normal(size=model.size(g)) * 0.5 for g in model.groups()}
    batch = make_data(model, 2, 1, FLOAT, 0)[0]
    _, grads = loss_and_gradients(model, p, batch, FLOAT)
    for g in model.groups():
        for i in rng.choice(model.size(g), size=min(12, model.size(g)), replace=False):
            up = {k: v.copy() for k, v in p.items()}
            down = {k: v.copy() for k, v in p.items()}
            up[g][i] += 1e-6
            down[g][i] -= 1e-6
            rise = loss_and_gradients(model, up, batch, FLOAT)[0] - loss_and_gradients(model, down, batch, FLOAT)[0]
            numeric = float(rise) / 2e-6
            assert abs(numeric - grads[g][i]) < 1e-6 * max(1.0, abs(numeric)), (g, i)


def test_the_loss_is_the_squared_error_of_the_logits() -> None:
    """Independent of the backward: a model whose head is zero predicts zero logits, so its loss is
    the mean over tokens of the targets' squared norm (computed here from the data alone)."""
    model = ReferenceModel(layers=1, hidden=4, heads=2, ffn=4, vocab=4, seq=4, tied=False)
    p = initial_parameters(model, FIELD, 0)
    p[HEAD] = FIELD.zeros(model.size(HEAD))
    batch = make_data(model, 2, 1, FIELD, 0)[0]
    loss, _ = loss_and_gradients(model, p, batch, FIELD)
    targets = np.where(batch.targets > PRIME // 2, batch.targets - PRIME, batch.targets)
    total = Fraction(int((targets.astype(np.int64) ** 2).sum()), batch.tokens.size)
    assert int(loss) == total.numerator % PRIME * pow(total.denominator, -1, PRIME) % PRIME


def test_the_groups_have_the_sizes_the_cost_model_counts() -> None:
    for model in (ReferenceModel(), ReferenceModel(bias=False), ReferenceModel(experts=4, tied=False)):
        sizes = model.transformer().group_elements()
        assert {g: model.size(g) for g in model.groups()} == sizes
        for g in model.groups():  # the tensors tile the group's flat vector exactly once
            flat = np.sort(np.concatenate([t.index.ravel() for t in model.tensors(g)]))
            assert (flat == np.arange(sizes[g])).all(), g


# --- experts and expert parallelism -------------------------------------------------------------


@pytest.mark.parametrize("text", ["ep2", "dp2xep2", "zero32xep2", "ep2xpp2xm2", "ep4", "tp2xep2", "tp2xspxdp2xep2"])
@pytest.mark.parametrize("tied", [True, False])
def test_expert_parallelism_trains_like_one_device_and_costs_what_the_model_says(text: str, tied: bool) -> None:
    """Experts split along ep (each rank holds and updates whole experts), tokens routed to their
    expert's rank and back by all-to-all, bit for bit against one device training every expert."""
    composition = parse(text)
    model = reference_for(composition, ReferenceModel(tied=tied))
    assert model.experts % composition.mesh()[Axis.EP] == 0 and EXPERTS in model.groups()
    result = simulate(composition, model, steps=2)
    assert result.matches, str(result.divergence)
    assert not result.cost_mismatches, result.cost_mismatches


def test_each_ep_rank_computes_only_its_own_experts() -> None:
    _, model, program = _program("ep2")
    pl = program.placement
    mesh = _Mesh(pl)
    layout = _Layout(model, pl, mesh)
    per_expert = model.size(EXPERTS) // model.experts
    for dev in mesh.devices:
        owned = set(layout.compute(EXPERTS, dev) // per_expert)  # expert-major flat order
        rank = mesh.coord(dev, Axis.EP)
        assert owned == set(range(rank * model.experts // 2, (rank + 1) * model.experts // 2))


@pytest.mark.parametrize("phase", [Phase.FORWARD, Phase.BACKWARD])
@pytest.mark.parametrize("change", ["drop", "duplicate"])
def test_the_token_all_to_all_runs_as_the_program_says(phase: Phase, change: str) -> None:
    """Without the dispatch a position stays on its rank, which does not hold its expert; a second
    all-to-all sends it back (the exchange is a transpose). Both sides say invalid."""
    composition, model, program = _program("dp2xep2")
    ops = list(program.ops)
    i = next(k for k, op in enumerate(ops) if op.kind is OpKind.ALL_TO_ALL and op.phase is phase)
    if change == "drop":
        del ops[i]
    else:
        ops.insert(i, ops[i])
    mutated = program.with_ops(ops)
    assert not simulate_program(mutated, model).matches
    assert decide(composition, mutated, model.transformer()).status is Status.REFUTED


def test_summed_expert_gradients_need_their_scale() -> None:
    """Each expert sums the per-rank means of every ep rank's tokens: without the 1/ep it is ep times
    the single-device gradient."""
    composition, model, program = _program("ep2")
    broken = _without(program, OpKind.SCALE, State.GRADIENTS, EXPERTS, Axis.EP)
    d = simulate_program(broken, model).divergence
    assert d is not None and (d.state, d.group) == (State.GRADIENTS, EXPERTS)
    assert decide(composition, broken, model.transformer()).status is Status.REFUTED


EXPERT_PARALLEL = (
    "ep2",
    "dp2xep2",
    "zero12xep2",
    "zero22xep2xm2",
    "zero32xep2",
    "fsdp2xep2",
    "ep2xpp2",
    "ep2xcp2",
    "ep4",
    "ep2xoffload",
    "hsdp2xdpr2xep2",
    "tp2xep2",
    "tp2xspxep2",
    "zero12xtp2xspxep2",
)


@st.composite
def expert_parallel_programs(draw: st.DrawFn) -> tuple[Composition, ReferenceModel, StepProgram, str]:
    """A library composition with ep, its reference model (tied or not) and one mutation of its program."""
    composition = parse(draw(st.sampled_from(EXPERT_PARALLEL)))
    model = reference_for(composition, ReferenceModel(tied=draw(st.booleans())))
    transformer = model.transformer()
    program = derive_program(composition.placement(transformer), transformer)
    mutated, what = draw(mutations(program))
    return composition, model, mutated, what


@settings(max_examples=max(10, settings().max_examples // 5))
@given(expert_parallel_programs())
def test_z3_proves_a_mutated_expert_parallel_program_iff_it_trains_like_one_device(
    case: tuple[Composition, ReferenceModel, StepProgram, str],
) -> None:
    """The differential property on expert parallelism (z3's unknown is never taken as valid; a
    refuted program that matches is run on two fresh seeds before it counts as a disagreement)."""
    composition, model, program, what = case
    verdict = decide(composition, program, model.transformer())
    assume(verdict.status is not Status.UNKNOWN)
    matches = simulate_program(program, model, steps=1).matches
    if verdict.status is Status.REFUTED and matches:
        matches = all(simulate_program(program, model, steps=1, seed=s).matches for s in (101, 202))
    assert (verdict.status is Status.PROVED) == matches, (str(composition), what, verdict.status)


def test_full_recomputation_replays_the_token_all_to_alls_in_the_cost_model_too() -> None:
    """Megatron-LM's full recomputation checkpoints whole layers, the MoE token dispatcher's
    all-to-alls included, so the backward runs them twice: four per layer, as the simulator sends.
    (The cost model once counted two per layer in backward: it was wrong, the simulator right.)"""
    composition = parse("ep2xrecompute")
    model = reference_for(composition)
    transformer = model.transformer()
    program = derive_program(composition.placement(transformer), transformer)
    # Per micro-batch and layer: dispatch and combine in the forward, their replay and the
    # backward's own two in the backward (one micro-batch, no pipeline: every layer on the device).
    sent = {
        phase: sum(op.count for op in program.ops if op.kind is OpKind.ALL_TO_ALL and op.phase is phase)
        for phase in (Phase.FORWARD, Phase.BACKWARD)
    }
    layers = transformer.layers * composition.options.micro_batches
    assert sent == {Phase.FORWARD: 2 * layers, Phase.BACKWARD: 4 * layers}
    result = simulate(composition, model, steps=1)
    assert result.matches, str(result.divergence)
    assert not result.cost_mismatches, result.cost_mismatches


@pytest.mark.parametrize("text", ["tp2", "tp2xsp"])
def test_experts_split_along_tp_train_like_one_device(text: str) -> None:
    """Each expert split like the MLP (fc1 by columns, fc2 by rows), its output reduced across tp
    before the router's gate scales it; the router replicated."""
    composition = parse(text)
    model = reference_for(composition, ReferenceModel(experts=4))
    result = simulate(composition, model, steps=2)
    assert result.matches, str(result.divergence)
    assert not result.cost_mismatches, result.cost_mismatches


def test_sequence_parallel_router_gradients_are_partial_along_tp() -> None:
    """Under sequence parallelism the router scores each rank's sequence shard (Megatron-LM's MoE
    router runs on the sequence-parallel input), so its gradient needs the reduction across tp."""
    composition, model, program = _program("tp2xsp", ReferenceModel(experts=4))
    broken = _without(program, OpKind.ALL_REDUCE, State.GRADIENTS, ROUTER, Axis.TP)
    d = simulate_program(broken, model).divergence
    assert d is not None and (d.state, d.group) == (State.GRADIENTS, ROUTER)
    assert decide(composition, broken, model.transformer()).status is Status.REFUTED


EXPERTS_REPLICATED_ALONG_EP = """
[strategies.ep-rep]
axis = "ep"
P = "R"
O = "R"
G = "R"
compute_sharded = ["experts"]
"""


def _program_of(composition: Composition) -> tuple[ReferenceModel, StepProgram]:
    model = reference_for(composition, ReferenceModel())
    transformer = model.transformer()
    return model, derive_program(composition.placement(transformer), transformer)


@pytest.mark.parametrize("degree", [2, 4])
def test_experts_replicated_along_ep_but_computed_split_diverge(degree: int) -> None:
    """Each ep rank computes only its own experts, yet every rank holds (G replicated) and updates
    (O replicated) all of them: nothing brings the other ranks' expert gradients, so a rank reads
    zeros where single-device training has the gradient. The simulator sees it."""
    composition = parse(f"ep-rep{degree}", loads(EXPERTS_REPLICATED_ALONG_EP).factories())
    model, program = _program_of(composition)
    d = simulate_program(program, model).divergence
    assert d is not None and (d.step, d.phase, d.state, d.group) == (1, "optimizer", State.GRADIENTS, EXPERTS)
    assert d.got == FIELD.as_text(0) != d.expected


def test_z3_refutes_experts_replicated_along_ep_but_computed_split() -> None:
    composition = parse("ep-rep2", loads(EXPERTS_REPLICATED_ALONG_EP).factories())
    model, program = _program_of(composition)
    """Each ep rank computes the gradient of its own experts only; held as a replica, the other
    experts' gradient is missing on it (the simulator's divergence above): z3 refutes it by the
    rule that split computation needs a sharded gradient, naming ep."""
    verdict = decide(composition, program, model.transformer())
    assert verdict.status is Status.REFUTED
    assert any("split_compute_needs_sharded_gradient[ep]" in str(v) for v in verdict.violations)


def test_a_reduction_along_pp_of_a_group_on_one_stage_is_judged_not_crashed() -> None:
    """An untied head lives on the last stage only: a mean all-reduce of its gradient along pp
    pairs the last stage's gradient with nothing, and halves it. Single-device training has the
    gradient whole, so the program is wrong: the simulator diverges (it used to raise on the
    slices' different sizes, which crashed the differential test's workers) and z3 refutes."""
    composition = parse("pp2xm2")
    model = ReferenceModel(tied=False)
    transformer = model.transformer()
    program = derive_program(composition.placement(transformer), transformer)
    ops = list(program.ops)
    step = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPTIMIZER_STEP)
    ops.insert(step, Op(OpKind.ALL_REDUCE, State.GRADIENTS, HEAD, Axis.PP, Phase.GRAD_SYNC, reduce=Reduce.MEAN))
    wrong = program.with_ops(ops)
    result = simulate_program(wrong, model)
    assert result.divergence is not None and result.divergence.group == HEAD
    assert decide(composition, wrong, transformer).status is Status.REFUTED
