"""The abstract step machine: one training step of one parameter group on a device mesh, in z3.

This is the semantics the sufficiency and necessity obligations reason about (proofs/sufficiency.md
section 1 defines it in prose). A mesh is a tuple of axes, each with a *class* (how the group's
gradient contributions relate to the axis) and a degree; a device is a coordinate tuple and the
group's elements are coordinate tuples too (``elements`` per axis, partitioned into ``degree``
contiguous blocks). A *program* is the tuple of features of the step program along every axis
(modes and offsets of P/O/G, gathers, reductions, scaling, refresh, fetches). Features are z3
terms: constants for a derived (concrete) program, fresh variables when the obligation quantifies
over every program.

The step, in order (docs/semantics.md, "The step program"):
  0. refresh-at-start: replicas of P along an axis are overwritten from the optimizer-shard owner;
  1. forward and backward reads of P (gathered, fetched, local, or a junk buffer);
  2. local gradients: sums of per-sample (per-token-block, per-part) contributions that depend on
     what the device read;
  3. gradient synchronisation: 0, 1 or 2 reductions per axis (all-reduce or reduce-scatter, sum or
     mean), then an optional 1/d scale;
  4. the element-wise update ``(p, o, g) -> (U(p,o,g), W(p,o,g))`` on the optimizer's shards;
  5. refresh-at-end: replicas of P all-gathered from the optimizer-shard owner.
The invariant: every *live* copy (held, and not overwritten before it is next read) equals the
single-device value.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, TypeAlias

import z3

Value: TypeAlias = Any  # a z3 real term (z3 ships no type information)
Coords = tuple[int, ...]


class AxisClass(StrEnum):
    """How a parameter group's gradient contributions relate to one axis (docs/semantics.md, "Gradient origins")."""

    DATA = "data"  # samples split: each device's gradient is a locally normalised partial (dp, dpr)
    SEQUENCE = "sequence"  # token blocks of the same sequences split, attention needs all keys (cp)
    PART = "part"  # each device holds a summand of every sample's gradient (tp under SP, tied pp)
    REPLICATED = "replicated"  # complete: every device computes the whole gradient (tp, LayerNorm)
    COMPUTE = "compute"  # complete, computation split: each device computes its shard (tp, pp)
    EXPERT = "expert"  # computation split, each expert sums every rank's normalised tokens (ep)

    @property
    def computes_sharded(self) -> bool:
        return self in (AxisClass.COMPUTE, AxisClass.EXPERT)

    @property
    def splits_samples(self) -> bool:
        return self in (AxisClass.DATA, AxisClass.SEQUENCE, AxisClass.EXPERT)


@dataclass(frozen=True)
class MeshAxis:
    cls: AxisClass
    degree: int
    elements: int = 0  # elements of the group along this axis; 0 means ``degree``

    @property
    def size(self) -> int:
        return self.elements or self.degree

    def __str__(self) -> str:
        extra = f"/{self.size}" if self.size != self.degree else ""
        return f"{self.cls.value}{self.degree}{extra}"


Mesh = tuple[MeshAxis, ...]


def mesh_name(mesh: Mesh) -> str:
    return "x".join(str(a) for a in mesh) or "single"


@dataclass(frozen=True)
class AxisProgram:
    """A concrete step program's features along one axis (see module doc)."""

    p_sharded: bool = False
    o_sharded: bool = False
    g_sharded: bool = False
    p_offset: int = 0
    o_offset: int = 0
    g_offset: int = 0
    refresh_offset: int = 0
    gather_forward: bool = False
    gather_backward: bool = False
    reductions: int = 0
    mean: bool = False
    scaled: bool = False
    refresh_end: bool = False
    refresh_start: bool = False
    exchange: bool = False


@dataclass(frozen=True)
class Program:
    axes: tuple[AxisProgram, ...]
    offload: bool = False
    fetch_forward: bool = False
    fetch_backward: bool = False


@dataclass(frozen=True)
class AxisFeatures:
    """The same features as z3 terms (constants or variables)."""

    p_sharded: z3.BoolRef
    o_sharded: z3.BoolRef
    g_sharded: z3.BoolRef
    p_offset: z3.ArithRef
    o_offset: z3.ArithRef
    g_offset: z3.ArithRef
    refresh_offset: z3.ArithRef
    gather_forward: z3.BoolRef
    gather_backward: z3.BoolRef
    reductions: z3.ArithRef
    mean: z3.BoolRef
    scaled: z3.BoolRef
    refresh_end: z3.BoolRef
    refresh_start: z3.BoolRef
    exchange: z3.BoolRef


