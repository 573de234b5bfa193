"""The scalars around the gradients (docs/semantics.md, "Global scalars"): sufficiency and
necessity of each condition the verdict checks (``formal/_smt_scalars.py``), written here
independently of the verdict's encoding (element values rather than squared norms of pieces,
per-token losses rather than weights).

Sufficiency (z3, validity queries):

* ``scalars.sufficiency.loss_normalisation[R<r>m<m>]``: with the token count reduced over every
  rank and micro-batch and the loss compensated by R, the synchronised gradient (the mean over
  the R ranks of the micro-batches' sums) of per-token losses is their sum over the global count,
  for every positive count per rank and micro-batch;
* ``scalars.sufficiency.norm[<holding><d>]``: the derived norm (every device adds the squares
  of the elements it holds, on the first holder only, all-reduced over the axis) is the squared
  norm of the whole gradient on every device;
* ``scalars.sufficiency.overflow[<holding><d>]``: the derived overflow flag is the or of every
  element's flag on every device;
* ``scalars.sufficiency.elementwise_after_scalar``: an element-wise update (uninterpreted)
  applied after a global scalar (the clip factor, a skipped step) gives every device the
  single-device result when the gradient and the scalar agree: the theorem is restated for
  element-wise optimizers after a global scalar.

Necessity (z3 finds the data, replayed in exact arithmetic with ``Fraction``): one program per
rule the verdict enforces, each committing exactly that violation, changes what single-device
training computes: ``token_count`` (the mean of two micro-batches' means), ``loss_compensation``
(the global count without undoing the mean over two ranks), ``norm_counts_once`` (a tp replica
added by both ranks), ``norm_covers`` (a stage left out), ``clip_factor`` (a group not clipped),
``overflow_reduced`` (a rank that does not see the other's overflow steps),
``aux_loss_statistics`` (the load-balancing loss of each cp shard's tokens, averaged, against the
micro-batch's), ``logits_placement`` (gathered logits in a vocabulary-parallel kernel).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from fractions import Fraction

import z3

from formal._verdict import Status
from proofs._obligation import Obligation, Outcome, proved_if_unsat
from proofs._solver import Answer, check, prove

HOLDINGS = ("shard", "replica", "one", "tied")
ELEMENTS = 2  # elements per piece: a norm of several elements, not one square


# --------------------------------------------------------------------------- sufficiency


def _loss_sufficiency(ranks: int, micro: int) -> Outcome:
    cells = list(itertools.product(range(ranks), range(micro)))
    n = {c: z3.Int(f"n{c[0]}_{c[1]}") for c in cells}
    losses = {c: z3.Real(f"L{c[0]}_{c[1]}") for c in cells}  # each cell's summed token losses
    total = z3.Sum(*[n[c] for c in cells])
    hyp = {f"tokens[{c}]": n[c] >= 1 for c in cells}
    # each rank's loss: its summed token losses x R / (count over every rank and micro-batch)
    weight = z3.RealVal(ranks) / z3.ToReal(total)
    gradient = z3.Sum(*[weight * losses[c] for c in cells]) / ranks  # the mean over the ranks
    goal = gradient == z3.Sum(*[losses[c] for c in cells]) / z3.ToReal(total)
    return proved_if_unsat(prove(hyp, goal))


def _holders(kind: str, d: int, piece: int) -> tuple[int, ...]:
    match kind:
        case "shard":
            return (piece,)
        case "replica":
            return tuple(range(d))
        case "one":
            return (d - 1,)  # a last-stage group
        case "tied":
            return (0, d - 1)
        case _:
            raise AssertionError(kind)


def _pieces(kind: str, d: int) -> int:
    return d if kind == "shard" else 1


def _norm_sufficiency(kind: str, d: int) -> Outcome:
    x = [[z3.Real(f"x{j}_{e}") for e in range(ELEMENTS)] for j in range(_pieces(kind, d))]
    square = [z3.Sum(*[v * v for v in piece]) for piece in x]
    adds = [
        z3.Sum(z3.RealVal(0), *[square[j] for j in range(len(x)) if i == min(_holders(kind, d, j))]) for i in range(d)
    ]
    reduced = z3.Sum(*adds)  # all-reduced over the axis: every device holds the same total
    whole = z3.Sum(*[v * v for piece in x for v in piece])
    return proved_if_unsat(prove({}, reduced == whole))


def _overflow_sufficiency(kind: str, d: int) -> Outcome:
    flags = [[z3.Bool(f"inf{j}_{e}") for e in range(ELEMENTS)] for j in range(_pieces(kind, d))]
    seen = [
        z3.Or(False, *[f for j in range(len(flags)) if i in _holders(kind, d, j) for f in flags[j]]) for i in range(d)
    ]
    anywhere = z3.Or(*[f for piece in flags for f in piece])
    goal = z3.Or(*seen) == anywhere  # all-reduced: every device holds this or
    return proved_if_unsat(prove({}, goal))


def _elementwise_sufficiency() -> Outcome:
    update = z3.Function("update", z3.RealSort(), z3.RealSort(), z3.RealSort(), z3.RealSort())
    p, o, g, c = z3.Reals("p o g c")
    skip = z3.Bool("skip")
    hyp: dict[str, z3.BoolRef] = {}
    goals = []
    for i in range(3):
        gi, ci, si = z3.Real(f"g{i}"), z3.Real(f"c{i}"), z3.Bool(f"skip{i}")
        hyp[f"integrity[{i}]"] = gi == g
        hyp[f"same_scalar[{i}]"] = ci == c
        hyp[f"same_decision[{i}]"] = si == skip
        goals.append(z3.If(si, p, update(p, o, ci * gi)) == z3.If(skip, p, update(p, o, c * g)))
    return proved_if_unsat(prove(hyp, z3.And(*goals)))


# --------------------------------------------------------------------------- necessity


def _replayed(found: z3.ModelRef | None, replay: Callable[[z3.ModelRef], tuple[bool, str]]) -> Outcome:
    if found is None:
        return Outcome(Status.REFUTED, "z3 found no data on which the violation changes the result")
    differs, detail = replay(found)
    if not differs:
        return Outcome(Status.REFUTED, f"the exact replay does not differ: {detail}")
    return Outcome(Status.PROVED, f"z3 data, replayed exactly: {detail}")


def _frac(model: z3.ModelRef, v: z3.ArithRef) -> Fraction:
    value = model.eval(v, model_completion=True)
    if z3.is_int_value(value):
        return Fraction(value.as_long())
    return Fraction(value.numerator_as_long(), value.denominator_as_long())


def _sat(assertions: dict[str, z3.BoolRef]) -> z3.ModelRef | None:
    found = check(assertions)
    return found.model if found.answer is Answer.SAT else None


def _token_count_necessity() -> Outcome:
    n0, n1 = z3.Ints("n0 n1")
    l0, l1 = z3.Reals("L0 L1")
    mean_of_means = (l0 / z3.ToReal(n0) + l1 / z3.ToReal(n1)) / 2
    model = _sat({"tokens": z3.And(n0 >= 1, n1 >= 1), "differs": mean_of_means != (l0 + l1) / z3.ToReal(n0 + n1)})

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        a, b, x, y = (_frac(m, v) for v in (n0, n1, l0, l1))
        mine, single = (x / a + y / b) / 2, (x + y) / (a + b)
        return mine != single, f"counts {a}, {b}: mean of means {mine}, global mean {single}"

    return _replayed(model, replay)


def _compensation_necessity() -> Outcome:
    n0, n1 = z3.Ints("n0 n1")
    l0, l1 = z3.Reals("L0 L1")
    total = z3.ToReal(n0 + n1)
    uncompensated = (l0 / total + l1 / total) / 2  # the mean over two ranks of loss / N
    model = _sat({"tokens": z3.And(n0 >= 1, n1 >= 1), "differs": uncompensated != (l0 + l1) / total})

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        a, b, x, y = (_frac(m, v) for v in (n0, n1, l0, l1))
        mine, single = (x / (a + b) + y / (a + b)) / 2, (x + y) / (a + b)
        return mine != single, f"gradient {mine} where single-device training has {single}"

    return _replayed(model, replay)


def _clip_replay(held: list[list[z3.ArithRef]], counted: Callable[[list[Fraction]], Fraction]) -> Outcome:
    """A norm that counts the pieces' squares as ``counted`` does, against the true one: z3 finds
    element values on which both exceed max_norm^2 = 1 and differ; the replay computes the squared
    clip factors 1/S exactly (the factor is max_norm / sqrt(S), injective in S)."""
    squares = [z3.Sum(*[v * v for v in piece]) for piece in held]
    true = z3.Sum(*squares)
    model = _sat({"clipped": true > 1, "differs": counted_z3(squares, counted) != true})

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        values = [[_frac(m, v) for v in piece] for piece in held]
        sq = [sum((v * v for v in piece), Fraction(0)) for piece in values]
        mine, single = counted(sq), sum(sq, Fraction(0))
        factor_sq = min(Fraction(1), 1 / mine) if mine else Fraction(1)
        return factor_sq != 1 / single, f"squared norm {mine} where single-device training has {single}"

    return _replayed(model, replay)


def counted_z3(squares: list[z3.ArithRef], counted: Callable[[list[Fraction]], Fraction]) -> z3.ArithRef:
    """``counted`` is linear in the squares with integer weights: read them off unit vectors."""
    weights = []
    for j in range(len(squares)):
        unit = [Fraction(1) if k == j else Fraction(0) for k in range(len(squares))]
        weights.append(counted(unit))
    return z3.Sum(*[z3.RealVal(str(w)) * s for w, s in zip(weights, squares, strict=True)])


def _duplicate_necessity() -> Outcome:
    # a tp-replicated group (one piece, both ranks hold it) added by both ranks, all-reduced over tp
    replica = [[z3.Real(f"x0_{e}") for e in range(ELEMENTS)]]
    return _clip_replay(replica, lambda sq: 2 * sq[0])


def _missing_stage_necessity() -> Outcome:
    # the layers of two stages, the norm not reduced over pp: stage 0 sees its own piece only
    stages = [[z3.Real(f"x{j}_{e}") for e in range(ELEMENTS)] for j in range(2)]
    return _clip_replay(stages, lambda sq: sq[0])


def _clip_factor_necessity() -> Outcome:
    g, norm = z3.Reals("g norm")
    model = _sat({"clipped": norm > 1, "gradient": g != 0})

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        gv, nv = _frac(m, g), _frac(m, norm)
        unclipped, single_sq = gv * gv, gv * gv / (nv * nv)  # (g c)^2 with c = 1 / norm
        return unclipped != single_sq, f"g^2 = {unclipped} unclipped, {single_sq} clipped"

    return _replayed(model, replay)


def _overflow_necessity() -> Outcome:
    p, g, lr = z3.Reals("p g lr")
    model = _sat({"lr": lr > 0, "gradient": g != 0})

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        pv, gv, lv = _frac(m, p), _frac(m, g), _frac(m, lr)
        stepped, skipped = pv - lv * gv, pv  # the rank that misses the overflow steps; the other skips
        return stepped != skipped, f"one rank holds {stepped}, the other {skipped}"

    return _replayed(model, replay)


def _aux_necessity() -> Outcome:
    """Two cp shards of one micro-batch, two experts: each shard's own Switch loss, averaged,
    against the loss of the union of their tokens."""
    n = [z3.Int(f"n{s}") for s in range(2)]
    c = [[z3.Int(f"c{s}_{e}") for e in range(2)] for s in range(2)]
    p = [[z3.Real(f"p{s}_{e}") for e in range(2)] for s in range(2)]
    facts: dict[str, z3.BoolRef] = {}
    for s_ in range(2):
        facts[f"tokens{s_}"] = z3.And(n[s_] >= 1, *[x >= 0 for x in c[s_]], z3.Sum(*c[s_]) == n[s_])
        facts[f"probabilities{s_}"] = z3.And(*[x >= 0 for x in p[s_]], z3.Sum(*p[s_]) == z3.ToReal(n[s_]))

    def balance(counts: list[z3.ArithRef], probs: list[z3.ArithRef], tokens: z3.ArithRef) -> z3.ArithRef:
        t = z3.ToReal(tokens)
        return 2 * z3.Sum(*[(z3.ToReal(counts[e]) / t) * (probs[e] / t) for e in range(2)])

    own = (balance(c[0], p[0], n[0]) + balance(c[1], p[1], n[1])) / 2
    union = balance([c[0][e] + c[1][e] for e in range(2)], [p[0][e] + p[1][e] for e in range(2)], n[0] + n[1])
    facts["differs"] = own != union
    model = _sat(facts)

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        def bal(counts: list[Fraction], probs: list[Fraction]) -> Fraction:
            t = sum(counts, Fraction(0))
            return 2 * sum(((x / t) * (y / t) for x, y in zip(counts, probs, strict=True)), Fraction(0))

        cs = [[_frac(m, x) for x in row] for row in c]
        ps = [[_frac(m, x) for x in row] for row in p]
        mine = (bal(cs[0], ps[0]) + bal(cs[1], ps[1])) / 2
        single = bal([cs[0][e] + cs[1][e] for e in range(2)], [ps[0][e] + ps[1][e] for e in range(2)])
        return mine != single, f"per-shard loss {mine}, the micro-batch's {single}"

    return _replayed(model, replay)


def _logits_necessity() -> Outcome:
    z = z3.Real("Z")  # the whole vocabulary's sum of exp, on each of two tp ranks holding it whole
    model = _sat({"positive": z > 0})

    def replay(m: z3.ModelRef) -> tuple[bool, str]:
        whole = _frac(m, z)
        summed = 2 * whole  # the vocabulary-parallel kernel's all-reduce over tp = 2
        return summed != whole, f"normaliser {summed} where single-device training has {whole} (log 2 apart)"

    return _replayed(model, replay)


# --------------------------------------------------------------------------- the list


def obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for ranks, micro in ((1, 2), (2, 1), (2, 2), (3, 2)):
        out.append(
            Obligation(
                f"scalars.sufficiency.loss_normalisation[R{ranks}m{micro}]",
                "the global token count, compensated for the mean over the ranks, gives the single-device "
                "per-token gradient for every token count",
                "z3",
                functools.partial(_loss_sufficiency, ranks, micro),
            )
        )
    for kind in HOLDINGS:
        for d in (2, 3, 4):
            out.append(
                Obligation(
                    f"scalars.sufficiency.norm[{kind}{d}]",
                    "each piece added once and the total all-reduced: the global squared norm on every device",
                    "z3",
                    functools.partial(_norm_sufficiency, kind, d),
                )
            )
            out.append(
                Obligation(
                    f"scalars.sufficiency.overflow[{kind}{d}]",
                    "the overflow flags or-reduced over the axis: the single-device decision on every device",
                    "z3",
                    functools.partial(_overflow_sufficiency, kind, d),
                )
            )
    out.append(
        Obligation(
            "scalars.sufficiency.elementwise_after_scalar",
            "an element-wise update after a global scalar (clip factor, skip) matches single-device training "
            "when the gradient and the scalar agree on every device",
            "z3",
            _elementwise_sufficiency,
        )
    )
    for name, statement, decide in (
        ("token_count", "the mean of two micro-batches' token means is not the global mean", _token_count_necessity),
        (
            "loss_compensation",
            "the global count without undoing the mean over two ranks halves the gradient",
            _compensation_necessity,
        ),
        ("norm_counts_once", "a tp replica added by both ranks changes the clip factor", _duplicate_necessity),
        ("norm_covers", "a pipeline stage left out of the norm changes the clip factor", _missing_stage_necessity),
        ("clip_factor", "a group not clipped differs from the clipped single-device gradient", _clip_factor_necessity),
        (
            "overflow_reduced",
            "a rank that misses another's overflow steps while single-device training skips",
            _overflow_necessity,
        ),
        (
            "aux_loss_statistics",
            "the load-balancing loss of each cp shard's own tokens, averaged, is not the micro-batch's",
            _aux_necessity,
        ),
        (
            "logits_placement",
            "gathered logits fed to a vocabulary-parallel kernel double its normaliser at tp = 2",
            _logits_necessity,
        ),
    ):
        out.append(Obligation(f"scalars.necessity.{name}", statement, "z3+exact-replay", decide))
    return out


__all__ = ["obligations"]
