"""The reference model's mixture-of-experts block on the simulated mesh, with expert parallelism.

Each layer's block replaces the MLP (``formal._reference``): a router scores every expert, each
position goes to one expert by hash routing on its token id (``formal._reference.route``), and
the expert's output is gated by the router's score of it. Under expert parallelism the experts
are split along ``ep`` (whole experts per rank, the flat shard of an expert-major group) and a
position's hidden state travels to the rank owning its expert and back by all-to-all (dispatch
and combine, GShard, Lepikhin et al. 2020; Megatron-LM's ``MoEAlltoAllTokenDispatcher``); in the
backward its gradient travels the same way.

The all-to-all is an op of the program, run as the program lists it: each listed all-to-all
transposes the exchange once (as in ``formal._activation_flow``), so an odd number of them per
site delivers a position to its expert's owner and an even number (none included) leaves it on
its own rank, which computes it with what it holds of that expert (zeros where it holds
nothing) and keeps the gradient it produces there (freed with what it does not hold).
"""

from __future__ import annotations

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

    routed: npt.NDArray[np.int64]  # each position's expert
    gate: Array  # the router's score of it
    expert_out: Array  # the expert's output, before the gate
    ys: dict[int, Array]  # per expert, fc1's output at its positions


class _Experts:
    """The MoE block of every layer on the devices of a stage (no tp split of the experts)."""

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
        self.model, self.mesh, self.n, self.states, self.traffic = model, mesh, numbers, states, traffic
        self.ep = mesh.degree(Axis.EP)
        if model.experts and model.experts % self.ep:
            raise SimulationError(f"experts={model.experts} do not split into ep({self.ep})")
        if model.experts and mesh.degree(Axis.TP) > 1:
            raise SimulationError("experts split along tp are not modelled by the reference model")
        self.a2a: dict[Phase, list[int]] = {
            phase: [
                i
                for i, op in enumerate(program.ops)
                if op.kind is OpKind.ALL_TO_ALL
                and op.state is State.ACTIVATIONS
                and op.group == LAYER_IO
                and op.axis is Axis.EP
                and op.phase is phase
            ]
            for phase in (Phase.FORWARD, Phase.BACKWARD)
        }
        self.sharded = self.ep > 1 and pl.computes_sharded(Axis.EP, EXPERTS)
        self.tokens: dict[Device, npt.NDArray[np.int64]] = {}  # this micro-batch's token ids per device
        self.saved: dict[tuple[int, Device], _Routed] = {}  # per (layer, device): what the backward reads

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

    def _weight(self, reads: Reads, dev: Device, which: int, layer: int) -> Array:
        out: Array = reads[dev][EXPERTS][self.model.tensors(EXPERTS)[which].index[layer]]
        return out

    def forward(self, layer: int, w: PerDevice, phase: Phase, reads: Reads) -> PerDevice:
        """``gate * expert(w)`` at every position (what the backward reads is kept per layer)."""
        n, model = self.n, self.model
        self._tally(phase, w)
        out: PerDevice = {}
        for s, ws in w.items():
            routed = route(model, self.tokens[s])
            router = reads[s][ROUTER][model.tensors(ROUTER)[0].index[layer]]
            gate = np.take_along_axis(n.mm(ws, router), routed[..., None], axis=2)[..., 0]
            expert_out = n.zeros(ws.shape)
            ys: dict[int, Array] = {}
            for e in range(model.experts):
                at = routed == e
                c = self._where(s, e, phase)
                y = n.mm(ws[at], self._weight(reads, c, 0, layer)[e])
                if model.bias:
                    y = n.add(y, self._weight(reads, c, 2, layer)[e])
                expert_out[at] = n.mm(y, self._weight(reads, c, 1, layer)[e])
                ys[e] = y
            out[s] = n.mul(expert_out, gate[..., None])
            self.saved[(layer, s)] = _Routed(routed, gate, expert_out, ys)
        return out

    def _add(self, dev: Device, group: Group, which: int, layer: int, expert: int | None, value: Array) -> None:
        index = self.model.tensors(group)[which].index[layer]
        if expert is not None:
            index = index[expert]
        arr = self.states.fresh[dev][group]
        arr[index] = self.n.add(arr[index], value)

    def backward(self, layer: int, w: PerDevice, dout: PerDevice, reads: Reads) -> PerDevice:
        """The input gradient; the router's gradient on the source, the experts' where computed."""
        n, model = self.n, self.model
        h = model.hidden
        phase = Phase.BACKWARD
        self._tally(phase, dout)
        dw: PerDevice = {}
        for s, ds in dout.items():
            kept = self.saved[(layer, s)]
            routed, gate, expert_out, ys = kept.routed, kept.gate, kept.expert_out, kept.ys
            ws = w[s]
            router = reads[s][ROUTER][model.tensors(ROUTER)[0].index[layer]]
            dgate = n.total(n.mul(ds, expert_out), axis=2)
            dscores = n.zeros((*ws.shape[:2], model.experts))
            np.put_along_axis(dscores, routed[..., None], dgate[..., None], axis=2)
            self._add(s, ROUTER, 0, layer, None, n.mm(ws.reshape(-1, h).T, dscores.reshape(-1, model.experts)))
            dws = n.mm(dscores, router.T)
            dexp = n.mul(ds, gate[..., None])
            for e in range(model.experts):
                at = routed == e
                c = self._where(s, e, phase)
                d_e = dexp[at]
                self._add(c, EXPERTS, 1, layer, e, n.mm(ys[e].T, d_e))
                dy = n.mm(d_e, self._weight(reads, c, 1, layer)[e].T)
                self._add(c, EXPERTS, 0, layer, e, n.mm(ws[at].T, dy))
                if model.bias:
                    self._add(c, EXPERTS, 2, layer, e, n.total(dy, axis=0))
                dws[at] = n.add(dws[at], n.mm(dy, self._weight(reads, c, 0, layer)[e].T))
            dw[s] = dws
        return dw