@dataclass(frozen=True)
class Features:
    axes: tuple[AxisFeatures, ...]
    offload: z3.BoolRef
    fetch_forward: z3.BoolRef
    fetch_backward: z3.BoolRef
    domain: tuple[tuple[str, z3.BoolRef], ...] = ()  # ranges of the variables


def _const(value: bool | int) -> z3.ExprRef:
    return z3.BoolVal(value) if isinstance(value, bool) else z3.IntVal(value)


def constant_features(program: Program) -> Features:
    axes = tuple(
        AxisFeatures(**{f.name: _const(getattr(ap, f.name)) for f in fields(AxisProgram)}) for ap in program.axes
    )
    return Features(
        axes, z3.BoolVal(program.offload), z3.BoolVal(program.fetch_forward), z3.BoolVal(program.fetch_backward)
    )


def symbolic_features(mesh: Mesh, prefix: str = "prog") -> Features:
    """Every program on ``mesh``: fresh variables, ranges as named domain constraints.

    Structural facts of a class are part of the machine, not conditions: along a compute-split
    axis the device holds and reads only its shard of P (that is what compute-split means).
    """
    axes: list[AxisFeatures] = []
    domain: list[tuple[str, z3.BoolRef]] = []
    for idx, ax in enumerate(mesh):
        values: dict[str, z3.ExprRef] = {}
        for f in fields(AxisProgram):
            name = f"{prefix}.{f.name}[{idx}]"
            values[f.name] = z3.Int(name) if f.type in ("int", int) else z3.Bool(name)
            if f.type in ("int", int):
                v = values[f.name]
                hi = 2 if f.name == "reductions" else ax.degree - 1
                domain.append((f"domain[{f.name}, {idx}]", z3.And(v >= 0, v <= hi)))
        if ax.cls.computes_sharded:
            values["p_sharded"] = z3.BoolVal(True)
        axes.append(AxisFeatures(**values))
    return Features(
        tuple(axes),
        z3.Bool(f"{prefix}.offload"),
        z3.Bool(f"{prefix}.fetch_forward"),
        z3.Bool(f"{prefix}.fetch_backward"),
        tuple(domain),
    )


# --- the conditions (docs/semantics.md, "Correctness"), one named constraint per axis and rule ----


def conditions(mesh: Mesh, ft: Features) -> dict[str, z3.BoolRef]:
    """Gradient integrity and state consistency as named constraints over the program features."""
    out: dict[str, z3.BoolRef] = {}
    for idx, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True)):
        where = f"{ax.cls.value}, axis {idx}"
        # Gradient integrity: every contribution summed exactly once, normalisation matching.
        match ax.cls:
            case AxisClass.DATA | AxisClass.SEQUENCE:
                out[f"grad_reduced_once[{where}]"] = f.reductions == 1
                # one 1/d: a mean reduction or a sum followed by a scale, not both, not neither
                out[f"grad_normalised[{where}]"] = f.mean != f.scaled
            case AxisClass.PART:
                out[f"grad_reduced_once[{where}]"] = f.reductions == 1
                out[f"grad_normalised[{where}]"] = z3.And(z3.Not(f.mean), z3.Not(f.scaled))
            case AxisClass.EXPERT:
                out[f"grad_not_reduced[{where}]"] = f.reductions == 0
                out[f"grad_normalised[{where}]"] = f.scaled  # summed over d ranks: divide by d
            case AxisClass.REPLICATED | AxisClass.COMPUTE:
                out[f"grad_not_reduced[{where}]"] = f.reductions == 0
                out[f"grad_normalised[{where}]"] = z3.Not(f.scaled)
            case _:
                raise AssertionError(ax.cls)
        # State consistency.
        if not ax.cls.computes_sharded:
            out[f"gather_before_forward[{where}]"] = z3.Implies(f.p_sharded, f.gather_forward)
            out[f"gather_before_backward[{where}]"] = z3.Implies(f.p_sharded, f.gather_backward)
        if ax.cls is AxisClass.SEQUENCE:
            out[f"kv_exchanged[{where}]"] = f.exchange
        if ax.cls in (AxisClass.DATA, AxisClass.SEQUENCE, AxisClass.PART):
            # G's partition is the reduce-scatter's; without a reduction (complete gradients) each
            # device holds what it computed, and the compute partition is P's (next rule).
            out[f"aligned_gradients[{where}]"] = z3.Implies(f.g_sharded, z3.And(f.o_sharded, f.g_offset == f.o_offset))
        out[f"aligned_parameters[{where}]"] = z3.Implies(f.p_sharded, z3.And(f.o_sharded, f.p_offset == f.o_offset))
        if ax.cls.computes_sharded:
            continue  # P is sharded along a compute-split axis: refresh rules have nothing to say
        out[f"aligned_refresh[{where}]"] = z3.Implies(
            z3.And(f.o_sharded, z3.Not(f.p_sharded), z3.Or(f.refresh_end, f.refresh_start)),
            f.refresh_offset == f.o_offset,
        )
        out[f"refreshed[{where}]"] = z3.Implies(
            z3.And(f.o_sharded, z3.Not(f.p_sharded)), z3.Or(f.refresh_end, f.refresh_start)
        )
    out["fetch_before_forward"] = z3.Implies(ft.offload, ft.fetch_forward)
    out["fetch_before_backward"] = z3.Implies(ft.offload, ft.fetch_backward)
    return out


