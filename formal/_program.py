"""The step program: the ordered collectives, transfers and local steps of one training step.

Derived from a ``Placement`` alone (docs/semantics.md, "The step program"). The cost model, the z3 encoding and the
simulator all read this one program; none of them re-derives it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from formal import _num as num
from formal._axes import Exchange, Origin, Width
from formal._exact import exact
from formal._exchanges import exchanged_group, program_exchanges
from formal._model import Model, Transformer
from formal._num import Num
from formal._placement import Entry, Placement, Recompute
from formal._scalar_program import derive_scalars
from formal._scalars import ScalarOp
from formal._vocab import (
    EMBEDDING,
    EXPERTS,
    FINAL_NORM,
    FIRST_STAGE_GROUPS,
    LAST_STAGE_GROUPS,
    LAYER_GROUPS,
    LAYER_IO,
    NORM,
    ROUTER,
    ROW_BIAS,
    Axis,
    Buffer,
    Group,
    Mode,
    OpKind,
    Phase,
    Reduce,
    Stage,
    State,
)
from formal.errors import InputError

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741 (the paper's P/O/G/A)

# Parameter groups applied inside the sequence-parallel region: with sequence parallelism
# their inputs are split along the sequence across tp, so their gradients are partial sums
# there (Korthikanti et al. 2022 section 4.2.2; Megatron-LM issue #1446 when forgotten).
SEQUENCE_REGION_GROUPS: frozenset[Group] = frozenset({NORM, ROW_BIAS, FINAL_NORM, ROUTER})


@dataclass(frozen=True)
class Op:
    """One step of a step program.

    ``elements``: elements of the whole tensor the op acts on along its axis, as seen by one device (already divided
    by the other axes' shards); ``count``: times per training step; ``participants``: devices in the collective (the
    axis degree unless fewer take part, as the first and last stage for tied embeddings); ``offset``: the shard
    partition a reduce-scatter, all-gather or optimizer step uses; ``full``: for a COMPUTE read, the axes along which
    the read needs the whole tensor; ``buffer``: for a gradient op, the gradient buffer it acts on (None: the default
    of ``formal._vocab.gradient_buffer``; docs/semantics.md, "Gradient buffers").
    """

    kind: OpKind
    state: State
    group: Group
    axis: Axis | None
    phase: Phase
    elements: Num = 0
    count: Num = 1
    reduce: Reduce | None = None
    participants: Num | None = None
    offset: int = 0
    scale: Num | None = None
    full: frozenset[Axis] = frozenset()
    note: str = field(default="", compare=False)
    buffer: Buffer | None = None

    def __str__(self) -> str:
        where = f", {self.axis.value}" if self.axis is not None else ""
        extra = f", {self.reduce.value}" if self.reduce is not None else ""
        if self.offset:
            extra += f", offset {self.offset}"
        if self.scale is not None:
            extra += f", x{self.scale}"
        extra += f", {self.buffer.value} buffer" if self.buffer is not None else ""
        target = f"{self.state.value}.{self.group.name}{where}{extra}"
        return f"{self.phase.value}: {self.kind.value}({target}) x{self.count}"


@dataclass(frozen=True)
class StepProgram:
    """A placement's step program. ``origins``: per (group, axis) the gradient after backward."""

    placement: Placement
    ops: tuple[Op, ...]
    origins: tuple[tuple[tuple[Group, Axis], Origin], ...]
    derived: bool = True  # False when given by the user (TOML) or mutated
    scalars: tuple[ScalarOp, ...] = ()  # the loss normaliser, norm, clip, overflow (formal._scalars)

    def origin(self, group: Group, axis: Axis) -> Origin:
        return dict(self.origins).get((group, axis), Origin.COMPLETE)

    def with_ops(self, ops: Iterable[Op]) -> StepProgram:
        return replace(self, ops=tuple(ops), derived=False)

    def collectives(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind.is_collective)


