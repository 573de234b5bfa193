"""Hypothesis strategies for differential testing (plural nouns): compositions the simulator can run
on the reference model, and mutations of step programs.

``compositions()`` draws library strategies on distinct axes (a data strategy, possibly with dpr
or hpz-dpr beside it; degrees 1, 2 or 4, at most ``max_devices`` devices), modifiers (sequence
parallelism, micro-batches, schedules, recomputation, offload) and a reference model they divide,
tied or not. Parameter offload is drawn under every data strategy, ZeRO-1/2 included (their
derived refresh brings the host copy through the device), so its mutations are judged too.

``mutations(program)`` changes one P/O/G op of a program: drop, duplicate, reorder (move it to
another place in the program, taking that place's phase), re-axis (another axis of the mesh),
sum <-> mean, shift a shard boundary (offset + 1 of a reduce-scatter, all-gather or optimizer step), average twice
(a ``1/d`` scale before a mean reduction), skip a refresh, skip a gather. Activation
collectives (tp's partial sums, sequence shards, cp's keys and values, pp's sends) are mutated
too, by drop, duplicate, reorder, re-axis and sum <-> mean: z3 judges them
(``formal/_activation_flow.py``) as the simulator runs them.
Shifting a boundary includes an optimizer step's own offset (its shard cut against the gradient's).

``programs(program, model)`` explores further: one or two changes from ``CHANGES`` (an op's
kind or state changed, a P/O/G collective inserted in any phase, a gradient op moved into
another phase, a mean turned into a sum and a 1/d scale on some axis and phase, a scale moved,
one scale split over two summed axes, a scale of P or O, or one of ``mutations()``'s).
``user_strategies()`` draws compositions over user strategies written as a ``--strategies``
TOML file would give them (random modes per state and group, offsets, holds, activations,
compute_sharded), with library strategies beside them, ep, degrees up to 8 and up to 32 devices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import sympy as sp
from hypothesis import assume
from hypothesis import strategies as st

from checker._parse import parse
from checker._toml import loads
from formal._model import Model
from formal._program import Op, StepProgram, derive_program, group_sizes, shard_elements
from formal._reference import ReferenceModel
from formal._simulator import reference_for
from formal._strategies import LIBRARY, Composition
from formal._vocab import Axis, Group, OpKind, Phase, Reduce, State
from formal.errors import InputError

DATA_PARALLEL = ("dp", "zero1", "zero2", "zero3", "fsdp", "fsdp-sgo", "hsdp", "distopt")
MUTATION_KINDS = (
    "drop",
    "duplicate",
    "reorder",
    "reaxis",
    "reduce",
    "offset",
    "rescale",
    "skip_refresh",
    "skip_gather",
)


@st.composite
def compositions(draw: st.DrawFn, max_devices: int = 8) -> tuple[Composition, ReferenceModel]:
    """A library composition the simulator runs, and the smallest reference model it divides."""
    terms: list[str] = []
    devices = 1

    def degree(options: list[int]) -> int:
        fitting = [d for d in options if devices * d <= max_devices]
        return draw(st.sampled_from(fitting))

    data = draw(st.sampled_from((None, *DATA_PARALLEL)))
    if data is not None:
        d = degree([1, 2, 2, 4])
        devices *= d
        terms.append(f"{data}{d}")
        if data == "hsdp" or draw(st.integers(0, 3)) == 0:
            r = degree([1, 2])
            devices *= r
            # the across-node axis of ZeRO++ hpZ (parameters held along it) or HSDP's replicate axis
            replicate = "dpr" if data == "hsdp" else draw(st.sampled_from(["dpr", "dpr", "hpz-dpr"]))
            terms.append(f"{replicate}{r}")
    tp = draw(st.sampled_from([0, 0, 1, 2]))
    if tp:
        tp = degree([1, tp])
        devices *= tp
        terms.append(f"tp{tp}")
    pp = draw(st.sampled_from([0, 0, 2]))
    if pp:
        pp = degree([1, pp])
        devices *= pp
        terms.append(f"pp{pp}")
    if draw(st.integers(0, 3)) == 0:
        c = degree([1, 2])
        devices *= c
        terms.append(f"cp{c}")
    if not terms:
        terms.append(f"dp{degree([2, 4])}")
    terms = list(draw(st.permutations(terms)))
    if tp > 1 and draw(st.booleans()):
        terms.append("sp")
    if pp > 1:
        schedule = draw(st.sampled_from(["", "", "gpipe", "v2"]))
        if schedule:
            terms.append(schedule)
    terms.append(f"m{draw(st.sampled_from([1, 1, 2]))}")
    recompute = draw(st.sampled_from(["", "", "recompute", "selective"]))
    if recompute:
        terms.append(recompute)
    if draw(st.integers(0, 4)) == 0:
        terms.append("offload")
    if draw(st.integers(0, 5)) == 0:
        terms.append("offload-params")
    composition = parse("x".join(terms))
    tied = draw(st.booleans())
    return composition, reference_for(composition, ReferenceModel(tied=tied))


def _state_ops(program: StepProgram) -> list[int]:
    return [i for i, op in enumerate(program.ops) if op.kind.is_collective or op.kind.is_transfer]


def applicable(program: StepProgram) -> list[tuple[str, int]]:
    """Every (mutation kind, op index) that changes ``program``."""
    ops = program.ops
    mesh = [a for a, d in program.placement.mesh if int(d) > 1]
    out: list[tuple[str, int]] = []
    for i in _state_ops(program):
        op = ops[i]
        out += [("drop", i), ("duplicate", i), ("reorder", i)]
        if op.kind.is_collective and any(a is not op.axis for a in mesh):
            out.append(("reaxis", i))
        if op.kind.is_reduction:
            out.append(("reduce", i))
            if op.reduce is Reduce.MEAN:
                out.append(("rescale", i))
        if op.state is State.ACTIVATIONS:
            continue  # the rest are model-state mutations
        if op.kind in (OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER):
            out.append(("offset", i))
        if op.phase is Phase.REFRESH:
            out.append(("skip_refresh", i))
        if op.kind is OpKind.ALL_GATHER and op.phase in (Phase.FORWARD, Phase.BACKWARD):
            out.append(("skip_gather", i))
    out += [
        ("offset", i)
        for i, op in enumerate(ops)
        if op.kind is OpKind.OPTIMIZER_STEP
        and any(program.placement.mode(State.OPTIMIZER, op.group, a).is_sharded for a in mesh)
    ]
    return out


@st.composite
def mutations(draw: st.DrawFn, program: StepProgram) -> tuple[StepProgram, str]:
    """One mutation of ``program`` (see the module docstring) and a description of it."""
    choices = applicable(program)
    assume(choices)  # a program without collectives has nothing to mutate
    # One draw in four mutates an activation op (when there is one), so that the model-state
    # mutations keep their share as activation ops multiply (the generator-quality test).
    activation = [c for c in choices if program.ops[c[1]].state is State.ACTIVATIONS]
    state = [c for c in choices if program.ops[c[1]].state is not State.ACTIVATIONS]
    pick_activation = bool(activation) and (not state or draw(st.integers(0, 3)) == 0)
    kind, i = draw(st.sampled_from(activation if pick_activation else state))
    ops = list(program.ops)
    op = ops[i]
    mesh = [a for a, d in program.placement.mesh if int(d) > 1]
    match kind:
        case "drop" | "skip_refresh" | "skip_gather":
            del ops[i]
        case "duplicate":
            ops.insert(i + 1, op)
        case "reorder":
            del ops[i]
            j = draw(st.integers(0, len(ops)).filter(lambda j: j != i))
            neighbour = ops[min(j, len(ops) - 1)]
            op = replace(op, phase=neighbour.phase)
            ops.insert(j, op)
            return program.with_ops(ops), f"reorder op {i} ({program.ops[i]}) to {j} as {op.phase.value}"
        case "reaxis":
            axis = draw(st.sampled_from([a for a in mesh if a is not op.axis]))
            ops[i] = replace(op, axis=axis)
        case "reduce":
            ops[i] = replace(op, reduce=Reduce.SUM if op.reduce is Reduce.MEAN else Reduce.MEAN)
        case "offset":
            ops[i] = replace(op, offset=op.offset + 1)
        case "rescale":
            assert op.axis is not None
            d = program.placement.degree(op.axis)
            ops.insert(
                i,
                Op(
                    OpKind.SCALE,
                    op.state,
                    op.group,
                    op.axis,
                    op.phase,
                    scale=Fraction(1, d),
                    note="normalise (again) before the mean",
                ),
            )
        case _:
            raise AssertionError(kind)
    return program.with_ops(ops), f"{kind} op {i}: {op}"


# --- exploring programs: kinds, states, inserted collectives, scales across axes and phases -----
#
# ``programs(program, model)`` applies one to ``max_changes`` changes, each drawn from
# ``CHANGES``: a name and a function ``(draw, program, sizes) -> (ops, description) | None``
# (``None``: the change does not apply to this program). Adding a change (the swap of a gradient
# op's buffer between the fresh and the accumulated gradient, once ``Op.buffer`` exists) is one
# function and one entry in ``CHANGES``.

COLLECTIVE_KINDS = (OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER, OpKind.BROADCAST)
MODEL_STATES = (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS)
Change = Callable[[st.DrawFn, StepProgram, Mapping[Group, sp.Expr]], "tuple[list[Op], str] | None"]


def _split_axes(program: StepProgram) -> list[Axis]:
    return [a for a, d in program.placement.mesh if int(d) > 1]


def _reduce_for(axis: Axis | None) -> Reduce:
    return Reduce.MEAN if axis is not None and axis.splits_data else Reduce.SUM


def _count(program: StepProgram, phase: Phase) -> sp.Expr:
    m = sp.Integer(program.placement.options.micro_batches)
    return m if phase in (Phase.FORWARD, Phase.BACKWARD) else sp.Integer(1)


def _position(draw: st.DrawFn, ops: list[Op], phase: Phase) -> int:
    """A place among (or right after) the ops of ``phase``, or the end of the program."""
    places = [i for i, op in enumerate(ops) if op.phase is phase] + [
        i + 1 for i, op in enumerate(ops) if op.phase is phase
    ]
    return draw(st.sampled_from(sorted(set(places)) or [len(ops)]))


def _model_state_ops(program: StepProgram, pick: Callable[[Op], bool]) -> list[int]:
    return [i for i, op in enumerate(program.ops) if op.state is not State.ACTIVATIONS and pick(op)]


def _rekind(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """A collective of P/O/G becomes another collective (all-reduce, reduce-scatter, all-gather, broadcast)."""
    found = _model_state_ops(program, lambda op: op.kind in COLLECTIVE_KINDS)
    if not found:
        return None
    i = draw(st.sampled_from(found))
    op = program.ops[i]
    kind = draw(st.sampled_from([k for k in COLLECTIVE_KINDS if k is not op.kind]))
    ops = list(program.ops)
    ops[i] = replace(op, kind=kind, reduce=_reduce_for(op.axis) if kind.is_reduction else None)
    return ops, f"rekind op {i} ({op}) to {kind.value}"


def _restate(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """A collective, transfer or scale of one model state acts on another (P, O or G)."""
    found = _model_state_ops(
        program, lambda op: op.kind.is_collective or op.kind.is_transfer or op.kind is OpKind.SCALE
    )
    if not found:
        return None
    i = draw(st.sampled_from(found))
    op = program.ops[i]
    state = draw(st.sampled_from([s for s in MODEL_STATES if s is not op.state]))
    ops = list(program.ops)
    ops[i] = replace(op, state=state)
    return ops, f"restate op {i} ({op}) to {state.value}"


def _insert(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """A new collective of P/O/G in any phase (forward and after-step ones included)."""
    mesh = _split_axes(program)
    groups = [g for g in program.placement.groups(State.PARAMETERS) if g in sizes]
    if not mesh or not groups:
        return None
    kind = draw(st.sampled_from(COLLECTIVE_KINDS))
    state = draw(st.sampled_from(MODEL_STATES))
    group = draw(st.sampled_from(groups))
    axis = draw(st.sampled_from(mesh))
    phase = draw(st.sampled_from(list(Phase)))
    reduce = draw(st.sampled_from([Reduce.SUM, Reduce.MEAN])) if kind.is_reduction else None
    elements = shard_elements(program.placement, state, group, sizes[group], axis)
    new = Op(kind, state, group, axis, phase, elements, _count(program, phase), reduce, note="inserted")
    ops = list(program.ops)
    j = _position(draw, ops, phase)
    ops.insert(j, new)
    return ops, f"insert {new} at {j}"


def _rephase(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """A gradient op moves into another phase (forward, backward, optimizer, refresh), placed among its ops."""
    found = _model_state_ops(program, lambda op: op.state is State.GRADIENTS and op.kind is not OpKind.COMPUTE)
    if not found:
        return None
    i = draw(st.sampled_from(found))
    op = program.ops[i]
    phase = draw(st.sampled_from([p for p in Phase if p is not op.phase]))
    ops = list(program.ops)
    del ops[i]
    moved = replace(op, phase=phase, count=_count(program, phase) if op.kind.is_collective else op.count)
    j = _position(draw, ops, phase)
    ops.insert(j, moved)
    return ops, f"rephase op {i} ({op}) to {phase.value} at {j}"


def _normalise_later(
    draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]
) -> tuple[list[Op], str] | None:
    """A mean reduction becomes a sum and a 1/d scale, on its axis or another, in some phase."""
    found = _model_state_ops(program, lambda op: op.kind.is_reduction and op.reduce is Reduce.MEAN)
    if not found:
        return None
    i = draw(st.sampled_from(found))
    op = program.ops[i]
    assert op.axis is not None
    ops = list(program.ops)
    ops[i] = replace(op, reduce=Reduce.SUM)
    axis = draw(st.sampled_from([op.axis, *[a for a in _split_axes(program) if a is not op.axis], None]))
    phase = draw(st.sampled_from([op.phase, op.phase, Phase.OPTIMIZER, Phase.BACKWARD, Phase.FORWARD]))
    scale = Op(OpKind.SCALE, op.state, op.group, axis, phase, scale=Fraction(1, program.placement.degree(op.axis)))
    j = i + 1 if phase is op.phase and draw(st.booleans()) else _position(draw, ops, phase)
    ops.insert(j, scale)
    return ops, f"normalise op {i} ({op}) later: {scale} at {j}"


def _move_scale(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """A scale op moves to another axis (its factor kept) or another phase."""
    found = _model_state_ops(program, lambda op: op.kind is OpKind.SCALE)
    if not found:
        return None
    i = draw(st.sampled_from(found))
    op = program.ops[i]
    ops = list(program.ops)
    others = [a for a in _split_axes(program) if a is not op.axis]
    if draw(st.booleans()) and others:
        ops[i] = replace(op, axis=draw(st.sampled_from(others)))
        return ops, f"move scale op {i} ({op}) onto {ops[i].axis}"
    phase = draw(st.sampled_from([p for p in Phase if p is not op.phase]))
    del ops[i]
    j = _position(draw, ops, phase)
    ops.insert(j, replace(op, phase=phase))
    return ops, f"move scale op {i} ({op}) into {phase.value} at {j}"


def _split_scale(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """Two mean reductions of one group on two axes become sums and one scale 1/(d1 d2)."""
    by_group: dict[tuple[State, Group], list[int]] = {}
    for i in _model_state_ops(program, lambda op: op.kind.is_reduction and op.reduce is Reduce.MEAN):
        by_group.setdefault((program.ops[i].state, program.ops[i].group), []).append(i)
    pairs = [
        (a, b)
        for found in by_group.values()
        for a in found
        for b in found
        if a < b and program.ops[a].axis is not program.ops[b].axis
    ]
    if not pairs:
        return None
    a, b = draw(st.sampled_from(pairs))
    ops = list(program.ops)
    first, second = ops[a], ops[b]
    assert first.axis is not None and second.axis is not None
    ops[a], ops[b] = replace(first, reduce=Reduce.SUM), replace(second, reduce=Reduce.SUM)
    factor = Fraction(1, int(program.placement.degree(first.axis)) * int(program.placement.degree(second.axis)))
    axis = draw(st.sampled_from([first.axis, second.axis, None]))
    scale = Op(OpKind.SCALE, second.state, second.group, axis, second.phase, scale=factor, note="one scale, two axes")
    ops.insert(b + 1, scale)
    return ops, f"split scale over ops {a} and {b}: {scale}"


def _scale_state(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """A scale of the parameters or the optimizer state (by 1/d, 2 or 1) in some phase."""
    groups = list(program.placement.groups(State.PARAMETERS))
    if not groups:
        return None
    state = draw(st.sampled_from([State.PARAMETERS, State.OPTIMIZER]))
    group = draw(st.sampled_from(groups))
    axis = draw(st.sampled_from([None, *_split_axes(program)]))
    inverse = [Fraction(1, int(program.placement.degree(axis)))] if axis else []
    factor = draw(st.sampled_from([sp.Integer(2), sp.Integer(1), *inverse]))
    phase = draw(st.sampled_from(list(Phase)))
    ops = list(program.ops)
    new = Op(OpKind.SCALE, state, group, axis, phase, scale=factor, note="scale a model state")
    j = _position(draw, ops, phase)
    ops.insert(j, new)
    return ops, f"scale {new} at {j}"


def _classic(draw: st.DrawFn, program: StepProgram, sizes: Mapping[Group, sp.Expr]) -> tuple[list[Op], str] | None:
    """One of ``mutations()``'s changes (drop, duplicate, reorder, re-axis, sum <-> mean, ...)."""
    if not applicable(program):
        return None
    mutated, what = draw(mutations(program))
    return list(mutated.ops), what


