"""Costs derived from a placement and its step program alone (docs/semantics.md, "Costs").

Memory: for every state and group, size x bytes/element x the product over axes of the mode's
factor (``pipeline_factor`` / ``axis_factor``), plus transient buffers implied by the modes.
Communication: every collective of the step program with the ring volumes. Everything is exact:
``int`` and ``Fraction`` for a concrete placement, a sympy expression where degrees or sizes are
symbols (``formal._num``); ``int`` values are bytes (GB = 1e9 bytes only when printed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from formal import _num as num
from formal._exact import exact
from formal._model import Model, Precision, Transformer
from formal._num import Num
from formal._placement import Entry, Placement, Recompute
from formal._program import Op, StepProgram, axis_factor, pipeline_factor, shard_elements
from formal._vocab import (
    ACTIVATION_GROUPS,
    FIRST_STAGE_ACTIVATIONS,
    FIRST_STAGE_GROUPS,
    IO_ACTIVATION_GROUPS,
    LAST_STAGE_ACTIVATIONS,
    LAST_STAGE_GROUPS,
    LAYER_GROUPS,
    LAYER_IO,
    MODEL_STATES,
    Axis,
    Group,
    Mode,
    OpKind,
    Stage,
    State,
)

STAGES: tuple[Stage, ...] = tuple(Stage)  # first, middle, last


def ceil_int(x: Num) -> int:
    """Bytes are whole: a fractional shard rounds up (shards are padded to equal size)."""
    return int(num.ceiling(exact(x)))


@dataclass(frozen=True)
class StateMemory:
    """Bytes one device holds of one state, by group (persistent, between steps)."""

    state: State
    by_group: tuple[tuple[Group, Num], ...]

    @property
    def total(self) -> Num:
        return exact(sum((v for _, v in self.by_group), 0))


@dataclass(frozen=True)
class Memory:
    """Per-device memory on one pipeline stage. ``activations`` is None when unknown."""

    stage: Stage
    parameters: StateMemory
    gradients: StateMemory
    optimizer: StateMemory
    activations: Num | None
    buffers: Num | None
    host: Num

    @property
    def model_states(self) -> Num:
        return exact(self.parameters.total + self.gradients.total + self.optimizer.total)

    @property
    def total(self) -> Num:
        return exact(self.model_states + (self.activations or 0) + (self.buffers or 0))

    def as_ints(self) -> dict[str, int | None]:
        return {
            "parameters": ceil_int(self.parameters.total),
            "gradients": ceil_int(self.gradients.total),
            "optimizer": ceil_int(self.optimizer.total),
            "activations": None if self.activations is None else ceil_int(self.activations),
            "buffers": None if self.buffers is None else ceil_int(self.buffers),
            "model_states": ceil_int(self.model_states),
            "total": ceil_int(self.total),
        }


def _device_factor(pl: Placement, state: State, group: Group, stage: Stage) -> Num:
    """Product over axes of the persistent factor, times the axis-free (local) mode."""
    if pl.local_mode(state, group) in (Mode.OFFLOADED, Mode.MATERIALIZED):
        return 0
    return _axes_factor(pl, state, group, stage)


def _axes_factor(pl: Placement, state: State, group: Group, stage: Stage) -> Num:
    out: Num = 1
    for axis, d in pl.mesh:
        entry = pl.entry(state, group, axis)
        out = out * (
            pipeline_factor(group, entry, d, stage, pl.layer_share) if axis.kind.is_pipeline else axis_factor(entry, d)
        )
    return out


def state_memory(
    pl: Placement, state: State, sizes: Mapping[Group, Num], precision: Precision, stage: Stage = Stage.FIRST
) -> StateMemory:
    nbytes = precision.bytes_of(state)
    rows = tuple((g, exact(sizes[g] * nbytes * _device_factor(pl, state, g, stage))) for g in pl.groups(state))
    return StateMemory(state, rows)


def host_memory(pl: Placement, sizes: Mapping[Group, Num], precision: Precision, stage: Stage = Stage.FIRST) -> Num:
    total: Num = 0
    for state in MODEL_STATES:
        for g in pl.groups(state):
            if pl.local_mode(state, g) is Mode.OFFLOADED:
                total += sizes[g] * precision.bytes_of(state) * _axes_factor(pl, state, g, stage)
    return exact(total)


def in_flight_micro_batches(pl: Placement, stage: Stage = Stage.FIRST) -> Num:
    """Micro-batches whose activations a pipeline stage holds at its peak (in whole-stage units):
    the schedule's count for the first or last stage (``PipelineSchedule.in_flight``; a middle
    stage gets the first stage's, an upper bound). No pipeline: 1."""
    p = pl.pipeline_degree
    m = num.canonical(pl.options.micro_batches)  # a symbol in the planner's derivations
    if not pl.pipelined or p == 1:
        return 1
    v = pl.options.virtual_stages
    return pl.options.pipeline_schedule.in_flight(p, m, v, stage)


