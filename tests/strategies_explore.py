"""The exploring generators' cases and the known classes of z3/simulator disagreement.

``explorations()`` draws a library composition (``strategies_sim.compositions()``) or one over
user strategies (``strategies_sim.user_strategies()``) and changes its derived program with
``strategies_sim.programs()``. ``KNOWN_CLASSES`` holds one membership predicate per known class
of disagreement, each written from the class's definition (not from any disagreement seen):

 1. a gradient broadcast or all-gather of an unreduced (partial) gradient;
 2. a forward-phase gradient op with more than one micro-batch;
 3. a backward-phase gradient op with more than one micro-batch (which buffer it acts on: the
    accumulated ``.grad`` or the micro-batch's fresh gradient);
 4. a group computed sharded along an axis where its P, O or G is replicated;
 5. activations replicated along an axis that splits the batch (every rank on the same samples);
 6. a scale of the parameters or the optimizer state;
 7. one normalising scale spanning several axes (a sum over dp and cp, then one 1/(dp cp));
 8. the derived program of ZeRO-2 with parameter offload.

The differential test labels each disagreement with the classes it belongs to and fails only on
a disagreement of no known class.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp
from hypothesis import strategies as st
from strategies_sim import USER_AXES, compositions, programs, user_strategies

from formal._program import SEQUENCE_REGION_GROUPS, Origin, StepProgram, derive_program
from formal._reference import ReferenceModel
from formal._strategies import Composition
from formal._vocab import LAYER_GROUPS, Axis, Mode, OpKind, Phase, Reduce, State


@dataclass(frozen=True)
class Explored:
    """A case of the exploring generators: a composition (library or user strategies), its
    reference model, and its derived program after zero or more changes."""

    composition: Composition
    model: ReferenceModel
    program: StepProgram
    changes: tuple[str, ...] = ()
    description: str = "derived"
    toml: str = ""


@st.composite
def explorations(
    draw: st.DrawFn, mutate: bool | None = None, max_devices: int = 32, simulated: bool = True
) -> Explored:
    """A library composition (one draw in two) or one over user strategies, and its derived
    program, changed by ``programs()`` in three draws of four (always when ``mutate``). With
    ``simulated`` no ep axis is drawn: the reference model has no experts (the simulator refuses
    ep, and z3 refutes ep on a dense model by its prerequisite ``ep_needs_moe``)."""
    toml = ""
    if draw(st.booleans()):
        composition, model = draw(compositions(max_devices=min(8, max_devices)))
    else:
        axes = [a for a in USER_AXES if a is not Axis.EP] if simulated else USER_AXES
        user = draw(user_strategies(max_devices=max_devices, axes=axes))
        composition, model, toml = user.composition, user.model, user.toml
    transformer = model.transformer()
    program = derive_program(composition.placement(transformer), transformer)
    if mutate is None:
        mutate = draw(st.integers(0, 3)) > 0
    if not mutate:
        return Explored(composition, model, program, toml=toml)
    changed = draw(programs(program, transformer))
    return Explored(composition, model, changed.program, changed.kinds, str(changed), toml)


def _split(e: Explored, axis: Axis | None) -> bool:
    return axis is not None and int(e.program.placement.degree(axis)) > 1


def _micro_batched(e: Explored) -> bool:
    return e.program.placement.options.micro_batches > 1


def _gradient_op_in(e: Explored, phase: Phase) -> bool:
    return any(
        op.state is State.GRADIENTS and op.phase is phase and op.kind is not OpKind.COMPUTE for op in e.program.ops
    )


def _spreads_unreduced_gradient(e: Explored) -> bool:
    """Class 1: a broadcast or all-gather of G along a split axis where the gradient is partial,
    before any reduction of that group's G along that axis."""
    ops = e.program.ops
    for i, op in enumerate(ops):
        if not (op.state is State.GRADIENTS and op.kind in (OpKind.BROADCAST, OpKind.ALL_GATHER)):
            continue
        if not _split(e, op.axis) or op.axis is None or e.program.origin(op.group, op.axis) is Origin.COMPLETE:
            continue
        earlier = ops[:i]
        if not any(
            o.state is State.GRADIENTS and o.kind.is_reduction and o.group == op.group and o.axis is op.axis
            for o in earlier
        ):
            return True
    return False


