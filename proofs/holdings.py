"""Obligations for where model states live through a step (proofs/programs.md, sections 7-9).

Three rules of docs/semantics.md that decide which copy a read sees: forward and backward ops run
once per micro-batch ("Execution order"), reduce-scatters along several axes cut towards the
partition they make together ("Collectives along several axes"), and a group outside the layers
along a pipeline lives whole where its mode puts it ("Groups outside the layers along a
pipeline"). Each gets a z3 obligation over symbolic values (sufficiency proved, necessity by a
witness that an exact ``Fraction`` replay confirms), and a ``shipped`` obligation that runs the
verdict the CLI uses (``formal._smt.decide`` on a parsed composition and its derived program,
changed as the section says), so a bug in the shipped encoder fails here too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from fractions import Fraction

import sympy as sp
import z3

from checker._parse import parse
from checker._toml import loads
from formal._model import Transformer
from formal._program import Op, StepProgram, derive_program, group_sizes, shard_elements
from formal._reference import ReferenceModel
from formal._simulator import reference_for
from formal._smt import decide
from formal._verdict import Status
from formal._vocab import Axis, OpKind, Phase, State
from proofs._obligation import Obligation, Outcome, combine, proved_if_unsat
from proofs._solver import Answer, check, prove

TIMEOUT_MS = 60_000
P, G = State.PARAMETERS, State.GRADIENTS
Change = Callable[[StepProgram, Transformer], StepProgram]


def _verdict(text: str, toml: str = "", change: Change | None = None, tied: bool = False) -> Status:
    """The shipped verdict on ``text`` (strategies from ``toml``), its derived program changed."""
    composition = parse(text, loads(toml).factories() if toml else None)
    transformer = reference_for(composition, ReferenceModel(tied=tied)).transformer()
    program = derive_program(composition.placement(transformer), transformer)
    if change is not None:
        program = change(program, transformer)
    return decide(composition, program, transformer).status


def _insert(state: State, group_name: str, axis: Axis, phase: Phase, kind: OpKind, at: int, **kw: object) -> Change:
    def change(program: StepProgram, model: Transformer) -> StepProgram:
        group = next(g for g in program.placement.groups(State.PARAMETERS) if g.name == group_name)
        elements = shard_elements(program.placement, state, group, group_sizes(model)[group], axis)
        op = Op(kind, state, group, axis, phase, elements, sp.Integer(1), **kw)  # type: ignore[arg-type]
        ops = list(program.ops)
        ops.insert(at if at >= 0 else len(ops) + 1 + at, op)
        return program.with_ops(ops)

    return change


def _after_backward(program: StepProgram) -> int:
    return max(i for i, op in enumerate(program.ops) if op.phase is Phase.BACKWARD) + 1


def _expect(cases: list[tuple[str, Status, Status]], detail: str) -> Outcome:
    wrong = [f"{name}: {got.label}, expected {want.label}" for name, got, want in cases if got is not want]
    return Outcome(Status.REFUTED, "; ".join(wrong)) if wrong else Outcome(Status.PROVED, detail)


# ---- 7. forward and backward ops run once per micro-batch -------------------------------------


def micro_batch_reads() -> Outcome:
    """A scale ``s`` of the parameters after each micro-batch's backward: micro-batch ``j`` reads
    ``s^j * p``. Sufficient: ``s = 1`` gives every read ``p`` (m in 2..4). Necessary: for ``s != 1``
    the second micro-batch's read differs (witness ``p = 1``, replayed exactly)."""
    outcomes = []
    for m in (2, 3, 4):
        p, s = z3.Real("p"), z3.Real("s")
        reads = [p]
        for _ in range(1, m):
            reads.append(reads[-1] * s)
        outcomes.append(proved_if_unsat(prove({"no_scale": s == 1}, z3.And(*[r == p for r in reads]), TIMEOUT_MS)))
        found = check({"a_scale": s != 1, "second_read_right": reads[1] == p, "p_nonzero": p != 0}, TIMEOUT_MS)
        if found.answer is not Answer.UNSAT:
            return Outcome(Status.REFUTED, f"m={m}: a scale other than 1 left the second read right")
    reads_replayed = [Fraction(1)]  # the witness s = 2, p = 1, replayed exactly
    reads_replayed.append(reads_replayed[-1] * 2)
    if reads_replayed[1] == Fraction(1):
        return Outcome(Status.REFUTED, "replay: the doubled read equals the single-device value")
    return combine(outcomes, "m in 2..4: s = 1 keeps every read; s != 1 changes the second (p = 1 reads 2)")


