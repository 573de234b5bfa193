"""Exporters: a checked composition out as a framework's configuration, or as DTensor placements.

Each exporter reads the composition's ``Layout`` (what the data axis shards comes from the
placement, so ``fsdp`` and ``zero3`` export alike) and writes every modifier the target can
say; what it cannot say it refuses with one line, or, where only the model code can say it,
names in ``Exported.notes``. The DTensor view is read from the ``Placement`` and the step
program's gradient origins; nothing here re-derives a placement.

Pipeline stages hold whole transformer layers: evenly when the layers divide by the stages,
otherwise (the ``uneven`` modifier) at most ``ceil(L / pp)`` on the fullest stage, which is what
the cost model charges (``Placement.stage_layers``). Each framework is told to split that way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any

from checker._layout import DataSharding, ExportError, Layout, layout_of
from formal._model import Ffn, Model, Norm, Transformer
from formal._placement import Placement, Recompute
from formal._program import Origin, gradient_origins
from formal._scalars import GLOBAL, LossScale, ScalarSettings
from formal._schedules import DEEPSPEED, MEGATRON, TORCHTITAN, PipelineSchedule
from formal._strategies import Composition
from formal._vocab import ATTENTION, EMBEDDING, EXPERTS, HEAD, MLP, Axis, Group, Mode, State


class Target(StrEnum):
    TORCHTITAN = "torchtitan"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"
    DTENSOR = "dtensor"


@dataclass(frozen=True)
class Exported:
    target: Target
    text: str  # the configuration as the framework reads it
    notes: tuple[str, ...] = ()  # what the user must still do by hand


def export(comp: Composition, model: Model, target: Target) -> Exported:
    if comp.options.sequence_parallel and comp.mesh().get(Axis.TP, 1) == 1:
        raise ExportError(
            f"{comp}: sequence parallelism without tensor parallelism (tp) has no "
            "framework spelling (the composition breaks sp_needs_tp)"
        )
    match target:
        case Target.TORCHTITAN:
            return export_torchtitan(comp, model)
        case Target.DEEPSPEED:
            return export_deepspeed(comp, model)
        case Target.MEGATRON:
            return export_megatron(comp, model)
        case Target.DTENSOR:
            return Exported(target, json.dumps(dtensor_placements(comp.placement(model)), indent=2))
        case _:
            raise AssertionError(target)


def _refuse(layout: Layout, target: str, **bad: bool) -> None:
    for what, present in bad.items():
        if present:
            raise ExportError(f"{layout.text()}: {target} cannot express {what.replace('_', ' ')}")


def _schedule_refusal(schedule: PipelineSchedule, target: str) -> dict[str, bool]:
    """The schedule's own refusal for ``target`` (``PipelineSchedule.refusals``), as a ``_refuse``
    keyword: what the framework cannot express of it, or nothing when it can."""
    what = schedule.refusal(target)
    return {} if what is None else {what: True}


def _micro(model: Model) -> int:
    return model.micro_batch


def _layers_per_chunk(layout: Layout, model: Model, target: str) -> int:
    """Layers per virtual stage: L / (pp x v), or its ceiling with declared uneven stages."""
    if not isinstance(model, Transformer):
        raise ExportError(
            f"{layout.text()}: the interleaved schedule needs a model with layers (--model) "
            f"to write {target}'s layers per virtual stage"
        )
    stages = layout.pp * layout.options.chunks
    if model.layers % stages == 0:
        return model.layers // stages
    per = -(-model.layers // stages)
    if not layout.options.uneven_stages or -(-model.layers // per) != stages:
        raise ExportError(
            f"{layout.text()}: {model.name}'s {model.layers} layers do not split into "
            f"pp({layout.pp}) x v({layout.options.chunks}) = {stages} virtual stages"
        )
    return per


def _uneven_layers(layout: Layout, model: Model) -> int | None:
    """The model's layer count when the stages are declared uneven and the layers do not divide
    by them (None: the even split, which is also what ``uneven`` means when they divide)."""
    if not layout.options.uneven_stages or layout.pp == 1 or not isinstance(model, Transformer):
        return None
    return model.layers if model.layers % (layout.pp * layout.options.chunks) else None


def megatron_uneven_split(layers: int, pp: int) -> tuple[int, int]:
    """``(first, last)`` for Megatron-LM's ``--decoder-first-pipeline-num-layers`` and
    ``--decoder-last-pipeline-num-layers``: the stages between them hold ``(layers - first -
    last) / (pp - 2)`` each, and no stage more than ``ceil(layers / pp)``. Middle stages are
    kept full and the remainder is shared by the first and last stage, which also run the
    embedding and the loss (Llama 3 405B: 126 layers on 16 stages, 7 on the first and last).
    ``ExportError`` when no such split exists (19 layers on 16 stages need three stages of 2).
    """
    fullest = -(-layers // pp)
    if pp < 2 or layers < pp:
        raise ExportError(f"{layers} layers on pp({pp}): every stage needs at least one layer")
    if pp == 2:
        return fullest, layers - fullest
    for middle in range(fullest, 0, -1):
        rest = layers - middle * (pp - 2)
        if middle == fullest and 2 <= rest <= 2 * fullest:
            return rest // 2, rest - rest // 2
        if middle < fullest and fullest + 1 <= rest <= 2 * fullest:
            return fullest, rest - fullest
    raise ExportError(
        f"{layers} layers on pp({pp}): Megatron-LM's first/last-stage layer counts cannot "
        f"hold them with at most {fullest} layers on every stage"
    )


# --- torchtitan -----------------------------------------------------------------------------


def export_torchtitan(comp: Composition, model: Model) -> Exported:
    """``[parallelism]``, ``[training]`` and ``[activation_checkpoint]`` of a torchtitan job TOML."""
    layout = layout_of(comp, model)
    o = layout.options
    assert layout.dp is not None
    _refuse(
        layout,
        "torchtitan",
        # FSDP2 has it (fully_shard(reshard_after_forward=<int>)); torchtitan's
        # fsdp_reshard_after_forward takes "default", "always" or "never" only
        ZeRO_hierarchical_partitioning_hpZ=layout.replicate == "hpz-dpr",
        ZeRO_1_or_2_sharding_without_parameters=layout.data in (DataSharding.OPTIMIZER, DataSharding.GRADIENTS),
        tensor_parallelism_without_sequence_parallelism=layout.tp > 1 and not o.sequence_parallel,
        offload_of_only_some_states=o.offload_optimizer != o.offload_parameters,
        offload_without_FSDP=o.offload_optimizer and layout.data is DataSharding.NONE,
        expert_parallelism_without_FSDP=layout.ep > 1 and layout.data is DataSharding.NONE,
        expert_parallelism_with_context_parallelism=layout.ep > 1 and layout.cp > 1,
        a_replicate_axis_without_FSDP=layout.dpr > 1 and layout.data is DataSharding.NONE,
        FSDP_over_one_device_as_shard_degree_1_disables_FSDP=(
            layout.data is not DataSharding.NONE and layout.dp * layout.ep == 1
        ),
        per_token_loss_normalisation_in_the_TOML=o.scalars.per_token,
        a_load_balancing_loss_scope_in_the_TOML=bool(o.scalars.balancing),
    )
    if layout.data is DataSharding.NONE:
        replicate, shard = layout.dp, 1
    else:
        replicate, shard = layout.dpr, layout.dp * layout.ep
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": "never" if layout.data is DataSharding.FULL_HELD else "always",
        "tensor_parallel_degree": layout.tp,
        "pipeline_parallel_degree": layout.pp,
        "context_parallel_degree": layout.cp,
        "expert_parallel_degree": layout.ep,
    }
    micro = _micro(model)
    training: dict[str, Any] = {}
    notes = []
    if layout.pp > 1:
        # torchtitan counts the embedding and the output layer as one layer each by default and
        # takes them off the first and last stage's share (pipeline_parallel_first/last_stage_
        # less_layers = 1); 0 splits the transformer layers alone: evenly, or with ceil(L / pp)
        # on the fullest stage when they do not divide (torchtitan splits uneven counts itself).
        par["pipeline_parallel_first_stage_less_layers"] = 0
        par["pipeline_parallel_last_stage_less_layers"] = 0
        uneven = _uneven_layers(layout, model)
        if uneven is not None:
            stages = layout.pp * o.chunks
            notes.append(
                f"uneven stages: torchtitan splits the {uneven} layers over the {stages} stages itself, "
                f"at most {-(-uneven // stages)} on one; no key of the TOML says so"
            )
        schedule = o.pipeline_schedule
        _refuse(layout, TORCHTITAN, **_schedule_refusal(schedule, TORCHTITAN))
        assert schedule.torchtitan is not None, schedule  # a schedule torchtitan lacks says so in its refusals
        par["pipeline_parallel_schedule"] = schedule.torchtitan
        if schedule.chunked:
            par["pipeline_parallel_layers_per_stage"] = _layers_per_chunk(layout, model, "torchtitan")
        par["pipeline_parallel_microbatch_size"] = micro
        training["local_batch_size"] = micro * o.micro_batches
    else:
        _refuse(layout, "torchtitan", a_pipeline_schedule_without_pp=not o.pipeline_schedule.default)
        training["local_batch_size"] = micro
        if o.micro_batches > 1:  # gradient accumulation: global = local x dp x steps
            training["global_batch_size"] = micro * layout.data_degree * o.micro_batches
    if isinstance(model, Transformer):
        training["seq_len"] = model.seq
    if o.offload_optimizer:
        training["enable_cpu_offload"] = True
    if o.scalars.clip:
        training["max_norm"] = _max_norm(o.scalars)
    match o.recompute:
        case Recompute.NONE:
            ac: dict[str, Any] = {"mode": "none"}
        case Recompute.FULL:
            ac = {"mode": "full"}
        case Recompute.SELECTIVE:
            ac = {"mode": "selective", "selective_ac_option": "op"}
        case _:
            raise AssertionError(o.recompute)
    if o.scalars.loss_scale is LossScale.DYNAMIC:
        notes.append(
            "fp16 dynamic loss scaling: torchtitan trains in bf16 without a loss scale, so there is no "
            "overflow decision to reduce; the checked composition's fp16 obligations do not apply"
        )
    text = _toml({"parallelism": par, "training": training, "activation_checkpoint": ac})
    if layout.cp > 1 and layout.data is not DataSharding.NONE:
        notes.append("torchtitan's FSDP also shards parameters over cp; the checked composition replicates them")
    return Exported(Target.TORCHTITAN, text, tuple(notes))


def _toml(sections: dict[str, dict[str, Any]]) -> str:
    out: list[str] = []
    for name, body in sections.items():
        out.append(f"[{name}]")
        for key, value in body.items():
            out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _max_norm(settings: ScalarSettings) -> float:
    """The clipping threshold to write: the one read, else the frameworks' common default, 1.0."""
    return float(settings.max_norm) if settings.max_norm is not None else 1.0


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string for plain text
    raise AssertionError(value)