def stage_in_flight(pl: Placement, index: int) -> Num:
    """Micro-batches pipeline stage ``index`` (0 .. p-1) holds at its peak, in whole-stage units
    (``PipelineSchedule.stage_in_flight``). At i = 0 and i = p - 1 these are
    ``in_flight_micro_batches``' first and last stage."""
    p = pl.pipeline_degree
    m = num.canonical(pl.options.micro_batches)
    if not pl.pipelined or p == 1:
        return 1
    if not 0 <= index < p:
        raise ValueError(f"stage {index} of a {p}-stage pipeline")
    v = pl.options.virtual_stages
    return pl.options.pipeline_schedule.stage_in_flight(p, m, v, index)


def peak_activations(
    pl: Placement, whole: Num, deferred: Num, stage: Stage = Stage.FIRST, index: int | None = None
) -> Num:
    """Activation bytes a device holds at its peak, on ``stage`` or on pipeline stage ``index``:
    the schedule's (``PipelineSchedule.peak_activations``) from ``whole``, the bytes one
    micro-batch holds until its backward, and ``deferred``, what it keeps after it for work the
    schedule defers. No pipeline: one micro-batch at a time."""
    p = pl.pipeline_degree
    m = num.canonical(pl.options.micro_batches)
    if not pl.pipelined or p == 1:
        return whole
    if index is not None and not 0 <= index < p:
        raise ValueError(f"stage {index} of a {p}-stage pipeline")
    v = pl.options.virtual_stages
    return pl.options.pipeline_schedule.peak_activations(p, m, v, whole, deferred, stage, index)


def deferred_layer_activations(pl: Placement, sbh: Num, precision: Precision) -> Num:
    """Bytes one device keeps of one layer and one micro-batch for work its schedule defers past
    the backward (``PipelineSchedule.deferred_activations``), through the placement: each
    group's elements split along tp and cp as that activation group is, at the activation width.
    Recomputation does not shrink them: what the deferred work reads is kept until it runs."""
    total: Num = 0
    for group, per_sbh in pl.options.pipeline_schedule.deferred_activations:
        total += per_sbh * sbh * precision.activations * _tensor_factor(pl, group)
    return total


def activation_memory(
    pl: Placement, model: Model, precision: Precision, stage: Stage = Stage.FIRST, index: int | None = None
) -> Num | None:
    """Activation bytes on a device: the per-layer bytes the layer's ops save (Korthikanti et al.
    2022, section 4.1, for the model's structure: ``formal._saved``) for the stage's layers,
    plus the input and output layers' bytes (section 4.3) where the stage holds them, both
    through the placement, at the stage's peak (``peak_activations``): for a schedule that
    defers nothing, times the micro-batches in flight on the stage, the first or last stage's
    (``in_flight_micro_batches``), or, given a pipeline stage ``index``, that stage's own
    (``stage_in_flight``; a middle stage holds fewer than the first); ZB-H1 also keeps what its
    deferred weight-gradient passes read (``deferred_layer_activations`` for the stage's layers)."""
    if not isinstance(model, Transformer):
        return None
    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    layers = pl.stage_layers(model.layers)
    sbh = model.seq * model.micro_batch * model.hidden
    total = layer_activations(pl, per_layer, sbh, precision) * layers
    io = model.io_activation_bytes(precision.activations, precision.mask_bytes, precision.logits_bytes)
    total += io_activations(pl, io, stage)
    deferred = deferred_layer_activations(pl, sbh, precision) * layers
    return exact(peak_activations(pl, total, deferred, stage, index))