def refuse_unmodelled_ops(program: StepProgram, by: str) -> None:
    """Refuse (``InputError``, one line) a program with an op the reader ``by`` (the z3 verdict,
    the simulator) does not model:

    * a rooted reduce: their reductions give every rank the reduced value, a ``reduce`` only its
      destination, so judging it as an all-reduce would pass a program whose other ranks step on
      their own partial gradients;
    * a collective with an offset along an axis that splits its group by structure (pipeline
      stages, tp's matrices and ep's experts where the group is computed split): there each
      rank's piece is its own slice, so a shifted piece is not a layout the model represents,
      as a placement's offset there is not (``Strategy.split_offset_problem``). A tied
      embedding's pieces along pp are flat shards between its two stages: offsets apply."""
    pl = program.placement
    for op in program.ops:
        if op.kind.is_rooted:
            raise InputError(f"{op}: a {op.kind.value} to one destination rank is not modelled by {by}")
        if not op.offset or not op.kind.is_collective or op.axis is None or op.state is State.ACTIVATIONS:
            continue
        stages = op.axis.kind.is_pipeline and op.group not in pl.tied
        by_structure = op.axis.kind.splits_matrices or op.axis.kind.places_experts
        slices = by_structure and pl.computes_sharded(op.axis, op.group)
        if stages or slices:
            raise InputError(
                f"{op}: an offset along {op.axis.value}, which splits {op.group.name} into each rank's own "
                f"slice, is not modelled by {by}"
            )


def rescatters(ops: Sequence[Op]) -> frozenset[int]:
    """The indices of gradient reduce-scatters (outside the forward) that follow a reduction of
    the same group's gradient along the same axis: every peer already holds the reduced value, so
    the collective writes its chunk over equal values and leaves the buffer as it is
    (``reduce_scatter_tensor`` does not touch its input). It cuts nothing."""
    reduced: set[tuple[Group, Axis]] = set()
    out = set()
    for i, op in enumerate(ops):
        if op.state is not State.GRADIENTS or op.axis is None or op.phase is Phase.FORWARD:
            continue
        if not op.kind.is_reduction:
            continue
        if op.kind is OpKind.REDUCE_SCATTER and (op.group, op.axis) in reduced:
            out.add(i)
        reduced.add((op.group, op.axis))
    return frozenset(out)


def scatter_axes(ops: Sequence[Op], group: Group) -> frozenset[Axis]:
    """The axes the program reduce-scatters ``group``'s gradient along, cutting it (outside the
    forward, whose gradient the backward makes whole again; re-scatters of a reduced gradient
    excluded): the partition the gradient is cut towards (docs/semantics.md, "Collectives along
    several axes"). The simulator and the z3 verdict both read it."""
    again = rescatters(ops)
    return frozenset(
        op.axis
        for i, op in enumerate(ops)
        if op.group == group
        and op.state is State.GRADIENTS
        and op.axis is not None
        and op.kind is OpKind.REDUCE_SCATTER
        and op.phase is not Phase.FORWARD
        and i not in again
    )


def group_sizes(model: Model) -> dict[Group, Num]:
    return dict(model.group_elements())


def pipeline_factor(group: Group, entry: Entry, p: Num, stage: Stage, layer_share: Num | None = None) -> Num:
    """Memory factor along pp on a stage (``first``, ``last`` or ``middle``).

    Layers are split evenly (1/p), or, with declared uneven stages, ``layer_share`` of them (ceil(L/p)/L: every stage
    is charged the fullest stage's layers); first-stage groups live on stage 0 only, last-stage groups on stage p-1
    only; a tied embedding (``R`` along pp) on both.
    """
    if entry.mode is Mode.REPLICATED and group not in LAYER_GROUPS:
        return 1 if stage in (Stage.FIRST, Stage.LAST) or p == 1 else 0
    if entry.mode in (Mode.OFFLOADED, Mode.MATERIALIZED):
        return 0
    if entry.mode is Mode.REPLICATED:
        return 1
    if group in FIRST_STAGE_GROUPS:
        return 1 if stage == Stage.FIRST or p == 1 else 0
    if group in LAST_STAGE_GROUPS:
        return 1 if stage == Stage.LAST or p == 1 else 0
    return num.ratio(1, p) if layer_share is None else layer_share


