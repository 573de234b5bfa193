"""Obligations for the verdict's program semantics (proofs/programs.md).

Every gradient, parameter and optimizer op enters the verdict (docs/semantics.md, "Gradient
integrity", "Gradient buffers", "State consistency", "Composition rules"). Each semantic gets a
sufficiency obligation (z3 proves it over symbolic contributions, scales and, where the
statement allows, symbolic degrees) and a necessity obligation (z3 finds a witness, which an
independent exact replay in ``Fraction`` arithmetic confirms). Where the shipped encoder exposes
the criterion as a function (``formal/_smt_integrity.py``'s ``_decide_integrity`` on one case,
``formal/_smt.py``'s ``_normalised`` on a group's cases), a ``shipped`` obligation runs it on the
same program, so a bug in the shipped encoder shows as a failed obligation here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from fractions import Fraction

import sympy as sp
import z3

from formal._axes import Origin
from formal._program import Op
from formal._smt import _memo, _normalised
from formal._smt_common import PLACEHOLDER
from formal._smt_integrity import _decide_integrity, _IntegrityCase
from formal._verdict import Obligation as EncoderObligation
from formal._verdict import Status
from formal._verdict import Violation as EncoderViolation
from formal._vocab import MLP, Axis, Buffer, OpKind, Phase, Reduce, State
from proofs._obligation import Obligation, Outcome, combine, proved_if_unsat
from proofs._solver import Answer, check, prove

G = State.GRADIENTS
TIMEOUT_MS = 60_000
NONLINEAR = "QF_NRA"  # products of unknown scales: decided by z3's nlsat (proofs/_solver.py)
GRIDS = ((2, 2), (2, 3), (3, 2), (4, 2))  # (dp, cp) grids with every contribution explicit
BUFFER_SHAPES = tuple((m, d) for m in (1, 2, 3, 4) for d in (2, 3, 4))  # (micro-batches, devices)


def _fraction(value: z3.ExprRef) -> Fraction:
    assert z3.is_rational_value(value), value
    return Fraction(value.numerator_as_long(), value.denominator_as_long())


def _witnessed(found: Answer, replay: Callable[[], str | None], what: str) -> Outcome:
    """A necessity outcome: z3 found a witness (sat) and the exact replay confirms it."""
    if found is Answer.UNKNOWN:
        return Outcome(Status.UNKNOWN, reason_unknown="z3 returned unknown")
    if found is Answer.UNSAT:
        return Outcome(Status.REFUTED, f"{what}: z3 found no witness")
    confirmed = replay()
    if confirmed is None:
        return Outcome(Status.REFUTED, f"{what}: z3's witness did not reproduce in the exact replay")
    return Outcome(Status.PROVED, f"{what}: {confirmed}")


# ---- 1. normalisation as a product across axes and micro-batches ----------------------------


def _grid_result(dp: int, cp: int, scales: Sequence[z3.ArithRef]) -> tuple[z3.ArithRef, z3.ArithRef, list[z3.ArithRef]]:
    """SUM all-reduce over dp, then over cp, the first scale applied to each fresh contribution
    before the reductions and the rest after: what every device holds, the mean, the inputs."""
    g = [[z3.Real(f"g_{i}_{j}") for j in range(cp)] for i in range(dp)]
    first = scales[0]
    over_dp = [z3.Sum(*[first * g[i][j] for i in range(dp)]) for j in range(cp)]
    held = z3.Sum(*over_dp)
    for s in scales[1:]:
        held = held * s
    mean = z3.Sum(*[g[i][j] for i in range(dp) for j in range(cp)]) / (dp * cp)
    return held, mean, [x for row in g for x in row]


def product_sufficient() -> Outcome:
    outcomes = []
    for dp, cp in GRIDS:
        scales = [z3.Real(f"s{n}") for n in range(3)]
        held, mean, _ = _grid_result(dp, cp, scales)
        product = scales[0] * scales[1] * scales[2]
        hyps = {"product_is_normaliser": product == z3.RealVal(Fraction(1, dp * cp))}
        outcomes.append(proved_if_unsat(prove(hyps, held == mean, TIMEOUT_MS, NONLINEAR)))
    # Symbolic degrees: N = dp*cp contributions whose sum is S, scales s1, s2 anywhere. N is taken
    # as any real >= 1: the claim for every such N covers every product of degrees, and keeps the
    # query in real arithmetic, which nlsat decides (products of integer unknowns are undecidable
    # in general: one such query once ran past its minute in CI).
    s1, s2, total, n = z3.Reals("s1 s2 S N")
    hyps = {"degrees": n >= 1, "product_is_normaliser": s1 * s2 * n == 1}
    outcomes.append(proved_if_unsat(prove(hyps, s1 * (s2 * total) == total / n, TIMEOUT_MS, NONLINEAR)))
    return combine(outcomes, f"dp x cp grids {list(GRIDS)} explicit, and symbolic degrees")


def product_necessary() -> Outcome:
    # For EVERY product of scales other than 1/N, the one-hot contribution (g_00 = 1) is a witness.
    outcomes = []
    for dp, cp in GRIDS:
        scales = [z3.Real(f"s{n}") for n in range(3)]
        held, mean, g = _grid_result(dp, cp, scales)
        product = scales[0] * scales[1] * scales[2]
        hyps: dict[str, z3.BoolRef] = {"product_is_not_normaliser": product != z3.RealVal(Fraction(1, dp * cp))}
        hyps["one_hot_contribution"] = z3.And(g[0] == 1, *[x == 0 for x in g[1:]])
        outcomes.append(proved_if_unsat(prove(hyps, held != mean, TIMEOUT_MS, NONLINEAR)))
    return combine(outcomes, f"the one-hot witness differs for every other product, grids {list(GRIDS)}")


def _op(kind: OpKind, phase: Phase, axis: Axis | None = Axis.DP, **kw: object) -> Op:
    return Op(kind, G, PLACEHOLDER, axis, phase, sp.Integer(1), **kw)  # type: ignore[arg-type]


def _case(
    axis: Axis, degree: int, ops: Sequence[Op], micro_batches: int = 0, buffers: Sequence[Buffer] = ()
) -> _IntegrityCase:
    bufs = tuple(buffers) if buffers else (Buffer.ACCUMULATED,) * len(ops)
    return _IntegrityCase(axis, degree, Origin.PARTIAL, False, tuple(ops), micro_batches=micro_batches, buffers=bufs)


def _decided(cases: Sequence[_IntegrityCase]) -> list[tuple[EncoderObligation, list[EncoderViolation]]]:
    answers = [_memo(c, MLP, TIMEOUT_MS) for c in cases]
    return _normalised(list(cases), answers, MLP, TIMEOUT_MS)


def product_shipped() -> Outcome:
    """Megatron-Core's DDP without ``average_in_collective``: SUM over dp and over cp, then one
    1/(dp*cp) scale (on the home axis, dp) is proved; a 1/dp scale alone is refuted as
    normalisation, on the axis that lacks its factor."""
    notes = []
    for dp, cp in ((2, 2), (2, 3)):
        total = sp.Rational(1, dp * cp)
        summed = [_op(OpKind.ALL_REDUCE, Phase.GRAD_SYNC, reduce=Reduce.SUM)]
        valid = [
            _case(Axis.DP, dp, [*summed, _op(OpKind.SCALE, Phase.OPTIMIZER, None, scale=total)]),
            _case(Axis.CP, cp, [_op(OpKind.ALL_REDUCE, Phase.GRAD_SYNC, Axis.CP, reduce=Reduce.SUM)]),
        ]
        if any(ob.status is not Status.PROVED for ob, _ in _decided(valid)):
            return Outcome(Status.REFUTED, f"dp={dp}, cp={cp}: SUM, SUM, x{total} not proved by the shipped encoder")
        short = [
            _case(Axis.DP, dp, [*summed, _op(OpKind.SCALE, Phase.OPTIMIZER, None, scale=sp.Rational(1, dp))]),
            valid[1],
        ]
        answers = _decided(short)
        rules = [v.rule for _, found in answers for v in found]
        if answers[1][0].status is not Status.REFUTED or not any(r.startswith("normalisation[") for r in rules):
            return Outcome(Status.REFUTED, f"dp={dp}, cp={cp}: SUM, SUM, x1/{dp} not refuted as normalisation: {rules}")
        notes.append(f"{dp}x{cp}")
    return Outcome(Status.PROVED, f"shipped _normalised on dp x cp {notes}: 1/(dp*cp) proved, 1/dp refuted")


# ---- 2. gradient buffers --------------------------------------------------------------------


def _buffers(
    m: int, d: int, reduce_fresh: bool, forward_scale: z3.ArithRef | Fraction | None = None
) -> tuple[list[z3.ArithRef], z3.ArithRef, list[list[z3.ArithRef]]]:
    """m micro-batches on d data-parallel devices: a SUM all-reduce of the fresh gradient (or of
    ``.grad`` after accumulation) each micro-batch, then one 1/d scale; ``forward_scale`` a
    forward-phase scale of ``.grad`` in each micro-batch. Returns .grad per device, the
    single-device value (the sum over micro-batches of each micro-batch's mean), the inputs."""
    c = [[z3.Real(f"c_{j}_{i}") for i in range(d)] for j in range(m)]
    acc: list[z3.ArithRef] = [z3.RealVal(0)] * d
    for j in range(m):
        if forward_scale is not None:
            acc = [a * forward_scale for a in acc]
        fresh = list(c[j])
        if reduce_fresh:
            fresh = [z3.Sum(*fresh)] * d
        acc = [acc[i] + fresh[i] for i in range(d)]
        if not reduce_fresh:
            acc = [z3.Sum(*acc)] * d
    held = [a / d for a in acc]
    single = z3.Sum(*[z3.Sum(*row) / d for row in c])
    return held, single, c


def buffer_sufficient() -> Outcome:
    outcomes = []
    for m, d in BUFFER_SHAPES:
        held, single, _ = _buffers(m, d, reduce_fresh=True)
        outcomes.append(proved_if_unsat(prove({}, z3.And(*[h == single for h in held]), TIMEOUT_MS)))
        if m == 1:  # one micro-batch: the fresh gradient IS .grad, either buffer is right
            held, single, _ = _buffers(m, d, reduce_fresh=False)
            outcomes.append(proved_if_unsat(prove({}, z3.And(*[h == single for h in held]), TIMEOUT_MS)))
    return combine(outcomes, f"(m, d) in {list(BUFFER_SHAPES)}; at m = 1 both buffers")


def _replay_accumulated(m: int, d: int, c: list[list[Fraction]]) -> tuple[Fraction, Fraction]:
    acc = [Fraction(0)] * d
    for j in range(m):
        acc = [acc[i] + c[j][i] for i in range(d)]
        acc = [sum(acc, Fraction(0))] * d
    return acc[0] / d, sum((sum(row, Fraction(0)) / d for row in c), Fraction(0))


def buffer_necessary() -> Outcome:
    m, d = 2, 2
    held, single, c = _buffers(m, d, reduce_fresh=False)
    found = check({"accumulated_all_reduce_differs": held[0] != single}, TIMEOUT_MS)
    # and for every m >= 2, d >= 2 in range, the witness "micro-batch 0 on device 0 is 1" differs
    universal = []
    for mm, dd in BUFFER_SHAPES:
        if mm < 2:
            continue
        h, s, cc = _buffers(mm, dd, reduce_fresh=False)
        one_hot = z3.And(cc[0][0] == 1, *[x == 0 for row in cc for x in row if x is not cc[0][0]])
        universal.append(proved_if_unsat(prove({"one_hot": one_hot}, h[0] != s, TIMEOUT_MS)))

    def replay() -> str | None:
        assert found.model is not None
        values = [[_fraction(found.model.eval(x, model_completion=True)) for x in row] for row in c]
        got, want = _replay_accumulated(m, d, values)
        return None if got == want else f"m=2, d=2, contributions {values}: .grad/d = {got}, single-device {want}"

    first = _witnessed(found.answer, replay, "SUM all-reduce of .grad each micro-batch")
    return combine([first, *universal], first.detail + "; one-hot witness for every m in 2..4, d in 2..4")


def forward_on_grad() -> Outcome:
    """A forward-phase op on ``.grad`` in micro-batch j acts on micro-batches 0..j-1's sum:
    with a forward scale s, micro-batch j's gradient ends scaled by s**(m-1-j); at m = 1 the
    op acts on the empty buffer and changes nothing."""
    outcomes = []
    for m in (1, 2, 3, 4):
        s = z3.Real("s")
        held, _, c = _buffers(m, 2, reduce_fresh=True, forward_scale=s)
        weighted = z3.Sum(*[z3.Sum(*c[j]) * (s ** (m - 1 - j) if m - 1 - j else 1) for j in range(m)]) / 2
        outcomes.append(proved_if_unsat(prove({}, held[0] == weighted, TIMEOUT_MS)))
        if m == 1:
            plain, single, _ = _buffers(m, 2, reduce_fresh=True)
            outcomes.append(proved_if_unsat(prove({}, held[0] == plain[0], TIMEOUT_MS)))
    # and at m = 2 a forward x1/2 on .grad is a witness against the single-device value
    held, single, c = _buffers(2, 2, reduce_fresh=True, forward_scale=Fraction(1, 2))
    found = check({"forward_scale_changes_grad": held[0] != single}, TIMEOUT_MS)

    def replay() -> str | None:
        assert found.model is not None
        v = [[_fraction(found.model.eval(x, model_completion=True)) for x in row] for row in c]
        got = (sum(v[0], Fraction(0)) / 2 + sum(v[1], Fraction(0))) / 2
        want = sum(v[0], Fraction(0)) / 2 + sum(v[1], Fraction(0)) / 2
        return None if got == want else f"m=2: contributions {v}: .grad/d = {got}, single-device {want}"

    return combine(
        [*outcomes, _witnessed(found.answer, replay, "forward x1/2 on .grad")], "weights s**(m-1-j), m in 1..4"
    )


def buffer_shipped() -> Outcome:
    """The shipped encoder at m = 2, d = 2: the per-micro-batch SUM all-reduce of the fresh
    gradient then x1/2 is proved, the same all-reduce on ``.grad`` is refuted as
    ``gradient_buffer``, and a forward x1/2 on ``.grad`` is refuted."""
    m = 2
    per_mb = _op(OpKind.ALL_REDUCE, Phase.GRAD_SYNC, reduce=Reduce.SUM, count=sp.Integer(m))
    acc_mb = _op(OpKind.ALL_REDUCE, Phase.GRAD_SYNC, reduce=Reduce.SUM, count=sp.Integer(m), buffer=Buffer.ACCUMULATED)
    half = _op(OpKind.SCALE, Phase.OPTIMIZER, scale=sp.Rational(1, 2))
    fwd = _op(OpKind.SCALE, Phase.FORWARD, scale=sp.Rational(1, 2))
    fresh = _decide_integrity(_case(Axis.DP, 2, [per_mb, half], m, [Buffer.FRESH, Buffer.ACCUMULATED]), TIMEOUT_MS)
    accumulated = _decide_integrity(_case(Axis.DP, 2, [acc_mb, half], m), TIMEOUT_MS)
    forward = _decide_integrity(
        _case(Axis.DP, 2, [fwd, per_mb, half], m, [Buffer.ACCUMULATED, Buffer.FRESH, Buffer.ACCUMULATED]), TIMEOUT_MS
    )
    if fresh[0].status is not Status.PROVED:
        return Outcome(Status.REFUTED, "fresh all-reduce per micro-batch not proved by the shipped encoder")
    for label, (ob, found) in (("accumulated all-reduce", accumulated), ("forward scale", forward)):
        if ob.status is not Status.REFUTED or not found:
            return Outcome(Status.REFUTED, f"{label} on .grad at m=2 not refuted by the shipped encoder")
    if not accumulated[1][0].rule.startswith("gradient_buffer["):
        return Outcome(Status.REFUTED, f"accumulated all-reduce refuted as {accumulated[1][0].rule}")
    return Outcome(
        Status.PROVED, "shipped _decide_integrity: fresh proved; .grad all-reduce gradient_buffer; forward refuted"
    )


# ---- 3. broadcasts and all-gathers of the gradient --------------------------------------------


def copies_sufficient() -> Outcome:
    """Mean all-reduce then broadcast gives the mean; reduce-scatter (SUM) of d elements then
    all-gather then 1/d gives every device the mean on every element."""
    outcomes = []
    for d in (2, 3, 4):
        c = [z3.Real(f"c{i}") for i in range(d)]
        mean = z3.Sum(*c) / d
        reduced = [mean] * d
        broadcast = [reduced[0]] * d
        outcomes.append(proved_if_unsat(prove({}, z3.And(*[b == mean for b in broadcast]), TIMEOUT_MS)))
        g = [[z3.Real(f"g_{i}_{e}") for e in range(d)] for i in range(d)]  # device i, element e
        shard = [z3.Sum(*[g[i][e] for i in range(d)]) for e in range(d)]  # device e holds element e
        gathered = [[shard[e] / d for e in range(d)] for _ in range(d)]
        goal = z3.And(*[gathered[i][e] == z3.Sum(*[g[k][e] for k in range(d)]) / d for i in range(d) for e in range(d)])
        outcomes.append(proved_if_unsat(prove({}, goal, TIMEOUT_MS)))
    return combine(outcomes, "d in 2..4: all-reduce then broadcast; reduce-scatter then all-gather")


def copies_necessary() -> Outcome:
    """A broadcast (or all-gather) of the unreduced gradient, then a mean all-reduce, gives every
    device device 0's contribution: the others' are lost (witness d = 2), and for every d the
    one-hot witness on device 1 differs."""
    outcomes = []
    for d in (2, 3, 4):
        c = [z3.Real(f"c{i}") for i in range(d)]
        copied = [c[0]] * d
        after = z3.Sum(*copied) / d
        one_hot = z3.And(c[1] == 1, *[c[i] == 0 for i in range(d) if i != 1])
        outcomes.append(proved_if_unsat(prove({"one_hot_on_device_1": one_hot}, after != z3.Sum(*c) / d, TIMEOUT_MS)))
    c0, c1 = z3.Reals("c0 c1")
    found = check({"broadcast_loses_contribution": c0 != (c0 + c1) / 2}, TIMEOUT_MS)

    def replay() -> str | None:
        assert found.model is not None
        a, b = (_fraction(found.model.eval(x, model_completion=True)) for x in (c0, c1))
        got, want = (a + a) / 2, (a + b) / 2
        return None if got == want else f"d=2, contributions {a}, {b}: device holds {got}, single-device {want}"

    return combine([*outcomes, _witnessed(found.answer, replay, "broadcast")], "one-hot witness, d in 2..4")


def copies_shipped() -> Outcome:
    mean = _op(OpKind.ALL_REDUCE, Phase.GRAD_SYNC, reduce=Reduce.MEAN)
    notes = []
    for d in (2, 3):
        rs = [
            _op(OpKind.REDUCE_SCATTER, Phase.GRAD_SYNC, reduce=Reduce.SUM),
            _op(OpKind.ALL_GATHER, Phase.GRAD_SYNC),
            _op(OpKind.SCALE, Phase.OPTIMIZER, scale=sp.Rational(1, d)),
        ]
        if _decide_integrity(_case(Axis.DP, d, rs), TIMEOUT_MS)[0].status is not Status.PROVED:
            return Outcome(
                Status.REFUTED, f"d={d}: reduce-scatter, all-gather, x1/{d} not proved by the shipped encoder"
            )
        for kind in (OpKind.BROADCAST, OpKind.ALL_GATHER):
            ob, found = _decide_integrity(_case(Axis.DP, d, [_op(kind, Phase.GRAD_SYNC), mean]), TIMEOUT_MS)
            if ob.status is not Status.REFUTED or not found or not found[0].rule.startswith("reduction_closure["):
                return Outcome(Status.REFUTED, f"d={d}: {kind.value} of the unreduced gradient not reduction_closure")
        notes.append(d)
    return Outcome(
        Status.PROVED, f"shipped _decide_integrity, d in {notes}: gather of reduced proved, copies of unreduced refuted"
    )


# ---- 4. scales of P and O fold ------------------------------------------------------------


def scale_folding() -> Outcome:
    """A state scaled by s1..sk is unchanged for every value iff the product is 1 (sufficient:
    z3 proves p*prod == p; necessary: for every other product, p = 1 is a witness); x1/2 then
    x2 restores."""
    outcomes = []
    for k in (1, 2, 3, 4):
        s = [z3.Real(f"s{n}") for n in range(k)]
        p = z3.Real("p")
        scaled = p
        for f in s:
            scaled = scaled * f
        product = s[0]
        for f in s[1:]:
            product = product * f
        outcomes.append(proved_if_unsat(prove({"product_is_one": product == 1}, scaled == p, TIMEOUT_MS)))
        outcomes.append(
            proved_if_unsat(prove({"product_is_not_one": product != 1, "p_is_one": p == 1}, scaled != p, TIMEOUT_MS))
        )
    p = z3.Real("p")
    outcomes.append(proved_if_unsat(prove({}, p * z3.RealVal(Fraction(1, 2)) * 2 == p, TIMEOUT_MS)))
    return combine(outcomes, "k in 1..4 scales; x1/2 then x2 restores")


# ---- 5. data assignment ------------------------------------------------------------------


def _sample_gradient(w: z3.ArithRef, x: z3.ArithRef, y: z3.ArithRef) -> z3.ArithRef:
    return (w * x - y) * x  # d/dw of (w*x - y)**2 / 2, linear regression


def data_assignment() -> Outcome:
    """Two samples, a data axis of degree 2. Distinct samples per device: the averaged gradient
    is the batch mean (proved for every w, x, y). The same sample on both devices (activations
    replicated along the axis): the averaged gradient is the gradient of 1/2 of the batch, not
    of the batch (a witness, replayed exactly)."""
    w, x1, x2, y1, y2 = z3.Reals("w x1 x2 y1 y2")
    g1, g2 = _sample_gradient(w, x1, y1), _sample_gradient(w, x2, y2)
    # The single-device gradient of the batch loss (1/2) sum_k (w x_k - y_k)^2 / 2, differentiated
    # by hand (not through the per-sample gradients): (w (x1^2 + x2^2) - (x1 y1 + x2 y2)) / 2.
    batch = (w * (x1 * x1 + x2 * x2) - (x1 * y1 + x2 * y2)) / 2
    distinct = proved_if_unsat(prove({}, (g1 + g2) / 2 == batch, TIMEOUT_MS))
    same = (g1 + g1) / 2  # both devices read sample 1
    half = proved_if_unsat(prove({}, same == w * x1 * x1 - x1 * y1, TIMEOUT_MS))  # the first half's gradient
    found = check({"replicated_data_differs": same != batch}, TIMEOUT_MS)

    def replay() -> str | None:
        assert found.model is not None
        v = {str(t): _fraction(found.model.eval(t, model_completion=True)) for t in (w, x1, x2, y1, y2)}
        a = (v["w"] * v["x1"] - v["y1"]) * v["x1"]
        b = (v["w"] * v["x2"] - v["y2"]) * v["x2"]
        got, want = (a + a) / 2, (a + b) / 2
        return None if got == want else f"{v}: replicated average {got}, batch mean {want}"

    return combine([distinct, half, _witnessed(found.answer, replay, "two samples")], "two samples, degree 2")


# ---- 6. split computation over a replicated gradient ----------------------------------------


def split_compute() -> Outcome:
    """d devices split the computation of a d-element gradient (device i computes element i).
    Sharded (device i reads only element i) every read is the full gradient's (proved); placed
    replicated, device 0 reads element 1 as it holds it, which differs from the full gradient
    outside its slice (a witness for every d, and z3's own at d = 2 replayed)."""
    outcomes = []
    for d in (2, 3, 4):
        g = [z3.Real(f"g{e}") for e in range(d)]
        stale = [[z3.Real(f"u_{i}_{e}") for e in range(d)] for i in range(d)]
        held = [[g[e] if e == i else stale[i][e] for e in range(d)] for i in range(d)]
        # sharded: device i reads its own slice; gathered from the owners, every element is right
        own = z3.And(*[held[i][i] == g[i] for i in range(d)])
        gathered = z3.And(*[held[e][e] == g[e] for _ in range(d) for e in range(d)])
        outcomes.append(proved_if_unsat(prove({}, z3.And(own, gathered), TIMEOUT_MS)))
        hyps = {"untouched_outside_slice_is_zero": z3.And(*[stale[0][e] == 0 for e in range(d)]), "g1": g[1] == 1}
        outcomes.append(proved_if_unsat(prove(hyps, held[0][1] != g[1], TIMEOUT_MS)))
    g1, u = z3.Reals("g1 u")  # u: what device 0 holds of element 1 (never computed)
    found = check({"replica_differs_outside_slice": u != g1}, TIMEOUT_MS)

    def replay() -> str | None:
        assert found.model is not None
        a, b = (_fraction(found.model.eval(t, model_completion=True)) for t in (g1, u))
        return None if a == b else f"d=2: device 0 reads element 1 as {b}, the full gradient has {a}"

    return combine([*outcomes, _witnessed(found.answer, replay, "replica")], "d in 2..4")


OBLIGATIONS: tuple[tuple[str, str, str, Callable[[], Outcome]], ...] = (
    (
        "programs.product_normalisation.sufficient",
        "normalisation is a product: SUM over dp and cp with scales whose product is 1/(dp*cp) gives the mean",
        "z3",
        product_sufficient,
    ),
    (
        "programs.product_normalisation.necessary",
        "any other product of scales gives a different value (one-hot witness)",
        "z3",
        product_necessary,
    ),
    (
        "programs.product_normalisation.shipped",
        "the shipped encoder proves SUM, SUM, x1/(dp*cp) and refutes x1/dp as normalisation",
        "z3",
        product_shipped,
    ),
    (
        "programs.gradient_buffer.sufficient",
        "SUM all-reduce of the fresh gradient each micro-batch, accumulate, then x1/d: the single-device gradient",
        "z3",
        buffer_sufficient,
    ),
    (
        "programs.gradient_buffer.necessary",
        "the same all-reduce on the accumulated .grad after each micro-batch differs (witness at m = 2)",
        "z3+numpy-check",
        buffer_necessary,
    ),
    (
        "programs.gradient_buffer.forward",
        "a forward op on .grad acts on the earlier micro-batches' sum (none at m = 1)",
        "z3+numpy-check",
        forward_on_grad,
    ),
    (
        "programs.gradient_buffer.shipped",
        "the shipped encoder proves the fresh all-reduce and refutes .grad ops inside the loop at m = 2",
        "z3",
        buffer_shipped,
    ),
    (
        "programs.gradient_copies.sufficient",
        "a broadcast of a reduced gradient, and an all-gather of shards of a reduced gradient, restore it",
        "z3",
        copies_sufficient,
    ),
    (
        "programs.gradient_copies.necessary",
        "a broadcast or all-gather of an unreduced gradient loses contributions (witness)",
        "z3+numpy-check",
        copies_necessary,
    ),
    (
        "programs.gradient_copies.shipped",
        "the shipped encoder proves gathering a reduced gradient and refutes copies of an unreduced one",
        "z3",
        copies_shipped,
    ),
    (
        "programs.scaled_state",
        "scales of P and O fold: the state is unchanged for every value iff the product of its scales is 1",
        "z3",
        scale_folding,
    ),
    (
        "programs.data_assignment",
        "activations replicated along a data axis: the averaged gradient is that of 1/d of the batch (witness)",
        "z3+numpy-check",
        data_assignment,
    ),
    (
        "programs.split_compute_needs_sharded_gradient",
        "split computation: a sharded gradient reads the full one; a replica differs outside its slice (witness)",
        "z3+numpy-check",
        split_compute,
    ),
)


def obligations() -> list[Obligation]:
    return [
        Obligation(name, statement, method, functools.partial(decide))
        for name, statement, method, decide in OBLIGATIONS
    ]