def holds_io_activations(pl: Placement, group: Group, stage: Stage) -> bool:
    """Whether a device of ``stage`` keeps an input/output-layer activation group: the input
    embeddings' on the first stage, the output layer's and the loss's on the last, all of them
    without a pipeline. A symbolic pp degree (the planner) means a pipeline of two or more."""
    p = pl.pipeline_degree
    if not pl.pipelined or (num.is_number(p) and p == 1):
        return True
    if group in FIRST_STAGE_ACTIVATIONS:
        return stage == Stage.FIRST
    if group in LAST_STAGE_ACTIVATIONS:
        return stage == Stage.LAST
    raise AssertionError(group)


def io_activations(pl: Placement, io_bytes: Mapping[Group, Num], stage: Stage = Stage.FIRST) -> Num:
    """Input/output-layer activation bytes one device keeps for one micro-batch on ``stage``
    (Korthikanti et al. 2022, section 4.3), through the placement. Works on symbolic sizes."""
    total: Num = 0
    for g in IO_ACTIVATION_GROUPS:
        if (State.ACTIVATIONS, g) not in set(pl.keys()) or not holds_io_activations(pl, g, stage):
            continue
        total += io_bytes[g] * _tensor_factor(pl, g)
    return total


def layer_activations(pl: Placement, per_layer: Mapping[Group, Num], sbh: Num, precision: Precision) -> Num:
    """Activation bytes one device keeps for one layer and one micro-batch, through the placement.

    Works on symbolic sizes too (``per_layer`` from ``formal._model.layer_activation_bytes``).
    """
    total: Num = 0
    for g in ACTIVATION_GROUPS:
        if pl.local_mode(State.ACTIVATIONS, g) is Mode.MATERIALIZED:
            continue  # recomputed in backward, freed after use
        total += per_layer[g] * _tensor_factor(pl, g)
    if pl.options.recompute is Recompute.FULL:
        # Korthikanti Table 2, full recomputation: each layer's input (2sbh bytes at 16 bits).
        total += precision.activations * sbh * _cp_factor(pl) * _sp_factor(pl)
    return total


def _sp_factor(pl: Placement) -> Num:
    """The share of a layer's input sequence parallelism leaves to a device, for its
    full-recomputation checkpoint (context parallelism's share is ``_cp_factor``).

    The input of a layer is split along the sequence by context parallelism and, under sequence
    parallelism, by tensor parallelism too: a layer's input is then the hidden state whole only
    along the sequence shard of the rank (the ``LAYER_IO`` placement along that axis), so the
    checkpoint is ``2sbh/(cp t)``. Megatron-LM keeps it so and refuses to split it again
    (``distribute_saved_activations and not sequence_parallel``, megatron/legacy/model/
    transformer.py); without sequence parallelism the rank keeps the whole ``2sbh/cp``, which
    ZeRO-R's partitioned activation checkpointing (Rajbhandari et al. 2020, section 6.1, "Pa")
    splits across the model-parallel ranks the same way.
    """
    out: Num = 1
    for axis, d in pl.mesh:
        if axis.kind.sequence_parallel and pl.entry(State.ACTIVATIONS, LAYER_IO, axis).mode.is_sharded:
            out = num.ratio(out, d)
    return out