# --- DeepSpeed ------------------------------------------------------------------------------

_DS_STAGE = {DataSharding.NONE: 0, DataSharding.OPTIMIZER: 1, DataSharding.GRADIENTS: 2, DataSharding.FULL: 3}


def export_deepspeed(comp: Composition, model: Model) -> Exported:
    """A DeepSpeed JSON fragment: batch sizes, ``zero_optimization``, ``pipeline``, ``tensor_parallel``."""
    layout = layout_of(comp, model)
    o = layout.options
    assert layout.dp is not None
    stage = _DS_STAGE.get(layout.data)
    hpz = layout.replicate == "hpz-dpr"  # ZeRO++ hpZ: ZeRO-3 over dp x dpr, secondary partition within dp
    _refuse(
        layout,
        "DeepSpeed",
        hierarchical_partitioning_without_ZeRO_3=hpz and stage != 3,
        # zero_hpz_partition_size 1 is DeepSpeed's default: no secondary partition at all
        hierarchical_partitioning_over_nodes_of_one_device=hpz and layout.dp == 1,
        parameters_held_through_backward=stage is None,
        a_replicate_axis=layout.dpr > 1 and not hpz,
        context_parallelism=layout.cp > 1,
        expert_parallelism_in_the_JSON=layout.ep > 1,
        sequence_parallelism=o.sequence_parallel,
        **_schedule_refusal(o.pipeline_schedule, DEEPSPEED),
        ZeRO_2_or_3_with_pipeline_parallelism=layout.pp > 1 and (stage or 0) >= 2,
        AutoTP_with_ZeRO_3=layout.tp > 1 and stage == 3,
        optimizer_offload_at_stage_0=o.offload_optimizer and stage == 0,
        parameter_offload_below_stage_3=o.offload_parameters and stage != 3,
        selective_recomputation=o.recompute is Recompute.SELECTIVE,
        per_token_loss_normalisation_in_the_JSON=o.scalars.per_token,
        a_load_balancing_loss_in_the_JSON=bool(o.scalars.balancing),
    )
    assert stage is not None
    micro = _micro(model)
    zero: dict[str, Any] = {"stage": stage}
    if o.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if o.offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if hpz and layout.dpr > 1:
        zero["zero_hpz_partition_size"] = layout.dp  # the secondary partition's group: one node
    doc: dict[str, Any] = {
        "train_batch_size": micro * o.micro_batches * layout.dp * (layout.dpr if hpz else 1),
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": o.micro_batches,
        "zero_optimization": zero,
    }
    if o.scalars.clip:
        doc["gradient_clipping"] = _max_norm(o.scalars)
    if o.scalars.loss_scale is LossScale.DYNAMIC:
        doc["fp16"] = {"enabled": True, "loss_scale": 0}
    else:
        doc["bf16"] = {"enabled": True}
    notes: list[str] = []
    if layout.pp > 1:
        doc["pipeline"] = {"stages": layout.pp}
        if o.recompute is Recompute.FULL:
            doc["pipeline"]["activation_checkpoint_interval"] = 1
        uneven = _uneven_layers(layout, model)
        split = "" if uneven is None else f" (uneven: at most {-(-uneven // layout.pp)} of the {uneven} layers each)"
        notes.append(
            f"build the model as deepspeed.pipe.PipelineModule(num_stages={layout.pp}, "
            'partition_method="type:<your transformer block class>"): equal transformer layers per '
            f'stage{split}, as the composition places them (the default, "parameters", balances '
            "parameter counts instead)"
        )
    elif o.recompute is Recompute.FULL:
        notes.append("full recomputation: wrap each layer in deepspeed.checkpointing.checkpoint (model code)")
    if layout.tp > 1:
        doc["tensor_parallel"] = {"autotp_size": layout.tp}
    return Exported(Target.DEEPSPEED, json.dumps(doc, indent=2), tuple(notes))