CHANGES: dict[str, Change] = {
    "classic": _classic,
    "rekind": _rekind,
    "restate": _restate,
    "insert": _insert,
    "rephase": _rephase,
    "normalise_later": _normalise_later,
    "move_scale": _move_scale,
    "split_scale": _split_scale,
    "scale_state": _scale_state,
}


@dataclass(frozen=True)
class Changed:
    """A program after ``programs()``: the changes' names and descriptions, in order."""

    program: StepProgram
    kinds: tuple[str, ...]
    descriptions: tuple[str, ...]

    def __str__(self) -> str:
        return "; ".join(self.descriptions) or "derived"


@st.composite
def programs(
    draw: st.DrawFn, program: StepProgram, model: Model, max_changes: int = 2, kinds: Sequence[str] | None = None
) -> Changed:
    """``program`` after one to ``max_changes`` changes from ``CHANGES`` (those in ``kinds`` if given)."""
    sizes = group_sizes(model)
    names = list(kinds or CHANGES)
    done: list[str] = []
    descriptions: list[str] = []
    for _ in range(draw(st.integers(1, max_changes))):
        name = draw(st.sampled_from(names))
        result = CHANGES[name](draw, program, sizes)
        if result is None:
            continue
        ops, what = result
        program = program.with_ops(ops)
        done.append(name)
        descriptions.append(what)
    assume(done)
    return Changed(program, tuple(done), tuple(descriptions))


