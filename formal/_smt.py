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
  ops on that axis (all-reduce, reduce-scatter, scale; in program order, up to the optimizer
  step) are executed symbolically over integer contributions, starting from the ``Origin`` the
  program records. The obligation asks z3 for contributions on which some device's gradient
  differs from the single-device one (the mean of the contributions along data axes, their sum
  otherwise: a tied embedding on ``pp``, sequence-parallel norms on ``tp``). Unsat: proved.
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

Execution order (the simulator's, ``formal/_simulator.py``): phases in order, each phase's ops
in program order, gradient ops of the backward after the backward has produced the gradient;
with m > 1 micro-batches, gradient-synchronisation ops done per micro-batch before the ones done
once per step; transient parameter copies freed at the end of the forward and of the backward; a
sharded gradient freed outside its shard after gradient synchronisation (see ``_execution_order``).
A collective along an axis of degree 1 exchanges nothing: it is the identity.

Why per axis. Collectives act on one axis at a time and placements are given per axis, so a
group's gradient is the tensor product of per-axis linear maps over the contributions, and a
chunk's holders along one axis do not depend on how other axes split it; a program is correct
iff it is correct along every axis. Gradient integrity is exact for any degree: devices along an
axis are symmetric, so up to 8 devices are explicit and the others are folded into one aggregate
(their contributions' sum and their values' sum), which every collective maps linearly. State
consistency uses the real degree up to 4; beyond 4 it uses 4 devices (or one per distinct offset,
if more) and relabels the distinct offsets used along the axis to 0, 1, 2, ...: the ops are
rotation-equivariant (device i and chunk k only meet through ``(i - offset) mod d``), so a read
is stale or misaligned iff the partitions it crosses have different offsets, which relabelling
preserves. (A program whose correctness hinges on sums of offsets, such as two gathers whose
rotations cancel, is outside this argument; no derived program has one.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, cast

import sympy as sp
import z3

from formal._activation_flow import decide_activation_exchange
from formal._exact import exact_fraction, exact_int
from formal._model import Model
from formal._placement import Entry
from formal._program import Op, Origin, StepProgram
from formal._rules import Provenance, Rule, applicable, framework_notes, setting_for
from formal._solver import (
    DEFAULT_QUERY_RLIMIT,
    DEFAULT_RUN_RLIMIT,
    DEFAULT_RUN_TIMEOUT_S,
    DEFAULT_TIMEOUT_MS,
    Budget,
    budgeted,
    current_budget,
)
from formal._solver import Answer as _Answer
from formal._solver import Solver as _Solver
from formal._strategies import Composition
from formal._verdict import Condition, Obligation, Status, Verdict, Violation
from formal._vocab import Axis, Group, Mode, OpKind, Phase, Reduce, State
from formal.errors import InexactError, SolverError

P, O, G = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS  # noqa: E741 (the paper's P/O/G)
PLACEHOLDER = Group("\u00a7")  # "§": the group of a case, renamed to the real group in the verdict

MAX_EXPLICIT_DEVICES = 8  # gradient integrity: devices modelled one by one (module docstring)
MAX_CONSISTENCY_DEVICES = 4  # state consistency: devices and chunks modelled (module docstring)

DEEPSPEED_PP_NOTE = (
    "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism (DeepSpeed issues #1629, #4164); "
    "torchtitan allows FSDP with PP. This is a cost, not a correctness, rule."
)


# --------------------------------------------------------------------------- the z3 wrapper


def _number(value: z3.ExprRef) -> int | str:
    """A z3 numeral as an int, or an exact fraction ``"3/2"``."""
    if z3.is_int_value(value):
        return int(value.as_long())
    if z3.is_rational_value(value):
        frac = Fraction(int(value.numerator_as_long()), int(value.denominator_as_long()))
        return int(frac) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"
    if z3.is_algebraic_value(value):
        return str(value.approx(12))
    return str(value)


def _real(x: Fraction | int) -> z3.ArithRef:
    f = Fraction(x)
    return z3.RealVal(f"{f.numerator}/{f.denominator}")


def _fraction(x: sp.Expr | None) -> Fraction:
    if x is None:
        return Fraction(1)
    try:
        return exact_fraction(x)
    except InexactError as err:
        raise SolverError(f"scale {x}: z3 needs a rational constant") from err


def _int_degree(pl_degree: sp.Expr) -> int:
    try:
        return exact_int(pl_degree)
    except InexactError as err:
        raise SolverError(f"degree {pl_degree}: decide needs a concrete placement") from err


def _status(answer: _Answer, *, violated_when: str) -> Status:
    if answer.result == "unknown":
        return Status.UNKNOWN
    return Status.REFUTED if answer.result == violated_when else Status.PROVED


# --------------------------------------------------------------------------- composition rules


class _RuleTerms:
    """``formal._rules.Terms`` as z3 terms: degrees and sizes are integer variables pinned by
    tracked facts (``value[heads]``), so that an unsat core names the sizes a broken rule read."""

    def __init__(self, composition: Composition, solver: _Solver) -> None:
        self.facts: list[z3.BoolRef] = []
        self._solver = solver
        self._mesh = composition.mesh()
        self._degree = {axis: self.size(axis.value, d) for axis, d in self._mesh.items()}
        self._micro_batches = composition.options.micro_batches

    def _pinned(self, var: Any, name: str, value: int | bool) -> Any:
        self.facts.append(self._solver.track(f"value[{name}]", var == value))
        return var

    def size(self, name: str, value: int) -> z3.ArithRef:
        return cast(z3.ArithRef, self._pinned(z3.Int(name), name, value))

    def flag(self, name: str, value: bool) -> z3.BoolRef:
        return cast(z3.BoolRef, self._pinned(z3.Bool(name), name, value))

    def degree(self, axis: Axis) -> z3.ArithRef | int:
        return self._degree.get(axis, 1)

    def present(self, axis: Axis) -> z3.BoolRef:
        return self.flag(f"has_{axis.value}", axis in self._mesh)

    def implies(self, a: Any, b: Any) -> z3.BoolRef:
        return z3.Implies(a, b)

    @property
    def micro_batches(self) -> z3.ArithRef:
        return self.size("micro_batches", self._micro_batches)


def _composition_rules(composition: Composition, model: Model, devices: int | None,
                       solver: _Solver) -> tuple[list[z3.BoolRef], list[tuple[z3.BoolRef, Rule]]]:
    """Tracked facts (degrees, sizes) and the correctness rules of ``formal._rules`` that apply,
    tracked under their names (orthogonality first, in the composition's axis order)."""
    terms = _RuleTerms(composition, solver)
    setting = setting_for(composition, model, devices)
    order = {axis: i for i, axis in enumerate(composition.mesh())}
    rules = sorted(applicable(setting, Provenance.CORRECTNESS),
                   key=lambda r: (0, order[r.axis]) if r.name.startswith("orthogonality[") and r.axis else (1, 0))
    tracked = [(solver.track(r.name, r.holds(terms, setting)), r) for r in rules]
    return terms.facts, tracked


def _decide_composition(composition: Composition, model: Model, devices: int | None,
                        timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    solver = _Solver(timeout_ms)
    facts, rules = _composition_rules(composition, model, devices, solver)
    mesh, setting = composition.mesh(), setting_for(composition, model, devices)
    by_literal = {lit.decl().name(): (lit, rule) for lit, rule in rules}
    remaining = [lit for lit, _ in rules]
    violations: list[Violation] = []
    cores: list[str] = []
    seconds = 0.0
    status = Status.PROVED
    reason = ""
    while True:
        answer = solver.check(facts + remaining)
        seconds += answer.seconds
        if answer.result == "sat":
            break
        if answer.result == "unknown":
            status, reason = Status.UNKNOWN, answer.reason
            break
        in_core = [by_literal[name][0] for name in answer.core if name in by_literal]
        broken = []
        for lit in in_core:  # a core need not be minimal: each rule of it is re-checked alone
            alone = solver.check([*facts, lit])
            seconds += alone.seconds
            if alone.result == "unsat":
                broken.append(lit)
        broken = broken or in_core
        if not broken:  # the facts alone conflict: impossible for concrete values
            raise SolverError(f"composition facts are inconsistent: {answer.core}")
        cores.extend(answer.core)
        for lit in broken:
            rule = by_literal[lit.decl().name()][1]
            violations.append(Violation(rule.name, Condition.COMPOSITION, None, None,
                                        rule.axis.value if rule.axis is not None else None,
                                        rule.explain(mesh, setting),
                                        {**rule.witness(mesh, setting), "core": list(answer.core)}))
            remaining.remove(lit)
        status = Status.REFUTED
    if violations and status is Status.UNKNOWN:
        status = Status.REFUTED
    return Obligation("composition_rules", Condition.COMPOSITION, status, reason, seconds,
                      tuple(dict.fromkeys(cores))), violations


# --------------------------------------------------------------------------- gradient integrity


def _scale_home(axes: Sequence[Axis]) -> Axis:
    """The axis an axis-free SCALE op is charged to: the first data axis, else the first axis."""
    return next((a for a in axes if a.splits_data), axes[0])


PHASE_ORDER: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.GRAD_SYNC, Phase.OPTIMIZER, Phase.REFRESH)


def _execution_order(ops: Sequence[Op], micro_batches: object = 1) -> list[Op]:
    """The order a step runs a program's ops in (the simulator's, ``formal/_simulator.py``).

    Phases run in ``PHASE_ORDER``, each phase's ops in program order, except that gradient ops
    of the backward phase run after the backward computation has produced the gradient, and
    that, with ``m > 1`` micro-batches, gradient-synchronisation ops done once per micro-batch
    (``count == m``) run with each micro-batch, before the ones done once per step.
    """
    rank = {phase: i for i, phase in enumerate(PHASE_ORDER)}
    m = micro_batches if isinstance(micro_batches, int) and micro_batches > 1 else None

    def per_micro_batch(op: Op) -> bool:
        return m is not None and op.phase is Phase.GRAD_SYNC and op.count == m

    def key(item: tuple[int, Op]) -> tuple[int, int, int]:
        i, op = item
        if op.phase is Phase.GRAD_SYNC:
            return rank[op.phase], int(not per_micro_batch(op)), i
        return rank[op.phase], int(op.phase is Phase.BACKWARD and op.state is G), i

    return [op for _, op in sorted(enumerate(ops), key=key)]


class _Index:
    """A program's placement and ops looked up by group once (not rescanned per obligation)."""

    def __init__(self, program: StepProgram) -> None:
        pl = program.placement
        self.placement = pl
        self.modes = {key: dict(row) for key, row in pl.modes}
        self.local = dict(pl.local)
        self.origins = dict(program.origins)
        self.degrees = {axis: _int_degree(d) for axis, d in pl.mesh}
        self.home = _scale_home(pl.axes)
        self.ops: dict[Group, list[Op]] = {}  # group -> its ops in execution order, group erased
        for op in _execution_order(program.ops, pl.options.micro_batches):
            self.ops.setdefault(op.group, []).append(_erased(op))

    def entry(self, state: State, group: Group, axis: Axis) -> Entry:
        return self.modes.get((state, group), {}).get(axis, Entry(Mode.REPLICATED))


def _reads_host_gradient(index: _Index, group: Group) -> bool:
    """The optimizer reads ``group``'s gradient from the host (ZeRO-Offload: G or O offloaded)."""
    return Mode.OFFLOADED in (index.local.get((G, group)), index.local.get((O, group)))


def _gradient_ops(index: _Index, group: Group, axis: Axis, host: bool = False) -> list[Op]:
    """G ops of ``group`` on ``axis`` (group erased) that run before its optimizer step reads G.

    Gradient ops of the forward phase run before the backward produces the gradient: they act
    on an empty buffer and do not count. With ``host`` (the optimizer reads a host copy of the
    gradient) the device-to-host copies of G, in any phase, are kept too: they are axis-free
    and the host copy is what the optimizer reads.
    """
    home = index.home
    out: list[Op] = []
    for op in index.ops.get(group, []):
        if op.kind is OpKind.OPTIMIZER_STEP:
            break
        if op.state is not G:
            continue
        if op.kind is OpKind.DEVICE_TO_HOST:
            if host:
                out.append(op)
            continue
        if op.phase is Phase.FORWARD:
            continue
        if op.kind.is_reduction and op.axis is axis:
            out.append(op)
        elif op.kind is OpKind.SCALE and (op.axis is axis or (op.axis is None and axis is home)):
            out.append(op)
    return out


def _op_label(n: int, op: Op) -> str:
    where = op.axis.value if op.axis is not None else "all"
    if op.kind.is_transfer:
        return f"op{n}:{op.kind.value}({op.state.value}.{op.group.name}, {op.phase.value})"
    extra = f", {(op.reduce or Reduce.SUM).value}" if op.kind.is_reduction else f", x{op.scale}"
    return f"op{n}:{op.kind.value}({op.state.value}.{op.group.name}, {where}{extra})"


@dataclass(frozen=True)
class _IntegrityCase:
    """All one gradient-integrity obligation depends on, with the group erased (``PLACEHOLDER``)."""

    axis: Axis
    degree: int
    origin: Origin
    sharded: bool
    ops: tuple[Op, ...]
    host: bool = False  # the optimizer reads a host copy of the gradient (made by DEVICE_TO_HOST ops)


def _integrity_case(index: _Index, group: Group, axis: Axis) -> _IntegrityCase:
    degree = index.degrees[axis]
    if axis is Axis.PP and group in index.placement.tied:
        degree = min(degree, 2)  # a tied embedding lives on the first and the last stage
    host = _reads_host_gradient(index, group)
    return _IntegrityCase(axis, degree, index.origins.get((group, axis), Origin.COMPLETE),
                          index.entry(G, group, axis).mode.is_sharded, tuple(_gradient_ops(index, group, axis, host)),
                          host)


def _decide_integrity(case: _IntegrityCase, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    axis, degree, origin, sharded = case.axis, case.degree, case.origin, case.sharded
    group = PLACEHOLDER
    name = f"G.{group.name}, {axis.value}"
    k = min(degree, MAX_EXPLICIT_DEVICES)
    rest = degree - k  # devices folded into one aggregate
    solver = _Solver(timeout_ms)
    contributions = [z3.Int(f"c{i}") for i in range(k)]
    rest_c = z3.Int("c_rest") if rest else z3.IntVal(0)
    total_c = z3.ToReal(z3.Sum(*contributions) + rest_c) if k > 1 or rest else z3.ToReal(contributions[0])
    # A gradient sharded along the axis is read by its one holder (device 0 by symmetry).
    owners = range(1) if sharded else range(k)
    values = [z3.Real(f"v0_{i}") for i in range(k)]
    rest_v = z3.Real("v0_rest")
    match origin:
        case Origin.PARTIAL:
            reference = total_c / degree if axis.splits_data else total_c
            init = [values[i] == z3.ToReal(contributions[i]) for i in range(k)] + [rest_v == z3.ToReal(rest_c)]
        case Origin.SUMMED:
            reference = total_c / degree if axis.splits_data else total_c
            init = [v == total_c for v in values] + [rest_v == rest * total_c]
        case Origin.COMPLETE:
            reference = z3.ToReal(z3.Int("r"))
            if sharded:
                # Other devices hold other elements (their own shards): unrelated values.
                others = [z3.ToReal(z3.Int(f"u{i}")) for i in range(1, k)]
                init = [values[0] == reference] + [values[i] == others[i - 1] for i in range(1, k)]
                init.append(rest_v == z3.ToReal(z3.Int("u_rest")))
            else:
                init = [v == reference for v in values] + [rest_v == rest * reference]
        case _:
            raise AssertionError(origin)
    solver.track(f"origin[{name}]={origin.value}", z3.And(*init))
    ops = list(case.ops)
    late: list[Op] = []  # reductions after the gradient was cut down to its shard
    trimmed = False
    host: list[z3.ArithRef] | None = None  # the host copy of the gradient, once one is made
    copied = -1  # index in ops of the last device-to-host copy
    for n, op in enumerate(ops, start=1):
        if op.kind is OpKind.DEVICE_TO_HOST:
            # A copy of the device value at the time of the transfer: later device-side
            # reductions do not reach it. Before the backward has produced the gradient (a copy
            # in the forward or the backward phase) the buffer holds none of it.
            host = [z3.Real(f"h{n}_{i}") for i in range(k)]
            incomplete = op.phase in (Phase.FORWARD, Phase.BACKWARD)
            solver.track(_op_label(n, op), z3.And(*[host[i] == (0 if incomplete else values[i]) for i in range(k)]))
            copied = n - 1
            continue
        if sharded and not trimmed and op.phase in (Phase.OPTIMIZER, Phase.REFRESH):
            # After gradient synchronisation a sharded gradient is freed outside each device's
            # shard: only the holder keeps this element (whatever it has reduced so far).
            trimmed = True
            kept = [z3.Real(f"t{n}_{i}") for i in range(k)]
            kept_rest = z3.Real(f"t{n}_rest")
            solver.track(f"free_outside_shard[{name}]",
                         z3.And(kept[0] == values[0], *[v == 0 for v in kept[1:]], kept_rest == 0))
            values, rest_v = kept, kept_rest
        if trimmed and op.kind.is_reduction:
            late.append(op)
        new = [z3.Real(f"v{n}_{i}") for i in range(k)]
        new_rest = z3.Real(f"v{n}_rest")
        match op.kind:
            case OpKind.ALL_REDUCE | OpKind.REDUCE_SCATTER:
                combined = z3.Sum(*values) + rest_v if k > 1 or rest else values[0] + rest_v
                if op.reduce is Reduce.MEAN:
                    combined = combined / degree
                step = [v == combined for v in new] + [new_rest == rest * combined]
            case OpKind.SCALE:
                factor = _real(_fraction(op.scale))
                step = [new[i] == values[i] * factor for i in range(k)] + [new_rest == rest_v * factor]
            case _:
                raise AssertionError(op.kind)
        solver.track(_op_label(n, op), z3.And(*step))
        values, rest_v = new, new_rest
    read = host if case.host and host is not None else values  # what the optimizer reads
    solver.track(f"integrity[{name}]", z3.Or(*[read[i] != reference for i in owners]))
    answer = solver.check()
    status = _status(answer, violated_when="sat")
    obligation = Obligation(f"gradient_integrity[{name}]", Condition.GRADIENT_INTEGRITY, status,
                            answer.reason, answer.seconds, answer.core)
    if answer.model is None:
        return obligation, []
    model = answer.model
    ref_value = _number(model.eval(reference, model_completion=True))
    held = {str(i): _number(model.eval(read[i], model_completion=True)) for i in owners}
    rule, defect = _classify_integrity(origin, ops, axis, degree, late,
                                       copied if case.host and host is not None else None)
    witness: dict[str, Any] = {
        "defect": defect, "origin": origin.value, "degree": degree, "modelled_devices": k,
        "contributions": {str(i): _number(model.eval(contributions[i], model_completion=True)) for i in range(k)},
        "devices": held, "single_device": ref_value,
        "disagreeing_devices": [i for i in held if held[i] != ref_value],
        "ops": [str(op) for op in ops],
    }
    if case.host:
        witness["read_from"] = "host" if host is not None else "device"
    if rest:
        witness["contributions"]["rest"] = _number(model.eval(rest_c, model_completion=True))
    if origin is Origin.COMPLETE:
        witness["contributions"] = {"complete": ref_value}
    first_bad = witness["disagreeing_devices"][0] if witness["disagreeing_devices"] else "0"
    holder = "the host copy of device" if case.host and host is not None else "device"
    explanation = (f"G.{group.name} along {axis.value}: {defect}; {holder} {first_bad} holds "
                   f"{held.get(first_bad)} where single-device training has {ref_value}")
    return obligation, [Violation(f"{rule}[{name}]", Condition.GRADIENT_INTEGRITY, G.value, group.name,
                                  axis.value, explanation, witness)]


def _classify_integrity(origin: Origin, ops: list[Op], axis: Axis, degree: int,
                        late: list[Op], copied: int | None = None) -> tuple[str, str]:
    """The rule a wrong gradient breaks. ``copied``: the index of the device-to-host copy the
    optimizer reads (only the ops before it reach the host)."""
    if copied is not None:
        copy = ops[copied]
        if copy.phase in (Phase.FORWARD, Phase.BACKWARD):
            return ("transfer_after_reduction", f"the gradient is copied to the host in the {copy.phase.value} "
                    "phase, before the backward has produced it: the host optimizer reads an incomplete gradient")
        after = [op for op in ops[copied + 1:] if op.kind.is_reduction or op.kind is OpKind.SCALE]
        if after:
            what = f"{after[0].kind.value}" + (f" ({after[0].reduce.value})" if after[0].reduce else "")
            return ("transfer_after_reduction", f"the gradient is copied to the host before its {what} along "
                    f"{axis.value}: the host optimizer reads the gradient as it was at the copy, and the "
                    "later device-side op does not reach it")
        ops = ops[:copied]
        late = [op for op in late if op in ops]
    ops = [op for op in ops if not op.kind.is_transfer]
    reductions = [op for op in ops if op.kind.is_reduction]
    if late:
        return ("reduction_closure", f"reduction after gradient synchronisation ({late[0].phase.value} phase): "
                f"the gradient sharded along {axis.value} was already freed outside each device's shard")
    if origin is Origin.PARTIAL and not reductions:
        return ("reduction_closure", f"missing reduction: each of the {degree} devices holds a partial "
                f"sum along {axis.value} and nothing reduces it")
    if origin is not Origin.PARTIAL and reductions:
        return ("reduction_closure", f"reduction along {axis.value}, whose contributions were already "
                f"{origin.value} after backward")
    if len(reductions) > 1:
        return ("reduction_closure", f"duplicated reduction: reduced {len(reductions)} times along {axis.value}")
    want = "mean" if axis.splits_data else "sum"
    return ("normalisation", f"normalisation: the contributions along {axis.value} must be combined by their "
            f"{want} exactly once, and the program's reductions and scales do not give that")


# --------------------------------------------------------------------------- state consistency


_SHAPES: dict[tuple[Any, ...], int] = {}  # term shapes seen so far, interned as ints


@dataclass(frozen=True)
class _T:
    """A value in the consistency model: an atom or an update of the (p, o, g) it read.

    Heads: ``P0``/``O0`` initial chunk values, ``g`` a step's gradient of a chunk, ``junk``
    whatever memory holds where nothing was written, ``upd_p``/``upd_o`` the element-wise
    optimizer (uninterpreted: any optimizer).
    """

    head: str
    chunk: int = -1
    tag: int = 0
    args: tuple[_T, ...] = ()
    digest: int = field(default=0, init=False, repr=False, compare=False)
    shape: int = field(default=0, init=False, repr=False, compare=False)
    leaves: tuple[tuple[str, int], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Terms nest and are compared often: hash once. ``shape`` (the term with its chunks and
        # junk tags erased, interned as an int) and ``leaves`` (its chunks and junk tags in
        # order) let checks that differ only by a renaming of chunks be recognised cheaply.
        object.__setattr__(self, "digest", hash((self.head, self.chunk, self.tag, self.args)))
        if self.args:
            shape: tuple[Any, ...] = (self.head, tuple(a.shape for a in self.args))
            leaves = tuple(leaf for a in self.args for leaf in a.leaves)
        else:
            shape = (self.head, self.tag if self.head == "g" else 0)
            leaves = (("junk", self.tag) if self.head == "junk" else ("chunk", self.chunk),)
        object.__setattr__(self, "shape", _SHAPES.setdefault(shape, len(_SHAPES)))
        object.__setattr__(self, "leaves", leaves)

    def __hash__(self) -> int:
        return self.digest

    def __str__(self) -> str:
        match self.head:
            case "P0" | "O0":
                return f"{self.head}[{self.chunk}]"
            case "g":
                return f"g{self.tag}[{self.chunk}]"
            case "junk":
                return f"junk{self.tag}"
            case "upd_p" | "upd_o":
                return f"{self.head}({', '.join(map(str, self.args))})"
            case _:
                raise AssertionError(self.head)

    def subterms(self) -> Iterator[_T]:
        yield self
        for a in self.args:
            yield from a.subterms()

    def chunks(self) -> frozenset[int]:
        return frozenset(t.chunk for t in self.subterms() if t.head in ("P0", "O0", "g"))

    @property
    def updates(self) -> int:
        return 0 if not self.args else 1 + max(a.updates for a in self.args)


class _Z3Terms:
    """Translation of ``_T`` values into z3 (Reals and two uninterpreted functions)."""

    def __init__(self) -> None:
        real = z3.RealSort()
        self.upd = {"upd_p": z3.Function("upd_p", real, real, real, real),
                    "upd_o": z3.Function("upd_o", real, real, real, real)}
        self.cache: dict[_T, z3.ArithRef] = {}

    def __call__(self, t: _T) -> z3.ArithRef:
        hit = self.cache.get(t)
        if hit is not None:
            return hit
        match t.head:
            case "upd_p" | "upd_o":
                out = self.upd[t.head](*[self(a) for a in t.args])
            case "P0" | "O0" | "g" | "junk":
                out = z3.Real(str(t))
            case _:
                raise AssertionError(t.head)
        self.cache[t] = out
        return out


@dataclass(frozen=True)
class _Check:
    """One read (or one coverage condition) to compare with single-device training."""

    state: State
    rule: str  # the rule its failure breaks, e.g. "refresh"
    label: str  # the tracked name, e.g. "refresh[P.attention, dp]"
    target: str  # what is read, e.g. "[P.attention, dp]" (the label of another rule it may break)
    values: tuple[_T, ...]  # a read: one value; coverage: every holder's value (none: lost)
    expected: _T
    where: tuple[tuple[str, Any], ...]


Holder = tuple[bool, int, State]  # (on the host, device along the axis, state)


@dataclass(frozen=True)
class _ConsistencyCase:
    """All one state-consistency obligation depends on, with the group erased (``PLACEHOLDER``)."""

    axis: Axis
    degree: int
    entries: tuple[Entry, Entry, Entry]  # P, O, G along the axis
    local: tuple[Mode | None, Mode | None, Mode | None]  # P, O, G axis-free modes
    ops: tuple[Op, ...]
    computed_sharded: bool  # the computation itself is split along the axis (TP matrices, PP stages)
    held: bool  # parameters gathered once and held through the backward, along any axis (FSDP SGO)
    held_here: bool  # ... along this axis: what was gathered along it stays (FSDP SGO; hpZ across nodes)


def _consistency_case(index: _Index, group: Group, axis: Axis) -> _ConsistencyCase:
    return _ConsistencyCase(
        axis, index.degrees[axis],
        (index.entry(P, group, axis), index.entry(O, group, axis), index.entry(G, group, axis)),
        (index.local.get((P, group)), index.local.get((O, group)), index.local.get((G, group))),
        tuple(op for op in index.ops.get(group, []) if op.state in (P, O, G) and op.axis in (None, axis)),
        index.placement.computes_sharded(axis, group),
        any(index.entry(P, group, a).keep_gathered for a in index.placement.axes),
        index.entry(P, group, axis).keep_gathered)


@dataclass
class _AxisRun:
    """Two steps of a program along one axis for one group: holdings, reads, coverage."""

    case: _ConsistencyCase
    checks: list[_Check] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.group = PLACEHOLDER
        self.axis = self.case.axis
        self.degree = self.case.degree
        self.entry = dict(zip((P, O, G), self.case.entries, strict=True))
        self.local = dict(zip((P, O, G), self.case.local, strict=True))
        self.ops = list(self.case.ops)
        raw = sorted({e.offset % self.degree for e in self.entry.values()}
                     | {op.offset % self.degree for op in self.ops} | {0})
        if self.degree <= MAX_CONSISTENCY_DEVICES:
            self.d = self.degree
            self.offsets = {o: o for o in raw}
        else:
            self.d = max(MAX_CONSISTENCY_DEVICES, len(raw))
            self.offsets = {o: i for i, o in enumerate(raw)}
        self.hold: dict[Holder, dict[int, _T]] = {
            (host, i, st): {} for host in (False, True) for i in range(self.d) for st in (P, O, G)}
        self.ref: dict[State, list[_T]] = {st: [_T(f"{st.value}0", k) for k in range(self.d)] for st in (P, O)}
        self.junk = 0
        self.names = {"P": f"P.{self.group.name}, {self.axis.value}", "O": f"O.{self.group.name}, {self.axis.value}",
                      "G": f"G.{self.group.name}, {self.axis.value}"}

    # -- partitions and holdings
    def off(self, offset: int) -> int:
        return self.offsets.get(offset % self.degree, 0)

    def partition(self, entry: Entry, device: int) -> list[int]:
        match entry.mode:
            case Mode.REPLICATED | Mode.OFFLOADED:
                return list(range(self.d))
            case Mode.SHARDED | Mode.SHARDED_GATHER:
                return [(device - self.off(entry.offset)) % self.d]
            case Mode.MATERIALIZED:
                return []
            case _:
                raise AssertionError(entry.mode)

    def on_host(self, state: State) -> bool:
        return self.local[state] is Mode.OFFLOADED or self.entry[state].mode is Mode.OFFLOADED

    def fresh_junk(self) -> _T:
        self.junk += 1
        return _T("junk", tag=self.junk)

    def initialise(self) -> None:
        for st in (P, O):
            host = self.on_host(st)
            for i in range(self.d):
                for k in self.partition(self.entry[st], i):
                    self.hold[(host, i, st)][k] = self.ref[st][k]
        if self.on_host(O) and not self.on_host(P):
            # ZeRO-Offload: the fp32 master parameters live with the optimizer state on the host.
            for i in range(self.d):
                for k in self.partition(self.entry[O], i):
                    self.hold[(True, i, P)][k] = self.ref[P][k]

    def contribute(self, holder: Holder, chunk: int) -> _T:
        """What a holder supplies for ``chunk``: its copy, else its one shard (misaligned), else junk."""
        held = self.hold[holder]
        if chunk in held:
            return held[chunk]
        if len(held) == 1:
            return next(iter(held.values()))
        return self.fresh_junk()

    # -- checks
    def check(self, state: State, rule: str, values: tuple[_T, ...], expected: _T, **where: Any) -> None:
        if rule in ("alignment_og", "alignment_op"):
            label = f"alignment[O/{'G' if rule == 'alignment_og' else 'P'}.{self.group.name}, {self.axis.value}]"
            rule = "alignment"
        elif rule == "fetch_before_use":
            label = f"fetch_before_use[P.{self.group.name}]"
        else:
            label = f"{rule}[{self.names[state.value]}]"
        self.checks.append(_Check(state, rule, label, f"[{self.names[state.value]}]", values, expected,
                                  tuple(where.items())))

    def compute_rule(self, full: bool) -> str:
        entry = self.entry[P]
        if self.local[P] is Mode.OFFLOADED:
            return "fetch_before_use"
        if entry.mode.is_sharded and full:
            return "gather_before_use"
        if entry.mode is Mode.REPLICATED and (self.entry[O].mode.is_sharded or self.on_host(O)):
            return "refresh"
        return "agreement"

    # -- ops
    def run(self) -> None:
        self.initialise()
        for step in (0, 1):
            gradient = [_T("g", k, step) for k in range(self.d)]
            updated = produced = trimmed = False
            phase: Phase | None = None
            for n, op in enumerate(self.ops):
                where = {"step": step, "op": n, "phase": op.phase.value, "kind": op.kind.value}
                if phase in (Phase.FORWARD, Phase.BACKWARD) and op.phase is not phase:
                    self.free_parameters(after_backward=phase is Phase.BACKWARD)
                phase = op.phase
                after_backward = PHASE_ORDER.index(op.phase) > PHASE_ORDER.index(Phase.BACKWARD)
                if not produced and (after_backward or (op.phase is Phase.BACKWARD and op.state is G)):
                    self.produce(gradient)  # the backward ran without a listed read of this group
                    produced = True
                if not trimmed and op.phase in (Phase.OPTIMIZER, Phase.REFRESH):
                    self.free_outside_shard()
                    trimmed = True
                if op.kind.is_collective and self.degree == 1:
                    continue  # one device along the axis: a collective exchanges nothing (the identity)
                match op.kind:
                    case OpKind.ALL_GATHER:
                        self.gather(op)
                    case OpKind.REDUCE_SCATTER:
                        self.reduce_scatter(op)
                    case OpKind.ALL_REDUCE:
                        self.all_reduce(op)
                    case OpKind.BROADCAST:
                        for i in range(1, self.d):
                            self.hold[(False, i, op.state)] = dict(self.hold[(False, 0, op.state)])
                    case OpKind.HOST_TO_DEVICE:
                        for i in range(self.d):
                            self.hold[(False, i, op.state)].update(self.hold[(True, i, op.state)])
                    case OpKind.DEVICE_TO_HOST:
                        for i in range(self.d):
                            self.hold[(True, i, op.state)].update(self.hold[(False, i, op.state)])
                    case OpKind.COMPUTE:
                        self.compute(op, gradient, where)
                        produced = produced or op.phase is Phase.BACKWARD
                    case OpKind.OPTIMIZER_STEP:
                        self.optimizer_step(op, gradient, where, update_reference=not updated)
                        updated = True
                    case OpKind.SCALE | OpKind.SEND_RECV | OpKind.ALL_TO_ALL:
                        pass  # values, not placements: gradient integrity judges them
                    case _:
                        raise AssertionError(op.kind)
            if phase in (Phase.FORWARD, Phase.BACKWARD):
                self.free_parameters(after_backward=phase is Phase.BACKWARD)
            if not updated:
                self.update_reference(gradient)
            for st in (P, O):
                for k in range(self.d):
                    holders = tuple(dict.fromkeys(h[k] for (_, _, s), h in self.hold.items() if s is st and k in h))
                    self.check(st, "coverage", holders, self.ref[st][k], step=step, op=len(self.ops), chunk=k,
                               at="end of step")
            for key in self.hold:
                if key[2] is G:
                    self.hold[key] = {}  # gradients live for one step

    def needs_all(self, full: bool) -> bool:
        return full or self.entry[P].mode in (Mode.REPLICATED, Mode.OFFLOADED)

    def produce(self, gradient: list[_T]) -> None:
        """The backward's gradient on every device: the chunks its computation covers."""
        full = self.needs_all(not self.case.computed_sharded)
        for i in range(self.d):
            self.hold[(False, i, G)] = {k: gradient[k] for k in (range(self.d) if full else [i])}

    def free_outside_shard(self) -> None:
        """After gradient synchronisation a sharded gradient is kept only on its shard."""
        if not self.entry[G].mode.is_sharded:
            return
        for i in range(self.d):
            own = self.partition(self.entry[G], i)
            self.hold[(False, i, G)] = {k: v for k, v in self.hold[(False, i, G)].items() if k in own}

    def gather(self, op: Op) -> None:
        o = self.off(op.offset)
        values = {k: self.contribute((False, (k + o) % self.d, op.state), k) for k in range(self.d)}
        for i in range(self.d):
            self.hold[(False, i, op.state)] = dict(values)

    def combined(self, state: State, chunk: int) -> _T:
        """A reduction's result for a chunk: the gradient if every device holds it, else junk."""
        held = [self.hold[(False, i, state)].get(chunk) for i in range(self.d)]
        first = held[0]
        if state is G and first is not None and all(h == first for h in held):
            return first
        return self.fresh_junk()

    def reduce_scatter(self, op: Op) -> None:
        o = self.off(op.offset)
        mine = {i: (i - o) % self.d for i in range(self.d)}
        values = {i: self.combined(op.state, mine[i]) for i in range(self.d)}
        for i in range(self.d):
            self.hold[(False, i, op.state)] = {mine[i]: values[i]}

    def all_reduce(self, op: Op) -> None:
        chunks = {k for i in range(self.d) for k in self.hold[(False, i, op.state)]}
        values = {k: self.combined(op.state, k) for k in chunks}
        for i in range(self.d):
            held = self.hold[(False, i, op.state)]
            for k in list(held):
                held[k] = values[k]

    def compute(self, op: Op, gradient: list[_T], where: dict[str, Any]) -> None:
        full = self.needs_all(self.axis in op.full)
        rule = self.compute_rule(full)
        for i in range(self.d):
            held = self.hold[(False, i, P)]
            needed = list(range(self.d)) if full else [i]  # a sharded computation uses shard i
            for k in needed:
                if k in held:
                    value = held[k]
                elif not full and len(held) == 1:
                    value = next(iter(held.values()))
                else:
                    value = self.fresh_junk()
                self.check(P, rule, (value,), self.ref[P][k], **where, device=i, chunk=k, holder="device")
            if op.phase is Phase.BACKWARD:
                self.hold[(False, i, G)] = {k: gradient[k] for k in needed}

    def free_parameters(self, after_backward: bool) -> None:
        """At the end of the forward and of the backward: transient copies are freed (gathered
        shards of others, fetched offloaded parameters), unless held through the backward."""
        entry = self.entry[P]
        # Held through the backward: what was gathered along a holding axis stays; along the other
        # axes the device keeps its shard (ZeRO++ hpZ holds across nodes and frees within the node,
        # whose shards the backward gathers again), its fetched shard too when P is offloaded.
        if not after_backward and self.case.held_here:
            return
        for i in range(self.d):
            if self.local[P] is Mode.OFFLOADED and (after_backward or not self.case.held):
                self.hold[(False, i, P)] = {}
            else:
                own = self.partition(entry, i)
                self.hold[(False, i, P)] = {k: v for k, v in self.hold[(False, i, P)].items() if k in own}

    def read_for_update(self, updater: Holder, chunk: int) -> _T:
        """What an update reads for ``chunk``: its copy, else its one shard (misaligned), else junk."""
        host, device, state = updater
        held = self.hold[updater]
        if chunk in held:
            return held[chunk]
        if not host and chunk in self.hold[(True, device, state)]:
            return self.hold[(True, device, state)][chunk]  # offloaded parameters, read in place
        if len(held) == 1:
            return next(iter(held.values()))
        return self.fresh_junk()

    def optimizer_step(self, op: Op, gradient: list[_T], where: dict[str, Any], *, update_reference: bool) -> None:
        """Each holder updates the chunks of the step's partition (``op.offset`` along an axis
        where the optimizer state is sharded, as the simulator does), reading P, O and G there."""
        host = self.on_host(O)
        entry = self.entry[O]
        partition = Entry(entry.mode, op.offset) if entry.mode.is_sharded else entry
        writes: list[tuple[Holder, int, _T]] = []
        for i in range(self.d):
            at = "host" if host else "device"
            for k in self.partition(partition, i):
                o_value = self.read_for_update((host, i, O), k)
                g_value = self.read_for_update((host, i, G), k)
                p_value = self.read_for_update((host, i, P), k)
                ctx = {**where, "device": i, "chunk": k, "holder": at}
                self.check(O, "agreement", (o_value,), self.ref[O][k], **ctx)
                self.check(G, "alignment_og", (g_value,), gradient[k], **ctx)
                self.check(P, "alignment_op", (p_value,), self.ref[P][k], **ctx)
                args = (p_value, o_value, g_value)
                for state, head in ((O, "upd_o"), (P, "upd_p")):
                    target = self.write_target((host, i, state), k)
                    if target is not None:
                        writes.append((target[0], target[1], _T(head, k, args=args)))
        if update_reference:
            self.update_reference(gradient)
        for holder, k, value in writes:
            self.hold[holder][k] = value

    def write_target(self, updater: Holder, chunk: int) -> tuple[Holder, int] | None:
        host, device, state = updater
        if chunk in self.hold[updater]:
            return updater, chunk
        if not host and chunk in self.hold[(True, device, state)]:
            return (True, device, state), chunk
        if len(self.hold[updater]) == 1:
            return updater, next(iter(self.hold[updater]))  # misaligned: overwrites another chunk
        return None

    def update_reference(self, gradient: list[_T]) -> None:
        for k in range(self.d):
            args = (self.ref[P][k], self.ref[O][k], gradient[k])
            self.ref[P][k] = _T("upd_p", k, args=args)
            self.ref[O][k] = _T("upd_o", k, args=args)


def _classify_read(check: _Check, value: _T) -> tuple[str, str]:
    """The rule a differing read breaks (and its label), from the provenance of the value."""
    target = check.target
    if check.rule == "coverage":
        return check.rule, check.label
    if value.head == "junk":  # nothing was written where the read looked
        if check.rule in ("gather_before_use", "fetch_before_use", "alignment"):
            return check.rule, check.label
        return "coverage", f"coverage{target}"
    if value.chunks() != check.expected.chunks():  # another element's value
        return "alignment", check.label if check.rule == "alignment" else f"alignment{target}"
    if any(value == t for t in check.expected.subterms()):  # an earlier version of this element
        return "refresh", f"refresh{target}"
    return "agreement", f"agreement{target}"


_EXPLAIN = {
    "coverage": "no device or host holds the single-device value",
    "agreement": "a copy read differs from the single-device value",
    "alignment": "the update reads another element's state (shards cut differently)",
    "gather_before_use": "a sharded parameter is read in full without being gathered",
    "fetch_before_use": "an offloaded parameter is read without being copied to the device",
    "refresh": "a stale copy (from before an update) is read",
}


def _time(check: _Check) -> tuple[int, int]:
    where = dict(check.where)
    return int(where["step"]), int(where["op"])


def _root_causes(run: _AxisRun, solver: _Solver, terms: _Z3Terms, distinct: list[_Check],
                 indicator: dict[int, z3.BoolRef], define: Callable[[_Check], z3.BoolRef], goal: z3.BoolRef,
                 found: dict[str, tuple[str, dict[str, Any], int]]) -> float:
    """Fill ``found`` with every rule that can fail first, each with a decoded counterexample."""
    checks = [(indicator[id(c)] if id(c) in indicator else define(c), c) for c in distinct]
    definitions = [lit for lit in solver.literals if not lit.eq(goal)]
    rule_of = {id(c): (_classify_read(c, c.values[0]) if c.values else ("coverage", c.label)) for _, c in checks}
    earlier_ok: dict[tuple[int, int], z3.BoolRef] = {}
    previous: list[z3.BoolRef] = []
    for t in sorted({_time(c) for _, c in checks}):  # earlier_ok[t]: no read before t fails
        earlier_ok[t] = z3.Bool(f"ok_before_{t[0]}_{t[1]}")
        solver.solver.add(earlier_ok[t] == (z3.And(*previous) if previous else z3.BoolVal(True)))
        previous = [earlier_ok[t], *[z3.Not(lit) for lit, c in checks if _time(c) == t]]
    first_failure = {id(c): z3.And(lit, earlier_ok[_time(c)]) for lit, c in checks}
    seconds = 0.0
    while True:
        open_ = [first_failure[id(c)] for _, c in checks if rule_of[id(c)][1] not in found]
        if not open_:
            break
        answer = solver.check([*definitions, solver.track("root_cause", z3.Or(*open_))])
        seconds += answer.seconds
        if answer.model is None:
            break
        model = answer.model
        for _, check in checks:
            if not z3.is_true(model.eval(first_failure[id(check)], model_completion=True)):
                continue
            rule, label = rule_of[id(check)]
            if label in found:
                r, w, count = found[label]
                found[label] = (r, w, count + 1)
                continue
            read = check.values[0] if check.values else None
            witness: dict[str, Any] = {
                **dict(check.where), "state": check.state.value, "degree": run.degree, "modelled_devices": run.d,
                "single_device": str(check.expected),
                "single_device_value": _number(model.eval(terms(check.expected), model_completion=True)),
            }
            if check.rule == "coverage":
                witness["holders"] = [str(v) for v in check.values]
            elif read is not None:
                witness["read"] = str(read)
                witness["read_value"] = _number(model.eval(terms(read), model_completion=True))
            found[label] = (rule, witness, 1)
    return seconds


def _decide_consistency(run: _AxisRun, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    """One obligation for P, O and G of a group along an axis; each check keeps its state's name.

    First z3 decides whether any read can differ from single-device training (checks that
    differ only by a renaming of chunks, the devices of a symmetric program, are asked once:
    satisfiability of a disjunct is invariant under renaming). If one can, every failing rule
    is named with its own counterexample, root causes only: a failure counts when it can happen
    while every earlier read (in program time: step, then op) is correct, so the knock-on
    effects of one bug (an update that read the wrong gradient corrupts every later read) are
    not reported as more bugs, while a second, independent bug is.
    """
    name = f"{run.group.name}, {run.axis.value}"
    solver = _Solver(timeout_ms)
    terms = _Z3Terms()
    distinct: list[_Check] = []  # up to the same read on another device
    representatives: list[_Check] = []  # up to a renaming of chunks
    seen_exact: set[tuple[str, tuple[_T, ...], _T]] = set()
    seen_renamed: set[tuple[str, tuple[int, ...], int, tuple[int, ...]]] = set()
    for check in run.checks:
        if (check.label, check.values, check.expected) in seen_exact:
            continue
        seen_exact.add((check.label, check.values, check.expected))
        distinct.append(check)
        names: dict[tuple[str, int], int] = {}
        renaming = tuple(names.setdefault(leaf, len(names))
                         for t in (*check.values, check.expected) for leaf in t.leaves)
        key = (check.label, tuple(v.shape for v in check.values), check.expected.shape, renaming)
        if key not in seen_renamed:
            seen_renamed.add(key)
            representatives.append(check)
    indicator: dict[int, z3.BoolRef] = {}  # id(check) -> "this read differs"

    def define(check: _Check) -> z3.BoolRef:
        literal = z3.Bool(f"fails{len(indicator)}")
        expected = terms(check.expected)
        differs = z3.And(*[terms(v) != expected for v in check.values]) if check.values else z3.BoolVal(True)
        solver.track(check.label, literal == differs)
        indicator[id(check)] = literal
        return literal

    goal = solver.track(f"state_consistency[{name}]", z3.Or(*[define(c) for c in representatives])
                        if representatives else False)
    first = solver.check()
    seconds = first.seconds
    found: dict[str, tuple[str, dict[str, Any], int]] = {}
    if first.model is not None:
        seconds += _root_causes(run, solver, terms, distinct, indicator, define, goal, found)
    status = Status.REFUTED if found else _status(first, violated_when="sat")
    obligation = Obligation(f"state_consistency[{name}]", Condition.STATE_CONSISTENCY, status,
                            first.reason, seconds, first.core)
    violations = []
    for label, (rule, witness, count) in found.items():
        state = witness["state"]
        witness["failing_reads"] = count
        where_text = (f"step {witness['step']}, {witness.get('phase', 'end of step')}, device {witness['device']}"
                      if "device" in witness else f"end of step {witness['step']}")
        explanation = (f"{_EXPLAIN[rule]}: {state}.{run.group.name} chunk {witness['chunk']} along "
                       f"{run.axis.value} ({where_text}) reads {witness.get('read', 'nothing current')} "
                       f"where single-device training has {witness['single_device']}")
        axis = None if rule == "fetch_before_use" else run.axis.value
        violations.append(Violation(label, Condition.STATE_CONSISTENCY, state, run.group.name, axis,
                                    explanation, witness))
    return obligation, violations


# --------------------------------------------------------------------------- the verdict


def _notes(composition: Composition, program: StepProgram) -> list[str]:
    pl = program.placement
    notes: list[str] = []
    m = pl.options.micro_batches
    if Axis.PP in pl.axes and _int_degree(pl.degree(Axis.PP)) > 1 and isinstance(m, int) and m > 1:
        sharded = sorted({a.value for g in pl.groups(P) for a in pl.axes
                          if a.splits_data and pl.mode(G, g, a) is Mode.SHARDED
                          and program.origin(g, a) is Origin.PARTIAL})
        if sharded:
            notes.append(f"gradients sharded along {', '.join(sharded)} under a pipeline with m={m} micro-batches: "
                         f"valid, but they are reduce-scattered once per micro-batch ({m}x the traffic of one "
                         f"reduction) or need unsharded accumulators. {DEEPSPEED_PP_NOTE}")
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


def _memo(case: _IntegrityCase | _ConsistencyCase, group: Group,
          timeout_ms: int) -> tuple[Obligation, list[Violation]]:
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
    named = Obligation(_named(ob.name, group), ob.condition, ob.status, ob.reason_unknown,
                       ob.seconds if fresh else 0.0, tuple(_named(c, group) for c in ob.core))
    return named, [Violation(_named(v.rule, group), v.condition, v.state, group.name, v.axis,
                             _named(v.explanation, group), _named_values(v.witness, group)) for v in found]


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


def _erased(op: Op) -> Op:
    """The op with its group erased and its size dropped (neither matters to a verdict)."""
    return replace(op, group=PLACEHOLDER, elements=sp.Integer(0), note="")


def decide(composition: Composition, program: StepProgram, model: Model, *,
           timeout_ms: int = DEFAULT_TIMEOUT_MS, devices: int | None = None,
           rlimit: int = DEFAULT_RUN_RLIMIT, query_rlimit: int = DEFAULT_QUERY_RLIMIT,
           run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> Verdict:
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


def _decide(composition: Composition, program: StepProgram, model: Model, timeout_ms: int,
            devices: int | None) -> Verdict:
    obligations: list[Obligation] = []
    violations: list[Violation] = []
    ob, found = _decide_composition(composition, model, devices, timeout_ms)
    obligations.append(ob)
    violations += found
    pl = program.placement
    index = _Index(program)
    for group in pl.groups(P):
        for axis in pl.axes:
            ob, found = _memo(_integrity_case(index, group, axis), group, timeout_ms)
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
    notes = [*_notes(composition, program), *framework_notes(setting_for(composition, model, devices),
                                                             composition.mesh())]
    return Verdict(tuple(obligations), tuple(violations), tuple(notes))


__all__ = ["DEFAULT_QUERY_RLIMIT", "DEFAULT_RUN_RLIMIT", "DEFAULT_RUN_TIMEOUT_S", "DEFAULT_TIMEOUT_MS",
           "MAX_CONSISTENCY_DEVICES", "MAX_EXPLICIT_DEVICES", "clear_cache", "decide"]
