"""The program's ops on model states, run on the simulated devices, and the traffic they send.

``_StateOps`` runs one op of the program on parameters, gradients or optimizer state: a
collective along a mesh axis moves real values between the buffers of its group's devices, a
transfer copies between a device and the host, the optimizer step reads (judged) and writes its
shard. ``_Traffic`` counts, per op and per device, the calls, elements and bytes sent, and
sets them beside ``formal._costs``'s figures for the same program.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from formal._costs import communication, transfers
from formal._exact import exact_fraction
from formal._model import Precision
from formal._program import Op, StepProgram, rescatters, scatter_axes
from formal._reference import Array, IndexArray, Numbers, Optimizer
from formal._sim_mesh import Device, _chunk, _Layout, _Mesh
from formal._sim_results import OpTraffic, _Judge
from formal._sim_states import Masks, _States
from formal._vocab import LAYER_GROUPS, Axis, Group, OpKind, Phase, Reduce, State
from formal.errors import SimulationError

P, O, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS  # noqa: E741


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


class _Traffic:
    """What each op of the program sent, per device, over the steps run."""

    def __init__(self, program: StepProgram, precision: Precision) -> None:
        self.program, self.precision = program, precision
        self.ops = program.ops
        self.tally: dict[int, _Tally] = {i: _Tally() for i in range(len(self.ops))}

    def add(self, index: int, dev: Device, elements: int, nbytes: Fraction) -> None:
        self.tally[index].add(dev, elements, nbytes)

    def activations(self, index: int, devs: list[Device], elements: int, kind: OpKind, k: int) -> None:
        """One activation collective of ``k`` devices on a tensor of ``elements`` elements."""
        op = self.ops[index]
        nbytes = elements * self.precision.op_wire_bytes(op.state, op.group) * _ring_share(kind, k)
        for d in devs:
            self.tally[index].add(d, elements, nbytes)

    def report(self, steps: int) -> tuple[OpTraffic, ...]:
        """Per collective and transfer: the most loaded device's figures per step, and the cost model's."""
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


class _StateOps:
    """Runs the program's ops on parameters, gradients and optimizer state."""

    def __init__(
        self,
        program: StepProgram,
        mesh: _Mesh,
        layout: _Layout,
        states: _States,
        traffic: _Traffic,
        judge: _Judge,
        optimizer: Optimizer,
        numbers: Numbers,
        precision: Precision,
    ) -> None:
        self.ops, self.pl = program.ops, program.placement
        self.mesh, self.layout, self.states, self.traffic, self.judge = mesh, layout, states, traffic, judge
        self.optimizer, self.n, self.precision = optimizer, numbers, precision
        # The axes the program reduce-scatters each group's gradient along: a reduce-scatter acts
        # on the gradient still whole along those it has not scattered yet (``states.scattered``).
        # A reduce-scatter of a gradient already reduced along its axis (by an earlier all-reduce
        # or reduce-scatter there) only copies a chunk of what every peer holds: it does not cut
        # the buffer that earlier reduce-scatters leave, nor nest them (``rescatters``).
        self.rescatters: frozenset[int] = rescatters(self.ops)
        self.scatter_axes: dict[Group, frozenset[Axis]] = {g: scatter_axes(self.ops, g) for g in states.groups}

    def _wire(self, state: State) -> int:
        return self.precision.wire_bytes_of(state)

    def collective(self, index: int, op: Op, per_mb: bool) -> None:
        axis = op.axis
        if axis is None:
            raise SimulationError(f"{op}: a collective needs an axis")
        if axis not in self.mesh.degrees or self.mesh.degree(axis) == 1:
            # One device along the axis: the collective exchanges nothing and is the identity
            # (docs/semantics.md, "Execution order"), as z3 reads it; a reduce-scatter there
            # does not cut the gradient towards the other axes' shards.
            return
        n = self.n
        live = self.states.live_fresh if per_mb else self.states.live
        # What earlier collectives along other axes left: parameters whole along the axes
        # gathered since the last free, a gradient whole along the axes it is scattered along later.
        whole: frozenset[Axis] = frozenset()
        scattered = self.states.scattered.setdefault((per_mb, op.group), set())
        if op.state is P and op.kind is OpKind.ALL_GATHER:
            whole = frozenset(self.states.gathered[op.group] - {axis})
        elif op.state is G and op.kind is OpKind.REDUCE_SCATTER:
            whole = self.scatter_axes[op.group] - scattered - {axis}
        # A gradient reduce-scattered along several axes (onto the optimizer's shard where G is
        # replicated there) is cut towards the partition all of them make: each one leaves the
        # union, over the axes still to come, of the final pieces (docs/semantics.md, "Collectives
        # along several axes"), whichever order they run in.
        forced: frozenset[Axis] = frozenset()
        regathered = self.states.regathered.setdefault((per_mb, op.group), set())
        if op.state is G and op.kind is OpKind.REDUCE_SCATTER:
            # those it nests in: scattered before and not gathered back since, and those to come;
            # a re-scatter of a reduced gradient cuts its chunk out of what the device holds
            own = frozenset() if index in self.rescatters else {axis}
            forced = frozenset((scattered - regathered) | whole | own)
        # The refresh's all-gathers of parameters replicated along the axis assemble what the
        # optimizer updated: the pieces are the optimizer state's partition (its tp slices, its
        # nested flat shards), made whole along the axes gathered so far.
        holder = op.state
        if op.state is P and op.kind is OpKind.ALL_GATHER and op.phase is Phase.REFRESH:
            if not self.pl.entry(P, op.group, axis).mode.is_sharded:
                holder = O
        for peers in self.mesh.groups(axis, self.mesh.devices):
            bases = {d: self.layout.holding(holder, op.group, d, skip=whole | {axis}, force=forced) for d in peers}
            if op.state is G and op.kind is not OpKind.ALL_REDUCE and self._split_elsewhere(op.group, axis):
                # A gradient exists only on the slice the device computes (a pipeline stage's
                # layers, its tp slice), whatever G's mode there: a reduce-scatter or gather along
                # another axis cuts that local tensor, as the optimizer state's shards are cut.
                bases = {d: np.intersect1d(bases[d], self.layout.compute(op.group, d)) for d in peers}
            if op.state is G and op.kind is OpKind.ALL_REDUCE:
                bases = {d: np.flatnonzero(self.layout.mask(G, op.group, d, axis) | live[d][op.group]) for d in peers}
            members = [d for d in peers if len(bases[d])]
            if not members:
                continue
            arrays = {d: self.states.array(op.state, d, op.group, per_mb) for d in members}
            k = len(members)
            deg = self.mesh.degree(axis)
            share = _ring_share(op.kind, k)
            # Along an axis that splits the group by structure (TP rows/columns, pipeline stages)
            # a device's piece is its own slice, not a flat shard: offsets do not apply.
            # A tied embedding is whole on the first and the last stage: along pp its pieces are
            # flat shards between those two (the participants), as for any replicated group.
            tied = axis.kind.is_pipeline and op.group in self.pl.tied
            structural = (axis.kind.is_pipeline and not tied) or (
                axis.kind.splits_matrices and self.pl.computes_sharded(axis, op.group)
            )

            def piece_of(
                d: Device,
                structural: bool = structural,
                bases: dict[Device, IndexArray] = bases,
                deg: int = deg,
                tied: bool = tied,
                members: list[Device] = members,
            ) -> IndexArray:
                if structural:
                    return np.intersect1d(bases[d], self.layout.compute(op.group, d))
                if tied:
                    return _chunk(bases[d], len(members), (members.index(d) - op.offset) % len(members))
                if whole:  # its shard along the axis, whole along the others made whole
                    piece = self.layout.holding(
                        holder, op.group, d, skip=whole, offsets={axis: op.offset}, force=forced | {axis}
                    )
                    return np.intersect1d(piece, bases[d], assume_unique=True)
                return _chunk(bases[d], deg, (self.mesh.coord(d, axis) - op.offset) % deg)

            for d in members:
                self.traffic.add(index, d, len(bases[d]), len(bases[d]) * self._wire(op.state) * share)
            split = structural or (axis.kind.places_experts and self.pl.computes_sharded(axis, op.group))
            if split and op.kind in (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER) and self._even(op, members):
                self._reduce_slices(op, members, arrays, live)
                continue
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
                    # A stage that does not compute a group outside the layers has no gradient
                    # buffer for it at all, fresh or accumulated (docs/semantics.md, "Groups
                    # outside the layers along a pipeline").
                    absent = per_mb and axis.kind.is_pipeline and op.group not in LAYER_GROUPS
                    after_backward = op.phase is not Phase.FORWARD or self.states.accumulated
                    if op.state is G and (absent or (not per_mb and after_backward)):
                        # After a backward, where a member's ``.grad`` holds no current value
                        # (freed outside its shard by the synchronisation, or by a reduce-scatter
                        # of an earlier micro-batch), the sum has none either: z3's junk. Zeros
                        # there would pass a sum off as a gather. (Before the first backward, in
                        # the first forward, ``.grad`` is zeroed memory: zeros are its value.)
                        dead = ~np.logical_and.reduce([live[d][op.group][union] for d in members])
                        if dead.any():
                            total = total.copy()
                            total[..., dead] = self.states.junk(int(dead.sum()))
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
                        alive = live[d][op.group][piece].copy() if op.state is G else None
                        pieces.append((piece, arrays[d][..., piece].copy(), alive))
                    for d in members:
                        for piece, values, alive in pieces:
                            arrays[d][..., piece] = values
                            if alive is not None:
                                # A gathered gradient shard is as current as on its sender: the
                                # step's free outside the holding keeps it (a reduce-scatter then
                                # an all-gather makes the reduced gradient whole again).
                                live[d][op.group][piece] = alive
                case OpKind.BROADCAST:
                    src = members[0]
                    for d in members[1:]:
                        arrays[d][..., bases[d]] = arrays[src][..., bases[d]]
                case _:
                    raise SimulationError(f"{op}: {op.kind.value} of {op.state.long_name} is not modelled")
        if op.state is P and op.kind is OpKind.ALL_GATHER:
            self.states.gathered[op.group].add(axis)
        elif op.state is G and op.kind is OpKind.REDUCE_SCATTER:
            scattered.add(axis)
            regathered.discard(axis)
        elif op.state is G and op.kind is OpKind.ALL_GATHER and axis in scattered:
            regathered.add(axis)

    def _split_elsewhere(self, group: Group, axis: Axis) -> bool:
        """Whether an axis other than ``axis`` splits the group's computation by structure."""
        return any(
            a is not axis
            and self.mesh.degree(a) > 1
            and (a.kind.is_pipeline or a.kind.splits_matrices)
            and self.pl.computes_sharded(a, group)
            and not (a.kind.is_pipeline and group in self.pl.tied)
            for a in self.mesh.degrees
        )

    def _even(self, op: Op, members: list[Device]) -> bool:
        """Whether every member computes a slice of the same size (tp slices, whole experts). A
        group that lives on one pipeline stage has no slice on the others: its reduction along pp
        is judged position by position, as for an unsplit group."""
        return len({len(self.layout.compute(op.group, d)) for d in members}) == 1

    def _reduce_slices(self, op: Op, members: list[Device], arrays: dict[Device, Array], live: Masks) -> None:
        """An all-reduce or reduce-scatter of a gradient (or of parameters or optimizer state: the
        same local tensors) along an axis that splits the group's computation (Megatron-LM's
        column/row-parallel slices, GShard's experts, pipeline stages): each device's tensor is
        only its own slice, and ``torch.distributed.all_reduce``
        combines the devices' tensors element by element, so the j-th element of one device's slice
        is summed with the j-th element of the others' (another slice's value, or another expert's),
        not with the same parameter. A reduce-scatter leaves each device its chunk of that sum
        (chunk ``coordinate - offset`` of its local tensor), at the positions of its own slice."""
        slices = {d: self.layout.compute(op.group, d) for d in members}
        sizes = {len(s) for s in slices.values()}
        if len(sizes) != 1:
            raise SimulationError(f"{op}: a {op.kind.value} of tensors of different sizes ({sorted(sizes)})")
        total = self.n.sum_of([arrays[d][..., slices[d]] for d in members])
        if op.reduce is Reduce.MEAN:
            total = self.n.scale(total, Fraction(1, len(members)))
        local = np.arange(len(slices[members[0]]))
        for d in members:
            keep = local
            if op.kind is OpKind.REDUCE_SCATTER:
                keep = _chunk(local, len(members), (members.index(d) - op.offset) % len(members))
            arrays[d][..., slices[d][keep]] = total[..., keep]
            if op.state is G:
                live[d][op.group][...] = False
                live[d][op.group][slices[d][keep]] = True

    def transfer(self, index: int, op: Op, per_mb: bool = False) -> None:
        n, st = self.n, self.states
        for dev in self.mesh.devices:
            g = op.group
            match (op.kind, op.state):
                case (OpKind.HOST_TO_DEVICE, State.PARAMETERS):
                    # offloaded parameters: the device's share; otherwise the host's master copy,
                    # updated on the optimizer's shard (ZeRO-Offload)
                    pos = self.layout.holding(P if g in st.offloaded[P] else O, g, dev)
                    src = st.host.get((P, dev, g))
                    if src is not None:
                        st.P[dev][g][pos] = src[pos]
                case (OpKind.DEVICE_TO_HOST, State.GRADIENTS):
                    # What the device holds of its gradient: outside a reduce-scatter's shard
                    # the buffer is freed, and the host copy gets nothing from there. A copy of
                    # the fresh buffer (inside a micro-batch's backward, before accumulation)
                    # copies that micro-batch's gradient; otherwise ``.grad`` as it stands.
                    pos = self.layout.holding(G, g, dev)
                    grads, live = (st.fresh, st.live_fresh) if per_mb else (st.G, st.live)
                    alive = live[dev][g][pos]
                    st.host.setdefault((G, dev, g), n.zeros(st.model.size(g)))[pos] = np.where(
                        alive, grads[dev][g][pos], 0
                    )
                case (OpKind.DEVICE_TO_HOST, State.PARAMETERS):
                    pos = self.layout.holding(P, g, dev)
                    st.host.setdefault((P, dev, g), n.zeros(st.model.size(g)))[pos] = st.P[dev][g][pos]
                case _:
                    raise SimulationError(f"{op}: {op.kind.value} of {op.state.long_name} is not modelled")
            if len(pos):
                self.traffic.add(index, dev, len(pos), Fraction(len(pos) * self.precision.bytes_of(op.state)))

    def optimizer_step(self, index: int, op: Op) -> None:
        g = op.group
        lay, st, ref = self.layout, self.states, self.judge.record
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
            on_host_o = g in st.offloaded[O]
            p_src = st.host[(P, dev, g)] if (g in st.offloaded[P] or on_host_o) else st.P[dev][g]
            g_src = st.host[(G, dev, g)] if (g in st.offloaded[G] or on_host_o) else st.G[dev][g]
            o_src = st.host[(O, dev, g)] if on_host_o else st.O[dev][g]
            phase = Phase.OPTIMIZER.value
            self.judge.check(G, g, dev, pos, g_src[pos], ref.gradients[g][pos], phase, None)
            self.judge.check(P, g, dev, pos, p_src[pos], ref.parameters[g][pos], phase, None)
            self.judge.check(O, g, dev, pos, o_src[:, pos], ref.optimizer[g][:, pos], phase, None)
            new_p, new_o = self.optimizer.step(p_src[pos], g_src[pos], o_src[:, pos], self.judge.step, self.n)
            p_src[pos] = new_p
            o_src[:, pos] = new_o
            self.traffic.add(index, dev, len(pos), Fraction(0))

    def run(self, index: int, per_mb: bool = False) -> None:
        """Op ``index`` of the program (``per_mb``: on the current micro-batch's gradients)."""
        op = self.ops[index]
        if op.kind.is_collective:
            self.collective(index, op, per_mb)
        elif op.kind.is_transfer:
            self.transfer(index, op, per_mb)
        elif op.kind is OpKind.SCALE:
            for dev in self.mesh.devices:
                arr = self.states.array(op.state, dev, op.group, per_mb)
                arr[...] = self.n.scale(arr, Fraction(str(op.scale)) if op.scale is not None else 1)
                self.traffic.add(index, dev, 0, Fraction(0))
        elif op.kind is OpKind.OPTIMIZER_STEP:
            self.optimizer_step(index, op)
        elif op.kind is OpKind.COMPUTE:
            for dev in self.mesh.devices:
                self.traffic.add(index, dev, 0, Fraction(0))
        else:
            raise SimulationError(f"{op}: not modelled")