def micro_batch_shipped() -> Outcome:
    """ZeRO-Offload with two micro-batches and a x2 of the device copy after the backward's
    reads: refuted (the second forward reads it); one micro-batch: proved (the refresh from the
    host master overwrites it before any read); x1: proved."""

    def after_backward(factor: int) -> Change:
        def change(program: StepProgram, model: Transformer) -> StepProgram:
            at = _after_backward(program)
            return _insert(P, "row_bias", Axis.DP, Phase.BACKWARD, OpKind.SCALE, at, scale=sp.Integer(factor))(
                program, model
            )

        return change

    return _expect(
        [
            ("m=2, x2", _verdict("dp2xm2xoffload", change=after_backward(2)), Status.REFUTED),
            ("m=1, x2", _verdict("dp2xm1xoffload", change=after_backward(2)), Status.PROVED),
            ("m=2, x1", _verdict("dp2xm2xoffload", change=after_backward(1)), Status.PROVED),
        ],
        "shipped decide: x2 after the backward refuted at m = 2, proved at m = 1; x1 proved",
    )


# ---- 8. reduce-scatters along several axes nest -----------------------------------------------


def nested_scatter() -> Outcome:
    """A gradient of ``d1*d2`` elements over a ``d1 x d2`` grid (element ``a*d2 + b`` is device
    ``(a, b)``'s piece). Sufficient: a reduce-scatter along either axis first, each leaving the
    union over the axis still to come of the final pieces, then along the other, gives every
    device the sum of all contributions to its piece (both orders, grids 2x2, 2x3, 3x2).
    Necessary: cutting the second one from the whole buffer, as if the first had not run, gives
    device (0, 1) a sum over one axis only (one-hot witness, replayed)."""
    outcomes = []
    for d1, d2 in ((2, 2), (2, 3), (3, 2)):
        n = d1 * d2
        c = {(a, b, e): z3.Real(f"c_{a}_{b}_{e}") for a in range(d1) for b in range(d2) for e in range(n)}

        totals = {e: z3.Sum(*[c[(a, b, e)] for a in range(d1) for b in range(d2)]) for e in range(n)}

        # first along axis 1 (a): device (a, b) keeps {a*d2 + b'} summed over a'
        first_a = {
            (a, b, a * d2 + b2): z3.Sum(*[c[(a2, b, a * d2 + b2)] for a2 in range(d1)])
            for a in range(d1)
            for b in range(d2)
            for b2 in range(d2)
        }
        then_b = [
            z3.Sum(*[first_a[(a, b2, a * d2 + b)] for b2 in range(d2)]) == totals[a * d2 + b]
            for a in range(d1)
            for b in range(d2)
        ]
        # first along axis 2 (b): device (a, b) keeps {a'*d2 + b} summed over b'
        first_b = {
            (a, b, a2 * d2 + b): z3.Sum(*[c[(a, b2, a2 * d2 + b)] for b2 in range(d2)])
            for a in range(d1)
            for b in range(d2)
            for a2 in range(d1)
        }
        then_a = [
            z3.Sum(*[first_b[(a2, b, a * d2 + b)] for a2 in range(d1)]) == totals[a * d2 + b]
            for a in range(d1)
            for b in range(d2)
        ]
        outcomes.append(proved_if_unsat(prove({}, z3.And(*then_b, *then_a), TIMEOUT_MS)))

    # The old cut, grid 2x2: after the reduce-scatter along b (device (0, 1) keeps elements 1 and
    # 3, summed over b), the one along a cut from the whole buffer gives device (0, 1) element 1
    # as the sum over a of what devices (0, 1) and (1, 1) hold there: device (1, 1) kept element
    # 1 unreduced along a. One-hot: only device (1, 0) contributes 1 to element 1.
    def replay() -> str | None:
        contribution = {(a, b): Fraction(int((a, b) == (1, 0))) for a in range(2) for b in range(2)}
        full = sum(contribution.values(), Fraction(0))
        kept_by_0_1 = contribution[(0, 0)] + contribution[(0, 1)]  # summed over b on row a = 0
        kept_by_1_1 = contribution[(1, 1)]  # not in (1, 1)'s union: its own unreduced value
        old = kept_by_0_1 + kept_by_1_1
        return None if old != full else "replay: the old cut gave the full sum"

    problem = replay()
    if problem is not None:
        return Outcome(Status.REFUTED, problem)
    return combine(outcomes, "grids 2x2, 2x3, 3x2, both orders: every piece sums every contribution once")