# --- constant folding: with a concrete program most branches disappear while the terms are built ---


def _flat(args: tuple[object, ...]) -> list[z3.BoolRef]:
    if len(args) == 1 and isinstance(args[0], list | tuple):
        return list(args[0])
    return list(args)


def _and(*args: object) -> z3.BoolRef:
    xs = [x for x in _flat(args) if not z3.is_true(x)]
    if any(z3.is_false(x) for x in xs):
        return z3.BoolVal(False)
    return z3.BoolVal(True) if not xs else xs[0] if len(xs) == 1 else z3.And(xs)


def _or(*args: object) -> z3.BoolRef:
    xs = [x for x in _flat(args) if not z3.is_false(x)]
    if any(z3.is_true(x) for x in xs):
        return z3.BoolVal(True)
    return z3.BoolVal(False) if not xs else xs[0] if len(xs) == 1 else z3.Or(xs)


def _not(x: z3.BoolRef) -> z3.BoolRef:
    if z3.is_true(x):
        return z3.BoolVal(False)
    if z3.is_false(x):
        return z3.BoolVal(True)
    return z3.Not(x)


def _implies(a: z3.BoolRef, b: z3.BoolRef) -> z3.BoolRef:
    return _or(_not(a), b)


def _if(c: z3.BoolRef, a: z3.ExprRef | float, b: z3.ExprRef | float) -> z3.ExprRef:
    if z3.is_true(c):
        return a
    if z3.is_false(c):
        return b
    return z3.If(c, a, b)


def _eq(x: z3.ArithRef, k: int) -> z3.BoolRef:
    return z3.BoolVal(x.as_long() == k) if z3.is_int_value(x) else x == k


# --- the semantics ---------------------------------------------------------------------------------

# A contribution: (sample coords, element, part coords, forward view, backward view, visible)
# where ``visible`` says, per sample-splitting axis, whether the whole sequence is visible
# (True) or only the device's own block (False); it matters on SEQUENCE axes only.
Contribution = Callable[[Coords, Coords, Coords, Sequence[Value], Sequence[Value], Coords, tuple[bool, ...]], Value]
Update = Callable[[Value, Value, Value], tuple[Value, Value]]


class Junk:
    """What a device reads from a buffer that does not hold the value it wants.

    ``free``: a fresh unconstrained variable per read (sufficiency: any garbage);
    otherwise zero (necessity: freshly allocated, zeroed buffers, as the numpy check does).
    """

    def __init__(self, free: bool, prefix: str = "junk") -> None:
        self.free, self.prefix, self.count = free, prefix, 0

    def __call__(self) -> Value:
        if not self.free:
            return z3.RealVal(0)
        self.count += 1
        return z3.Real(f"{self.prefix}!{self.count}")


def devices(mesh: Mesh) -> list[Coords]:
    return list(itertools.product(*(range(a.degree) for a in mesh)))


def elements(mesh: Mesh) -> list[Coords]:
    return list(itertools.product(*(range(a.size) for a in mesh)))