# --- Megatron-LM ----------------------------------------------------------------------------


def export_megatron(comp: Composition, model: Model) -> Exported:
    """Megatron-LM command-line arguments (one per line, ready for a launch script)."""
    layout = layout_of(comp, model)
    o = layout.options
    assert layout.dp is not None
    _refuse(
        layout,
        "Megatron-LM",
        ZeRO_hierarchical_partitioning_hpZ=layout.replicate == "hpz-dpr",
        ZeRO_2_or_3_or_FSDP_in_its_DDP=layout.data not in (DataSharding.NONE, DataSharding.OPTIMIZER),
        a_replicate_axis=layout.dpr > 1,
        offload=o.offload_optimizer or o.offload_parameters,
        **_schedule_refusal(o.pipeline_schedule, MEGATRON),
    )
    micro = _micro(model)
    args: list[tuple[str, str | None]] = []
    notes: list[str] = []
    if isinstance(model, Transformer):
        args += megatron_model_arguments(model, layout.tp)
        if not model.final_norm:
            notes.append(f"{model.name}: Megatron-LM always adds a final norm ({model.hidden:,} or more parameters)")
    args += [("--tensor-model-parallel-size", str(layout.tp)), ("--pipeline-model-parallel-size", str(layout.pp))]
    uneven = _uneven_layers(layout, model)
    if uneven is not None:
        _refuse(layout, "Megatron-LM", uneven_stages_with_an_interleaved_schedule=o.pipeline_schedule.chunked)
        try:
            first, last = megatron_uneven_split(uneven, layout.pp)
        except ExportError as err:
            raise ExportError(f"{layout.text()}: {err}") from None
        args += [("--decoder-first-pipeline-num-layers", str(first)), ("--decoder-last-pipeline-num-layers", str(last))]
    flag = o.pipeline_schedule.megatron_flag
    if flag is not None:
        args.append((flag, str(_layers_per_chunk(layout, model, "Megatron"))))
    if layout.cp > 1:
        args.append(("--context-parallel-size", str(layout.cp)))
    if layout.ep > 1:
        args.append(("--expert-model-parallel-size", str(layout.ep)))
    if o.sequence_parallel:
        args.append(("--sequence-parallel", None))
    if layout.data is DataSharding.OPTIMIZER:
        args.append(("--use-distributed-optimizer", None))
    match o.recompute:
        case Recompute.NONE:
            pass
        case Recompute.FULL:
            args += [
                ("--recompute-granularity", "full"),
                ("--recompute-method", "uniform"),
                ("--recompute-num-layers", "1"),
            ]
        case Recompute.SELECTIVE:
            args.append(("--recompute-granularity", "selective"))
        case _:
            raise AssertionError(o.recompute)
    dp_megatron = layout.dp * layout.ep  # Megatron's data-parallel group contains the expert ranks
    args += [
        ("--micro-batch-size", str(micro)),
        ("--global-batch-size", str(micro * dp_megatron * o.micro_batches)),
        ("--fp16" if o.scalars.loss_scale is LossScale.DYNAMIC else "--bf16", None),
    ]
    if o.scalars.clip:
        args.append(("--clip-grad", repr(_max_norm(o.scalars))))
    if o.scalars.per_token:
        args.append(("--calculate-per-token-loss", None))
    if o.scalars.balancing:
        kind = "global_aux_loss" if o.scalars.balancing == GLOBAL else "aux_loss"
        coeff = o.scalars.aux_loss_coeff if o.scalars.aux_loss_coeff is not None else Fraction(1, 100)
        args += [("--moe-router-load-balancing-type", kind), ("--moe-aux-loss-coeff", repr(float(coeff)))]
    text = " \\\n".join(name if value is None else f"{name} {value}" for name, value in args) + "\n"
    devices = dp_megatron * layout.tp * layout.pp * layout.cp
    notes.append(f"launch on {devices} devices (torchrun ... pretrain_gpt.py ARGS)")
    return Exported(Target.MEGATRON, text, tuple(notes))


