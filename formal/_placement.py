"""Placements: the mode of every tensor group of every state along every mesh axis.

A ``Strategy`` is one axis's placement (plus what the computation along that axis splits); a
``Composition`` is strategies on distinct axes plus axis-free modifiers (recomputation,
offload, pipeline schedule). ``Composition.placement(model)`` produces the one ``Placement``
that the step program, the cost model, the z3 encoding, the simulator and the reports read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from formal import _num as num
from formal._num import Num
from formal._scalars import ScalarSettings
from formal._schedules import DEFAULT_SCHEDULE, PipelineSchedule, Schedule, schedule_of
from formal._vocab import (
    LAYER_GROUPS,
    PARAMETER_GROUPS,
    Axis,
    AxisKind,
    Group,
    Mode,
    State,
)

Key = tuple[State, Group]


@dataclass(frozen=True)
class Entry:
    """The placement of one state group along one axis.

    ``offset``: shard ``k`` of the state lives on axis coordinate ``(k + offset) mod d``; P, O
    and G of one group must agree on it (alignment). ``keep_gathered``: an ``S*`` state that
    is gathered once per micro-batch and held through backward (FSDP shard-grad-op,
    ``reshard_after_forward=False``) instead of gathered for each use.
    """

    mode: Mode
    offset: int = 0
    keep_gathered: bool = False

    def __str__(self) -> str:
        extra = ""
        if self.offset:
            extra += f"@{self.offset}"
        if self.keep_gathered:
            extra += "+hold"
        return f"{self.mode.value}{extra}"


R = Entry(Mode.REPLICATED)
S = Entry(Mode.SHARDED)
SG = Entry(Mode.SHARDED_GATHER)


class Recompute(StrEnum):
    """Activation recomputation (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


@dataclass(frozen=True)
class Strategy:
    """One axis's placement.

    ``entries`` maps (state, group) to an ``Entry``; a ``None`` group is the default for that
    state. ``compute_sharded``: groups whose computation is itself split along the axis (TP's
    matrices, PP's layers, EP's experts), so a sharded copy is used locally without a gather.
    """

    name: str
    axis: Axis
    degree: int | None
    entries: tuple[tuple[tuple[State, Group | None], Entry], ...]
    compute_sharded: frozenset[Group] | None = frozenset()  # None: every group (PP)
    description: str = field(default="", compare=False)
    source: str = field(default="", compare=False)

    def entry(self, state: State, group: Group) -> Entry:
        table = dict(self.entries)
        if (state, group) in table:
            return table[(state, group)]
        if (state, None) in table:
            return table[(state, None)]
        return R

    def computes_sharded(self, group: Group) -> bool:
        return self.compute_sharded is None or group in self.compute_sharded

    def problem(self) -> str | None:
        """Why the model cannot represent this strategy, or None: a gradient materialized (``M``)
        along the axis (the backward produces every gradient and the update reads it: nothing
        could recompute it, and no framework drops it), or a pipeline whose stages do not own their
        layers (``pipeline_problem``)."""
        for (state, group), entry in self.entries:
            if state is State.GRADIENTS and entry.mode is Mode.MATERIALIZED:
                where = "" if group is None else f" ({group.name})"
                return f"G = 'M'{where}: a gradient cannot be materialized along an axis (hold it R or S)"
        return self.pipeline_problem() or self.split_offset_problem()

    def split_offset_problem(self) -> str | None:
        """An offset (``@k``) on a state of a group whose computation the axis splits (tp's
        matrices, ep's experts): there a rank's shard is its own slice (Megatron-LM's column- and
        row-parallel weights, GShard's experts), and a shifted assignment, rank ``k + i`` holding
        rank ``i``'s slice, is not a layout the model represents (the simulator places slices
        by structure, without offsets)."""
        if not (self.axis.kind.splits_matrices or self.axis.kind.places_experts):
            return None
        for state in (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS):
            for group in PARAMETER_GROUPS:
                entry = self.entry(state, group)
                if entry.offset and entry.mode.is_sharded and self.computes_sharded(group):
                    return (
                        f"{state.value}.{group.name} = {str(entry)!r} along {self.axis.value}, where {group.name} is "
                        "computed split: each rank's shard is its own slice, so an offset is not modelled"
                    )
        return None

    def pipeline_problem(self) -> str | None:
        """Why this strategy, along a pipeline axis, is not a pipeline the model represents, or
        None. Pipeline stages own their layers (GPipe, Huang et al. 2019; Megatron-LM's and
        torchtitan's stages): every group's computation is split by stage, and the layers' P, O
        and G are sharded by stage, stage k holding layers of chunk k (``S``, no offset). A stage
        holding other stages' layers (``R``, ``S*``), nothing (``M``), or a shifted assignment
        is not modelled. Groups outside the layers (embedding, head, final norm) may be ``R``
        (held by the first and the last stage, the tied embedding's placement) or ``S``."""
        if not self.axis.kind.is_pipeline:
            return None
        if self.compute_sharded is not None:
            return 'along a pipeline axis every group is computed split by stage (compute_sharded = "all")'
        # Every state's effective entry for every layer group (a state the strategy does not
        # name is replicated), and the entries it names for the other groups.
        checked: list[tuple[tuple[State, Group | None], Entry]] = [
            ((state, g), self.entry(state, g))
            for state in (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS)
            for g in sorted(LAYER_GROUPS)
        ]
        checked += [((state, g), e) for (state, g), e in self.entries if state is not State.ACTIVATIONS]
        for (state, group), entry in checked:
            layers = group is None or group in LAYER_GROUPS
            allowed = (Mode.SHARDED,) if layers else (Mode.SHARDED, Mode.REPLICATED)
            if entry.mode not in allowed or entry.offset or entry.keep_gathered:
                what = "the layers'" if layers or group is None else f"{group.name}'s"
                return (
                    f"{state.value} = {str(entry)!r} along a pipeline axis: {what} {state.long_name} must be "
                    f"{' or '.join(repr(m.value) for m in allowed)} (each stage holds its own layers)"
                )
        return None

    def with_degree(self, degree: int | None) -> Strategy:
        return Strategy(self.name, self.axis, degree, self.entries, self.compute_sharded, self.description, self.source)

    def with_entry(self, state: State, group: Group | None, entry: Entry) -> Strategy:
        table = dict(self.entries)
        table[(state, group)] = entry
        return Strategy(
            self.name, self.axis, self.degree, tuple(table.items()), self.compute_sharded, self.description, self.source
        )

    def __str__(self) -> str:
        return self.name if self.degree is None else f"{self.name}{self.degree}"


@dataclass(frozen=True)
class Options:
    """Axis-free choices of a composition: modifiers in the composition language."""

    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    offload_optimizer: bool = False
    offload_parameters: bool = False
    schedule: Schedule = DEFAULT_SCHEDULE
    chunks: int = 1  # virtual stages per device (interleaved schedule)
    micro_batches: int = 1  # per step per data-parallel replica (pipeline or accumulation)
    uneven_stages: bool = False  # declared uneven pipeline stages: layers need not divide by pp
    # ``flash``: the attention is one fused kernel (FlashAttention, Dao et al. 2022): the same
    # placement as selective recomputation (so not part of the options' equality), but the
    # scores are never materialised, not even when recomputed in backward (read by the engine
    # terms only).
    fused_attention: bool = field(default=False, compare=False)
    scalars: ScalarSettings = ScalarSettings()  # noqa: RUF009 (frozen) clipping, per-token loss, loss scaling

    @property
    def pipeline_schedule(self) -> PipelineSchedule:
        """The schedule's object (``formal._schedules``): its memory, bubble, sends and spellings."""
        return schedule_of(self.schedule)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per device: ``chunks`` under a chunked (interleaved) schedule, else 1."""
        return self.pipeline_schedule.virtual_stages(self.chunks)


@dataclass(frozen=True)
class Placement:
    """The plan every downstream module reads. Nothing downstream re-derives a placement.

    ``mesh``: axis to degree (ints, or sympy symbols for symbolic derivations).
    ``modes``: (state, group) to axis to Entry, for every group the model has.
    ``local``: axis-free modes (``M`` recomputation, ``O`` offload) per (state, group).
    ``compute_sharded``: per axis, the groups whose computation is split along it.
    ``tied``: groups used on two pipeline stages (tied embeddings).
    ``layer_share``: the fraction of the transformer layers the fullest pipeline stage holds
    when uneven stages are declared (ceil(L/p)/L, Megatron-LM / Llama 3 layout); ``None``
    means the layers split evenly (1/p).
    """

    mesh: tuple[tuple[Axis, Num], ...]
    modes: tuple[tuple[Key, tuple[tuple[Axis, Entry], ...]], ...]
    local: tuple[tuple[Key, Mode], ...]
    compute_sharded: tuple[tuple[Axis, frozenset[Group]], ...]
    options: Options
    tied: frozenset[Group] = frozenset()
    user_program: bool = False  # the step program is given, not derived (user TOML)
    layer_share: Num | None = None

    def stage_layers(self, layers: int) -> Num:
        """Transformer layers on the fullest pipeline stage: L/p, or ceil(L/p) when uneven."""
        if self.layer_share is None:
            return num.ratio(layers, self.pipeline_degree)
        return num.canonical(layers * self.layer_share)

    @property
    def pipelined(self) -> bool:
        """Whether the mesh has a pipeline axis (of any degree)."""
        return any(a.kind.is_pipeline for a in self.axes)

    @property
    def pipeline_degree(self) -> Num:
        """Pipeline stages (the pipeline axis' degree; 1 without one)."""
        return self.degree_where(lambda kind: kind.is_pipeline)

    def degree_where(self, test: Callable[[AxisKind], bool]) -> Num:
        """The product of the degrees of the axes whose kind passes ``test`` (1 if none does)."""
        out: Num = 1
        for axis, d in self.mesh:
            if test(axis.kind):
                out = out * d
        return out

    def axis_where(self, test: Callable[[AxisKind], bool]) -> Axis | None:
        """The first axis of the mesh whose kind passes ``test``, or None."""
        return next((a for a in self.axes if test(a.kind)), None)

    @property
    def axes(self) -> tuple[Axis, ...]:
        return tuple(a for a, _ in self.mesh)

    def degree(self, axis: Axis) -> Num:
        return dict(self.mesh).get(axis, 1)

    def keys(self) -> Iterator[Key]:
        for key, _ in self.modes:
            yield key

    def groups(self, state: State) -> tuple[Group, ...]:
        return tuple(g for (st, g) in self.keys() if st is state)

    @cached_property
    def _rows(self) -> dict[Key, dict[Axis, Entry]]:
        """``modes`` as nested dicts, built once per placement (the costs and the z3 encoding
        read entries thousands of times per check)."""
        return {key: dict(row) for key, row in self.modes}

    @cached_property
    def _local(self) -> dict[Key, Mode]:
        return dict(self.local)

    @cached_property
    def _compute(self) -> dict[Axis, frozenset[Group]]:
        return dict(self.compute_sharded)

    def entry(self, state: State, group: Group, axis: Axis) -> Entry:
        return self._rows[(state, group)].get(axis, R)

    def mode(self, state: State, group: Group, axis: Axis) -> Mode:
        return self.entry(state, group, axis).mode

    def local_mode(self, state: State, group: Group) -> Mode | None:
        return self._local.get((state, group))

    def computes_sharded(self, axis: Axis, group: Group) -> bool:
        return group in self._compute.get(axis, frozenset())

    def table(self) -> dict[str, dict[str, str]]:
        """``{"P.attention": {"dp": "S*", "tp": "S"}, ...}`` for reports and JSON."""
        out: dict[str, dict[str, str]] = {}
        for (state, group), row in self.modes:
            cells = {axis.value: str(e) for axis, e in row}
            loc = self.local_mode(state, group)
            if loc is not None:
                cells["local"] = loc.value
            out[f"{state.value}.{group.name}"] = cells
        return out


__all__ = [
    "Entry",
    "Key",
    "Options",
    "Placement",
    "R",
    "Recompute",
    "S",
    "SG",
    "Schedule",
    "Strategy",
]