NESTED = """
[strategies.zero1-dpr]
axis = "dpr"
P = "R"
O = "S"
G = "R"

[strategies.zero1-dp]
axis = "dp"
P = "R"
O = "S"
G = "R"
"""


def nested_shipped() -> Outcome:
    """ZeRO-1 over dpr x dp (full-size gradient buffer, optimizer state sharded along both):
    the derived program (dp first) and the reordered one are proved; without the refresh, the
    replicas outside each shard go stale: refuted."""

    def reordered(program: StepProgram, model: Transformer) -> StepProgram:
        ops = list(program.ops)
        at = [i for i, op in enumerate(ops) if op.kind is OpKind.REDUCE_SCATTER and op.state is G]
        for i, j in zip(at[::2], at[1::2], strict=True):
            ops[i], ops[j] = ops[j], ops[i]
        return program.with_ops(ops)

    def no_refresh(program: StepProgram, model: Transformer) -> StepProgram:
        return program.with_ops([op for op in program.ops if op.phase is not Phase.REFRESH])

    text = "zero1-dpr2xzero1-dp2"
    return _expect(
        [
            ("derived", _verdict(text, NESTED), Status.PROVED),
            ("reordered", _verdict(text, NESTED, reordered), Status.PROVED),
            ("no refresh", _verdict(text, NESTED, no_refresh), Status.REFUTED),
        ],
        "shipped decide: both orders proved, no refresh refuted",
    )


def scatter_across_axes() -> Outcome:
    """The optimizer's piece cut along two axes, outer first (element ``a*d2 + b`` is device
    ``(a, b)``'s). Sufficient: an all-reduce along the outer axis, then a reduce-scatter along
    the inner one of the outer chunk, gives every device the sum of all contributions to its
    piece (grids 2x2, 2x3, 3x2). Necessary: the reduce-scatter along the inner axis first, then
    an all-reduce along the outer one, fails however the first cuts: from the whole buffer,
    device (0, 1) holds the inner chunk 1 (elements 2 and 3 of 4), not its piece 1; within the
    outer chunk, the all-reduce adds device (1, 1)'s element 3 to device (0, 1)'s element 1
    (z3 finds contributions where the sum differs; a one-hot witness is replayed)."""
    outcomes = []
    for d1, d2 in ((2, 2), (2, 3), (3, 2)):
        n = d1 * d2
        c = {(a, b, e): z3.Real(f"c_{a}_{b}_{e}") for a in range(d1) for b in range(d2) for e in range(n)}
        totals = {e: z3.Sum(*[c[(a, b, e)] for a in range(d1) for b in range(d2)]) for e in range(n)}
        outer = {(b, e): z3.Sum(*[c[(a, b, e)] for a in range(d1)]) for b in range(d2) for e in range(n)}
        then_inner = [
            z3.Sum(*[outer[(b2, a * d2 + b)] for b2 in range(d2)]) == totals[a * d2 + b]
            for a in range(d1)
            for b in range(d2)
        ]
        outcomes.append(proved_if_unsat(prove({}, z3.And(*then_inner), TIMEOUT_MS)))
    # the other order on a 2x2 grid, cut within the outer chunk: device (a, 1) holds element
    # a*2 + 1 summed over b; the all-reduce along a sums elements 1 and 3 into device (0, 1)'s piece
    c = {(a, b, e): z3.Real(f"c_{a}_{b}_{e}") for a in range(2) for b in range(2) for e in range(4)}
    inner = {a: c[(a, 0, a * 2 + 1)] + c[(a, 1, a * 2 + 1)] for a in range(2)}
    mixed = inner[0] + inner[1]
    total = z3.Sum(*[c[(a, b, 1)] for a in range(2) for b in range(2)])
    found = check({"mixed_differs": mixed != total}, TIMEOUT_MS)
    if found.answer is not Answer.SAT:
        return Outcome(Status.REFUTED, "no contributions told the mixed sum from the total")

    def replay() -> str | None:
        one_hot = {
            (a, b, e): Fraction(int((a, b, e) == (1, 0, 1))) for a in range(2) for b in range(2) for e in range(4)
        }
        full = sum((one_hot[(a, b, 1)] for a in range(2) for b in range(2)), Fraction(0))
        summed = sum((one_hot[(a, 0, a * 2 + 1)] + one_hot[(a, 1, a * 2 + 1)] for a in range(2)), Fraction(0))
        from_whole = {2 * 1 + k for k in range(2)}  # inner chunk 1 of the whole buffer: elements 2, 3
        if summed == full:
            return "replay: the mixed sum matched"
        return "replay: the inner chunk of the whole held piece 1" if 1 in from_whole else None

    problem = replay()
    if problem is not None:
        return Outcome(Status.REFUTED, problem)
    return combine(
        outcomes, "outer all-reduce then inner reduce-scatter sums every contribution; the other order fails"
    )


