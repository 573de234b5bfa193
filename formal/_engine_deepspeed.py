"""DeepSpeed's ZeRO engine effects (0.19.8): what its optimizers hold and send beyond the
placement, as named terms of a device's memory (``formal._engine_effects.Term``), each citing the
DeepSpeed source file that holds it. ``checker._torch._deepspeed`` measures them on gloo."""

from __future__ import annotations

from dataclasses import dataclass

from formal._costs import Memory, ceil_int
from formal._engine_effects import Term, _data_axes
from formal._model import Model, Precision, Transformer
from formal._placement import Placement
from formal._program import shard_elements
from formal._tensors import parameter_tensors
from formal._vocab import Stage, State
from formal.errors import ModelError

P, OPT, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS


@dataclass(frozen=True)
class DeepSpeedEffects:
    """What DeepSpeed's ZeRO optimizers (0.19.8) hold and send beyond the placement, one field
    per effect; sources are DeepSpeed's files, ``deepspeed/runtime/zero/``."""

    # ZeRO-1/2 (``stage_1_and_2.py``: ``single_partition_of_fp32_groups``) and ZeRO-3
    # (``stage3.py``: ``fp32_partitioned_groups_flat``) copy the rank's partition of the flat
    # parameters into an fp32 tensor the optimizer steps, whatever the model's dtype: an fp32
    # model gets a second, partitioned fp32 copy that no precision recipe describes.
    fp32_master: bool = True
    # ``reduce_bucket_size`` (``config.py``: 5e8 elements by default): ZeRO-1/2 reduce gradients
    # through an ``ipg_buffer`` of that many elements allocated for backward
    # (``stage_1_and_2.py`` ``setup_buckets``); ZeRO-3 keeps its flat reduce bucket of that many
    # elements for the whole run (``stage3.py``, the ``ipg_bucket`` buffer).
    reduce_bucket_elements: int = 500_000_000
    # ``overlap_comm`` (``config.py``: None means True for ZeRO-3 only): ZeRO-1/2 then allocate a
    # second bucket of ``reduce_bucket_size`` elements so backward fills one while the other is
    # reduced (``setup_buckets``: ``buf_1``); ZeRO-3 keeps one bucket either way.
    overlap_comm: bool | None = None
    # ZeRO-2 (``stage_1_and_2.py``): the flat parameters, padded to a multiple of
    # ``nccl_start_alignment_factor`` (2) times the ranks, are cut into equal partitions, and the
    # rank's gradient buffer (``grads_in_partition``) holds every parameter that overlaps its
    # partition whole (``params_in_partition`` from ``get_partition_info``): a parameter
    # straddling a boundary is held whole by both ranks.
    zero2_whole_straddling_gradients: bool = True
    alignment_elements: int = 2
    # ``use_multi_rank_bucket_allreduce`` (True by default) makes ZeRO-1/2 all-reduce each
    # bucket (``stage_1_and_2.py`` ``average_tensor``, ``allreduce_and_scatter``) where the
    # placement reduce-scatters; False sends ``reduce`` calls to each slice's owner, a kind the
    # op vocabulary has no name for (reported as not modelled).
    allreduce_gradients: bool = True


def zero_stage(pl: Placement) -> int:
    """The ZeRO stage a placement is along its data axes: 3 when a parameter is sharded there,
    2 when a gradient is, 1 when only optimizer state is, 0 otherwise."""

    def sharded(state: State) -> bool:
        return any(_data_axes(pl, state, g) for g in pl.groups(state))

    return 3 if sharded(P) else 2 if sharded(G) else 1 if sharded(OPT) else 0


