"""The simulated device mesh, and which elements of each group every device holds and reads.

``_Mesh`` numbers the devices of a placement's mesh and finds a device's peers along an axis;
``_Layout`` says which flat positions of a group a device holds of each state (structural splits:
pipeline stage and TP slice, then flat shards along the other sharded axes) and which its
computation reads; ``_Geometry`` is how the batch, the sequence and the vocabulary divide over
the mesh, checked once against the reference model.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from formal._axes import nesting_order
from formal._placement import Entry, Placement
from formal._reference import Array, IndexArray, ReferenceModel
from formal._vocab import FIRST_STAGE_GROUPS, LAST_STAGE_GROUPS, LAYER_IO, Axis, Group, Mode, Stage, State
from formal.errors import SimulationError

A = State.ACTIVATIONS
Device = int
PerDevice = dict[Device, Array]


class _Mesh:
    def __init__(self, pl: Placement) -> None:
        self.axes: tuple[Axis, ...] = tuple(a for a, _ in pl.mesh)
        self.degrees: dict[Axis, int] = {a: int(d) for a, d in pl.mesh}
        shape = [self.degrees[a] for a in self.axes]
        self.coords: list[dict[Axis, int]] = [
            dict(zip(self.axes, c, strict=True)) for c in itertools.product(*[range(n) for n in shape])
        ]
        self.devices = range(len(self.coords))
        self._index = {tuple(c[a] for a in self.axes): i for i, c in enumerate(self.coords)}

    def degree(self, axis: Axis) -> int:
        return self.degrees.get(axis, 1)

    def coord(self, dev: Device, axis: Axis) -> int:
        return self.coords[dev].get(axis, 0)

    def moved(self, dev: Device, axis: Axis, value: int) -> Device:
        c = dict(self.coords[dev])
        c[axis] = value
        return self._index[tuple(c[a] for a in self.axes)]

    def peers(self, dev: Device, axis: Axis) -> list[Device]:
        """The devices of ``dev``'s group along ``axis``, by coordinate (just ``dev`` if absent)."""
        if axis not in self.degrees:
            return [dev]
        return [self.moved(dev, axis, k) for k in range(self.degrees[axis])]

    def groups(self, axis: Axis, devices: Iterable[Device]) -> list[list[Device]]:
        seen: set[Device] = set()
        out = []
        for d in devices:
            if d in seen:
                continue
            grp = self.peers(d, axis)
            seen.update(grp)
            out.append(grp)
        return out

    def stage_devices(self, stage: int) -> list[Device]:
        """The devices of one pipeline stage (every device without a pipeline axis)."""
        return [d for d in self.devices if self.coord(d, Axis.PP) == stage]

    def text(self, dev: Device) -> str:
        return ",".join(f"{a.value}={self.coords[dev][a]}" for a in self.axes) or "single"


def _chunk(positions: IndexArray, d: int, k: int) -> IndexArray:
    n = len(positions)
    if n % d:
        raise SimulationError(f"{n} elements do not split evenly into {d} shards")
    size = n // d
    return positions[k * size : (k + 1) * size]