def _computes_sharded_over_replicated(e: Explored) -> bool:
    """Class 4: a group computed sharded along a split axis whose P, O or G is replicated there
    (a first- or last-stage group replicated along pp is the tied embedding on both ends, as
    every pipeline derives it, and is not a member)."""
    pl = e.program.placement
    return any(
        pl.computes_sharded(axis, g) and pl.mode(s, g, axis) is Mode.REPLICATED
        for axis, d in pl.mesh
        if int(d) > 1
        for g in pl.groups(State.PARAMETERS)
        if not (axis is Axis.PP and g not in LAYER_GROUPS)
        for s in (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS)
    )


def _replicated_activations_on_data_axis(e: Explored) -> bool:
    """Class 5: activations replicated along a split axis that splits the batch (dp, dpr, cp, ep)."""
    pl = e.program.placement
    return any(
        pl.mode(State.ACTIVATIONS, g, axis) is Mode.REPLICATED
        for axis, d in pl.mesh
        if int(d) > 1 and axis.splits_data
        for g in pl.groups(State.ACTIVATIONS)
    )


def _scales_model_state(e: Explored) -> bool:
    """Class 6: a scale of P or O."""
    return any(op.kind is OpKind.SCALE and op.state in (State.PARAMETERS, State.OPTIMIZER) for op in e.program.ops)


def _scale_spans_axes(e: Explored) -> bool:
    """Class 7: a gradient scale whose factor is 1/(d1 d2 ...) over two or more split axes along
    each of which the group's gradient is reduced by a sum."""
    pl = e.program.placement
    for op in e.program.ops:
        if op.kind is not OpKind.SCALE or op.state is not State.GRADIENTS or op.scale is None:
            continue
        summed = {
            o.axis
            for o in e.program.ops
            if o.state is State.GRADIENTS
            and o.kind.is_reduction
            and o.reduce is Reduce.SUM
            and o.group == op.group
            and _split(e, o.axis)
        }
        for size in range(2, len(summed) + 1):
            for axes in itertools.combinations(sorted(a for a in summed if a is not None), size):
                if sp.simplify(op.scale * sp.Mul(*(pl.degree(a) for a in axes)) - 1) == 0:
                    return True
    return False


def _zero2_offload_params_derived(e: Explored) -> bool:
    """Class 8: the derived (unchanged) program of ZeRO-2 with parameter offload."""
    names = {s.name for s in e.composition.strategies}
    return not e.changes and "zero2" in names and e.composition.options.offload_parameters


KNOWN_CLASSES: dict[str, tuple[str, Callable[[Explored], bool]]] = {
    "1": ("gradient broadcast / all-gather of unreduced G", _spreads_unreduced_gradient),
    "2": ("a forward-phase gradient op with m > 1", lambda e: _micro_batched(e) and _gradient_op_in(e, Phase.FORWARD)),
    "3": (
        "a backward-phase gradient op with m > 1 (accumulated .grad or fresh gradient)",
        lambda e: _micro_batched(e) and _gradient_op_in(e, Phase.BACKWARD),
    ),
    "4": ("compute_sharded group over replicated P/O/G", _computes_sharded_over_replicated),
    "5": ("activations replicated along a data axis", _replicated_activations_on_data_axis),
    "6": ("a scale of P or O", _scales_model_state),
    "7": ("one normalising scale spanning several summed axes", _scale_spans_axes),
    "8": ("the derived program of zero2 x offload-params", _zero2_offload_params_derived),
}