# --- user strategies: random modes per state and group, as a --strategies TOML file gives them ---

USER_AXES = (Axis.DP, Axis.DPR, Axis.TP, Axis.PP, Axis.CP, Axis.EP)
USER_GROUPS = ("attention", "mlp", "norm", "final_norm", "embedding", "head")
LIBRARY_ON: dict[Axis, tuple[str, ...]] = {
    axis: tuple(sorted(n for n, make in LIBRARY.items() if make().axis is axis and n != "hpz-dpr")) for axis in Axis
}
P_MODES = ("R", "R", "S", "S*", "S*", "S*+hold", "M", "O")
O_MODES = ("R", "R", "S", "S", "O", "M")
G_MODES = ("R", "R", "S", "S")  # a materialized gradient is refused (``Strategy.problem``)


@dataclass(frozen=True)
class UserComposition:
    """A composition over user strategies (and library ones), its reference model, the TOML text."""

    composition: Composition
    model: ReferenceModel
    toml: str


def _mode(draw: st.DrawFn, modes: Sequence[str], degree: int) -> str:
    """A mode word; one sharded mode in six is rotated by an offset (shard k on coordinate k + offset)."""
    mode = draw(st.sampled_from(modes))
    if mode.startswith("S") and degree > 1 and draw(st.integers(0, 5)) == 0:
        offset = draw(st.integers(1, degree - 1))
        mode = mode.replace("S*", f"S*@{offset}", 1) if "*" in mode else f"S@{offset}"
    return mode


