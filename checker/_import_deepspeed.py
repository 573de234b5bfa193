"""The DeepSpeed JSON importer (https://www.deepspeed.ai/docs/config-json/): world size =
dp x tp x pp, train_batch_size = micro x gas x dp; ZeRO stages, offload, hpZ, AutoTP and the
pipeline engine.

``checker._importers`` is the entry (``load_config``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from checker._import_common import (
    ConfigError,
    Framework,
    Imported,
    Unmapped,
    _check_keys,
    _divide,
    _pos_int,
    _schema,
    _shown,
    imported,
)
from checker._import_deepspeed_types import ds_precision
from checker._import_scalars import deepspeed_scalars
from checker._layout import DataSharding, Layout
from checker._numbers import MAX_BATCH, MAX_DEGREE, MAX_MICRO_BATCH
from formal._engine_deepspeed import DeepSpeedEffects
from formal._input import OBJECT, TEXT, Expect, Schema, integer
from formal._model import Model, Transformer
from formal._placement import Options, Recompute
from formal._presets import DEFAULT_DEVICES

# --- DeepSpeed ------------------------------------------------------------------------------

_DS_STAGES = {0: "dp", 1: "zero1", 2: "zero2", 3: "zero3"}
_DS_SHARDING = {0: DataSharding.NONE, 1: DataSharding.OPTIMIZER, 2: DataSharding.GRADIENTS, 3: DataSharding.FULL}
_DS_MAPPED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "pipeline",
    "tensor_parallel",
    "fp16",
    "bf16",
    "activation_checkpointing",
    "gradient_clipping",
)
# Keys with no effect on placements (optimizer hyper-parameters, logging, I/O): accepted, not mapped.
_DS_IGNORED = (
    "optimizer",
    "scheduler",
    "steps_per_print",
    "wall_clock_breakdown",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "dump_state",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "monitor_config",
    "comms_logger",
    "communication_data_type",
    "data_types",
    "amp",
    "memory_breakdown",
    "checkpoint",
    "elasticity",
    "autotuning",
    "data_efficiency",
    "curriculum_learning",
    "compression_training",
    "aio",
    "nebula",
    "seq_parallel_communication_data_type",
    "disable_allgather",
    "timers",
    "torch_autocast",
    "weight_quantization",
    "use_data_before_expert_parallelism",
    "graph_harvesting",
    "compile",
    "sparse_attention",
    "dataloader_drop_last",
)
# Keys that change memory or traffic in ways the composition does not count: each one present is
# reported (``Unmapped``) with what it changes, never dropped. DeepSpeed's config reference
# (https://www.deepspeed.ai/docs/config-json/) and ZeRO++ (Wang et al. 2023) for the quantisation.
_BUFFERS = "a communication buffer; buffers are not counted (0 bytes)"
_REUSE = (
    "gathered parameters kept for reuse: the deepspeed engine's collectives drop the saved gathers "
    "(formal._engine_deepspeed); the placement counts a gather per use and not the memory"
)
_PREFETCH = (
    "parameters fetched ahead, up to a live limit: the deepspeed engine replays ZeRO-3's fetches "
    "(formal._engine_zero3) for its gathers and its gathered working set; the placement counts one layer"
)
_PERSIST = (
    "small parameters kept unpartitioned: the deepspeed engine's collectives fetch them never and gather them "
    "after the step (formal._engine_deepspeed); the placement counts them partitioned"
)
_DS_ZERO_EFFECTS = {
    "allgather_bucket_size": "splits ZeRO-1/2's parameter gather only where torch lacks all_gather_into_tensor "
    "(DeepSpeed's all_gather_dp_groups): one gather a step",
    "stage3_prefetch_bucket_size": _PREFETCH,
    "prefetch_bucket_size": _PREFETCH,
    "stage3_max_live_parameters": _PREFETCH,
    "max_live_parameters": _PREFETCH,
    "stage3_max_reuse_distance": _REUSE,
    "max_reuse_distance": _REUSE,
    "stage3_param_persistence_threshold": _PERSIST,
    "param_persistence_threshold": _PERSIST,
    "stage3_model_persistence_threshold": _PERSIST,
    "model_persistence_threshold": _PERSIST,
    "sub_group_size": f"optimizer step in groups of this many elements: {_BUFFERS}",
    "contiguous_gradients": f"gradients copied into a contiguous buffer: {_BUFFERS}",
    "reduce_scatter": "false reduces gradients with all-reduce instead of reduce-scatter: the traffic counted is "
    "reduce-scatter's",
    "allgather_partitions": "false gathers with broadcasts instead of all-gather: the traffic counted is all-gather's",
    "use_multi_rank_bucket_allreduce": "true all-reduces each ZeRO-1/2 gradient bucket (2(n-1)/n of it), false "
    "reduces each slice onto its owner ((n-1)/n): the deepspeed engine's collectives count the calls "
    "(formal._engine_deepspeed); the placement counts a reduce-scatter",
    "zero_quantized_weights": "ZeRO++ qwZ: parameters gathered in int8 (half of fp16's bytes): counted at full width",
    "zero_quantized_nontrainable_weights": "ZeRO++: frozen parameters held in int8: counted at full width",
    "zero_quantized_gradients": "ZeRO++ qgZ: gradients reduced in int4 all-to-all: counted at full width",
    "zeropp_loco_param": "ZeRO++ LoCo error feedback: its buffers are not counted",
    "memory_efficient_linear": "a linear that frees its input early: activations counted as kept",
}
_DS_OFFLOAD_EFFECTS = {
    "ratio": "only this fraction of the optimizer is offloaded: counted as all of it",
    "buffer_count": "staging buffers for offload: not counted",
    "buffer_size": "staging buffers for offload: not counted",
    "max_in_cpu": "parameters kept in host memory before NVMe: not counted",
}
_DS_TOP_EFFECTS = {
    "communication_data_type": "the data type gradients are reduced in: the precision recipe's wire bytes are used",
    "sparse_gradients": "sparse embedding gradients travel as indices and values: counted dense",
    "seq_parallel_communication_data_type": "sequence-parallel traffic's data type: not modelled",
    "disable_allgather": "parameters broadcast instead of all-gathered: all-gather traffic counted",
    "weight_quantization": "quantised weights: counted at full width",
    "compression_training": "compressed (quantised, pruned) training: counted uncompressed",
    "amp": "NVIDIA Apex AMP: the precision recipe's bytes are used",
    "torch_autocast": "autocast lower-precision activations: the precision recipe's activations are used",
    "sparse_attention": "sparse attention: dense attention activations are counted",
    "data_efficiency": "data sampling and routing can change the sequences seen: counted at full length",
    "curriculum_learning": "a curriculum changes the sequence length over training: counted at the full length",
}
# Optimizers whose state is two fp32 moments beside the fp32 master (the 12 bytes recipes count).
_DS_ADAM_LIKE = ("adam", "adamw", "lamb", "fusedadam", "cpuadam", "deepspeedcpuadam")
_DS_ZERO_MAPPED = ("stage", "offload_optimizer", "offload_param", "zero_hpz_partition_size")
_DS_ZERO_IGNORED = (
    "contiguous_gradients",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "allgather_partitions",
    "allgather_bucket_size",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "elastic_checkpoint",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "ignore_unused_parameters",
    "legacy_stage1",
    "use_multi_rank_bucket_allreduce",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "cpu_offload_use_pin_memory",
)
# Keys that change the placement in a way the composition language cannot say: refused.
_DS_ZERO_REFUSED = {
    "mics_shard_size": "MiCS shards within groups; write it as zero3<k>xdpr<n/k> instead",
    "cpu_offload": 'deprecated: use offload_optimizer.device = "cpu"',
    "cpu_offload_param": 'deprecated: use offload_param.device = "cpu"',
}
_DS_OFFLOAD_KEYS = (
    "device",
    "pin_memory",
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
    "ratio",
    "pipeline",
)
_DS_PIPELINE_KEYS = (
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
    "use_reentrant",
)


_DS_BATCH = integer(words=("auto",))
_DS_OFFLOAD = Expect(OBJECT.label, OBJECT.types, nullable=True)
# The type of every key the DeepSpeed importer reads (values and ranges it checks itself).
DEEPSPEED_SCHEMA: Schema = {
    "train_batch_size": _DS_BATCH,
    "train_micro_batch_size_per_gpu": _DS_BATCH,
    "gradient_accumulation_steps": _DS_BATCH,
    "zero_optimization": OBJECT,
    "zero_optimization.stage": integer(),
    "zero_optimization.offload_optimizer": _DS_OFFLOAD,
    "zero_optimization.offload_optimizer.device": TEXT,
    "zero_optimization.offload_param": _DS_OFFLOAD,
    "zero_optimization.offload_param.device": TEXT,
    "zero_optimization.overlap_comm": Expect("true, false or null", (bool,), nullable=True),
    "pipeline": OBJECT,
    "pipeline.stages": _DS_BATCH,
    "pipeline.activation_checkpoint_interval": integer(),
    "tensor_parallel": Expect(OBJECT.label, OBJECT.types, nullable=True),
    "tensor_parallel.autotp_size": integer(),
    "fp16": OBJECT,
    "fp16.enabled": Expect('true, false or "auto"', (bool,), ("auto",)),
    "bf16": OBJECT,
    "bf16.enabled": Expect('true, false or "auto"', (bool,), ("auto",)),
    "activation_checkpointing": OBJECT,
    "data_types": OBJECT,
    "data_types.grad_accum_dtype": Expect(TEXT.label, TEXT.types, nullable=True),
}


def import_deepspeed(
    raw: Any, *, devices: int | None, model: Model | None = None, where: str = "deepspeed.json"
) -> Imported:
    """A DeepSpeed JSON config. World size = dp x tp x pp; train_batch = micro x gas x dp.

    ``model`` (when known) tells whether the pipeline's layers divide by its stages."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object {{...}}")
    if not raw:
        raise ConfigError(
            f"{where}: an empty object states nothing to check (no zero_optimization, pipeline or batch sizes)"
        )
    _schema(raw, DEEPSPEED_SCHEMA, where)
    _check_keys(raw, _DS_MAPPED + _DS_IGNORED, where)
    if "sequence_parallel_size" in raw:
        raise ConfigError(f"{where}: sequence_parallel_size (DeepSpeed-Ulysses) is not mapped")
    notes: list[Unmapped] = []
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: zero_optimization must be an object")
    _ds_effects(raw, zero, notes)
    engine = deepspeed_effects(raw, where)  # its engine settings (bad values refused here)
    # the reduce bucket as the model sizes it ("auto": Hugging Face's hidden^2)
    engine = replace(engine, reduce_bucket_elements=_ds_buffers(zero, where, model, notes).reduce_bucket_elements)
    for key, why in _DS_ZERO_REFUSED.items():
        if key in zero and zero[key] not in (None, 0, 1, False):
            raise ConfigError(f"{where}: zero_optimization.{key}={zero[key]!r}: {why}")
    _check_keys(zero, _DS_ZERO_MAPPED + _DS_ZERO_IGNORED + tuple(_DS_ZERO_REFUSED), where, "zero_optimization.")
    stage = zero.get("stage", 0)
    if stage not in _DS_STAGES or isinstance(stage, bool):
        raise ConfigError(f"{where}: zero_optimization.stage={stage!r}: ZeRO stage must be 0, 1, 2 or 3")
    off_opt = _ds_offload(zero, "offload_optimizer", where)
    off_par = _ds_offload(zero, "offload_param", where)
    if off_opt and stage == 0:
        raise ConfigError(f"{where}: zero_optimization.offload_optimizer needs stage 1, 2 or 3 (stage is 0)")
    if off_par and stage != 3:
        raise ConfigError(f"{where}: zero_optimization.offload_param is valid only with stage 3 (stage is {stage})")
    tp = _ds_section_int(
        raw, "tensor_parallel", "autotp_size", where, ("autotp_size", "tp_size", "tp", "partition_config")
    )
    if tp > 1 and stage == 3:
        raise ConfigError(
            f"{where}: tensor_parallel.autotp_size={tp} with ZeRO stage 3: AutoTP training supports stages 0, 1 and 2"
        )
    pipe = raw.get("pipeline", {})
    if not isinstance(pipe, dict):
        raise ConfigError(f"{where}: pipeline must be an object")
    _check_keys(pipe, _DS_PIPELINE_KEYS, where, "pipeline.")
    stages = pipe.get("stages", 1)
    if stages == "auto":
        raise ConfigError(
            f'{where}: pipeline.stages="auto": the stage count is set in code '
            "(PipelineModule(num_stages=...)); write the number here"
        )
    pp = _pos_int(stages, where, "pipeline.stages")
    if pp > 1 and stage >= 2:
        raise ConfigError(
            f"{where}: zero_optimization.stage={stage} with pipeline.stages={pp}: DeepSpeed's "
            f"pipeline engine supports ZeRO stage 0 or 1 only (check zero{stage}xpp{pp} directly "
            "to see what it would cost)"
        )
    recompute = Recompute.NONE
    interval = pipe.get("activation_checkpoint_interval", 0)
    if interval:
        _pos_int(interval, where, "pipeline.activation_checkpoint_interval")
        recompute = Recompute.FULL
        if interval > 1:
            notes.append(
                Unmapped(
                    f"pipeline.activation_checkpoint_interval={interval}",
                    f"one checkpoint every {interval} layers; counted as one per layer (an upper bound "
                    "on activation memory)",
                )
            )
    if "activation_checkpointing" in raw:
        notes.append(
            Unmapped(
                "activation_checkpointing",
                "recomputation is switched on in model code (deepspeed.checkpointing.checkpoint), not "
                "by this section; add 'recompute' if it is",
            )
        )
    micro = _ds_batch(raw, "train_micro_batch_size_per_gpu", where, notes)
    gas = _ds_batch(raw, "gradient_accumulation_steps", where, notes)
    total = _ds_batch(raw, "train_batch_size", where, notes)
    dp, micro, gas, devices = _ds_solve_batch(total, micro, gas, devices, tp, pp, where, notes)
    precision = ds_precision(raw, where, notes, stage, off_opt)
    uneven = _ds_uneven(pp, model, notes)
    options = Options(
        offload_optimizer=off_opt,
        offload_parameters=off_par,
        recompute=recompute,
        micro_batches=gas,
        uneven_stages=uneven,
        scalars=deepspeed_scalars(raw, where),
    )
    hpz = zero.get("zero_hpz_partition_size")  # DeepSpeed's default 1 (and 0) mean no secondary partition
    node = 1 if hpz is None else max(1, _pos_int(hpz, where, "zero_optimization.zero_hpz_partition_size", allow=(0,)))
    if node > 1:  # ZeRO++ hpZ: ZeRO-3 within groups of `node` ranks (dp), held across them (hpz-dpr)
        if stage != 3:
            raise ConfigError(
                f"{where}: zero_optimization.zero_hpz_partition_size={node} needs stage 3 "
                f"(ZeRO++ partitions ZeRO-3's parameters; stage is {stage})"
            )
        if dp is None:
            dp = _divide(DEFAULT_DEVICES, {"tp": tp, "pp": pp}, where, "--devices")
            devices = dp * tp * pp
            notes.append(
                Unmapped(
                    "zero_hpz_partition_size",
                    f"the data-parallel degree is taken as {dp} of the default {DEFAULT_DEVICES} devices "
                    "(give --devices)",
                )
            )
        if dp % node:
            raise ConfigError(
                f"{where}: zero_optimization.zero_hpz_partition_size={node} does not divide the "
                f"data-parallel degree {dp}"
            )
        layout = Layout(
            "zero3", DataSharding.FULL, node, dpr=dp // node, tp=tp, pp=pp, options=options, replicate="hpz-dpr"
        )
        return replace(
            imported(Framework.DEEPSPEED, layout, devices, micro, None, precision, None, notes), deepspeed=engine
        )
    layout = Layout(_DS_STAGES[stage], _DS_SHARDING[stage], dp, tp=tp, pp=pp, options=options)
    return replace(
        imported(Framework.DEEPSPEED, layout, devices, micro, None, precision, None, notes), deepspeed=engine
    )


