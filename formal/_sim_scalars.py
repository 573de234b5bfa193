"""The executable reference for the scalars around the gradients (``formal/_scalars.py``).

Runs a program's scalar ops on concrete data over every device of the mesh at once (not axis by
axis, as z3 does), beside single-device training, and reports the first disagreement:

* the loss normaliser, with random, unequal token counts per data-parallel rank (each position
  along dp, dpr, cp and ep) and per micro-batch: each device's divisor from the counts it
  reduces, the weight one of its tokens carries in the synchronised gradient (the gradient
  synchronisation's mean over the data axes included), in exact fractions, against one over
  the global count;
* the global gradient norm and the clip, in float64: each group's gradient is a random tensor
  laid out by its holdings (one dimension per axis along which it is sharded), every device adds
  the squared norm of the block it holds (on the first holder only along the ``once`` axes) and
  sums over the devices that agree with it off the ``over`` axes; the clip scales each device's
  block by ``min(1, max_norm / norm)`` with ``max_norm`` half the true norm, so clipping bites.
  Compared with the single-device norm and clipped gradient within a relative tolerance of
  ``RTOL`` (the summation order differs, as for Adam in ``formal/_simulator.py``);
* the fp16 overflow decision: an inf at a random element of each group in turn; each device
  sees the infs of the blocks it checks, or-reduced over the ``over`` axes, against "skip".

The defaults when the settings ask for a scalar the program does not compute are the verdict's:
no normaliser is the mean of the micro-batches' means, no norm leaves every gradient unclipped,
no overflow check lets every device step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from math import prod

import numpy as np

from formal._program import StepProgram
from formal._scalar_program import Holding, aux_scope, aux_split_axes, holders, holding, token_axes
from formal._scalars import GLOBAL, LossScale, ScalarKind, ScalarOp
from formal._smt_common import _int_degree
from formal._vocab import LOGITS, Axis, Group, State

RTOL = 1e-9  # relative tolerance of the float64 norm and clip (summation order differs)
MAX_DEVICES = 512


@dataclass(frozen=True)
class ScalarMismatch:
    """The first disagreement: which scalar, on which device, both values."""

    scalar: str
    device: dict[str, int]
    value: str
    single_device: str
    detail: str = ""


def simulate_scalars(program: StepProgram, seed: int = 0) -> ScalarMismatch | None:
    """Run ``program``'s scalars beside single-device training; ``None`` when they agree."""
    pl = program.placement
    mesh = [(a, _int_degree(d)) for a, d in pl.mesh]
    if prod(d for _, d in mesh) > MAX_DEVICES:
        raise ValueError(f"{prod(d for _, d in mesh)} devices: the scalar reference runs at most {MAX_DEVICES}")
    rng = np.random.default_rng(seed)
    settings = pl.options.scalars
    ops = list(program.scalars)
    normalisers = [op for op in ops if op.kind is ScalarKind.NORMALISE_LOSS]
    if normalisers or settings.per_token:
        op = normalisers[0] if normalisers else ScalarOp(ScalarKind.NORMALISE_LOSS)
        found = _loss(program, op, mesh, rng)
        if found is not None:
            return found
    kinds = [op.kind for op in ops]
    if ScalarKind.GRAD_NORM in kinds or ScalarKind.CLIP in kinds or settings.clip:
        found = _norm_and_clip(program, ops, mesh, rng)
        if found is not None:
            return found
    if ScalarKind.OVERFLOW_CHECK in kinds or settings.loss_scale is LossScale.DYNAMIC:
        check = next((op for op in ops if op.kind is ScalarKind.OVERFLOW_CHECK), None)
        found = _overflow(program, check, mesh, rng)
        if found is not None:
            return found
    if ScalarKind.AUX_LOSS in kinds or settings.balancing:
        aux = next((op for op in ops if op.kind is ScalarKind.AUX_LOSS), ScalarOp(ScalarKind.AUX_LOSS))
        found = _aux(program, aux, rng)
        if found is not None:
            return found
    for kernel in (op for op in ops if op.kind is ScalarKind.CROSS_ENTROPY):
        found = _cross_entropy(program, kernel, mesh, rng)
        if found is not None:
            return found
    return None


