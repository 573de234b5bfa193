"""What every simulated device holds: its arrays of each state, and the host's offloaded copies.

A buffer is as long as its whole group on every device. Outside what a device holds, a
parameter or optimizer buffer holds junk (fresh pseudo-random values: freed memory has no defined
value, as z3's holdings have it), so an op that reads or reduces a shard it should not have goes
wrong rather than summing zeros by luck; a gradient buffer is zero there, and ``live`` says which
of its positions hold a current value.
Gradients have two buffers: ``fresh``, the current micro-batch's, and ``G``, their sum over
the step so far; ``live`` and ``live_fresh`` mark the positions holding a current value.
``gathered`` and ``scattered`` record along which axes the collectives so far have made a
group's parameters whole, or scattered its gradients: a collective along one axis acts on what
the earlier ones along other axes left (ZeRO++ hpZ).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from formal._placement import Placement
from formal._reference import PRIME, Arithmetic, Array, Numbers, Optimizer, ReferenceModel
from formal._sim_mesh import Device, _Layout, _Mesh
from formal._vocab import Axis, Group, Mode, State

P, O, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS  # noqa: E741
Stores = dict[Device, dict[Group, Array]]
Masks = dict[Device, dict[Group, npt.NDArray[np.bool_]]]


class _States:
    """Every device's buffers of parameters, gradients and optimizer state, and the host store."""

    def __init__(
        self, model: ReferenceModel, pl: Placement, mesh: _Mesh, layout: _Layout, optimizer: Optimizer, numbers: Numbers
    ) -> None:
        self.model, self.pl, self.mesh, self.layout = model, pl, mesh, layout
        self.optimizer, self.n = optimizer, numbers
        self.groups = tuple(pl.groups(P))
        # Offloaded by the axis-free modifiers, or by a per-axis O (the whole group on the host,
        # as z3's holdings have it: ``_AxisRun.on_host``).
        self.offloaded = {
            st: {
                g
                for g in self.groups
                if pl.local_mode(st, g) is Mode.OFFLOADED or any(pl.mode(st, g, a) is Mode.OFFLOADED for a in pl.axes)
            }
            for st in (P, O, G)
        }
        # No buffer until ``reset`` allocates them.
        self.P: Stores = {}
        self.G: Stores = {}
        self.fresh: Stores = {}
        self.O: Stores = {}
        self.host: dict[tuple[State, Device, Group], Array] = {}
        # Gradient positions holding a current value (a summand or a sum) in each buffer: what
        # an all-reduce acts on besides the placement's share (an all-reduce placed before a
        # reduce-scatter reduces the whole unsharded buffer, as an implementation would).
        self.live: Masks = {}
        self.live_fresh: Masks = {}
        # Collectives along several axes of one group act on what the earlier ones left: a gather
        # on the parameters made whole along the axes gathered since the last free (ZeRO++ hpZ:
        # within the node, then across nodes), a reduce-scatter on the gradient still whole along
        # the axes the program scatters it along later. ``scattered`` is keyed by (per micro-batch
        # buffer, group); ``regathered``, the axes a gradient was all-gathered along after
        # being scattered there (whole again: later scatters no longer nest inside them).
        self.gathered: dict[Group, set[Axis]] = {g: set() for g in self.groups}
        self.scattered: dict[tuple[bool, Group], set[Axis]] = {}
        self.regathered: dict[tuple[bool, Group], set[Axis]] = {}
        self.accumulated = 0  # micro-batches accumulated into ``.grad`` so far this step
        self._junk = np.random.default_rng(0x5EED)

    def junk(self, shape: int | tuple[int, ...]) -> Array:
        """Values of freed or never-written memory: pseudo-random, nonzero, reproducible."""
        if self.n.kind is Arithmetic.FIELD:
            return self.n.encode(self._junk.integers(1, PRIME, size=shape))
        return self._junk.uniform(1.0, 2.0, size=shape) * 1e3

    def reset(self, p0: dict[Group, Array]) -> None:
        """Every buffer zero but the parameters each device (or the host) holds of ``p0``."""
        n, model = self.n, self.model
        self.P, self.G, self.fresh, self.O, self.host = {}, {}, {}, {}, {}
        self.live, self.live_fresh = {}, {}
        self.gathered = {g: set() for g in self.groups}
        self.scattered = {}
        self.regathered = {}
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
                self.P[dev][g] = self.junk(size)
                target = self.P[dev][g]
                if g in self.offloaded[P]:
                    target = self.host.setdefault((P, dev, g), n.zeros(size))
                target[hold] = p0[g][hold]
                o_junk = ~self.layout.mask(O, g, dev)
                self.O[dev][g][:, o_junk] = self.junk((self.optimizer.slots, int(o_junk.sum())))
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

    def array(self, state: State, dev: Device, g: Group, per_mb: bool) -> Array:
        """The buffer an op on ``state`` acts on (``per_mb``: a gradient op of each micro-batch)."""
        match state:
            case State.PARAMETERS:
                return self.P[dev][g]
            case State.GRADIENTS:
                return self.fresh[dev][g] if per_mb else self.G[dev][g]
            case State.OPTIMIZER:
                return self.O[dev][g]
            case _:
                raise AssertionError(state)

    def start_step(self) -> None:
        """A step starts with no gradient."""
        for dev in self.mesh.devices:
            for g in self.groups:
                self.G[dev][g][...] = 0
                self.live[dev][g][...] = False
        self.scattered.clear()
        self.regathered.clear()
        self.accumulated = 0

    def start_micro_batch(self) -> None:
        """A micro-batch's gradients start from zero (and scattered along no axis yet)."""
        for dev in self.mesh.devices:
            for g in self.groups:
                self.fresh[dev][g][...] = 0
        for g in self.groups:
            self.scattered.pop((True, g), None)
            self.regathered.pop((True, g), None)

    def mark_computed(self) -> None:
        """After the backward every position the device's computation reads has a summand."""
        for dev in self.mesh.devices:
            for g in self.groups:
                self.live_fresh[dev][g] = self.layout.mask(None, g, dev).copy()

    def accumulate(self) -> None:
        """The micro-batch's gradients (as its ops left them) join the step's sum."""
        self.accumulated += 1
        for dev in self.mesh.devices:
            for g in self.groups:
                self.G[dev][g] = self.n.add(self.G[dev][g], self.fresh[dev][g])
                self.live[dev][g] |= self.live_fresh[dev][g]
        # ``.grad`` is now cut as the micro-batch's gradient was (whole, or scattered as produced):
        # what ops on the earlier buffer scattered is summed with a whole gradient.
        for g in self.groups:
            self.scattered[(False, g)] = set(self.scattered.get((True, g), ()))
            self.regathered[(False, g)] = set(self.regathered.get((True, g), ()))

    def free_parameters(self, after_backward: bool) -> None:
        """Gathered copies are freed after the forward, or after the backward if kept through it."""
        for g in self.groups:
            # After the forward, what was gathered along the holding axes stays (FSDP SGO: all of
            # it; ZeRO++ hpZ: the secondary partition, whole across nodes), fetched offloaded
            # parameters included.
            held = (
                frozenset()
                if after_backward
                else frozenset(a for a in self.mesh.axes if self.pl.entry(P, g, a).keep_gathered)
            )
            self.gathered[g] &= held
            for dev in self.mesh.devices:
                if g in self.offloaded[P] and not held:
                    self.P[dev][g][...] = self.junk(self.P[dev][g].shape)
                else:
                    freed = ~self.layout.mask(P, g, dev, skip=held)
                    self.P[dev][g][freed] = self.junk(int(freed.sum()))

    def free_gradients(self, arrays: Stores, live: Masks, groups: Iterable[Group] | None = None) -> None:
        """Gradients outside the device's holding are dropped, in ``arrays`` and from ``live``
        (of ``groups``; None: every group)."""
        for g in self.groups if groups is None else groups:
            for dev in self.mesh.devices:
                held = self.layout.mask(G, g, dev)
                live[dev][g] &= held
                # A reduce-scatter leaves the device its shard: the rest of the buffer is freed
                # with the placement's (z3's "freed outside the shard"), whatever the mode says.
                arrays[dev][g][~live[dev][g]] = 0