def _ds_buffers(zero: dict[str, Any], where: str, model: Model | None, notes: list[Unmapped]) -> DeepSpeedEffects:
    """The buffer settings DeepSpeed's terms read (``formal._engine_deepspeed``), defaults as
    DeepSpeed's ``runtime/zero/config.py``: ``reduce_bucket_size`` 5e8 elements (a JSON number
    such as 5e8 or 500000000; DeepSpeed's ``pp_int`` reads integral floats), ``overlap_comm``
    None (True for ZeRO-3 only). ``"auto"`` is Hugging Face Trainer's: it fills the bucket with
    hidden x hidden elements (transformers' ``integrations/deepspeed.py``,
    ``trainer_config_finalize``), known only with the model."""
    default = DeepSpeedEffects().reduce_bucket_elements
    size = zero.get("reduce_bucket_size", default)
    if size == "auto":
        if isinstance(model, Transformer):
            size = model.hidden * model.hidden
        else:
            size = default
            why = f"Hugging Face fills it with hidden^2 elements; without the model {default:,} (DeepSpeed's default)"
            notes.append(Unmapped("zero_optimization.reduce_bucket_size=auto", why))
    if isinstance(size, bool) or not isinstance(size, int | float) or size != int(size) or size < 1:
        raise ConfigError(f"{where}: zero_optimization.reduce_bucket_size={_shown(size)}: a positive whole number")
    if int(size) > MAX_BUCKET:
        raise ConfigError(f"{where}: zero_optimization.reduce_bucket_size={_shown(size)}: at most {MAX_BUCKET:.0e}")
    overlap = zero.get("overlap_comm")
    if overlap is not None and not isinstance(overlap, bool):
        raise ConfigError(f"{where}: zero_optimization.overlap_comm={_shown(overlap)}: true, false or null")
    return DeepSpeedEffects(reduce_bucket_elements=int(size), overlap_comm=overlap)