# --------------------------------------------------------------------------- the loss kernel's logits


def _cross_entropy(
    program: StepProgram, op: ScalarOp, mesh: list[tuple[Axis, int]], rng: np.random.Generator
) -> ScalarMismatch | None:
    """Random logits over a vocabulary of 4 entries per shard; every device computes the
    cross-entropy of one target token as its kernel does (log of its normaliser, summed over
    the ``over`` axes, minus the target's logit from the owning shard), against ``log Z - x_t``
    over the whole vocabulary, within ``RTOL``."""
    pl = program.placement
    split = [(a, d) for a, d in mesh if a.kind.hosts_vocabulary and pl.mode(State.ACTIVATIONS, LOGITS, a).is_sharded]
    shards = prod(d for _, d in split)
    vocab = 4 * shards
    logits = rng.standard_normal(vocab)
    target = int(rng.integers(0, vocab))
    single = float(np.log(np.sum(np.exp(logits))) - logits[target])
    names = [a for a, _ in split]
    layout = np.arange(vocab).reshape([*(d for _, d in split), 4])

    def local(device: dict[Axis, int]) -> float:
        """Sum of exp over the vocabulary ``device`` holds: its shard along the axes kept split."""
        index = layout
        for a in names:
            if a not in op.gathered:
                index = np.take(index, [device[a]], axis=names.index(a))
        return float(np.sum(np.exp(logits[index.ravel()])))

    devices = _devices(mesh)
    for dev in devices:
        peers = [o for o in devices if all(o[a] == dev[a] or a in op.over for a, _ in mesh)]
        value = float(np.log(sum(local(o) for o in peers)) - logits[target])  # target from its owner
        if abs(value - single) > RTOL * max(1.0, abs(single)):
            return ScalarMismatch("cross_entropy", _show(dev), f"{value:.12g}", f"{single:.12g}", "the loss")
    return None


# --------------------------------------------------------------------------- the load-balancing loss

EXPERTS = 3


def _aux(program: StepProgram, op: ScalarOp, rng: np.random.Generator) -> ScalarMismatch | None:
    """Random routing of a few tokens per cell (one cell per position along every axis that
    splits the tokens, and per micro-batch); each cell forms Switch's ``E sum_e f_e P_e`` from
    the statistics of the cells it reduces over; the cells' losses combine as the gradient does
    (the mean along data axes and micro-batches, the sum along tp); single-device training
    balances each set of tokens its scope names (a replica's micro-batch, or the global batch)."""
    pl = program.placement
    whole = pl.options.scalars.balancing == GLOBAL
    axes = list(aux_split_axes(pl))
    m = int(pl.options.micro_batches)
    names = [a.value for a in axes] + ["micro-batch"]
    degrees = [int(pl.degree(a)) for a in axes] + [m]
    reduced = [a in op.over for a in axes] + [op.micro_batches]
    scope = [a in set(aux_scope(pl, whole)) for a in axes] + [whole]
    averaged = [a.splits_data for a in axes] + [True]
    grid = list(itertools.product(*(range(d) for d in degrees)))
    stats: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
    for cell in grid:
        tokens = int(rng.integers(1, 6))
        choice = rng.integers(0, EXPERTS, size=tokens)
        probs = rng.dirichlet(np.ones(EXPERTS), size=tokens)
        stats[cell] = (np.bincount(choice, minlength=EXPERTS).astype(float), probs.sum(axis=0))

    def balance(cells: list[tuple[int, ...]]) -> float:
        counts = sum((stats[c][0] for c in cells), np.zeros(EXPERTS))
        probs = sum((stats[c][1] for c in cells), np.zeros(EXPERTS))
        n = counts.sum()
        return float(EXPERTS * np.sum((counts / n) * (probs / n)))

    def group(cell: tuple[int, ...], free: list[bool]) -> list[tuple[int, ...]]:
        return [c for c in grid if all(c[i] == cell[i] or free[i] for i in range(len(cell)))]

    device = {cell: balance(group(cell, reduced)) for cell in grid}

    def combine(values: dict[tuple[int, ...], float], i: int) -> dict[tuple[int, ...], float]:
        """Fold coordinate ``i``: the mean, the sum, or (reduced along tp) the one shared loss."""
        out: dict[tuple[int, ...], list[float]] = {}
        for cell, v in values.items():
            out.setdefault(cell[:i] + cell[i + 1 :], []).append(v)
        if averaged[i]:
            return {k: sum(v) / len(v) for k, v in out.items()}
        return {k: (v[0] if reduced[i] else sum(v)) for k, v in out.items()}

    program_value = device
    for i in reversed(range(len(degrees))):
        program_value = combine(program_value, i)
    reference = {cell: balance(group(cell, scope)) for cell in grid}
    for i in reversed(range(len(degrees))):
        folded: dict[tuple[int, ...], list[float]] = {}
        for cell, v in reference.items():
            folded.setdefault(cell[:i] + cell[i + 1 :], []).append(v)
        reference = {k: sum(v) / len(v) for k, v in folded.items()}
    mine, single = program_value[()], reference[()]
    if abs(mine - single) > RTOL * max(1.0, abs(single)):
        return ScalarMismatch(
            "aux_loss", dict(zip(names, [0] * len(names), strict=True)), f"{mine:.12g}", f"{single:.12g}"
        )
    return None


