"""The torchtitan TOML importer (``torchtitan/config/job_config.py``): world = dp_replicate x
dp_shard x cp x tp x pp (ParallelDims); FSDP resharding, pipeline schedules, activation
checkpointing and CPU offload.

``checker._importers`` is the entry (``load_config``).
"""

from __future__ import annotations

from typing import Any

from checker._import_common import (
    ConfigError,
    Framework,
    Imported,
    Unmapped,
    _bool,
    _check_keys,
    _divide,
    _pos_int,
    _schema,
    imported,
)
from checker._import_scalars import torchtitan_scalars
from checker._layout import DataSharding, Layout
from checker._numbers import MAX_BATCH, MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ
from formal._input import BOOL, TEXT, TEXT_LIST, Expect, Schema, integer
from formal._model import Model, Transformer
from formal._placement import Options, Recompute, Schedule
from formal._presets import DEFAULT_DEVICES, PRESETS
from formal._schedules import for_torchtitan, schedule_of, torchtitan_names

# --- torchtitan -----------------------------------------------------------------------------

_TT_PARALLELISM = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "fsdp_reshard_after_forward",
    "tensor_parallel_degree",
    "disable_loss_parallel",
    "enable_async_tensor_parallel",
    "pipeline_parallel_degree",
    "pipeline_parallel_split_points",
    "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv",
    "pipeline_parallel_microbatch_size",
    "context_parallel_degree",
    "context_parallel_rotate_method",
    "expert_parallel_degree",
    "expert_tensor_parallel_degree",
    "enable_compiled_autograd",
    "module_fqns_per_model_part",
    "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
)
_TT_SECTIONS = (
    "job",
    "profiling",
    "metrics",
    "model",
    "optimizer",
    "lr_scheduler",
    "training",
    "parallelism",
    "checkpoint",
    "activation_checkpoint",
    "float8",
    "mx",
    "comm",
    "memory_estimation",
    "fault_tolerance",
    "experimental",
    "validation",
    "compile",
    "quantize",
)
_TT_AC = ("mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop")
# torchtitan [model] name/flavor -> our preset (torchtitan/models/llama3/__init__.py flavors).
_TT_MODELS = {("llama3", "8B"): "llama3-8b", ("llama3", "70B"): "llama3-70b", ("llama3", "405B"): "llama3-405b"}


_TT_INT = integer()
# The type of every key the torchtitan importer reads (values and ranges it checks itself).
TORCHTITAN_SCHEMA: Schema = {
    **{
        f"parallelism.{key}": _TT_INT
        for key in (
            "data_parallel_replicate_degree",
            "data_parallel_shard_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "context_parallel_degree",
            "expert_parallel_degree",
            "expert_tensor_parallel_degree",
            "pipeline_parallel_layers_per_stage",
            "pipeline_parallel_microbatch_size",
            "pipeline_parallel_first_stage_less_layers",
            "pipeline_parallel_last_stage_less_layers",
        )
    },
    "parallelism.fsdp_reshard_after_forward": TEXT,
    "parallelism.pipeline_parallel_schedule": TEXT,
    "parallelism.pipeline_parallel_split_points": TEXT_LIST,
    **{
        f"parallelism.{key}": BOOL
        for key in ("enable_async_tensor_parallel", "enable_compiled_autograd", "disable_loss_parallel")
    },
    "model.name": TEXT,
    "model.flavor": TEXT,
    **{f"training.{key}": _TT_INT for key in ("local_batch_size", "batch_size", "seq_len", "global_batch_size")},
    "training.enable_cpu_offload": BOOL,
    "activation_checkpoint.mode": TEXT,
    "activation_checkpoint.selective_ac_option": Expect('a string ("op" or a number)', (str, int)),
}