def megatron_model_arguments(model: Transformer, tp: int) -> list[tuple[str, str | None]]:
    """The model's architecture as Megatron-LM's arguments (``megatron/training/arguments.py``),
    every one stated rather than left to a default: sizes, the FFN width and kind (``--swiglu``),
    the norm (``--normalization RMSNorm``), grouped-query attention (``--group-query-attention
    --num-query-groups``), a decoupled head width (``--kv-channels``), rotary instead of learned
    positions, untied embeddings, linear biases (``--disable-bias-linear``; ``--add-qkv-bias`` for
    Qwen2's biases on Q, K and V only), QK norms (``--qk-layernorm``), experts, and dropout (both
    rates 0 for a model that trains without it; Megatron-LM's default is 0.1). The vocabulary:
    Megatron-LM pads the tokenizer's size to a multiple of ``--make-vocab-size-divisible-by``
    (128) x tp, so the multiple is lowered to tp when that keeps the model's vocabulary whole;
    the tokenizer itself is the user's to give."""
    args: list[tuple[str, str | None]] = [
        ("--num-layers", str(model.layers)),
        ("--hidden-size", str(model.hidden)),
        ("--num-attention-heads", str(model.heads)),
        ("--seq-length", str(model.seq)),
        ("--max-position-embeddings", str(model.seq)),
        ("--ffn-hidden-size", str(model.ffn_)),
    ]
    if model.kv_heads_ != model.heads:
        args += [("--group-query-attention", None), ("--num-query-groups", str(model.kv_heads_))]
    if model.head_dim * model.heads != model.hidden:
        args.append(("--kv-channels", str(model.head_dim)))
    if model.ffn_kind is Ffn.SWIGLU:
        args.append(("--swiglu", None))
    if model.norm is Norm.RMSNORM:
        args.append(("--normalization", "RMSNorm"))
    if not model.learned_positions:
        args.append(("--position-embedding-type", "rope"))
    if not model.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if not model.bias:
        args.append(("--disable-bias-linear", None))
        if model.qkv_bias:
            args.append(("--add-qkv-bias", None))
    if model.qk_norm:
        args.append(("--qk-layernorm", None))
    if model.is_moe:
        args += [
            ("--num-experts", str(model.experts)),
            ("--moe-router-topk", str(model.top_k)),
            ("--moe-ffn-hidden-size", str(model.ffn_)),
        ]
    if not model.dropout:
        args += [("--attention-dropout", "0"), ("--hidden-dropout", "0")]
    args.append(("--vocab-size", str(model.vocab)))
    if model.vocab % (128 * tp):
        if model.vocab % tp:
            raise ExportError(
                f"{model.name}: a vocabulary of {model.vocab:,} tokens does not split over tp({tp}); "
                "Megatron-LM would pad it (a larger model than the one checked)"
            )
        args.append(("--make-vocab-size-divisible-by", "1"))
    return args


