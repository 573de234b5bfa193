"""Refinement: the shipped encoder (``formal._smt.decide``, what the CLI runs) and the proof machine
(``proofs._machine``) give the same verdict, group by group, on the programs the machine models.

The other obligations reason about the machine alone, so a bug in the encoder the CLI uses would
be invisible to them. Here a step program is judged twice: by ``decide`` (a group is refuted when
some violation names it) and by the machine on the program's translation (``proofs._translate``:
the group's modes, gathers, reductions, scale, refresh and fetches along every axis). The two must
agree on every group the machine models faithfully; ``scope`` says why a group is left out
otherwise (an op the machine has no feature for, ops in another order than its fixed one, a host
optimizer, activation collectives other than the derived ones). A group left out is counted,
never taken as agreement.

The obligation ``refinement.shipped_encoder[NAME]`` checks the derived programs of the library
strategy NAME alone on 4 devices (with each modifier ``sufficiency.library`` tries) and with every
other strategy (2 x 2, no modifier), and every program one dropped P/O/G collective or scale away
from the strategy alone. ``tests/test_refinement.py``
runs the same comparison on the programs the exploring generators draw and on every example in
``examples/``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import sympy as sp

from formal._model import Model
from formal._placement import Options
from formal._program import Op, StepProgram, derive_program
from formal._scalars import is_scalar_rule
from formal._smt import decide
from formal._strategies import LIBRARY, Composition
from formal._verdict import Status
from formal._vocab import Group, Mode, OpKind, Phase, State
from proofs._machine import Mesh, Program, constant_features, mesh_name, sufficiency_query
from proofs._obligation import Obligation, Outcome
from proofs._solver import Answer, prove
from proofs._translate import Translated, translate
from proofs.sufficiency import STRATEGIES, compositions_with, model_for, options_for

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741
MAX_MACHINE_DEVICES = 8  # larger meshes are counted out of scope (the machine grows with the devices)
PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.GRAD_SYNC, Phase.OPTIMIZER, Phase.REFRESH)
# The machine's fixed order of one group's ops within a phase (proofs/_machine.py, "The step").
SINGLE_DEGREES = (4,)  # the strategy alone; pairs at 2 x 2 (sufficiency.PAIR_DEGREES)
RANK = {OpKind.HOST_TO_DEVICE: 0, OpKind.ALL_GATHER: 1, OpKind.COMPUTE: 2, OpKind.ALL_REDUCE: 0}
RANK |= {OpKind.REDUCE_SCATTER: 0, OpKind.SCALE: 1, OpKind.OPTIMIZER_STEP: 0}
# (kind, state) -> the phases in which the machine has a feature for it.
MODELLED: dict[tuple[OpKind, State], tuple[Phase, ...]] = {
    (OpKind.HOST_TO_DEVICE, P): (Phase.FORWARD, Phase.BACKWARD),
    (OpKind.ALL_GATHER, P): (Phase.FORWARD, Phase.BACKWARD, Phase.REFRESH),
    (OpKind.COMPUTE, P): (Phase.FORWARD, Phase.BACKWARD),
    (OpKind.ALL_REDUCE, G): (Phase.GRAD_SYNC,),
    (OpKind.REDUCE_SCATTER, G): (Phase.GRAD_SYNC,),
    (OpKind.SCALE, G): (Phase.GRAD_SYNC,),
    (OpKind.OPTIMIZER_STEP, O): (Phase.OPTIMIZER,),
}


def _activations(ops: tuple[Op, ...]) -> list[Op]:
    return [op for op in ops if op.state is A]


def scope(program: StepProgram, model: Model, group: Group) -> str | None:
    """Why the machine cannot judge ``group`` under ``program`` faithfully, or None when it can."""
    pl = program.placement
    if pl.local_mode(O, group) is Mode.OFFLOADED:
        return "host optimizer"
    for state in (P, O, G):
        if any(pl.mode(state, group, a) in (Mode.MATERIALIZED, Mode.OFFLOADED) for a in pl.axes):
            return f"{state.value}: a per-axis mode M or O (the machine has no feature for it)"
    if pl.local_mode(P, group) is Mode.OFFLOADED and any(
        pl.mode(O, group, a).is_sharded or pl.mode(P, group, a).is_sharded for a in pl.axes
    ):
        # The machine keeps one whole host copy of P. Here each rank offloads its own shard
        # (ZeRO-Infinity), which must still be gathered after the fetch, or its own replica,
        # updated only on its optimizer shard, whose other shards go stale on the host.
        return "offloaded P with P or O sharded (the machine keeps one whole host copy)"
    if any(pl.computes_sharded(a, group) and a.kind.splits_data and not a.kind.places_experts for a in pl.axes):
        return "computation split along a data axis (no machine class for it)"
    if any(
        pl.computes_sharded(a, group) and not a.kind.is_pipeline and not pl.mode(G, group, a).is_sharded
        for a in pl.axes
    ):
        # The machine reads a gradient computed in slices as whole wherever G is replicated: it
        # has no computation slices, so it cannot see the stale replica outside a rank's slice
        # (formal._rules, split computation needs a sharded gradient).
        return "computation split over a replicated gradient (the machine has no computation slices)"
    if _activations(program.ops) != _activations(derive_program(pl, model).ops):
        return "activation collectives other than the derived ones"
    mine = [op for op in program.ops if op.group == group and op.state is not A]
    for op in mine:
        if op.phase not in MODELLED.get((op.kind, op.state), ()):
            return f"{op}: no machine feature"
    keys = [(PHASES.index(op.phase), RANK[op.kind]) for op in mine]
    if keys != sorted(keys):
        return "ops in another order than the machine's"
    steps = [op for op in mine if op.kind is OpKind.OPTIMIZER_STEP]
    sharded = [pl.entry(O, group, a) for a in pl.axes if pl.mode(O, group, a).is_sharded]
    if len(steps) != 1 or steps[0].offset != max((e.offset for e in sharded), default=0):
        return "optimizer step other than one on the optimizer's shards"
    for axis in pl.axes:
        here = [op for op in mine if op.axis is axis]
        reductions = [op for op in here if op.kind.is_reduction]
        if len({(op.kind, op.reduce, op.offset, op.participants) for op in reductions}) > 1 or len(reductions) > 2:
            return f"{axis.value}: reductions of different kinds"
        scales = [op for op in here if op.kind is OpKind.SCALE]
        d = pl.degree(axis)
        if len(scales) > 1 or any(op.scale is None or sp.simplify(op.scale * d - 1) != 0 for op in scales):
            return f"{axis.value}: a scale other than one 1/d"
        entry = pl.entry(P, group, axis)
        gathers = [op for op in here if op.kind is OpKind.ALL_GATHER and op.phase is not Phase.REFRESH]
        if any(op.offset != entry.offset for op in gathers):
            return f"{axis.value}: a gather on another partition than P's"
        if len({op.offset for op in here if op.kind is OpKind.ALL_GATHER and op.phase is Phase.REFRESH}) > 1:
            return f"{axis.value}: refreshes on different partitions"
    if any(op.kind is OpKind.SCALE and op.axis is None for op in mine):
        return "a scale without an axis"
    return None


def _translated(program: StepProgram, group: Group) -> Translated:
    """``translate``, plus the one feature it leaves out: an all-gather of P before the forward
    along an axis where P is replicated refreshes the replicas at the start of the step (the
    update's all-gather deferred to the next forward), not a gather of shards."""
    t = translate(program, group)
    pl = program.placement
    axes = list(t.program.axes)
    for k, axis in enumerate(t.axes):
        if pl.mode(P, group, axis).is_sharded:
            continue
        early = [
            op
            for op in program.ops
            if op.group == group
            and op.state is P
            and op.kind is OpKind.ALL_GATHER
            and op.axis is axis
            and op.phase in (Phase.FORWARD, Phase.BACKWARD)
        ]
        if early:
            axes[k] = replace(
                axes[k], gather_forward=False, gather_backward=False, refresh_start=True, refresh_offset=early[0].offset
            )
    return Translated(t.mesh, replace(t.program, axes=tuple(axes)), t.axes)


@dataclass(frozen=True)
class Comparison:
    group: str
    shipped: Status
    machine: Status | None  # None: out of the machine's scope
    reason: str = ""  # why out of scope, or the machine's detail

    @property
    def agrees(self) -> bool:
        return self.machine is None or self.machine is self.shipped


@functools.cache
def _machine(key: tuple[Mesh, Program]) -> Outcome:
    """The machine's own verdict on a concrete program: one step from the invariant, without the
    conditions (they are sufficient, not necessary: a mean all-reduce done twice breaks
    ``grad_reduced_once`` yet averages values already equal). Unsat: every live copy and read is
    right (proved); sat: z3 built a model, data and optimizer on which one is wrong (refuted)."""
    mesh, program = key
    hyps, goal = sufficiency_query(mesh, constant_features(program))
    hyps = {k: v for k, v in hyps.items() if k == "invariant_before_step" or k.startswith("domain")}
    check = prove(hyps, goal)
    match check.answer:
        case Answer.UNSAT:
            return Outcome(Status.PROVED, f"{mesh_name(mesh)}: unsat")
        case Answer.SAT:
            return Outcome(Status.REFUTED, f"{mesh_name(mesh)}: z3 found a counterexample")
        case _:
            return Outcome(Status.UNKNOWN, reason_unknown=check.reason_unknown)


def compare(composition: Composition, program: StepProgram, model: Model) -> list[Comparison]:
    """Per parameter group: the shipped encoder's verdict and the machine's (when in scope).
    Nothing is compared when the shipped verdict is unknown or refutes a rule of no group."""
    verdict = decide(composition, program, model)
    if verdict.status is Status.UNKNOWN:
        return []
    # The machine models gradient integrity and state consistency of the step program; the
    # scalar reductions around it (clipping, loss normalisation, loss scaling, the aux loss)
    # have their own obligations (``proofs/scalars.py``) and are not compared here.
    refuted = {v.group for v in verdict.violations if not is_scalar_rule(v.rule)}
    if None in refuted:
        return []  # a composition rule (prerequisite, activation flow) the machine has no feature for
    out: list[Comparison] = []
    for group in program.placement.groups(P):
        shipped = Status.REFUTED if group.name in refuted else Status.PROVED
        reason = scope(program, model, group)
        if reason is not None:
            out.append(Comparison(group.name, shipped, None, reason))
            continue
        t = _translated(program, group)
        devices = 1
        for ax in t.mesh:
            devices *= ax.degree
        if devices > MAX_MACHINE_DEVICES:
            out.append(Comparison(group.name, shipped, None, f"{devices} devices: beyond the machine's budget"))
            continue
        outcome = _machine((t.mesh, t.program))
        if outcome.status is Status.UNKNOWN:
            out.append(Comparison(group.name, shipped, None, f"machine unknown: {outcome.reason_unknown}"))
            continue
        out.append(Comparison(group.name, shipped, outcome.status, outcome.detail))
    return out


def _dropped(program: StepProgram) -> Iterator[StepProgram]:
    for i, op in enumerate(program.ops):
        if op.state is not A and (op.kind.is_collective or op.kind is OpKind.SCALE):
            yield program.with_ops(o for k, o in enumerate(program.ops) if k != i)


def library_obligation(name: str) -> Outcome:
    compared = disagreed = 0
    first = ""
    for spec in compositions_with(name):
        if len(spec) == 1 and spec[0][1] not in SINGLE_DEGREES:
            continue
        names = tuple(n for n, _ in spec)
        model = model_for(names)
        for options in options_for(names) if len(spec) == 1 else [Options()]:
            comp = Composition(tuple(LIBRARY[n]().with_degree(d) for n, d in spec), options)
            derived = derive_program(comp.placement(model), model)
            # Mutants of the strategy alone; its pairs with every other strategy as derived.
            for program in (derived, *(_dropped(derived) if len(spec) == 1 else ())):
                for c in compare(comp, program, model):
                    if c.machine is None:
                        continue
                    compared += 1
                    if not c.agrees:
                        disagreed += 1
                        first = first or f"{comp}, {c.group}: shipped {c.shipped.label}, machine {c.machine.label}"
    if disagreed:
        return Outcome(Status.REFUTED, f"{disagreed} of {compared} group verdicts differ, first: {first}")
    if not compared:
        return Outcome(Status.UNKNOWN, reason_unknown="no group in the machine's scope")
    return Outcome(Status.PROVED, f"{compared} group verdicts agree")


def obligations() -> list[Obligation]:
    return [
        Obligation(
            f"refinement.shipped_encoder[{name}]",
            f"formal._smt.decide and the proof machine agree, group by group, on {name}'s derived programs "
            "(alone and paired) and on each alone without one P/O/G collective or scale "
            "(where the machine models the group)",
            "z3",
            functools.partial(library_obligation, name),
        )
        for name in STRATEGIES
    ]
