"""The engine terms of a device's activations (``formal._engine_effects`` gathers every term):
what PyTorch keeps beyond the placement's saved tensors at each moment of the step (tensor- and
sequence-parallel copies, the loss's temporaries, recomputation's working set, the pipeline's
kept outputs and receive buffers, token ids), each a named ``Term`` citing its PyTorch source."""

from __future__ import annotations

from formal._axes import TENSOR
from formal._costs import _tensor_factor as tensor_factor
from formal._costs import (
    ceil_int,
    holds_io_activations,
    in_flight_micro_batches,
    layer_activations,
    stage_in_flight,
)
from formal._engine_terms import EngineEffects, Term
from formal._model import Ffn, Precision, Transformer
from formal._placement import Placement, Recompute
from formal._vocab import (
    ACTIVATION_GROUPS,
    ATTN_SCORES,
    EMBEDDING,
    EMBEDDING_IO,
    HEAD,
    LAYER_IO,
    LOGITS,
    OUTPUT_IO,
    Axis,
    Mode,
    Stage,
    State,
)
from formal.errors import ModelError

P, G, OPT, A = State.PARAMETERS, State.GRADIENTS, State.OPTIMIZER, State.ACTIVATIONS


def _tp_axis(pl: Placement) -> Axis | None:
    return pl.axis_where(lambda kind: kind is TENSOR)


def _tp(pl: Placement) -> int:
    tp = _tp_axis(pl)
    return 1 if tp is None else int(pl.degree(tp))


def _in_flight(pl: Placement, stage: Stage, index: int | None) -> int:
    return ceil_int(in_flight_micro_batches(pl, stage) if index is None else stage_in_flight(pl, index))