def axis_factor(entry: Entry, d: Num) -> Num:
    """Persistent memory factor of one mode along one (non-pipeline) axis (docs/semantics.md, "Modes")."""
    match entry.mode:
        case Mode.REPLICATED:
            return 1
        case Mode.SHARDED | Mode.SHARDED_GATHER:
            return num.ratio(1, d)
        case Mode.MATERIALIZED | Mode.OFFLOADED:
            return 0
        case _:
            raise AssertionError(entry)


def owner_stage(group: Group) -> Stage:
    if group in FIRST_STAGE_GROUPS:
        return Stage.FIRST
    if group in LAST_STAGE_GROUPS:
        return Stage.LAST
    return Stage.FIRST


def shard_elements(
    pl: Placement,
    state: State,
    group: Group,
    size: Num,
    skip: Axis | Iterable[Axis] | None,
    stage: Stage | None = None,
) -> Num:
    """Elements one device holds of (state, group), ignoring the axis (or axes) ``skip`` and axis-free modes: the
    tensor a collective along ``skip`` acts on, whole along it. Offloaded/materialized along an axis count as their
    shard (what would be held).
    """
    stage = stage or owner_stage(group)
    skipped = {skip} if isinstance(skip, Axis) else set(skip or ())
    out = size
    for axis, d in pl.mesh:
        if axis in skipped:
            continue
        entry = pl.entry(state, group, axis)
        if entry.mode in (Mode.OFFLOADED, Mode.MATERIALIZED):
            entry = Entry(Mode.REPLICATED)
        if axis.kind.is_pipeline:
            out = out * pipeline_factor(group, entry, d, stage, pl.layer_share)
        else:
            out = out * axis_factor(entry, d)
    return exact(out)


def gradient_origins(pl: Placement) -> dict[tuple[Group, Axis], Origin]:
    """Per parameter group and axis: is its gradient partial after backward? (rule 2)."""
    out: dict[tuple[Group, Axis], Origin] = {}
    for group in pl.groups(P):
        for axis in pl.axes:
            out[(group, axis)] = _origin(pl, group, axis)
    return out


def _origin(pl: Placement, group: Group, axis: Axis) -> Origin:
    # Sequence parallelism on the axis splits the layer inputs (A.layer_io) along the sequence.
    in_region = axis.kind.sequence_parallel and group in SEQUENCE_REGION_GROUPS and (A, LAYER_IO) in set(pl.keys())
    return axis.kind.gradient_origin(
        computes_sharded=pl.computes_sharded(axis, group),
        sequence_region=in_region and pl.mode(A, LAYER_IO, axis).is_sharded,
        tied=group in pl.tied,
    )


