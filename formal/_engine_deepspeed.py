"""DeepSpeed's ZeRO engine effects (0.19.8): what its optimizers hold and send beyond the
placement, as named terms of a device's memory (``formal._engine_effects.Term``), each citing the
DeepSpeed source file that holds it. ``checker._torch._deepspeed`` measures them on gloo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from formal._costs import Memory, buffer_parts, ceil_int
from formal._engine_terms import Term
from formal._engine_terms import data_axes as _data_axes
from formal._engine_zero3 import Zero3Fetches, Zero3Settings, zero3_fetches
from formal._model import Model, Precision, Transformer
from formal._placement import Placement
from formal._program import shard_elements
from formal._tensors import parameter_tensors
from formal._vocab import OpKind, Stage, State
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
    # ---- the collectives (``deepspeed_collectives``); the zero_optimization keys, defaults of
    # ``deepspeed/runtime/zero/config.py`` (DeepSpeedZeroConfig)
    # ``reduce_scatter`` false or ``contiguous_gradients`` false: ZeRO-1/2 all-reduce each
    # bucket whole (``gradient_reduction_w_predivide``, ``buffered_reduce_fallback``), whatever
    # ``use_multi_rank_bucket_allreduce`` says.
    reduce_scatter: bool = True
    contiguous_gradients: bool = True
    # (``overlap_comm``, above, also makes ZeRO-1 reduce from the gradient hooks in backward
    # order instead of from ``reduce_gradients`` in registration order.)
    # ``compute_grad_norm``: ZeRO-1/2's global gradient norm all-reduce (``get_grad_norm_direct``,
    # an fp32 scalar; ``gradient_clipping`` only reads it, so clipping adds no call).
    compute_grad_norm: bool = True
    # The overflow check all-reduce (a one-byte flag, ``has_overflow``): fp16 always, bf16 when
    # ``bf16.check_grad_overflow`` (ZeRO-1/2 only; ZeRO-3 checks under fp16 only).
    overflow_check: bool = False
    fp16: bool = False
    # ZeRO-3 (``partitioned_param_coordinator.py``, ``parameter_offload.py``): parameters of at
    # most ``stage3_param_persistence_threshold`` elements, while their running total stays
    # within ``stage3_model_persistence_threshold``, are never partitioned for compute
    # (``mark_persistent_parameters``); a released parameter is kept when the trace uses it
    # again within ``stage3_max_reuse_distance`` elements (``__params_to_release``);
    # ``stage3_prefetch_bucket_size`` elements are gathered ahead of their module while fewer
    # than ``stage3_max_live_parameters`` are gathered (``fetch_sub_module``): the replay of
    # ``formal._engine_zero3``.
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    max_reuse_distance: int = 1_000_000_000
    prefetch_bucket_elements: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    round_robin_gradients: bool = False
    # Settings a config states that change DeepSpeed's calls beyond these terms (offload, ZeRO++
    # quantisation, hpZ, a communication dtype other than the gradients'): reported as not
    # modelled beside the collectives, never dropped.
    unmodelled: tuple[str, ...] = ()


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


def zero3_settings(fx: DeepSpeedEffects) -> Zero3Settings:
    return Zero3Settings(
        fx.param_persistence_threshold,
        fx.model_persistence_threshold,
        fx.max_reuse_distance,
        fx.prefetch_bucket_elements,
        fx.max_live_parameters,
    )


def zero3_replay(pl: Placement, model: Model, fx: DeepSpeedEffects) -> Zero3Fetches | None:
    """ZeRO-3's fetches over a steady step (``formal._engine_zero3``), where they are modelled:
    ZeRO-3 along one data axis of a transformer whose tensors are whole on every rank (no
    other axis splits them) and laid out by ``parameter_tensors``; None elsewhere."""
    if zero_stage(pl) != 3 or not _straddling_modelled(pl, model) or not isinstance(model, Transformer):
        return None
    return zero3_fetches(model, zero3_settings(fx))


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
    if stage == 3 and zero3_replay(pl, model, fx) is None:
        out.append("ZeRO-3 prefetch, reuse and live-parameter limits need whole tensors: the placement's gathers stand")
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
    # The bucket holds gradients in the type they are reduced in, not the accumulation type:
    # ZeRO-1/2's ``torch.empty(reduce_bucket_size, dtype=self.dtype)`` (the 16-bit model's),
    # ZeRO-3's ``ipg_buckets`` of ``communication_data_type`` (stage_1_and_2.py, stage3.py).
    bucket = buckets * fx.reduce_bucket_elements * precision.wire_bytes_of(G)
    moment = "persistent" if stage == 3 else "backward"
    n = fx.reduce_bucket_elements
    label = f"DeepSpeed reduce buckets (2 x {n} elements, overlap_comm)" if buckets == 2 else ""
    label = label or f"DeepSpeed reduce bucket ({n} elements)"
    out.append(Term("deepspeed_reduce_bucket", label, bucket, moment, "buffers"))
    out += _zero3_gathered_terms(pl, model, precision, fx, stage)
    return out


def _short(n: int) -> str:
    """A round count as people write it in a DeepSpeed config: 50000000 as 5e7."""
    digits = str(n)
    zeros = len(digits) - len(digits.rstrip("0"))
    return f"{digits.rstrip('0')}e{zeros}" if zeros >= 3 else digits


def zero3_placement_unit(pl: Placement, model: Model, precision: Precision, stage: Stage = Stage.FIRST) -> int:
    """The parameter bytes the placement's ``S*`` mode holds gathered at a time (one layer, or
    the largest group outside the layers: ``formal._costs.buffer_parts``)."""
    parts = buffer_parts(pl, model, model.group_elements(), precision, stage)
    return 0 if parts is None else ceil_int(parts[1][P])


def _zero3_gathered_terms(
    pl: Placement, model: Model, precision: Precision, fx: DeepSpeedEffects, zero: int
) -> list[Term]:
    """ZeRO-3's gathered working set at the moments of the step, from the replayed fetches, in
    place of the placement's one gathered layer (``zero3_placement_unit``): after the forward
    (and at the loss's backward, before the backward's first fetch), at the first block's
    backward and at the second's (the change from the first, which it also holds). Persistent
    parameters are gathered all step: their whole tensors count beside the fetched ones (the
    placement counts their shard as parameters, which DeepSpeed keeps too, ``ds_tensor``)."""
    if zero != 3:
        return []
    replay = zero3_replay(pl, model, fx)
    if replay is None:
        return []
    width = precision.wire_bytes_of(P)
    # what the placement counts (one layer gathered), less what persistent parameters add: held whole
    unit = zero3_placement_unit(pl, model, precision) - replay.persistent_elements * width
    trace = replay.trace
    end = max(i for i, m in enumerate(trace) if m.forward)
    blocks: list[int] = []  # the first module of each block the backward reaches, in order
    seen: set[int] = set()
    for i, m in enumerate(trace):
        if not m.forward and m.params and m.layer is not None and m.layer not in seen:
            seen.add(m.layer)
            blocks.append(i)
    after_forward = replay.after[end] * width - unit
    first = replay.live[blocks[0]] * width - unit if blocks else after_forward
    second = replay.live[blocks[1]] * width - unit - first if len(blocks) > 1 else 0
    what = f"prefetch {_short(fx.prefetch_bucket_elements)}, reuse {_short(fx.max_reuse_distance)}"
    label = f"ZeRO-3 gathered parameters less one layer ({what})"
    key = "deepspeed_zero3_gathered"
    return [
        Term(f"{key}_forward", label, after_forward, "forward", "buffers"),
        Term(f"{key}_loss", label, after_forward, "loss", "buffers"),
        Term(f"{key}_backward", label, first, "backward", "buffers"),
        Term(f"{key}_second_block", f"{label}, second block's change", second, "second_block", "buffers"),
    ]


# ---- the collectives ----------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveTerm:
    """The calls of one kind a DeepSpeed engine effect issues in one steady step on one rank:
    ``calls`` the bytes of each call in issue order, as ``torch.distributed`` is handed them
    (an all-gather its gathered output, a reduce-scatter its input, the others the tensor)."""

    key: str
    label: str
    kind: OpKind
    ranks: int
    calls: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return sum(self.calls)


def _chunks(sizes: Sequence[int], limit: int) -> list[int]:
    """DeepSpeed's small-bucket rule (``allreduce_and_scatter``, ``allreduce_no_retain``): add
    tensors until the running total exceeds ``limit``, send, start again; send what is left."""
    out, total = [], 0
    for n in sizes:
        total += n
        if total > limit:
            out.append(total)
            total = 0
    return out + ([total] if total else [])


def _buckets(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """The reduce buckets (``reduce_independent_p_g_buckets_and_remove_grads``, both files): a
    gradient that would take the bucket past ``limit`` elements sends the bucket first."""
    out: list[list[int]] = [[]]
    for i in range(len(sizes)):
        if out[-1] and sum(sizes[j] for j in out[-1]) + sizes[i] > limit:
            out.append([])
        out[-1].append(i)
    return [b for b in out if b]


def _zero12_gradient_calls(
    sizes: list[int], ranks: int, backward_order: bool, gbytes: int, fx: DeepSpeedEffects
) -> tuple[OpKind, list[int]]:
    """ZeRO-1/2's gradient reduction (``stage_1_and_2.py``: ``reduce_ipg_grads``,
    ``average_tensor``): the flat parameters (registration order, padded to a multiple of
    ``alignment_elements`` x ranks) are cut into equal partitions; gradients enter the bucket in
    backward order (the reverse of registration: ZeRO-2, and ZeRO-1 under ``overlap_comm``) or
    in registration order (ZeRO-1's ``reduce_gradients``); each bucket is all-reduced whole, or,
    without ``use_multi_rank_bucket_allreduce``, each slice is reduced onto the rank owning it,
    one ``reduce`` per owner (in the order owners first appear), both under ``_chunks``."""
    align = fx.alignment_elements * ranks
    part = -(-sum(sizes) // align) * align // ranks
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order = list(range(len(sizes)))[::-1] if backward_order else list(range(len(sizes)))
    limit = fx.reduce_bucket_elements
    whole = not fx.reduce_scatter or not fx.contiguous_gradients
    rooted = not whole and not fx.allreduce_gradients
    calls: list[int] = []
    for bucket in _buckets([sizes[i] for i in order], limit):
        tensors = [order[j] for j in bucket]
        if whole:
            calls.append(sum(sizes[i] for i in tensors) * gbytes)
            continue
        slices: list[tuple[int, int]] = []  # (owner, elements), in bucket order
        for i in tensors:
            lo, hi = starts[i], starts[i] + sizes[i]
            while lo < hi:
                owner = lo // part
                cut = min(hi, (owner + 1) * part)
                slices.append((owner, cut - lo))
                lo = cut
        if not rooted:
            calls += [n * gbytes for n in _chunks([n for _, n in slices], limit)]
            continue
        owners = list(dict.fromkeys(o for o, _ in slices))
        for o in owners:
            calls += [n * gbytes for n in _chunks([n for w, n in slices if w == o], limit)]
    return (OpKind.REDUCE if rooted else OpKind.ALL_REDUCE), calls


def _modules(model: Transformer) -> list[list[int]]:
    """The parameter sizes of each module with parameters, in registration order (the forward
    order of a GPT-style model: embedding, each block's norms and linears, final norm, head)."""
    out: dict[str, list[int]] = {}
    for t in parameter_tensors(model):
        out.setdefault(t.name.rsplit(".", 1)[0], []).append(t.elements)
    return list(out.values())


def _zero3_calls(
    model: Transformer, ranks: int, pbytes: int, gbytes: int, fx: DeepSpeedEffects
) -> tuple[list[int], list[int], list[int]]:
    """ZeRO-3's fetches, gradient reduce-scatters and post-step gather, as call bytes.

    The fetches are the replayed trace's (``formal._engine_zero3``: one coalesced all-gather of
    each parameter's padded shard, ceil(n/ranks) elements, from every rank, per fetch and per
    prefetch). Gradients arrive module by module in reverse order, each module's parameters in
    registration order, and are reduce-scattered per bucket (``stage3.py``
    ``__reduce_and_partition_ipg_grads``, through ``reduce_scatter_coalesced``: every tensor
    padded to a multiple of the ranks). Persistent parameters are gathered after the step
    (``_post_step``), one all-gather each (``partition_parameters.py``
    ``_allgather_params_coalesced`` launches one per parameter)."""
    replay = zero3_fetches(model, zero3_settings(fx))
    gathers = [replay.padded(g, ranks) * pbytes for g in replay.gathers]
    modules = _modules(model)
    sizes = [n for m in modules for n in m]
    starts = [sum(len(m) for m in modules[:i]) for i in range(len(modules))]
    backward = [starts[m] + k for m in reversed(range(len(modules))) for k in range(len(modules[m]))]
    scatters = [
        replay.padded([backward[j] for j in b], ranks) * gbytes
        for b in _buckets([sizes[t] for t in backward], fx.reduce_bucket_elements)
    ]
    post = [replay.padded([t], ranks) * pbytes for t in sorted(replay.persistent)]
    return gathers, scatters, post


def deepspeed_collectives(
    pl: Placement, model: Model, precision: Precision, fx: DeepSpeedEffects
) -> tuple[tuple[CollectiveTerm, ...], tuple[str, ...]]:
    """The collectives a steady DeepSpeed ZeRO step issues on one rank (0.19.8), as named terms,
    and what is not modelled (one line each): a ZeRO stage along one data axis of a dense GELU
    transformer (``parameter_tensors``), one parameter group, one dtype."""
    stage = zero_stage(pl)
    axes = [a for a in pl.axes if a.splits_data and pl.degree(a) != 1]
    if stage == 0 or len(axes) != 1 or not isinstance(model, Transformer):
        return (), ("DeepSpeed's collectives: modelled for one ZeRO stage along one data axis",)
    others = [a for a in pl.axes if a not in axes and pl.degree(a) != 1]
    if others:
        return (), (f"DeepSpeed's collectives beside {others[0].value}: not modelled",)
    try:
        sizes = [t.elements for t in parameter_tensors(model)]
    except ValueError as err:
        return (), (f"DeepSpeed's collectives: {err}",)
    n = int(pl.degree(axes[0]))
    pbytes, gbytes = int(precision.wire_bytes_of(P)), int(precision.wire_bytes_of(G))
    out: list[CollectiveTerm] = []
    notes: list[str] = [f"DeepSpeed's collectives under {u}" for u in fx.unmodelled]
    if pl.options.micro_batches != 1:
        notes.append(f"DeepSpeed's collectives over {pl.options.micro_batches} accumulated micro-batches")
    if stage in (1, 2):
        if fx.round_robin_gradients:
            notes.append("round_robin_gradients: the reordered partitions are not modelled")
        kind, calls = _zero12_gradient_calls(sizes, n, stage == 2 or bool(fx.overlap_comm), gbytes, fx)
        label = f"DeepSpeed gradient buckets ({fx.reduce_bucket_elements} elements), {kind.value} each"
        out.append(CollectiveTerm("deepspeed_gradient_buckets", label, kind, n, tuple(calls)))
    else:
        gathers, scatters, post = _zero3_calls(model, n, pbytes, gbytes, fx)
        out.append(
            CollectiveTerm(
                "deepspeed_zero3_fetch",
                "ZeRO-3 module fetches (forward, backward)",
                OpKind.ALL_GATHER,
                n,
                tuple(gathers),
            )
        )
        label = f"ZeRO-3 gradient buckets ({fx.reduce_bucket_elements} elements)"
        out.append(CollectiveTerm("deepspeed_zero3_reduce_scatter", label, OpKind.REDUCE_SCATTER, n, tuple(scatters)))
    if fx.fp16 or (fx.overflow_check and stage in (1, 2)):
        out.append(
            CollectiveTerm(
                "deepspeed_overflow_check", "DeepSpeed overflow check (1-byte flag)", OpKind.ALL_REDUCE, n, (1,)
            )
        )
    if stage == 3:
        # ``stage3.py`` ``get_grad_norm_direct``: the norm accumulates in fp64 (``get_norm_dtype``)
        out.append(
            CollectiveTerm("deepspeed_grad_norm", "DeepSpeed gradient norm (fp64 scalar)", OpKind.ALL_REDUCE, n, (8,))
        )
        if post:
            out.append(
                CollectiveTerm(
                    "deepspeed_persistent_gather",
                    "ZeRO-3 persistent parameters gathered after the step",
                    OpKind.ALL_GATHER,
                    n,
                    tuple(post),
                )
            )
    else:
        if fx.compute_grad_norm:
            out.append(
                CollectiveTerm(
                    "deepspeed_grad_norm", "DeepSpeed gradient norm (fp32 scalar)", OpKind.ALL_REDUCE, n, (4,)
                )
            )
        # ``all_gather_dp_groups``: one ``all_gather_into_tensor`` of the padded flat parameters
        # (``allgather_bucket_size`` only splits the fallback for torch without that call)
        align = fx.alignment_elements * n
        padded = -(-sum(sizes) // align) * align
        out.append(
            CollectiveTerm(
                "deepspeed_parameter_gather",
                "ZeRO-1/2 updated parameters gathered",
                OpKind.ALL_GATHER,
                n,
                (padded * pbytes,),
            )
        )
    return tuple(out), tuple(notes)


__all__ = [
    "CollectiveTerm",
    "DeepSpeedEffects",
    "HostMemory",
    "INIT_BYTES",
    "deepspeed_collectives",
    "deepspeed_host_memory",
    "deepspeed_notes",
    "deepspeed_partition_gradients",
    "deepspeed_terms",
    "largest_unit",
    "zero_stage",
]