def owns(ax: MeshAxis, e: int, offset: z3.ArithRef, c: int) -> z3.BoolRef:
    """Does coordinate ``c`` hold element coordinate ``e`` when shard k lives on (k + offset) mod d?

    Blocks are ``size // degree`` long; elements past ``degree`` whole blocks belong to nobody
    (what happens when sizes do not divide, composition rule 1).
    """
    q = ax.size // ax.degree
    if q == 0 or e >= q * ax.degree:
        return z3.BoolVal(False)
    block = e // q
    if z3.is_int_value(offset):
        return z3.BoolVal((block + offset.as_long()) % ax.degree == c)
    return _or([offset == o for o in range(ax.degree) if (block + o) % ax.degree == c])


def _lookup(table: dict[tuple[Coords, Coords], Value], e: Coords) -> Callable[[Coords], Value]:
    """``device -> table[(device, e)]``."""
    return lambda c: table[(c, e)]


def _with(coords: Coords, axis: int, value: int) -> Coords:
    return (*coords[:axis], value, *coords[axis + 1 :])


def _from_owner(
    ax: MeshAxis, axis: int, e: Coords, offset: z3.ArithRef, i: Coords, table: Callable[[Coords], Value], junk: Junk
) -> Value:
    """The value ``table`` holds at the owner (along ``axis``) of element ``e``, seen from ``i``."""
    out: Value = junk()
    for c in reversed(range(ax.degree)):
        out = _if(owns(ax, e[axis], offset, c), table(_with(i, axis, c)), out)
    return out


@dataclass
class Step:
    """The result of running the machine: every read and every post-state copy, as z3 terms."""

    reads: list[tuple[str, Value, Value]]  # (where, value read, single-device value)
    post: list[tuple[str, z3.BoolRef, Value, Value]]  # (where, live?, value, single-device value)
    coverage: list[tuple[str, z3.BoolRef]]
    pre: list[tuple[str, z3.BoolRef]]  # the invariant before the step
    single_gradient: dict[Coords, Value]
    gradient: dict[tuple[Coords, Coords], Value]
    p_final: dict[tuple[Coords, Coords], Value]

    def goal(self) -> z3.BoolRef:
        parts = [read == want for _, read, want in self.reads]
        parts += [_implies(live, value == want) for _, live, value, want in self.post]
        parts += [cov for _, cov in self.coverage]
        return _and(parts)

    def invariant(self) -> z3.BoolRef:
        return _and([p for _, p in self.pre])


