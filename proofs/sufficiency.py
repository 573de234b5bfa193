"""Sufficiency obligations (proofs/sufficiency.md).

* ``sufficiency.step[<mesh>]``: for EVERY program on a one-axis mesh (features are z3
  variables), gradient integrity and state consistency imply that one step preserves the
  invariant and that every read returns the single-device value (z3, uninterpreted model and
  optimizer). Two-axis meshes are the composition obligations (``proofs/composition.py``).
* ``sufficiency.library[<strategy>]``: every step program ``derive_program`` produces for the
  strategy, alone (2 to 8 devices) and composed with every library strategy on another axis (2x2),
  for every parameter group of a dense and an MoE model, satisfies the conditions and z3 proves
  its inductive step.
* ``sufficiency.normalisation[<strategy>]``: for symbolic degrees (sympy), the coefficient with
  which the derived program sums each contribution is exactly the single-device 1/B.
"""

from __future__ import annotations

import functools

import sympy as sp
import z3

from formal._model import Transformer
from formal._placement import Options, Placement
from formal._program import Origin, StepProgram, derive_program
from formal._strategies import LIBRARY, Composition
from formal._verdict import Status
from formal._vocab import Axis, OpKind, Phase, Reduce, State
from proofs._machine import (
    AxisClass,
    Mesh,
    MeshAxis,
    Program,
    conditions,
    constant_features,
    mesh_name,
    sufficiency_query,
    symbolic_features,
)
from proofs._obligation import Obligation, Outcome, combine, proved_if_unsat
from proofs._solver import prove
from proofs._translate import Untranslatable, translate

DENSE = Transformer("proof-dense", layers=8, hidden=8, heads=2, vocab=16, seq=8)
MOE = Transformer("proof-moe", layers=8, hidden=8, heads=2, vocab=16, seq=8, experts=8, top_k=2)
# Aliases name the same strategy (ddp is dp): one obligation per distinct constructor.
STRATEGIES = tuple(n for n in LIBRARY if n != "ddp")
MAX_SINGLE_DEVICES = 8  # every library strategy alone on 2..8 devices
PAIR_DEGREES = ((2, 2),)  # every pair of library strategies on distinct axes
ONE_AXIS_DEGREES = (2, 3, 4)  # the every-program obligation, per axis class

INVARIANT = (
    "every live copy or shard (read before it is next written) equals the single-device value, "
    "and every read returns it"
)


def step_obligation(mesh: Mesh, drop: frozenset[str] = frozenset()) -> Outcome:
    """Every program on ``mesh`` satisfying the conditions (minus ``drop``) preserves the invariant."""
    hyps, goal = sufficiency_query(mesh, symbolic_features(mesh))
    for name in drop:
        if name not in hyps:
            raise KeyError(name)
        del hyps[name]
    return proved_if_unsat(prove(hyps, goal))


def one_axis_meshes() -> list[Mesh]:
    return [(MeshAxis(cls, d),) for cls in AxisClass for d in ONE_AXIS_DEGREES]


def model_for(names: tuple[str, ...]) -> Transformer:
    return MOE if "ep" in names else DENSE


def options_for(names: tuple[str, ...]) -> list[Options]:
    out = [Options()]
    if "tp" in names:
        out.append(Options(sequence_parallel=True))
    if "pp" in names:
        out.append(Options(micro_batches=4))
    if any(n in names for n in ("dp", "zero3", "fsdp")) and len(names) == 1:
        out.append(Options(offload_parameters=True))
    return out


def compositions_with(name: str) -> list[tuple[tuple[str, int], ...]]:
    """``name`` alone on 2..8 devices, and with every strategy on another axis (PAIR_DEGREES)."""
    out: list[tuple[tuple[str, int], ...]] = [((name, d),) for d in range(2, MAX_SINGLE_DEVICES + 1)]
    axis = LIBRARY[name]().axis
    for other in STRATEGIES:
        if LIBRARY[other]().axis is axis:
            continue
        for d1, d2 in PAIR_DEGREES:
            out.append(((name, d1), (other, d2)))
    return out


def derived(spec: tuple[tuple[str, int], ...], options: Options) -> tuple[Placement, StepProgram]:
    names = tuple(n for n, _ in spec)
    model = model_for(names)
    comp = Composition(tuple(LIBRARY[n]().with_degree(d) for n, d in spec), options)
    pl = comp.placement(model)
    return pl, derive_program(pl, model)


@functools.cache
def instance(mesh: Mesh, program: Program) -> Outcome:
    """The inductive step of one concrete (derived) program, after checking its conditions."""
    ft = constant_features(program)
    failed = [n for n, f in conditions(mesh, ft).items() if not z3.is_true(z3.simplify(f))]
    if failed:
        return Outcome(Status.REFUTED, f"{mesh_name(mesh)}: the derived program violates {', '.join(failed)}")
    hyps, goal = sufficiency_query(mesh, ft)
    return proved_if_unsat(prove(hyps, goal), f"{mesh_name(mesh)}: ")