def import_torchtitan(
    raw: Any, *, devices: int | None, model: Model | None = None, where: str = "torchtitan.toml"
) -> Imported:
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
    notes: list[Unmapped] = []

    def degree(key: str, allow: tuple[int, ...] = ()) -> int:
        return _pos_int(par.get(key, 1), where, f"parallelism.{key}", allow)

    replicate, tp, pp = (
        degree("data_parallel_replicate_degree"),
        degree("tensor_parallel_degree"),
        degree("pipeline_parallel_degree"),
    )
    cp, ep = degree("context_parallel_degree"), degree("expert_parallel_degree")
    mdl = raw.get("model", {})
    preset = _TT_MODELS.get((str(mdl.get("name", "")), str(mdl.get("flavor", ""))))
    if model is None and preset is not None:
        model = PRESETS[preset]
    shard = _pos_int(par.get("data_parallel_shard_degree", -1), where, "parallelism.data_parallel_shard_degree", (-1,))
    etp = par.get("expert_tensor_parallel_degree", 1)
    if ep > 1 and etp not in (1, tp):
        raise ConfigError(
            f"{where}: parallelism.expert_tensor_parallel_degree={etp!r} is not mapped "
            "(experts follow tp or are not split by it)"
        )
    if shard == -1:
        total = devices if devices is not None else DEFAULT_DEVICES
        if devices is None:
            notes.append(
                Unmapped(
                    "parallelism.data_parallel_shard_degree=-1",
                    f"the devices left over of {DEFAULT_DEVICES} (give --devices)",
                )
            )
        shard = _divide(total, {"dp_replicate": replicate, "cp": cp, "tp": tp, "pp": pp}, where, "--devices")
    world = replicate * shard * cp * tp * pp
    if world > MAX_DEGREE:
        raise ConfigError(
            f"{where}: dp_replicate({replicate}) x dp_shard({shard}) x cp({cp}) x tp({tp}) x "
            f"pp({pp}) = {world:,} devices is absurd (at most {MAX_DEGREE:,})"
        )
    if devices is not None and devices != world:
        raise ConfigError(
            f"{where}: dp_replicate({replicate}) x dp_shard({shard}) x cp({cp}) x tp({tp}) x "
            f"pp({pp}) = {world} != --devices {devices}"
        )
    if ep > 1:
        if cp > 1:
            raise ConfigError(f"{where}: expert_parallel_degree={ep} with context_parallel_degree={cp} is not mapped")
        if shard % ep:
            raise ConfigError(
                f"{where}: expert_parallel_degree={ep} must divide data_parallel_shard_degree={shard} "
                "(torchtitan borrows expert ranks from dp_shard)"
            )
        notes.append(
            Unmapped(
                "parallelism.expert_parallel_degree",
                "torchtitan shards dense weights over all dp_shard ranks; the composition shards them "
                "over dp_shard/ep and replicates them along ep",
            )
        )
    reshard = par.get("fsdp_reshard_after_forward", "default")
    match reshard:
        case "always":
            held = False
        case "never":
            held = True
        case "default":  # torchtitan parallelize: reshard_after_forward = not pp_enabled
            held = pp > 1
        case _:
            raise ConfigError(
                f"{where}: parallelism.fsdp_reshard_after_forward={reshard!r}: expected default, always or never"
            )
    if shard > 1:
        name, sharding = ("fsdp-sgo", DataSharding.FULL_HELD) if held else ("fsdp", DataSharding.FULL)
        dp, dpr = shard // ep, replicate
    else:
        name, sharding, dp, dpr = "dp", DataSharding.NONE, replicate, 1
        if ep > 1:
            raise ConfigError(f"{where}: expert_parallel_degree={ep} needs data_parallel_shard_degree > 1")
    if cp > 1 and shard > 1:
        notes.append(
            Unmapped(
                "parallelism.context_parallel_degree",
                "torchtitan's FSDP shards over dp_shard x cp; the composition replicates parameters along cp",
            )
        )
    for key in ("enable_async_tensor_parallel", "enable_compiled_autograd", "disable_loss_parallel"):
        if par.get(key):
            notes.append(Unmapped(f"parallelism.{key}", "overlap or kernel choice, no change to placements"))
    schedule, chunks = _tt_schedule(par, pp, model, where)
    training = raw.get("training", {})
    micro, m, seq = _tt_batches(training, par, pp, replicate * shard, where)
    offload = _bool(training.get("enable_cpu_offload", False), where, "training.enable_cpu_offload")
    if offload and shard == 1:
        raise ConfigError(f"{where}: training.enable_cpu_offload needs FSDP (data_parallel_shard_degree > 1)")
    recompute = _tt_recompute(raw.get("activation_checkpoint"), where, notes)
    uneven = _tt_uneven(par, pp, schedule, model, where, notes)
    options = Options(
        sequence_parallel=tp > 1,
        recompute=recompute,
        offload_optimizer=offload,
        offload_parameters=offload,
        schedule=schedule,
        chunks=chunks,
        micro_batches=m,
        uneven_stages=uneven,
        scalars=torchtitan_scalars(training, where),
    )
    if tp > 1:
        notes.append(
            Unmapped(
                "parallelism.tensor_parallel_degree",
                "torchtitan always applies sequence parallelism with it (SequenceParallel on norms)",
            )
        )
    layout = Layout(name, sharding, dp, dpr=dpr, tp=tp, pp=pp, cp=cp, ep=ep, options=options)
    notes.append(
        Unmapped("precision", "torchtitan keeps fp32 sharded parameters, gradients and AdamW state ('fp32' recipe)")
    )
    return imported(Framework.TORCHTITAN, layout, world, micro, seq, "fp32", preset, notes)


