"""The closed vocabulary below the mesh axes: training states, modes, tensor groups, program ops.

The axes themselves (``Axis`` and the ``AxisKind`` each one is) live in ``formal._axes``, which
reads these terms; ``formal._vocab`` re-exports both.

Follows PyTorch DTensor's ``placement_types.py``: small immutable values with a compact ``str``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    """The four training states."""

    PARAMETERS = "P"
    OPTIMIZER = "O"
    GRADIENTS = "G"
    ACTIVATIONS = "A"

    @property
    def long_name(self) -> str:
        match self:
            case State.PARAMETERS:
                return "parameters"
            case State.OPTIMIZER:
                return "optimizer"
            case State.GRADIENTS:
                return "gradients"
            case State.ACTIVATIONS:
                return "activations"
            case _:
                raise AssertionError(self)


MODEL_STATES: tuple[State, ...] = (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS)


class Mode(StrEnum):
    """How a state (group) is held along one axis (docs/semantics.md, "Modes")."""

    REPLICATED = "R"
    SHARDED = "S"
    SHARDED_GATHER = "S*"
    MATERIALIZED = "M"
    OFFLOADED = "O"

    @property
    def is_sharded(self) -> bool:
        return self in (Mode.SHARDED, Mode.SHARDED_GATHER)

    @property
    def long_name(self) -> str:
        match self:
            case Mode.REPLICATED:
                return "replicated"
            case Mode.SHARDED:
                return "sharded"
            case Mode.SHARDED_GATHER:
                return "sharded-with-gather"
            case Mode.MATERIALIZED:
                return "materialized"
            case Mode.OFFLOADED:
                return "offloaded"
            case _:
                raise AssertionError(self)

    @classmethod
    def parse(cls, text: str) -> Mode:
        """Accept the symbol (``S*``) or the long name (``sharded-with-gather``)."""
        t = text.strip().lower().replace("_", "-")
        for mode in cls:
            if t == mode.value.lower() or t == mode.long_name:
                return mode
        raise ValueError(text)


@dataclass(frozen=True, order=True)
class Group:
    """A tensor group: part of a state that strategies may treat differently.

    Groups are open (a user or a benchmark may name new ones); the library's are constants
    below. ``per_layer`` groups repeat in every transformer layer and are split by pipeline
    stage; the others live on one stage (``stage`` ``first`` or ``last``).
    """

    name: str

    def __str__(self) -> str:
        return self.name


# Parameter groups (also the groups of their gradients and optimizer state).
ATTENTION = Group("attention")  # QKV and output projection weights (+ QKV bias): TP column/row split
MLP = Group("mlp")  # the two (or three, SwiGLU) FFN matrices (+ fc1 bias): TP split
ROW_BIAS = Group("row_bias")  # biases of row-parallel linears: replicated under TP (Megatron)
NORM = Group("norm")  # per-layer LayerNorm/RMSNorm weights: replicated under TP
FINAL_NORM = Group("final_norm")  # the last norm before the head (last pipeline stage)
EMBEDDING = Group("embedding")  # word embedding: vocabulary-parallel under TP (first stage)
POSITION = Group("position")  # learned position embedding: replicated under TP (first stage)
HEAD = Group("head")  # untied output layer: vocabulary-parallel (last stage)
EXPERTS = Group("experts")  # MoE expert FFNs: sharded along ep
ROUTER = Group("router")  # MoE router (gate): replicated
WEIGHTS = Group("weights")  # every parameter of a model given only by its count

PARAMETER_GROUPS: tuple[Group, ...] = (
    ATTENTION,
    MLP,
    ROW_BIAS,
    NORM,
    FINAL_NORM,
    EMBEDDING,
    POSITION,
    HEAD,
    EXPERTS,
    ROUTER,
    WEIGHTS,
)
LAYER_GROUPS: frozenset[Group] = frozenset({ATTENTION, MLP, ROW_BIAS, NORM, EXPERTS, ROUTER, WEIGHTS})
FIRST_STAGE_GROUPS: frozenset[Group] = frozenset({EMBEDDING, POSITION})
LAST_STAGE_GROUPS: frozenset[Group] = frozenset({HEAD, FINAL_NORM})

# Activation groups, per layer (Korthikanti et al. 2022, section 4.1, 16-bit activations).
LAYER_IO = Group("layer_io")  # 10sbh: norm inputs, linear inputs, dropout masks; replicated by TP
LINEAR_INNER = Group("linear_inner")  # 24sbh: Q, K, V, attention out, FFN inner; split by TP
ATTN_SCORES = Group("attn_scores")  # 5as^2b: softmax, its dropout mask and output; split by TP
ACTIVATION_GROUPS: tuple[Group, ...] = (LAYER_IO, LINEAR_INNER, ATTN_SCORES)  # the per-layer ones

# Activation groups of the input and output layers, once per model (Korthikanti et al. 2022,
# section 4.3): the first stage keeps the input embeddings' dropout mask (sbh masks); the last
# keeps the final norm's and the output projection's inputs (2sbh activations) and the
# cross-entropy's fp32 logits (4sbv bytes).
EMBEDDING_IO = Group("embedding_io")  # sbh dropout mask of the input embeddings; sequence-split by SP
OUTPUT_IO = Group("output_io")  # 2sbh: final norm input, head input; sequence-split by SP
LOGITS = Group("logits")  # sbv fp32 logits of the loss: vocabulary-split by TP
IO_ACTIVATION_GROUPS: tuple[Group, ...] = (EMBEDDING_IO, OUTPUT_IO, LOGITS)
FIRST_STAGE_ACTIVATIONS: frozenset[Group] = frozenset({EMBEDDING_IO})
LAST_STAGE_ACTIVATIONS: frozenset[Group] = frozenset({OUTPUT_IO, LOGITS})


class Stage(StrEnum):
    """A kind of pipeline stage. The first holds the input layer (embedding), the last the output
    layer and the loss, a middle one neither; without a pipeline the one device is the first.
    Costs that differ along the pipeline are given per kind (``formal._costs.pipeline_stages``)."""

    FIRST = "first"
    MIDDLE = "middle"
    LAST = "last"

    @classmethod
    def of(cls, index: int, stages: int) -> Stage:
        """The kind of pipeline stage ``index`` (0 .. stages - 1) of a ``stages``-stage pipeline."""
        if stages == 1 or index == 0:
            return cls.FIRST
        return cls.LAST if index == stages - 1 else cls.MIDDLE


class Phase(StrEnum):
    """When in a training step an op runs."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GRAD_SYNC = "grad_sync"
    OPTIMIZER = "optimizer"
    REFRESH = "refresh"