def derive_program(pl: Placement, model: Model, sizes: Mapping[Group, Num] | None = None) -> StepProgram:
    """Derive the step program of a placement, in order:

    1. forward, per micro-batch: gather ``S*`` parameters, fetch offloaded ones, read them, activation collectives
       (TP, CP, EP, PP sends, the vocabulary-parallel embedding's and head's);
    2. backward, per micro-batch: gather again unless held, read, activation collectives;
    3. gradient synchronisation: reduce every partial gradient along its axes (reduce-scatter
       where G is sharded, all-reduce where replicated; mean along data axes, sum otherwise),
       scale summed expert gradients, copy offloaded gradients to the host;
    4. the optimizer step on the optimizer's shards;
    5. refresh: all-gather replicated parameters updated from sharded optimizer state, copy
       host-updated parameters back (offloaded replicas: to the device, gathered, to the host).

    Beside the ops, the scalar program the composition's scalar settings ask for (the loss
    normaliser, the global norm and clip, the fp16 overflow check, the load-balancing loss:
    ``formal._scalar_program.derive_scalars``).
    """
    sizes = dict(sizes) if sizes is not None else group_sizes(model)
    m = num.canonical(pl.options.micro_batches)  # a symbol in the planner's derivations
    origins = gradient_origins(pl)
    ops: list[Op] = []
    groups = pl.groups(P)
    act = _ActivationOps(pl, model, m)
    # 1. forward
    for g in groups:
        ops += _fetch_parameters(pl, g, sizes[g], m, Phase.FORWARD)
    ops += act.forward()
    # 2. backward
    for g in groups:
        ops += _fetch_parameters(pl, g, sizes[g], m, Phase.BACKWARD)
    ops += act.backward()
    # 3. gradient synchronisation
    for g in groups:
        ops += _sync_gradients(pl, g, sizes[g], m, origins)
    # 4. optimizer step
    for g in groups:
        entry_axes = [(axis, pl.entry(O, g, axis)) for axis in pl.axes]
        offset = max((e.offset for _, e in entry_axes if e.mode.is_sharded), default=0)
        ops.append(
            Op(
                OpKind.OPTIMIZER_STEP,
                O,
                g,
                None,
                Phase.OPTIMIZER,
                shard_elements(pl, O, g, sizes[g], None),
                offset=offset,
            )
        )
    # 5. refresh
    for g in groups:
        ops += _refresh_parameters(pl, g, sizes[g])
    return StepProgram(pl, tuple(ops), tuple(origins.items()), scalars=derive_scalars(pl))


def _fetch_parameters(pl: Placement, g: Group, size: Num, m: Num, phase: Phase) -> list[Op]:
    # An offloaded shard comes to the device before it can be gathered (ZeRO-Infinity); the
    # other order gathers shards that are not there yet (found by the simulator).
    fetch = Op(
        OpKind.HOST_TO_DEVICE, P, g, None, phase, shard_elements(pl, P, g, size, None), m, note="fetch offloaded"
    )
    ops: list[Op] = [fetch] if pl.local_mode(P, g) is Mode.OFFLOADED else []
    # Gathers along several axes run in mesh order, each on what the earlier ones (and, in the
    # backward, the forward's held ones) made whole: ZeRO++ hpZ's forward gathers within the node,
    # then across nodes, and its backward within the node only, from the held secondary copy.
    whole = {a for a in pl.axes if phase is Phase.BACKWARD and pl.entry(P, g, a).keep_gathered}
    for axis in pl.axes:
        entry = pl.entry(P, g, axis)
        if entry.mode is Mode.SHARDED_GATHER and not (phase is Phase.BACKWARD and entry.keep_gathered):
            ops.append(
                Op(
                    OpKind.ALL_GATHER,
                    P,
                    g,
                    axis,
                    phase,
                    shard_elements(pl, P, g, size, whole | {axis}),
                    m,
                    offset=entry.offset,
                    note="gather before use",
                )
            )
            whole.add(axis)
    full = frozenset(axis for axis in pl.axes if not pl.computes_sharded(axis, g))
    ops.append(Op(OpKind.COMPUTE, P, g, None, phase, count=m, full=full))
    return ops