def _tt_schedule(par: dict[str, Any], pp: int, model: Model | None, where: str) -> tuple[Schedule, int]:
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    schedule = for_torchtitan(name)
    if schedule is None:
        raise ConfigError(
            f"{where}: parallelism.pipeline_parallel_schedule={name!r} is not mapped "
            f"(mapped: {', '.join(torchtitan_names())})"
        )
    if not schedule_of(schedule).chunked:
        return schedule, 1
    if par.get("pipeline_parallel_split_points"):
        stages = len(par["pipeline_parallel_split_points"]) + 1
    elif "pipeline_parallel_layers_per_stage" in par:
        per = _pos_int(
            par["pipeline_parallel_layers_per_stage"], where, "parallelism.pipeline_parallel_layers_per_stage"
        )
        if not isinstance(model, Transformer):
            raise ConfigError(f"{where}: pipeline_parallel_layers_per_stage needs a model with layers (--model)")
        if model.layers % per:
            raise ConfigError(
                f"{where}: pipeline_parallel_layers_per_stage={per} does not divide "
                f"{model.name}'s {model.layers} layers"
            )
        stages = model.layers // per
    else:
        raise ConfigError(f"{where}: Interleaved1F1B needs pipeline_parallel_layers_per_stage or split points")
    if stages % pp or stages // pp < 2:
        raise ConfigError(
            f"{where}: Interleaved1F1B with {stages} stages on pipeline_parallel_degree={pp}: "
            "need a multiple of the degree, at least two stages per rank"
        )
    return schedule, stages // pp


def _tt_uneven(
    par: dict[str, Any], pp: int, schedule: Schedule, model: Model | None, where: str, notes: list[Unmapped]
) -> bool:
    """torchtitan splits the layers over the stages itself (``generate_llm_fqn_per_model_part``,
    ``torchtitan/distributed/pipeline_parallel.py``): the embedding and the output layer count as
    ``pipeline_parallel_first/last_stage_less_layers`` layers (default 1 each), the total is split
    evenly and the first ``total % stages`` stages take one more. Layers that do not divide by the
    stages are the composition's ``uneven`` stages (the fullest holds ceil(L / pp)); a split whose
    fullest stage holds more than the composition charges is named as not mapped."""
    keys = ("pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers")
    first, last = (_pos_int(par.get(k, 1), where, f"parallelism.{k}", allow=(0,)) for k in keys)
    if pp == 1 or schedule_of(schedule).chunked or not isinstance(model, Transformer):
        return False
    total = model.layers + first + last
    split = [total // pp + (1 if s < total % pp else 0) for s in range(pp)]
    split[0] -= first
    split[-1] -= last
    if min(split) < 1:
        raise ConfigError(
            f"{where}: parallelism.{keys[0]}={first}, {keys[1]}={last}: torchtitan's split of "
            f"{model.layers} layers on {pp} stages leaves a stage without a transformer layer"
        )
    fullest, charged = max(split), -(-model.layers // pp)
    if fullest > charged:
        notes.append(
            Unmapped(
                f"parallelism.{keys[0]}={first}, {keys[1]}={last}",
                f"torchtitan counts the embedding and the output layer as layers: its split puts up to "
                f"{fullest} of the {model.layers} transformer layers on one stage; the composition charges "
                f"{charged} (write 0 for both to split the transformer layers alone)",
            )
        )
    return model.layers % pp != 0


def _tt_batches(
    training: dict[str, Any], par: dict[str, Any], pp: int, dp: int, where: str
) -> tuple[int, int, int | None]:
    local = _pos_int(
        training.get("local_batch_size", training.get("batch_size", 8)),
        where,
        "training.local_batch_size",
        high=MAX_MICRO_BATCH,
    )
    seq = training.get("seq_len")
    seq = None if seq is None else _pos_int(seq, where, "training.seq_len", high=MAX_SEQ)
    global_ = training.get("global_batch_size", -1)
    gas = 1
    if global_ != -1:
        global_ = _pos_int(global_, where, "training.global_batch_size", high=MAX_BATCH)
        gas = _divide(global_, {"local_batch_size": local, "dp": dp}, where, "training.global_batch_size")
    if pp > 1:
        mbs = _pos_int(
            par.get("pipeline_parallel_microbatch_size", 1), where, "parallelism.pipeline_parallel_microbatch_size"
        )
        n = _divide(local, {"pipeline_parallel_microbatch_size": mbs}, where, "training.local_batch_size")
        return mbs, n * gas, seq
    return local, gas, seq


def _tt_recompute(section: Any, where: str, notes: list[Unmapped]) -> Recompute:
    if section is None:
        notes.append(
            Unmapped(
                "[activation_checkpoint]",
                "absent: torchtitan's default (selective, every 2nd layer) has no composition spelling; "
                "activations counted without recomputation (an upper bound)",
            )
        )
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
            notes.append(
                Unmapped(
                    'activation_checkpoint.selective_ac_option="op"',
                    "per-op selective recomputation, counted as Korthikanti's selective recomputation "
                    "(attention core recomputed)",
                )
            )
            return Recompute.SELECTIVE
        case "selective" if option == "1":
            return Recompute.FULL  # every layer fully checkpointed
        case "selective" if option.isascii() and option.isdigit():
            notes.append(
                Unmapped(
                    f'activation_checkpoint.selective_ac_option="{option}"',
                    f"every {option}th layer fully recomputed has no composition spelling; counted "
                    "without recomputation (an upper bound)",
                )
            )
            return Recompute.NONE
        case _:
            raise ConfigError(
                f"{where}: activation_checkpoint.mode={mode!r} / selective_ac_option={option!r}: "
                "expected none, full, or selective with 'op' or an integer"
            )
