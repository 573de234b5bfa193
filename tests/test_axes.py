"""The axis kinds (formal/_axes.py): what each parallelism does, and the one exchange table.

Each axis is one kind that owns its facts; the step program's builder and the verifier's
activation flow read the same exchange table (formal/_exchanges.py). Expected facts come from
the published designs: data parallelism averages gradients over replicas (PyTorch DDP, Li et
al., VLDB 2020), tensor parallelism splits matrices and sums partial results (Shoeybi et al.
2019), sequence parallelism lives on the tensor-parallel group (Korthikanti et al. 2022),
context parallelism splits the sequence, expert parallelism places whole experts and routes
tokens (GShard), the pipeline splits layers into stages (Narayanan et al. 2021), and HSDP's
replicate axis is the outer one (PyTorch FSDP HYBRID_SHARD).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import compositions, models

from formal._activation_flow import required_sites
from formal._axes import Axis, Origin, Split, data_axes
from formal._exchanges import exchanges
from formal._program import derive_program
from formal._vocab import Group, Mode, OpKind, Phase, Reduce, State

# (splits data, splits the batch, splits the sequence, splits computation, pipeline, vocabulary/SP, experts)
PUBLISHED: dict[Axis, tuple[bool, bool, bool, bool, bool, bool, bool]] = {
    Axis.DP: (True, True, False, False, False, False, False),
    Axis.DPR: (True, True, False, False, False, False, False),
    Axis.TP: (False, False, False, True, False, True, False),
    Axis.PP: (False, False, False, False, True, False, False),
    Axis.CP: (True, False, True, False, False, False, False),
    Axis.EP: (True, True, False, True, False, False, True),
}

NEED_OF: dict[OpKind, frozenset[str]] = {
    OpKind.ALL_REDUCE: frozenset({"sum"}),
    OpKind.REDUCE_SCATTER: frozenset({"shard-sum"}),
    OpKind.ALL_GATHER: frozenset({"gather"}),
    OpKind.ALL_TO_ALL: frozenset({"all-to-all"}),
    OpKind.SEND_RECV: frozenset({"send"}),
}


@pytest.mark.parametrize("axis", list(Axis))
def test_each_kind_states_what_its_parallelism_does(axis: Axis) -> None:
    k = axis.kind
    facts = (
        k.splits_data,
        k.splits_batch,
        k.splits_sequence,
        k.splits_computation,
        k.is_pipeline,
        k.hosts_vocabulary and k.sequence_parallel,
        k.places_experts,
    )
    assert facts == PUBLISHED[axis]
    assert axis.splits_data == k.splits_data
    assert k.averages_gradients == k.splits_data  # DDP averages; tp and pp partial sums are added
    assert k.is_data == (axis in (Axis.DP, Axis.DPR))
    # every device holds its own samples, tokens, chunk or stage; tp's layer inputs are whole on each rank
    assert (k.activations is Mode.SHARDED) == (axis is not Axis.TP)


@pytest.mark.parametrize("axis", list(Axis))
def test_every_exchange_asks_for_what_its_collective_delivers(axis: Axis) -> None:
    for e in axis.kind.exchanges:
        assert e.need in NEED_OF[e.kind], e
        assert e.what and e.group.name


@given(st.permutations(list(Axis)))
def test_data_axes_run_the_hsdp_replicate_axis_first(axes: list[Axis]) -> None:
    assert data_axes(axes) == (Axis.DPR, Axis.DP)


@pytest.mark.parametrize(
    ("axis", "computes_sharded", "sequence_region", "tied", "origin"),
    [
        (Axis.DP, False, False, False, Origin.PARTIAL),  # each replica's samples
        (Axis.CP, False, False, False, Origin.PARTIAL),  # each rank's sequence chunk
        (Axis.EP, True, False, False, Origin.SUMMED),  # an expert sees every rank's tokens
        (Axis.EP, False, False, False, Origin.PARTIAL),  # the router and dense layers: own tokens
        (Axis.TP, True, False, False, Origin.COMPLETE),  # a matrix shard's own gradient
        (Axis.TP, False, True, False, Origin.PARTIAL),  # a norm under sequence parallelism
        (Axis.TP, False, False, False, Origin.COMPLETE),  # a replicated norm without it
        (Axis.PP, False, False, True, Origin.PARTIAL),  # a tied embedding: first and last stage
        (Axis.PP, False, False, False, Origin.COMPLETE),
    ],
)
def test_gradient_origins(
    axis: Axis, computes_sharded: bool, sequence_region: bool, tied: bool, origin: Origin
) -> None:
    got = axis.kind.gradient_origin(computes_sharded=computes_sharded, sequence_region=sequence_region, tied=tied)
    assert got is origin


def _activation_key(
    op_kind: OpKind, group: Group, axis: Axis | None, phase: Phase
) -> tuple[OpKind, Group, Axis | None, Phase]:
    return (op_kind, group, axis, phase)


@settings(max_examples=25)
@given(st.data())
def test_the_program_and_the_verifier_read_one_table(data: st.DataObject) -> None:
    """Every exchange the verifier requires is one activation op of the derived program; every
    activation op of the program is an exchange of its axis' table, and one the verifier does
    not require only where nothing computes split along that axis (a redundant reduction) or
    inside a kernel (``verified`` false: the cross-entropy's statistics)."""
    model = data.draw(models())
    comp = data.draw(compositions(model))
    pl = comp.placement(model)
    program = derive_program(pl, model)
    emitted = [
        _activation_key(op.kind, op.group, op.axis, op.phase)
        for op in program.ops
        if op.state is State.ACTIVATIONS and op.kind.is_collective
    ]
    required = [_activation_key(s.kind, s.group, s.axis, s.phase) for s in required_sites(program, model)]
    assert len(set(emitted)) == len(emitted)  # one op per exchange site
    assert set(required) <= set(emitted)
    rows = {_activation_key(e.kind, e.group, a, e.phase): e for a, e in exchanges(pl, model, required=False)}
    assert set(emitted) == set(rows)
    for key in set(emitted) - set(required):
        row, axis = rows[key], key[2]
        if not row.verified:
            assert (row.group.name, row.kind, row.phase.value) == ("logits", OpKind.ALL_REDUCE, "forward")
            continue
        assert row.split is Split.LAYER and axis is not None
        assert not any(pl.computes_sharded(axis, g) for g in pl.groups(State.PARAMETERS))
    for op in program.ops:
        if op.state is State.ACTIVATIONS and op.kind.is_reduction:
            assert op.reduce is Reduce.SUM  # partial activations are added, never averaged