# --- DTensor --------------------------------------------------------------------------------

# Which tensor dimension a shard cuts along tp (Megatron / torch.distributed.tensor.parallel):
# column-parallel weights (QKV, FFN in) are Shard(0) of [out, in], row-parallel ones (attention
# output, FFN out) Shard(1); the vocabulary-parallel embedding and head are Shard(0) of [vocab, h].
_TP_DIMS: dict[Group, str] = {
    ATTENTION: "Shard(0) wq/wk/wv, Shard(1) wo",
    MLP: "Shard(0) w1/w3, Shard(1) w2",
    EXPERTS: "Shard(1) w1/w3, Shard(2) w2",
    EMBEDDING: "Shard(0)",
    HEAD: "Shard(0)",
}


def _shard(axis: Axis, group: Group) -> str:
    if axis.kind.splits_matrices:
        return _TP_DIMS.get(group, "Shard(0)")
    return "Shard(0)"  # FSDP2 and expert parallelism shard dim 0 (rows, or the expert index)


def _placement_name(entry_mode: Mode, axis: Axis, group: Group) -> str:
    match entry_mode:
        case Mode.REPLICATED:
            return "Replicate()"
        case Mode.SHARDED:
            return _shard(axis, group)
        case Mode.SHARDED_GATHER:
            return f"{_shard(axis, group)} -> all-gather to Replicate() per use"
        case Mode.MATERIALIZED | Mode.OFFLOADED:
            return entry_mode.long_name
        case _:
            raise AssertionError(entry_mode)


