"""Properties of the cost model over random models, degrees and compositions (hypothesis)."""

from __future__ import annotations

from fractions import Fraction

import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies_costs import compositions, models, transformers

from checker._analysis import analyze
from checker._parse import parse
from checker._report import to_json
from formal._costs import memory, state_memory
from formal._model import PRECISIONS, Ffn, Model, ParameterCount, Transformer
from formal._placement import Placement, Schedule
from formal._program import group_sizes
from formal._strategies import Composition
from formal._vocab import (
    FIRST_STAGE_GROUPS,
    LAST_STAGE_GROUPS,
    MLP,
    MODEL_STATES,
    Axis,
    Group,
    Mode,
    Stage,
    State,
)

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
precisions = st.sampled_from(sorted(PRECISIONS))


def with_degree(comp: Composition, axis: Axis, degree: int) -> Composition:
    strategies = tuple(s.with_degree(degree) if s.axis is axis else s for s in comp.strategies)
    return Composition(strategies, comp.options, comp.modifiers)


def total(comp: Composition, model: Model, precision: str) -> sp.Expr:
    return analyze(comp, model, PRECISIONS[precision]).memory.total


@PROPERTY
@given(compositions(), models(), precisions, st.data())
def test_more_devices_on_an_axis_never_raise_per_device_memory(
    text: str, model: Model, precision: str, data: st.DataObject
) -> None:
    """Four real pipeline costs are excluded: under the interleaved schedule the in-flight factor
    1 + (p-1)/(p v) grows with p (Korthikanti et al. 2022, 4.2.3); GPipe going from one
    stage (plain accumulation, one micro-batch live) to several holds all m micro-batches;
    under 1F1B with m > p the first stage keeps min(p, m) micro-batches of the input
    embeddings' dropout mask, Korthikanti's sbhp/t (4.3), which grows with p; and under ZB-H1
    the last stage keeps what min(p, m) - 1 deferred weight-gradient passes read of its L/p
    layers, which grows with p (Qi et al. 2024, section 2.1)."""
    comp = parse(text)
    gpipe_from_one = "gpipe" in comp.modifiers and comp.mesh().get(Axis.PP) == 1
    one_f_one_b_grows = (
        isinstance(model, Transformer)
        and comp.options.schedule is Schedule.ONE_F_ONE_B
        and comp.options.micro_batches > comp.mesh().get(Axis.PP, 1)
    )
    zero_bubble = "zb" in comp.modifiers
    axes = [
        s.axis
        for s in comp.strategies
        if not (s.axis is Axis.PP and ("v2" in comp.modifiers or gpipe_from_one or one_f_one_b_grows or zero_bubble))
    ]
    axis = data.draw(st.sampled_from(axes))
    degree = comp.mesh()[axis]
    factor = data.draw(st.sampled_from([2, 3]))
    before = total(comp, model, precision)
    after = total(with_degree(comp, axis, degree * factor), model, precision)
    assert sp.nsimplify(after - before) <= 0, (text, axis, before, after)


def _group_bytes(pl: Placement, model: Model, precision: str, stage: Stage) -> dict[tuple[State, Group], sp.Expr]:
    sizes = group_sizes(model)
    out: dict[tuple[State, Group], sp.Expr] = {}
    for state in MODEL_STATES:
        for g, v in state_memory(pl, state, sizes, PRECISIONS[precision], stage).by_group:
            out[(state, g)] = v
    return out


@PROPERTY
@given(compositions(pipeline=False), models(), precisions, st.data())
def test_devices_along_an_axis_hold_the_unsharded_state_between_them(
    text: str, model: Model, precision: str, data: st.DataObject
) -> None:
    comp = parse(text)
    axis = data.draw(st.sampled_from([s.axis for s in comp.strategies]))
    d = comp.mesh()[axis]
    pl = comp.placement(model)
    sharded = _group_bytes(pl, model, precision, Stage.FIRST)
    whole = _group_bytes(with_degree(comp, axis, 1).placement(model), model, precision, Stage.FIRST)
    for (state, g), value in sharded.items():
        mode = pl.mode(state, g, axis)
        if pl.local_mode(state, g) in (Mode.OFFLOADED, Mode.MATERIALIZED):
            assert value == 0 and whole[(state, g)] == 0
        elif mode.is_sharded:
            assert sp.nsimplify(d * value - whole[(state, g)]) == 0, (text, state, g)
        else:
            assert sp.nsimplify(value - whole[(state, g)]) == 0, (text, state, g)


@PROPERTY
@given(transformers(), precisions, st.sampled_from([2, 3, 4, 8]), st.sampled_from(["dp2", "zero32", "tp2xzero12"]))
def test_pipeline_stages_hold_the_whole_model_between_them(
    model: Transformer, precision: str, p: int, rest: str
) -> None:
    """first + (p-2) middle + last stages hold every parameter once (a tied embedding twice)."""
    comp = parse(f"{rest}xpp{p}")
    pl = comp.placement(model)
    whole = _group_bytes(parse(f"{rest}xpp1").placement(model), model, precision, Stage.FIRST)
    stages = {st_: _group_bytes(pl, model, precision, st_) for st_ in (Stage.FIRST, Stage.MIDDLE, Stage.LAST)}
    for key, value in whole.items():
        summed = stages[Stage.FIRST][key] + (p - 2) * stages[Stage.MIDDLE][key] + stages[Stage.LAST][key]
        copies = 2 if key[1] in pl.tied else 1
        assert sp.nsimplify(summed - copies * value) == 0, key