def _sync_gradients(
    pl: Placement, g: Group, size: Num, m: Num, origins: Mapping[tuple[Group, Axis], Origin]
) -> list[Op]:
    scatter: list[Op] = []
    reduce: list[Op] = []
    # Without a full-size accumulator (G sharded along a data axis) each micro-batch's
    # gradient is reduce-scattered as it is produced (ZeRO-2/3 under gradient accumulation).
    per_micro_batch = any(
        pl.mode(G, g, axis) is Mode.SHARDED and origins[(g, axis)] is Origin.PARTIAL for axis in pl.axes
    )
    count = m if per_micro_batch else 1
    for axis in pl.axes:
        origin = origins[(g, axis)]
        d = pl.degree(axis)
        if origin is Origin.SUMMED:
            reduce.append(
                Op(
                    OpKind.SCALE,
                    G,
                    g,
                    axis,
                    Phase.GRAD_SYNC,
                    scale=num.ratio(1, d),
                    note="normalise a gradient summed over the axis",
                )
            )
            continue
        if origin is not Origin.PARTIAL:
            continue
        how = Reduce.MEAN if axis.kind.averages_gradients else Reduce.SUM
        entry = pl.entry(G, g, axis)
        elements = shard_elements(pl, G, g, size, axis)
        # the first and the last stage (a tied embedding); one stage when pp has degree 1
        participants = 2 if axis.kind.is_pipeline and d != 1 else None
        o_entry = pl.entry(O, g, axis)
        if entry.mode.is_sharded:
            scatter.append(
                Op(OpKind.REDUCE_SCATTER, G, g, axis, Phase.GRAD_SYNC, elements, count, how, offset=entry.offset)
            )
        elif o_entry.mode.is_sharded:
            # ZeRO-1 / Megatron's distributed optimizer: the gradient buffer is full size (R), but
            # only the optimizer's shard of it is ever read, so a reduce-scatter onto that shard
            # suffices (ZeRO paper section 7.2.1: P_os moves 2 Psi, like DP).
            scatter.append(
                Op(
                    OpKind.REDUCE_SCATTER,
                    G,
                    g,
                    axis,
                    Phase.GRAD_SYNC,
                    elements,
                    count,
                    how,
                    offset=o_entry.offset,
                    note="only the optimizer's shard is read",
                )
            )
        else:
            reduce.append(
                Op(OpKind.ALL_REDUCE, G, g, axis, Phase.GRAD_SYNC, elements, count, how, participants=participants)
            )
    # Reduce-scatters along several axes run in reverse mesh order (the transpose of the gathers),
    # each on the gradient still whole along the axes scattered after it.
    # One onto the optimizer's shard (G full size along its axis) leaves the later ones the
    # device's piece of it: they act on that piece.
    scatter.reverse()
    for i, op in enumerate(scatter):
        later = [o.axis for o in scatter[i:] if o.axis is not None]
        elements = shard_elements(pl, G, g, size, later) if len(later) > 1 else op.elements
        for before in scatter[:i]:
            if before.axis is not None and not pl.entry(G, g, before.axis).mode.is_sharded:
                elements = exact(elements * num.ratio(1, pl.degree(before.axis)))
        scatter[i] = replace(op, elements=elements)
    ops = scatter + reduce
    if pl.local_mode(G, g) is Mode.OFFLOADED:
        ops.append(
            Op(
                OpKind.DEVICE_TO_HOST,
                G,
                g,
                None,
                Phase.GRAD_SYNC,
                shard_elements(pl, G, g, size, None),
                note="gradients to the host optimizer",
            )
        )
    return ops


def _refresh_parameters(pl: Placement, g: Group, size: Num) -> list[Op]:
    def transfer(kind: OpKind, state: State, note: str) -> Op:
        return Op(kind, P, g, None, Phase.REFRESH, shard_elements(pl, state, g, size, None), note=note)

    gathers = [
        Op(
            OpKind.ALL_GATHER,
            P,
            g,
            axis,
            Phase.REFRESH,
            shard_elements(pl, P, g, size, axis),
            offset=o.offset,
            note="refresh replicas after a sharded update",
        )
        for axis in pl.axes
        if pl.entry(P, g, axis).mode is Mode.REPLICATED and (o := pl.entry(O, g, axis)).mode.is_sharded
    ]
    if pl.local_mode(P, g) is Mode.OFFLOADED:
        # Offloaded replicas (ZeRO-1/2 with offload-params): the update wrote the host copy on the
        # optimizer's shard only; the gather runs on the device, so the copy comes to it and goes
        # back, or the next fetch reads the other shards' old values (ZeRO-Infinity, SC'21).
        if not gathers:
            return []
        to_device = transfer(OpKind.HOST_TO_DEVICE, P, "updated shard to the device for the gather")
        return [to_device, *gathers, transfer(OpKind.DEVICE_TO_HOST, P, "refreshed replica back to the host")]
    # The host-updated shard comes back first, then replicas are refreshed from it (ZeRO-Offload);
    # gathering first would spread the shards' old values (found by the simulator).
    if pl.local_mode(O, g) is Mode.OFFLOADED:
        return [transfer(OpKind.HOST_TO_DEVICE, O, "updated parameters back from the host"), *gathers]
    return gathers


