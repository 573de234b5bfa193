"""The mesh axes and the kind of parallelism each one is (docs/semantics.md, "Axis kinds").

Each ``Axis`` is one ``AxisKind`` (``axis.kind``), and the kind owns what the axis does: whether
its devices see different samples or tokens (so their gradient contributions are partial and
averaged, as PyTorch DDP's all-reduce divides by the world size), whether it splits a layer's
computation (Megatron-LM's column/row-parallel matrices, GShard's experts), whether it is the
pipeline (stages, sends, a stage's share of the layers), and which activation exchanges a split
along it needs (``AxisKind.exchanges``: the one table that the step program's builder,
``formal._exchanges``/``formal._program``, and the verifier's activation flow,
``formal._activation_flow``, both read). Consumers ask these properties; only this module and
``formal._vocab`` (which re-exports it) say which axis name is which kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from formal._terms import EMBEDDING_IO, LAYER_IO, LINEAR_INNER, LOGITS, OUTPUT_IO, Group, Mode, OpKind, Phase


class Origin(StrEnum):
    """What one device holds of a gradient along one axis right after backward."""

    COMPLETE = "complete"  # the value itself (contributions not split along the axis)
    PARTIAL = "partial"  # a summand: device i holds contribution i
    SUMMED = "summed"  # every device holds the sum of all contributions, each locally normalised


class Place(StrEnum):
    """Where in the model an activation exchange sits."""

    LAYERS = "layers"  # every transformer layer, on every pipeline stage
    INPUT = "input"  # the vocabulary-parallel embedding, on the first stage
    OUTPUT = "output"  # the vocabulary-parallel head (or tied embedding), on the last stage


class Split(StrEnum):
    """Which split computation makes an exchange necessary (beyond the axis having degree > 1)."""

    NONE = "none"  # the split of the axis alone
    LAYER = "layer"  # some parameter group computes sharded along the axis; the program emits it regardless
    INPUT = "input"  # the embedding computes sharded (its output is a partial sum)
    OUTPUT = "output"  # the head (or tied embedding) computes sharded (its input gradient is a partial sum)


class Width(StrEnum):
    """Elements per token of the exchanged tensor."""

    HIDDEN = "hidden"  # h
    KEYS_VALUES = "keys_values"  # 2 x kv_heads x head_dim
    ROUTED = "routed"  # h x top_k (every token goes to each of its experts)
    TOKEN = "token"  # 1 (one statistic per token: the loss's)


@dataclass(frozen=True)
class Exchange:
    """One kind of activation exchange a split along an axis needs, in one phase.

    ``need`` says what every device must end with (the verifier's obligation): ``sum`` (the
    whole sum of partial contributions), ``shard-sum`` (its shard of it), ``gather`` (every
    shard), ``all-to-all`` (the tokens addressed to it), ``send`` (the neighbour stage's tensor).
    ``sequence``: only with (True) or only without (False) sequence parallelism at the exchanged
    activation, or either (None); ``recompute``: only under full recomputation. ``per_layer``:
    ops per layer and micro-batch (0: once per micro-batch); ``replayed``: full recomputation
    runs it again in backward (the count doubles); ``per_boundary``: once per pipeline boundary
    crossing the schedule makes. ``calls``: collectives per micro-batch of an exchange made once
    per micro-batch (the loss's three statistics).
    ``verified``: False for an exchange inside an op's own kernel rather than between the
    placement's pieces (the vocabulary-parallel cross-entropy's statistics): the program emits
    and costs it, the verifier's activation flow does not read it (the scalar program's
    ``cross_entropy`` op states what the kernel reduces). ``what`` names the activation for the
    verifier, ``note`` the op.
    """

    phase: Phase
    group: Group
    kind: OpKind
    need: str
    what: str
    place: Place = Place.LAYERS
    split: Split = Split.NONE
    sequence: bool | None = None
    recompute: bool = False
    width: Width = Width.HIDDEN
    per_layer: int = 0
    replayed: bool = False
    per_boundary: bool = False
    calls: int = 1
    verified: bool = True
    note: str = ""


@dataclass(frozen=True)
class AxisKind:
    """What a parallelism does along its axis.

    ``splits_data``: devices see different samples or tokens of the batch, so every gradient is a
    partial contribution, averaged by default (DDP). ``splits_batch``: they see different samples
    (the micro-batch size b is one replica's already; cp splits tokens within a sample).
    ``splits_sequence``: the sequence is split (the activations' per-sample length).
    ``splits_computation``: a layer's computation is split (groups in ``compute_sharded``).
    ``is_pipeline``: layers are split into stages (memory by stage, sends between them).
    ``hosts_vocabulary``: the embedding and head are vocabulary-parallel along it (Shoeybi et al.
    2019, section 3). ``sequence_parallel``: sequence parallelism splits its replicated layer
    activations along the sequence (Korthikanti et al. 2022, section 4.2.2). ``places_experts``:
    whole experts are placed along it (GShard), so the model must have them. ``splits_matrices``:
    a group computed split along it keeps a slice of its matrices' rows or columns (Megatron's
    column and row parallel linears), a structural piece rather than a flat shard. ``activations``:
    how a strategy on the axis holds activations unless it says otherwise: split (each device
    its own samples, tokens, sequence chunk or stage's layers), or whole on every rank (the
    tensor-parallel layer inputs, Megatron's replicated ``f``/``g`` boundaries).
    ``data_order``: position among the data axes (the outer HSDP replicate axis first), or None.
    ``exchanges``: the activation exchanges a split along the axis brings (``Exchange``), run in
    ``exchange_rank`` order among the axes (tensor, context, expert, pipeline).
    """

    name: str
    splits_data: bool = False
    splits_batch: bool = False
    splits_sequence: bool = False
    splits_computation: bool = False
    is_pipeline: bool = False
    hosts_vocabulary: bool = False
    sequence_parallel: bool = False
    places_experts: bool = False
    splits_matrices: bool = False
    activations: Mode = Mode.SHARDED
    data_order: int | None = None
    exchanges: tuple[Exchange, ...] = ()
    exchange_rank: int = 0

    @property
    def averages_gradients(self) -> bool:
        """Whether a gradient reduction along the axis defaults to the mean (data axes) or the sum."""
        return self.splits_data

    @property
    def is_data(self) -> bool:
        """A data-parallel axis (dp or the HSDP replicate axis): the strategies of the data kind live here."""
        return self.data_order is not None

    def gradient_origin(self, *, computes_sharded: bool, sequence_region: bool, tied: bool) -> Origin:
        """A parameter group's gradient on one device after backward (docs/semantics.md, rule 2).

        ``computes_sharded``: the group's computation is split along the axis;
        ``sequence_region``: the group is applied inside the sequence-parallel region while
        sequence parallelism is on along the axis (its inputs are sequence shards);
        ``tied``: the group is tied across pipeline stages (embedding and head).
        """
        if self.splits_data and self.splits_computation:
            # Tokens are split; an expert receives (all-to-all) the tokens of every rank, each
            # rank's loss normalised by its own batch: the sum of all contributions.
            return Origin.SUMMED if computes_sharded else Origin.PARTIAL
        if self.splits_data:
            return Origin.PARTIAL
        if self.splits_computation:
            return Origin.PARTIAL if sequence_region and not computes_sharded else Origin.COMPLETE
        if self.is_pipeline:
            return Origin.PARTIAL if tied else Origin.COMPLETE
        return Origin.COMPLETE


_F, _B = Phase.FORWARD, Phase.BACKWARD
_AR, _RS, _AG = OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER
_GATHER_WHAT = "sequence shards read whole by the next column-parallel matrix"
_EMBED_WHAT = "vocabulary-parallel embedding output (partial sums of each rank's rows)"
_EMBED_NOTE = "vocabulary-parallel embedding output (partial sums), first stage"
_HEAD_WHAT = "vocabulary-parallel head's input gradient (partial sums over vocabulary shards)"
_HEAD_NOTE = "vocabulary-parallel head's input gradient (partial sums), last stage"


def _tensor_layer(phase: Phase) -> tuple[Exchange, ...]:
    """Megatron's f/g operators, one per attention and per MLP block each way (Shoeybi et al.
    2019, section 3); under sequence parallelism an all-gather before and a reduce-scatter after
    each block, the same volume (Korthikanti et al. 2022, section 4.2.2)."""
    partial = "row-parallel outputs" if phase is _F else "column-parallel input gradients"

    def row(kind: OpKind, need: str, what: str, sequence: bool) -> Exchange:
        return Exchange(
            phase, LAYER_IO, kind, need, what, split=Split.LAYER, sequence=sequence, per_layer=2, replayed=True
        )

    return (
        row(_AG, "gather", _GATHER_WHAT, True),
        row(_RS, "shard-sum", f"{partial} (partial sums, to sequence shards)", True),
        row(_AR, "sum", f"{partial} (partial sums)", False),
    )


# The vocabulary-parallel embedding (first stage) and head (last stage): rows split by vocabulary
# (Shoeybi et al. 2019, section 3), inputs and outputs split by sequence under sequence
# parallelism (Korthikanti et al. 2022, section 4.3).
_TENSOR_VOCABULARY = (
    Exchange(
        _F, EMBEDDING_IO, _RS, "shard-sum", f"{_EMBED_WHAT}, to sequence shards", Place.INPUT, Split.INPUT, True,
        note=_EMBED_NOTE,
    ),
    Exchange(_F, EMBEDDING_IO, _AR, "sum", _EMBED_WHAT, Place.INPUT, Split.INPUT, False, note=_EMBED_NOTE),
    Exchange(
        _B, EMBEDDING_IO, _AG, "gather",
        "sequence shards of the embedding output's gradient, read whole by its backward", Place.INPUT, sequence=True,
        note="sequence shards of the embedding's output gradient, first stage",
    ),
    Exchange(
        _F, OUTPUT_IO, _AG, "gather", "sequence shards of the head's input, read whole by the head", Place.OUTPUT,
        sequence=True, note="sequence shards of the head's input, last stage",
    ),
    Exchange(
        _B, OUTPUT_IO, _RS, "shard-sum", f"{_HEAD_WHAT}, to sequence shards", Place.OUTPUT, Split.OUTPUT, True,
        note=_HEAD_NOTE,
    ),
    Exchange(_B, OUTPUT_IO, _AR, "sum", _HEAD_WHAT, Place.OUTPUT, Split.OUTPUT, False, note=_HEAD_NOTE),
    # The cross-entropy over vocabulary-sharded logits (Megatron-LM's
    # ``_VocabParallelCrossEntropy.forward``; torch's ``loss_parallel``): three all-reduces of one
    # fp32 value per token, the logits' maximum, the target's logit (from the shard that owns
    # it) and the sum of exponentials, once per micro-batch; the backward is local.
    Exchange(
        _F, LOGITS, _AR, "sum", "the cross-entropy's per-token statistics over vocabulary shards", Place.OUTPUT,
        Split.OUTPUT, width=Width.TOKEN, calls=3, verified=False,
        note="cross-entropy statistics (max, target logit, sum of exp; fp32), last stage",
    ),
)  # fmt: skip

# Context parallelism (ring attention, Megatron-LM): attention needs every position's keys and
# values; their gradients are partial sums of every query chunk.
_CONTEXT = (
    Exchange(
        _F, LINEAR_INNER, _AG, "gather", "keys and values of every sequence chunk", width=Width.KEYS_VALUES,
        per_layer=1, note="keys and values across the context-parallel group",
    ),
    Exchange(
        _B, LINEAR_INNER, _AG, "gather", "keys and values of every chunk, for the recomputed forward",
        recompute=True, width=Width.KEYS_VALUES, per_layer=1, note="keys and values across the context-parallel group",
    ),
    Exchange(
        _B, LINEAR_INNER, _RS, "shard-sum", "key and value gradients (partial sums over query chunks)",
        width=Width.KEYS_VALUES, per_layer=1, note="key and value gradients back to their context-parallel owners",
    ),
)  # fmt: skip

# Expert parallelism (GShard): tokens to their experts' devices and back, an all-to-all each way.
# Full recomputation checkpoints whole transformer layers (Megatron-LM's
# ``--recompute-granularity full``, Korthikanti et al. 2022, section 5): the backward replays
# the layer's forward, the MoE token dispatcher's dispatch and combine included, before its own
# two, so the backward's count doubles (``replayed``), as for tp's f/g operators.
_EXPERT = tuple(
    Exchange(
        ph, LAYER_IO, OpKind.ALL_TO_ALL, "all-to-all", "tokens routed to their experts' devices",
        split=Split.LAYER, width=Width.ROUTED, per_layer=2, replayed=ph is _B, note="token dispatch and combine",
    )
    for ph in (_F, _B)
)  # fmt: skip

# Pipeline parallelism (PTD-P, section 2.2): each stage's output forward, its input gradient back.
_PIPELINE = (
    Exchange(
        _F, LAYER_IO, OpKind.SEND_RECV, "send", "each stage's output to the next stage", per_boundary=True,
        note="activation (forward) or its gradient (backward) to the next stage",
    ),
    Exchange(
        _B, LAYER_IO, OpKind.SEND_RECV, "send", "each stage's input gradient to the previous stage",
        per_boundary=True, note="activation (forward) or its gradient (backward) to the next stage",
    ),
)  # fmt: skip

DATA = AxisKind("data", splits_data=True, splits_batch=True, data_order=1)
DATA_REPLICATE = AxisKind("data-replicate", splits_data=True, splits_batch=True, data_order=0)
TENSOR = AxisKind(
    "tensor",
    splits_computation=True,
    splits_matrices=True,
    hosts_vocabulary=True,
    sequence_parallel=True,
    activations=Mode.REPLICATED,
    exchanges=_tensor_layer(_F) + _tensor_layer(_B) + _TENSOR_VOCABULARY,
    exchange_rank=0,
)
CONTEXT = AxisKind("context", splits_data=True, splits_sequence=True, exchanges=_CONTEXT, exchange_rank=1)
EXPERT = AxisKind(
    "expert",
    splits_data=True,
    splits_batch=True,
    splits_computation=True,
    places_experts=True,
    exchanges=_EXPERT,
    exchange_rank=2,
)
PIPELINE = AxisKind("pipeline", is_pipeline=True, exchanges=_PIPELINE, exchange_rank=3)


class Axis(StrEnum):
    """A named mesh axis. ``dpr`` is the outer replicate axis of hybrid sharding (HSDP)."""

    DP = "dp"
    DPR = "dpr"
    TP = "tp"
    PP = "pp"
    CP = "cp"
    EP = "ep"

    @property
    def kind(self) -> AxisKind:
        """The parallelism this axis is."""
        return _KINDS[self]

    @property
    def splits_data(self) -> bool:
        """Whether devices along this axis see different samples or tokens of the batch."""
        return self.kind.splits_data


_KINDS: dict[Axis, AxisKind] = {
    Axis.DP: DATA,
    Axis.DPR: DATA_REPLICATE,
    Axis.TP: TENSOR,
    Axis.PP: PIPELINE,
    Axis.CP: CONTEXT,
    Axis.EP: EXPERT,
}


def data_axes(axes: Iterable[Axis]) -> tuple[Axis, ...]:
    """The data axes among ``axes``, outermost (HSDP's replicate axis) first."""
    found = [a for a in axes if a.kind.data_order is not None]
    return tuple(sorted(found, key=lambda a: a.kind.data_order or 0))


def nesting_order(axes: Iterable[Axis], experts_split: bool = False) -> list[Axis]:
    """The order in which a state cut into flat shards along several of ``axes`` is cut, outer
    first: dpr first (the replicate axis is the outer one, as in PyTorch's HSDP mesh
    ("replicate", "shard") and DeepSpeed's node-major ranks), or ep first for a group whose
    experts ep splits (cut into whole experts, Megatron-LM's expert data parallelism), then the
    mesh's own order (docs/semantics.md, "Collectives along several axes")."""
    first = Axis.EP if experts_split else Axis.DPR
    return sorted(axes, key=lambda a: a is not first)


__all__ = [
    "CONTEXT",
    "DATA",
    "DATA_REPLICATE",
    "EXPERT",
    "PIPELINE",
    "TENSOR",
    "Axis",
    "AxisKind",
    "Exchange",
    "Origin",
    "Place",
    "Split",
    "Width",
    "data_axes",
    "nesting_order",
]