class OpKind(StrEnum):
    """Collectives, transfers and local steps of a step program."""

    ALL_REDUCE = "all_reduce"
    # A rooted reduction (torch.distributed.reduce, MPI_Reduce): the reduced tensor lands on one
    # destination rank, every other rank keeps the buffer it sent. DeepSpeed's ZeRO-1/2 send
    # each gradient slice to its owner this way (``use_multi_rank_bucket_allreduce`` false).
    REDUCE = "reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"
    ALL_TO_ALL = "all_to_all"
    HOST_TO_DEVICE = "host_to_device"
    DEVICE_TO_HOST = "device_to_host"
    COMPUTE = "compute"  # a forward or backward use of a state (a read)
    OPTIMIZER_STEP = "optimizer_step"  # the element-wise update (reads P, O, G; writes P, O)
    SCALE = "scale"  # a local multiplication of a gradient by a constant (normalisation)

    @property
    def is_collective(self) -> bool:
        return self in (
            OpKind.ALL_REDUCE,
            OpKind.REDUCE,
            OpKind.REDUCE_SCATTER,
            OpKind.ALL_GATHER,
            OpKind.BROADCAST,
            OpKind.SEND_RECV,
            OpKind.ALL_TO_ALL,
        )

    @property
    def is_transfer(self) -> bool:
        return self in (OpKind.HOST_TO_DEVICE, OpKind.DEVICE_TO_HOST)

    @property
    def is_reduction(self) -> bool:
        """A collective that every rank receives a reduced value from (all-reduce,
        reduce-scatter). A rooted ``REDUCE`` is not one: only its destination receives."""
        return self in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER)

    @property
    def is_rooted(self) -> bool:
        """A collective whose result lands on one destination rank (``REDUCE``)."""
        return self is OpKind.REDUCE


class Reduce(StrEnum):
    """How a reduction combines contributions."""

    SUM = "sum"
    MEAN = "mean"


class Buffer(StrEnum):
    """Which gradient buffer a gradient op acts on (docs/semantics.md, "Gradient buffers")."""

    FRESH = "fresh"  # the current micro-batch's gradient, before it is added to ``.grad``
    ACCUMULATED = "accumulated"  # the ``.grad`` buffer, summed over the micro-batches so far


def gradient_buffer(phase: Phase, per_micro_batch: bool, explicit: Buffer | None) -> Buffer:
    """The buffer a gradient op acts on: ``explicit`` when given, else PyTorch's default.

    A backward-phase op, and a gradient-synchronisation op run once per micro-batch, act on the
    fresh gradient as a hook on the gradient tensor sees it (FSDP's post-backward reduce-scatter
    reduces the fresh unsharded gradient, then accumulates it into the sharded ``.grad``); every
    other op acts on ``.grad`` (a forward op on what earlier micro-batches accumulated, DDP's
    reducer under ``no_sync`` on the accumulated gradient of the last micro-batch, the optimizer
    on the step's sum). A fresh buffer exists only between a micro-batch's backward and its
    accumulation: asking for it elsewhere is refused by the callers.
    """
    if explicit is not None:
        return explicit
    if phase is Phase.BACKWARD or (phase is Phase.GRAD_SYNC and per_micro_batch):
        return Buffer.FRESH
    return Buffer.ACCUMULATED