def _devices(mesh: list[tuple[Axis, int]]) -> list[dict[Axis, int]]:
    return [dict(zip((a for a, _ in mesh), c, strict=True)) for c in itertools.product(*(range(d) for _, d in mesh))]


def _show(device: dict[Axis, int]) -> dict[str, int]:
    return {a.value: i for a, i in device.items()}


# --------------------------------------------------------------------------- the loss normaliser


def _loss(
    program: StepProgram, op: ScalarOp, mesh: list[tuple[Axis, int]], rng: np.random.Generator
) -> ScalarMismatch | None:
    pl = program.placement
    m = int(pl.options.micro_batches)
    degrees = dict(mesh)
    axes = [a for a in token_axes(pl) if degrees[a] > 1]
    grid = list(itertools.product(*(range(degrees[a]) for a in axes), range(m)))
    if op.tokens == "equal":
        t = int(rng.integers(1, 50))
        counts = {cell: t for cell in grid}
    else:
        counts = {cell: int(rng.integers(1, 50)) for cell in grid}
    total = sum(counts.values())
    replicas = prod(degrees[a] for a in axes)
    compensation = prod(degrees[a] for a in axes if a in op.over) if op.compensated else 1
    per_mb = 1 if op.micro_batches else m
    free = [i for i, a in enumerate(axes) if a in op.over] + ([len(axes)] if op.micro_batches else [])
    for cell in grid:
        divisor = sum(
            n for other, n in counts.items() if all(other[i] == cell[i] or i in free for i in range(len(cell)))
        )
        weight = Fraction(compensation, per_mb * divisor * replicas)
        if weight != Fraction(1, total):
            where = {a.value: cell[i] for i, a in enumerate(axes)} | {"micro_batch": cell[-1]}
            return ScalarMismatch(
                "loss_normalisation",
                where,
                str(weight),
                f"1/{total}",
                f"token counts {sorted(counts.values())}; divisor {divisor}",
            )
    return None


# --------------------------------------------------------------------------- the norm and the clip


def _layout(pl_program: StepProgram, group: Group, mesh: list[tuple[Axis, int]]) -> dict[Axis, Holding]:
    return {a: holding(pl_program.placement, group, a) for a, _ in mesh}


def _block(
    tensor: np.ndarray, kinds: dict[Axis, Holding], mesh: list[tuple[Axis, int]], group: Group, device: dict[Axis, int]
) -> np.ndarray | None:
    """What ``device`` holds of a group's gradient laid out with one dimension per axis (size d if
    sharded along it, else 1), or None when it holds nothing of it."""
    index: list[int | slice] = []
    for a, d in mesh:
        kind = kinds[a]
        if kind is Holding.SHARD:
            index.append(device[a])
            continue
        if device[a] not in holders(kind, group, d, 0):
            return None
        index.append(0)
    return np.asarray(tensor[tuple(index)])


def _first_holder(kind: Holding, group: Group, d: int, i: int) -> bool:
    """Whether device ``i`` along an axis is the first that holds the block it holds."""
    if kind is Holding.SHARD:
        return True
    return i == min(holders(kind, group, d, 0))