def _pipeline_table(draw: st.DrawFn, name: str, axis: Axis) -> str:
    """A pipeline strategy as the model represents one (``Strategy.pipeline_problem``): every
    group computed split by stage, the layers' P, O and G sharded by stage, the groups outside
    the layers ``S`` or ``R``."""
    lines = [f"[strategies.{name}]", f'axis = "{axis.value}"', 'P = "S"', 'O = "S"', 'G = "S"']
    if draw(st.integers(0, 3)) == 0:
        lines.append(f'A = "{draw(st.sampled_from(["R", "S"]))}"')
    for group in draw(st.lists(st.sampled_from(("embedding", "head", "final_norm")), max_size=2, unique=True)):
        lines.append(f"[strategies.{name}.groups.{group}]")
        lines += [f'{key} = "{draw(st.sampled_from(["S", "R"]))}"' for key in ("P", "O", "G")]
    return "\n".join(lines)


def _strategy_table(draw: st.DrawFn, name: str, axis: Axis, degree: int) -> str:
    # Along pp, seven tables in eight are pipelines the model represents; the eighth draws any
    # modes and is mostly refused (``Strategy.pipeline_problem``), which the generator skips.
    if axis.kind.is_pipeline and draw(st.integers(0, 7)) > 0:
        return _pipeline_table(draw, name, axis)
    lines = [f"[strategies.{name}]", f'axis = "{axis.value}"']
    for key, modes in (("P", P_MODES), ("O", O_MODES), ("G", G_MODES)):
        if key == "P" or draw(st.integers(0, 4)) > 0:
            lines.append(f'{key} = "{_mode(draw, modes, degree)}"')
    if draw(st.integers(0, 3)) == 0:
        lines.append(f'A = "{draw(st.sampled_from(["R", "S"]))}"')
    # The simulator splits computation along tp and pp only: elsewhere compute_sharded is rare.
    match draw(st.integers(0, 4 if axis in (Axis.TP, Axis.PP, Axis.EP) else 12)):
        case 0:
            lines.append('compute_sharded = "all"')
        case 1:
            chosen = draw(st.lists(st.sampled_from(USER_GROUPS), min_size=1, max_size=3, unique=True))
            lines.append(f"compute_sharded = {chosen!r}".replace("'", '"'))
        case _:
            pass
    for group in draw(st.lists(st.sampled_from(USER_GROUPS), max_size=2, unique=True)):
        lines.append(f"[strategies.{name}.groups.{group}]")
        for key, modes in (("P", P_MODES), ("O", O_MODES), ("G", G_MODES)):
            if draw(st.booleans()):
                lines.append(f'{key} = "{_mode(draw, modes, degree)}"')
        if len(lines[-1].split("=")) < 2:
            lines.append('P = "R"')
    return "\n".join(lines)