def _materialized_or_offloaded_state(e: Explored) -> bool:
    """Class 9: a user strategy gives P or O the per-axis mode M (materialized: held nowhere
    between uses) or O (offloaded) along some axis; the library never does (it offloads with the
    axis-free ``offload``/``offload-params``)."""
    pl = e.program.placement
    return any(
        pl.mode(s, g, axis) in (Mode.MATERIALIZED, Mode.OFFLOADED)
        for s in (State.PARAMETERS, State.OPTIMIZER)
        for g in pl.groups(s)
        for axis in pl.axes
    )


def _tp_exchanged_without_split(e: Explored) -> bool:
    """Class 10: tp activation collectives (the layer's partial-sum all-reduce) along a tp axis
    along which no layer group (attention, mlp) is computed sharded."""
    pl = e.program.placement
    if not _split(e, Axis.TP) or Axis.TP not in pl.axes:
        return False
    split = any(pl.computes_sharded(Axis.TP, g) for g in pl.groups(State.PARAMETERS) if g.name in ("attention", "mlp"))
    exchanged = any(op.state is State.ACTIVATIONS and op.axis is Axis.TP for op in e.program.ops)
    return exchanged and not split


def _scale_off_its_axis(e: Explored) -> bool:
    """Class 11: a gradient scale whose factor is not 1/d of its own axis (moved onto another
    axis, or given no axis), or one outside gradient synchronisation."""
    pl = e.program.placement
    for op in e.program.ops:
        if op.kind is not OpKind.SCALE or op.state is not State.GRADIENTS or op.scale is None:
            continue
        if op.phase is not Phase.GRAD_SYNC or op.axis is None:
            return True
        if sp.simplify(op.scale * pl.degree(op.axis) - 1) != 0:
            return True
    return False


def _sequence_region_computed_sharded(e: Explored) -> bool:
    """Class 12: sequence parallelism with a group of the sequence-parallel region (norms,
    row-parallel biases, the router) declared computed sharded along tp."""
    pl = e.program.placement
    if not e.composition.options.sequence_parallel or not _split(e, Axis.TP) or Axis.TP not in pl.axes:
        return False
    return any(pl.computes_sharded(Axis.TP, g) for g in pl.groups(State.PARAMETERS) if g in SEQUENCE_REGION_GROUPS)


def _one_stage_group_moved_along_pp(e: Explored) -> bool:
    """Class 13: a collective of P or O along pp of a group that lives on one pipeline stage (the
    embedding, untied, on the first; the head and final norm on the last)."""
    pl = e.program.placement
    return _split(e, Axis.PP) and any(
        op.kind.is_collective
        and op.state in (State.PARAMETERS, State.OPTIMIZER)
        and op.axis is Axis.PP
        and op.group not in LAYER_GROUPS
        and op.group not in pl.tied
        for op in e.program.ops
    )


def _reduces_complete_split_gradient(e: Explored) -> bool:
    """Class 14: a reduction of G along a split axis along which the group is computed sharded
    and its gradient complete (each device's shard of a tensor-parallel matrix)."""
    pl = e.program.placement
    return any(
        op.state is State.GRADIENTS
        and op.kind.is_reduction
        and op.axis is not None
        and _split(e, op.axis)
        and pl.computes_sharded(op.axis, op.group)
        and e.program.origin(op.group, op.axis) is Origin.COMPLETE
        for op in e.program.ops
    )


def _scattered_after_its_reduction(e: Explored) -> bool:
    """Class 16: a reduce-scatter of a gradient replicated along its axis, placed after a
    reduction of that gradient along the same axis (the buffer already holds the reduced value
    everywhere)."""
    ops = e.program.ops
    pl = e.program.placement
    return any(
        op.state is State.GRADIENTS
        and op.kind is OpKind.REDUCE_SCATTER
        and op.axis is not None
        and not pl.entry(State.GRADIENTS, op.group, op.axis).mode.is_sharded
        and any(
            o.state is State.GRADIENTS and o.group == op.group and o.axis is op.axis and o.kind.is_reduction
            for o in ops[:i]
        )
        for i, op in enumerate(ops)
    )


