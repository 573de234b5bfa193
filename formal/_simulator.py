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
2. BACKWARD: the same, then the backward; the micro-batch's gradient ops act on the buffer
   docs/semantics.md ("Gradient buffers") gives them: the BACKWARD gradient ops and the GRAD_SYNC
   ops whose count is the number of micro-batches (reduce-scatter as produced, ZeRO-2/3 under
   accumulation) on the fresh gradient, which is then accumulated, and those that name the
   accumulated buffer after that, on ``.grad`` (forward-phase gradient ops act on ``.grad`` too,
   as the earlier micro-batches left it);
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

This module keeps the entry points and the step loop; the work is done by collaborators, each
owning its state: ``formal._sim_mesh`` (the mesh, which elements each device holds, how the
batch divides), ``formal._sim_states`` (the devices' buffers and the host store),
``formal._sim_collectives`` (the program's ops on model states, the traffic tallies),
``formal._sim_passes`` (the model's forward and backward with its activation exchanges),
``formal._sim_experts`` (the mixture-of-experts block, its experts split along ep and its tokens
routed by the program's all-to-all) and ``formal._sim_results`` (the results, the judge of every
read, and ``NotSimulated``: what the simulator does not run, and why).
"""

from __future__ import annotations

import sympy as sp

from formal._costs import host_memory, state_memory
from formal._exact import exact_fraction
from formal._model import DEFAULT_PRECISION, Precision
from formal._program import StepProgram, derive_program, group_sizes, refuse_unmodelled_ops
from formal._reference import (
    Arithmetic,
    Array,
    Batch,
    Numbers,
    Optimizer,
    ReferenceModel,
    StepRecord,
    initial_parameters,
    make_data,
    train_single_device,
)
from formal._sim_collectives import _StateOps, _Traffic
from formal._sim_experts import _Experts
from formal._sim_mesh import _Geometry, _Layout, _Mesh
from formal._sim_passes import Reads, _Exchanges, _Passes
from formal._sim_results import Divergence, NotSimulated, OpTraffic, SimulationResult, _Diverged, _Judge
from formal._sim_states import _States
from formal._strategies import Composition
from formal._vocab import EXPERTS, Axis, Buffer, Group, OpKind, Phase, State, gradient_buffer
from formal.errors import SimulationError

P, O, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS  # noqa: E741


class Simulator:
    """Runs one step program on the reference model over a mesh, beside single-device training.

    Its collaborators: ``layout`` (which elements each device holds and reads), ``states`` (the
    devices' buffers), ``state_ops`` (the program's ops on them), ``passes`` (the model's forward
    and backward, with ``exchanges`` for its activations), ``tallies`` (what each op sent) and
    ``judge`` (each read against single-device training). The simulator runs the step loop.
    """

    def __init__(
        self,
        program: StepProgram,
        model: ReferenceModel,
        optimizer: Optimizer,
        numbers: Numbers,
        precision: Precision = DEFAULT_PRECISION,
    ) -> None:
        pl = program.placement
        self.program, self.model, self.optimizer, self.n, self.precision = program, model, optimizer, numbers, precision
        self.pl = pl
        optimizer.check(numbers)
        for axis, d in pl.mesh:
            if not isinstance(d, sp.Integer) and not isinstance(d, int):
                raise SimulationError(f"{axis.value}: symbolic degree {d}; the simulator needs numbers")
        self.mesh = _Mesh(pl)
        unknown = set(pl.groups(P)) ^ set(model.groups())
        if unknown:
            raise SimulationError(
                f"groups {sorted(g.name for g in unknown)}: the program and the reference model differ in them"
            )
        for axis in self.mesh.axes:
            split = [g for g in model.groups() if pl.computes_sharded(axis, g)]
            if axis.kind.places_experts and split and split != [EXPERTS]:
                raise SimulationError(f"{axis.value}: only the experts' computation is split along it, not {split}")
            if not (axis.kind.splits_computation or axis.kind.is_pipeline) and split:
                raise SimulationError(f"{axis.value}: computation split along this axis is not modelled")
        self.layout = _Layout(model, pl, self.mesh)
        self.geometry = _Geometry.of(model, pl, self.mesh)
        self.m, self.replicas = self.geometry.m, self.geometry.replicas
        self.ops = program.ops
        for i, op in enumerate(self.ops):
            if op.buffer is not None and op.state is not G:
                raise SimulationError(f"{op}: a buffer applies to gradient ops only")
            if op.state is G:
                self._buffer(i)  # refuses a fresh buffer where none exists
        self.tallies = _Traffic(program, precision)
        self.judge = _Judge(model, self.mesh, numbers)
        self.states = _States(model, pl, self.mesh, self.layout, optimizer, numbers)
        self.groups, self.offloaded = self.states.groups, self.states.offloaded
        self.state_ops = _StateOps(
            program, self.mesh, self.layout, self.states, self.tallies, self.judge, optimizer, numbers, precision
        )
        self.exchanges = _Exchanges(program, self.mesh, numbers, self.tallies)
        moe = _Experts(model, pl, program, self.mesh, numbers, self.states, self.tallies)
        self.passes = _Passes(
            model, pl, self.mesh, self.layout, self.geometry, numbers, self.states, self.exchanges, moe
        )

    # ---- one step ----------------------------------------------------------------------------
    def _phase_ops(self, phase: Phase, states: tuple[State, ...]) -> list[int]:
        return [i for i, op in enumerate(self.ops) if op.phase is phase and op.state in states]

    def _fetch_and_read(self, phase: Phase, mb: int, states: tuple[State, ...]) -> Reads:
        """A phase's ops in program order; each ``COMPUTE`` read is checked and remembered.

        A group the program never reads in this phase is read as the phase's ops leave it.
        """
        held = self.states.P
        read: Reads = {dev: {} for dev in self.mesh.devices}
        for i in self._phase_ops(phase, states):
            op = self.ops[i]
            if op.kind is OpKind.COMPUTE and op.state is P:
                self.state_ops.run(i)
                for dev in self.mesh.devices:
                    pos = self.layout.compute(op.group, dev)
                    self.judge.check(
                        P,
                        op.group,
                        dev,
                        pos,
                        held[dev][op.group][pos],
                        self.judge.record.parameters[op.group][pos],
                        phase.value,
                        mb,
                    )
                    read[dev].setdefault(op.group, held[dev][op.group].copy())
            elif op.kind is not OpKind.COMPUTE:
                self.state_ops.run(i)
        for dev in self.mesh.devices:
            for g in self.groups:
                read[dev].setdefault(g, held[dev][g].copy())
        return read

    def _per_micro_batch(self, index: int) -> bool:
        op = self.ops[index]
        return self.m > 1 and int(op.count) == self.m

    def _buffer(self, index: int) -> Buffer:
        """The gradient buffer op ``index`` acts on (``formal._vocab.gradient_buffer``)."""
        op = self.ops[index]
        per_mb = op.phase is Phase.GRAD_SYNC and self._per_micro_batch(index)
        buffer = gradient_buffer(op.phase, per_mb, op.buffer)
        if buffer is Buffer.FRESH and op.phase is not Phase.BACKWARD and not per_mb:
            raise SimulationError(f"{op}: a fresh gradient exists only in a micro-batch's backward")
        return buffer

    def _step(self, batch: Batch) -> None:
        st, run_op = self.states, self.state_ops.run
        st.start_step()
        sync = self._phase_ops(Phase.GRAD_SYNC, (G, P, O))
        per_mb = [i for i in sync if self._per_micro_batch(i)]
        once = [i for i in sync if i not in per_mb]
        # docs/semantics.md, "Gradient buffers": the ops on the fresh gradient, then its
        # accumulation into .grad, then the micro-batch's ops on the accumulated buffer.
        loop = [*self._phase_ops(Phase.BACKWARD, (G,)), *per_mb]
        fresh = [i for i in loop if self._buffer(i) is Buffer.FRESH]
        # Each group's own: a group whose gradient no op reduce-scatters per micro-batch (along
        # an axis of the mesh: one of degree 1 cuts nothing, an all-reduce neither) keeps a
        # full-size ``.grad`` whatever the others do (FSDP2 syncs per parameter group).
        scattered_as_produced = frozenset(
            self.ops[i].group
            for i in fresh
            if i in per_mb and self.ops[i].kind is OpKind.REDUCE_SCATTER and self.ops[i].axis in self.mesh.degrees
        )
        for mb in range(self.m):
            forward_p = self._fetch_and_read(Phase.FORWARD, mb, (P, O, G))
            st.start_micro_batch()
            st.free_parameters(after_backward=False)
            # The forward math reads the parameters as they were at each group's forward read,
            # the backward (and its replay under recomputation) as at its backward read.
            backward_p = self._fetch_and_read(Phase.BACKWARD, mb, (P, O))
            self.passes.micro_batch(batch, mb, forward_p, backward_p)
            st.mark_computed()
            for i in fresh:
                run_op(i, per_mb=True)
            if scattered_as_produced:
                st.free_gradients(st.fresh, st.live_fresh, scattered_as_produced)
            st.accumulate()
            if scattered_as_produced:
                # No full-size accumulator (ZeRO-2/3, FSDP under accumulation): ``.grad`` holds
                # the device's shard only, whatever earlier ops wrote outside it.
                st.free_gradients(st.G, st.live, scattered_as_produced)
            for i in loop:
                if i not in fresh:
                    run_op(i)
            st.free_parameters(after_backward=True)
        for i in once:
            run_op(i)
        st.free_gradients(st.G, st.live)
        for i in self._phase_ops(Phase.OPTIMIZER, (P, O, G)):
            run_op(i)
        for i in self._phase_ops(Phase.REFRESH, (P, O, G)):
            run_op(i)

    # ---- driver ------------------------------------------------------------------------------
    def run(
        self,
        data: tuple[Batch, ...],
        records: tuple[StepRecord, ...],
        p0: dict[Group, Array],
        stop_at_divergence: bool = True,
    ) -> tuple[Divergence | None, bool]:
        """Train on ``data`` from ``p0``, each step judged against ``records``.

        Returns the first divergence (None: none) and whether every step ran.
        """
        self.states.reset(p0)
        divergence = None
        for k, (batch, ref) in enumerate(zip(data, records, strict=True), start=1):
            self.judge.step, self.judge.ref = k, ref
            try:
                self._step(batch)
            except _Diverged as err:
                divergence = err.divergence
                if stop_at_divergence:
                    return divergence, False
        return divergence, True

    # ---- cost figures ------------------------------------------------------------------------
    def traffic(self, steps: int) -> tuple[OpTraffic, ...]:
        """What each collective and transfer sent per step on its most loaded device, and the cost model's figure."""
        return self.tallies.report(steps)

    def memory(self) -> tuple[tuple[tuple[str, State, int, int], ...], tuple[tuple[str, int, int], ...]]:
        sizes = group_sizes(self.model.transformer())
        rows = []
        host_rows = []
        for stage in range(self.layout.p):
            name = self.layout.stage_name(stage)
            devs = self.mesh.stage_devices(stage)
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


def simulate_program(
    program: StepProgram,
    model: ReferenceModel,
    *,
    optimizer: Optimizer | None = None,
    arithmetic: Arithmetic = Arithmetic.FIELD,
    steps: int = 2,
    seed: int = 0,
    precision: Precision = DEFAULT_PRECISION,
    stop_at_divergence: bool = True,
) -> SimulationResult:
    """Run ``program`` on the simulated mesh and single-device training side by side.

    ``steps`` training steps are checked, plus one more whose reads check the last update.
    """
    refuse_unmodelled_ops(program, "the simulator")
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
        matches=divergence is None,
        divergence=divergence,
        steps=steps + 1,
        devices=len(sim.mesh.devices),
        arithmetic=arithmetic,
        traffic=sim.traffic(steps + 1) if complete else (),
        memory=memory,
        host=host,
        complete=complete,
    )


def simulate(
    composition: Composition,
    model: ReferenceModel | None = None,
    *,
    program: StepProgram | None = None,
    **kwargs: object,
) -> SimulationResult:
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
    hidden, heads, ffn and vocabulary by tp, sequence by cp (x tp under sequence parallelism),
    experts by ep, with four experts when ep splits a dense ``base``); biases as ``base`` has them."""
    base = base or ReferenceModel()
    mesh = composition.mesh()
    t, p, cp, ep = mesh.get(Axis.TP, 1), mesh.get(Axis.PP, 1), mesh.get(Axis.CP, 1), mesh.get(Axis.EP, 1)
    v = composition.options.virtual_stages
    layers = _multiple(base.layers, p * v)
    hidden = _multiple(base.hidden, t)
    heads = _multiple(base.heads, t)
    while hidden % heads:
        hidden += t
    seq = _multiple(base.seq, cp * (t if composition.options.sequence_parallel else 1))
    return ReferenceModel(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=_multiple(base.ffn, t),
        vocab=_multiple(base.vocab, t),
        seq=seq,
        micro_batch=base.micro_batch,
        tied=base.tied,
        bias=base.bias,
        experts=_multiple(base.experts or (4 if ep > 1 else 0), ep),
    )


def _multiple(value: int, k: int) -> int:
    return value if value % k == 0 else (value // k + 1) * k


__all__ = [
    "Divergence",
    "NotSimulated",
    "OpTraffic",
    "SimulationResult",
    "Simulator",
    "reference_for",
    "simulate",
    "simulate_program",
]
