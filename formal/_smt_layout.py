"""Where a gradient's pieces lie across axes (docs/semantics.md, "Collectives along several axes").

State consistency runs along one axis at a time (``formal/_smt.py`` says why that is exact
along one axis). Flat shards cut along several axes nest, though: a state cut along an outer
and an inner axis is cut outer axis first (``formal._axes.nesting_order``), so where a device's
piece along the inner axis lies depends on its coordinate along the outer one. Two facts about a
program's gradient cross axes, and neither one-axis run can see them; this module decides them,
one z3 query each, over the nested positions of the pieces:

* ``scatter_nesting[G.g]``: the optimizer updates O's piece from the gradient the device holds
  there, so at the step O's piece must lie inside G's. G is cut along the flat axes its
  placement shards it along and those the program reduce-scatters it along
  (``formal._program.scatter_axes``). O cut along dpr and dp (dpr outer) with G reduce-scattered
  along dp alone: the device at dpr=0, dp=1 updates [1/4, 1/2) of the tensor and holds the
  gradient on [1/2, 1). (A placement that alone misnests G and O is the composition rule
  ``nested_shards``; this obligation judges what the program's reduce-scatters add.)
* ``scatter_then_reduce[G.g, A]``: a reduce-scatter along B cuts the gradient towards the
  partition of G's flat shard axes and the reduce-scatters still to come along the others; where
  that piece is cut along A too (G sharded along A, no reduce-scatter along A), an all-reduce
  along A after it sums different elements on the devices along A.

Positions are exact: with ``N`` the product of the degrees, a piece cut along axes
``a_1, ..., a_k`` (outer first) at coordinates ``c`` starts at
``sum_j c_{a_j} * N / (d_{a_1} * ... * d_{a_j})`` and spans ``N / (d_{a_1} * ... * d_{a_k})``.
z3 looks for coordinates that break the fact; its model is the witness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from math import prod
from typing import Any

import z3

from formal._axes import nesting_order
from formal._placement import Placement
from formal._program import Op, StepProgram, rescatters, scatter_axes
from formal._smt_common import _execution_order, _int_degree, _status
from formal._solver import Solver
from formal._verdict import Condition, Obligation, Status, Violation
from formal._vocab import Axis, Group, OpKind, Phase, State

P, O, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS  # noqa: E741 (the paper's P/O/G)
SC = Condition.STATE_CONSISTENCY


def flat_axes(pl: Placement, group: Group) -> list[Axis]:
    """The axes of degree above 1 along which a state of ``group`` can be cut into flat shards,
    outer first: not a pipeline axis, nor an axis whose computation of the group is split into
    slices (tp's matrices); ep first for a group whose experts ep splits."""
    degrees = {a: _int_degree(d) for a, d in pl.mesh}
    experts = any(a.kind.places_experts and pl.computes_sharded(a, group) for a in pl.axes if degrees[a] > 1)
    return [
        a
        for a in nesting_order(pl.axes, experts)
        if degrees[a] > 1 and not a.kind.is_pipeline and not (a.kind.splits_matrices and pl.computes_sharded(a, group))
    ]


def _sharded(pl: Placement, state: State, group: Group, axes: Sequence[Axis]) -> list[Axis]:
    return [a for a in axes if pl.mode(state, group, a).is_sharded]


@dataclass(frozen=True)
class _Positions:
    """Nested positions over ``axes`` (outer first) with their degrees, in units of 1/N."""

    axes: tuple[Axis, ...]
    degrees: tuple[int, ...]

    @property
    def total(self) -> int:
        return prod(self.degrees)

    def coordinates(self, tag: str) -> dict[Axis, z3.ArithRef]:
        return {a: z3.Int(f"{tag}[{a.value}]") for a in self.axes}

    def ranges(self, c: dict[Axis, z3.ArithRef]) -> z3.BoolRef:
        return z3.And(*[z3.And(c[a] >= 0, c[a] < d) for a, d in zip(self.axes, self.degrees, strict=True)])

    def size(self, cut: Sequence[Axis]) -> int:
        """A piece cut along ``cut`` (a subset of ``axes``): its size in units of 1/N."""
        return self.total // prod(d for a, d in zip(self.axes, self.degrees, strict=True) if a in cut)

    def start(self, cut: Sequence[Axis], c: dict[Axis, z3.ArithRef]) -> z3.ArithRef:
        """Where the piece cut along ``cut`` (taken in the order of ``axes``) at ``c`` starts."""
        size, terms = self.total, []
        for a, d in zip(self.axes, self.degrees, strict=True):
            if a in cut:
                size //= d
                terms.append(c[a] * size)
        return z3.Sum(*terms) if terms else z3.IntVal(0)

    def fraction(self, at: int) -> str:
        return str(Fraction(at, self.total))


def _positions(pl: Placement, axes: Sequence[Axis]) -> _Positions:
    return _Positions(tuple(axes), tuple(_int_degree(pl.degree(a)) for a in axes))


def _value(model: z3.ModelRef, x: z3.ArithRef) -> int:
    return int(model.eval(x, model_completion=True).as_long())


@dataclass(frozen=True)
class _Answer:
    """One query's answer, with the model's values by name (None unless sat)."""

    status: Status
    reason: str
    seconds: float
    core: tuple[str, ...]
    values: dict[str, int] | None


# One run's queries, keyed by what they ask (axes, degrees, cuts): groups placed alike share one.
Memo = dict[tuple[object, ...], _Answer]


Query = Callable[[], tuple[Solver, dict[str, z3.ArithRef]]]  # builds a solver and what to read


def _ask(memo: Memo, key: tuple[object, ...], query: Query) -> _Answer:
    """The answer to ``query``: built and asked once per run, remembered unless unknown."""
    if key in memo:
        return replace(memo[key], seconds=0.0)
    solver, read = query()
    answer = solver.check()
    values = None if answer.model is None else {name: _value(answer.model, x) for name, x in read.items()}
    found = _Answer(_status(answer, violated_when="sat"), answer.reason, answer.seconds, answer.core, values)
    if found.status is not Status.UNKNOWN:
        memo[key] = found
    return found


def decide_layout(program: StepProgram, timeout_ms: int) -> tuple[list[Obligation], list[Violation]]:
    """Both facts (module docstring) for every group whose pieces cross axes."""
    pl = program.placement
    obligations: list[Obligation] = []
    violations: list[Violation] = []
    order = _execution_order(program.ops, pl.options.micro_batches)
    position = {id(op): i for i, op in enumerate(program.ops)}
    again = rescatters(program.ops)
    memo: Memo = {}
    for group in pl.groups(P):
        flat = flat_axes(pl, group)
        if len(flat) < 2:
            continue  # one flat axis at most: nothing nests
        ops = [op for op in order if op.group == group and op.state is G and op.phase is not Phase.FORWARD]
        scattered = scatter_axes(program.ops, group)
        for found in (
            _nesting(pl, group, flat, ops, scattered, memo, timeout_ms),
            *_mixing(
                pl, group, flat, ops, scattered, {position[id(op)] for op in ops} & again, position, memo, timeout_ms
            ),
        ):
            if found is not None:
                obligations.append(found[0])
                violations += found[1]
    return obligations, violations


def _nesting(
    pl: Placement,
    group: Group,
    flat: list[Axis],
    ops: list[Op],
    scattered: frozenset[Axis],
    memo: Memo,
    timeout_ms: int,
) -> tuple[Obligation, list[Violation]] | None:
    o_axes = _sharded(pl, O, group, flat)
    g_placed = set(_sharded(pl, G, group, flat))
    # gathered back after its last reduce-scatter: whole along the axis again (unless placed sharded)
    last_scatter = {op.axis: i for i, op in enumerate(ops) if op.kind is OpKind.REDUCE_SCATTER}
    regathered = {
        op.axis for i, op in enumerate(ops) if op.kind is OpKind.ALL_GATHER and i > last_scatter.get(op.axis, len(ops))
    }
    added = {a for a in scattered if a in o_axes and a not in g_placed and a not in regathered}
    if len(o_axes) < 2 or not added:
        return None  # the placement's own nesting is the composition rule ``nested_shards``
    g_axes = [a for a in o_axes if a in g_placed or a in added]
    pos = _positions(pl, o_axes)
    o_size, g_size = pos.size(o_axes), pos.size(g_axes)
    name = f"scatter_nesting[G.{group.name}]"

    def query() -> tuple[Solver, dict[str, z3.ArithRef]]:
        c = pos.coordinates("device")
        o_start, g_start = pos.start(o_axes, c), pos.start(g_axes, c)
        solver = Solver(timeout_ms)
        solver.track("devices", pos.ranges(c))
        solver.track("scatter_nesting", z3.Or(o_start < g_start, o_start + o_size > g_start + g_size))
        return solver, {**{a.value: c[a] for a in o_axes}, "optimizer": o_start, "gradient": g_start}

    answer = _ask(memo, ("nesting", pos, tuple(g_axes)), query)
    ob = Obligation(name, SC, answer.status, answer.reason, answer.seconds, answer.core)
    if answer.values is None:
        return ob, []
    coords = {a.value: answer.values[a.value] for a in o_axes}
    at_o, at_g = answer.values["optimizer"], answer.values["gradient"]
    o_range = f"[{pos.fraction(at_o)}, {pos.fraction(at_o + o_size)})"
    g_range = f"[{pos.fraction(at_g)}, {pos.fraction(at_g + g_size)})"
    device = ", ".join(f"{k}={v}" for k, v in coords.items())
    missing = [a.value for a in o_axes if a not in g_axes]
    explanation = (
        f"O.{group.name} is cut along {' and '.join(a.value for a in o_axes)} ({o_axes[0].value} outer), but the "
        f"program leaves G.{group.name} cut along {', '.join(a.value for a in g_axes)} alone (reduce-scattered "
        f"along {', '.join(sorted(a.value for a in added))}): the device at {device} updates {o_range} of the "
        f"tensor and holds its gradient on {g_range}; reduce-scatter along {', '.join(missing)} too"
    )
    witness: dict[str, Any] = {
        "device": coords,
        "optimizer_piece": o_range,
        "gradient_piece": g_range,
        "optimizer_axes": [a.value for a in o_axes],
        "gradient_axes": [a.value for a in g_axes],
    }
    return ob, [Violation(name, SC, G.value, group.name, None, explanation, witness)]


def _mixing(
    pl: Placement,
    group: Group,
    flat: list[Axis],
    ops: list[Op],
    scattered: frozenset[Axis],
    again: set[int],
    position: dict[int, int],
    memo: Memo,
    timeout_ms: int,
) -> list[tuple[Obligation, list[Violation]] | None]:
    g_placed = set(_sharded(pl, G, group, flat))
    out: list[tuple[Obligation, list[Violation]] | None] = []
    done: set[Axis] = set()  # the axes reduce-scattered along so far
    regathered: set[Axis] = set()
    pending: list[tuple[Op, list[Axis], set[Axis]]] = []  # a cutting reduce-scatter, its cut, gathers since
    reported: set[Axis] = set()
    for op in ops:
        axis = op.axis
        if axis is None or axis not in flat:
            continue
        if op.kind is OpKind.REDUCE_SCATTER and position[id(op)] not in again:
            # the simulator's cut: G's flat shards and the axes scattered so far, along each
            # axis still to come whole (``formal/_sim_collectives.py``)
            whole = scattered - done - {axis}
            cut = [a for a in flat if (a in g_placed or a in done - regathered or a == axis) and a not in whole]
            pending.append((op, cut, set()))
            done.add(axis)
            regathered.discard(axis)
        elif op.kind is OpKind.ALL_GATHER:
            if axis in done:
                regathered.add(axis)
            for _, _, gathered in pending:
                gathered.add(axis)
        elif op.kind is OpKind.ALL_REDUCE and axis not in done and axis not in reported:
            # after a reduce-scatter along another axis, not gathered back along this one since
            # (a reduction along an axis already scattered along is the one-axis run's to judge)
            earlier = [(rs, cut) for rs, cut, gathered in pending if rs.axis != axis and axis not in gathered]
            if earlier:
                rs, cut = next(((r, k) for r, k in reversed(earlier) if axis in k), earlier[-1])
                out.append(_mixed(pl, group, flat, rs, op, cut, memo, timeout_ms))
                reported.add(axis)
    return out


def _mixed(
    pl: Placement, group: Group, flat: list[Axis], rs: Op, ar: Op, cut: list[Axis], memo: Memo, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    assert ar.axis is not None and rs.axis is not None
    along = ar.axis
    pos = _positions(pl, flat)
    size = pos.size(cut)
    name = f"scatter_then_reduce[G.{group.name}, {along.value}]"

    def query() -> tuple[Solver, dict[str, z3.ArithRef]]:
        c, c2 = pos.coordinates("device"), pos.coordinates("peer")
        start, start2 = pos.start(cut, c), pos.start(cut, c2)
        solver = Solver(timeout_ms)
        solver.track("devices", z3.And(pos.ranges(c), pos.ranges(c2)))
        solver.track(f"peers[{along.value}]", z3.And(*[c[a] == c2[a] for a in flat if a != along]))
        solver.track("scatter_then_reduce", start != start2)
        read = {f"device {a.value}": c[a] for a in flat} | {f"peer {a.value}": c2[a] for a in flat}
        return solver, {**read, "device": start, "peer": start2}

    answer = _ask(memo, ("mixing", pos, tuple(cut), along), query)
    ob = Obligation(name, SC, answer.status, answer.reason, answer.seconds, answer.core)
    if answer.values is None:
        return ob, []
    values = answer.values
    one = {a.value: values[f"device {a.value}"] for a in flat}
    two = {a.value: values[f"peer {a.value}"] for a in flat}
    at1, at2 = values["device"], values["peer"]
    r1 = f"[{pos.fraction(at1)}, {pos.fraction(at1 + size)})"
    r2 = f"[{pos.fraction(at2)}, {pos.fraction(at2 + size)})"
    explanation = (
        f"G.{group.name} is reduce-scattered along {rs.axis.value} and then all-reduced along {along.value}, but "
        f"the piece the reduce-scatter leaves is cut along {', '.join(a.value for a in cut)}: the device at "
        f"{along.value}={one[along.value]} holds {r1} of the tensor, its peer at {along.value}={two[along.value]} "
        f"holds {r2}, so the all-reduce sums different elements; reduce-scatter along {along.value} instead, or "
        f"all-reduce along {along.value} before the reduce-scatter along {rs.axis.value}"
    )
    witness: dict[str, Any] = {
        "device": one,
        "peer": two,
        "device_piece": r1,
        "peer_piece": r2,
        "reduce_scatter": str(rs),
        "all_reduce": str(ar),
        "cut_along": [a.value for a in cut],
    }
    return ob, [Violation(name, SC, G.value, group.name, along.value, explanation, witness)]


__all__ = ["decide_layout", "flat_axes"]