def _nested_shards_cut_differently(e: Explored) -> bool:
    """Class 15: a group sharded along two or more split flat axes (not pipeline stages or tp
    slices of a split computation) by one of its states, while another of P, O, G is sharded
    along a different set of those axes: nested shards are cut axis after axis, and the two cuts
    need not nest (P's cp-then-dp chunk is not inside O's dp chunk)."""
    pl = e.program.placement
    flat = [a for a, d in pl.mesh if int(d) > 1 and not a.kind.is_pipeline]
    for g in pl.groups(State.PARAMETERS):
        axes = [a for a in flat if not pl.computes_sharded(a, g)]
        sets = {
            s: frozenset(a for a in axes if pl.mode(s, g, a).is_sharded)
            for s in (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS)
        }
        if any(len(v) >= 2 for v in sets.values()) and len(set(sets.values())) > 1:
            return True
    return False


# Classes this suite found, beyond the eight known ones, each with the side that single-device
# training says is wrong (as judged when they were found). They are labelled like the known ones
# so that the test keeps failing only on what nobody has classified yet.
FOUND_CLASSES: dict[str, tuple[str, Callable[[Explored], bool]]] = {
    "9": (
        "P or O materialized (M) or offloaded (O) by a per-axis mode (M: nothing holds the state "
        "between steps, z3's coverage refutation is right and the simulator, which keeps it, is wrong)",
        _materialized_or_offloaded_state,
    ),
    "10": (
        "tp activation collectives with no layer computed sharded along tp (the all-reduce sums "
        "complete outputs d times: the simulator diverges, z3 proves it: z3 is wrong)",
        _tp_exchanged_without_split,
    ),
    "11": (
        "a gradient scale off its own axis or phase (a local product: the simulator trains like one "
        "device, z3 ties the factor to the scale's axis and refutes: z3 is wrong)",
        _scale_off_its_axis,
    ),
    "12": (
        "sequence parallelism with a sequence-region group computed sharded along tp (its gradient "
        "is a partial sum over the sequence shards whatever compute_sharded says: the derived "
        "program and z3's proof are wrong, the simulator diverges)",
        _sequence_region_computed_sharded,
    ),
    "13": (
        "a P or O collective along pp of a group living on one stage (z3 cut the group into pp "
        "blocks and refuted; the simulator keeps it whole on its stage and matched: z3 was wrong, "
        "now whole where held on both sides)",
        _one_stage_group_moved_along_pp,
    ),
    "14": (
        "a reduction of a complete gradient along an axis that splits its computation (the shards "
        "are different elements: summing them is wrong, z3 refutes; the simulator pads each shard "
        "with zeros to the full tensor, so its all-reduce acts as an all-gather: simulator wrong)",
        _reduces_complete_split_gradient,
    ),
    "15": (
        "nested shards of one group cut along different sets of axes by P, O and G (the simulator "
        "cut a later reduce-scatter, and the refresh's gathers, as if the earlier ones had not run, "
        "and diverged where z3 proved it: the simulator was wrong, now fixed)",
        _nested_shards_cut_differently,
    ),
    "16": (
        "a reduce-scatter of an already reduced, replicated gradient, then an update that reads "
        "the whole buffer (reduce_scatter_tensor leaves its input, so every element is still the "
        "reduced one: the simulator matches; z3's consistency run kept only the scattered piece "
        "of a gradient and refuted: z3 was wrong, now it keeps the reduced chunks)",
        _scattered_after_its_reduction,
    ),
}


def known_classes(e: Explored) -> tuple[str, ...]:
    """The known classes (1-8) and the classes found by this suite (9-) ``e`` belongs to."""
    return tuple(k for k, (_, member) in {**KNOWN_CLASSES, **FOUND_CLASSES}.items() if member(e))


__all__ = ["FOUND_CLASSES", "KNOWN_CLASSES", "Explored", "explorations", "known_classes"]
