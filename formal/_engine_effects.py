"""What a named training engine holds beyond the placement: engine effects as terms of the peak.

The placement gives the textbook figure (``formal._costs.memory``: persistent model states, the
activations the layers save, the buffers the modes imply), the paper's number. A real engine
adds tensors of its own: FSDP2 keeps its root module unsharded, prefetches the next block,
holds a block's unsharded gradient before its reduce-scatter; DDP keeps a second copy of the
gradients in its buckets; DTensor's tensor parallelism keeps the full-vocabulary embedding
gradient and the gathered inputs of its column-parallel matmuls; PyTorch's cross-entropy
backward makes logits-sized temporaries; ``torch.distributed.pipelining`` keeps each in-flight
micro-batch's stage output and preallocates a receive buffer per micro-batch.

Each effect is a named ``Term`` derived from the placement (which groups are sharded where, the
stage's layers, the micro-batches in flight) and the model, never a per-strategy constant.
``engine_prediction`` adds them to the placement's figure at three moments of the step, the
largest being the peak:

* ``forward``: a forward has just ended (a pipeline stage holds that micro-batch's output);
* ``loss``: the loss's backward has begun; every activation is held, with the loss's
  temporaries;
* ``backward``: the first transformer block's backward (the last block of the stage); the output
  layer's activations are freed, but an FSDP engine holds the root's first gradients unsharded,
  two gathered blocks (the one computing and the one prefetched) and the block's gradient; under
  recomputation the block's recomputed activations are held too;
* ``second_block``: the next block's backward: what the first block's backward held (the terms
  of ``backward`` count here too), less that block's saved activations, plus FSDP2's
  reduce-scatter input of the first block, kept until this block's gradients are reduced. Where
  a layer keeps little (recomputation), this is the step's peak.

The CLI (``check-composition --engine``) prints these terms; the PyTorch validator
(``checker/_torch/_predict.py``) reads the same terms, so the number a user reads is the number
that is validated. DeepSpeed's ZeRO effects are stated in ``formal._engine_deepspeed`` (the fp32
master partition, the reduce bucket, ZeRO-2's straddling gradients): ``engine_prediction`` adds
them for ``Engine.DEEPSPEED``, and ``--validate deepspeed`` (``checker/_torch/_deepspeed.py``)
reads the same terms. Megatron-LM's own effects are not modelled: it gets the placement's figure
and the token ids, and says so (``EnginePrediction.modelled``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from formal._axes import TENSOR
from formal._costs import (
    Memory,
    ceil_int,
)
from formal._engine_activations import (
    activation_terms,
    kept_layer_bytes,
    stage_actions,
    token_id_terms,
)
from formal._engine_deepspeed import DeepSpeedEffects, deepspeed_notes, deepspeed_terms, zero_stage
from formal._engine_terms import EngineEffects, Term
from formal._engine_terms import data_axes as _data_axes
from formal._model import Model, Precision, Transformer
from formal._placement import Placement
from formal._program import shard_elements
from formal._tensors import parameter_tensors
from formal._vocab import (
    EMBEDDING,
    FINAL_NORM,
    FIRST_STAGE_GROUPS,
    HEAD,
    LAST_STAGE_GROUPS,
    LAYER_GROUPS,
    Axis,
    Group,
    Mode,
    Stage,
    State,
)
from formal.errors import ModelError

P, G, OPT, A = State.PARAMETERS, State.GRADIENTS, State.OPTIMIZER, State.ACTIVATIONS


class Engine(StrEnum):
    """The training engine a prediction is for (``--engine``)."""

    FSDP2 = "fsdp2"  # PyTorch: FSDP2 fully_shard, DTensor tensor parallelism, torch.distributed.pipelining
    DDP = "ddp"  # PyTorch: DistributedDataParallel (ZeRO-1: ZeroRedundancyOptimizer), DTensor, pipelining
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"


NO_EFFECTS = EngineEffects(
    fsdp_root_unsharded=False,
    fsdp_prefetched_blocks=0,
    fsdp_unsharded_gradients=False,
    ddp_bucket_copy=False,
    zero_redundancy_whole_tensors=False,
    tp_embedding_full_gradient=False,
    tp_row_bias_before_reduction=False,
    tp_loss_keeps_logits=False,
    sp_saves_gathered_inputs=False,
    token_id_bytes=8,  # every engine's embedding and loss keep their int64 token ids
    loss_backward_temporaries=0,
    pipeline_keeps_outputs=False,
    pipeline_receive_buffers=False,
    recompute_working_set=False,
    fsdp_reduce_scatter_held=False,
    pipeline_fsdp_deferred_reduction=False,
    attention_backward_temporaries=0,
    tp_input_collective_per_module=False,
)


def effects_for(engine: Engine) -> EngineEffects:
    """The PyTorch effects an engine has: PyTorch's (FSDP2, DDP: the same DTensor and
    pipelining stack) all of them; DeepSpeed (its own terms: ``formal._engine_deepspeed``) and
    Megatron-LM (not modelled) none."""
    if engine in (Engine.FSDP2, Engine.DDP):
        return EngineEffects()
    return NO_EFFECTS


def modelled(engine: Engine) -> bool:
    """Whether the engine's own buffers are terms of the prediction (Megatron-LM's are not)."""
    return engine in (Engine.FSDP2, Engine.DDP, Engine.DEEPSPEED)


# The moments of a step at which a peak can fall: the end of a forward, the loss's backward, the
# first block's backward, the second block's backward (which holds the first's terms too).
MOMENTS = ("forward", "loss", "backward", "second_block")
# The moments whose terms a moment holds besides its own and the persistent ones.
_ALSO_HELD = {"second_block": ("backward",)}


def held_at(term: Term, moment: str) -> bool:
    """Whether ``term`` is held at ``moment`` (persistent terms always; ``second_block`` holds the
    first block's backward terms too)."""
    return term.moment in ("persistent", moment, *_ALSO_HELD.get(moment, ()))


@dataclass(frozen=True)
class EnginePrediction:
    """The placement's figure and what the engine adds: the per-device peak a user reads."""

    engine: Engine
    modelled: bool  # False: the engine's effects are not modelled (the placement's figure stands)
    placement_total: int  # the paper's number: model states + activations + the modes' buffers
    placement_buffers: int
    base: int  # the placement's figure without the buffers an FSDP engine replaces with its own
    terms: tuple[Term, ...]
    stage: Stage = Stage.FIRST
    notes: tuple[str, ...] = ()  # effects of the engine this prediction could not model, said

    def moment_total(self, moment: str) -> int:
        return self.base + sum(t.bytes for t in self.terms if held_at(t, moment))

    @property
    def moments(self) -> dict[str, int]:
        return {m: self.moment_total(m) for m in MOMENTS}

    @property
    def peak_moment(self) -> str:
        both = self.moments
        return max(MOMENTS, key=lambda m: (both[m], m == "loss"))

    @property
    def total(self) -> int:
        """The per-device peak: the largest moment (the placement's figure when no term applies)."""
        if not self.terms and self.base == self.placement_total:
            return self.placement_total
        return max(self.moments.values())

    def persistent(self, state: str) -> int:
        """Bytes the persistent terms add to a row of the memory table (``Term.state``)."""
        return sum(t.bytes for t in self.terms if t.moment == "persistent" and t.state == state)

    def as_json(self) -> dict[str, object]:
        return {
            "engine": self.engine.value,
            "modelled": self.modelled,
            "pipeline_stage": self.stage.value,
            "placement_total": self.placement_total,
            "total": self.total,
            "peak_moment": self.peak_moment,
            "moments": self.moments,
            "notes": list(self.notes),
            "terms": [
                {"name": t.key, "label": t.label, "bytes": t.bytes, "moment": t.moment, "state": t.state}
                for t in self.terms
            ],
        }


def default_engine(strategy_names: tuple[str, ...]) -> Engine:
    """The engine a composition most plausibly runs on when none is declared: DeepSpeed for the
    ZeRO stages by name (zero1/2/3, ZeRO++), FSDP2 for fsdp/hsdp, DDP for plain data parallelism,
    Megatron-LM when no data axis shards or replicates with an engine of its own (tp, sp, pp, cp,
    ep alone: the layout the placement model describes)."""
    names = set(strategy_names)
    if any(n.startswith("zero") or n.startswith("hpz") for n in names):
        return Engine.DEEPSPEED
    if any(n.startswith("fsdp") or n.startswith("hsdp") for n in names):
        return Engine.FSDP2
    if names & {"dp", "ddp"}:
        return Engine.DDP
    return Engine.MEGATRON


def pytorch_engine(strategy_names: tuple[str, ...]) -> Engine:
    """The PyTorch engine a composition runs on: DDP for plain data parallelism (``dp``, ``ddp``;
    ``zero1``: DDP with ``ZeroRedundancyOptimizer``), FSDP2 otherwise (tensor and pipeline
    parallelism run on DTensor and ``torch.distributed.pipelining`` under either)."""
    return Engine.DDP if set(strategy_names) & {"dp", "ddp", "zero1"} else Engine.FSDP2


def _whole_along_data(pl: Placement, state: State, group: Group, size: int, stage: Stage) -> int:
    axes = _data_axes(pl, state, group)
    return ceil_int(shard_elements(pl, state, group, size, axes, stage)) if axes else 0


def engine_prediction(
    pl: Placement,
    model: Model,
    precision: Precision,
    placement: Memory,
    engine: Engine,
    stage: Stage = Stage.FIRST,
    index: int | None = None,
    effects: EngineEffects | None = None,
    data_rank: int | None = None,
    deepspeed: DeepSpeedEffects | None = None,
) -> EnginePrediction:
    """The engine's terms on one device of ``stage`` (pipeline stage ``index`` when given),
    added to ``placement`` (``formal._costs.memory`` of that stage, its activations for that
    stage). ``effects`` overrides the engine's own (``effects_for``). ``data_rank``: the device's
    rank along the data axis, for effects that differ between its ranks (ZeRO-1's whole-tensor
    partition, ZeRO-2's straddling gradients); None: the most loaded of them. ``deepspeed``:
    DeepSpeed's settings under ``Engine.DEEPSPEED`` (None: DeepSpeed's defaults)."""
    fx = effects_for(engine) if effects is None else effects
    buffers = 0 if placement.buffers is None else ceil_int(placement.buffers)
    total = ceil_int(placement.total)
    terms: list[Term] = []
    fsdp = engine is Engine.FSDP2 and any(_data_axes(pl, P, g) for g in pl.groups(P))
    torch = engine in (Engine.FSDP2, Engine.DDP) or effects is not None  # PyTorch's stack
    known = torch
    if torch:
        terms += _gradient_terms(pl, model, precision, fx, stage, engine is Engine.DDP)
    notes: list[str] = []
    if torch and engine is Engine.DDP and fx.zero_redundancy_whole_tensors and isinstance(model, Transformer):
        terms += _whole_tensor_partition(pl, model, precision, placement, data_rank, notes)
    if engine is Engine.DEEPSPEED:
        ds = DeepSpeedEffects() if deepspeed is None else deepspeed
        terms += deepspeed_terms(pl, model, precision, placement, ds, data_rank)
        notes += deepspeed_notes(pl, model, precision, ds)
        known = zero_stage(pl) != 0
    if isinstance(model, Transformer):
        terms += token_id_terms(pl, model, fx, stage, index)
    if torch and isinstance(model, Transformer):
        terms += activation_terms(pl, model, precision, fx, stage, index)
        if fsdp:
            terms += _fsdp_terms(pl, model, precision, fx, stage, index, notes)
    # A bare parameter count has no layers: FSDP2's units (root, blocks) are unknown.
    known = known and (isinstance(model, Transformer) or not fsdp)
    base = total - buffers if fsdp and known else total  # FSDP2's own buffers replace the modes' generic ones
    kept = tuple(t for t in terms if t.bytes)
    return EnginePrediction(engine, known, total, buffers, base, kept, stage, tuple(notes))


def _gradient_terms(
    pl: Placement, model: Model, precision: Precision, fx: EngineEffects, stage: Stage, ddp: bool
) -> list[Term]:
    out: list[Term] = []
    sizes = model.group_elements()
    if fx.ddp_bucket_copy and ddp:
        # Every gradient all-reduced along a data axis (not sharded there): a bucket copy.
        copy = 0
        for g in pl.groups(G):
            axes = [a for a in pl.axes if a.splits_data and pl.degree(a) != 1]
            if axes and not any(pl.mode(G, g, a).is_sharded for a in axes) and _local(pl, G, g):
                copy += ceil_int(shard_elements(pl, G, g, sizes[g], None, stage)) * precision.bytes_of(G)
        out.append(
            Term(
                "ddp_bucket_copy",
                "DDP gradient buckets (a second copy of the gradients)",
                copy,
                "persistent",
                "gradients",
            )
        )
    if fx.tp_embedding_full_gradient:
        out.append(
            Term(
                "tp_embedding_full_gradient",
                "DTensor embedding gradient whole along tp (Replicate)",
                _embedding_gradient_replicas(pl, model, precision, stage),
                "persistent",
                "gradients",
            )
        )
    return out


def zero1_axis(pl: Placement) -> Axis | None:
    """The data axis along which the optimizer state is sharded while the gradients are not
    (ZeRO-1): where ``ZeroRedundancyOptimizer`` partitions; None if there is none or several."""
    found = [
        a
        for a in pl.axes
        if a.splits_data
        and pl.degree(a) != 1
        and any(pl.mode(OPT, g, a).is_sharded for g in pl.groups(OPT))
        and not any(pl.mode(G, g, a).is_sharded for g in pl.groups(G))
    ]
    return found[0] if len(found) == 1 else None


def whole_tensor_owners(pl: Placement, model: Transformer, axis: Axis) -> list[int]:
    """The rank along ``axis`` that owns each parameter tensor (``parameter_tensors`` order):
    largest first, each to the rank with the fewest elements so far (the first such rank),
    as ``ZeroRedundancyOptimizer._partition_parameters`` does."""
    tensors = parameter_tensors(model)
    sizes = [ceil_int(shard_elements(pl, OPT, t.group, t.elements, axis, Stage.FIRST)) for t in tensors]
    n = int(pl.degree(axis))
    load = [0] * n
    owners = [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: -sizes[i]):  # stable: registration order on ties
        r = load.index(min(load))
        owners[i] = r
        load[r] += sizes[i]
    return owners


def _whole_tensor_partition(
    pl: Placement,
    model: Transformer,
    precision: Precision,
    placement: Memory,
    data_rank: int | None,
    notes: list[str],
) -> list[Term]:
    axis = zero1_axis(pl)
    if axis is None:
        return []
    unmodelled = "ZeRO-1's whole-tensor split not modelled"
    if pl.pipelined and pl.pipeline_degree != 1:
        notes.append(f"{unmodelled} with a pipeline (1/n)")
        return []
    try:
        owners = whole_tensor_owners(pl, model, axis)
    except ModelError:
        notes.append(f"{unmodelled} for these tensors (1/n)")
        return []
    tensors = parameter_tensors(model)
    n = int(pl.degree(axis))
    load = [0] * n
    for t, r in zip(tensors, owners, strict=True):
        load[r] += ceil_int(shard_elements(pl, OPT, t.group, t.elements, axis, Stage.FIRST))
    rank = max(range(n), key=lambda r: load[r]) if data_rank is None else data_rank % n
    even = ceil_int(placement.optimizer.total)
    held = load[rank] * precision.bytes_of(OPT)
    label = f"ZeroRedundancyOptimizer whole tensors (rank {rank} of {n})"
    return [Term("zero_redundancy_whole_tensors", label, held - even, "persistent", "optimizer")]


def _local(pl: Placement, state: State, group: Group) -> bool:
    return pl.local_mode(state, group) not in (Mode.OFFLOADED, Mode.MATERIALIZED)


def _embedding_gradient_replicas(pl: Placement, model: Model, precision: Precision, stage: Stage) -> int:
    """The full-vocabulary gradient DTensor keeps on each tp rank beyond the rank's shard, while
    the gradient is the persistent one (not reduce-scattered away by FSDP)."""
    tp = pl.axis_where(lambda kind: kind is TENSOR)
    if tp is None or pl.degree(tp) == 1 or EMBEDDING not in pl.groups(G) or not pl.computes_sharded(tp, EMBEDDING):
        return 0
    if any(pl.mode(G, EMBEDDING, ax).is_sharded for ax in pl.axes if ax.splits_data):
        return 0
    if stage != Stage.FIRST and pl.pipelined and pl.pipeline_degree != 1:
        return 0
    shard = ceil_int(shard_elements(pl, G, EMBEDDING, model.group_elements()[EMBEDDING], None, stage))
    return (shard * int(pl.degree(tp)) - shard) * precision.bytes_of(G)


def _fsdp_terms(
    pl: Placement,
    model: Transformer,
    precision: Precision,
    fx: EngineEffects,
    stage: Stage,
    index: int | None,
    notes: list[str],
) -> list[Term]:
    """FSDP2's unsharded parameters and gradients (the placement's ``S*`` buffers replaced)."""
    out: list[Term] = []
    sizes = model.group_elements()
    width_p, width_g = precision.wire_bytes_of(P), precision.wire_bytes_of(G)
    layers = ceil_int(pl.stage_layers(model.layers))
    root_groups = [g for g in pl.groups(P) if g not in LAYER_GROUPS and _on_stage(pl, g, stage)]
    block_groups = [g for g in pl.groups(P) if g in LAYER_GROUPS]
    root = sum(_whole_along_data(pl, P, g, sizes[g], stage) for g in root_groups) * width_p
    block = sum(_whole_along_data(pl, P, g, sizes[g], stage) for g in block_groups) * width_p // max(layers, 1)
    held = any(pl.entry(P, g, a).keep_gathered for g in block_groups for a in _data_axes(pl, P, g))
    if fx.fsdp_root_unsharded and root:
        out.append(Term("fsdp_root_unsharded", "FSDP2 root module unsharded", root, "persistent", "buffers"))
    elif root:  # without the effect the root is gathered for its use like a block
        out.append(Term("fsdp_root_gathered", "FSDP2 root module gathered for its use", root, "loss", "buffers"))
    if held:
        out.append(
            Term(
                "fsdp_blocks_unsharded",
                f"FSDP2 all {layers} blocks unsharded (no reshard)",
                block * layers,
                "persistent",
                "buffers",
            )
        )
    else:
        k = fx.fsdp_prefetched_blocks
        out.append(
            Term("fsdp_prefetch", f"FSDP2 backward prefetch: {k} block(s) gathered", block * k, "loss", "buffers")
        )
        out.append(
            Term(
                "fsdp_blocks_gathered",
                f"FSDP2 {1 + k} block(s) gathered (computing and prefetched)",
                block * (1 + k),
                "backward",
                "buffers",
            )
        )
    deferred = fx.pipeline_fsdp_deferred_reduction and pl.pipelined and pl.pipeline_degree != 1
    # A forward after a backward (1F1B's steady state) holds the stage's micro-batches in flight
    # again with every gradient unsharded; without one (GPipe) the activations peak before any
    # backward, and the first backward holds what FSDP2 alone holds (below).
    try:
        steady = deferred and "BF" in "".join(stage_actions(pl, _stage_index(pl, stage, index)))
    except ModelError as err:
        notes.append(f"pipelining + FSDP2's unsharded gradients not modelled: {err}")
        steady = False
    if steady:
        stage_groups = [g for g in pl.groups(G) if g in LAYER_GROUPS or _on_stage(pl, g, stage)]
        whole = sum(_whole_along_data(pl, G, g, sizes[g], stage) for g in stage_groups) * width_g
        out.append(
            Term(
                "pipeline_fsdp_unsharded_gradients",
                "pipelining + FSDP2: the stage's gradients unsharded until the last micro-batch",
                whole,
                "persistent",
                "buffers",
            )
        )
        return out
    if not deferred and fx.fsdp_reduce_scatter_held and layers > 1 and any(_data_axes(pl, G, g) for g in block_groups):
        rs = sum(_whole_along_data(pl, G, g, sizes[g], stage) for g in block_groups if g in pl.groups(G))
        out.append(
            Term(
                "fsdp_reduce_scatter_held",
                "FSDP2 previous block's reduce-scatter input held",
                rs * width_g // layers,
                "second_block",
                "buffers",
            )
        )
        out.append(
            Term(
                "first_block_freed",
                "first block's saved activations freed (second block's backward)",
                -kept_layer_bytes(pl, model, precision),
                "second_block",
                "activations",
            )
        )
    if fx.fsdp_unsharded_gradients:
        first_grads = [g for g in (HEAD, FINAL_NORM) if g in pl.groups(G) and _on_stage(pl, g, stage)]
        if HEAD not in pl.groups(G) and EMBEDDING in pl.groups(G) and _on_stage(pl, EMBEDDING, stage):
            first_grads.append(EMBEDDING)  # tied: the head's gradient accumulates into the embedding's
        head_grad = sum(_whole_along_data(pl, G, g, sizes[g], stage) for g in first_grads) * width_g
        block_grad = sum(_whole_along_data(pl, G, g, sizes[g], stage) for g in block_groups if g in pl.groups(G))
        out.append(
            Term(
                "fsdp_root_gradient",
                "FSDP2 head gradient unsharded until the root's reduce-scatter",
                head_grad,
                "backward",
                "buffers",
            )
        )
        out.append(
            Term(
                "fsdp_block_gradient",
                "FSDP2 block gradient unsharded before its reduce-scatter",
                block_grad * width_g // max(layers, 1),
                "backward",
                "buffers",
            )
        )
    return out


def _stage_index(pl: Placement, stage: Stage, index: int | None) -> int:
    """Pipeline stage ``index``, or without one the first or last stage's (a middle stage: the
    first's, the most loaded)."""
    if index is not None:
        return index
    return int(pl.pipeline_degree) - 1 if stage == Stage.LAST else 0


def _on_stage(pl: Placement, group: Group, stage: Stage) -> bool:
    if not pl.pipelined or pl.pipeline_degree == 1 or group in pl.tied:
        return True
    if group in FIRST_STAGE_GROUPS:
        return stage == Stage.FIRST
    if group in LAST_STAGE_GROUPS:
        return stage == Stage.LAST
    return True


__all__ = [
    "MOMENTS",
    "NO_EFFECTS",
    "Engine",
    "EngineEffects",
    "EnginePrediction",
    "Term",
    "default_engine",
    "effects_for",
    "engine_prediction",
    "held_at",
    "modelled",
    "pytorch_engine",
    "stage_actions",
    "whole_tensor_owners",
    "zero1_axis",
]