@st.composite
def user_strategies(
    draw: st.DrawFn, max_devices: int = 32, max_degree: int = 8, axes: Sequence[Axis] = USER_AXES
) -> UserComposition:
    """One to three axes, each a user strategy (random modes per state and group, offsets, holds,
    activations, compute_sharded, per-group tables) or a library one; degrees up to ``max_degree``,
    at most ``max_devices`` devices; modifiers; the smallest reference model the degrees divide."""
    chosen = draw(st.lists(st.sampled_from(list(axes)), min_size=1, max_size=3, unique=True))
    devices = 1
    terms: list[str] = []
    tables: list[str] = []
    for k, axis in enumerate(chosen):
        fitting = [d for d in (1, 2, 2, 4, 8) if d <= max_degree and devices * d <= max_devices]
        degree = draw(st.sampled_from(fitting))
        devices *= degree
        library = LIBRARY_ON[axis]
        if library and draw(st.integers(0, 3)) == 0:
            terms.append(f"{draw(st.sampled_from(library))}{degree}")
            continue
        name = f"user-{'abc'[k]}"
        tables.append(_strategy_table(draw, name, axis, degree))
        terms.append(f"{name}{degree}")
    if Axis.TP in chosen and draw(st.booleans()):
        terms.append("sp")
    terms.append(f"m{draw(st.sampled_from([1, 1, 2, 4]))}")
    if draw(st.integers(0, 5)) == 0:
        terms.append(draw(st.sampled_from(["offload", "offload-params", "recompute"])))
    text = "\n\n".join(tables) + "\n"
    try:
        factories = loads(text).factories() if tables else {}
        composition = parse("x".join(terms), factories)
        model = reference_for(composition, ReferenceModel(tied=draw(st.booleans())))
        transformer = model.transformer()
        derive_program(composition.placement(transformer), transformer)
    except InputError:
        assume(False)
        raise  # unreachable: assume(False) raises
    return UserComposition(composition, model, text)


__all__ = [
    "CHANGES",
    "MUTATION_KINDS",
    "Changed",
    "Op",
    "UserComposition",
    "applicable",
    "compositions",
    "mutations",
    "programs",
    "user_strategies",
]
