"""z3 decides the scalars around the gradients (``formal/_scalars.py``; docs/semantics.md,
"Global scalars").

Four families of obligations, each over tracked constraints with a decoded witness:

* ``loss_normalisation[loss]``: the weight every token's loss carries in the synchronised
  gradient is one over the global batch's token count. Token counts are z3 integers, one per
  cell of a grid whose coordinates are the judged device's position (0) or "the others" along
  every axis that splits the tokens and along the micro-batches; a cell of the others counts
  the tokens of all of its devices and micro-batches (at least one each). The gradient
  synchronisation averages over the data axes (gradient integrity proves that), so a rank's
  loss must be its summed token losses times R / N (R the product of those degrees, N the
  global count): z3 looks for counts on which the program's divisor gives another weight.
  Unless the op says the counts are equal (``tokens = "equal"``, tracked as ``equal_tokens``),
  they are free.
* ``clip_norm[G.group, axis]``: the squared global norm every device computes counts each
  piece of the group's gradient exactly once. Along the axis each device holds a ``Holding``
  of the group (a shard, the whole, or the whole on one or two stages); the squared norms of
  the pieces are non-negative reals; a device adds what it holds (only on the first holder along
  the op's ``once`` axes), and the total is all-reduced if the axis is among the op's ``over``.
  Exact for every degree: up to 8 devices are explicit, the others one aggregate.
* ``clip_factor[G.group]``: the clipped gradient is the single-device one, ``g min(1, c/n)``:
  the group is clipped, after the norm is computed (the norm's agreement on every device is
  ``clip_norm``'s, so the factor is one scalar applied identically).
* ``loss_scale_overflow[G.group, axis]``: the decision to skip the step is the single-device
  one, an overflow anywhere: each piece's overflow flag is a z3 Boolean, a device sees the flags
  of what it holds (of the groups it checks), and the or of them if the axis is reduced over.
  An or counts a replica any number of times, so, unlike the norm, duplicates are harmless.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import z3

from formal._program import StepProgram
from formal._scalar_program import Holding, aux_scope, aux_split_axes, holders, holding, pieces, token_axes
from formal._scalars import GLOBAL, SCALAR_RULES, LossScale, ScalarKind, ScalarOp, is_scalar_rule
from formal._smt_common import _int_degree, _number, _status
from formal._solver import Solver
from formal._verdict import Condition, Obligation, Violation
from formal._vocab import LOGITS, ROUTER, Axis, Group, State
from formal.errors import InputError

GI = Condition.GRADIENT_INTEGRITY

MAX_EXPLICIT = 8  # devices modelled one by one along an axis; the others are one aggregate
MB = "micro-batches"  # the micro-batch loop, as a coordinate of the token grid


def decide_scalars(program: StepProgram, timeout_ms: int) -> tuple[list[Obligation], list[Violation]]:
    """Every scalar obligation of ``program`` (none when it computes no scalar)."""
    pl = program.placement
    settings = pl.options.scalars
    ops = list(program.scalars)
    kinds = [op.kind for op in ops]
    obligations: list[Obligation] = []
    violations: list[Violation] = []

    def add(found: tuple[Obligation, list[Violation]]) -> None:
        obligations.append(found[0])
        violations.extend(found[1])

    normalisers = [op for op in ops if op.kind is ScalarKind.NORMALISE_LOSS]
    if len(normalisers) > 1:
        raise InputError(f"{len(normalisers)} normalise_loss ops: a loss is normalised once")
    if normalisers or settings.per_token:
        # Without a normaliser each micro-batch divides by its own count (the frameworks' default).
        op = normalisers[0] if normalisers else ScalarOp(ScalarKind.NORMALISE_LOSS, note="mean of means")
        add(_loss_normalisation(program, op, timeout_ms))
    groups = pl.groups(State.PARAMETERS)
    # Axes of degree 1 exchange nothing; with none left, one of them still judges which groups
    # the scalar covers (found by the differential: a norm leaving a group out on one device).
    judged = [a for a, d in pl.mesh if d != 1] or [pl.axes[0]]
    norms = [op for op in ops if op.kind is ScalarKind.GRAD_NORM]
    if len(norms) > 1:
        raise InputError(f"{len(norms)} grad_norm ops: clipping computes one global norm")
    clips = [i for i, op in enumerate(ops) if op.kind is ScalarKind.CLIP]
    if norms or clips or settings.clip:
        norm = norms[0] if norms else ScalarOp(ScalarKind.GRAD_NORM, groups=frozenset())
        norm_at = kinds.index(ScalarKind.GRAD_NORM) if norms else len(ops)
        for g in groups:
            for axis in judged:
                add(_norm(program, norm, g, axis, timeout_ms))
            clipped = any(ops[i].covers(g) and i > norm_at for i in clips)
            early = any(ops[i].covers(g) and i < norm_at for i in clips)
            add(_clip(g, clipped, early, bool(norms), timeout_ms))
    checks = [op for op in ops if op.kind is ScalarKind.OVERFLOW_CHECK]
    if len(checks) > 1:
        raise InputError(f"{len(checks)} overflow_check ops: one decision per step")
    if checks or settings.loss_scale is LossScale.DYNAMIC:
        check = checks[0] if checks else ScalarOp(ScalarKind.OVERFLOW_CHECK, groups=frozenset())
        for g in groups:
            for axis in judged:
                add(_overflow(program, check, g, axis, timeout_ms))
    auxes = [op for op in ops if op.kind is ScalarKind.AUX_LOSS]
    if len(auxes) > 1:
        raise InputError(f"{len(auxes)} aux_loss ops: one load-balancing loss per step")
    if auxes or settings.balancing:
        if ROUTER not in groups:
            raise InputError("a load-balancing loss needs a model with experts (a router to balance)")
        aux = auxes[0] if auxes else ScalarOp(ScalarKind.AUX_LOSS)
        whole = settings.balancing == GLOBAL
        scope = set(aux_scope(pl, whole))
        m = _int_degree(pl.options.micro_batches)
        coords: list[tuple[str, int, bool, bool, bool]] = [
            (a.value, _int_degree(pl.degree(a)), a in scope, a in aux.over, a.splits_data) for a in aux_split_axes(pl)
        ]
        if m > 1:
            coords.append((MB, m, whole, aux.micro_batches, True))
        for name, d, in_scope, reduced, averaged in coords:
            add(_aux(name, d, in_scope, reduced, averaged, whole, timeout_ms))
    kernels = [op for op in ops if op.kind is ScalarKind.CROSS_ENTROPY]
    if len(kernels) > 1:
        raise InputError(f"{len(kernels)} cross_entropy ops: one loss kernel")
    for kernel in kernels:
        if (State.ACTIVATIONS, LOGITS) not in set(pl.keys()):
            raise InputError("cross_entropy: the model has no logits activation (a transformer's output layer)")
        for axis in judged:
            add(_cross_entropy(program, kernel, axis, timeout_ms))
    return obligations, violations


def _small_routing(
    differs: z3.BoolRef, n: list[z3.ArithRef], c: list[list[z3.ArithRef]], p: list[list[z3.ArithRef]]
) -> z3.BoolRef | None:
    """The first routing of at most 3 tokens per shard, probabilities one-hot on the chosen
    expert, on which ``differs`` evaluates to true; None if there is none."""
    for sizes in itertools.product(range(1, 4), repeat=len(n)):
        for firsts in itertools.product(*(range(t + 1) for t in sizes)):
            pairs: list[tuple[z3.ArithRef, z3.ArithRef]] = []
            for s_, (t, f) in enumerate(zip(sizes, firsts, strict=True)):
                counts = [f, t - f]
                pairs += [(n[s_], z3.IntVal(t))]
                pairs += [(c[s_][e], z3.IntVal(counts[e])) for e in range(2)]
                pairs += [(p[s_][e], z3.RealVal(counts[e])) for e in range(2)]
            if z3.is_true(z3.simplify(z3.substitute(differs, *pairs))):
                return z3.And(*[a == b for a, b in pairs])
    return None


# --------------------------------------------------------------------------- the loss kernel's logits


def _cross_entropy(
    program: StepProgram, op: ScalarOp, axis: Axis, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    """The softmax normaliser ``Z = sum_j exp(x_j)`` a cross-entropy kernel forms from the logits
    each device holds along ``axis`` (vocabulary shards where ``A.logits`` is sharded along it
    and not gathered, else the whole vocabulary), summed over the axis if the kernel all-reduces
    there (Megatron-LM's ``vocab_parallel_cross_entropy``), against single-device training's
    ``Z`` over the whole vocabulary (the target logit is taken from the shard that owns it). The
    exponentials are positive reals; the loss is ``log Z - x_target``, so Z decides it."""
    pl = program.placement
    d = _int_degree(pl.degree(axis))
    # only an axis that hosts the vocabulary splits it (along data axes A.logits splits the batch)
    vocab_split = axis.kind.hosts_vocabulary and pl.mode(State.ACTIVATIONS, LOGITS, axis).is_sharded
    sharded = vocab_split and axis not in op.gathered
    k = min(d, MAX_EXPLICIT)
    rest = d - k
    pieces_ = (k + (1 if rest else 0)) if sharded else 1
    exps = [z3.Real(f"exp{j}") for j in range(pieces_)]
    solver = Solver(timeout_ms)
    solver.track("positive", z3.And(*[e > 0 for e in exps]))
    devices = range(k + (1 if rest else 0))
    weight = {i: (rest if (i == k and not sharded) else 1) for i in devices}  # the aggregate: rest whole copies

    def local(i: int) -> z3.ArithRef:
        return exps[i] if sharded else weight[i] * exps[0]

    reduced = axis in op.over
    total = z3.Sum(*[local(i) for i in devices])
    mine = {i: (total if reduced else local(i)) for i in devices if i < k}
    reference = z3.Sum(*exps)
    name = f"A.logits, {axis.value}"
    solver.track(f"logits_placement[{name}]", z3.Or(*[v != reference for v in mine.values()]))
    answer = solver.check()
    ob = Obligation(f"cross_entropy[{name}]", GI, _status(answer, violated_when="sat"), answer.reason, answer.seconds)
    if answer.model is None:
        return ob, []
    model = answer.model
    held = {str(i): _number(model.eval(v, model_completion=True)) for i, v in mine.items()}
    single = _number(model.eval(reference, model_completion=True))
    if not sharded and reduced:
        explanation = (
            f"every {axis.value} rank holds the whole vocabulary"
            + (f" (the logits were gathered along {axis.value})" if axis in op.gathered else "")
            + f" and the vocabulary-parallel kernel sums exp over {axis.value}: the softmax normaliser is "
            f"{d} Z, so the loss is off by log({d}) and every softmax probability, the gradient, is 1/{d} of "
            "single-device training's"
        )
    else:
        explanation = (
            f"each {axis.value} rank holds a vocabulary shard and the kernel normalises over its shard only: "
            f"the softmax normaliser is its shard's sum of exp, not the whole vocabulary's"
        )
    witness: dict[str, Any] = {
        "logits": "vocabulary shards" if sharded else "whole vocabulary",
        "normaliser_reduced_over_axis": reduced,
        "degree": d,
        "exponentials": [_number(model.eval(e, model_completion=True)) for e in exps],
        "devices": held,
        "single_device": single,
    }
    rule = f"logits_placement[{name}]"
    return ob, [Violation(rule, GI, "A", LOGITS.name, axis.value, explanation, witness)]


# --------------------------------------------------------------------------- the load-balancing loss

EXPERTS_MODELLED = 2  # two experts suffice for a witness; the loss is a sum over experts
# Two shards decide every case: reduced, each shard holds the union's loss (an identity when the
# scope spans the axis); not reduced, the shards' own losses (an identity when it does not); the
# two other cases differ already on two shards (a counterexample the witness shows). More shards
# only make the nonlinear query slower.
MAX_AUX_SHARDS = 2


def _aux(
    name: str, d: int, in_scope: bool, reduced: bool, averaged: bool, whole: bool, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    """The load-balancing loss along one coordinate (an axis, or the micro-batches) that splits
    the routed tokens into ``d`` shards (two modelled: see ``MAX_AUX_SHARDS``). Switch/GShard's
    loss over a set of tokens is ``E sum_e f_e P_e`` (f_e the fraction routed to expert e, P_e
    their mean router probability of e). Reduced, every shard forms it from the union's
    statistics; not, from its own, and the shards' losses combine as the gradient does: the mean
    along data axes and micro-batches, the sum along tp. Single-device training forms it over
    the union when the coordinate lies within the statistics' scope, else per shard, averaged."""
    k = min(d, MAX_AUX_SHARDS)
    e_ = EXPERTS_MODELLED
    solver = Solver(timeout_ms)
    n = [z3.Int(f"n{s}") for s in range(k)]
    c = [[z3.Int(f"c{s}_{e}") for e in range(e_)] for s in range(k)]
    p = [[z3.Real(f"p{s}_{e}") for e in range(e_)] for s in range(k)]
    for s_ in range(k):
        solver.track(f"tokens[{s_}]", z3.And(n[s_] >= 1, *[x >= 0 for x in c[s_]], z3.Sum(*c[s_]) == n[s_]))
        solver.track(f"probabilities[{s_}]", z3.And(*[x >= 0 for x in p[s_]], z3.Sum(*p[s_]) == z3.ToReal(n[s_])))

    def balance(counts: list[z3.ArithRef], probs: list[z3.ArithRef], tokens: z3.ArithRef) -> z3.ArithRef:
        t = z3.ToReal(tokens)
        return e_ * z3.Sum(*[(z3.ToReal(counts[e]) / t) * (probs[e] / t) for e in range(e_)])

    own = [balance(c[s_], p[s_], n[s_]) for s_ in range(k)]
    union = balance(
        [z3.Sum(*[c[s_][e] for s_ in range(k)]) for e in range(e_)],
        [z3.Sum(*[p[s_][e] for s_ in range(k)]) for e in range(e_)],
        z3.Sum(*n),
    )
    combined = z3.Sum(*own) / k if averaged else z3.Sum(*own)
    program = union if reduced else combined
    reference = union if in_scope else z3.Sum(*own) / k
    label = f"aux, {name}"
    differs = program != reference
    solver.track(f"aux_loss[{label}]", differs)
    # A counterexample among small one-hot routings, if there is one, is found by evaluation and
    # confirmed by z3 (a real model); otherwise z3 decides over all counts and probabilities,
    # so a proof is only ever the unrestricted query (nonlinear search is slow, evaluation not).
    candidate = _small_routing(differs, n, c, p)
    if candidate is not None:
        solver.track("small_one_hot_routing", candidate)
    answer = solver.check()
    ob = Obligation(f"aux_loss[{label}]", GI, _status(answer, violated_when="sat"), answer.reason, answer.seconds)
    if answer.model is None:
        return ob, []
    model = answer.model

    def val(x: z3.ArithRef) -> int | str:
        return _number(model.eval(x, model_completion=True))

    shard = "micro-batch" if name == MB else f"{name} rank"
    routed = "; ".join(
        f"{shard} {s_} routes {', '.join(f'{val(c[s_][e])} to expert {e}' for e in range(e_))}" for s_ in range(k)
    )
    scope = "the global batch" if whole else "each replica's micro-batch"
    if in_scope:
        rule = f"aux_loss_statistics[{label}]"
        why = (
            f"the routing statistics are not reduced along {name}: each {shard} balances its own tokens "
            f"({', '.join(str(val(a)) for a in own)}), " + ("averaged" if averaged else "summed")
        )
    else:
        rule = f"aux_loss_scope[{label}]"
        why = (
            f"the routing statistics are reduced along {name}, so the loss balances more tokens than "
            f"{scope}: another loss than single-device training's"
        )
    explanation = f"{routed}: {why}; the loss is {val(program)} where single-device training has {val(reference)}"
    witness: dict[str, Any] = {
        "scope": scope,
        "tokens": {f"{shard} {s_}": val(n[s_]) for s_ in range(k)},
        "routed": {f"{shard} {s_}": [val(x) for x in c[s_]] for s_ in range(k)},
        "probabilities": {f"{shard} {s_}": [val(x) for x in p[s_]] for s_ in range(k)},
        "loss": val(program),
        "single_device": val(reference),
        "reduced": reduced,
        "modelled_shards": k,
        "degree": d,
    }
    return ob, [Violation(rule, GI, "aux", ROUTER.name, None if name == MB else name, explanation, witness)]


# --------------------------------------------------------------------------- the loss normaliser


@dataclass(frozen=True)
class _Cell:
    """A cell of the token grid: along each coordinate, position 0 (the judged device) or the others."""

    where: tuple[tuple[str, bool], ...]  # coordinate name, True for "the others"

    def label(self) -> str:
        return ", ".join(f"{name} {'others' if rest else '0'}" for name, rest in self.where) or "all"


def _loss_normalisation(program: StepProgram, op: ScalarOp, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    pl = program.placement
    m = _int_degree(pl.options.micro_batches)
    coords: list[tuple[str, int]] = [(a.value, _int_degree(pl.degree(a))) for a in token_axes(pl)]
    coords = [(name, d) for name, d in coords if d > 1]
    if m > 1:
        coords.append((MB, m))
    over = {a.value for a in op.over}
    if op.micro_batches:
        over.add(MB)
    replicas = 1
    for name, d in coords:
        if name != MB:
            replicas *= d
    compensation = 1
    if op.compensated:
        for name, d in coords:
            if name != MB and name in over:
                compensation *= d
    per_mb = 1 if op.micro_batches or m == 1 else m
    solver = Solver(timeout_ms)
    cells = [_Cell(tuple(zip((n for n, _ in coords), bits, strict=True))) for bits in _bits(len(coords))]
    sizes = {c: _size(c, dict(coords)) for c in cells}
    counts = {c: z3.Int(f"n[{c.label()}]") for c in cells}
    solver.track("tokens_per_device", z3.And(*[counts[c] >= sizes[c] for c in cells]))
    if op.tokens == "equal":
        t = z3.Int("t")
        solver.track("equal_tokens", z3.And(t >= 1, *[counts[c] == t * sizes[c] for c in cells]))
    total = z3.Sum(*[counts[c] for c in cells]) if len(cells) > 1 else counts[cells[0]]
    # The judged device's divisor: its cell summed over the coordinates the count is reduced over.
    mine = [c for c in cells if all(not rest or name in over for name, rest in c.where)]
    divisor = z3.Sum(*[counts[c] for c in mine]) if len(mine) > 1 else counts[mine[0]]
    # weight = compensation / (per_mb * divisor) / replicas must be 1 / total
    solver.track(
        "loss_normalisation[loss]",
        compensation * total != replicas * per_mb * divisor,
    )
    answer = solver.check()
    status = _status(answer, violated_when="sat")
    axes = ", ".join(n for n, _ in coords) or "one device"
    ob = Obligation(f"loss_normalisation[loss, {axes}]", GI, status, answer.reason, answer.seconds, answer.core)
    if answer.model is None:
        return ob, []
    model = answer.model
    values = {c: int(model.eval(counts[c], model_completion=True).as_long()) for c in cells}
    n_total = sum(values.values())
    d_mine = sum(values[c] for c in mine)
    weight = Fraction(compensation, replicas * per_mb * d_mine)
    missing = [name for name, _ in coords if name not in over]
    if compensation != replicas and not missing:
        rule = "loss_compensation[loss]"
        reduced = [n for n, _ in coords if n != MB]
        explanation = (
            f"the loss is divided by the global count ({n_total} tokens) and the gradients averaged over "
            f"{' x '.join(reduced)} ({replicas}), not compensated: a token weighs {weight}, not 1/{n_total}"
        )
    else:
        name = MB if MB in missing else missing[0]  # accumulation first: the most reported case
        rule = f"token_count[loss, {name}]"
        own = values[cells[0]]
        other = sum(v for c, v in values.items() if dict(c.where)[name] and all(not r for n, r in c.where if n != name))
        what = "micro-batch" if name == MB else f"{name} rank"
        others = "the other micro-batches" if name == MB else f"the other {name} ranks"
        plural = "has"
        if dict(coords)[name] > 2:
            plural = "have together"
            others = f"the other {dict(coords)[name] - 1} " + ("micro-batches" if name == MB else f"{name} ranks")
        else:
            others = "micro-batch 1" if name == MB else f"{name} rank 1"
        explanation = (
            f"{what} 0 has {own} tokens, {others} {plural} {other}: the count is not reduced along {name}, so "
            f"{'the mean of means' if not over else 'a partial count'} is not the global mean "
            f"(a token of {what} 0 weighs {weight}, single-device training gives 1/{n_total})"
        )
    witness: dict[str, Any] = {
        "tokens": {c.label(): values[c] for c in cells},
        "global_tokens": n_total,
        "divisor": d_mine,
        "weight": str(weight),
        "single_device_weight": f"1/{n_total}",
        "count_reduced_over": sorted(over),
        "compensated": op.compensated,
    }
    axis = None if not missing or rule == "loss_compensation[loss]" or name == MB else name
    return ob, [Violation(rule, GI, "loss", None, axis, explanation, witness)]


def _bits(n: int) -> list[tuple[bool, ...]]:
    return [tuple(bool((i >> j) & 1) for j in range(n)) for i in range(2**n)]


def _size(cell: _Cell, degrees: dict[str, int]) -> int:
    out = 1
    for name, rest in cell.where:
        out *= degrees[name] - 1 if rest else 1
    return out


# --------------------------------------------------------------------------- the norm and the overflow flag


@dataclass(frozen=True)
class _Pieces:
    """One axis's pieces of a group's gradient and which explicit devices hold each.

    ``k`` devices are explicit; with ``rest`` > 0 the others are one aggregate device ``k``
    (holding, for a shard, one aggregate piece; for a replica, the whole on each of them)."""

    kind: Holding
    k: int
    rest: int
    held: tuple[tuple[int, ...], ...]  # per piece, the (explicit or aggregate) devices holding it

    @property
    def devices(self) -> range:
        return range(self.k + (1 if self.rest else 0))


def _pieces(kind: Holding, group: Group, degree: int) -> _Pieces:
    k = min(degree, MAX_EXPLICIT)
    rest = degree - k
    held: tuple[tuple[int, ...], ...]
    if kind is Holding.SHARD:
        held = tuple((i,) for i in range(k)) + (((k,),) if rest else ())
    elif kind is Holding.REPLICA:
        held = (tuple(range(k + (1 if rest else 0))),)
    else:
        # One or two stages: their holders made explicit (the last stage as device k - 1).
        hs = holders(kind, group, degree, 0)
        held = (tuple(sorted({h if h < k - 1 else k - 1 for h in hs})),)
        rest = 0
    assert pieces(kind, degree) == len(held) or rest
    return _Pieces(kind, k, rest, held)


def _device_name(p: _Pieces, i: int) -> str:
    return "others" if i == p.k else str(i)


def _norm(
    program: StepProgram, op: ScalarOp, group: Group, axis: Axis, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    pl = program.placement
    d = _int_degree(pl.degree(axis))
    kind = holding(pl, group, axis)
    p = _pieces(kind, group, d)
    name = f"G.{group.name}, {axis.value}"
    reduced, once, covered = axis in op.over, axis in op.once, op.covers(group)
    solver = Solver(timeout_ms)
    x = [z3.Real(f"sq{j}") for j in range(len(p.held))]
    solver.track(f"squares[{name}]", z3.And(*[v >= 0 for v in x]))
    weight_of_rest = p.rest if kind is Holding.REPLICA else 1  # the aggregate: d - k replicas, or one piece

    def adds(i: int, j: int) -> int:
        """How many times device ``i`` (or the aggregate) adds piece ``j``."""
        if not covered or i not in p.held[j] or (once and i != min(p.held[j])):
            return 0
        return weight_of_rest if i == p.k else 1

    added = {i: z3.Sum(*[adds(i, j) * x[j] for j in range(len(x))]) for i in p.devices}
    total = z3.Sum(*added.values())
    norms = {i: total if reduced else added[i] for i in p.devices if i < p.k}
    reference = z3.Sum(*x)
    solver.track(f"norm_reduction[{name}]", z3.Or(*[v != reference for v in norms.values()]))
    answer = solver.check()
    status = _status(answer, violated_when="sat")
    ob = Obligation(f"clip_norm[{name}]", GI, status, answer.reason, answer.seconds, answer.core)
    if answer.model is None:
        return ob, []
    model = answer.model
    values = [model.eval(v, model_completion=True) for v in x]
    counts = {j: sum(adds(i, j) if reduced else 0 for i in p.devices) for j in range(len(x))}
    adders = {j: [_device_name(p, i) for i in p.devices if adds(i, j)] for j in range(len(x))}
    held = {str(i): _number(model.eval(v, model_completion=True)) for i, v in norms.items()}
    single = _number(model.eval(reference, model_completion=True))
    label = _piece_label(kind, group, axis)
    twice = [j for j in counts if counts[j] > 1 and z3.is_true(model.eval(x[j] > 0, model_completion=True))]
    if reduced and twice:
        j = twice[0]
        rule = f"norm_counts_once[{name}]"
        times = "twice" if counts[j] == 2 else f"{counts[j]} times"
        who = adders[j]
        shown = " and ".join(who[:2]) if len(who) <= 2 else f"{', '.join(who[:3])} ..."
        explanation = (
            f"the norm counts G.{group.name}{label(j)} {times} along {axis.value}: devices {shown} all add it "
            f"and the norm is all-reduced over {axis.value}"
        ).replace("all add", "both add" if len(who) == 2 else "all add")
    else:
        rule = f"norm_covers[{name}]"
        if not covered:
            explanation = f"the norm leaves out G.{group.name}: no device adds its squared norm"
        else:
            bad = next(i for i in norms if held[str(i)] != single)
            j = next(j for j in range(len(x)) if not adds(bad, j) and z3.is_true(model.eval(x[j] > 0)))
            owner = ", ".join(adders[j]) or "no device"
            explanation = f"device {bad}'s norm lacks G.{group.name}{label(j)} (added by {owner}): " + (
                f"the norm is not all-reduced over {axis.value}"
                if not reduced
                else f"only its first holder along {axis.value} adds it"
            )
    witness: dict[str, Any] = {
        "holding": kind.value,
        "degree": d,
        "squared_norms": {f"piece {j}": _number(v) for j, v in enumerate(values)},
        "added_by": {f"piece {j}": adders[j] for j in adders},
        "reduced_over_axis": reduced,
        "devices": held,
        "single_device": single,
    }
    return ob, [Violation(rule, GI, State.GRADIENTS.value, group.name, axis.value, explanation, witness)]


def _piece_label(kind: Holding, group: Group, axis: Axis) -> Any:
    def label(j: int) -> str:
        if kind is not Holding.SHARD:
            return ""
        return f"'s layers on stage {j}" if axis.kind.is_pipeline else f"'s shard {j}"

    return label


def _clip(
    group: Group, clipped: bool, early: bool, has_norm: bool, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    name = f"G.{group.name}"
    solver = Solver(timeout_ms)
    g, n, c = z3.Reals("g norm max_norm")
    solver.track("positive", z3.And(n > 0, c > 0))
    factor = z3.If(c < n, c / n, z3.RealVal(1))
    applied = clipped and has_norm
    device = g * factor if applied else g
    solver.track(f"clip_factor[{name}]", device != g * factor)
    answer = solver.check()
    ob = Obligation(f"clip_factor[{name}]", GI, _status(answer, violated_when="sat"), answer.reason, answer.seconds)
    if answer.model is None:
        return ob, []
    model = answer.model
    if not has_norm:
        why = "no global norm is computed, so nothing is clipped"
    elif early:
        why = "it is clipped before the global norm is computed (by a stale or partial norm)"
    else:
        why = "no clip covers it"
    witness = {
        "gradient": _number(model.eval(g, model_completion=True)),
        "norm": _number(model.eval(n, model_completion=True)),
        "max_norm": _number(model.eval(c, model_completion=True)),
        "devices": _number(model.eval(device, model_completion=True)),
        "single_device": _number(model.eval(g * factor, model_completion=True)),
    }
    explanation = f"G.{group.name} is not scaled by the clip factor: {why}"
    return ob, [Violation(f"clip_factor[{name}]", GI, "G", group.name, None, explanation, witness)]


def _overflow(
    program: StepProgram, op: ScalarOp, group: Group, axis: Axis, timeout_ms: int
) -> tuple[Obligation, list[Violation]]:
    pl = program.placement
    d = _int_degree(pl.degree(axis))
    kind = holding(pl, group, axis)
    p = _pieces(kind, group, d)
    name = f"G.{group.name}, {axis.value}"
    reduced, covered = axis in op.over, op.covers(group)
    solver = Solver(timeout_ms)
    flags = [z3.Bool(f"inf{j}") for j in range(len(p.held))]
    seen = {i: z3.Or(False, *[flags[j] for j in range(len(flags)) if covered and i in p.held[j]]) for i in p.devices}
    anywhere = z3.Or(*seen.values())
    decisions = {i: anywhere if reduced else seen[i] for i in p.devices if i < p.k}
    reference = z3.Or(*flags)
    solver.track(f"overflow_reduction[{name}]", z3.Or(*[v != reference for v in decisions.values()]))
    answer = solver.check()
    status = _status(answer, violated_when="sat")
    ob = Obligation(f"loss_scale_overflow[{name}]", GI, status, answer.reason, answer.seconds, answer.core)
    if answer.model is None:
        return ob, []
    model = answer.model
    skips = {str(i): z3.is_true(model.eval(v, model_completion=True)) for i, v in decisions.items()}
    where = [j for j in range(len(flags)) if z3.is_true(model.eval(flags[j], model_completion=True))]
    j = where[0]
    label = _piece_label(kind, group, axis)(j)
    if not covered:
        rule = f"overflow_covers[{name}]"
        explanation = (
            f"no device checks G.{group.name} for overflow: an inf in it{label} is stepped on, where "
            "single-device training skips the step and lowers the scale"
        )
    else:
        rule = f"overflow_reduced[{name}]"
        holder = _device_name(p, p.held[j][0])
        blind = next(i for i, s in skips.items() if not s)
        explanation = (
            f"device {holder} holds an overflow in G.{group.name}{label} along {axis.value} and skips the step; "
            f"device {blind} does not see it and steps: the flag is not reduced over {axis.value}"
        )
    witness: dict[str, Any] = {
        "holding": kind.value,
        "degree": d,
        "overflow_in": [f"piece {j}" for j in where],
        "skips": skips,
        "single_device_skips": True,
        "reduced_over_axis": reduced,
    }
    return ob, [Violation(rule, GI, State.GRADIENTS.value, group.name, axis.value, explanation, witness)]


__all__ = ["MAX_EXPLICIT", "SCALAR_RULES", "decide_scalars", "is_scalar_rule"]