def run(
    mesh: Mesh,
    ft: Features,
    contribution: Contribution,
    update: Update,
    junk: Junk,
    p: dict[Coords, Value],
    o: dict[Coords, Value],
    p_dev: dict[tuple[Coords, Coords], Value],
    o_dev: dict[tuple[Coords, Coords], Value],
    host: dict[Coords, Value],
) -> Step:
    """One step of the program ``ft`` on ``mesh`` from the given single-device values ``p``,
    ``o`` and per-device copies ``p_dev``, ``o_dev``, ``host`` (see the module doc)."""
    devs, elems = devices(mesh), elements(mesh)
    n = len(mesh)

    def held(
        sharded: Callable[[AxisFeatures], z3.BoolRef],
        offset: Callable[[AxisFeatures], z3.ArithRef],
        i: Coords,
        e: Coords,
    ) -> z3.BoolRef:
        return _and(
            [
                _or(_not(sharded(f)), owns(ax, e[a], offset(f), i[a]))
                for a, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True))
            ]
        )

    def held_p(i: Coords, e: Coords) -> z3.BoolRef:
        return held(lambda f: f.p_sharded, lambda f: f.p_offset, i, e)

    def held_o(i: Coords, e: Coords) -> z3.BoolRef:
        return held(lambda f: f.o_sharded, lambda f: f.o_offset, i, e)

    # 0. refresh at start: replicas overwritten from the optimizer-shard owner (refresh offset).
    p1 = dict(p_dev)
    for a, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True)):
        prev = dict(p1)
        for i in devs:
            for e in elems:
                pulled = _from_owner(ax, a, e, f.refresh_offset, i, _lookup(prev, e), junk)
                p1[(i, e)] = _if(_and(f.refresh_start, _not(f.p_sharded)), pulled, prev[(i, e)])

    # 1. reads.
    def read(i: Coords, e: Coords, gather: Callable[[AxisFeatures], z3.BoolRef], fetch: z3.BoolRef) -> Value:
        def pick(a: int, src: Coords) -> Value:
            if a == n:
                return p1[(src, e)]
            ax, f = mesh[a], ft.axes[a]
            from_owner = _from_owner(ax, a, e, f.p_offset, src, lambda c: pick(a + 1, c), junk)
            if ax.cls.computes_sharded:  # the computation for e runs on its owner
                return from_owner
            local = _if(_or(_not(f.p_sharded), owns(ax, e[a], f.p_offset, src[a])), pick(a + 1, src), junk())
            return _if(_and(f.p_sharded, gather(f)), from_owner, local)

        return _if(ft.offload, _if(fetch, host[e], junk()), pick(0, i))

    view_f = {i: [read(i, e, lambda f: f.gather_forward, ft.fetch_forward) for e in elems] for i in devs}
    view_b = {i: [read(i, e, lambda f: f.gather_backward, ft.fetch_backward) for e in elems] for i in devs}
    reads: list[tuple[str, Value, Value]] = []
    for i in devs:
        for k, e in enumerate(elems):
            reads.append((f"forward read of P{e} on {i}", view_f[i][k], p[e]))
            reads.append((f"backward read of P{e} on {i}", view_b[i][k], p[e]))

    # 2. local gradients.
    sample_axes = [a for a, ax in enumerate(mesh) if ax.cls.splits_samples]
    part_axes = [a for a, ax in enumerate(mesh) if ax.cls is AxisClass.PART]
    all_samples = list(itertools.product(*(range(mesh[a].degree) for a in sample_axes)))
    all_parts = list(itertools.product(*(range(mesh[a].degree) for a in part_axes)))
    seq_flags = [mesh[a].cls is AxisClass.SEQUENCE for a in sample_axes]
    everything = tuple(True for _ in sample_axes)
    batch = len(all_samples)

    def contributions(
        i: Coords, e: Coords, vf: Sequence[Value], vb: Sequence[Value], visible: tuple[bool, ...]
    ) -> Value:
        samples = [
            k
            for k in all_samples
            if all(mesh[a].cls is AxisClass.EXPERT or k[s] == i[a] for s, a in enumerate(sample_axes))
        ]
        parts = [j for j in all_parts if all(j[s] == i[a] for s, a in enumerate(part_axes))]
        return z3.Sum(
            [contribution(k, e, j, vf, vb, tuple(i[a] for a in sample_axes), visible) for k in samples for j in parts]
            or [z3.RealVal(0)]
        )

    lg: dict[tuple[Coords, Coords], Value] = {}
    for i in devs:
        for e in elems:
            computes = _and(
                [
                    owns(ax, e[a], f.p_offset, i[a])
                    for a, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True))
                    if ax.cls.computes_sharded
                ]
            )
            # Without K/V exchange a token block sees only its own block along SEQUENCE axes.
            value: Value = contributions(i, e, view_f[i], view_b[i], everything)
            for s, a in enumerate(sample_axes):
                if seq_flags[s]:
                    local = tuple(not (t == s) for t in range(len(sample_axes)))
                    value = _if(ft.axes[a].exchange, value, contributions(i, e, view_f[i], view_b[i], local))
            lg[(i, e)] = _if(computes, value, junk())

    single_view = [p[e] for e in elems]
    single_g = {
        e: z3.Sum(
            [contribution(k, e, j, single_view, single_view, k, everything) for k in all_samples for j in all_parts]
            or [z3.RealVal(0)]
        )
        / batch
        for e in elems
    }

    # 3. gradient synchronisation, axis by axis.
    g = lg
    for a, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True)):
        d = ax.degree

        def reduce(
            src: dict[tuple[Coords, Coords], Value], a: int = a, ax: MeshAxis = ax, f: AxisFeatures = f, d: int = d
        ) -> dict[tuple[Coords, Coords], Value]:
            out: dict[tuple[Coords, Coords], Value] = {}
            for i in devs:
                for e in elems:
                    total = z3.Sum([src[(_with(i, a, c), e)] for c in range(d)])
                    total = _if(f.mean, total / d, total)
                    out[(i, e)] = _if(_or(_not(f.g_sharded), owns(ax, e[a], f.g_offset, i[a])), total, junk())
            return out

        once = reduce(g) if not z3.is_true(_eq(f.reductions, 0)) else g
        twice = reduce(once) if not (z3.is_true(_eq(f.reductions, 0)) or z3.is_true(_eq(f.reductions, 1))) else g
        g = {
            key: _if(f.scaled, 1 / z3.RealVal(d), 1)
            * _if(_eq(f.reductions, 0), g[key], _if(_eq(f.reductions, 1), once[key], twice[key]))
            for key in g
        }

    # 4. the element-wise update on the optimizer's shards.
    p2: dict[tuple[Coords, Coords], Value] = {}
    o2: dict[tuple[Coords, Coords], Value] = {}
    new_p: dict[tuple[Coords, Coords], Value] = {}
    post: list[tuple[str, z3.BoolRef, Value, Value]] = []
    for i in devs:
        for e in elems:
            updates = held_o(i, e)
            p_read = _if(ft.offload, host[e], _if(held_p(i, e), p1[(i, e)], junk()))
            reads.append((f"optimizer read of P{e} on {i}", _if(updates, p_read, p[e]), p[e]))
            reads.append((f"optimizer read of O{e} on {i}", _if(updates, o_dev[(i, e)], o[e]), o[e]))
            reads.append((f"optimizer read of G{e} on {i}", _if(updates, g[(i, e)], single_g[e]), single_g[e]))
            up_p, up_o = update(p_read, o_dev[(i, e)], g[(i, e)])
            new_p[(i, e)] = up_p
            p2[(i, e)] = _if(_and(updates, held_p(i, e), _not(ft.offload)), up_p, p1[(i, e)])
            o2[(i, e)] = _if(updates, up_o, o_dev[(i, e)])

    # 5. refresh at end.
    for a, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True)):
        prev = dict(p2)
        for i in devs:
            for e in elems:
                pulled = _from_owner(ax, a, e, f.refresh_offset, i, _lookup(prev, e), junk)
                p2[(i, e)] = _if(_and(f.refresh_end, _not(f.p_sharded)), pulled, prev[(i, e)])

    # The host copy (offloaded parameters) is written by the optimizer-shard owner of each element.
    def canonical(e: Coords) -> Value:
        def pick(a: int, src: Coords) -> Value:
            if a == n:
                return new_p[(src, e)]
            ax, f = mesh[a], ft.axes[a]
            return _if(
                f.o_sharded,
                _from_owner(ax, a, e, f.o_offset, src, lambda c: pick(a + 1, c), junk),
                pick(a + 1, _with(src, a, 0)),
            )

        return pick(0, tuple(0 for _ in mesh))

    # Liveness: held, and not overwritten (refresh at start) before the next read.
    def live_p(i: Coords, e: Coords) -> z3.BoolRef:
        overwritten = _or(
            [
                _and(f.refresh_start, _not(f.p_sharded), _not(owns(ax, e[a], f.refresh_offset, i[a])))
                for a, (ax, f) in enumerate(zip(mesh, ft.axes, strict=True))
            ]
            or [z3.BoolVal(False)]
        )
        return _and(_not(ft.offload), held_p(i, e), _not(overwritten))

    pre: list[tuple[str, z3.BoolRef]] = []
    coverage: list[tuple[str, z3.BoolRef]] = []
    for e in elems:
        want_p, want_o = update(p[e], o[e], single_g[e])
        for i in devs:
            pre.append((f"P{e} on {i}", _implies(live_p(i, e), p_dev[(i, e)] == p[e])))
            pre.append((f"O{e} on {i}", _implies(held_o(i, e), o_dev[(i, e)] == o[e])))
            post.append((f"P{e} on {i} after the step", live_p(i, e), p2[(i, e)], want_p))
            post.append((f"O{e} on {i} after the step", held_o(i, e), o2[(i, e)], want_o))
        pre.append((f"host P{e}", _implies(ft.offload, host[e] == p[e])))
        post.append((f"host P{e} after the step", ft.offload, _if(ft.offload, canonical(e), host[e]), want_p))
        coverage.append((f"P{e} held", _or([ft.offload] + [live_p(i, e) for i in devs])))
        coverage.append((f"O{e} held", _or([held_o(i, e) for i in devs])))
    return Step(reads, post, coverage, pre, single_g, g, p2)