class _ActivationOps:
    """Collectives on activations (per layer, per micro-batch), from the activation placement.

    Which ones: the axis kinds' exchange table (``formal._axes``, read for this placement by
    ``formal._exchanges.program_exchanges``); here only their sizes and counts. Like the first-
    and last-stage parameter groups' ops, the activation ops are a union over pipeline stages:
    the per-layer ones run on every stage, ``count`` = the fullest stage's layers x m (x2 in
    backward for a layer exchange full recomputation replays); the vocabulary-parallel
    embedding's (``A.embedding_io``) on the first stage only and the head's (``A.output_io``,
    and the cross-entropy's statistics, ``A.logits``, three a micro-batch) on the last only,
    ``count`` = m (once per micro-batch); a pipeline send once per micro-batch
    per boundary crossing the schedule makes. ``communication(program, precision, stage)``
    gives one device of a stage its own (``formal._costs.op_stage_factor``); without ``stage``
    it sums the union, as the simulator's per-op cost check reads it.
    """

    def __init__(self, pl: Placement, model: Model, m: Num) -> None:
        self.pl, self.model, self.m = pl, model, m

    def _tensor(self, group: Group, skip: Axis, per_token: Num) -> Num:
        """Elements of one activation tensor of one micro-batch on one device (bsh-sized)."""
        assert isinstance(self.model, Transformer)
        out: Num = self.model.seq * self.model.micro_batch * per_token
        for axis, d in self.pl.mesh:
            if axis == skip or axis.kind.is_pipeline or axis.kind.splits_batch:
                continue  # b is already one replica's micro-batch; pp splits layers, not tensors
            out = out * axis_factor(self.pl.entry(A, group, axis), d)
        return exact(out)

    def _width(self, width: Width) -> Num:
        assert isinstance(self.model, Transformer)
        match width:
            case Width.HIDDEN:
                return self.model.hidden
            case Width.KEYS_VALUES:
                return 2 * self.model.kv_heads_ * self.model.head_dim
            case Width.ROUTED:
                return self.model.hidden * max(self.model.top_k, 1)
            case Width.TOKEN:
                return 1
            case _:
                raise AssertionError(width)

    def _count(self, exchange: Exchange) -> Num:
        assert isinstance(self.model, Transformer)
        if exchange.per_boundary:
            options = self.pl.options
            return self.m * options.pipeline_schedule.boundary_sends(options.chunks)
        if not exchange.per_layer:
            return exchange.calls * self.m
        count = exchange.per_layer * self.pl.stage_layers(self.model.layers) * self.m
        again = exchange.phase is Phase.BACKWARD and self.pl.options.recompute is Recompute.FULL
        return 2 * count if exchange.replayed and again else count

    def _op(self, axis: Axis, e: Exchange) -> Op:
        elements = self._tensor(exchanged_group(self.pl, axis, e), axis, self._width(e.width))
        how = Reduce.SUM if e.kind.is_reduction else None
        return Op(e.kind, A, e.group, axis, e.phase, elements, self._count(e), how, note=e.note)

    def forward(self) -> list[Op]:
        return [self._op(a, e) for a, e in program_exchanges(self.pl, self.model, Phase.FORWARD)]

    def backward(self) -> list[Op]:
        return [self._op(a, e) for a, e in program_exchanges(self.pl, self.model, Phase.BACKWARD)]


__all__ = [
    "EMBEDDING",
    "EXPERTS",
    "Op",
    "Origin",
    "SEQUENCE_REGION_GROUPS",
    "StepProgram",
    "derive_program",
    "gradient_origins",
    "group_sizes",
    "refuse_unmodelled_ops",
    "rescatters",
    "scatter_axes",
    "shard_elements",
]
