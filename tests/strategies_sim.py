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
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import assume
from hypothesis import strategies as st

from checker._parse import parse
from formal._program import Op, StepProgram
from formal._reference import ReferenceModel
from formal._simulator import reference_for
from formal._strategies import Composition
from formal._vocab import OpKind, Phase, Reduce, State

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
                    scale=1 / d,
                    note="normalise (again) before the mean",
                ),
            )
        case _:
            raise AssertionError(kind)
    return program.with_ops(ops), f"{kind} op {i}: {op}"


__all__ = ["MUTATION_KINDS", "Op", "applicable", "compositions", "mutations"]
