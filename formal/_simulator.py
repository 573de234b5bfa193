"""A simulator of N devices that executes any step program on the reference model.

Every device holds numpy arrays for every state it holds (parameters, gradients, optimizer
state; a separate host store for offloaded states); collectives move real values between the
devices of a mesh axis. The program's ops decide what happens: a gather that is missing leaves
zeros (a freshly freed buffer) where the shard of another device should be, a reduction that is
missing leaves a partial sum, a duplicated sum doubles, a refresh that is skipped leaves a stale
replica. Nothing crashes on a wrong program: the values go wrong, and the first read that differs
from single-device training is reported (``Divergence``).

Semantics of a program, one training step (``StepProgram`` order within a phase):

1. per micro-batch, FORWARD: the FORWARD ops on parameters (gathers, host fetches) in program
   order; every device reads its parameters (checked against the reference: the ``COMPUTE``
   reads); the model's forward with the activation collectives the program lists; transient
   gathered copies are freed (unless held through backward: ``keep_gathered``);
2. BACKWARD: the same, then the backward; the gradient of the micro-batch is reduced by the
   GRAD_SYNC ops whose count is the number of micro-batches (reduce-scatter as produced, ZeRO-2/3
   under accumulation) and accumulated;
3. GRAD_SYNC: the remaining gradient ops (count 1) on the accumulated gradients, then gradients
   outside the device's holding are freed;
4. OPTIMIZER: every optimizer step reads P, O and G of its shard (checked) and writes P and O;
5. REFRESH: the refresh ops.

Reads are judged, not snapshots (docs/semantics.md, "State consistency"): the simulator runs one more step than
it trains, so every update is read again, and reports the first read that differs.

It also counts, per device, the bytes each op sends and how often, the bytes each state holds
between steps and on the host; ``SimulationResult.cost_mismatches`` compares them with
``formal._costs`` for the same program (the most loaded device per op; each stage's memory).
The vocabulary-parallel embedding's and head's collectives are ops of the program
(``A.embedding_io``, ``A.output_io``) like every other exchange: a program without them diverges.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import numpy.typing as npt
import sympy as sp

from formal._costs import communication, host_memory, state_memory, transfers
from formal._exact import exact_fraction
from formal._model import DEFAULT_PRECISION, Precision
from formal._placement import Entry, Placement, Recompute
from formal._program import Op, StepProgram, derive_program, group_sizes
from formal._reference import (
    FLOAT_TOLERANCE,
    Arithmetic,
    Array,
    Batch,
    IndexArray,
    Numbers,
    Optimizer,
    ReferenceModel,
    StepRecord,
    initial_parameters,
    make_data,
    train_single_device,
)
from formal._strategies import Composition
from formal._vocab import (
    ATTENTION,
    EMBEDDING,
    EMBEDDING_IO,
    FINAL_NORM,
    FIRST_STAGE_GROUPS,
    HEAD,
    LAST_STAGE_GROUPS,
    LAYER_IO,
    LINEAR_INNER,
    MLP,
    NORM,
    OUTPUT_IO,
    Axis,
    Group,
    Mode,
    OpKind,
    Phase,
    Reduce,
    Stage,
    State,
)
from formal.errors import SimulationError

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741
Device = int
PerDevice = dict[Device, Array]
_Saved = dict[Device, tuple[Array, ...]]


@dataclass(frozen=True)
class Divergence:
    """The first read that differs from single-device training."""

    step: int
    phase: str
    micro_batch: int | None
    state: State
    group: Group
    device: Device
    coordinates: str  # "dp=1,tp=0"
    position: int
    element: str  # "layer 1 qkv[3, 0, 5]"
    expected: str
    got: str
    exact: bool  # bit-for-bit comparison (else within the float tolerance)

    def __str__(self) -> str:
        mb = f", micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        return (f"step {self.step} {self.phase}{mb}: {self.state.value}.{self.group.name} {self.element} "
                f"on device {self.device} ({self.coordinates}): expected {self.expected}, got {self.got}")

    def as_json(self) -> dict[str, object]:
        return {"step": self.step, "phase": self.phase, "micro_batch": self.micro_batch,
                "state": self.state.value, "group": self.group.name, "device": self.device,
                "coordinates": self.coordinates, "position": self.position, "element": self.element,
                "expected": self.expected, "got": self.got,
                "comparison": "bit-for-bit" if self.exact else "tolerance"}


@dataclass(frozen=True)
class OpTraffic:
    """What the simulator measured for one op of the program, on its most loaded device."""

    index: int
    op: str
    calls: int  # per step
    elements: int | None  # per call (None: never called)
    bytes: Fraction  # per device per step (collectives: ring algorithm; transfers: the tensor)
    expected_bytes: Fraction | None  # the cost model's figure


@dataclass(frozen=True)
class SimulationResult:
    matches: bool
    divergence: Divergence | None
    steps: int
    devices: int
    arithmetic: Arithmetic
    traffic: tuple[OpTraffic, ...]
    memory: tuple[tuple[str, State, int, int], ...]  # (stage, state, simulated bytes, cost-model bytes)
    host: tuple[tuple[str, int, int], ...]  # (stage, simulated host bytes, cost-model host bytes)
    complete: bool  # ran every step (False when it stopped at the divergence)

    @property
    def cost_mismatches(self) -> tuple[str, ...]:
        """Every measured figure that differs from the cost model (empty: they agree)."""
        if not self.complete:
            return ()
        out = [f"op {t.index} {t.op}: simulated {t.bytes} bytes/step, cost model {t.expected_bytes}"
               for t in self.traffic if t.expected_bytes is not None and t.bytes != t.expected_bytes]
        out += [f"{stage} {state.value}: simulated {sim} bytes, cost model {cost}"
                for stage, state, sim, cost in self.memory if sim != cost]
        out += [f"{stage} host: simulated {sim} bytes, cost model {cost}" for stage, sim, cost in self.host
                if sim != cost]
        return tuple(out)

    def as_json(self) -> dict[str, object]:
        return {
            "matches": self.matches, "steps": self.steps, "devices": self.devices,
            "arithmetic": self.arithmetic.value,
            "comparison": "bit-for-bit" if self.arithmetic is Arithmetic.FIELD else
            f"relative tolerance {FLOAT_TOLERANCE}",
            "divergence": None if self.divergence is None else self.divergence.as_json(),
            "cost_model_agrees": not self.cost_mismatches if self.complete else None,
            "cost_mismatches": list(self.cost_mismatches),
        }


# --- the mesh and where each device's elements are -------------------------------------------

class _Mesh:
    def __init__(self, pl: Placement) -> None:
        self.axes: tuple[Axis, ...] = tuple(a for a, _ in pl.mesh)
        self.degrees: dict[Axis, int] = {a: int(d) for a, d in pl.mesh}
        shape = [self.degrees[a] for a in self.axes]
        self.coords: list[dict[Axis, int]] = [dict(zip(self.axes, c, strict=True))
                                              for c in itertools.product(*[range(n) for n in shape])]
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

    def text(self, dev: Device) -> str:
        return ",".join(f"{a.value}={self.coords[dev][a]}" for a in self.axes) or "single"


def _chunk(positions: IndexArray, d: int, k: int) -> IndexArray:
    n = len(positions)
    if n % d:
        raise SimulationError(f"{n} elements do not split evenly into {d} shards")
    size = n // d
    return positions[k * size:(k + 1) * size]


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
            split = Axis.TP in self.mesh.degrees and self.pl.computes_sharded(Axis.TP, group)
            self._cache[key] = self._structural(group, dev, None, split)
        return self._cache[key]

    def holding(self, state: State, group: Group, dev: Device, skip: Axis | Iterable[Axis] | None = None,
                offsets: dict[Axis, int] | None = None, force: Axis | None = None) -> IndexArray:
        """Positions a device holds of (state, group) by its placement (the axes ``skip`` ignored:
        the union of what the devices along them hold).

        Structural splits first (pipeline stage, TP rows/columns of compute-sharded groups), then
        flat shards along every other sharded axis (and along ``force``, as if sharded there: the
        partition a reduce-scatter onto the optimizer's shard cuts), dpr first, then in mesh order:
        the replicate axis is the outer one, as in PyTorch's HSDP mesh ("replicate", "shard") and
        DeepSpeed's node-major ranks. Shard ``k`` along an axis lives on coordinate
        ``(k + offset) mod d``.
        """
        skipped = frozenset({skip} if isinstance(skip, Axis) else skip or ())
        key: tuple[object, ...] = ("hold", state, group, dev, skipped, tuple(sorted((offsets or {}).items())), force)
        if key in self._cache:
            return self._cache[key]
        pl = self.pl
        entries: dict[Axis, Entry] = {a: pl.entry(state, group, a) for a in self.mesh.axes}
        pp_mode = Mode.REPLICATED  # no pipeline axis, or ignored: every stage's share
        if Axis.PP in entries and Axis.PP not in skipped and entries[Axis.PP].mode.is_sharded:
            pp_mode = Mode.SHARDED
        tp_split = (Axis.TP in entries and Axis.TP not in skipped and entries[Axis.TP].mode.is_sharded
                    and pl.computes_sharded(Axis.TP, group))
        flat = [a for a in sorted(self.mesh.axes, key=lambda a: a is not Axis.DPR)
                if a is not Axis.PP and (entries[a].mode.is_sharded or a is force) and not (a is Axis.TP and tp_split)]
        split = [a for a in flat if self.mesh.degree(a) > 1]
        union = [a for a in split if a in skipped] if len(split) > 1 else []
        if union:  # several flat axes nest: ignoring one is the union over its coordinates
            rest = skipped - set(union)
            peers = [dev]
            for a in union:
                peers = [self.mesh.moved(p, a, c) for p in peers for c in range(self.mesh.degree(a))]
            pos = np.unique(np.concatenate([self.holding(state, group, p, rest, offsets, force) for p in peers]))
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

    def mask(self, state: State | None, group: Group, dev: Device,
             skip: Axis | Iterable[Axis] | None = None) -> npt.NDArray[np.bool_]:
        """``holding`` (or ``compute`` when ``state`` is None) as a boolean mask over the group."""
        key: tuple[object, ...] = ("mask", state, group, dev,
                                   frozenset({skip} if isinstance(skip, Axis) else skip or ()))
        if key not in self._masks:
            keep = np.zeros(self.model.size(group), dtype=bool)
            keep[self.compute(group, dev) if state is None else self.holding(state, group, dev, skip)] = True
            self._masks[key] = keep
        return self._masks[key]

    def structural_axes(self, state: State, group: Group) -> list[Axis]:
        """Sharded axes that split the group by structure: pipeline stages and TP slices."""
        return [a for a in self.mesh.axes if self.pl.entry(state, group, a).mode.is_sharded
                and (a is Axis.PP or (a is Axis.TP and self.pl.computes_sharded(Axis.TP, group)))]

    def sharded_axes(self, state: State, group: Group) -> list[Axis]:
        return [a for a in self.mesh.axes if self.pl.entry(state, group, a).mode.is_sharded and a is not Axis.PP
                and not (a is Axis.TP and self.pl.computes_sharded(Axis.TP, group))]


# --- the simulator -----------------------------------------------------------------------------

class _Diverged(Exception):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


def _ring_share(kind: OpKind, n: int) -> Fraction:
    """Elements one device sends per element of the full tensor: a ring all-reduce is a
    reduce-scatter then an all-gather, each ``n-1`` steps of ``1/n`` of the tensor."""
    match kind:
        case OpKind.ALL_REDUCE:
            return Fraction(2 * (n - 1), n)
        case OpKind.REDUCE_SCATTER | OpKind.ALL_GATHER | OpKind.BROADCAST | OpKind.ALL_TO_ALL:
            return Fraction(n - 1, n)
        case OpKind.SEND_RECV:
            return Fraction(1)
        case _:
            raise AssertionError(kind)


@dataclass
class _Tally:
    calls: dict[Device, int] = field(default_factory=dict)
    bytes: dict[Device, Fraction] = field(default_factory=dict)
    elements: set[int] = field(default_factory=set)

    def add(self, dev: Device, elements: int, nbytes: Fraction) -> None:
        self.calls[dev] = self.calls.get(dev, 0) + 1
        self.bytes[dev] = self.bytes.get(dev, Fraction(0)) + nbytes
        self.elements.add(elements)


class Simulator:
    """Runs one step program on the reference model over a mesh, beside single-device training."""

    def __init__(self, program: StepProgram, model: ReferenceModel, optimizer: Optimizer, numbers: Numbers,
                 precision: Precision = DEFAULT_PRECISION) -> None:
        pl = program.placement
        self.program, self.model, self.optimizer, self.n, self.precision = program, model, optimizer, numbers, precision
        self.pl = pl
        optimizer.check(numbers)
        for axis, d in pl.mesh:
            if not isinstance(d, sp.Integer) and not isinstance(d, int):
                raise SimulationError(f"{axis.value}: symbolic degree {d}; the simulator needs numbers")
        self.mesh = _Mesh(pl)
        if self.mesh.degree(Axis.EP) > 1:
            raise SimulationError("ep: expert parallelism is not modelled (the reference model has no experts)")
        unknown = set(pl.groups(P)) - set(model.groups())
        if unknown:
            raise SimulationError(f"groups {sorted(g.name for g in unknown)} are not in the reference model")
        for axis in self.mesh.axes:
            split = any(pl.computes_sharded(axis, g) for g in model.groups())
            if axis is not Axis.TP and axis is not Axis.PP and split:
                raise SimulationError(f"{axis.value}: computation split along this axis is not modelled")
        self.layout = _Layout(model, pl, self.mesh)
        self.m = pl.options.micro_batches
        self.t = self.mesh.degree(Axis.TP)
        self.cp = self.mesh.degree(Axis.CP)
        self.sp = (A, LAYER_IO) in set(pl.keys()) and self.t > 1 and pl.mode(A, LAYER_IO, Axis.TP).is_sharded
        self.data_axes = [a for a in self.mesh.axes if a in (Axis.DP, Axis.DPR)]
        self.replicas = int(np.prod([self.mesh.degree(a) for a in self.data_axes])) if self.data_axes else 1
        s_chunk = model.seq // self.cp if model.seq % self.cp == 0 else 0
        if not s_chunk or (self.sp and s_chunk % self.t):
            raise SimulationError(f"seq={model.seq} does not split into cp({self.cp})"
                                  + (f" x tp({self.t}) sequence shards" if self.sp else ""))
        if model.vocab % self.t or model.hidden % self.t or model.ffn % self.t:
            raise SimulationError(f"vocab, hidden and ffn must divide by tp({self.t})")
        self.s_chunk = s_chunk
        self.ops = program.ops
        self.tally: dict[int, _Tally] = {i: _Tally() for i in range(len(self.ops))}
        self.act_ops: dict[tuple[OpKind, Group, Axis | None, Phase], list[int]] = {}
        for i, op in enumerate(self.ops):
            if op.state is A:
                self.act_ops.setdefault((op.kind, op.group, op.axis, op.phase), []).append(i)
        self.groups = tuple(pl.groups(P))
        self.offloaded = {st: {g for g in self.groups if pl.local_mode(st, g) is Mode.OFFLOADED} for st in (P, O, G)}
        # Collectives along several axes of one group act on what the earlier ones left: a gather
        # on the parameters made whole along the axes gathered since the last free (ZeRO++ hpZ:
        # within the node, then across nodes), a reduce-scatter on the gradient still whole along
        # the axes the program scatters it along later.
        self.gathered: dict[Group, set[Axis]] = {g: set() for g in self.groups}
        self.scattered: dict[tuple[bool, Group], set[Axis]] = {}
        self.scatter_axes: dict[Group, frozenset[Axis]] = {
            g: frozenset(op.axis for op in self.ops if op.group == g and op.state is G and op.axis is not None
                         and op.kind is OpKind.REDUCE_SCATTER) for g in self.groups}

    # ---- setup --------------------------------------------------------------------------
    def _init_states(self, p0: dict[Group, Array]) -> None:
        n, model = self.n, self.model
        self.P: dict[Device, dict[Group, Array]] = {}
        self.G: dict[Device, dict[Group, Array]] = {}
        self.fresh: dict[Device, dict[Group, Array]] = {}
        self.O: dict[Device, dict[Group, Array]] = {}
        self.host: dict[tuple[State, Device, Group], Array] = {}
        # Gradient positions holding a current value (a summand or a sum) in each buffer: what
        # an all-reduce acts on besides the placement's share (an all-reduce placed before a
        # reduce-scatter reduces the whole unsharded buffer, as an implementation would).
        self.live: dict[Device, dict[Group, npt.NDArray[np.bool_]]] = {}
        self.live_fresh: dict[Device, dict[Group, npt.NDArray[np.bool_]]] = {}
        for dev in self.mesh.devices:
            self.P[dev], self.G[dev], self.O[dev], self.fresh[dev] = {}, {}, {}, {}
            self.live[dev], self.live_fresh[dev] = {}, {}
            for g in self.groups:
                size = model.size(g)
                self.P[dev][g] = n.zeros(size)
                self.G[dev][g] = n.zeros(size)
                self.fresh[dev][g] = n.zeros(size)
                self.live[dev][g] = np.zeros(size, dtype=bool)
                self.live_fresh[dev][g] = np.zeros(size, dtype=bool)
                self.O[dev][g] = n.zeros((self.optimizer.slots, size))
                hold = self.layout.holding(P, g, dev)
                target = self.P[dev][g]
                if g in self.offloaded[P]:
                    target = self.host.setdefault((P, dev, g), n.zeros(size))
                target[hold] = p0[g][hold]
                if g in self.offloaded[O]:
                    self.host[(O, dev, g)] = n.zeros((self.optimizer.slots, size))
                    self.host[(G, dev, g)] = n.zeros(size)
                    if g not in self.offloaded[P]:  # the host keeps the master copy it updates
                        master = n.zeros(size)
                        o_hold = self.layout.holding(O, g, dev)
                        master[o_hold] = p0[g][o_hold]
                        self.host[(P, dev, g)] = master
                elif g in self.offloaded[G]:
                    self.host[(G, dev, g)] = n.zeros(size)

    # ---- checks -------------------------------------------------------------------------
    def _check(self, state: State, group: Group, dev: Device, positions: IndexArray, got: Array,
               expected: Array, phase: str, micro_batch: int | None) -> None:
        if not len(positions):
            return
        exact = self.n.kind is Arithmetic.FIELD
        ok = self.n.equal(expected, got, exact)
        if ok.all():
            return
        bad = np.argwhere(~ok)[0]
        col = int(bad[-1])
        pos = int(positions[col])
        exp_v = expected[tuple(bad)]
        got_v = got[tuple(bad)]
        element = self.model.locate(group, pos)
        if state is O and got.ndim == 2:
            element += f" slot {int(bad[0])}"
        raise _Diverged(Divergence(self.step, phase, micro_batch, state, group, dev, self.mesh.text(dev), pos,
                                   element, self.n.as_text(exp_v), self.n.as_text(got_v), exact))

    # ---- model-state ops ----------------------------------------------------------------
    def _array(self, state: State, dev: Device, g: Group, per_mb: bool) -> Array:
        match state:
            case State.PARAMETERS:
                return self.P[dev][g]
            case State.GRADIENTS:
                return self.fresh[dev][g] if per_mb else self.G[dev][g]
            case State.OPTIMIZER:
                return self.O[dev][g]
            case _:
                raise AssertionError(state)

    def _wire(self, state: State) -> int:
        return self.precision.wire_bytes_of(state)

    def _state_collective(self, index: int, op: Op, per_mb: bool) -> None:
        axis = op.axis
        if axis is None:
            raise SimulationError(f"{op}: a collective needs an axis")
        if axis not in self.mesh.degrees:
            return  # an axis of degree 1 that the mesh does not have: nothing to exchange
        n = self.n
        live = self.live_fresh if per_mb else self.live
        whole: frozenset[Axis] = frozenset()
        scattered = self.scattered.setdefault((per_mb, op.group), set())
        if op.state is P and op.kind is OpKind.ALL_GATHER:
            whole = frozenset(self.gathered[op.group] - {axis})
        elif op.state is G and op.kind is OpKind.REDUCE_SCATTER:
            whole = self.scatter_axes[op.group] - scattered - {axis}
        for peers in self.mesh.groups(axis, self.mesh.devices):
            bases = {d: self.layout.holding(op.state, op.group, d, skip=whole | {axis}) for d in peers}
            if op.state is G and op.kind is OpKind.ALL_REDUCE:
                bases = {d: np.flatnonzero(self.layout.mask(G, op.group, d, axis) | live[d][op.group]) for d in peers}
            members = [d for d in peers if len(bases[d])]
            if not members:
                continue
            arrays = {d: self._array(op.state, d, op.group, per_mb) for d in members}
            k = len(members)
            deg = self.mesh.degree(axis)
            share = _ring_share(op.kind, k)
            # Along an axis that splits the group by structure (TP rows/columns, pipeline stages)
            # a device's piece is its own slice, not a flat shard: offsets do not apply.
            # A tied embedding is whole on the first and the last stage: along pp its pieces are
            # flat shards between those two (the participants), as for any replicated group.
            tied = axis is Axis.PP and op.group in self.pl.tied
            structural = (axis is Axis.PP and not tied) or (
                axis is Axis.TP and self.pl.computes_sharded(Axis.TP, op.group))

            def piece_of(d: Device, structural: bool = structural, bases: dict[Device, IndexArray] = bases,
                         deg: int = deg, tied: bool = tied, members: list[Device] = members) -> IndexArray:
                if structural:
                    return np.intersect1d(bases[d], self.layout.compute(op.group, d))
                if tied:
                    return _chunk(bases[d], len(members), (members.index(d) - op.offset) % len(members))
                if whole:  # its shard along the axis, whole along the others made whole
                    return self.layout.holding(op.state, op.group, d, skip=whole, offsets={axis: op.offset},
                                               force=axis)
                return _chunk(bases[d], deg, (self.mesh.coord(d, axis) - op.offset) % deg)

            for d in members:
                self.tally[index].add(d, len(bases[d]), len(bases[d]) * self._wire(op.state) * share)
            match op.kind:
                case OpKind.ALL_REDUCE | OpKind.REDUCE_SCATTER:
                    first = bases[members[0]]
                    if all(bases[d] is first or np.array_equal(bases[d], first) for d in members):
                        union = first
                    else:
                        union = np.unique(np.concatenate([bases[d] for d in members]))
                    total = n.sum_of([arrays[d][..., union] for d in members])
                    if op.reduce is Reduce.MEAN:
                        total = n.scale(total, Fraction(1, k))
                    for d in members:
                        if op.kind is OpKind.ALL_REDUCE:
                            keep = bases[d]
                        else:
                            keep = piece_of(d)
                        arrays[d][..., keep] = total[..., np.searchsorted(union, keep)]
                        if op.state is G:
                            live[d][op.group][...] = False
                            live[d][op.group][keep] = True
                case OpKind.ALL_GATHER:
                    pieces = []
                    for d in members:
                        piece = piece_of(d)
                        pieces.append((piece, arrays[d][..., piece].copy()))
                    for d in members:
                        for piece, values in pieces:
                            arrays[d][..., piece] = values
                case OpKind.BROADCAST:
                    src = members[0]
                    for d in members[1:]:
                        arrays[d][..., bases[d]] = arrays[src][..., bases[d]]
                case _:
                    raise SimulationError(f"{op}: {op.kind.value} of {op.state.long_name} is not modelled")
        if op.state is P and op.kind is OpKind.ALL_GATHER:
            self.gathered[op.group].add(axis)
        elif op.state is G and op.kind is OpKind.REDUCE_SCATTER:
            scattered.add(axis)

    def _transfer(self, index: int, op: Op) -> None:
        n = self.n
        for dev in self.mesh.devices:
            g = op.group
            match (op.kind, op.state):
                case (OpKind.HOST_TO_DEVICE, State.PARAMETERS):
                    # offloaded parameters: the device's share; otherwise the host's master copy,
                    # updated on the optimizer's shard (ZeRO-Offload)
                    pos = self.layout.holding(P if g in self.offloaded[P] else O, g, dev)
                    src = self.host.get((P, dev, g))
                    if src is not None:
                        self.P[dev][g][pos] = src[pos]
                case (OpKind.DEVICE_TO_HOST, State.GRADIENTS):
                    # What the device holds of its gradient: outside a reduce-scatter's shard
                    # the buffer is freed, and the host copy gets nothing from there.
                    pos = self.layout.holding(G, g, dev)
                    alive = self.live[dev][g][pos]
                    self.host.setdefault((G, dev, g), n.zeros(self.model.size(g)))[pos] = np.where(
                        alive, self.G[dev][g][pos], 0)
                case (OpKind.DEVICE_TO_HOST, State.PARAMETERS):
                    pos = self.layout.holding(P, g, dev)
                    self.host.setdefault((P, dev, g), n.zeros(self.model.size(g)))[pos] = self.P[dev][g][pos]
                case _:
                    raise SimulationError(f"{op}: {op.kind.value} of {op.state.long_name} is not modelled")
            if len(pos):
                self.tally[index].add(dev, len(pos), Fraction(len(pos) * self.precision.bytes_of(op.state)))

    def _optimizer_step(self, index: int, op: Op) -> None:
        g = op.group
        lay = self.layout
        for dev in self.mesh.devices:
            offsets = {a: op.offset for a in lay.sharded_axes(O, g)}
            # Along an axis split by structure (TP slices, pipeline stages) an offset rotates
            # which device's slice this device updates.
            owner = dev
            for axis in lay.structural_axes(O, g):
                d = self.mesh.degree(axis)
                owner = self.mesh.moved(owner, axis, (self.mesh.coord(dev, axis) - op.offset) % d)
            pos = lay.holding(O, g, owner, offsets=offsets)
            if not len(pos):
                continue
            on_host_o = g in self.offloaded[O]
            p_src = self.host[(P, dev, g)] if (g in self.offloaded[P] or on_host_o) else self.P[dev][g]
            g_src = self.host[(G, dev, g)] if (g in self.offloaded[G] or on_host_o) else self.G[dev][g]
            o_src = self.host[(O, dev, g)] if on_host_o else self.O[dev][g]
            phase = Phase.OPTIMIZER.value
            self._check(G, g, dev, pos, g_src[pos], self.ref.gradients[g][pos], phase, None)
            self._check(P, g, dev, pos, p_src[pos], self.ref.parameters[g][pos], phase, None)
            self._check(O, g, dev, pos, o_src[:, pos], self.ref.optimizer[g][:, pos], phase, None)
            new_p, new_o = self.optimizer.step(p_src[pos], g_src[pos], o_src[:, pos], self.step, self.n)
            p_src[pos] = new_p
            o_src[:, pos] = new_o
            self.tally[index].add(dev, len(pos), Fraction(0))

    def _run_state_op(self, index: int, per_mb: bool = False) -> None:
        op = self.ops[index]
        if op.kind.is_collective:
            self._state_collective(index, op, per_mb)
        elif op.kind.is_transfer:
            self._transfer(index, op)
        elif op.kind is OpKind.SCALE:
            for dev in self.mesh.devices:
                arr = self._array(op.state, dev, op.group, per_mb)
                arr[...] = self.n.scale(arr, Fraction(str(op.scale)) if op.scale is not None else 1)
                self.tally[index].add(dev, 0, Fraction(0))
        elif op.kind is OpKind.OPTIMIZER_STEP:
            self._optimizer_step(index, op)
        elif op.kind is OpKind.COMPUTE:
            for dev in self.mesh.devices:
                self.tally[index].add(dev, 0, Fraction(0))
        else:
            raise SimulationError(f"{op}: not modelled")

    def _free_parameters(self, after_backward: bool) -> None:
        for g in self.groups:
            # After the forward, what was gathered along the holding axes stays (FSDP SGO: all of
            # it; ZeRO++ hpZ: the secondary partition, whole across nodes), fetched offloaded
            # parameters included.
            held = frozenset() if after_backward else frozenset(
                a for a in self.mesh.axes if self.pl.entry(P, g, a).keep_gathered)
            self.gathered[g] &= held
            for dev in self.mesh.devices:
                if g in self.offloaded[P] and not held:
                    self.P[dev][g][...] = 0
                else:
                    self.P[dev][g][~self.layout.mask(P, g, dev, skip=held)] = 0

    def _free_gradients(self, arrays: dict[Device, dict[Group, Array]],
                        live: dict[Device, dict[Group, npt.NDArray[np.bool_]]]) -> None:
        for g in self.groups:
            for dev in self.mesh.devices:
                held = self.layout.mask(G, g, dev)
                live[dev][g] &= held
                # A reduce-scatter leaves the device its shard: the rest of the buffer is freed
                # with the placement's (z3's "freed outside the shard"), whatever the mode says.
                arrays[dev][g][~live[dev][g]] = 0

    # ---- activation collectives ----------------------------------------------------------
    def _instances(self, kind: OpKind, group: Group, axis: Axis, phase: Phase) -> list[int]:
        return self.act_ops.get((kind, group, axis, phase), [])

    def _count(self, index: int, devs: Iterable[Device], elements: int, kind: OpKind, k: int) -> None:
        nbytes = elements * self.precision.activations * _ring_share(kind, k)
        for d in devs:
            self.tally[index].add(d, elements, nbytes)

    def _act(self, kind: OpKind, group: Group, axis: Axis, phase: Phase, vals: PerDevice,
             dim: int = 1) -> PerDevice:
        """An activation collective along ``axis`` at one site of the model, as the program says."""
        if self.mesh.degree(axis) == 1:
            return vals
        n = self.n
        instances = self._instances(kind, group, axis, phase)
        out = dict(vals)
        for grp in self.mesh.groups(axis, vals):
            k = len(grp)
            pieces = [vals[d] for d in grp]
            if kind is OpKind.ALL_GATHER:
                if not instances:  # nothing gathered: the others' slots hold a freed buffer's zeros
                    for j, d in enumerate(grp):
                        blank = [np.zeros_like(pc) for pc in pieces]
                        blank[j] = pieces[j]
                        out[d] = np.concatenate(blank, axis=dim)
                    continue
                full = np.concatenate(pieces, axis=dim)
                for index in instances:  # a second gather of the same pieces changes nothing
                    self._count(index, grp, full.size, kind, k)
                for d in grp:
                    out[d] = full
                continue
            current = pieces
            for step_no, index in enumerate(instances):
                op_reduce = self.ops[index].reduce
                total = n.sum_of(current)
                if op_reduce is Reduce.MEAN:
                    total = n.scale(total, Fraction(1, k))
                self._count(index, grp, current[0].size, kind, k)
                if kind is OpKind.ALL_REDUCE:
                    current = [total for _ in grp]
                elif kind is OpKind.REDUCE_SCATTER:
                    if step_no == 0:
                        current = list(np.split(total, k, axis=dim))
                    else:  # reducing again sums different shards: wrong, as it would be
                        current = [total for _ in grp]
                else:
                    raise AssertionError(kind)
            if not instances and kind is OpKind.REDUCE_SCATTER:
                current = [np.split(pc, k, axis=dim)[j] for j, pc in enumerate(pieces)]
            for d, value in zip(grp, current, strict=True):
                out[d] = value
        return out

    def _send(self, phase: Phase, vals: PerDevice, to_stage: int) -> PerDevice:
        instances = self._instances(OpKind.SEND_RECV, LAYER_IO, Axis.PP, phase)
        out: PerDevice = {}
        for d, value in vals.items():
            dest = self.mesh.moved(d, Axis.PP, to_stage)
            out[dest] = value.copy() if instances else np.zeros_like(value)
            for index in instances:
                self._count(index, [d], value.size, OpKind.SEND_RECV, 2)
        return out

    # ---- the model on the mesh -----------------------------------------------------------
    def _index(self, dev: Device, group: Group, which: int, layer: int | None) -> Array:
        """Flat indices of one tensor on a device, cut to its TP slice when compute-sharded."""
        t = self.model.tensors(group)[which]
        index = t.index if layer is None else t.index[layer]
        if t.tp_dim is not None and self.t > 1 and self.pl.computes_sharded(Axis.TP, group):
            r = self.mesh.coord(dev, Axis.TP)
            n_ = index.shape[t.tp_dim]
            index = np.take(index, range(r * n_ // self.t, (r + 1) * n_ // self.t), axis=t.tp_dim)
        return index

    def _w(self, dev: Device, group: Group, which: int, layer: int | None = None) -> Array:
        """A device's working copy of one tensor, cut to its TP slice when compute-sharded."""
        return self.P_read[dev][group][self._index(dev, group, which, layer)]

    def _add_grad(self, dev: Device, group: Group, which: int, layer: int | None, value: Array) -> None:
        index = self._index(dev, group, which, layer)
        arr = self.fresh[dev][group]
        arr[index] = self.n.add(arr[index], value)

    def _seq_slice(self, dev: Device) -> slice:
        """The positions of the full sequence a device's tokens cover (cp chunk, SP slice)."""
        start = self.mesh.coord(dev, Axis.CP) * self.s_chunk
        return slice(start, start + self.s_chunk)

    def _sp_split(self, dev: Device, value: Array) -> Array:
        if not self.sp:
            return value
        return np.split(value, self.t, axis=1)[self.mesh.coord(dev, Axis.TP)]

    def _layer_forward(self, layer: int, x: PerDevice, phase: Phase) -> tuple[PerDevice, _Saved]:
        n, t_ax = self.n, Axis.TP
        u = {d: n.mul(x[d], self._w(d, NORM, 0, layer)) for d in x}
        u_full = self._act(OpKind.ALL_GATHER, LAYER_IO, t_ax, phase, u) if self.sp else u
        q, kv, c, z, a = {}, {}, {}, {}, {}
        for d in x:
            wqkv = self._w(d, ATTENTION, 0, layer)
            q[d] = n.mm(u_full[d], wqkv[:, 0])
            kv[d] = np.concatenate([n.mm(u_full[d], wqkv[:, 1]), n.mm(u_full[d], wqkv[:, 2])], axis=2)
        kv_all = self._act(OpKind.ALL_GATHER, LINEAR_INNER, Axis.CP, phase, kv)
        for d in x:
            half = kv_all[d].shape[2] // 2
            prefix = n.cumsum(n.mul(kv_all[d][..., :half], kv_all[d][..., half:]), axis=1)
            c[d] = prefix[:, self._seq_slice(d)]
            z[d] = n.mul(q[d], c[d])
            a[d] = n.mm(z[d], self._w(d, ATTENTION, 1, layer))
        a = self._block_out(a, phase)
        x_mid = {d: n.add(x[d], a[d]) for d in x}
        w = {d: n.mul(x_mid[d], self._w(d, NORM, 1, layer)) for d in x}
        w_full = self._act(OpKind.ALL_GATHER, LAYER_IO, t_ax, phase, w) if self.sp else w
        y = {d: n.mm(w_full[d], self._w(d, MLP, 0, layer)) for d in x}
        o = self._block_out({d: n.mm(y[d], self._w(d, MLP, 1, layer)) for d in x}, phase)
        x_out = {d: n.add(x_mid[d], o[d]) for d in x}
        saved: _Saved = {d: (x[d], u_full[d], q[d], kv_all[d], c[d], z[d], x_mid[d], w_full[d], y[d]) for d in x}
        return x_out, saved

    def _block_out(self, partial: PerDevice, phase: Phase) -> PerDevice:
        """Megatron's g operator: the row-parallel output's partial sums across tp."""
        if self.t == 1:
            return partial
        kind = OpKind.REDUCE_SCATTER if self.sp else OpKind.ALL_REDUCE
        return self._act(kind, LAYER_IO, Axis.TP, phase, partial)

    def _block_in_grad(self, partial: PerDevice) -> PerDevice:
        """Megatron's f operator in backward: the column-parallel input gradient across tp."""
        return self._block_out(partial, Phase.BACKWARD)

    def _layer_backward(self, layer: int, dx: PerDevice, saved: dict[Device, tuple[Array, ...]]) -> PerDevice:
        n, h = self.n, self.model.hidden
        bw = Phase.BACKWARD
        gather = (lambda v: self._act(OpKind.ALL_GATHER, LAYER_IO, Axis.TP, bw, v)) if self.sp else (lambda v: v)
        do_full = gather(dx)
        dw_part = {}
        for d in dx:
            x_in, u_full, q, kv_all, c, z, x_mid, w_full, y = saved[d]
            fc1, fc2 = self._w(d, MLP, 0, layer), self._w(d, MLP, 1, layer)
            self._add_grad(d, MLP, 1, layer, n.mm(y.reshape(-1, y.shape[-1]).T, do_full[d].reshape(-1, h)))
            dy = n.mm(do_full[d], fc2.T)
            self._add_grad(d, MLP, 0, layer, n.mm(w_full.reshape(-1, h).T, dy.reshape(-1, dy.shape[-1])))
            dw_part[d] = n.mm(dy, fc1.T)
        dw = self._block_in_grad(dw_part)
        dx2 = {}
        for d in dx:
            x_mid = saved[d][6]
            self._add_grad(d, NORM, 1, layer, n.total(n.mul(dw[d], x_mid), axis=(0, 1)))
            dx2[d] = n.add(dx[d], n.mul(dw[d], self._w(d, NORM, 1, layer)))
        da_full = gather(dx2)
        dkv_part, dq = {}, {}
        for d in dx:
            x_in, u_full, q, kv_all, c, z, x_mid, w_full, y = saved[d]
            out_w = self._w(d, ATTENTION, 1, layer)
            self._add_grad(d, ATTENTION, 1, layer, n.mm(z.reshape(-1, z.shape[-1]).T, da_full[d].reshape(-1, h)))
            dz = n.mm(da_full[d], out_w.T)
            dq[d] = n.mul(dz, c)
            dc = n.zeros((*kv_all.shape[:2], kv_all.shape[2] // 2))
            dc[:, self._seq_slice(d)] = n.mul(dz, q)
            dprod = n.rev_cumsum(dc, axis=1)
            half = kv_all.shape[2] // 2
            dkv_part[d] = np.concatenate([n.mul(dprod, kv_all[..., half:]), n.mul(dprod, kv_all[..., :half])], axis=2)
        dkv = self._act(OpKind.REDUCE_SCATTER, LINEAR_INNER, Axis.CP, bw, dkv_part)
        du_part = {}
        for d in dx:
            x_in, u_full = saved[d][0], saved[d][1]
            local = dkv[d]
            half = local.shape[2] // 2
            dk, dv = local[..., :half], local[..., half:]
            wqkv = self._w(d, ATTENTION, 0, layer)
            u2 = u_full.reshape(-1, h)
            grad = np.stack([n.mm(u2.T, g_.reshape(-1, half)) for g_ in (dq[d], dk, dv)], axis=1)
            self._add_grad(d, ATTENTION, 0, layer, grad)
            du_part[d] = n.add(n.add(n.mm(dq[d], wqkv[:, 0].T), n.mm(dk, wqkv[:, 1].T)), n.mm(dv, wqkv[:, 2].T))
        du = self._block_in_grad(du_part)
        out = {}
        for d in dx:
            x_in = saved[d][0]
            self._add_grad(d, NORM, 0, layer, n.total(n.mul(du[d], x_in), axis=(0, 1)))
            out[d] = n.add(dx2[d], n.mul(du[d], self._w(d, NORM, 0, layer)))
        return out

    def _stage_devices(self, stage: int) -> list[Device]:
        return [d for d in self.mesh.devices if self.mesh.coord(d, Axis.PP) == stage]

    def _batch_of(self, dev: Device, batch: Batch, mb: int) -> tuple[np.ndarray, Array]:
        replica = 0
        for axis in self.data_axes:
            replica = replica * self.mesh.degree(axis) + self.mesh.coord(dev, axis)
        b = self.model.micro_batch
        start = (replica * self.m + mb) * b
        sl = self._seq_slice(dev)
        return batch.tokens[start:start + b, sl], batch.targets[start:start + b, sl]

    def _vocab_range(self, dev: Device) -> tuple[int, int]:
        per = self.model.vocab // self.t
        r = self.mesh.coord(dev, Axis.TP) if self.pl.computes_sharded(Axis.TP, EMBEDDING) else 0
        if not self.pl.computes_sharded(Axis.TP, EMBEDDING):
            return 0, self.model.vocab
        return r * per, (r + 1) * per

    def _micro_batch(self, batch: Batch, mb: int) -> None:
        n, lay = self.n, self.layout
        h = self.model.hidden
        chunks = len(lay.chunk_layers)
        recompute = self.pl.options.recompute
        vocab_split = self.t > 1 and self.pl.computes_sharded(Axis.TP, EMBEDDING)
        head_group = EMBEDDING if self.model.tied else HEAD
        head_split = self.t > 1 and self.pl.computes_sharded(Axis.TP, head_group)
        # forward
        first = self._stage_devices(0)
        x: PerDevice = {}
        for d in first:
            tokens, _ = self._batch_of(d, batch, mb)
            lo, hi = self._vocab_range(d)
            emb = self._w(d, EMBEDDING, 0)
            inside = (tokens >= lo) & (tokens < hi)
            x[d] = np.where(inside[..., None], emb[np.clip(tokens - lo, 0, hi - lo - 1)], 0).astype(emb.dtype)
        if vocab_split:  # partial sums of the vocabulary-split lookup
            kind = OpKind.REDUCE_SCATTER if self.sp else OpKind.ALL_REDUCE
            x = self._act(kind, EMBEDDING_IO, Axis.TP, Phase.FORWARD, x)
        elif self.sp:
            x = {d: self._sp_split(d, x[d]) for d in x}
        saved: dict[int, dict[Device, tuple[Array, ...]]] = {}
        inputs: dict[int, PerDevice] = {}
        for c in range(chunks):
            if c > 0 and lay.chunk_stage(c) != lay.chunk_stage(c - 1):
                x = self._send(Phase.FORWARD, x, lay.chunk_stage(c))
            for layer in lay.chunk_layers[c]:
                inputs[layer] = x
                x, saved[layer] = self._layer_forward(layer, x, Phase.FORWARD)
                if recompute is Recompute.FULL:
                    del saved[layer]  # only the layer input is kept (a checkpoint)
        # head and loss (last stage)
        xf = {d: n.mul(x[d], self._w(d, FINAL_NORM, 0)) for d in x}
        if self.sp:  # the head reads the whole sequence
            xf_full = self._act(OpKind.ALL_GATHER, OUTPUT_IO, Axis.TP, Phase.FORWARD, xf)
        else:
            xf_full = xf
        self.P_read = self._backward_p
        dxf_part: PerDevice = {}
        tokens_local = self.m * self.model.micro_batch * self.s_chunk
        for d in x:
            _, targets = self._batch_of(d, batch, mb)
            head = self._w(d, head_group, 0)
            lo, hi = (self._vocab_range(d) if head_split else (0, self.model.vocab))
            dlogits = n.scale(targets[..., lo:hi], Fraction(1, tokens_local))
            grad = n.mm(dlogits.reshape(-1, hi - lo).T, xf_full[d].reshape(-1, h))
            self._add_grad(d, head_group, 0, None, grad)
            dxf_part[d] = n.mm(dlogits, head)
        if head_split:  # the input gradient of the vocabulary-split head: partial sums
            kind = OpKind.REDUCE_SCATTER if self.sp else OpKind.ALL_REDUCE
            dxf = self._act(kind, OUTPUT_IO, Axis.TP, Phase.BACKWARD, dxf_part)
        else:
            dxf = {d: self._sp_split(d, v) for d, v in dxf_part.items()}
        dx: PerDevice = {}
        for d in x:
            self._add_grad(d, FINAL_NORM, 0, None, n.total(n.mul(dxf[d], x[d]), axis=(0, 1)))
            dx[d] = n.mul(dxf[d], self._w(d, FINAL_NORM, 0))
        # backward
        for c in reversed(range(chunks)):
            for layer in reversed(lay.chunk_layers[c]):
                if layer not in saved:  # full recomputation: replay the forward from the checkpoint
                    _, saved[layer] = self._layer_forward(layer, inputs[layer], Phase.BACKWARD)
                dx = self._layer_backward(layer, dx, saved[layer])
            if c > 0 and lay.chunk_stage(c) != lay.chunk_stage(c - 1):
                dx = self._send(Phase.BACKWARD, dx, lay.chunk_stage(c - 1))
        if self.sp:  # the lookup's backward reads the whole sequence's gradient
            dx = self._act(OpKind.ALL_GATHER, EMBEDDING_IO, Axis.TP, Phase.BACKWARD, dx)
        for d in dx:
            tokens, _ = self._batch_of(d, batch, mb)
            lo, hi = self._vocab_range(d)
            grad = n.zeros((hi - lo, h))
            inside = (tokens >= lo) & (tokens < hi)
            np.add.at(grad, tokens[inside] - lo, dx[d][inside])
            self._add_grad(d, EMBEDDING, 0, None, n.fix(grad))

    # ---- one step ----------------------------------------------------------------------------
    def _phase_ops(self, phase: Phase, states: tuple[State, ...]) -> list[int]:
        return [i for i, op in enumerate(self.ops) if op.phase is phase and op.state in states]

    def _fetch_and_read(self, phase: Phase, mb: int, states: tuple[State, ...]) -> dict[Device, dict[Group, Array]]:
        """A phase's ops in program order; each ``COMPUTE`` read is checked and remembered.

        A group the program never reads in this phase is read as the phase's ops leave it.
        """
        read: dict[Device, dict[Group, Array]] = {dev: {} for dev in self.mesh.devices}
        for i in self._phase_ops(phase, states):
            op = self.ops[i]
            if op.kind is OpKind.COMPUTE and op.state is P:
                self._run_state_op(i)
                for dev in self.mesh.devices:
                    pos = self.layout.compute(op.group, dev)
                    self._check(P, op.group, dev, pos, self.P[dev][op.group][pos],
                                self.ref.parameters[op.group][pos], phase.value, mb)
                    read[dev].setdefault(op.group, self.P[dev][op.group].copy())
            elif op.kind is not OpKind.COMPUTE:
                self._run_state_op(i)
        for dev in self.mesh.devices:
            for g in self.groups:
                read[dev].setdefault(g, self.P[dev][g].copy())
        return read

    def _per_micro_batch(self, index: int) -> bool:
        op = self.ops[index]
        return self.m > 1 and int(op.count) == self.m

    def _step(self, batch: Batch) -> None:
        for dev in self.mesh.devices:
            for g in self.groups:
                self.G[dev][g][...] = 0
                self.live[dev][g][...] = False
        self.scattered.clear()
        sync = self._phase_ops(Phase.GRAD_SYNC, (G, P, O))
        per_mb = [i for i in sync if self._per_micro_batch(i)]
        once = [i for i in sync if i not in per_mb]
        for mb in range(self.m):
            forward_p = self._fetch_and_read(Phase.FORWARD, mb, (P, O, G))
            for dev in self.mesh.devices:
                for g in self.groups:
                    self.fresh[dev][g][...] = 0
            for g in self.groups:
                self.scattered.pop((True, g), None)
            self._free_parameters(after_backward=False)
            # The forward math reads the parameters as they were at each group's forward read,
            # the backward (and its replay under recomputation) as at its backward read.
            self._backward_p = self._fetch_and_read(Phase.BACKWARD, mb, (P, O))
            self.P_read = forward_p
            self._micro_batch(batch, mb)
            for dev in self.mesh.devices:
                for g in self.groups:
                    self.live_fresh[dev][g] = self.layout.mask(None, g, dev).copy()
            for i in self._phase_ops(Phase.BACKWARD, (G,)):
                self._run_state_op(i, per_mb=True)
            for i in per_mb:
                self._run_state_op(i, per_mb=True)
            if per_mb:
                self._free_gradients(self.fresh, self.live_fresh)
            for dev in self.mesh.devices:
                for g in self.groups:
                    self.G[dev][g] = self.n.add(self.G[dev][g], self.fresh[dev][g])
                    self.live[dev][g] |= self.live_fresh[dev][g]
            for g in self.groups:
                self.scattered.setdefault((False, g), set()).update(self.scattered.get((True, g), ()))
            self._free_parameters(after_backward=True)
        for i in once:
            self._run_state_op(i)
        self._free_gradients(self.G, self.live)
        for i in self._phase_ops(Phase.OPTIMIZER, (P, O, G)):
            self._run_state_op(i)
        for i in self._phase_ops(Phase.REFRESH, (P, O, G)):
            self._run_state_op(i)

    # ---- driver ------------------------------------------------------------------------------
    def run(self, data: tuple[Batch, ...], records: tuple[StepRecord, ...], p0: dict[Group, Array],
            stop_at_divergence: bool = True) -> tuple[Divergence | None, bool]:
        self._init_states(p0)
        divergence = None
        for k, (batch, ref) in enumerate(zip(data, records, strict=True), start=1):
            self.step, self.ref = k, ref
            try:
                self._step(batch)
            except _Diverged as err:
                divergence = err.divergence
                if stop_at_divergence:
                    return divergence, False
        return divergence, True

    # ---- cost figures ------------------------------------------------------------------------
    def traffic(self, steps: int) -> tuple[OpTraffic, ...]:
        expected: dict[int, Fraction] = {}
        comm = iter(communication(self.program, self.precision))
        trans = iter(transfers(self.program, self.precision))
        for i, op in enumerate(self.ops):
            if op.kind.is_collective and op.axis is not None:
                expected[i] = exact_fraction(next(comm).bytes)
            elif op.kind.is_transfer:
                expected[i] = exact_fraction(next(trans)[4])
        out = []
        for i, op in enumerate(self.ops):
            tally = self.tally[i]
            if not (op.kind.is_collective or op.kind.is_transfer):
                continue
            top = max(tally.bytes.values(), default=Fraction(0)) / steps
            calls = max(tally.calls.values(), default=0) // steps
            elements = max(tally.elements) if tally.elements else None
            out.append(OpTraffic(i, str(op), calls, elements, top, expected.get(i)))
        return tuple(out)

    def memory(self) -> tuple[tuple[tuple[str, State, int, int], ...], tuple[tuple[str, int, int], ...]]:
        sizes = group_sizes(self.model.transformer())
        rows = []
        host_rows = []
        for stage in range(self.layout.p):
            name = self.layout.stage_name(stage)
            devs = self._stage_devices(stage)
            host_sim = 0
            for state in (P, G, O):
                sim = 0
                for dev in devs:
                    total = 0
                    for g in self.groups:
                        held = len(self.layout.holding(state, g, dev))
                        if g in self.offloaded[state]:
                            continue
                        total += held * self.precision.bytes_of(state)
                    sim = max(sim, total)
                cost = exact_fraction(state_memory(self.pl, state, sizes, self.precision, name).total)
                rows.append((name, state, sim, int(cost)))
            for dev in devs:
                total = 0
                for state in (P, G, O):
                    for g in self.offloaded[state]:
                        total += len(self.layout.holding(state, g, dev)) * self.precision.bytes_of(state)
                host_sim = max(host_sim, total)
            host_rows.append((name, host_sim, int(exact_fraction(host_memory(self.pl, sizes, self.precision, name)))))
        return tuple(rows), tuple(host_rows)


def _copy(states: dict[Device, dict[Group, Array]]) -> dict[Device, dict[Group, Array]]:
    return {dev: {g: a.copy() for g, a in row.items()} for dev, row in states.items()}


def simulate_program(program: StepProgram, model: ReferenceModel, *, optimizer: Optimizer | None = None,
                     arithmetic: Arithmetic = Arithmetic.FIELD, steps: int = 2, seed: int = 0,
                     precision: Precision = DEFAULT_PRECISION, stop_at_divergence: bool = True) -> SimulationResult:
    """Run ``program`` on the simulated mesh and single-device training side by side.

    ``steps`` training steps are checked, plus one more whose reads check the last update.
    """
    optimizer = optimizer or Optimizer()
    numbers = Numbers(arithmetic)
    sim = Simulator(program, model, optimizer, numbers, precision)
    sequences = sim.replicas * sim.m * model.micro_batch
    data = make_data(model, sequences, steps + 1, numbers, seed)
    p0 = initial_parameters(model, numbers, seed)
    records = train_single_device(model, data, optimizer, numbers, parameters=p0)
    divergence, complete = sim.run(data, records, p0, stop_at_divergence)
    memory, host = sim.memory()
    return SimulationResult(
        matches=divergence is None, divergence=divergence, steps=steps + 1, devices=len(sim.mesh.devices),
        arithmetic=arithmetic, traffic=sim.traffic(steps + 1) if complete else (), memory=memory, host=host,
        complete=complete)


def simulate(composition: Composition, model: ReferenceModel | None = None, *,
             program: StepProgram | None = None, **kwargs: object) -> SimulationResult:
    """Simulate a composition (its degrees, micro-batches and options) on the reference model.

    ``program``: a step program to run instead of the derived one (a user's or a mutated one).
    """
    model = model or ReferenceModel()
    pl = composition.placement(model.transformer())
    if program is None:
        program = derive_program(pl, model.transformer())
    return simulate_program(program, model, **kwargs)  # type: ignore[arg-type]


def reference_for(composition: Composition, base: ReferenceModel | None = None) -> ReferenceModel:
    """The smallest reference model the composition's degrees divide (layers by pp x chunks,
    hidden, heads, ffn and vocabulary by tp, sequence by cp (x tp under sequence parallelism))."""
    base = base or ReferenceModel()
    mesh = composition.mesh()
    t, p, cp = mesh.get(Axis.TP, 1), mesh.get(Axis.PP, 1), mesh.get(Axis.CP, 1)
    v = composition.options.virtual_stages
    layers = _multiple(base.layers, p * v)
    hidden = _multiple(base.hidden, t)
    heads = _multiple(base.heads, t)
    while hidden % heads:
        hidden += t
    seq = _multiple(base.seq, cp * (t if composition.options.sequence_parallel else 1))
    return ReferenceModel(layers=layers, hidden=hidden, heads=heads, ffn=_multiple(base.ffn, t),
                          vocab=_multiple(base.vocab, t), seq=seq, micro_batch=base.micro_batch, tied=base.tied)


def _multiple(value: int, k: int) -> int:
    return value if value % k == 0 else (value // k + 1) * k


__all__ = [
    "Divergence", "OpTraffic", "SimulationResult", "Simulator", "reference_for", "simulate",
    "simulate_program",
]
