"""A concrete model, data and plain SGD, run single-device and on the machine's devices with numpy.

The necessity obligations take z3's counterexample (targets ``y`` and initial weights) and check it
here, independently of the z3 encoding: this file interprets a ``Program`` imperatively, on numpy
arrays of exact ``Fraction`` values (so "differs" is exact, not within a tolerance).

The model: linear regression with L2 regularisation, per sample ``k`` and part ``j``,
``loss = (x_eff . w - y)^2 / 2 + lam |w|^2 / 2`` where ``x_eff`` mixes the token blocks a sample's
block can see (a one-line stand-in for attention: without the K/V exchange of context
parallelism, a block sees only itself). Its per-sample gradient is
``(x_eff . w_forward - y) x_eff + lam w_backward``: the forward read enters the residual, the
backward read the regulariser, so a wrong read in either phase changes the gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from proofs._machine import AxisClass, Coords, Mesh, MeshAxis, Program, devices, elements

LAMBDA = Fraction(1, 2)  # L2 coefficient
LR = Fraction(1, 4)  # dyadic learning rate


def _x_value(k: int, j: int, e: int) -> int:
    """Fixed features in -2..2, varied over samples, parts and elements (not all zero)."""
    return (3 + 5 * k + 7 * j + 11 * e) % 5 - 2


@dataclass(frozen=True)
class LinearModel:
    """The data of one counterexample: targets per (sample, part); features are fixed."""

    mesh: Mesh

    @property
    def sample_axes(self) -> list[int]:
        return [a for a, ax in enumerate(self.mesh) if ax.cls.splits_samples]

    @property
    def part_axes(self) -> list[int]:
        return [a for a, ax in enumerate(self.mesh) if ax.cls is AxisClass.PART]

    def samples(self) -> list[Coords]:
        return list(itertools.product(*(range(self.mesh[a].degree) for a in self.sample_axes)))

    def parts(self) -> list[Coords]:
        return list(itertools.product(*(range(self.mesh[a].degree) for a in self.part_axes)))

    def _flat(self, coords: Coords, axes: Sequence[int]) -> int:
        out = 0
        for c, a in zip(coords, axes, strict=True):
            out = out * self.mesh[a].degree + c
        return out

    def x(self, k: Coords, j: Coords) -> list[int]:
        kf, jf = self._flat(k, self.sample_axes), self._flat(j, self.part_axes)
        return [_x_value(kf, jf, ef) for ef in range(len(elements(self.mesh)))]

    def x_eff(self, k: Coords, j: Coords, visible: tuple[bool, ...]) -> list[int]:
        seq = [self.mesh[a].cls is AxisClass.SEQUENCE for a in self.sample_axes]
        out = [0] * len(elements(self.mesh))
        for k2 in self.samples():
            same = all(k2[s] == k[s] or (seq[s] and visible[s]) for s in range(len(k)))
            if same:
                out = [u + v for u, v in zip(out, self.x(k2, j), strict=True)]
        return out

    def contribution(
        self,
        k: Coords,
        e: Coords,
        j: Coords,
        vf: Any,
        vb: Any,
        block: Coords,
        visible: tuple[bool, ...],
        y: dict[tuple[Coords, Coords], Any],
    ) -> Any:
        del block  # the sample's own block is ``k``; ``visible`` says how far it sees
        xe = self.x_eff(k, j, visible)
        idx = elements(self.mesh).index(e)
        residual = sum((xe[t] * vf[t] for t in range(len(xe))), start=0) - y[(k, j)]
        return residual * xe[idx] + LAMBDA * vb[idx]


def _owner(ax: MeshAxis, e: int, offset: int) -> int | None:
    q = ax.size // ax.degree
    if q == 0 or e >= q * ax.degree:
        return None
    return (e // q + offset) % ax.degree


def _owns(ax: MeshAxis, e: int, offset: int, c: int) -> bool:
    return _owner(ax, e, offset) == c


def _with(i: Coords, a: int, c: int) -> Coords:
    return (*i[:a], c, *i[a + 1 :])


@dataclass(frozen=True)
class Outcome:
    """What differs, step by step: the first differing read or state, or None."""

    differs: str | None
    steps: int


def single_device(
    model: LinearModel, y: dict[tuple[Coords, Coords], Fraction], w: dict[Coords, Fraction]
) -> dict[Coords, Fraction]:
    elems = elements(model.mesh)
    view = np.array([w[e] for e in elems], dtype=object)
    samples, parts = model.samples(), model.parts()
    everything = tuple(True for _ in model.sample_axes)
    out = {}
    for e in elems:
        total = sum(
            (model.contribution(k, e, j, view, view, k, everything, y) for k in samples for j in parts),
            start=Fraction(0),
        )
        out[e] = w[e] - LR * total / len(samples)
    return out


def distributed(
    model: LinearModel,
    program: Program,
    y: dict[tuple[Coords, Coords], Fraction],
    w0: dict[Coords, Fraction],
    steps: int = 2,
) -> Outcome:
    """Run ``program`` for ``steps`` steps from all copies equal to ``w0``; compare every read and
    every live copy with single-device SGD after each step. Unheld buffers read as zero."""
    mesh = model.mesh
    devs, elems = devices(mesh), elements(mesh)
    axes = program.axes
    p_dev = {(i, e): w0[e] for i in devs for e in elems}
    host = dict(w0)
    w = dict(w0)

    def held(kind: str, i: Coords, e: Coords) -> bool:
        for a, (ax, f) in enumerate(zip(mesh, axes, strict=True)):
            sharded, offset = {
                "P": (f.p_sharded or ax.cls.computes_sharded, f.p_offset),
                "O": (f.o_sharded, f.o_offset),
            }[kind]
            if sharded and not _owns(ax, e[a], offset, i[a]):
                return False
        return True

    def pull(table: dict[tuple[Coords, Coords], Fraction], a: int, offset: int, i: Coords, e: Coords) -> Fraction:
        owner = _owner(mesh[a], e[a], offset)
        return Fraction(0) if owner is None else table[(_with(i, a, owner), e)]

    for step in range(1, steps + 1):
        # 0. refresh at start
        for a, f in enumerate(axes):
            if f.refresh_start and not f.p_sharded:
                prev = dict(p_dev)
                for i in devs:
                    for e in elems:
                        p_dev[(i, e)] = pull(prev, a, f.refresh_offset, i, e)

        # 1. reads
        def read(
            i: Coords,
            e: Coords,
            backward: bool,
            p_dev: dict[tuple[Coords, Coords], Fraction] = p_dev,
            host: dict[Coords, Fraction] = host,
        ) -> Fraction:
            if program.offload:
                return host[e] if (program.fetch_backward if backward else program.fetch_forward) else Fraction(0)
            src = list(i)
            for a, (ax, f) in enumerate(zip(mesh, axes, strict=True)):
                gather = f.gather_backward if backward else f.gather_forward
                owner = _owner(ax, e[a], f.p_offset)
                if ax.cls.computes_sharded or (f.p_sharded and gather):
                    if owner is None:
                        return Fraction(0)
                    src[a] = owner
                elif f.p_sharded and owner != i[a]:
                    return Fraction(0)
            return p_dev[(tuple(src), e)]

        view_f = {i: np.array([read(i, e, False) for e in elems], dtype=object) for i in devs}
        view_b = {i: np.array([read(i, e, True) for e in elems], dtype=object) for i in devs}
        for i in devs:
            for k, e in enumerate(elems):
                for phase, view in (("forward", view_f), ("backward", view_b)):
                    if view[i][k] != w[e]:
                        return Outcome(
                            f"step {step}: {phase} read of P{list(e)} on device {list(i)} is "
                            f"{view[i][k]}, single-device {w[e]}",
                            step,
                        )

        # 2. local gradients
        sample_axes, part_axes = model.sample_axes, model.part_axes
        lg: dict[tuple[Coords, Coords], Fraction] = {}
        for i in devs:
            visible = tuple(axes[a].exchange or mesh[a].cls is not AxisClass.SEQUENCE for a in sample_axes)
            samples = [
                k
                for k in model.samples()
                if all(mesh[a].cls is AxisClass.EXPERT or k[s] == i[a] for s, a in enumerate(sample_axes))
            ]
            parts = [j for j in model.parts() if all(j[s] == i[a] for s, a in enumerate(part_axes))]
            for e in elems:
                computes = all(
                    _owns(ax, e[a], f.p_offset, i[a])
                    for a, (ax, f) in enumerate(zip(mesh, axes, strict=True))
                    if ax.cls.computes_sharded
                )
                lg[(i, e)] = (
                    sum(
                        (
                            model.contribution(k, e, j, view_f[i], view_b[i], k, visible, y)
                            for k in samples
                            for j in parts
                        ),
                        start=Fraction(0),
                    )
                    if computes
                    else Fraction(0)
                )

        # 3. synchronisation
        g = lg
        for a, (ax, f) in enumerate(zip(mesh, axes, strict=True)):
            for _ in range(f.reductions):
                new = {}
                for i in devs:
                    for e in elems:
                        total = sum((g[(_with(i, a, c), e)] for c in range(ax.degree)), start=Fraction(0))
                        if f.mean:
                            total /= ax.degree
                        keep = not f.g_sharded or _owns(ax, e[a], f.g_offset, i[a])
                        new[(i, e)] = total if keep else Fraction(0)
                g = new
            if f.scaled:
                g = {key: v / ax.degree for key, v in g.items()}

        # 4. SGD on the optimizer's shards
        new_w = single_device(model, y, w)
        p2 = dict(p_dev)
        new_host = dict(host)
        for i in devs:
            for e in elems:
                if not held("O", i, e):
                    continue
                p_read = host[e] if program.offload else (p_dev[(i, e)] if held("P", i, e) else Fraction(0))
                if p_read != w[e]:
                    return Outcome(
                        f"step {step}: optimizer read of P{list(e)} on device {list(i)} is {p_read}, "
                        f"single-device {w[e]}",
                        step,
                    )
                value = p_read - LR * g[(i, e)]
                if program.offload:
                    new_host[e] = value
                elif held("P", i, e):
                    p2[(i, e)] = value

        # 5. refresh at end
        for a, f in enumerate(axes):
            if f.refresh_end and not f.p_sharded:
                prev = dict(p2)
                for i in devs:
                    for e in elems:
                        p2[(i, e)] = pull(prev, a, f.refresh_offset, i, e)
        p_dev, host, w = p2, new_host, new_w

        # Reassembled parameters: every element from a holder that the next step will read.
        for e in elems:
            holders = [host[e]] if program.offload else [p_dev[(i, e)] for i in devs if held("P", i, e)]
            if not holders:
                return Outcome(f"step {step}: no device holds P{list(e)}", step)
            if program.offload or not any(f.refresh_start for f in axes):
                wrong = [v for v in holders if v != w[e]]
                if wrong and all(v != w[e] for v in holders):
                    return Outcome(f"step {step}: reassembled P{list(e)} is {wrong[0]}, single-device {w[e]}", step)
    return Outcome(None, steps)