def _norm_and_clip(
    program: StepProgram, ops: list[ScalarOp], mesh: list[tuple[Axis, int]], rng: np.random.Generator
) -> ScalarMismatch | None:
    pl = program.placement
    groups = pl.groups(State.PARAMETERS)
    devices = _devices(mesh)
    tensors: dict[Group, np.ndarray] = {}
    kinds: dict[Group, dict[Axis, Holding]] = {}
    for g in groups:
        kinds[g] = _layout(program, g, mesh)
        shape = (*(d if kinds[g][a] is Holding.SHARD else 1 for a, d in mesh), 3)
        tensors[g] = rng.standard_normal(shape)
    true_sq = sum(float(np.sum(t * t)) for t in tensors.values())
    max_norm = 0.5 * np.sqrt(true_sq)
    true_factor = min(1.0, max_norm / np.sqrt(true_sq))
    norm_at = next((i for i, op in enumerate(ops) if op.kind is ScalarKind.GRAD_NORM), None)
    norm = ops[norm_at] if norm_at is not None else None
    adds: dict[tuple[int, ...], float] = {}
    for dev in devices:
        total = 0.0
        for g in groups:
            if norm is None or not norm.covers(g):
                continue
            block = _block(tensors[g], kinds[g], mesh, g, dev)
            if block is None:
                continue
            if all(_first_holder(kinds[g][a], g, d, dev[a]) for a, d in mesh if a in norm.once):
                total += float(np.sum(block * block))
        adds[tuple(dev[a] for a, _ in mesh)] = total
    for dev in devices:
        key = tuple(dev[a] for a, _ in mesh)
        if norm is None:
            sq = None
        else:
            sq = sum(
                v
                for other, v in adds.items()
                if all(other[i] == key[i] or a in norm.over for i, (a, _) in enumerate(mesh))
            )
            if abs(sq - true_sq) > RTOL * true_sq:
                return ScalarMismatch("grad_norm", _show(dev), f"{sq:.12g}", f"{true_sq:.12g}", "squared global norm")
        for g in groups:
            block = _block(tensors[g], kinds[g], mesh, g, dev)
            if block is None:
                continue
            factor = 1.0
            if sq is not None and norm_at is not None:
                for i, op in enumerate(ops):
                    if op.kind is ScalarKind.CLIP and op.covers(g) and i > norm_at:
                        factor = min(1.0, max_norm / np.sqrt(sq)) if sq > 0 else 1.0
                        break
            if not np.allclose(block * factor, block * true_factor, rtol=RTOL, atol=0.0):
                return ScalarMismatch(
                    "clip",
                    _show(dev),
                    f"factor {factor:.12g}",
                    f"factor {true_factor:.12g}",
                    f"G.{g.name} as the optimizer reads it",
                )
    return None


# --------------------------------------------------------------------------- the overflow decision


def _overflow(
    program: StepProgram, check: ScalarOp | None, mesh: list[tuple[Axis, int]], rng: np.random.Generator
) -> ScalarMismatch | None:
    pl = program.placement
    groups = pl.groups(State.PARAMETERS)
    devices = _devices(mesh)
    for g in groups:
        kinds = _layout(program, g, mesh)
        shape = (*(d if kinds[a] is Holding.SHARD else 1 for a, d in mesh), 3)
        tensor = np.zeros(shape)
        tensor[tuple(int(rng.integers(0, s)) for s in shape)] = np.inf
        seen: dict[tuple[int, ...], bool] = {}
        for dev in devices:
            block = None if check is None or not check.covers(g) else _block(tensor, kinds, mesh, g, dev)
            seen[tuple(dev[a] for a, _ in mesh)] = block is not None and bool(np.isinf(block).any())
        for dev in devices:
            key = tuple(dev[a] for a, _ in mesh)
            over = check.over if check is not None else ()
            skips = any(
                v for other, v in seen.items() if all(other[i] == key[i] or a in over for i, (a, _) in enumerate(mesh))
            )
            if not skips:
                return ScalarMismatch(
                    "overflow", _show(dev), "steps", "skips the step", f"an inf in G.{g.name} it does not see"
                )
    return None


__all__ = ["RTOL", "ScalarMismatch", "simulate_scalars"]