# --- instantiations -------------------------------------------------------------------------------


def state_variables(
    mesh: Mesh, prefix: str = "s"
) -> tuple[
    dict[Coords, Value],
    dict[Coords, Value],
    dict[tuple[Coords, Coords], Value],
    dict[tuple[Coords, Coords], Value],
    dict[Coords, Value],
]:
    devs, elems = devices(mesh), elements(mesh)
    p = {e: z3.Real(f"{prefix}.p{list(e)}") for e in elems}
    o = {e: z3.Real(f"{prefix}.o{list(e)}") for e in elems}
    p_dev = {(i, e): z3.Real(f"{prefix}.p{list(e)}@{list(i)}") for i in devs for e in elems}
    o_dev = {(i, e): z3.Real(f"{prefix}.o{list(e)}@{list(i)}") for i in devs for e in elems}
    host = {e: z3.Real(f"{prefix}.host{list(e)}") for e in elems}
    return p, o, p_dev, o_dev, host


def uninterpreted(mesh: Mesh) -> tuple[Contribution, Update]:
    """Any model and any element-wise optimizer: per-sample contributions and the update are
    uninterpreted functions; a contribution sees the parameters only through what was read."""
    n_elems = len(elements(mesh))
    contrib = z3.Function(
        "contribution",
        z3.IntSort(),
        z3.IntSort(),
        z3.IntSort(),
        z3.IntSort(),
        z3.RealSort(),
        z3.RealSort(),
        z3.RealSort(),
    )
    view = z3.Function("view", *([z3.RealSort()] * max(n_elems, 1)), z3.RealSort())
    upd_p = z3.Function("update_p", z3.RealSort(), z3.RealSort(), z3.RealSort(), z3.RealSort())
    upd_o = z3.Function("update_o", z3.RealSort(), z3.RealSort(), z3.RealSort(), z3.RealSort())
    elem_index = {e: k for k, e in enumerate(elements(mesh))}
    sample_axes = [ax for ax in mesh if ax.cls.splits_samples]
    part_dims = [ax.degree for ax in mesh if ax.cls is AxisClass.PART]

    def index(coords: Coords, dims: Sequence[int]) -> int:
        out = 0
        for c, dim in zip(coords, dims, strict=True):
            out = out * dim + c
        return out

    def contribution(
        k: Coords,
        e: Coords,
        j: Coords,
        vf: Sequence[Value],
        vb: Sequence[Value],
        block: Coords,
        visible: tuple[bool, ...],
    ) -> Value:
        # What a token block sees without the exchange: only its own block (``block``), encoded
        # as a context number; 0 is the whole sequence.
        ctx = 0
        for s, (vis, _ax) in enumerate(zip(visible, sample_axes, strict=True)):
            if not vis:
                ctx = 1 + s * 64 + block[s]
        sdims = [ax.degree for ax in sample_axes]
        return contrib(index(k, sdims), elem_index[e], index(j, part_dims), ctx, view(*vf), view(*vb))

    def update(pv: Value, ov: Value, gv: Value) -> tuple[Value, Value]:
        return upd_p(pv, ov, gv), upd_o(pv, ov, gv)

    return contribution, update