def activation_breakdown(
    pl: Placement, model: Model, precision: Precision, stage: Stage = Stage.FIRST
) -> dict[str, dict[str, int]] | None:
    """One device's activation bytes for one micro-batch on ``stage``, before the schedule's
    in-flight multiple, by layer kind and group: ``layer`` (one transformer layer: each per-layer
    group it keeps through the placement, and ``checkpoint`` under full recomputation), ``layers``
    (the same for all the stage's layers), ``io`` (the input and output layers' groups the stage
    holds). Whole bytes, rounded up; None for a model given only by its parameter count."""
    if not isinstance(model, Transformer):
        return None
    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    sbh = model.seq * model.micro_batch * model.hidden
    layer: dict[str, Num] = {}
    for g in ACTIVATION_GROUPS:
        kept = pl.local_mode(State.ACTIVATIONS, g) is not Mode.MATERIALIZED
        layer[g.name] = per_layer[g] * _tensor_factor(pl, g) if kept else 0
    if pl.options.recompute is Recompute.FULL:
        layer["checkpoint"] = precision.activations * sbh * _cp_factor(pl) * _sp_factor(pl)
    count = pl.stage_layers(model.layers)
    io_bytes = model.io_activation_bytes(precision.activations, precision.mask_bytes, precision.logits_bytes)
    io = {
        g.name: io_bytes[g] * _tensor_factor(pl, g)
        if (State.ACTIVATIONS, g) in set(pl.keys()) and holds_io_activations(pl, g, stage)
        else 0
        for g in IO_ACTIVATION_GROUPS
    }
    return {
        "layer": {k: ceil_int(v) for k, v in layer.items()},
        "layers": {k: ceil_int(v * count) for k, v in layer.items()},
        "io": {k: ceil_int(v) for k, v in io.items()},
    }


def _tensor_factor(pl: Placement, group: Group) -> Num:
    out: Num = 1
    for axis, d in pl.mesh:
        if axis.kind.is_pipeline or axis.kind.splits_batch:
            continue  # b is one replica's micro-batch already; pp splits layers (counted above)
        out = out * axis_factor(pl.entry(State.ACTIVATIONS, group, axis), d)
    return out


def _cp_factor(pl: Placement) -> Num:
    return num.ratio(1, pl.degree_where(lambda kind: kind.splits_sequence))


def buffer_memory(
    pl: Placement, model: Model, sizes: Mapping[Group, Num], precision: Precision, stage: Stage = Stage.FIRST
) -> Num | None:
    """Transient buffers implied by the modes, at their peak (``buffer_parts``: what is held
    through the backward, and the largest unit per state)."""
    parts = buffer_parts(pl, model, sizes, precision, stage)
    if parts is None:
        return None
    held, largest = parts
    return exact(held + sum(largest.values(), 0))