def scatter_across_shipped() -> Outcome:
    """ZeRO-1 over dpr x dp with the reduce-scatter along dpr turned into an all-reduce (after the
    one along dp): refuted. ZeRO++ hpZ with ZeRO-2 over dpr x dp: an all-reduce along dpr after
    the reduce-scatter along dp refuted, before it proved."""

    def all_reduced(first: bool, outer: Axis = Axis.DPR) -> Change:
        def change(program: StepProgram, model: Transformer) -> StepProgram:
            ops = list(program.ops)
            for i, op in enumerate(program.ops):
                if op.state is G and op.kind is OpKind.REDUCE_SCATTER and op.axis is outer:
                    ops[i] = Op(OpKind.ALL_REDUCE, G, op.group, op.axis, op.phase, op.elements, op.count, op.reduce)
                    other = [j for j in range(i) if ops[j].group == op.group and ops[j].kind is OpKind.REDUCE_SCATTER]
                    if first and other:
                        ops[i], ops[other[-1]] = ops[other[-1]], ops[i]
            return program.with_ops(ops)

        return change

    hpz = "hpz-dpr2xtp2xzero12xm1xrecomputexoffload-params"
    return _expect(
        [
            (
                "ZeRO-1, dp then dpr all-reduced",
                _verdict("zero1-dpr2xzero1-dp2", NESTED, all_reduced(False)),
                Status.REFUTED,
            ),
            ("hpZ, dp then dpr all-reduced", _verdict(hpz, change=all_reduced(False)), Status.REFUTED),
            ("hpZ, dpr all-reduced first", _verdict(hpz, change=all_reduced(True)), Status.PROVED),
        ],
        "shipped decide: the inner reduce-scatter before the outer all-reduce refuted, after it proved",
    )


# ---- 9. groups outside the layers along a pipeline ----------------------------------------------

ONE_STAGE = """
[strategies.stages]
axis = "pp"
P = "S"
O = "S"
G = "S"
[strategies.stages.groups.{group}]
P = "{p}"
O = "{o}"
G = "{g}"
"""


def stage_update() -> Outcome:
    """An update is right only where the gradient was computed: a stage that holds a replica of a
    group it never computes updates it from an empty gradient (zero), so its copy is
    ``upd(p, 0)``, not ``upd(p, g)``. For SGD, ``p - lr*0 != p - lr*g`` iff ``lr*g != 0``
    (sufficiency of holding it on the computing stage, necessity with the witness lr = g = 1)."""
    p, lr, g = z3.Real("p"), z3.Real("lr"), z3.Real("g")
    same = proved_if_unsat(prove({}, (p - lr * g == p - lr * g), TIMEOUT_MS))
    found = check({"step_nonzero": lr * g != 0, "replica_right": p - lr * 0 == p - lr * g}, TIMEOUT_MS)
    if found.answer is not Answer.UNSAT:
        return Outcome(Status.REFUTED, "an update from no gradient matched one from a nonzero gradient")
    if Fraction(0) - Fraction(1) * 0 == Fraction(0) - Fraction(1) * 1:
        return Outcome(Status.REFUTED, "replay: the witness does not differ")
    return combine([same], "the computing stage's update is right; a replica's differs whenever lr*g != 0")