# The largest bucket read (elements): beyond any device's memory, so a typo is caught.
MAX_BUCKET = 10**13


def _ds_effects(raw: dict[str, Any], zero: dict[str, Any], notes: list[Unmapped]) -> None:
    """Every key present that changes memory or traffic beyond the composition, as ``Unmapped``."""
    for key, why in _DS_TOP_EFFECTS.items():
        if key in raw:
            notes.append(Unmapped(f"{key}={_shown(raw[key])}", why))
    for key, why in _DS_ZERO_EFFECTS.items():
        if key in zero:
            notes.append(Unmapped(f"zero_optimization.{key}={_shown(zero[key])}", why))
    for section in ("offload_optimizer", "offload_param"):
        body = zero.get(section)
        if isinstance(body, dict):
            for key, why in _DS_OFFLOAD_EFFECTS.items():
                if key in body:
                    notes.append(Unmapped(f"zero_optimization.{section}.{key}={_shown(body[key])}", why))
    optimizer = raw.get("optimizer")
    if isinstance(optimizer, dict):
        kind = optimizer.get("type")
        if not isinstance(kind, str) or kind.lower() not in _DS_ADAM_LIKE:
            notes.append(
                Unmapped(
                    f"optimizer.type={_shown(kind)}",
                    "the optimizer state is counted as Adam's two fp32 moments beside the fp32 master "
                    "(12 bytes a parameter); 1-bit optimizers also compress their traffic",
                )
            )
    checkpointing = raw.get("activation_checkpointing")
    if isinstance(checkpointing, dict):
        for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
            if checkpointing.get(key):
                notes.append(
                    Unmapped(
                        f"activation_checkpointing.{key}=true",
                        "where checkpoints are kept (partitioned over tp, on the host, contiguous) is not counted",
                    )
                )


