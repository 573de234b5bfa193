"""The reference model's mixture-of-experts block on the simulated mesh, with expert parallelism.

Each layer's block replaces the MLP (``formal._reference``): a router scores every expert, each
position goes to one expert by hash routing on its token id (``formal._reference.route``), and
the expert's output is gated by the router's score of it. Under expert parallelism the experts
are split along ``ep`` (whole experts per rank, the flat shard of an expert-major group) and a
position's hidden state travels to the rank owning its expert and back by all-to-all (dispatch
and combine, GShard, Lepikhin et al. 2020; Megatron-LM's ``MoEAlltoAllTokenDispatcher``); in the
backward its gradient travels the same way. Under tp each expert is split like the MLP (fc1 by
columns, fc2 by rows: Megatron-LM's expert tensor parallelism) and its output reduced across tp
before the gate scales it; under sequence parallelism the router scores each rank's own sequence
shard, so its gradient is a partial sum across tp (``formal._program.SEQUENCE_REGION_GROUPS``).

The all-to-all is an op of the program, run as the program lists it: each listed all-to-all
transposes the exchange once (as in ``formal._activation_flow``), so an odd number of them per
site delivers a position to its expert's owner and an even number (none included) leaves it on
its own rank, which computes it with what it holds of that expert (zeros where it holds
nothing) and keeps the gradient it produces there (freed with what it does not hold).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from formal._placement import Placement
from formal._program import StepProgram
from formal._reference import Array, Numbers, ReferenceModel, route
from formal._sim_collectives import _Traffic
from formal._sim_mesh import Device, PerDevice, _Mesh
from formal._sim_states import _States
from formal._vocab import EXPERTS, LAYER_IO, ROUTER, Axis, Group, OpKind, Phase, State
from formal.errors import SimulationError

Reads = dict[Device, dict[Group, Array]]


@dataclass(frozen=True)
class _Routed:
    """What one layer's forward on one device keeps for the backward."""

    routed: npt.NDArray[np.int64]  # each position's expert (the whole sequence)
    routes: npt.NDArray[np.int64]  # the same on the device's own positions
    gate: Array  # the router's score of its expert, on the device's own positions
    expert_out: Array  # the experts' reduced output there, before the gate
    ys: dict[int, Array]  # per expert, fc1's output at its positions (of its tp slice)


