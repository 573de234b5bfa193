"""Importers: a framework's configuration in, a composition (+ options) out, and what was not mapped.

DeepSpeed JSON (https://www.deepspeed.ai/docs/config-json/), torchtitan TOML
(``torchtitan/config/job_config.py``) and Megatron-LM arguments (``megatron/training/arguments.py``).
Every importer builds a ``Layout`` and writes it with ``Layout.text()``, the same canonical text
the exporters' round trip compares. Unknown keys and contradictions raise ``ConfigError`` (an
``InputError``): one line naming the key as the user spelled it.

Files are read through ``formal._input`` (regular files only, bounded size, strict UTF-8,
bounded nesting and integers); each format declares the type of every key it reads
(``DEEPSPEED_SCHEMA``, ``TORCHTITAN_SCHEMA``), and every number in a Megatron script is read by
``parse_int``. A file of no known kind, or one that states nothing (an empty file, a script
without arguments), is refused rather than read as an empty configuration.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from checker._layout import DataSharding, Layout
from checker._numbers import MAX_BATCH, MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ, parse_int
from formal._input import (
    BOOL,
    OBJECT,
    TEXT,
    TEXT_LIST,
    Expect,
    Schema,
    check_schema,
    integer,
    load_json,
    load_toml,
    printable,
    read_text,
)
from formal._model import Model, Transformer
from formal._placement import Options, Recompute, Schedule
from formal._presets import DEFAULT_DEVICES, PRESETS
from formal._schedules import for_torchtitan, schedule_of, torchtitan_names
from formal.errors import InputError


class ConfigError(InputError):
    """Raised when a framework configuration has an unknown key, a bad value or a contradiction."""


class Framework(StrEnum):
    DEEPSPEED = "deepspeed"
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


@dataclass(frozen=True)
class Imported:
    """What an importer read: the composition, the run's numbers, and what it could not map."""

    framework: Framework
    layout: Layout
    devices: int | None  # None: not stated by the config (the CLI's --devices or default applies)
    micro_batch: int | None = None
    seq: int | None = None
    precision: str | None = None  # a PRECISIONS name suggested by the config's dtype settings
    model: str | None = None  # a preset the config names (torchtitan [model] flavor)
    notes: tuple[str, ...] = field(default=())

    @property
    def composition(self) -> str:
        return self.layout.text()

    def as_json(self) -> dict[str, Any]:
        return {"framework": self.framework.value, "composition": self.composition, "devices": self.devices,
                "micro_batch": self.micro_batch, "seq": self.seq, "precision": self.precision,
                "model": self.model, "not_mapped": list(self.notes)}


# --- small readers --------------------------------------------------------------------------

def _where(where: str, key: str) -> str:
    return f"{where}: {key}"


def _pos_int(value: Any, where: str, key: str, allow: Iterable[int] = (), high: int = MAX_DEGREE) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value not in allow):
        raise ConfigError(f"{_where(where, key)}={printable(repr(value), 60)}: expected a positive integer")
    if value > high:
        raise ConfigError(f"{_where(where, key)}={value}: absurd (at most {high:,})")
    return value


def _schema(raw: Any, schema: Schema, where: str) -> None:
    """Every key a format reads holds the declared type; anything else is one ``ConfigError`` line."""
    try:
        check_schema(raw, schema, where)
    except ConfigError:
        raise
    except InputError as err:
        raise ConfigError(str(err)) from None


def _bool(value: Any, where: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{_where(where, key)}={value!r}: expected true or false")
    return value


def _check_keys(section: Mapping[str, Any], known: Iterable[str], where: str, prefix: str = "") -> None:
    names = list(known)
    for key in section:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            raise ConfigError(f"{where}: unknown key {prefix}{key}{hint}")


def _divide(total: int, parts: Mapping[str, int], where: str, what: str) -> int:
    product = 1
    for d in parts.values():
        product *= d
    if total % product:
        shown = " x ".join(f"{k}({v})" for k, v in parts.items())
        raise ConfigError(f"{where}: {what} {total} is not divisible by {shown} = {product}")
    return total // product


# --- DeepSpeed ------------------------------------------------------------------------------

_DS_STAGES = {0: "dp", 1: "zero1", 2: "zero2", 3: "zero3"}
_DS_SHARDING = {0: DataSharding.NONE, 1: DataSharding.OPTIMIZER, 2: DataSharding.GRADIENTS, 3: DataSharding.FULL}
_DS_MAPPED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "zero_optimization", "pipeline", "tensor_parallel", "fp16", "bf16", "activation_checkpointing")
# Keys with no effect on placements (optimizer hyper-parameters, logging, I/O): accepted, not mapped.
_DS_IGNORED = ("optimizer", "scheduler", "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
               "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
               "gradient_predivide_factor", "sparse_gradients", "dump_state", "flops_profiler", "tensorboard",
               "wandb", "csv_monitor", "comet", "monitor_config", "comms_logger", "communication_data_type",
               "data_types", "amp", "memory_breakdown", "checkpoint", "elasticity", "autotuning",
               "data_efficiency", "curriculum_learning", "compression_training", "aio", "nebula",
               "seq_parallel_communication_data_type", "disable_allgather", "timers", "torch_autocast",
               "weight_quantization", "use_data_before_expert_parallelism", "graph_harvesting",
               "compile", "sparse_attention", "dataloader_drop_last")