_DS_FLAGS = {  # zero_optimization key -> DeepSpeedEffects field (booleans)
    "use_multi_rank_bucket_allreduce": "allreduce_gradients",
    "reduce_scatter": "reduce_scatter",
    "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm",
    "compute_grad_norm": "compute_grad_norm",
    "round_robin_gradients": "round_robin_gradients",
}
_DS_SIZES = {  # zero_optimization key (and its stage3_ alias) -> DeepSpeedEffects field (elements)
    "reduce_bucket_size": "reduce_bucket_elements",
    "param_persistence_threshold": "param_persistence_threshold",
    "model_persistence_threshold": "model_persistence_threshold",
    "max_reuse_distance": "max_reuse_distance",
    "prefetch_bucket_size": "prefetch_bucket_elements",
    "max_live_parameters": "max_live_parameters",
}


def deepspeed_effects(raw: dict[str, Any], where: str = "deepspeed.json") -> DeepSpeedEffects:
    """The settings of DeepSpeed's engine terms (``formal._engine_deepspeed.DeepSpeedEffects``)
    a config states, DeepSpeed's defaults (``deepspeed/runtime/zero/config.py``) for the rest:
    bucket and persistence sizes, reuse distance, prefetch, the reduction flags, fp16 and the
    bf16 overflow check. ``"auto"`` (the Hugging Face Trainer's) takes the default. Bad values:
    one ``ConfigError`` line."""
    zero = raw.get("zero_optimization", {})
    zero = zero if isinstance(zero, dict) else {}
    fields: dict[str, Any] = {"overlap_comm": zero.get("stage") == 3}  # DeepSpeed's default: on for ZeRO-3
    for key, name in _DS_FLAGS.items():
        value = zero.get(key)
        if value is None or value == "auto":
            continue
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: zero_optimization.{key}={_shown(value)}: expected true or false")
        fields[name] = value
    for key, name in _DS_SIZES.items():
        for spelled in (f"stage3_{key}", key):
            value = zero.get(spelled)
            if value is None or value == "auto":
                continue
            integral = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
            low = 1 if key == "reduce_bucket_size" else 0
            if not integral or not low <= value <= 2**63 - 1:
                raise ConfigError(f"{where}: zero_optimization.{spelled}={_shown(value)}: expected an integer >= {low}")
            fields[name] = int(value)
    fp16_section = raw.get("fp16")
    bf16_section = raw.get("bf16")
    fp16 = isinstance(fp16_section, dict) and fp16_section.get("enabled") in (True, "auto")
    bf16: dict[str, Any] = bf16_section if isinstance(bf16_section, dict) else {}
    fields["fp16"] = fp16
    fields["unmodelled"] = _ds_unmodelled_calls(raw, zero)
    fields["overflow_check"] = fp16 or (
        bf16.get("enabled") in (True, "auto") and bf16.get("check_grad_overflow") is True
    )
    return DeepSpeedEffects(**fields)