class _Layout:
    """Which flat positions of each group a device holds, reads and reduces."""

    def __init__(self, model: ReferenceModel, pl: Placement, mesh: _Mesh) -> None:
        self.model, self.pl, self.mesh = model, pl, mesh
        self.p = mesh.degree(Axis.PP)
        self.v = pl.options.virtual_stages
        if self.p == 1:
            self.v = 1
        if model.layers % (self.p * self.v):
            raise SimulationError(f"layers={model.layers} do not split into pp({self.p}) x chunks({self.v}) stages")
        per = model.layers // (self.p * self.v)
        self.chunk_layers = [list(range(c * per, (c + 1) * per)) for c in range(self.p * self.v)]
        self._cache: dict[tuple[object, ...], IndexArray] = {}
        self._masks: dict[tuple[object, ...], npt.NDArray[np.bool_]] = {}

    def chunk_stage(self, chunk: int) -> int:
        return chunk % self.p

    def stage_layers(self, stage: int) -> list[int]:
        return [layer for c, ls in enumerate(self.chunk_layers) if self.chunk_stage(c) == stage for layer in ls]

    def stage_name(self, stage: int) -> Stage:
        return Stage.of(stage, self.p)

    def _positions(self, group: Group, layers: list[int] | None, tp: tuple[int, int] | None) -> IndexArray:
        parts = []
        for t in self.model.tensors(group):
            index = t.index
            if layers is not None:
                index = index[layers]
            if tp is not None and t.tp_dim is not None:
                rank, deg = tp
                dim = t.tp_dim + (1 if self.model.is_layered(group) else 0)
                n = index.shape[dim]
                if n % deg:
                    raise SimulationError(f"{group.name}.{t.name}: {n} rows/columns do not split into tp({deg})")
                index = np.take(index, range(rank * n // deg, (rank + 1) * n // deg), axis=dim)
            parts.append(index.ravel())
        return np.sort(np.concatenate(parts))

    def _stage_restrict(self, group: Group, stage: int, mode: Mode | None) -> list[int] | bool | None:
        """Layers (layered groups), True (all of a non-layered group) or False (none) on a stage.

        ``mode`` None: where the computation uses the group; otherwise where that pp mode holds it.
        """
        layered = self.model.is_layered(group)
        if mode is Mode.REPLICATED:
            if layered:
                return None
            return self.p == 1 or stage in (0, self.p - 1)
        if layered:
            return self.stage_layers(stage)
        if group in FIRST_STAGE_GROUPS:
            used = stage == 0 or (mode is None and group in self.pl.tied and stage == self.p - 1)
            return used
        if group in LAST_STAGE_GROUPS:
            return stage == self.p - 1
        raise SimulationError(f"{group.name}: no pipeline stage known for this group")

    def _structural(self, group: Group, dev: Device, pp_mode: Mode | None, tp_split: bool) -> IndexArray:
        stage = self.mesh.coord(dev, Axis.PP)
        where = self._stage_restrict(group, stage, pp_mode)
        if where is False:
            return np.zeros(0, dtype=np.intp)
        layers = where if isinstance(where, list) else None
        if not self.model.is_layered(group):
            layers = None
        tp = (self.mesh.coord(dev, Axis.TP), self.mesh.degree(Axis.TP)) if tp_split else None
        return self._positions(group, layers, tp)

    def compute(self, group: Group, dev: Device) -> IndexArray:
        """Positions a device's computation reads (and produces gradients for)."""
        key: tuple[object, ...] = ("compute", group, dev)
        if key not in self._cache:
            split = any(a.kind.splits_matrices and self.pl.computes_sharded(a, group) for a in self.mesh.degrees)
            pos = self._structural(group, dev, None, split)
            if self._expert_split(group):  # the rank's own experts: a flat shard of the expert-major group
                pos = _chunk(pos, self.mesh.degree(Axis.EP), self.mesh.coord(dev, Axis.EP))
            self._cache[key] = pos
        return self._cache[key]

    def _expert_split(self, group: Group) -> bool:
        return any(a.kind.places_experts and self.pl.computes_sharded(a, group) for a in self.mesh.degrees)

    def holding(
        self,
        state: State,
        group: Group,
        dev: Device,
        skip: Axis | Iterable[Axis] | None = None,
        offsets: dict[Axis, int] | None = None,
        force: Axis | Iterable[Axis] | None = None,
    ) -> IndexArray:
        """Positions a device holds of (state, group) by its placement (the axes ``skip`` ignored:
        the union of what the devices along them hold).

        Structural splits first (pipeline stage, TP rows/columns of compute-sharded groups), then
        flat shards along every other sharded axis (and along the ``force`` axes, as if sharded
        there: the partition reduce-scatters onto the optimizer's shard cut), dpr first, then in mesh order:
        the replicate axis is the outer one, as in PyTorch's HSDP mesh ("replicate", "shard") and
        DeepSpeed's node-major ranks. Shard ``k`` along an axis lives on coordinate
        ``(k + offset) mod d``.
        """
        skipped = frozenset({skip} if isinstance(skip, Axis) else skip or ())
        forced = frozenset({force} if isinstance(force, Axis) else force or ())
        key: tuple[object, ...] = ("hold", state, group, dev, skipped, tuple(sorted((offsets or {}).items())), forced)
        if key in self._cache:
            return self._cache[key]
        pl = self.pl
        entries: dict[Axis, Entry] = {a: pl.entry(state, group, a) for a in self.mesh.axes}
        if state in (State.PARAMETERS, State.OPTIMIZER) and any(e.mode is Mode.MATERIALIZED for e in entries.values()):
            # Parameters or optimizer state materialized (M) along an axis: nothing holds them
            # between uses ("Modes" in docs/semantics.md; the memory model charges 0), and nothing
            # recomputes them, so a use reads zeros. (Offloaded along an axis, O, they live on the
            # host: ``_States.offloaded``. A materialized gradient is the backward's, consumed
            # within the step.)
            empty = np.zeros(0, dtype=np.intp)
            self._cache[key] = empty
            return empty
        # Ignoring an axis that splits the group by structure (pipeline stages, tp slices) while
        # flat shards cut it along other axes is the union over its coordinates of what they
        # hold: each stage's (slice's) own flat shards, as a gather along it assembles them.
        structural_skipped = [
            a
            for a in self.mesh.axes
            if a in skipped
            and self.mesh.degree(a) > 1
            and entries[a].mode.is_sharded
            and (a.kind.is_pipeline or (a.kind.splits_matrices and pl.computes_sharded(a, group)))
        ]
        if structural_skipped and any(
            self.mesh.degree(a) > 1 and a not in skipped and (entries[a].mode.is_sharded or a in forced)
            for a in self.mesh.axes
            if not a.kind.is_pipeline and not (a.kind.splits_matrices and pl.computes_sharded(a, group))
        ):
            peers = [dev]
            for a in structural_skipped:
                peers = [self.mesh.moved(p, a, c) for p in peers for c in range(self.mesh.degree(a))]
            rest = skipped - set(structural_skipped)
            pos = np.unique(np.concatenate([self.holding(state, group, p, rest, offsets, forced) for p in peers]))
            self._cache[key] = pos
            return pos
        pp_mode = Mode.REPLICATED  # no pipeline axis, or ignored: every stage's share
        pipe = next((a for a in entries if a.kind.is_pipeline), None)
        if pipe is not None and pipe not in skipped and entries[pipe].mode.is_sharded:
            pp_mode = Mode.SHARDED
        tp = next((a for a in entries if a.kind.splits_matrices), None)
        tp_split = (
            tp is not None and tp not in skipped and entries[tp].mode.is_sharded and pl.computes_sharded(tp, group)
        )
        # Along ep a group computed split there (the experts) is cut first, into whole experts;
        # the other axes shard what the rank computes (Megatron-LM's expert data parallelism).
        flat = [
            a
            for a in nesting_order(self.mesh.axes, self._expert_split(group))
            if not a.kind.is_pipeline
            and (entries[a].mode.is_sharded or a in forced)
            and not (a.kind.splits_matrices and tp_split)
        ]
        split = [a for a in flat if self.mesh.degree(a) > 1]
        union = [a for a in split if a in skipped] if len(split) > 1 else []
        if union:  # several flat axes nest: ignoring one is the union over its coordinates
            rest = skipped - set(union)
            peers = [dev]
            for a in union:
                peers = [self.mesh.moved(p, a, c) for p in peers for c in range(self.mesh.degree(a))]
            pos = np.unique(np.concatenate([self.holding(state, group, p, rest, offsets, forced) for p in peers]))
            self._cache[key] = pos
            return pos
        pos = self._structural(group, dev, pp_mode, tp_split)
        for axis in flat:
            if axis in skipped:
                continue
            d = self.mesh.degree(axis)
            offset = (offsets or {}).get(axis, entries[axis].offset)
            pos = _chunk(pos, d, (self.mesh.coord(dev, axis) - offset) % d)
        self._cache[key] = pos
        return pos

    def mask(
        self, state: State | None, group: Group, dev: Device, skip: Axis | Iterable[Axis] | None = None
    ) -> npt.NDArray[np.bool_]:
        """``holding`` (or ``compute`` when ``state`` is None) as a boolean mask over the group."""
        key: tuple[object, ...] = (
            "mask",
            state,
            group,
            dev,
            frozenset({skip} if isinstance(skip, Axis) else skip or ()),
        )
        if key not in self._masks:
            keep = np.zeros(self.model.size(group), dtype=bool)
            keep[self.compute(group, dev) if state is None else self.holding(state, group, dev, skip)] = True
            self._masks[key] = keep
        return self._masks[key]

    def structural_axes(self, state: State, group: Group) -> list[Axis]:
        """Sharded axes that split the group by structure: pipeline stages and TP slices."""
        return [
            a
            for a in self.mesh.axes
            if self.pl.entry(state, group, a).mode.is_sharded
            and (a.kind.is_pipeline or (a.kind.splits_matrices and self.pl.computes_sharded(a, group)))
        ]

    def sharded_axes(self, state: State, group: Group) -> list[Axis]:
        return [
            a
            for a in self.mesh.axes
            if self.pl.entry(state, group, a).mode.is_sharded
            and not a.kind.is_pipeline
            and not (a.kind.splits_matrices and self.pl.computes_sharded(a, group))
        ]


@dataclass(frozen=True)
class _Geometry:
    """How the batch, the sequence and the vocabulary divide over the mesh."""

    m: int  # micro-batches per step
    t: int  # tp degree
    cp: int  # cp degree
    sp: bool  # sequence parallelism: the layer inputs are split along the sequence across tp
    data_axes: tuple[Axis, ...]  # the axes that give each replica its own sequences
    replicas: int  # product of the data axes' degrees
    s_chunk: int  # positions of the sequence one cp rank covers
    # Data axes (dp, dpr, cp) along which the activations are replicated: the data assignment of
    # the placement puts every rank there on the same samples (cp: the same tokens), those of
    # coordinate 0 (formal._rules, data_assignment).
    same_data: frozenset[Axis] = frozenset()

    @classmethod
    def of(cls, model: ReferenceModel, pl: Placement, mesh: _Mesh) -> _Geometry:
        """The split of ``model``'s batch and dimensions; raises where they do not divide."""
        t = mesh.degree(Axis.TP)
        cp = mesh.degree(Axis.CP)
        sp = (A, LAYER_IO) in set(pl.keys()) and t > 1 and pl.mode(A, LAYER_IO, Axis.TP).is_sharded
        # Expert parallelism splits the batch too: each ep rank routes its own tokens.
        data_axes = tuple(a for a in mesh.axes if a.kind.splits_batch)
        replicas = int(np.prod([mesh.degree(a) for a in data_axes])) if data_axes else 1
        s_chunk = model.seq // cp if model.seq % cp == 0 else 0
        if not s_chunk or (sp and s_chunk % t):
            raise SimulationError(
                f"seq={model.seq} does not split into cp({cp})" + (f" x tp({t}) sequence shards" if sp else "")
            )
        if model.vocab % t or model.hidden % t or model.ffn % t:
            raise SimulationError(f"vocab, hidden and ffn must divide by tp({t})")
        same = frozenset(
            a
            for a in data_axes + ((Axis.CP,) if cp > 1 else ())
            if any(not pl.mode(A, g, a).is_sharded for g in pl.groups(A))
        )
        return cls(pl.options.micro_batches, t, cp, sp, data_axes, replicas, s_chunk, same)