def deepspeed_partition_gradients(model: Transformer, ranks: int, fx: DeepSpeedEffects) -> list[int]:
    """ZeRO-2's ``grads_in_partition`` per rank, in elements: the parameters (registration
    order, ``parameter_tensors``) that overlap each of ``ranks`` equal partitions of the padded
    flat buffer, each counted whole."""
    sizes = [t.elements for t in parameter_tensors(model)]
    align = fx.alignment_elements * ranks
    part = -(-sum(sizes) // align) * align // ranks
    out = []
    for r in range(ranks):
        lo, hi, start, held = r * part, (r + 1) * part, 0, 0
        for n in sizes:
            held += n if start < hi and start + n > lo else 0
            start += n
        out.append(held)
    return out


def _straddling_modelled(pl: Placement, model: Model) -> bool:
    """Whether ZeRO-2's partition of the flat buffer is computable: the model's whole tensors
    (``parameter_tensors``: a Transformer, no model-parallel axis cutting them), one data axis."""
    whole = isinstance(model, Transformer) and all(pl.degree(a) == 1 for a in pl.axes if not a.splits_data)
    if not whole or len([a for a in pl.axes if a.splits_data and pl.degree(a) != 1]) != 1:
        return False
    try:
        parameter_tensors(model)  # type: ignore[arg-type]
    except ModelError:  # a block the tensor layout does not describe (a gated MLP)
        return False
    return True


def deepspeed_notes(pl: Placement, model: Model, precision: Precision, fx: DeepSpeedEffects) -> list[str]:
    """What DeepSpeed does on this placement that ``deepspeed_terms`` does not count, said."""
    stage = zero_stage(pl)
    if stage == 0:
        return ["no ZeRO stage on a data axis: DeepSpeed's own buffers not modelled"]
    out: list[str] = []
    if stage >= 2 and pl.pipelined and pl.pipeline_degree != 1:
        # ``runtime/pipe/engine.py``: PipelineEngine asserts the ZeRO stage is below 2.
        out.append("DeepSpeed's pipeline engine refuses ZeRO-2/3 (runtime/pipe/engine.py)")
    if stage == 3:
        out.append("ZeRO-3 prefetch, live-parameter limits: the placement's gathers stand")
    if stage == 2 and not pl.options.offload_optimizer and not _straddling_modelled(pl, model):
        out.append("ZeRO-2 straddling gradients need whole tensors: even split counted")
    if fx.fp32_master and precision.parameters == 4 and pl.options.offload_optimizer:
        out.append("offloaded: the fp32 master partition is on the host, not counted")
    return out


def deepspeed_terms(
    pl: Placement,
    model: Model,
    precision: Precision,
    placement: Memory,
    fx: DeepSpeedEffects,
    data_rank: int | None = None,
) -> list[Term]:
    """DeepSpeed's terms on one device: the fp32 master partition and the reduce bucket
    (persistent under ZeRO-3, held through backward under ZeRO-1/2)."""
    stage = zero_stage(pl)
    if stage == 0:
        return []
    out: list[Term] = []
    sizes = model.group_elements()
    # The elements of the rank's optimizer partition: the groups' optimizer shards.
    partition = sum(ceil_int(shard_elements(pl, OPT, g, sizes[g], None, Stage.FIRST)) for g in pl.groups(OPT))
    # A mixed-precision recipe's optimizer bytes already count the fp32 master (16-bit
    # parameters); with fp32 parameters the recipe's optimizer state is the moments alone.
    if fx.fp32_master and precision.parameters == 4 and not pl.options.offload_optimizer:
        out.append(
            Term("deepspeed_fp32_master", "DeepSpeed fp32 master partition", 4 * partition, "persistent", "optimizer")
        )
    # Offloaded, ZeRO-2's gradient partition is copied to the host's fp32 partition instead.
    straddling = fx.zero2_whole_straddling_gradients and stage == 2 and not pl.options.offload_optimizer
    straddling = straddling and _straddling_modelled(pl, model)
    if straddling and isinstance(model, Transformer):
        n = int(next(pl.degree(a) for a in pl.axes if a.splits_data and pl.degree(a) != 1))
        held = deepspeed_partition_gradients(model, n, fx)
        rank = max(range(n), key=lambda r: held[r]) if data_rank is None else data_rank % n
        extra = held[rank] * precision.bytes_of(G) - ceil_int(placement.gradients.total)
        label = f"ZeRO-2 straddling gradients whole (rank {rank}/{n})"
        out.append(Term("deepspeed_straddling_gradients", label, extra, "persistent", "gradients"))
    overlap = stage == 3 if fx.overlap_comm is None else fx.overlap_comm
    buckets = 2 if overlap and stage != 3 else 1
    bucket = buckets * fx.reduce_bucket_elements * precision.bytes_of(G)
    moment = "persistent" if stage == 3 else "backward"
    n = fx.reduce_bucket_elements
    label = f"DeepSpeed reduce buckets (2 x {n} elements, overlap_comm)" if buckets == 2 else ""
    label = label or f"DeepSpeed reduce bucket ({n} elements)"
    out.append(Term("deepspeed_reduce_bucket", label, bucket, moment, "buffers"))
    return out


__all__ = ["DeepSpeedEffects", "deepspeed_notes", "deepspeed_partition_gradients", "deepspeed_terms", "zero_stage"]