def _ds_unmodelled_calls(raw: dict[str, Any], zero: dict[str, Any]) -> tuple[str, ...]:
    """The stated settings that change DeepSpeed's calls beyond ``deepspeed_collectives``'s
    terms, as ``key=value`` (the terms then report them as not modelled)."""
    out = [f"{k}={_shown(raw[k])}" for k in ("communication_data_type", "data_types") if k in raw]
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "use_all_reduce_for_fetch_params"):
        if zero.get(key) is True:
            out.append(f"zero_optimization.{key}=true")
    if isinstance(zero.get("zero_hpz_partition_size"), int) and zero["zero_hpz_partition_size"] > 1:
        out.append(f"zero_optimization.zero_hpz_partition_size={zero['zero_hpz_partition_size']}")
    for section in ("offload_optimizer", "offload_param"):
        body = zero.get(section)
        if isinstance(body, dict) and body.get("device") not in (None, "none"):
            out.append(f"zero_optimization.{section}.device={_shown(body['device'])}")
    return tuple(out)


def _ds_uneven(pp: int, model: Model | None, notes: list[Unmapped]) -> bool:
    """DeepSpeed's pipeline stages are cut in model code (``PipelineModule(partition_method=...)``),
    not in the JSON. With ``"type:<block class>"`` DeepSpeed splits the L blocks with
    ``partition_uniform`` (``deepspeed/runtime/utils.py``): the first ``L % pp`` stages one more,
    ceil(L / pp) on the fullest, which is the composition's ``uneven`` stages."""
    if pp == 1 or not isinstance(model, Transformer) or model.layers % pp == 0:
        return False
    notes.append(
        Unmapped(
            "pipeline.stages",
            f"{model.layers} layers do not divide by {pp} stages: the stages are taken as "
            'PipelineModule(partition_method="type:<transformer block>") cuts them, at most '
            f"{-(-model.layers // pp)} layers each (the partition is set in model code, not in this file)",
        )
    )
    return True