_DS_ZERO_MAPPED = ("stage", "offload_optimizer", "offload_param", "zero_hpz_partition_size")
_DS_ZERO_IGNORED = (
    "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "round_robin_gradients", "load_from_fp32_weights", "elastic_checkpoint",
    "sub_group_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
    "param_persistence_threshold", "stage3_model_persistence_threshold", "model_persistence_threshold",
    "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
    "use_multi_rank_bucket_allreduce", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zeropp_loco_param", "cpu_offload_use_pin_memory",
)
# Keys that change the placement in a way the composition language cannot say: refused.
_DS_ZERO_REFUSED = {
    "mics_shard_size": "MiCS shards within groups; write it as zero3<k>xdpr<n/k> instead",
    "cpu_offload": "deprecated: use offload_optimizer.device = \"cpu\"",
    "cpu_offload_param": "deprecated: use offload_param.device = \"cpu\"",
}
_DS_OFFLOAD_KEYS = ("device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                    "pipeline_read", "pipeline_write", "fast_init", "ratio", "pipeline")
_DS_PIPELINE_KEYS = ("stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                     "grad_partitioned", "use_reentrant")


_DS_BATCH = integer(words=("auto",))
_DS_OFFLOAD = Expect(OBJECT.label, OBJECT.types, nullable=True)
# The type of every key the DeepSpeed importer reads (values and ranges it checks itself).
DEEPSPEED_SCHEMA: Schema = {
    "train_batch_size": _DS_BATCH, "train_micro_batch_size_per_gpu": _DS_BATCH,
    "gradient_accumulation_steps": _DS_BATCH,
    "zero_optimization": OBJECT, "zero_optimization.stage": integer(),
    "zero_optimization.offload_optimizer": _DS_OFFLOAD, "zero_optimization.offload_optimizer.device": TEXT,
    "zero_optimization.offload_param": _DS_OFFLOAD, "zero_optimization.offload_param.device": TEXT,
    "pipeline": OBJECT, "pipeline.stages": _DS_BATCH, "pipeline.activation_checkpoint_interval": integer(),
    "tensor_parallel": Expect(OBJECT.label, OBJECT.types, nullable=True), "tensor_parallel.autotp_size": integer(),
    "fp16": OBJECT, "fp16.enabled": Expect('true, false or "auto"', (bool,), ("auto",)),
    "bf16": OBJECT, "bf16.enabled": Expect('true, false or "auto"', (bool,), ("auto",)),
    "activation_checkpointing": OBJECT,
}


def import_deepspeed(raw: Any, *, devices: int | None, where: str = "deepspeed.json") -> Imported:
    """A DeepSpeed JSON config. World size = dp x tp x pp; train_batch = micro x gas x dp."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object {{...}}")
    if not raw:
        raise ConfigError(f"{where}: an empty object states nothing to check (no zero_optimization, pipeline "
                          "or batch sizes)")
    _schema(raw, DEEPSPEED_SCHEMA, where)
    _check_keys(raw, _DS_MAPPED + _DS_IGNORED, where)
    if "sequence_parallel_size" in raw:
        raise ConfigError(f"{where}: sequence_parallel_size (DeepSpeed-Ulysses) is not mapped")
    notes: list[str] = []
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: zero_optimization must be an object")
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
    tp = _ds_section_int(raw, "tensor_parallel", "autotp_size", where, ("autotp_size", "tp_size", "tp",
                                                                          "partition_config"))
    if tp > 1 and stage == 3:
        raise ConfigError(f"{where}: tensor_parallel.autotp_size={tp} with ZeRO stage 3: AutoTP training "
                          "supports stages 0, 1 and 2")
    pipe = raw.get("pipeline", {})
    if not isinstance(pipe, dict):
        raise ConfigError(f"{where}: pipeline must be an object")
    _check_keys(pipe, _DS_PIPELINE_KEYS, where, "pipeline.")
    stages = pipe.get("stages", 1)
    if stages == "auto":
        raise ConfigError(f"{where}: pipeline.stages=\"auto\": the stage count is set in code "
                          "(PipelineModule(num_stages=...)); write the number here")
    pp = _pos_int(stages, where, "pipeline.stages")
    if pp > 1 and stage >= 2:
        raise ConfigError(f"{where}: zero_optimization.stage={stage} with pipeline.stages={pp}: DeepSpeed's "
                          f"pipeline engine supports ZeRO stage 0 or 1 only (check zero{stage}xpp{pp} directly "
                          "to see what it would cost)")
    recompute = Recompute.NONE
    interval = pipe.get("activation_checkpoint_interval", 0)
    if interval:
        _pos_int(interval, where, "pipeline.activation_checkpoint_interval")
        recompute = Recompute.FULL
        if interval > 1:
            notes.append(f"pipeline.activation_checkpoint_interval={interval}: one checkpoint every {interval} "
                         "layers; counted as one per layer (an upper bound on activation memory)")
    if "activation_checkpointing" in raw:
        notes.append("activation_checkpointing: recomputation is switched on in model code "
                     "(deepspeed.checkpointing.checkpoint), not by this section; add 'recompute' if it is")
    micro = _ds_batch(raw, "train_micro_batch_size_per_gpu", where, notes)
    gas = _ds_batch(raw, "gradient_accumulation_steps", where, notes)
    total = _ds_batch(raw, "train_batch_size", where, notes)
    dp, micro, gas, devices = _ds_solve_batch(total, micro, gas, devices, tp, pp, where, notes)
    precision = _ds_precision(raw, where, notes)
    options = Options(offload_optimizer=off_opt, offload_parameters=off_par, recompute=recompute,
                      micro_batches=gas)
    hpz = zero.get("zero_hpz_partition_size")  # DeepSpeed's default 1 (and 0) mean no secondary partition
    node = 1 if hpz is None else max(1, _pos_int(hpz, where, "zero_optimization.zero_hpz_partition_size", allow=(0,)))
    if node > 1:  # ZeRO++ hpZ: ZeRO-3 within groups of `node` ranks (dp), held across them (hpz-dpr)
        if stage != 3:
            raise ConfigError(f"{where}: zero_optimization.zero_hpz_partition_size={node} needs stage 3 "
                              f"(ZeRO++ partitions ZeRO-3's parameters; stage is {stage})")
        if dp is None:
            dp = _divide(DEFAULT_DEVICES, {"tp": tp, "pp": pp}, where, "--devices")
            devices = dp * tp * pp
            notes.append(f"zero_hpz_partition_size: the data-parallel degree is taken as {dp} of the default "
                         f"{DEFAULT_DEVICES} devices (give --devices)")
        if dp % node:
            raise ConfigError(f"{where}: zero_optimization.zero_hpz_partition_size={node} does not divide the "
                              f"data-parallel degree {dp}")
        layout = Layout("zero3", DataSharding.FULL, node, dpr=dp // node, tp=tp, pp=pp, options=options,
                        replicate="hpz-dpr")
        return Imported(Framework.DEEPSPEED, layout, devices, micro, None, precision, None, tuple(notes))
    layout = Layout(_DS_STAGES[stage], _DS_SHARDING[stage], dp, tp=tp, pp=pp, options=options)
    return Imported(Framework.DEEPSPEED, layout, devices, micro, None, precision, None, tuple(notes))


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


def _ds_batch(raw: dict[str, Any], key: str, where: str, notes: list[str]) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if value == "auto":
        notes.append(f"{key}=\"auto\": filled in by the Hugging Face Trainer; derived here or taken as 1")
        return None
    return _pos_int(value, where, key, high=MAX_BATCH if key == "train_batch_size" else MAX_MICRO_BATCH)


def _ds_solve_batch(total: int | None, micro: int | None, gas: int | None, devices: int | None, tp: int,
                    pp: int, where: str, notes: list[str]) -> tuple[int | None, int, int, int | None]:
    """DeepSpeed's rule train_batch_size = micro x gas x dp, with dp = devices / (tp x pp)."""
    dp: int | None = None
    if devices is not None:
        dp = _divide(devices, {"tp": tp, "pp": pp}, where, "--devices")
    if total is not None and micro is not None and gas is not None:
        if total % (micro * gas):
            raise ConfigError(f"{where}: train_batch_size {total} is not divisible by "
                              f"train_micro_batch_size_per_gpu({micro}) x gradient_accumulation_steps({gas})")
        implied = total // (micro * gas)
        if dp is not None and implied != dp:
            raise ConfigError(f"{where}: train_batch_size {total} != micro({micro}) x gas({gas}) x dp({dp}) = "
                              f"{micro * gas * dp} (dp = --devices {devices} / (tp({tp}) x pp({pp})))")
        dp = implied
    elif total is not None:
        if dp is None:
            raise ConfigError(f"{where}: train_batch_size without both train_micro_batch_size_per_gpu and "
                              "gradient_accumulation_steps: give --devices to solve for the missing one")
        if micro is None and gas is None:
            gas = 1  # DeepSpeed: only train_batch_size given -> no accumulation
        known = {"dp": dp, **({"micro": micro} if micro is not None else {}), **({"gas": gas} if gas else {})}
        solved = _divide(total, known, where, "train_batch_size")
        micro, gas = (solved, gas) if micro is None else (micro, solved)
    micro = micro if micro is not None else 1
    gas = gas if gas is not None else 1
    if dp is not None and dp * tp * pp > MAX_DEGREE:
        raise ConfigError(f"{where}: dp({dp}) x tp({tp}) x pp({pp}) = {dp * tp * pp:,} devices is absurd "
                          f"(at most {MAX_DEGREE:,})")
    if dp is None:
        notes.append(f"data-parallel degree not stated: the devices left over (--devices, default {DEFAULT_DEVICES})")
    return dp, micro, gas, None if dp is None else dp * tp * pp


def _ds_precision(raw: dict[str, Any], where: str, notes: list[str]) -> str:
    enabled = []
    for key in ("fp16", "bf16"):
        section = raw.get(key, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: {key} must be an object")
        flag = section.get("enabled", False)
        if flag == "auto" or flag is True:
            enabled.append(key)
        elif flag is not False:
            raise ConfigError(f"{where}: {key}.enabled={flag!r}: expected true, false or \"auto\"")
    if len(enabled) > 1:
        raise ConfigError(f"{where}: fp16.enabled and bf16.enabled are both on")
    if enabled:
        notes.append(f"{enabled[0]}: precision recipe 'deepspeed' (DeepSpeed's estimator: 16-bit params, fp32 Adam)")
        return "deepspeed"
    return "fp32"


# --- torchtitan -----------------------------------------------------------------------------

_TT_PARALLELISM = (
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
    "pipeline_parallel_degree", "pipeline_parallel_split_points", "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
    "context_parallel_degree", "context_parallel_rotate_method", "expert_parallel_degree",
    "expert_tensor_parallel_degree", "enable_compiled_autograd", "module_fqns_per_model_part",
    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
)
_TT_SECTIONS = ("job", "profiling", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism",
                "checkpoint", "activation_checkpoint", "float8", "mx", "comm", "memory_estimation",
                "fault_tolerance", "experimental", "validation", "compile", "quantize")
_TT_AC = ("mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop")
# torchtitan [model] name/flavor -> our preset (torchtitan/models/llama3/__init__.py flavors).
_TT_MODELS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b", ("llama3", "405B"): "llama3-405b"}


_TT_INT = integer()
# The type of every key the torchtitan importer reads (values and ranges it checks itself).
TORCHTITAN_SCHEMA: Schema = {
    **{f"parallelism.{key}": _TT_INT for key in (
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree",
        "expert_tensor_parallel_degree", "pipeline_parallel_layers_per_stage", "pipeline_parallel_microbatch_size")},
    "parallelism.fsdp_reshard_after_forward": TEXT, "parallelism.pipeline_parallel_schedule": TEXT,
    "parallelism.pipeline_parallel_split_points": TEXT_LIST,
    **{f"parallelism.{key}": BOOL for key in ("enable_async_tensor_parallel", "enable_compiled_autograd",
                                              "disable_loss_parallel")},
    "model.name": TEXT, "model.flavor": TEXT,
    **{f"training.{key}": _TT_INT for key in ("local_batch_size", "batch_size", "seq_len", "global_batch_size")},
    "training.enable_cpu_offload": BOOL,
    "activation_checkpoint.mode": TEXT,
    "activation_checkpoint.selective_ac_option": Expect("a string (\"op\" or a number)", (str, int)),
}


def import_torchtitan(raw: Any, *, devices: int | None, model: Model | None = None,
                      where: str = "torchtitan.toml") -> Imported:
    """A torchtitan job TOML. World = dp_replicate x dp_shard x cp x tp x pp (ParallelDims)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a TOML table")
    if not raw:
        raise ConfigError(f"{where}: no tables: states nothing to check (expected [parallelism], [training], ...)")
    _check_keys(raw, _TT_SECTIONS, where, "[")
    for section in raw:
        if not isinstance(raw[section], dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
    _schema(raw, TORCHTITAN_SCHEMA, where)
    par = raw.get("parallelism", {})
    _check_keys(par, _TT_PARALLELISM, where, "parallelism.")
    notes: list[str] = []

    def degree(key: str, allow: tuple[int, ...] = ()) -> int:
        return _pos_int(par.get(key, 1), where, f"parallelism.{key}", allow)

    replicate, tp, pp = degree("data_parallel_replicate_degree"), degree("tensor_parallel_degree"), \
        degree("pipeline_parallel_degree")
    cp, ep = degree("context_parallel_degree"), degree("expert_parallel_degree")
    mdl = raw.get("model", {})
    preset = _TT_MODELS.get((str(mdl.get("name", "")), str(mdl.get("flavor", ""))))
    if model is None and preset is not None:
        model = PRESETS[preset]
    shard = _pos_int(par.get("data_parallel_shard_degree", -1), where, "parallelism.data_parallel_shard_degree", (-1,))
    etp = par.get("expert_tensor_parallel_degree", 1)
    if ep > 1 and etp not in (1, tp):
        raise ConfigError(f"{where}: parallelism.expert_tensor_parallel_degree={etp!r} is not mapped "
                          "(experts follow tp or are not split by it)")
    if shard == -1:
        total = devices if devices is not None else DEFAULT_DEVICES
        if devices is None:
            notes.append(f"data_parallel_shard_degree=-1: the devices left over of {DEFAULT_DEVICES} (give --devices)")
        shard = _divide(total, {"dp_replicate": replicate, "cp": cp, "tp": tp, "pp": pp}, where, "--devices")
    world = replicate * shard * cp * tp * pp
    if world > MAX_DEGREE:
        raise ConfigError(f"{where}: dp_replicate({replicate}) x dp_shard({shard}) x cp({cp}) x tp({tp}) x "
                          f"pp({pp}) = {world:,} devices is absurd (at most {MAX_DEGREE:,})")
    if devices is not None and devices != world:
        raise ConfigError(f"{where}: dp_replicate({replicate}) x dp_shard({shard}) x cp({cp}) x tp({tp}) x "
                          f"pp({pp}) = {world} != --devices {devices}")
    if ep > 1:
        if cp > 1:
            raise ConfigError(f"{where}: expert_parallel_degree={ep} with context_parallel_degree={cp} is not mapped")
        if shard % ep:
            raise ConfigError(f"{where}: expert_parallel_degree={ep} must divide data_parallel_shard_degree={shard} "
                              "(torchtitan borrows expert ranks from dp_shard)")
        notes.append("expert parallelism: torchtitan shards dense weights over all dp_shard ranks; the composition "
                     "shards them over dp_shard/ep and replicates them along ep")
    reshard = par.get("fsdp_reshard_after_forward", "default")
    match reshard:
        case "always":
            held = False
        case "never":
            held = True
        case "default":  # torchtitan parallelize: reshard_after_forward = not pp_enabled
            held = pp > 1
        case _:
            raise ConfigError(f"{where}: parallelism.fsdp_reshard_after_forward={reshard!r}: expected "
                              "default, always or never")
    if shard > 1:
        name, sharding = ("fsdp-sgo", DataSharding.FULL_HELD) if held else ("fsdp", DataSharding.FULL)
        dp, dpr = shard // ep, replicate
    else:
        name, sharding, dp, dpr = "dp", DataSharding.NONE, replicate, 1
        if ep > 1:
            raise ConfigError(f"{where}: expert_parallel_degree={ep} needs data_parallel_shard_degree > 1")
    if cp > 1 and shard > 1:
        notes.append("context parallelism: torchtitan's FSDP shards over dp_shard x cp; the composition "
                     "replicates parameters along cp")
    for key in ("enable_async_tensor_parallel", "enable_compiled_autograd", "disable_loss_parallel"):
        if par.get(key):
            notes.append(f"parallelism.{key}: overlap or kernel choice, no change to placements")
    schedule, chunks = _tt_schedule(par, pp, model, where)
    training = raw.get("training", {})
    micro, m, seq = _tt_batches(training, par, pp, replicate * shard, where)
    offload = _bool(training.get("enable_cpu_offload", False), where, "training.enable_cpu_offload")
    if offload and shard == 1:
        raise ConfigError(f"{where}: training.enable_cpu_offload needs FSDP (data_parallel_shard_degree > 1)")
    recompute = _tt_recompute(raw.get("activation_checkpoint"), where, notes)
    options = Options(sequence_parallel=tp > 1, recompute=recompute, offload_optimizer=offload,
                      offload_parameters=offload, schedule=schedule, chunks=chunks, micro_batches=m)
    if tp > 1:
        notes.append("tensor parallelism: torchtitan always applies sequence parallelism (SequenceParallel on norms)")
    layout = Layout(name, sharding, dp, dpr=dpr, tp=tp, pp=pp, cp=cp, ep=ep, options=options)
    notes.append("precision: torchtitan keeps fp32 sharded parameters, gradients and AdamW state ('fp32' recipe)")
    return Imported(Framework.TORCHTITAN, layout, world, micro, seq, "fp32", preset, tuple(notes))


def _tt_schedule(par: dict[str, Any], pp: int, model: Model | None, where: str) -> tuple[Schedule, int]:
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    schedule = for_torchtitan(name)
    if schedule is None:
        raise ConfigError(f"{where}: parallelism.pipeline_parallel_schedule={name!r} is not mapped "
                          f"(mapped: {', '.join(torchtitan_names())})")
    if not schedule_of(schedule).chunked:
        return schedule, 1
    if par.get("pipeline_parallel_split_points"):
        stages = len(par["pipeline_parallel_split_points"]) + 1
    elif "pipeline_parallel_layers_per_stage" in par:
        per = _pos_int(par["pipeline_parallel_layers_per_stage"], where,
                       "parallelism.pipeline_parallel_layers_per_stage")
        if not isinstance(model, Transformer):
            raise ConfigError(f"{where}: pipeline_parallel_layers_per_stage needs a model with layers (--model)")
        if model.layers % per:
            raise ConfigError(f"{where}: pipeline_parallel_layers_per_stage={per} does not divide "
                              f"{model.name}'s {model.layers} layers")
        stages = model.layers // per
    else:
        raise ConfigError(f"{where}: Interleaved1F1B needs pipeline_parallel_layers_per_stage or split points")
    if stages % pp or stages // pp < 2:
        raise ConfigError(f"{where}: Interleaved1F1B with {stages} stages on pipeline_parallel_degree={pp}: "
                          "need a multiple of the degree, at least two stages per rank")
    return schedule, stages // pp


def _tt_batches(training: dict[str, Any], par: dict[str, Any], pp: int, dp: int,
                where: str) -> tuple[int, int, int | None]:
    local = _pos_int(training.get("local_batch_size", training.get("batch_size", 8)), where,
                     "training.local_batch_size", high=MAX_MICRO_BATCH)
    seq = training.get("seq_len")
    seq = None if seq is None else _pos_int(seq, where, "training.seq_len", high=MAX_SEQ)
    global_ = training.get("global_batch_size", -1)
    gas = 1
    if global_ != -1:
        global_ = _pos_int(global_, where, "training.global_batch_size", high=MAX_BATCH)
        gas = _divide(global_, {"local_batch_size": local, "dp": dp}, where, "training.global_batch_size")
    if pp > 1:
        mbs = _pos_int(par.get("pipeline_parallel_microbatch_size", 1), where,
                       "parallelism.pipeline_parallel_microbatch_size")
        n = _divide(local, {"pipeline_parallel_microbatch_size": mbs}, where, "training.local_batch_size")
        return mbs, n * gas, seq
    return local, gas, seq


def _tt_recompute(section: Any, where: str, notes: list[str]) -> Recompute:
    if section is None:
        notes.append("[activation_checkpoint] absent: torchtitan's default (selective, every 2nd layer) has no "
                     "composition spelling; activations counted without recomputation (an upper bound)")
        return Recompute.NONE
    _check_keys(section, _TT_AC, where, "activation_checkpoint.")
    mode = section.get("mode", "selective")
    option = str(section.get("selective_ac_option", "2"))
    match mode:
        case "none":
            return Recompute.NONE
        case "full":
            return Recompute.FULL
        case "selective" if option == "op":
            notes.append("selective_ac_option=\"op\": per-op selective recomputation, counted as Korthikanti's "
                         "selective recomputation (attention core recomputed)")
            return Recompute.SELECTIVE
        case "selective" if option == "1":
            return Recompute.FULL  # every layer fully checkpointed
        case "selective" if option.isascii() and option.isdigit():
            notes.append(f"selective_ac_option=\"{option}\": every {option}th layer fully recomputed has no "
                         "composition spelling; counted without recomputation (an upper bound)")
            return Recompute.NONE
        case _:
            raise ConfigError(f"{where}: activation_checkpoint.mode={mode!r} / selective_ac_option={option!r}: "
                              "expected none, full, or selective with 'op' or an integer")


# --- Megatron-LM ----------------------------------------------------------------------------

_MEG_VALUE = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
              "--num-layers-per-virtual-pipeline-stage", "--context-parallel-size",
              "--expert-model-parallel-size", "--recompute-granularity", "--recompute-method",
              "--recompute-num-layers", "--micro-batch-size", "--global-batch-size", "--seq-length", "--num-layers",
              "--hidden-size", "--num-attention-heads", "--expert-tensor-parallel-size")
# Bounds of the Megatron arguments read as numbers that are not degrees (MAX_DEGREE otherwise).
_MEG_BOUNDS = {"--micro-batch-size": MAX_MICRO_BATCH, "--global-batch-size": MAX_BATCH, "--seq-length": MAX_SEQ,
               "--hidden-size": 2**40}
_MEG_FLAGS = ("--sequence-parallel", "--use-distributed-optimizer", "--recompute-activations", "--fp16", "--bf16")
# Arguments without effect on placements (hyper-parameters, data, I/O, kernels, overlap): accepted.
_MEG_IGNORED = (
    "--ffn-hidden-size", "--max-position-embeddings", "--num-query-groups", "--group-query-attention", "--swiglu",
    "--normalization", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--position-embedding-type",
    "--rotary-base", "--rotary-percent", "--use-rotary-position-embeddings", "--no-position-embedding",
    "--num-experts", "--moe-router-topk", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
    "--moe-grouped-gemm", "--moe-token-dispatcher-type", "--moe-ffn-hidden-size", "--kv-channels",
    "--make-vocab-size-divisible-by", "--vocab-size", "--lr", "--min-lr", "--lr-decay-style", "--lr-decay-iters",
    "--lr-warmup-iters", "--lr-warmup-fraction", "--train-iters", "--train-samples", "--weight-decay",
    "--clip-grad", "--adam-beta1", "--adam-beta2", "--adam-eps", "--init-method-std", "--attention-dropout",
    "--hidden-dropout", "--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model",
    "--split", "--save", "--load", "--save-interval", "--eval-interval", "--eval-iters", "--log-interval",
    "--tensorboard-dir", "--distributed-backend", "--overlap-grad-reduce", "--overlap-param-gather",
    "--use-flash-attn", "--use-mcore-models", "--transformer-impl", "--attention-softmax-in-fp32",
    "--accumulate-allreduce-grads-in-fp32", "--no-masked-softmax-fusion", "--seed", "--log-throughput",
    "--wandb-project", "--wandb-exp-name", "--exit-duration-in-mins", "--ckpt-format", "--data-cache-path",
    "--no-gradient-accumulation-fusion", "--tp-comm-overlap", "--num-workers", "--dataloader-type", "--mock-data",
    "--log-params-norm", "--log-num-zeros-in-grad", "--timing-log-level", "--use-checkpoint-args",
    "--no-load-optim", "--no-load-rng", "--finetune", "--manual-gc", "--manual-gc-interval",
    "--no-async-tensor-model-parallel-allreduce", "--optimizer", "--loss-scale", "--initial-loss-scale",
    "--min-loss-scale", "--loss-scale-window", "--hysteresis", "--apply-layernorm-1p", "--norm-epsilon",
    "--bf16-reduce", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard", "--use-distributed-sampler", "--sequence-parallel-comm-overlap",
    "--defer-embedding-wgrad-compute", "--cross-entropy-loss-fusion", "--use-dist-ckpt", "--async-save",
)
_MEG_VALUED_IGNORED = frozenset(
    a for a in _MEG_IGNORED if a not in {
        "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--use-rotary-position-embeddings", "--no-position-embedding", "--moe-grouped-gemm",
        "--overlap-grad-reduce", "--overlap-param-gather", "--use-flash-attn", "--use-mcore-models",
        "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--no-masked-softmax-fusion",
        "--log-throughput", "--no-gradient-accumulation-fusion", "--tp-comm-overlap", "--mock-data",
        "--log-params-norm", "--log-num-zeros-in-grad", "--use-checkpoint-args", "--no-load-optim",
        "--no-load-rng", "--finetune", "--manual-gc", "--no-async-tensor-model-parallel-allreduce",
        "--apply-layernorm-1p", "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--log-memory-to-tensorboard", "--use-distributed-sampler", "--sequence-parallel-comm-overlap",
        "--defer-embedding-wgrad-compute", "--cross-entropy-loss-fusion", "--use-dist-ckpt", "--async-save",
    })
_MEG_REFUSED = {
    "--use-torch-fsdp2": "Megatron with torch FSDP2: check fsdp<N> directly",
    "--use-custom-fsdp": "Megatron-FSDP: check zero2/zero3 compositions directly",
    "--optimizer-cpu-offload": "Megatron's hybrid CPU optimizer offload is not mapped",
    "--virtual-pipeline-model-parallel-size": "write --num-layers-per-virtual-pipeline-stage instead",
}


def _shell_words(text: str) -> list[str]:
    try:  # a backslash-newline continues the line, as in the shell
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as err:
        raise ConfigError(f"megatron arguments: {err}") from None


def megatron_tokens(text: str) -> list[str]:
    """Arguments of a launch line or script: shell words after ``*.py`` (or from the first ``--``)."""
    words = _shell_words(text)
    for i, w in enumerate(words):
        if w.endswith(".py"):
            return words[i + 1:]
    for i, w in enumerate(words):
        if w.startswith("--"):
            return words[i:]
    return []


def launcher_world_size(text: str) -> int | None:
    """``torchrun --nproc_per_node N --nnodes M ... pretrain_gpt.py``: N x M, when both are numbers."""
    words = _shell_words(text)
    end = next((i for i, w in enumerate(words) if w.endswith(".py")), 0)
    found: dict[str, int] = {}
    for i, w in enumerate(words[:end]):
        name, eq, inline = w.partition("=")
        key = name.replace("-", "_")
        if key in ("__nproc_per_node", "__nnodes"):
            value = inline if eq else (words[i + 1] if i + 1 < end else "")
            if value.isascii() and value.isdigit():  # a shell variable or "gpu" is not a count: not stated
                found[key] = parse_int(value, f"megatron launcher: {name}", high=MAX_DEGREE)
    if "__nproc_per_node" in found:
        world = found["__nproc_per_node"] * found.get("__nnodes", 1)
        if world > MAX_DEGREE:
            raise ConfigError(f"megatron launcher: nproc_per_node x nnodes = {world:,} devices is absurd "
                              f"(at most {MAX_DEGREE:,})")
        return world
    return None


def import_megatron(args: list[str], *, devices: int | None, model: Model | None = None,
                    where: str = "megatron arguments") -> Imported:
    """Megatron-LM arguments. World = tp x pp x cp x dp; experts are carved out of dp (ep | dp)."""
    values: dict[str, str] = {}
    flags: set[str] = set()
    notes: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, inline = word.partition("=")
        if not name.startswith("--"):
            raise ConfigError(f"{where}: unexpected word {word!r} (expected --argument)")
        if name in _MEG_REFUSED:
            raise ConfigError(f"{where}: {name}: {_MEG_REFUSED[name]}")
        takes_value = name in _MEG_VALUE or name in _MEG_VALUED_IGNORED
        if name not in _MEG_VALUE + _MEG_FLAGS + _MEG_IGNORED:
            near = difflib.get_close_matches(name, _MEG_VALUE + _MEG_FLAGS + _MEG_IGNORED, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"{where}: unknown argument {name}{hint}")
        if takes_value:
            if eq:
                value = inline
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                raise ConfigError(f"{where}: {name} needs a value")
            if name in values and values[name] != value:
                raise ConfigError(f"{where}: {name} given twice ({values[name]} and {value})")
            values[name] = value
        else:
            flags.add(name)
        i += 1

    def num(name: str, default: int) -> int:
        if name not in values:
            return default
        text = values[name]
        high = _MEG_BOUNDS.get(name, MAX_DEGREE)
        try:
            return parse_int(text, f"{where}: {name}", high=high)
        except InputError as err:
            hint = " (expand shell variables first)" if "$" in text else ""
            raise ConfigError(f"{err}{hint}") from None

    tp, pp = num("--tensor-model-parallel-size", 1), num("--pipeline-model-parallel-size", 1)
    cp, ep = num("--context-parallel-size", 1), num("--expert-model-parallel-size", 1)
    etp = num("--expert-tensor-parallel-size", tp)
    if etp != tp:
        raise ConfigError(f"{where}: --expert-tensor-parallel-size {etp} != --tensor-model-parallel-size {tp} "
                          "is not mapped")
    if "--sequence-parallel" in flags and tp == 1:
        raise ConfigError(f"{where}: --sequence-parallel needs --tensor-model-parallel-size > 1")
    _meg_check_model(values, model, where, num)
    total = devices if devices is not None else DEFAULT_DEVICES
    if devices is None:
        notes.append(f"world size not in the arguments: {DEFAULT_DEVICES} devices (give --devices)")
    dp_meg = _divide(total, {"tp": tp, "pp": pp, "cp": cp}, where, "--devices")
    if dp_meg % ep:
        raise ConfigError(f"{where}: --expert-model-parallel-size {ep} must divide the data-parallel size "
                          f"{dp_meg} (= {total} / (tp({tp}) x pp({pp}) x cp({cp})))")
    micro = num("--micro-batch-size", 1)
    m = 1
    if "--global-batch-size" in values:
        m = _divide(num("--global-batch-size", 1), {"micro-batch-size": micro, "dp": dp_meg}, where,
                    "--global-batch-size")
    schedule, chunks = Schedule.ONE_F_ONE_B, 1
    if "--num-layers-per-virtual-pipeline-stage" in values:
        per = num("--num-layers-per-virtual-pipeline-stage", 1)
        layers = _meg_layers(values, model, where)
        if pp == 1 or layers % (pp * per) or layers // (pp * per) < 2:
            raise ConfigError(f"{where}: --num-layers-per-virtual-pipeline-stage {per} with {layers} layers on "
                              f"--pipeline-model-parallel-size {pp}: need layers = pp x per-stage x chunks, "
                              "chunks >= 2")
        schedule, chunks = Schedule.INTERLEAVED, layers // (pp * per)
    recompute = _meg_recompute(values, flags, pp, model, where, notes, num)
    options = Options(sequence_parallel="--sequence-parallel" in flags, recompute=recompute,
                      schedule=schedule, chunks=chunks, micro_batches=m)
    distopt = "--use-distributed-optimizer" in flags
    if distopt and ep > 1:
        notes.append(f"--use-distributed-optimizer with experts: Megatron shards dense optimizer state over the "
                     f"whole data-parallel group ({dp_meg}); the composition shards it over dp ({dp_meg // ep}) "
                     "and replicates it along ep (an upper bound)")
    layout = Layout("distopt" if distopt else "dp", DataSharding.OPTIMIZER if distopt else DataSharding.NONE,
                    dp_meg // ep, tp=tp, pp=pp, cp=cp, ep=ep, options=options)
    seq = num("--seq-length", 0) or None
    preset = None if model is not None else _meg_preset(values, flags, num)
    return Imported(Framework.MEGATRON, layout, total, micro, seq, "megatron", preset, tuple(notes))


def _meg_preset(values: dict[str, str], flags: set[str], num: Callable[[str, int], int]) -> str | None:
    """The one preset whose dimensions the model arguments state, if exactly one matches."""
    if not {"--num-layers", "--hidden-size", "--num-attention-heads"} <= set(values):
        return None
    hidden, heads = num("--hidden-size", 1), num("--num-attention-heads", 1)
    wanted = {"layers": num("--num-layers", 1), "hidden": hidden, "heads": heads,
              "ffn_": num("--ffn-hidden-size", 4 * hidden), "experts": num("--num-experts", 0) if
              "--num-experts" in values else 0,
              "kv_heads_": num("--num-query-groups", heads) if "--group-query-attention" in flags else heads}
    found = [name for name, m in PRESETS.items() if isinstance(m, Transformer)
             and all(getattr(m, k) == v for k, v in wanted.items())]
    return found[0] if len(found) == 1 else None


def _meg_layers(values: dict[str, str], model: Model | None, where: str) -> int:
    if "--num-layers" in values:
        return parse_int(values["--num-layers"], f"{where}: --num-layers")
    if isinstance(model, Transformer):
        return model.layers
    raise ConfigError(f"{where}: --num-layers-per-virtual-pipeline-stage needs --num-layers or --model")


def _meg_check_model(values: dict[str, str], model: Model | None, where: str, num: Callable[[str, int], int]) -> None:
    if not isinstance(model, Transformer):
        return
    for arg, have in (("--num-layers", model.layers), ("--hidden-size", model.hidden),
                      ("--num-attention-heads", model.heads)):
        if arg in values and num(arg, 0) != have:
            raise ConfigError(f"{where}: {arg} {values[arg]} contradicts --model {model.name} ({have})")


def _meg_recompute(values: dict[str, str], flags: set[str], pp: int, model: Model | None, where: str,
                   notes: list[str], num: Callable[[str, int], int]) -> Recompute:
    granularity = values.get("--recompute-granularity")
    if "--recompute-activations" in flags:
        if granularity not in (None, "selective"):
            raise ConfigError(f"{where}: --recompute-activations (selective) contradicts "
                              f"--recompute-granularity {granularity}")
        granularity = "selective"
    match granularity:
        case None:
            if "--recompute-method" in values:
                raise ConfigError(f"{where}: --recompute-method without --recompute-granularity full")
            return Recompute.NONE
        case "selective":
            return Recompute.SELECTIVE
        case "full":
            method = values.get("--recompute-method")
            count = num("--recompute-num-layers", 1)
            if method not in ("uniform", "block"):
                raise ConfigError(f"{where}: --recompute-granularity full needs --recompute-method uniform or block")
            if method == "uniform" and count > 1:
                notes.append(f"--recompute-num-layers {count} (uniform): one checkpoint per {count} layers, counted "
                             "as one per layer (an upper bound)")
            if method == "block":
                per_stage = (model.layers // pp) if isinstance(model, Transformer) else None
                if per_stage is None or count < per_stage:
                    notes.append(f"--recompute-method block --recompute-num-layers {count}: only some layers "
                                 "recomputed; counted as every layer (a lower bound on activation memory)")
            return Recompute.FULL
        case _:
            raise ConfigError(f"{where}: --recompute-granularity {granularity}: expected full or selective")


# --- dispatch -------------------------------------------------------------------------------

_MEGATRON_SUFFIXES = ("", ".sh", ".bash", ".zsh", ".txt", ".args", ".slurm", ".sbatch", ".cmd")
_YAML_SUFFIXES = (".yaml", ".yml")


def detect(path: Path) -> Framework:
    """The format of a config from its name: ``.json`` DeepSpeed, ``.toml`` torchtitan, a shell
    script or arguments file (``.sh``, ``.txt``, no suffix, ...) Megatron; anything else is refused."""
    suffix = path.suffix.lower()
    match suffix:
        case ".json":
            return Framework.DEEPSPEED
        case ".toml":
            return Framework.TORCHTITAN
        case _ if suffix in _MEGATRON_SUFFIXES:
            return Framework.MEGATRON
        case _ if suffix in _YAML_SUFFIXES:
            raise ConfigError(f"--from {printable(str(path), 200)}: YAML is not read (give a DeepSpeed config as "
                              ".json, a torchtitan config as .toml, or a Megatron launch script)")
        case _:
            raise ConfigError(f"--from {printable(str(path), 200)}: unknown kind of file {printable(suffix, 20)!r} "
                              "(expected a DeepSpeed .json, a torchtitan .toml, or a Megatron launch script such "
                              "as .sh)")


def load_config(path: Path, *, devices: int | None, model: Model | None = None,
                framework: Framework | None = None) -> Imported:
    """Read ``path`` (format from its suffix unless given) and import it."""
    where = printable(str(path), 200)
    kind = framework or detect(path)
    try:
        text = read_text(path, f"--from {where}")
        if not text.strip():
            raise ConfigError(f"--from {where}: empty file: states nothing to check")
        match kind:
            case Framework.DEEPSPEED:
                return import_deepspeed(load_json(text, where), devices=devices, where=where)
            case Framework.TORCHTITAN:
                return import_torchtitan(load_toml(text, where), devices=devices, model=model, where=where)
            case Framework.MEGATRON:
                launched = launcher_world_size(text)
                if devices is not None and launched is not None and devices != launched:
                    raise ConfigError(f"{where}: --devices {devices} != the launcher's nproc_per_node x nnodes "
                                      f"= {launched}")
                tokens = megatron_tokens(text)
                if not tokens:
                    raise ConfigError(f"--from {where}: no Megatron arguments (expected a launch line or script "
                                      "with --tensor-model-parallel-size and the like; a DeepSpeed config is "
                                      ".json, a torchtitan one .toml)")
                return import_megatron(tokens, devices=devices or launched, model=model, where=where)
            case _:
                raise AssertionError(kind)
    except ConfigError:
        raise
    except InputError as err:
        raise ConfigError(str(err)) from None