def _expected_factor(pl: Placement, state: State, g: Group, stage: str) -> sp.Expr:
    """What the modes imply, written out again from docs/semantics.md's "Modes" table (not the cost code)."""
    if pl.local_mode(state, g) in (Mode.OFFLOADED, Mode.MATERIALIZED):
        return sp.Integer(0)
    out = sp.Integer(1)
    for axis, d in pl.mesh:
        mode = pl.mode(state, g, axis)
        if axis is Axis.PP and d != 1:
            if g in FIRST_STAGE_GROUPS or g in LAST_STAGE_GROUPS:
                home = "first" if g in FIRST_STAGE_GROUPS else "last"
                on_stage = stage == home or (mode is Mode.REPLICATED and stage in ("first", "last"))
                out *= 1 if on_stage else 0
            else:
                out *= sp.Rational(1, int(d)) if mode.is_sharded else 1
            continue
        if mode in (Mode.SHARDED, Mode.SHARDED_GATHER):
            out *= sp.Rational(1, int(d))
        elif mode in (Mode.OFFLOADED, Mode.MATERIALIZED):
            out *= 0
    return out


@PROPERTY
@given(compositions(), models(), precisions)
def test_memory_is_what_the_placement_implies_axis_by_axis(text: str, model: Model, precision: str) -> None:
    comp = parse(text)
    pl = comp.placement(model)
    rec = PRECISIONS[precision]
    sizes = model.group_elements()
    for stage in (Stage.FIRST, Stage.LAST):
        mem = memory(pl, model, rec, group_sizes(model), stage)
        by_state = {State.PARAMETERS: mem.parameters, State.GRADIENTS: mem.gradients, State.OPTIMIZER: mem.optimizer}
        host = sp.Integer(0)
        for state, got in by_state.items():
            expected = sp.Integer(0)
            for g in pl.groups(state):
                expected += sizes[g] * rec.bytes_of(state) * _expected_factor(pl, state, g, stage)
                if pl.local_mode(state, g) is Mode.OFFLOADED:
                    local = tuple((k, v) for k, v in pl.local if k != (state, g))
                    on_device = Placement(pl.mesh, pl.modes, local, pl.compute_sharded, pl.options, pl.tied)
                    host += sizes[g] * rec.bytes_of(state) * _expected_factor(on_device, state, g, stage)
            assert sp.nsimplify(got.total - expected) == 0, (text, stage, state)
        assert sp.nsimplify(mem.host - host) == 0, (text, stage)
        assert sp.nsimplify(mem.model_states - sum(by_state[s].total for s in by_state)) == 0


@PROPERTY
@given(compositions(), models(), precisions)
def test_costs_are_exact_and_reported_as_whole_bytes(text: str, model: Model, precision: str) -> None:
    a = analyze(parse(text), model, PRECISIONS[precision])
    exact = [a.memory.model_states, a.memory.total, a.memory.host, *(t.bytes for t in a.traffic)]
    exact += [x for x in (a.memory.activations, a.memory.buffers) if x is not None]
    for value in exact:  # a concrete composition's costs are plain exact numbers: no float, no sympy
        assert type(value) is int or type(value) is Fraction, (text, value)
        assert type(value) is int or value.denominator != 1, (text, value)  # whole values are ints
    doc = to_json(a)
    for key, value in doc["memory"]["per_device"].items():
        assert value is None or type(value) is int, key
    ints = a.memory.as_ints()
    assert ints["model_states"] == sp.ceiling(a.memory.model_states)
    assert all(type(c["bytes"]) is int and c["bytes"] >= 0 for c in doc["communication"]["collectives"])
    assert type(doc["communication"]["per_device_per_step"]) is int
    assert (doc["memory"]["per_device"]["activations"] is None) == isinstance(model, ParameterCount)


@PROPERTY
@given(compositions(pipeline=False, modifiers=False), st.integers(1, 1000), precisions)
def test_divisible_sizes_give_integer_bytes(text: str, k: int, precision: str) -> None:
    """A count divisible by every degree's product shards into whole elements and bytes."""
    psi = k * 2**12 * 3**4
    a = analyze(parse(text), ParameterCount(psi), PRECISIONS[precision])
    assert type(a.memory.model_states) is int, (text, a.memory.model_states)
    for t in a.traffic:
        assert type(t.elements) is int, (text, t)


def test_a_third_of_a_shard_stays_rational() -> None:
    """Regression: ``sp.nsimplify`` turned 9850880/3 bytes (an MLP over 3 pipeline stages)
    into a product of irrational powers; costs now stay exact rationals."""
    model = Transformer(
        "r",
        layers=4,
        hidden=320,
        heads=8,
        kv_heads=1,
        vocab=8,
        seq=1,
        learned_positions=False,
        tied_embeddings=False,
        final_norm=False,
        ffn_kind=Ffn.SWIGLU,
    )
    a = analyze(parse("dp1xpp3xm16"), model, PRECISIONS["deepspeed"])
    mlp = dict(a.memory.parameters.by_group)[MLP]
    assert mlp == sp.Rational(model.group_elements()[MLP] * 2, 3)
    assert isinstance(a.memory.model_states, int | Fraction)