def _ds_offload(zero: dict[str, Any], key: str, where: str) -> bool:
    section = zero.get(key)
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: zero_optimization.{key} must be an object")
    _check_keys(section, _DS_OFFLOAD_KEYS, where, f"zero_optimization.{key}.")
    device = section.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"{where}: zero_optimization.{key}.device={device!r}: expected none, cpu or nvme")
    return bool(device != "none")


def _ds_section_int(raw: dict[str, Any], section: str, key: str, where: str, known: tuple[str, ...]) -> int:
    body = raw.get(section)
    if body is None:
        return 1
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: {section} must be an object")
    _check_keys(body, known, where, f"{section}.")
    return _pos_int(body.get(key, 1), where, f"{section}.{key}")


def _ds_batch(raw: dict[str, Any], key: str, where: str, notes: list[Unmapped]) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if value == "auto":
        notes.append(Unmapped(f'{key}="auto"', "filled in by the Hugging Face Trainer; derived here or taken as 1"))
        return None
    return _pos_int(value, where, key, high=MAX_BATCH if key == "train_batch_size" else MAX_MICRO_BATCH)


def _ds_solve_batch(
    total: int | None,
    micro: int | None,
    gas: int | None,
    devices: int | None,
    tp: int,
    pp: int,
    where: str,
    notes: list[Unmapped],
) -> tuple[int | None, int, int, int | None]:
    """DeepSpeed's rule train_batch_size = micro x gas x dp, with dp = devices / (tp x pp)."""
    dp: int | None = None
    if devices is not None:
        dp = _divide(devices, {"tp": tp, "pp": pp}, where, "--devices")
    if total is not None and micro is not None and gas is not None:
        if total % (micro * gas):
            raise ConfigError(
                f"{where}: train_batch_size {total} is not divisible by "
                f"train_micro_batch_size_per_gpu({micro}) x gradient_accumulation_steps({gas})"
            )
        implied = total // (micro * gas)
        if dp is not None and implied != dp:
            raise ConfigError(
                f"{where}: train_batch_size {total} != micro({micro}) x gas({gas}) x dp({dp}) = "
                f"{micro * gas * dp} (dp = --devices {devices} / (tp({tp}) x pp({pp})))"
            )
        dp = implied
    elif total is not None:
        if dp is None:
            raise ConfigError(
                f"{where}: train_batch_size without both train_micro_batch_size_per_gpu and "
                "gradient_accumulation_steps: give --devices to solve for the missing one"
            )
        if micro is None and gas is None:
            gas = 1  # DeepSpeed: only train_batch_size given -> no accumulation
        known = {"dp": dp, **({"micro": micro} if micro is not None else {}), **({"gas": gas} if gas else {})}
        solved = _divide(total, known, where, "train_batch_size")
        micro, gas = (solved, gas) if micro is None else (micro, solved)
    micro = micro if micro is not None else 1
    gas = gas if gas is not None else 1
    if dp is not None and dp * tp * pp > MAX_DEGREE:
        raise ConfigError(
            f"{where}: dp({dp}) x tp({tp}) x pp({pp}) = {dp * tp * pp:,} devices is absurd (at most {MAX_DEGREE:,})"
        )
    if dp is None:
        notes.append(
            Unmapped(
                "data-parallel degree", f"not stated: the devices left over (--devices, default {DEFAULT_DEVICES})"
            )
        )
    return dp, micro, gas, None if dp is None else dp * tp * pp