def buffer_parts(
    pl: Placement, model: Model, sizes: Mapping[Group, Num], precision: Precision, stage: Stage = Stage.FIRST
) -> tuple[Num, dict[State, Num]] | None:
    """Transient buffers implied by the modes: the copies held through backward, and per state
    (parameters, gradients) the largest unit gathered or reduced at a time, in bytes.

    ``S*`` gathered per use: the largest gather unit (one transformer layer's parameters, or
    a non-layer group) held unsharded at a time, without prefetch. ``S*`` held through
    backward (shard-grad-op): every unsharded parameter of the stage minus its shard. ``G``
    sharded along a data axis: one layer's unsharded gradient (at the wire width it is
    reduced in) before its reduce-scatter. Together, 2 + 2 bytes per element of the largest
    layer under ZeRO-3: DeepSpeed's ``largest_layer_memory = 4 * largest_layer_params``
    (``estimate_zero3_model_states_mem_needs``, deepspeed/runtime/zero/stage3.py).
    Unknown (None) for a model given only by its parameter count, whose layers are unknown,
    unless it states its largest unit (``ParameterCount.largest_layer``, ``--largest-layer``):
    then that unit is gathered and reduced, as in DeepSpeed's estimator.
    """
    layer_count = model.layers if isinstance(model, Transformer) else None
    held: Num = 0
    units: dict[str, Num] = {}
    for state in (State.PARAMETERS, State.GRADIENTS):
        nbytes = precision.wire_bytes_of(state)  # the gradient bucket holds the reduced width
        for g in pl.groups(state):
            axes = [a for a in pl.axes if _needs_buffer(pl, state, g, a, pl.entry(state, g, a))]
            if not axes:
                continue
            unit_count = _bare_unit(model)
            if layer_count is None and unit_count is None:
                return None
            # Along several axes (ZeRO++ hpZ: within and across nodes) the buffer is whole along all.
            held_axes = [a for a in axes if state is State.PARAMETERS and pl.entry(state, g, a).keep_gathered]
            if held_axes:
                # Held through the backward along these axes: the copy whole along them, minus the
                # device's own shard (hpZ's secondary partition, P/k, when only the across-node axis holds),
                # which the parameters' memory already counts unless it lives on the host (offload-params).
                copy = shard_elements(pl, state, g, sizes[g], held_axes, stage) * nbytes
                own = (
                    0
                    if pl.local_mode(state, g) is Mode.OFFLOADED
                    else shard_elements(pl, state, g, sizes[g], None, stage) * nbytes
                )
                held += copy - own
                if len(held_axes) == len(axes):
                    continue
            full = shard_elements(pl, state, g, sizes[g], axes, stage) * nbytes
            unit = f"{state.value}:{'layer' if g in LAYER_GROUPS else g.name}"
            if layer_count is None:
                # A bare count's largest unit: whole along the axes it is gathered or reduced on
                # and along the pipeline (a unit sits on one stage), sharded along the others (tp).
                pipe = [a for a in pl.axes if a.kind.is_pipeline]
                piece = shard_elements(pl, state, g, unit_count or 0, [*axes, *pipe], stage) * nbytes
            elif g in LAYER_GROUPS:
                piece = num.ratio(full, pl.stage_layers(layer_count))
            else:
                piece = full
            units[unit] = units.get(unit, 0) + piece
    # num.maximum, not max(): with symbolic degrees the units may not be comparable (the planner derives
    # costs with symbolic degrees).
    largest = {
        st: num.maximum(0, *(v for k, v in units.items() if k.startswith(st.value)))
        for st in (State.PARAMETERS, State.GRADIENTS)
    }
    return held, largest


def _bare_unit(model: Model) -> int | None:
    """A bare parameter count's largest gather unit (``ParameterCount.largest_layer``)."""
    return None if isinstance(model, Transformer) else model.largest_layer


def _needs_buffer(pl: Placement, state: State, group: Group, axis: Axis, entry: Entry) -> bool:
    """``S*`` parameters need a gather buffer; gradients sharded along an axis whose data is
    split (ZeRO-2/3, FSDP) need a full-size bucket of one unit before the reduce-scatter."""
    match state:
        case State.PARAMETERS:
            return entry.mode is Mode.SHARDED_GATHER
        case State.GRADIENTS:
            return entry.mode is Mode.SHARDED and axis.splits_data and not pl.computes_sharded(axis, group)
        case _:
            return False


def memory(
    pl: Placement, model: Model, precision: Precision, sizes: Mapping[Group, Num], stage: Stage = Stage.FIRST
) -> Memory:
    return Memory(
        stage=stage,
        parameters=state_memory(pl, State.PARAMETERS, sizes, precision, stage),
        gradients=state_memory(pl, State.GRADIENTS, sizes, precision, stage),
        optimizer=state_memory(pl, State.OPTIMIZER, sizes, precision, stage),
        activations=activation_memory(pl, model, precision, stage),
        buffers=buffer_memory(pl, model, sizes, precision, stage),
        host=host_memory(pl, sizes, precision, stage),
    )


