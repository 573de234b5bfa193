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
    # (``stage_1_and_2.py``); ZeRO-3 keeps its flat reduce bucket of that many elements for the
    # whole run (``stage3.py``, the ``ipg_bucket`` buffer).
    reduce_bucket_elements: int = 500_000_000
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


# PyTorch builds a module's parameters in fp32 unless told otherwise: what a process holds on
# the host while it builds the model (DeepSpeed's memory docs, "4 (in 4*n_gpus): when pytorch
# creates a model it creates it in fp32 by default").
INIT_BYTES = 4


@dataclass(frozen=True)
class HostMemory:
    """A device's host memory under DeepSpeed: ``initialisation`` while its process builds the
    model, ``steady`` what the placement offloads for the run (``Memory.host``), in bytes."""

    initialisation: int
    steady: int

    @property
    def peak(self) -> int:
        """The larger of the two: the host memory one device's process needs."""
        return max(self.initialisation, self.steady)

    def per_node(self, devices_per_node: int) -> int:
        """A node's peak: each of its processes builds the model at once, then holds its share."""
        return self.peak * devices_per_node


def largest_unit(model: Model) -> int | None:
    """The most parameters one module holds itself (``largest_layer_params``): stated for a bare
    count (``ParameterCount.largest_layer``), derived from the architecture otherwise."""
    return model.largest_module if isinstance(model, Transformer) else model.largest_layer


def deepspeed_host_memory(pl: Placement, model: Model, placement: Memory, zero_init: bool) -> HostMemory:
    """A device's host memory under DeepSpeed, initialisation and steady state.

    Without ``zero_init`` every process builds the whole model on the host in fp32
    (``INIT_BYTES`` per parameter) before the engine moves and partitions it. With it
    (``deepspeed.zero.Init``, ZeRO-3 only) each module is partitioned as it is built: one module
    at a time in fp32. ``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage3.py)
    charges a node ``largest_layer_params * 4 * n_gpus`` with it and ``total_params * 4 * n_gpus``
    without, or the offloaded states when larger, times its ``additional_buffer_factor``; with
    offload and ``zero_init`` it charges the offloaded states alone (the build's one module is
    smaller than any real offload)."""
    stage = zero_stage(pl)
    if zero_init and stage != 3:
        raise ModelError(f"zero_init: deepspeed.zero.Init partitions parameters under ZeRO-3 only (stage {stage})")
    steady = ceil_int(placement.host)
    if not zero_init:
        return HostMemory(INIT_BYTES * model.parameter_count(), steady)
    unit = largest_unit(model)
    if unit is None:
        raise ModelError("zero_init: the largest module is unknown (give --largest-layer with --params)")
    return HostMemory(INIT_BYTES * unit, steady)


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
    if fx.fp32_master and precision.parameters == 4:
        out.append(
            Term("deepspeed_fp32_master", "DeepSpeed fp32 master partition", 4 * partition, "persistent", "optimizer")
        )
    axes = [a for a in pl.axes if a.splits_data and pl.degree(a) != 1]
    if fx.zero2_whole_straddling_gradients and stage == 2 and isinstance(model, Transformer) and len(axes) == 1:
        n = int(pl.degree(axes[0]))
        held = deepspeed_partition_gradients(model, n, fx)
        rank = max(range(n), key=lambda r: held[r]) if data_rank is None else data_rank % n
        extra = held[rank] * precision.bytes_of(G) - ceil_int(placement.gradients.total)
        label = f"ZeRO-2 straddling gradients whole (rank {rank}/{n})"
        out.append(Term("deepspeed_straddling_gradients", label, extra, "persistent", "gradients"))
    bucket = fx.reduce_bucket_elements * precision.bytes_of(G)
    moment = "persistent" if stage == 3 else "backward"
    out.append(
        Term(
            "deepspeed_reduce_bucket",
            f"DeepSpeed reduce bucket ({fx.reduce_bucket_elements} elements)",
            bucket,
            moment,
            "buffers",
        )
    )
    return out


__all__ = [
    "INIT_BYTES",
    "DeepSpeedEffects",
    "HostMemory",
    "deepspeed_host_memory",
    "deepspeed_partition_gradients",
    "deepspeed_terms",
    "largest_unit",
    "zero_stage",
]