def sufficiency_query(
    mesh: Mesh, ft: Features, drop: frozenset[str] = frozenset()
) -> tuple[dict[str, z3.BoolRef], z3.BoolRef]:
    """Hypotheses (domain, conditions minus ``drop``, the invariant before) and the goal."""
    contribution, update = uninterpreted(mesh)
    p, o, p_dev, o_dev, host = state_variables(mesh)
    step = run(mesh, ft, contribution, update, Junk(free=True), p, o, p_dev, o_dev, host)
    hyps: dict[str, z3.BoolRef] = dict(ft.domain)
    for name, formula in conditions(mesh, ft).items():
        if name not in drop:
            hyps[name] = formula
    hyps["invariant_before_step"] = step.invariant()
    return hyps, step.goal()


def iter_meshes(max_devices: int, classes: Sequence[AxisClass], max_axes: int = 2) -> Iterator[Mesh]:
    """Every mesh of up to ``max_axes`` axes of the given classes with at least two devices per
    axis and at most ``max_devices`` devices (axes unordered: sorted by class)."""
    for count in range(1, max_axes + 1):
        for combo in itertools.combinations_with_replacement(classes, count):
            for degrees in itertools.product(range(2, max_devices + 1), repeat=count):
                total = 1
                for d in degrees:
                    total *= d
                if total <= max_devices:
                    yield tuple(MeshAxis(c, d) for c, d in zip(combo, degrees, strict=True))