def dtensor_placements(pl: Placement) -> dict[str, Any]:
    """Per parameter group, the DTensor placement on each mesh dimension (pp is not a DTensor dim).

    ``parameters``/``optimizer``: the resting layout. ``gradients_after_backward``: ``Partial``
    where the step program's gradient origin is partial (mean along data axes, sum otherwise).
    ``gradients``: after the gradient synchronisation. Offloaded states say ``host``.
    """
    mesh = [axis for axis in pl.axes if not axis.kind.is_pipeline]
    origins = gradient_origins(pl)
    groups: dict[str, Any] = {}
    for group in pl.groups(State.PARAMETERS):
        row: dict[str, Any] = {}
        for state, key in (
            (State.PARAMETERS, "parameters"),
            (State.OPTIMIZER, "optimizer"),
            (State.GRADIENTS, "gradients"),
        ):
            cells = [_placement_name(pl.mode(state, group, axis), axis, group) for axis in mesh]
            if pl.local_mode(state, group) is Mode.OFFLOADED:
                cells = [f"{c} (host)" for c in cells]
            row[key] = cells
        row["gradients_after_backward"] = [
            ("Partial(avg)" if axis.splits_data else "Partial(sum)")
            if origins[(group, axis)] is Origin.PARTIAL
            else _placement_name(pl.mode(State.GRADIENTS, group, axis), axis, group)
            for axis in mesh
        ]
        if pl.pipelined:
            row["pp"] = "stage-local module (pipeline stages are separate modules, not a DTensor mesh dim)"
            if group in pl.tied:
                row["pp"] = "on the first and last stage; gradients summed across them"
        groups[group.name] = row
    return {"mesh_dims": [a.value for a in mesh], "mesh_shape": [int(pl.degree(a)) for a in mesh], "groups": groups}