def stage_shipped() -> Outcome:
    """The final norm ``R`` along pp with its optimizer state ``R`` (the first stage updates a
    replica it never computes): refuted; ``S``: proved. The embedding's optimizer state ``S``
    (all of it on the first stage), its refresh to the last stage as a broadcast: proved. A
    broadcast of the head's gradient from the first stage, which never computed it: refuted."""

    def refresh_as_broadcast(program: StepProgram, model: Transformer) -> StepProgram:
        return program.with_ops(
            [
                Op(OpKind.BROADCAST, op.state, op.group, op.axis, op.phase, op.elements, op.count)
                if op.phase is Phase.REFRESH
                and op.axis is not None
                and op.axis.kind.is_pipeline
                and op.kind is OpKind.ALL_GATHER
                else op
                for op in program.ops
            ]
        )

    def head_broadcast(program: StepProgram, model: Transformer) -> StepProgram:
        return _insert(G, "head", Axis.PP, Phase.BACKWARD, OpKind.BROADCAST, _after_backward(program))(program, model)

    def embedding_broadcast(program: StepProgram, model: Transformer) -> StepProgram:
        at = _after_backward(program)
        return _insert(G, "embedding", Axis.PP, Phase.BACKWARD, OpKind.BROADCAST, at)(program, model)

    replica = ONE_STAGE.format(group="final_norm", p="R", o="R", g="R")
    held = ONE_STAGE.format(group="final_norm", p="S", o="S", g="S")
    embedding = ONE_STAGE.format(group="embedding", p="R", o="S", g="S")
    return _expect(
        [
            ("final norm R, O R", _verdict("stages2xdpr2", replica), Status.REFUTED),
            ("final norm S", _verdict("stages2xdpr2", held), Status.PROVED),
            (
                "embedding O S, refresh broadcast",
                _verdict("stages2xtp2xm2", embedding, refresh_as_broadcast),
                Status.PROVED,
            ),
            ("head G broadcast", _verdict("pp2", change=head_broadcast), Status.REFUTED),
            ("embedding G broadcast", _verdict("pp2", change=embedding_broadcast), Status.PROVED),
        ],
        "shipped decide: replicas that never compute refuted, whole-where-held proved, broadcasts from the first stage",
    )


OBLIGATIONS: tuple[tuple[str, str, str, Callable[[], Outcome]], ...] = (
    (
        "programs.micro_batch_parameter_ops",
        "a parameter op after the backward acts before the next forward: reads are right iff it changes nothing",
        "z3+numpy-check",
        micro_batch_reads,
    ),
    (
        "programs.micro_batch_parameter_ops.shipped",
        "the shipped verdict refutes a x2 of the parameters after the backward at m = 2, proves it at m = 1",
        "z3",
        micro_batch_shipped,
    ),
    (
        "programs.nested_reduce_scatter",
        "reduce-scatters along two axes, in either order, give each piece the sum of every contribution once",
        "z3+numpy-check",
        nested_scatter,
    ),
    (
        "programs.nested_reduce_scatter.shipped",
        "the shipped verdict proves ZeRO-1 over dpr x dp in both orders and refutes it without the refresh",
        "z3",
        nested_shipped,
    ),
    (
        "programs.scatter_across_axes",
        "an all-reduce along the outer axis must come before the reduce-scatter along the inner one",
        "z3+numpy-check",
        scatter_across_axes,
    ),
    (
        "programs.scatter_across_axes.shipped",
        "the shipped verdict refutes an inner reduce-scatter before an outer all-reduce, proves the other order",
        "z3",
        scatter_across_shipped,
    ),
    (
        "programs.stage_groups",
        "a replica on a stage that never computes the group is updated from no gradient and differs",
        "z3+numpy-check",
        stage_update,
    ),
    (
        "programs.stage_groups.shipped",
        "the shipped verdict on groups outside the layers along pp: whole where held, broadcasts from the first stage",
        "z3",
        stage_shipped,
    ),
)


def obligations() -> list[Obligation]:
    return [
        Obligation(name, statement, method, functools.partial(decide_one))
        for name, statement, method, decide_one in OBLIGATIONS
    ]
