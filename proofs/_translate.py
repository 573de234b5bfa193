"""From a derived ``StepProgram`` (formal/_program.py) to the machine's mesh and features.

The translation reads the program's ops and the placement, never re-derives them: a gather is
there because ``derive_program`` emitted an ``all_gather`` of P, a reduction because it emitted an
``all_reduce``/``reduce_scatter`` of G, and so on. One parameter group at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from formal._program import Origin, StepProgram
from formal._vocab import Axis, Group, Mode, OpKind, Phase, Reduce, State
from proofs._machine import AxisClass, AxisProgram, Mesh, MeshAxis, Program

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741


class Untranslatable(Exception):
    """Raised when a program uses something the machine does not model (host optimizer)."""


@dataclass(frozen=True)
class Translated:
    mesh: Mesh
    program: Program
    axes: tuple[Axis, ...]


def axis_class(program: StepProgram, group: Group, axis: Axis) -> AxisClass:
    pl = program.placement
    match program.origin(group, axis):
        case Origin.PARTIAL:
            if axis.kind.splits_sequence:
                return AxisClass.SEQUENCE
            return AxisClass.DATA if axis.splits_data else AxisClass.PART
        case Origin.SUMMED:
            return AxisClass.EXPERT
        case Origin.COMPLETE:
            sharded = pl.mode(P, group, axis).is_sharded
            return AxisClass.COMPUTE if pl.computes_sharded(axis, group) and sharded else AxisClass.REPLICATED
        case _:
            raise AssertionError(axis)


def translate(program: StepProgram, group: Group) -> Translated:
    """The machine mesh and program of ``group`` under ``program`` (axes of degree 1 dropped)."""
    pl = program.placement
    if pl.local_mode(O, group) is Mode.OFFLOADED:
        raise Untranslatable(f"{group}: host-side optimizer is not modelled")
    mesh: list[MeshAxis] = []
    axes: list[AxisProgram] = []
    kept: list[Axis] = []
    ops = [op for op in program.ops if op.group == group or op.state is A]
    for axis in pl.axes:
        cls = axis_class(program, group, axis)
        degree = int(pl.degree(axis))
        mine = [op for op in ops if op.axis is axis and op.state is not A]
        reductions = [op for op in mine if op.state is G and op.kind.is_reduction and op.phase is Phase.GRAD_SYNC]
        if reductions and reductions[0].participants is not None:
            degree = int(reductions[0].participants)  # the tied weight: the two stages holding it
        elif cls is AxisClass.PART and axis.kind.is_pipeline:
            degree = 2
        if degree == 1:
            continue
        p_entry, o_entry, g_entry = (pl.entry(st, group, axis) for st in (P, O, G))
        gathers_f = any(op.kind is OpKind.ALL_GATHER and op.state is P and op.phase is Phase.FORWARD for op in mine)
        gathers_b = any(
            op.kind is OpKind.ALL_GATHER and op.state is P and op.phase is Phase.BACKWARD for op in mine
        ) or (gathers_f and p_entry.keep_gathered)
        refresh = [op for op in mine if op.kind is OpKind.ALL_GATHER and op.state is P and op.phase is Phase.REFRESH]
        scatter = [op for op in reductions if op.kind is OpKind.REDUCE_SCATTER]
        scales = [op for op in mine if op.kind is OpKind.SCALE and op.state is G]
        exchange = any(op.state is A and op.axis is axis and op.phase is Phase.FORWARD for op in program.ops)
        scaled = any(op.scale is not None and sp.simplify(op.scale * degree - 1) == 0 for op in scales)
        axes.append(
            AxisProgram(
                p_sharded=p_entry.mode.is_sharded,
                o_sharded=o_entry.mode.is_sharded,
                g_sharded=bool(scatter) if reductions else g_entry.mode.is_sharded,
                p_offset=p_entry.offset,
                o_offset=o_entry.offset,
                g_offset=scatter[0].offset if scatter else g_entry.offset,
                refresh_offset=refresh[0].offset if refresh else o_entry.offset,
                gather_forward=gathers_f,
                gather_backward=gathers_b,
                reductions=len(reductions),
                mean=bool(reductions) and reductions[0].reduce is Reduce.MEAN,
                scaled=scaled,
                refresh_end=bool(refresh),
                refresh_start=False,
                exchange=exchange,
            )
        )
        mesh.append(MeshAxis(cls, degree))
        kept.append(axis)
    offload = pl.local_mode(P, group) is Mode.OFFLOADED
    fetch = {
        ph: any(
            op.kind is OpKind.HOST_TO_DEVICE and op.state is P and op.group == group and op.phase is ph
            for op in program.ops
        )
        for ph in (Phase.FORWARD, Phase.BACKWARD)
    }
    prog = Program(tuple(axes), offload, fetch[Phase.FORWARD], fetch[Phase.BACKWARD])
    return Translated(tuple(mesh), prog, tuple(kept))