def stage_memory(pl: Placement, model: Model, precision: Precision, sizes: Mapping[Group, Num], index: int) -> Memory:
    """Memory of a device on pipeline stage ``index`` (0 .. p-1): the model states and buffers of
    its kind of stage (the first holds the embedding, the last the head, a middle one neither) and
    the activations that stage itself holds at its peak (``activation_memory`` with ``index``:
    under 1F1B stage i keeps min(p - i, m) micro-batches). Without a pipeline, stage 0 is every device."""
    p = pl.pipeline_degree if pl.pipelined else 1
    if not num.is_number(p) or not 0 <= index < p:
        raise ValueError(f"stage {index} of a {p}-stage pipeline")
    kind = Stage.of(index, int(p))
    whole = memory(pl, model, precision, sizes, kind)
    if p == 1:
        return whole
    return replace(whole, activations=activation_memory(pl, model, precision, kind, index))


def most_loaded(pl: Placement, model: Model, precision: Precision, sizes: Mapping[Group, Num]) -> Memory:
    """The device with the largest total: pipeline stage 0 (embedding, most in-flight
    activations) unless the last stage's head outweighs it. Without pp there is one kind."""
    if not pl.pipelined or pl.pipeline_degree == 1:
        return memory(pl, model, precision, sizes, Stage.FIRST)
    candidates = [memory(pl, model, precision, sizes, st) for st in (Stage.FIRST, Stage.LAST)]
    if any(not num.is_number(m.total) for m in candidates):
        return candidates[0]
    return max(candidates, key=lambda m: exact(m.total))


# --- communication -------------------------------------------------------------------------


def ring_factor(kind: OpKind, n: Num) -> Num:
    """Bytes one device sends per byte of the full tensor, ring algorithms (docs/semantics.md, "Costs").

    A rooted reduce moves (n-1)/n of the buffer per device, the bandwidth lower bound of
    reduce-to-one (Chan, Heimlich, Purkayastha and van de Geijn 2007, "Collective communication:
    theory, practice, and experience", the lower bounds table: (p-1)/p n beta), which a pipelined
    ring or tree reaches for large buffers."""
    match kind:
        case OpKind.ALL_REDUCE:
            return num.ratio(2 * (n - 1), n)
        case OpKind.REDUCE_SCATTER | OpKind.ALL_GATHER | OpKind.ALL_TO_ALL | OpKind.BROADCAST | OpKind.REDUCE:
            return num.ratio(n - 1, n)
        case OpKind.SEND_RECV:
            return 1
        case _:
            raise AssertionError(kind)


def paper_factor(kind: OpKind) -> Num:
    """The ZeRO paper's convention: (d-1)/d dropped; an all-reduce moves 2x, the others 1x."""
    return 2 if kind is OpKind.ALL_REDUCE else 1


@dataclass(frozen=True)
class Traffic:
    """One collective of the step program with its per-device volume."""

    kind: OpKind
    axis: Axis
    state: State
    group: Group
    phase: str
    elements: Num  # per call: elements of the full tensor along the axis
    count: Num  # calls per step
    participants: Num
    bytes: Num  # per device per step, ring algorithm
    paper_elements: Num  # ZeRO-paper units: elements x (2 for all-reduce, else 1) x count


def pipeline_stages(pl: Placement) -> tuple[Stage, ...]:
    """The kinds of pipeline stage a placement has: one without a pipeline, first and last with
    two stages, and a middle one beyond (a symbolic degree: all three)."""
    p = pl.pipeline_degree
    if not pl.pipelined or (num.is_number(p) and p == 1):
        return (Stage.FIRST,)
    if num.is_number(p) and p == 2:
        return (Stage.FIRST, Stage.LAST)
    return STAGES