def library_obligation(name: str) -> Outcome:
    outcomes: list[Outcome] = []
    seen: set[tuple[Mesh, Program]] = set()
    programs = 0
    for spec in compositions_with(name):
        for options in options_for(tuple(n for n, _ in spec)):
            pl, prog = derived(spec, options)
            for group in pl.groups(State.PARAMETERS):
                try:
                    t = translate(prog, group)
                except Untranslatable:
                    continue
                programs += 1
                key = (t.mesh, t.program)
                if key in seen:
                    continue
                seen.add(key)
                outcomes.append(instance(*key))
    return combine(outcomes, f"{programs} (composition, group) programs, {len(seen)} distinct machine programs")


def coefficient(program: StepProgram, group: object, axis: Axis) -> sp.Expr:
    """The factor by which the derived program scales a contribution along ``axis``, relative to
    its single-device coefficient, or 0 when some contribution is never summed."""
    pl = program.placement
    d = pl.degree(axis)
    origin = program.origin(group, axis)  # type: ignore[arg-type]
    reductions = [
        op
        for op in program.ops
        if op.group == group
        and op.axis is axis
        and op.state is State.GRADIENTS
        and op.kind.is_reduction
        and op.phase is Phase.GRAD_SYNC
    ]
    scales = [
        op.scale
        for op in program.ops
        if op.group == group and op.axis is axis and op.kind is OpKind.SCALE and op.scale is not None
    ]
    n = reductions[0].participants if reductions and reductions[0].participants is not None else d
    match origin:
        case Origin.PARTIAL:
            # each device's contribution is normalised by its own share of the batch (d/B for a
            # data axis) or is a summand of the same loss (1 for tp/pp partial sums)
            factor: sp.Expr = n if axis.splits_data else sp.Integer(1)
            if not reductions:
                return sp.Integer(0)  # the other devices' contributions are never added
        case Origin.SUMMED:
            factor = d  # every rank's locally normalised tokens summed on the expert
        case Origin.COMPLETE:
            factor = sp.Integer(1)
        case _:
            raise AssertionError(origin)
    for k, op in enumerate(reductions):
        if k == 0 and origin is Origin.PARTIAL:  # adds the n different summands
            factor = factor * (1 / n if op.reduce is Reduce.MEAN else 1)
        else:  # the copies are already equal: a sum multiplies by n, a mean leaves them
            factor = factor * (1 if op.reduce is Reduce.MEAN else n)
    for s in scales:
        factor = factor * s
    return sp.simplify(factor)


def normalisation_obligation(name: str) -> Outcome:
    """sympy: with symbolic degrees, every (group, axis) coefficient is exactly 1."""
    specs = [((name, 0),)] + [
        ((name, 0), (other, 0)) for other in STRATEGIES if LIBRARY[other]().axis is not LIBRARY[name]().axis
    ]
    checked = 0
    for spec in specs:
        names = tuple(n for n, _ in spec)
        model = model_for(names)
        for options in options_for(names):
            comp = Composition(tuple(LIBRARY[n]().with_degree(2) for n, _ in spec), options)
            pl = comp.placement(model, symbolic=True)
            prog = derive_program(pl, model)
            for group in pl.groups(State.PARAMETERS):
                for axis in pl.axes:
                    c = coefficient(prog, group, axis)
                    checked += 1
                    if sp.simplify(c - 1) != 0:
                        return Outcome(
                            Status.REFUTED, f"{'x'.join(names)}: {group} along {axis.value} is scaled by {c}, not 1"
                        )
    return Outcome(Status.PROVED, f"{checked} (composition, group, axis) coefficients equal 1 for symbolic degrees")


def obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for mesh in one_axis_meshes():
        out.append(
            Obligation(
                f"sufficiency.step[{mesh_name(mesh)}]",
                f"every program on a {mesh_name(mesh)} mesh with gradient integrity and state consistency preserves: "
                f"{INVARIANT}",
                "z3",
                functools.partial(step_obligation, mesh),
            )
        )
    for name in STRATEGIES:
        out.append(
            Obligation(
                f"sufficiency.library[{name}]",
                f"every derived step program of {name} (alone, 2..{MAX_SINGLE_DEVICES} devices; with each other "
                "library strategy on another axis, 2x2) satisfies both conditions and preserves the invariant",
                "z3",
                functools.partial(library_obligation, name),
            )
        )
        out.append(
            Obligation(
                f"sufficiency.normalisation[{name}]",
                f"for symbolic degrees, every derived program of {name} (alone and composed) sums every gradient "
                "contribution exactly once with the single-device normalisation",
                "sympy",
                functools.partial(normalisation_obligation, name),
            )
        )
    return out