class _Experts:
    """The MoE block of every layer on the devices of a stage."""

    def __init__(
        self,
        model: ReferenceModel,
        pl: Placement,
        program: StepProgram,
        mesh: _Mesh,
        numbers: Numbers,
        states: _States,
        traffic: _Traffic,
    ) -> None:
        self.model, self.pl, self.mesh, self.n, self.states, self.traffic = model, pl, mesh, numbers, states, traffic
        self.t = mesh.degree(Axis.TP)
        self.ep = mesh.degree(Axis.EP)
        if model.experts and model.experts % self.ep:
            raise SimulationError(f"experts={model.experts} do not split into ep({self.ep})")
        self.a2a: dict[Phase, list[int]] = {
            phase: [
                i
                for i, op in enumerate(program.ops)
                if op.kind is OpKind.ALL_TO_ALL
                and op.state is State.ACTIVATIONS
                and op.group == LAYER_IO
                and op.axis is not None
                and op.axis.kind.places_experts
                and op.phase is phase
            ]
            for phase in (Phase.FORWARD, Phase.BACKWARD)
        }
        self.sharded = self.ep > 1 and pl.computes_sharded(Axis.EP, EXPERTS)
        self.tokens: dict[Device, npt.NDArray[np.int64]] = {}  # this micro-batch's token ids per device
        self.saved: dict[tuple[int, Device], _Routed] = {}  # per (layer, device): what the backward reads
        # The layer's exchanges around the block, set by the pass that runs it (``bind``).
        self.split: Callable[[Device, Array], Array] = lambda d, v: v
        self.reduce: Callable[[PerDevice, Phase], PerDevice] = lambda v, phase: v
        self.gather: Callable[[PerDevice], PerDevice] = lambda v: v
        self.reduce_input: Callable[[PerDevice], PerDevice] = lambda v: v

    def bind(
        self,
        split: Callable[[Device, Array], Array],
        reduce: Callable[[PerDevice, Phase], PerDevice],
        gather: Callable[[PerDevice], PerDevice],
        reduce_input: Callable[[PerDevice], PerDevice],
    ) -> None:
        """The pass's sequence split, the block's output reduction, the backward's gather of the
        output gradient and its input-gradient reduction (all as the program lists them)."""
        self.split, self.reduce, self.gather, self.reduce_input = split, reduce, gather, reduce_input

    def _where(self, source: Device, expert: int, phase: Phase) -> Device:
        """The device that computes ``source``'s positions routed to ``expert`` in ``phase``."""
        if not self.sharded or len(self.a2a[phase]) % 2 == 0:
            return source
        return self.mesh.moved(source, Axis.EP, expert // (self.model.experts // self.ep))

    def _tally(self, phase: Phase, values: PerDevice) -> None:
        """Dispatch and combine: two all-to-alls of each device's positions per listed op."""
        if self.ep == 1:
            return
        for index in self.a2a[phase]:
            for d, v in values.items():
                for _ in range(2):
                    self.traffic.activations(index, [d], v.size, OpKind.ALL_TO_ALL, self.ep)

    def _index(self, dev: Device, group: Group, which: int, layer: int) -> Array:
        """One layer's flat indices of a tensor on a device, cut to its tp slice when split there."""
        t = self.model.tensors(group)[which]
        index: Array = t.index[layer]
        if t.tp_dim is not None and self.t > 1 and self.pl.computes_sharded(Axis.TP, group):
            r, n_ = self.mesh.coord(dev, Axis.TP), index.shape[t.tp_dim]
            index = np.take(index, range(r * n_ // self.t, (r + 1) * n_ // self.t), axis=t.tp_dim)
        return index

    def _weight(self, reads: Reads, dev: Device, group: Group, which: int, layer: int) -> Array:
        out: Array = reads[dev][group][self._index(dev, group, which, layer)]
        return out

    def forward(self, layer: int, w: PerDevice, w_full: PerDevice, phase: Phase, reads: Reads) -> PerDevice:
        """``gate * expert(w)`` at every position (what the backward reads is kept per layer).

        ``w``: each device's input (a sequence shard under sequence parallelism), which the router
        scores; ``w_full``: the whole sequence, which the experts compute, split by tp like the MLP
        (fc1 by columns, fc2 by rows): their output is a partial sum that the block's reduction
        (Megatron's g operator, ``reduce``) completes, before the gate scales it.
        """
        n, model = self.n, self.model
        self._tally(phase, w)
        partial: PerDevice = {}
        gates: PerDevice = {}
        routes: dict[Device, npt.NDArray[np.int64]] = {}
        ys: dict[Device, dict[int, Array]] = {}
        for s, ws in w.items():
            routes[s] = route(model, self.split(s, self.tokens[s]))
            router = self._weight(reads, s, ROUTER, 0, layer)
            gates[s] = np.take_along_axis(n.mm(ws, router), routes[s][..., None], axis=2)[..., 0]
            routed = route(model, self.tokens[s])
            expert_out = n.zeros((*w_full[s].shape[:2], model.hidden))
            ys[s] = {}
            for e in range(model.experts):
                at = routed == e
                c = self._where(s, e, phase)
                y = n.mm(w_full[s][at], self._weight(reads, c, EXPERTS, 0, layer)[e])
                if model.bias:
                    y = n.add(y, self._weight(reads, c, EXPERTS, 2, layer)[e])
                expert_out[at] = n.mm(y, self._weight(reads, c, EXPERTS, 1, layer)[e])
                ys[s][e] = y
            partial[s] = expert_out
        reduced = self.reduce(partial, phase)
        for s in w:
            self.saved[(layer, s)] = _Routed(route(model, self.tokens[s]), routes[s], gates[s], reduced[s], ys[s])
        return {s: n.mul(reduced[s], gates[s][..., None]) for s in w}

    def _add(self, dev: Device, group: Group, which: int, layer: int, expert: int | None, value: Array) -> None:
        index = self._index(dev, group, which, layer)
        if expert is not None:
            index = index[expert]
        arr = self.states.fresh[dev][group]
        arr[index] = self.n.add(arr[index], value)

    def backward(self, layer: int, w: PerDevice, w_full: PerDevice, dout: PerDevice, reads: Reads) -> PerDevice:
        """The input gradient; the router's gradient on the source, the experts' where computed.

        The gate's gradient and the router's are taken on the device's own positions; the experts'
        output gradient is made whole along the sequence (``gather``, the backward of a
        reduce-scatter) and their input gradient, a partial sum across tp, reduced
        (``reduce_input``, Megatron's f operator) before the router's part is added.
        """
        n, model = self.n, self.model
        h = model.hidden
        phase = Phase.BACKWARD
        self._tally(phase, dout)
        d_router: PerDevice = {}
        d_expert: PerDevice = {}
        for s, ds in dout.items():
            kept = self.saved[(layer, s)]
            dgate = n.total(n.mul(ds, kept.expert_out), axis=2)
            dscores = n.zeros((*w[s].shape[:2], model.experts))
            np.put_along_axis(dscores, kept.routes[..., None], dgate[..., None], axis=2)
            self._add(s, ROUTER, 0, layer, None, n.mm(w[s].reshape(-1, h).T, dscores.reshape(-1, model.experts)))
            d_router[s] = n.mm(dscores, self._weight(reads, s, ROUTER, 0, layer).T)
            d_expert[s] = n.mul(ds, kept.gate[..., None])
        d_full = self.gather(d_expert)
        partial: PerDevice = {}
        for s in dout:
            kept = self.saved[(layer, s)]
            dws = n.zeros(w_full[s].shape)
            for e in range(model.experts):
                at = kept.routed == e
                c = self._where(s, e, phase)
                d_e = d_full[s][at]
                self._add(c, EXPERTS, 1, layer, e, n.mm(kept.ys[e].T, d_e))
                dy = n.mm(d_e, self._weight(reads, c, EXPERTS, 1, layer)[e].T)
                self._add(c, EXPERTS, 0, layer, e, n.mm(w_full[s][at].T, dy))
                if model.bias:
                    self._add(c, EXPERTS, 2, layer, e, n.total(dy, axis=0))
                dws[at] = n.mm(dy, self._weight(reads, c, EXPERTS, 0, layer)[e].T)
            partial[s] = dws
        reduced = self.reduce_input(partial)
        return {s: n.add(reduced[s], d_router[s]) for s in dout}
