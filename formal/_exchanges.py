"""Which activation exchanges a placement has: the axis kinds' one table, read for one placement.

Each axis kind lists its exchanges (``formal._axes.AxisKind.exchanges``); this module decides
which of them a placement's split brings, once, for both readers: the step program's builder
(``formal._program``, ``required=False``: the ops it emits) and the verifier's activation flow
(``formal._activation_flow``, ``required=True``: the exchanges z3 must find completed). The two
differ in one place only: a split layer's exchange (``Split.LAYER``) along an expert axis is
emitted whenever the axis is split, and required only when some parameter group's computation is
split along it. Along a tensor axis both follow whether the layer's blocks are split
(``_matrix_blocks_split``): over whole blocks nothing is summed.
"""

from __future__ import annotations

from formal._axes import Axis, Exchange, Place, Split
from formal._model import Model, Transformer
from formal._placement import Placement, Recompute
from formal._terms import ATTENTION, EMBEDDING, EXPERTS, HEAD, LAYER_IO, MLP, Group, Phase, State
from formal.errors import InputError

A = State.ACTIVATIONS


def sequence_split(pl: Placement, group: Group, axis: Axis) -> bool:
    """Whether sequence parallelism splits the activation ``group`` along ``axis`` (a group the
    placement does not list follows the layer inputs, ``A.layer_io``)."""
    keys = set(pl.keys())
    source = group if (A, group) in keys else LAYER_IO
    return (A, source) in keys and pl.mode(A, source, axis).is_sharded


def head_group(pl: Placement) -> Group:
    """The group the vocabulary-parallel head computes with: the head, or the tied embedding."""
    return HEAD if HEAD in pl.groups(State.PARAMETERS) else EMBEDDING


def exchanged_group(pl: Placement, axis: Axis, exchange: Exchange) -> Group:
    """The activation whose size the exchange moves: its own group in the layers; at the input
    and output layers the activation sequence parallelism splits there (``sequence_split``)."""
    if exchange.place is Place.LAYERS:
        return exchange.group
    keys = set(pl.keys())
    return exchange.group if (A, exchange.group) in keys else LAYER_IO


def _matrix_blocks_split(pl: Placement, axis: Axis) -> bool:
    """Whether a layer's blocks are split by rows and columns along ``axis`` (Megatron-LM's f/g
    pairs around attention and the FFN, Shoeybi et al. 2019, section 3): then each block's
    output is a partial sum to exchange. With neither block split (and no sequence parallelism)
    every rank computes whole values and there is nothing to sum: summing would count each layer
    d times. One block split alone, or sequence parallelism over whole blocks, is not modelled."""
    blocks = {ATTENTION, MLP, EXPERTS} & set(pl.groups(State.PARAMETERS))
    split = {pl.computes_sharded(axis, g) for g in blocks}
    # Sequence parallelism is the modifier, or a placement that shards the layer inputs along the
    # axis (a user strategy's A = "S" along tp): either needs the blocks split.
    sequence = pl.options.sequence_parallel or sequence_split(pl, LAYER_IO, axis)
    if True not in split and not sequence:
        return False
    if split != {True}:
        raise InputError(
            f"{axis.value}: the computation of attention and mlp must both be split (or neither, without sp "
            "or sequence-sharded layer inputs)"
        )
    return True


def _split_computation(pl: Placement, axis: Axis, split: Split, required: bool) -> bool:
    match split:
        case Split.NONE:
            return True
        case Split.LAYER:
            if axis.kind.splits_matrices:
                return _matrix_blocks_split(pl, axis)
            return not required or any(pl.computes_sharded(axis, g) for g in pl.groups(State.PARAMETERS))
        case Split.INPUT:
            return pl.computes_sharded(axis, EMBEDDING)
        case Split.OUTPUT:
            return pl.computes_sharded(axis, head_group(pl))
        case _:
            raise AssertionError(split)


def _applies(pl: Placement, axis: Axis, exchange: Exchange, required: bool) -> bool:
    groups = pl.groups(State.PARAMETERS)
    if exchange.place is Place.INPUT and EMBEDDING not in groups:
        return False
    if exchange.place is Place.OUTPUT and head_group(pl) not in groups:
        return False
    if exchange.recompute and pl.options.recompute is not Recompute.FULL:
        return False
    if exchange.sequence is not None and sequence_split(pl, exchange.group, axis) != exchange.sequence:
        return False
    return _split_computation(pl, axis, exchange.split, required)


def _split_axes(pl: Placement) -> list[Axis]:
    """The axes of degree other than 1 whose kind has exchanges, in the kinds' exchange order."""
    found = [a for a in pl.axes if a.kind.exchanges and pl.degree(a) != 1]
    return sorted(found, key=lambda a: a.kind.exchange_rank)


def exchanges(pl: Placement, model: Model, *, required: bool) -> list[tuple[Axis, Exchange]]:
    """Every exchange the placement's splits bring, axis by axis in table order (no model layers: none)."""
    if not isinstance(model, Transformer):
        return []
    return [
        (a, e)
        for a in _split_axes(pl)
        for e in a.kind.exchanges
        if (e.verified or not required) and _applies(pl, a, e, required)
    ]


def program_exchanges(pl: Placement, model: Model, phase: Phase) -> list[tuple[Axis, Exchange]]:
    """The exchanges the program emits in ``phase``, in the order it runs them: forward the input
    layer's, every layer's (axis by axis), the output layer's; backward the reverse by place."""
    found = [(a, e) for a, e in exchanges(pl, model, required=False) if e.phase is phase]
    places = (Place.INPUT, Place.LAYERS, Place.OUTPUT)
    if phase is Phase.BACKWARD:
        places = places[::-1]
    return [(a, e) for place in places for a, e in found if e.place is place]


__all__ = ["exchanged_group", "exchanges", "head_group", "program_exchanges", "sequence_split"]
