"""z3 decides gradient integrity, state consistency and the composition rules (docs/semantics.md,
"Correctness" and "Composition rules").

``decide(composition, program, model)`` returns a three-valued ``Verdict``. Every query goes
through ``formal._solver.solve`` (the one wrapper, which keeps ``reason_unknown()`` and holds the
run to its resource and wall-clock budget), every obligation gets a
fresh solver, and every constraint is tracked under a readable name such as
``reduction_closure[G.norm, tp]`` or ``refresh[P.attention, dp]``: unsat cores come back as those
names, and sat models are decoded into witnesses (which state, group, axis, device and chunk, the
value read and the single-device value).

Four families of obligations:

* **Composition rules** (docs/semantics.md, "Composition rules"), one obligation over the
  correctness rules of the one rules table, ``formal/_rules.py``: the composition's degrees and
  the model's sizes are tracked facts (``value[heads]``), the rules tracked assumptions
  (``divides[heads, tp]``, ``orthogonality[dp]``, ``sp_needs_tp``...). Unsat means some rule
  fails; its core names it, and each rule of the core is re-checked alone so that every broken
  rule is reported. The table's framework rules are notes, never refutations.
* **Gradient integrity**, one obligation per parameter group and axis: the program's gradient
  ops on that axis (all-reduce, reduce-scatter, broadcast, all-gather, scale; in every phase, in
  program order, up to the optimizer step, each on the buffer docs/semantics.md's "Gradient
  buffers" gives it, micro-batch by micro-batch when an op acts on ``.grad`` inside the loop)
  are executed symbolically over integer contributions, starting from the ``Origin`` the
  program records. The obligation asks z3 for contributions on which some device's gradient
  differs from the single-device one (the mean of the contributions along data axes, their sum
  otherwise: a tied embedding on ``pp``, sequence-parallel norms on ``tp``). Unsat: proved.
  Normalisation is a product across axes (``_normalised``): one scale may normalise several.
  When the optimizer runs on the host (ZeRO-Offload) it reads the host copy of the gradient: a
  device-to-host copy snapshots the device value at that point (none of it before the backward),
  and reductions after it do not reach the host (``transfer_after_reduction``).
* **Activation exchange** (part of gradient integrity; ``formal/_activation_flow.py``), one
  obligation per exchange the placement needs (tp's partial sums, cp's keys and values, ep's
  all-to-all, pp's sends, forward and backward): the program's activation ops run over z3
  values, and z3 looks for values on which a device ends without the single-device value.
* **State consistency**, one obligation per group and axis (for P, O and G): the program runs
  for two consecutive steps over chunks of the tensor with per-device (and per-host) holdings
  whose values are z3 terms (initial values, per-step gradients, and the optimizer update as
  uninterpreted functions of the (p, o, g) it read). Every read (a forward/backward use, the
  optimizer reading P, O and G, and the coverage of P and O at each step boundary) is compared
  with the single-device value at that point. Two steps make the check judge reads, not
  snapshots: a replica left stale after step 0 but refreshed before its next read is fine.
  Where flat shards nest across axes (the one-axis runs cannot see it), ``formal/_smt_layout.py``
  adds two obligations per group over the exact positions of the pieces: the optimizer's piece
  lies inside the gradient's at the step (``scatter_nesting``), and no all-reduce along an axis
  follows a reduce-scatter whose piece is cut along it (``scatter_then_reduce``).

Execution order (the simulator's, ``formal/_simulator.py``): phases in order, each phase's ops
in program order, gradient ops of the backward after the backward has produced the gradient;
with m > 1 micro-batches, gradient-synchronisation ops done per micro-batch before the ones done
once per step; transient parameter copies freed at the end of the forward and of the backward; a
sharded gradient freed outside its shard after gradient synchronisation (see ``_execution_order``,
``formal/_smt_common.py``).
A collective along an axis of degree 1 exchanges nothing: it is the identity.

Why per axis. Collectives act on one axis at a time and placements are given per axis, so a
group's gradient is the tensor product of per-axis linear maps over the contributions, and a
chunk's holders along one axis do not depend on how other axes split it; a program is correct
iff it is correct along every axis (where flat shards nest across axes, the positions of the pieces
are judged too: ``formal/_smt_layout.py``). Gradient integrity is exact for any degree: devices along an
axis are symmetric, so up to 8 devices are explicit and the others are folded into one aggregate
(their contributions' sum and their values' sum), which every collective maps linearly. State
consistency uses the real degree up to 4; beyond 4 it uses 4 devices (or one per distinct offset,
if more) and relabels the distinct offsets used along the axis to 0, 1, 2, ...: the ops are
rotation-equivariant (device i and chunk k only meet through ``(i - offset) mod d``), so a read
is stale or misaligned iff the partitions it crosses have different offsets, which relabelling
preserves. (A program whose correctness hinges on sums of offsets, such as two gathers whose
rotations cancel, is outside this argument; no derived program has one.)

Modules. This one keeps the memo (``_MEMO``, read here at call time), ``clear_cache`` and
``decide``; the encodings live in ``formal/_smt_rules.py`` (composition rules),
``formal/_smt_integrity.py`` (gradient integrity), ``formal/_smt_holdings.py`` (state
consistency's two-step run of holdings and reads) and ``formal/_smt_consistency.py`` (its z3
query, root causes and witnesses), with what they share (numbers, the execution order,
``_Index``) in ``formal/_smt_common.py``.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from math import prod
from typing import Any

from formal._activation_flow import decide_activation_exchange
from formal._model import Model
from formal._program import Origin, StepProgram, refuse_unmodelled_ops
from formal._rules import framework_notes, setting_for
from formal._smt_common import MAX_CONSISTENCY_DEVICES, MAX_EXPLICIT_DEVICES, PLACEHOLDER, G, P, _Index, _int_degree
from formal._smt_consistency import _decide_consistency
from formal._smt_holdings import _AxisRun, _consistency_case, _ConsistencyCase
from formal._smt_integrity import _decide_integrity, _integrity_case, _IntegrityCase
from formal._smt_layout import decide_layout
from formal._smt_rules import _decide_composition
from formal._smt_scalars import decide_scalars
from formal._solver import (
    DEFAULT_QUERY_RLIMIT,
    DEFAULT_RUN_RLIMIT,
    DEFAULT_RUN_TIMEOUT_S,
    DEFAULT_TIMEOUT_MS,
    Budget,
    budgeted,
    current_budget,
)
from formal._strategies import Composition
from formal._verdict import Obligation, Status, Verdict, Violation
from formal._vocab import Group, Mode

DEEPSPEED_PP_NOTE = (
    "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism (DeepSpeed issues #1629, #4164); "
    "torchtitan allows FSDP with PP. This is a cost, not a correctness, rule."
)


# --------------------------------------------------------------------------- the verdict


def _notes(composition: Composition, program: StepProgram) -> list[str]:
    pl = program.placement
    notes: list[str] = []
    m = pl.options.micro_batches
    if pl.pipelined and _int_degree(pl.pipeline_degree) > 1 and isinstance(m, int) and m > 1:
        sharded = sorted(
            {
                a.value
                for g in pl.groups(P)
                for a in pl.axes
                if a.splits_data and pl.mode(G, g, a) is Mode.SHARDED and program.origin(g, a) is Origin.PARTIAL
            }
        )
        if sharded:
            notes.append(
                f"gradients sharded along {', '.join(sharded)} under a pipeline with m={m} micro-batches: "
                f"valid, but they are reduce-scattered once per micro-batch ({m}x the traffic of one "
                f"reduction) or need unsharded accumulators. {DEEPSPEED_PP_NOTE}"
            )
    if program.derived is False or pl.user_program:
        notes.append("the step program was given, not derived: the verdict judges that program")
    return notes


# Obligations are decided once per distinct case. A case holds everything its formula depends on,
# with the tensor group erased, so groups placed alike (attention and MLP under most strategies;
# a hundred synthetic groups) share one z3 query; names are then written with each group's own.
# Answers are pure functions of (case, per-query resource limit); unknown answers are never
# remembered. A remembered answer is charged to the run's budget with the units it cost when it
# was decided, so that a run spends the same units whether or not earlier runs in this process
# decided the same cases: the verdict of an input never depends on what ran before it.
_MEMO: dict[tuple[_IntegrityCase | _ConsistencyCase, int], tuple[tuple[Obligation, list[Violation]], int]] = {}
_MEMO_LIMIT = 50_000  # 0 turns remembering off (the benchmark's worst case: every group its own query)


def _memo(case: _IntegrityCase | _ConsistencyCase, group: Group, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    budget = current_budget()
    key = (case, budget.query_rlimit if budget is not None else 0)
    hit = _MEMO.get(key)
    if hit is not None and (budget is None or hit[1] <= budget.left):
        answer, fresh = hit[0], False
        if budget is not None:
            budget.charge(hit[1])
    else:
        spent = budget.used if budget is not None else 0
        if isinstance(case, _IntegrityCase):
            answer = _decide_integrity(case, timeout_ms)
        else:
            run = _AxisRun(case)
            run.run()
            answer = _decide_consistency(run, timeout_ms)
        units = budget.used - spent if budget is not None else 0
        if answer[0].status is not Status.UNKNOWN and _MEMO_LIMIT > 0:
            if len(_MEMO) >= _MEMO_LIMIT:
                _MEMO.clear()
            _MEMO[key] = (answer, units)
        fresh = True
    ob, found = answer
    named = Obligation(
        _named(ob.name, group),
        ob.condition,
        ob.status,
        ob.reason_unknown,
        ob.seconds if fresh else 0.0,
        tuple(_named(c, group) for c in ob.core),
    )
    return named, [
        Violation(
            _named(v.rule, group),
            v.condition,
            v.state,
            group.name,
            v.axis,
            _named(v.explanation, group),
            _named_values(v.witness, group),
        )
        for v in found
    ]


def _normalised(
    cases: list[_IntegrityCase], answers: list[tuple[Obligation, list[Violation]]], group: Group, timeout_ms: int
) -> list[tuple[Obligation, list[Violation]]]:
    """Normalisation judged as a product across axes (docs/semantics.md, "Gradient integrity").

    Every gradient op is linear and ops along different axes act on different coordinates of the
    mesh, so a group's gradient is the tensor product of its per-axis maps and a scale is a
    scalar wherever it is applied: the gradient is right iff along every axis the ops combine
    the contributions right up to a factor, and the factors multiply to one. Megatron-Core's DDP
    (``average_in_collective=False``) sums over dp and cp and scales once by 1/(dp x cp); HSDP
    and expert data parallelism do the same over two axes. When only ``normalisation`` fails,
    each failing axis's factor is read off its counterexample (the value a device holds over
    the single-device one: a factor when the axis is right up to one) and, if the factors
    multiply to one, each axis is decided again allowing its factor. The product is accepted
    only if every axis is then proved: otherwise the first answers stand. The rule a failing
    axis was labelled with does not matter (a mean all-reduced twice is labelled a duplicated
    reduction, yet it is the identity on reduced values, and a scale elsewhere may be all that
    is off): the axis is decided again in full, so only an axis right up to its factor passes.
    """
    failing = [i for i, (ob, _) in enumerate(answers) if ob.status is Status.REFUTED]
    per_axis = ("normalisation[", "reduction_closure[")
    if not failing or any(
        not found or any(not v.rule.startswith(per_axis) for v in found) for found in (answers[i][1] for i in failing)
    ):
        return answers
    factors: dict[int, Fraction] = {}
    for i in failing:
        witness = answers[i][1][0].witness
        if "devices" not in witness or "single_device" not in witness:
            return answers
        held, single = witness["devices"], Fraction(str(witness["single_device"]))
        values = {Fraction(str(v)) for v in held.values()}
        if single == 0 or len(values) != 1:
            return answers  # not one factor: the axis is wrong beyond its normalisation
        factors[i] = next(iter(values)) / single
    if prod(factors.values()) != 1:
        return answers
    again = [
        _memo(replace(cases[i], allowance=factors[i]), group, timeout_ms) if i in factors else answers[i]
        for i in range(len(cases))
    ]
    if any(ob.status is not Status.PROVED for ob, _ in again):
        return answers
    return again


def clear_cache() -> None:
    """Forget every remembered answer (benchmarks time cold verdicts; tests patch the solver)."""
    _MEMO.clear()


def _named(text: str, group: Group) -> str:
    return text.replace(PLACEHOLDER.name, group.name)


def _named_values(witness: dict[str, Any], group: Group) -> dict[str, Any]:
    def rename(value: Any) -> Any:
        if isinstance(value, str):
            return _named(value, group)
        if isinstance(value, list):
            return [rename(v) for v in value]
        if isinstance(value, dict):
            return {k: rename(v) for k, v in value.items()}
        return value

    return {k: rename(v) for k, v in witness.items()}


def decide(
    composition: Composition,
    program: StepProgram,
    model: Model,
    *,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    devices: int | None = None,
    rlimit: int = DEFAULT_RUN_RLIMIT,
    query_rlimit: int = DEFAULT_QUERY_RLIMIT,
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
) -> Verdict:
    """Decide the composition rules, gradient integrity and state consistency of ``program``.

    ``devices``: the device count the degrees must multiply to (the ``device_count`` rule),
    when the user gave one. The run is held to a budget (``formal._solver``): ``rlimit`` z3
    resource units in all and ``query_rlimit`` for one query (deterministic: the same input
    gets the same verdict on every run), and, as a safety net, ``timeout_ms`` of wall clock per
    query and ``run_timeout_s`` per run. Whatever a limit cuts short is ``UNKNOWN``.
    """
    budget = Budget(query_rlimit=query_rlimit, run_rlimit=rlimit, timeout_ms=timeout_ms, run_timeout_s=run_timeout_s)
    with budgeted(budget):
        verdict = _decide(composition, program, model, timeout_ms, devices)
    return replace(verdict, units=budget.used, rlimit=budget.run_rlimit)


def _decide(
    composition: Composition, program: StepProgram, model: Model, timeout_ms: int, devices: int | None
) -> Verdict:
    refuse_unmodelled_ops(program, "the z3 verdict")
    obligations: list[Obligation] = []
    violations: list[Violation] = []
    ob, found = _decide_composition(composition, model, devices, timeout_ms)
    obligations.append(ob)
    violations += found
    pl = program.placement
    index = _Index(program)
    for group in pl.groups(P):
        cases = [_integrity_case(index, group, axis) for axis in pl.axes]
        answers = _normalised(cases, [_memo(case, group, timeout_ms) for case in cases], group, timeout_ms)
        for ob, found in answers:
            obligations.append(ob)
            violations += found
    exchange, found = decide_activation_exchange(program, model, timeout_ms)
    obligations += exchange
    violations += found
    labels: set[str] = set()
    for group in pl.groups(P):
        for axis in pl.axes:
            ob, found = _memo(_consistency_case(index, group, axis), group, timeout_ms)
            obligations.append(ob)
            for v in found:  # an axis-free rule (fetch before use) is found along every axis
                if v.rule not in labels:
                    labels.add(v.rule)
                    violations.append(v)
    layout, found = decide_layout(program, timeout_ms)  # pieces across axes: formal/_smt_layout.py
    obligations += layout
    violations += found
    scalar_obligations, found = decide_scalars(program, timeout_ms)  # formal/_smt_scalars.py
    obligations += scalar_obligations
    violations += found
    notes = [
        *_notes(composition, program),
        *framework_notes(setting_for(composition, model, devices), composition.mesh()),
    ]
    return Verdict(tuple(obligations), tuple(violations), tuple(notes))


__all__ = [
    "DEFAULT_QUERY_RLIMIT",
    "DEFAULT_RUN_RLIMIT",
    "DEFAULT_RUN_TIMEOUT_S",
    "DEFAULT_TIMEOUT_MS",
    "MAX_CONSISTENCY_DEVICES",
    "MAX_EXPLICIT_DEVICES",
    "clear_cache",
    "decide",
]