def op_stage_factor(op: Op, pl: Placement, stage: Stage) -> Num:
    """How often a device of pipeline ``stage`` runs ``op``, relative to the op's ``count``.

    The step program is a union over stages: the first stage's groups (embedding, its
    activation) run on the first stage only, the last stage's (head, final norm, their
    activations) on the last, a tied embedding on both; stage-to-stage sends are counted per
    boundary (m x the schedule's ``boundary_sends`` b per phase), and a device ends
    ``2b - [first] - [last]`` of
    its boundaries (a middle stage sends and receives both ways). Without a pipeline: 1.
    """
    if len(pipeline_stages(pl)) == 1:
        return 1
    if op.kind is OpKind.SEND_RECV and op.axis is not None and op.axis.kind.is_pipeline:
        sends = pl.options.pipeline_schedule.boundary_sends(pl.options.chunks)
        ends = int(stage == Stage.FIRST) + int(stage == Stage.LAST)
        return num.ratio(2 * sends - ends, sends)
    group = op.group
    if group in pl.tied:
        return int(stage in (Stage.FIRST, Stage.LAST))
    if group in FIRST_STAGE_GROUPS or group in FIRST_STAGE_ACTIVATIONS:
        return int(stage == Stage.FIRST)
    if group in LAST_STAGE_GROUPS or group in LAST_STAGE_ACTIVATIONS:
        return int(stage == Stage.LAST)
    return 1


def communication(program: StepProgram, precision: Precision, stage: Stage | None = None) -> tuple[Traffic, ...]:
    """Every collective of the program with its per-device volume: the program's union over
    pipeline stages, or, given ``stage``, what one device of that stage sends (``op_stage_factor``)."""
    out: list[Traffic] = []
    pl = program.placement
    for op in program.ops:
        if not op.kind.is_collective or op.axis is None:
            continue
        factor = 1 if stage is None else op_stage_factor(op, pl, stage)
        if factor == 0:
            continue
        count = exact(op.count * factor)
        n = op.participants if op.participants is not None else pl.degree(op.axis)
        nbytes = precision.op_wire_bytes(op.state, op.group)
        volume = exact(op.elements * nbytes * ring_factor(op.kind, n) * count)
        paper = exact(op.elements * paper_factor(op.kind) * count)
        out.append(Traffic(op.kind, op.axis, op.state, op.group, op.phase.value, op.elements, count, n, volume, paper))
    return tuple(out)


def busiest_stage_traffic(program: StepProgram, precision: Precision) -> tuple[Stage, tuple[Traffic, ...]]:
    """The pipeline stage whose device sends the most per step, and its collectives (the first
    stage on a tie; without a pipeline, the one kind of device)."""
    stages = pipeline_stages(program.placement)
    per_stage = [(st, communication(program, precision, st)) for st in stages]
    if len(per_stage) == 1 or any(not num.is_number(total_bytes(t)) for _, t in per_stage):
        return per_stage[0]
    return max(per_stage, key=lambda item: exact(total_bytes(item[1])))


def transfers(program: StepProgram, precision: Precision) -> tuple[tuple[str, State, Group, str, Num], ...]:
    """Host-device (PCIe) transfers, counted apart from network collectives: bytes per step."""
    out = []
    for op in program.ops:
        if op.kind.is_transfer:
            out.append(
                (
                    op.kind.value,
                    op.state,
                    op.group,
                    op.phase.value,
                    exact(op.elements * precision.bytes_of(op.state) * op.count),
                )
            )
    return tuple(out)


def total_bytes(traffic: tuple[Traffic, ...]) -> Num:
    return exact(sum((t.bytes for t in traffic), 0))


def model_state_paper_units(traffic: tuple[Traffic, ...]) -> Num:
    """Elements of model-state collectives in the ZeRO paper's units (divide by Psi for Psi)."""
    return exact(sum((t.paper_elements for t in traffic if t.state is not State.ACTIVATIONS), 0))


def bubble_fraction(pl: Placement) -> Num:
    """Pipeline bubble: a stage's idle time over its compute time in one step, the schedule's
    (``PipelineSchedule.bubble_fraction``; (p-1)/m for 1F1B and GPipe, (p-1)/(v m) interleaved,
    Narayanan et al. 2021, section 2.2). No pipeline: 0."""
    p = pl.pipeline_degree
    m = num.canonical(pl.options.micro_batches)  # a symbol in the planner's derivations
    if not pl.pipelined:
        return 0
    return pl.options.pipeline_schedule.bubble_fraction(p, m, pl.options.virtual_stages)