def token_id_terms(pl: Placement, model: Transformer, fx: EngineEffects, stage: Stage, index: int | None) -> list[Term]:
    """The int64 token ids the embedding's backward reads and the targets the loss's reads, for
    each micro-batch in flight: ``s b / cp`` each (a context-parallel rank holds its chunk)."""
    cp = _cp_degree(pl)
    per = -(-(model.seq * model.micro_batch) // cp)  # a context-parallel rank's chunk, rounded up
    tokens = per * fx.token_id_bytes * _in_flight(pl, stage, index)
    out: list[Term] = []
    if holds_io_activations(pl, EMBEDDING_IO, stage):
        out.append(Term("input_ids", "embedding keeps the int64 token ids", tokens, "persistent", "activations"))
    if holds_io_activations(pl, LOGITS, stage):
        out.append(Term("target_ids", "loss keeps the int64 targets", tokens, "persistent", "activations"))
    return out


def _cp_degree(pl: Placement) -> int:
    d = 1
    for axis, degree in pl.mesh:
        if axis.kind.splits_sequence:
            d *= int(degree)
    return d


def activation_terms(
    pl: Placement, model: Transformer, precision: Precision, fx: EngineEffects, stage: Stage, index: int | None
) -> list[Term]:
    out: list[Term] = []
    t = _tp(pl)
    sbh = model.seq * model.micro_batch * model.hidden
    in_flight = _in_flight(pl, stage, index)
    tp = _tp_axis(pl)
    sp_on = tp is not None and t > 1 and pl.mode(A, LAYER_IO, tp).is_sharded
    if fx.sp_saves_gathered_inputs and sp_on:
        shard = ceil_int(precision.activations * sbh * tensor_factor(pl, LAYER_IO))
        whole = precision.activations * sbh - shard
        # The QKV and FC1 inputs, gathered, where the placement counts their shards; a Llama
        # layout's q, k, v and gate, up each save a gathered copy of their own (3 + 2 where the
        # placement counts 2 shards).
        modules = 5 if model.ffn_kind is Ffn.SWIGLU else 2
        per_layer = modules * whole + (modules - 2) * shard
        extra = per_layer * ceil_int(pl.stage_layers(model.layers))
        if holds_io_activations(pl, OUTPUT_IO, stage):
            extra += whole  # the head's input
        out.append(
            Term(
                "sp_saves_gathered_inputs",
                "DTensor SP: gathered QKV/FC1 inputs saved",
                extra * in_flight,
                "persistent",
                "activations",
            )
        )
    fused = pl.options.recompute is Recompute.SELECTIVE and pl.options.fused_attention  # nothing recomputed
    if fx.recompute_working_set and pl.options.recompute is not Recompute.NONE and not fused:
        out.append(
            Term(
                "recompute_working_set",
                f"checkpoint: one layer's recomputed activations ({pl.options.recompute.value})",
                recomputed_layer_bytes(pl, model, precision),
                "backward",
                "activations",
            )
        )
    if fx.attention_backward_temporaries and not pl.options.fused_attention and pl.stage_layers(model.layers) != 0:
        scores = model.heads * model.seq * model.seq * model.micro_batch * precision.activations
        out.append(
            Term(
                "attention_backward_temporaries",
                f"softmax backward: {fx.attention_backward_temporaries} score-sized gradients",
                ceil_int(fx.attention_backward_temporaries * scores * tensor_factor(pl, ATTN_SCORES)),
                "backward",
                "activations",
            )
        )
    io = model.io_activation_bytes(precision.activations, precision.mask_bytes, precision.logits_bytes)
    last = holds_io_activations(pl, LOGITS, stage)
    logits = ceil_int(io[LOGITS] * tensor_factor(pl, LOGITS)) if last else 0
    if logits and fx.loss_backward_temporaries:
        out.append(
            Term(
                "loss_backward_temporaries",
                f"cross-entropy backward: {fx.loss_backward_temporaries} logits-sized fp32 temporaries",
                fx.loss_backward_temporaries * logits,
                "loss",
                "activations",
            )
        )
    head = HEAD if HEAD in pl.groups(P) else EMBEDDING
    if logits and fx.tp_loss_keeps_logits and tp is not None and t > 1 and pl.computes_sharded(tp, head):
        out.append(
            Term(
                "tp_loss_keeps_logits",
                "loss_parallel keeps the logits' vocabulary shard",
                logits,
                "loss",
                "activations",
            )
        )
    # The output layer's activations of the micro-batch in backward are freed by the first block's backward.
    if last:
        freed = logits + ceil_int(io[OUTPUT_IO] * tensor_factor(pl, OUTPUT_IO))
        out.append(
            Term(
                "output_layer_freed",
                "output layer's activations freed (backward of the blocks)",
                -freed,
                "backward",
                "activations",
            )
        )
    p = pl.pipeline_degree
    if pl.pipelined and p != 1:
        m = int(pl.options.micro_batches)
        hidden = ceil_int(precision.activations * sbh * tensor_factor(pl, LAYER_IO))
        output = logits if last else hidden
        if fx.pipeline_keeps_outputs and in_flight > 1:
            out.append(
                Term(
                    "pipeline_keeps_outputs",
                    f"pipelining keeps {in_flight - 1} other in-flight stage outputs",
                    (in_flight - 1) * output,
                    "persistent",
                    "activations",
                )
            )
        if fx.pipeline_keeps_outputs:  # at the end of a forward its own output is held too
            out.append(
                Term("pipeline_current_output", "pipelining: this forward's output", output, "forward", "activations")
            )
        first = stage == Stage.FIRST if index is None else index == 0
        if fx.pipeline_receive_buffers and not first and m > in_flight:
            out.append(
                Term(
                    "pipeline_receive_buffers",
                    f"pipelining: {m - in_flight} idle preallocated receive buffers",
                    (m - in_flight) * hidden,
                    "persistent",
                    "activations",
                )
            )
    return out


def recomputed_layer_bytes(pl: Placement, model: Transformer, precision: Precision) -> int:
    """The bytes one layer's recomputation makes for one micro-batch on a device: the activation
    groups the placement does not keep (``M``, materialised again in backward), through the
    placement's tensor-parallel split."""
    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    total = sum(
        (per_layer[g] * tensor_factor(pl, g) for g in ACTIVATION_GROUPS if pl.local_mode(A, g) is Mode.MATERIALIZED),
        start=0,
    )
    return ceil_int(total)


def kept_layer_bytes(pl: Placement, model: Transformer, precision: Precision) -> int:
    """The bytes one layer keeps for one micro-batch on a device through the placement (its
    checkpoint under full recomputation): what the first block's backward frees."""
    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    sbh = model.seq * model.micro_batch * model.hidden
    return ceil_int(layer_activations(pl, per_layer, sbh, precision))


def stage_actions(pl: Placement, index: int) -> list[str]:
    """The order in which pipeline stage ``index`` runs its micro-batches' forwards (``F``) and
    backwards (``B``) in one step: GPipe every forward then every backward; 1F1B ``min(p - i,
    m)`` warm-up forwards, then a backward and a forward in turn, then the remaining backwards
    (``torch.distributed.pipelining.Schedule1F1B``; Narayanan et al. 2021, section 2.2)."""
    p, m = int(pl.pipeline_degree), int(pl.options.micro_batches)
    schedule = pl.options.pipeline_schedule
    actions = schedule.actions(p, m, index)
    if actions is None:
        raise ModelError(f"the {schedule.kind.value} schedule's order of forwards and backwards is not modelled")
    return actions


__all__ = ["activation_terms", "kept_layer_bytes", "recomputed_layer_bytes", "stage_actions", "token_id_terms"]
