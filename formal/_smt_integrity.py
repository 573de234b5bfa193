"""Gradient integrity, one z3 obligation per group and axis (``formal/_smt.py`` explains it).

``_integrity_case`` collects what one obligation depends on (the group erased), and
``_decide_integrity`` runs the gradient ops symbolically over integer contributions (``_apply``
one op; ``_micro_batches`` the micro-batch loop one by one when an op acts on the accumulated
``.grad`` inside it: docs/semantics.md, "Gradient buffers"), asks z3 for contributions on which a
device's gradient differs from the single-device one, and decodes a model into a witness
(``_classify_integrity`` names the rule it breaks).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import z3

from formal._program import Op, Origin
from formal._smt_common import (
    MAX_EXPLICIT_DEVICES,
    PLACEHOLDER,
    G,
    O,
    _fraction,
    _Index,
    _number,
    _real,
    _status,
)
from formal._solver import Solver as _Solver
from formal._verdict import Condition, Obligation, Violation
from formal._vocab import (
    FIRST_STAGE_GROUPS,
    LAYER_GROUPS,
    Axis,
    Buffer,
    Group,
    Mode,
    OpKind,
    Phase,
    Reduce,
    gradient_buffer,
)
from formal.errors import InputError

# Micro-batches modelled one by one when an op acts on the accumulated gradient inside the
# micro-batch loop (docs/semantics.md, "Gradient buffers"); beyond this the program is refused.
MAX_UNROLLED_MICRO_BATCHES = 16


def _reads_host_gradient(index: _Index, group: Group) -> bool:
    """The optimizer reads ``group``'s gradient from the host (ZeRO-Offload: G or O offloaded)."""
    return Mode.OFFLOADED in (index.local.get((G, group)), index.local.get((O, group)))


def _gradient_ops(index: _Index, group: Group, axis: Axis, host: bool = False) -> list[tuple[Op, Buffer]]:
    """G ops of ``group`` on ``axis`` (group erased) that run before its optimizer step reads G,
    each with the gradient buffer it acts on (docs/semantics.md, "Gradient buffers").

    With one micro-batch a forward-phase gradient op acts on the step's empty ``.grad`` and is
    left out; with more it acts on what the earlier micro-batches accumulated. With ``host`` (the
    optimizer reads a host copy of the gradient) the device-to-host copies of G, in any phase,
    are kept too: they are axis-free and the host copy is what the optimizer reads. A kind of
    gradient op the encoding cannot model is refused (``InputError``), never skipped.
    """
    home, m = index.home, index.micro_batches
    out: list[tuple[Op, Buffer]] = []
    for op in index.ops.get(group, []):
        if op.kind is OpKind.OPTIMIZER_STEP:
            break
        if op.state is not G:
            continue
        if op.kind in (OpKind.SEND_RECV, OpKind.ALL_TO_ALL, OpKind.HOST_TO_DEVICE, OpKind.COMPUTE):
            raise InputError(f"{op}: a {op.kind.value} of the gradients is not modelled by the gradient encoding")
        per_mb = op.phase is Phase.GRAD_SYNC and m > 1 and op.count == m
        buffer = gradient_buffer(op.phase, per_mb, op.buffer)
        if buffer is Buffer.FRESH and op.phase is not Phase.BACKWARD and not per_mb:
            raise InputError(f"{op}: a fresh gradient exists only in a micro-batch's backward")
        if op.kind is OpKind.DEVICE_TO_HOST:
            if host:
                out.append((op, buffer))
            continue
        if op.phase is Phase.FORWARD and m == 1:
            continue
        if op.kind.is_collective and op.axis is axis:
            out.append((op, buffer))
        elif op.kind is OpKind.SCALE and (op.axis is axis or (op.axis is None and axis is home)):
            out.append((op, buffer))
    return out


def _in_loop(op: Op, m: int) -> bool:
    """The op runs with each micro-batch (forward, backward, or synchronised per micro-batch)."""
    return op.phase in (Phase.FORWARD, Phase.BACKWARD) or (op.phase is Phase.GRAD_SYNC and m > 1 and op.count == m)


def _unrolled(ops: list[tuple[Op, Buffer]], m: int) -> int:
    """Micro-batches to model one by one: ``m`` when an op inside the loop acts on ``.grad``
    (then the micro-batches do not commute with the ops, and even with one the op runs after
    the fresh-buffer ops of its micro-batch), else 0: every loop op is linear on the fresh
    gradient, so applying it to each micro-batch equals applying it to their sum. A device-to-host
    copy inside the loop is not: it snapshots one micro-batch's buffer, so it is unrolled too."""
    if not any(
        _in_loop(op, m) and (buffer is Buffer.ACCUMULATED or op.kind is OpKind.DEVICE_TO_HOST) for op, buffer in ops
    ):
        return 0
    if m > MAX_UNROLLED_MICRO_BATCHES:
        raise InputError(
            f"m={m} micro-batches with a gradient op on the accumulated buffer inside the micro-batch loop: "
            f"the gradient encoding models at most {MAX_UNROLLED_MICRO_BATCHES} such micro-batches"
        )
    return m


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
    micro_batches: int = 0  # modelled one by one (``_unrolled``; 0: one gradient per step)
    buffers: tuple[Buffer, ...] = ()  # the gradient buffer each op acts on
    offset: int = 0  # the gradient's shard partition along the axis (its holder's chunk)
    # The factor of the single-device normaliser that scales along other axes apply to this
    # element (normalisation is a product across axes: ``formal/_smt.py``, ``_normalised``).
    allowance: Fraction = Fraction(1)
    # Along pp, a group outside the layers lives whole on the stage that uses it (docs/semantics.md,
    # "Groups outside the layers along a pipeline"): rank 0 of the pp group, the first stage, is
    # its holder for the embedding (True) and not for the head or the final norm (False).
    first_stage_holds: bool | None = None


def _integrity_case(index: _Index, group: Group, axis: Axis) -> _IntegrityCase:
    degree = index.degrees[axis]
    if axis.kind.is_pipeline and group in index.placement.tied:
        degree = min(degree, 2)  # a tied embedding lives on the first and the last stage
    host = _reads_host_gradient(index, group)
    entry = index.entry(G, group, axis)
    ops = _gradient_ops(index, group, axis, host)
    return _IntegrityCase(
        axis,
        degree,
        index.origins.get((group, axis), Origin.COMPLETE),
        entry.mode.is_sharded,
        tuple(op for op, _ in ops),
        host,
        _unrolled(ops, index.micro_batches),
        tuple(buffer for _, buffer in ops),
        entry.offset if entry.mode.is_sharded else 0,
        first_stage_holds=(
            (group in FIRST_STAGE_GROUPS) if axis.kind.is_pipeline and group not in LAYER_GROUPS else None
        ),
    )


def _owner(op: Op, case: _IntegrityCase, k: int) -> int:
    """The device whose piece holds the element in ``op``'s partition (the holder's chunk)."""
    src = (op.offset - case.offset) % case.degree
    if src >= k:
        raise InputError(f"{op}: a {op.kind.value} onto or from device {src} of {case.degree} is not modelled")
    return src


def _apply(
    op: Op, values: list[z3.ArithRef], rest_v: z3.ArithRef, case: _IntegrityCase, rest: int, scatter: bool = False
) -> tuple[list[z3.ArithRef], z3.ArithRef]:
    """One gradient op on the devices' values of the element (``rest``: devices folded into
    ``rest_v``, their values' sum): the new values, as expressions. With ``scatter`` a
    reduce-scatter writes the reduced element on its owner only and leaves the other devices'
    buffers as they were (inside the micro-batch loop, where they are reduced again); otherwise
    every device is given it, as only the holder reads it after the buffer is freed outside its
    shard (``free_outside_shard``)."""
    k = len(values)
    match op.kind:
        case OpKind.ALL_REDUCE | OpKind.REDUCE_SCATTER:
            combined = z3.Sum(*values) + rest_v if k > 1 or rest else values[0] + rest_v
            if op.reduce is Reduce.MEAN:
                combined = combined / case.degree
            if scatter and op.kind is OpKind.REDUCE_SCATTER:
                owner = _owner(op, case, k)
                return [combined if i == owner else v for i, v in enumerate(values)], rest_v
            return [combined] * k, rest * combined
        case OpKind.SCALE:
            factor = _real(_fraction(op.scale))
            return [v * factor for v in values], rest_v * factor
        case OpKind.BROADCAST:  # from the axis's first device (rank 0 of the group)
            if case.sharded and k > 1 and case.first_stage_holds is not None:
                value = values[0] if case.first_stage_holds else values[1]
                return [value] * k, rest * value
            if case.sharded and k > 1:
                # The element's one holder is device 0 by symmetry, but rank 0 is not symmetric:
                # for most elements the source is another device. One constant for every
                # broadcast of the case (z3 names are global): the solver picks the holder or a
                # non-holder as rank 0, and an element wrong for either is a counterexample.
                source = z3.Int("broadcast_source")
                value = z3.If(source == 0, values[0], values[1])
                return [value] * k, rest * value
            return [values[0]] * k, rest * values[0]
        case OpKind.ALL_GATHER:
            # Every device gets the element from the device whose piece holds it in the gather's
            # partition: the element is the holder's chunk, device (offset - holder's offset).
            src = _owner(op, case, k)
            return [values[src]] * k, rest * values[src]
        case _:
            raise InputError(f"{op}: a {op.kind.value} of the gradients is not modelled by the gradient encoding")


def _start(
    case: _IntegrityCase, solver: _Solver, k: int, rest: int, name: str, tag: str = ""
) -> tuple[list[z3.ArithRef], z3.ArithRef, dict[str, z3.ArithRef], z3.ArithRef, z3.ArithRef]:
    """The devices' values right after one backward (``tag``: its micro-batch, when modelled
    one by one), from the origin: the values, the folded aggregate, the named contributions,
    the element's sum of contributions (or complete value) and the single-device value."""
    axis, degree, origin = case.axis, case.degree, case.origin
    contributions = [z3.Int(f"c{i}{tag}") for i in range(k)]
    rest_c = z3.Int(f"c_rest{tag}") if rest else z3.IntVal(0)
    total_c = z3.ToReal(z3.Sum(*contributions) + rest_c) if k > 1 or rest else z3.ToReal(contributions[0])
    named = {f"{i}{tag}": c for i, c in enumerate(contributions)}
    if rest:
        named[f"rest{tag}"] = rest_c
    values = [z3.Real(f"v0_{i}{tag}") for i in range(k)]
    rest_v = z3.Real(f"v0_rest{tag}")
    match origin:
        case Origin.PARTIAL:
            total = total_c
            init = [values[i] == z3.ToReal(contributions[i]) for i in range(k)] + [rest_v == z3.ToReal(rest_c)]
        case Origin.SUMMED:
            total = total_c
            init = [v == total_c for v in values] + [rest_v == rest * total_c]
        case Origin.COMPLETE:
            total = z3.ToReal(z3.Int(f"r{tag}"))
            if case.sharded:
                # Other devices hold other elements (their own shards): unrelated values.
                others = [z3.ToReal(z3.Int(f"u{i}{tag}")) for i in range(1, k)]
                init = [values[0] == total] + [values[i] == others[i - 1] for i in range(1, k)]
                # The folded aggregate holds other elements only if devices were folded: with
                # none it is empty, so a collective over one device stays the identity.
                init.append(rest_v == (z3.ToReal(z3.Int(f"u_rest{tag}")) if rest else 0))
            else:
                init = [v == total for v in values] + [rest_v == rest * total]
        case _:
            raise AssertionError(origin)
    solver.track(f"origin[{name}]={origin.value}{tag}", z3.And(*init))
    reference = total / degree if origin is not Origin.COMPLETE and axis.splits_data else total
    return values, rest_v, named, total, reference


def _micro_batches(
    case: _IntegrityCase, solver: _Solver, k: int, rest: int, name: str
) -> tuple[list[z3.ArithRef], z3.ArithRef, dict[str, z3.ArithRef], z3.ArithRef, dict[int, list[z3.ArithRef]]]:
    """The micro-batch loop modelled one by one (docs/semantics.md, "Gradient buffers"): in each,
    the forward's gradient ops act on ``.grad``, the backward's fresh-buffer ops on the fresh
    gradient, which is then added to ``.grad``, then the ops on the accumulated buffer run.
    A device-to-host copy inside the loop snapshots the buffer it names at its point of the loop
    (``.grad`` as the earlier micro-batches and the ops so far left it, or this micro-batch's fresh
    gradient), each micro-batch overwriting the host copy, as ``copy_`` of ``p.grad`` does.
    Returns ``.grad`` after the loop, the named contributions, the single-device value and, by
    op number, the host copy each in-loop device-to-host copy left after the last micro-batch."""
    m = case.micro_batches
    acc: list[z3.ArithRef] = [z3.RealVal(0)] * k
    acc_rest: z3.ArithRef = z3.RealVal(0)
    named: dict[str, z3.ArithRef] = {}
    references: list[z3.ArithRef] = []
    ops = list(enumerate(zip(case.ops, case.buffers, strict=True), start=1))
    loop = [(n, op, b) for n, (op, b) in ops if _in_loop(op, m)]
    copies: dict[int, list[z3.ArithRef]] = {}

    def run(n: int, op: Op, values: list[z3.ArithRef], rest_v: z3.ArithRef, j: int) -> tuple[Any, Any]:
        if op.kind is OpKind.DEVICE_TO_HOST:
            copy = [z3.Real(f"h{n}_{i}@mb{j}") for i in range(k)]
            solver.track(f"{_op_label(n, op)}@mb{j}", z3.And(*[copy[i] == values[i] for i in range(k)]))
            copies[n] = copy
            return values, rest_v
        new = [z3.Real(f"v{n}_{i}@mb{j}") for i in range(k)]
        new_rest = z3.Real(f"v{n}_rest@mb{j}")
        exprs, rest_expr = _apply(op, values, rest_v, case, rest, scatter=True)
        step = [new[i] == exprs[i] for i in range(k)] + [new_rest == rest_expr]
        solver.track(f"{_op_label(n, op)}@mb{j}", z3.And(*step))
        return new, new_rest

    for j in range(m):
        fresh, fresh_rest, contributions, _, reference = _start(case, solver, k, rest, name, f"@mb{j}")
        named.update(contributions)
        references.append(reference)
        for n, op, _ in loop:
            if op.phase is Phase.FORWARD:
                acc, acc_rest = run(n, op, acc, acc_rest, j)
        for n, op, buffer in loop:
            if op.phase is not Phase.FORWARD and buffer is Buffer.FRESH:
                fresh, fresh_rest = run(n, op, fresh, fresh_rest, j)
        summed = [z3.Real(f"acc_{i}@mb{j}") for i in range(k)]
        summed_rest = z3.Real(f"acc_rest@mb{j}")
        solver.track(
            f"accumulate[{name}]@mb{j}",
            z3.And(*[summed[i] == acc[i] + fresh[i] for i in range(k)], summed_rest == acc_rest + fresh_rest),
        )
        acc, acc_rest = summed, summed_rest
        for n, op, buffer in loop:
            if op.phase is not Phase.FORWARD and buffer is Buffer.ACCUMULATED:
                acc, acc_rest = run(n, op, acc, acc_rest, j)
    return acc, acc_rest, named, z3.Sum(*references), copies


def _decide_integrity(case: _IntegrityCase, timeout_ms: int) -> tuple[Obligation, list[Violation]]:
    axis, degree, origin, sharded = case.axis, case.degree, case.origin, case.sharded
    group = PLACEHOLDER
    name = f"G.{group.name}, {axis.value}"
    k = min(degree, MAX_EXPLICIT_DEVICES)
    rest = degree - k  # devices folded into one aggregate
    solver = _Solver(timeout_ms)
    m = case.micro_batches
    copies: dict[int, list[z3.ArithRef]] = {}
    if m:
        values, rest_v, contributions, reference, copies = _micro_batches(case, solver, k, rest, name)
    else:
        values, rest_v, contributions, _, reference = _start(case, solver, k, rest, name)
    # A gradient sharded along the axis is read by its one holder (device 0 by symmetry).
    owners = range(1) if sharded else range(k)
    ops = list(case.ops)
    late: list[Op] = []  # reductions after the gradient was cut down to its shard
    trimmed = False
    host: list[z3.ArithRef] | None = None  # the host copy of the gradient, once one is made
    copied = -1  # index in ops of the last device-to-host copy
    for n, op in enumerate(ops, start=1):
        if op.kind is OpKind.DEVICE_TO_HOST:
            # A copy of the device value at the time of the transfer: later device-side
            # reductions do not reach it. Inside the micro-batch loop the copy is the last
            # micro-batch's snapshot of its buffer (``_micro_batches``).
            copied = n - 1
            if n in copies:
                host = copies[n]
                continue
            host = [z3.Real(f"h{n}_{i}") for i in range(k)]
            solver.track(_op_label(n, op), z3.And(*[host[i] == values[i] for i in range(k)]))
            continue
        if m and _in_loop(op, m):
            continue  # run with each micro-batch (``_micro_batches``)
        if sharded and not trimmed and op.phase in (Phase.OPTIMIZER, Phase.REFRESH):
            # After gradient synchronisation a sharded gradient is freed outside each device's
            # shard: only the holder keeps this element (whatever it has reduced so far).
            trimmed = True
            kept = [z3.Real(f"t{n}_{i}") for i in range(k)]
            kept_rest = z3.Real(f"t{n}_rest")
            solver.track(
                f"free_outside_shard[{name}]", z3.And(kept[0] == values[0], *[v == 0 for v in kept[1:]], kept_rest == 0)
            )
            values, rest_v = kept, kept_rest
        if trimmed and op.kind.is_reduction:
            late.append(op)
        new = [z3.Real(f"v{n}_{i}") for i in range(k)]
        new_rest = z3.Real(f"v{n}_rest")
        exprs, rest_expr = _apply(op, values, rest_v, case, rest)
        step = [new[i] == exprs[i] for i in range(k)] + [new_rest == rest_expr]
        solver.track(_op_label(n, op), z3.And(*step))
        values, rest_v = new, new_rest
    read = host if case.host and host is not None else values  # what the optimizer reads
    # Scales along other axes may carry part of this element's normaliser (``allowance``).
    target = reference * _real(case.allowance) if case.allowance != 1 else reference
    solver.track(f"integrity[{name}]", z3.Or(*[read[i] != target for i in owners]))
    answer = solver.check()
    status = _status(answer, violated_when="sat")
    obligation = Obligation(
        f"gradient_integrity[{name}]", Condition.GRADIENT_INTEGRITY, status, answer.reason, answer.seconds, answer.core
    )
    if answer.model is None:
        return obligation, []
    model = answer.model
    ref_value = _number(model.eval(target, model_completion=True))
    held = {str(i): _number(model.eval(read[i], model_completion=True)) for i in owners}
    accumulated = [
        op
        for op, b in zip(ops, case.buffers, strict=True)
        if _in_loop(op, m) and b is Buffer.ACCUMULATED and not _passes_accumulation_through(op)
    ]
    rule, defect = _classify_integrity(
        origin,
        ops,
        axis,
        degree,
        late,
        copied if case.host and host is not None else None,
        accumulated if m > 1 else [],  # with one micro-batch nothing goes through an op twice
        m,
    )
    witness: dict[str, Any] = {
        "defect": defect,
        "origin": origin.value,
        "degree": degree,
        "modelled_devices": k,
        "contributions": {
            key: _number(model.eval(c, model_completion=True)) for key, c in contributions.items() if key != "rest"
        },
        "devices": held,
        "single_device": ref_value,
        "disagreeing_devices": [i for i in held if held[i] != ref_value],
        "ops": [str(op) for op in ops],
    }
    if m > 1:
        witness["micro_batches"] = m
    if case.allowance != 1:
        witness["normalised_along_other_axes"] = str(case.allowance)
    if case.host:
        witness["read_from"] = "host" if host is not None else "device"
    if "rest" in contributions:
        witness["contributions"]["rest"] = _number(model.eval(contributions["rest"], model_completion=True))
    if origin is Origin.COMPLETE:
        witness["contributions"] = {"complete": ref_value}
    first_bad = witness["disagreeing_devices"][0] if witness["disagreeing_devices"] else "0"
    holder = "the host copy of device" if case.host and host is not None else "device"
    explanation = (
        f"G.{group.name} along {axis.value}: {defect}; {holder} {first_bad} holds "
        f"{held.get(first_bad)} where single-device training has {ref_value}"
    )
    return obligation, [
        Violation(
            f"{rule}[{name}]", Condition.GRADIENT_INTEGRITY, G.value, group.name, axis.value, explanation, witness
        )
    ]


def _passes_accumulation_through(op: Op) -> bool:
    """A mean all-reduce of ``.grad`` inside the micro-batch loop: what the earlier micro-batches
    left is already equal across the axis (their own mean all-reduce made it so), and a mean of
    equal values is that value, so only the new micro-batch's gradient is averaged: the op cannot
    be what breaks the gradient (docs/semantics.md, "Gradient buffers"), and a wrong value is
    then the normaliser's or another op's."""
    return op.kind is OpKind.ALL_REDUCE and op.reduce is Reduce.MEAN


def _classify_integrity(
    origin: Origin,
    ops: list[Op],
    axis: Axis,
    degree: int,
    late: list[Op],
    copied: int | None = None,
    accumulated: list[Op] | None = None,
    m: int = 1,
) -> tuple[str, str]:
    """The rule a wrong gradient breaks. ``copied``: the index of the device-to-host copy the
    optimizer reads (only the ops before it reach the host); ``accumulated``: the ops that act
    on ``.grad`` inside the loop over ``m`` micro-batches."""
    if copied is not None:
        copy = ops[copied]
        after = [op for op in ops[copied + 1 :] if op.kind.is_reduction or op.kind is OpKind.SCALE]
        if copy.phase in (Phase.FORWARD, Phase.BACKWARD) and (m > 1 or copy.phase is Phase.FORWARD or not after):
            return (
                "transfer_after_reduction",
                f"the gradient is copied to the host in the {copy.phase.value} phase, inside the micro-batch "
                "loop: the host keeps the last micro-batch's snapshot of the buffer the copy names (its fresh "
                "gradient, or .grad as accumulated so far), not the step's synchronised gradient",
            )
        if after:
            what = f"{after[0].kind.value}" + (f" ({after[0].reduce.value})" if after[0].reduce else "")
            return (
                "transfer_after_reduction",
                f"the gradient is copied to the host before its {what} along "
                f"{axis.value}: the host optimizer reads the gradient as it was at the copy, and the "
                "later device-side op does not reach it",
            )
        ops = ops[:copied]
        late = [op for op in late if op in ops]
    ops = [op for op in ops if not op.kind.is_transfer]
    reductions = [op for op in ops if op.kind.is_reduction]
    if late:
        return (
            "reduction_closure",
            f"reduction after gradient synchronisation ({late[0].phase.value} phase): "
            f"the gradient sharded along {axis.value} was already freed outside each device's shard",
        )
    if origin is Origin.PARTIAL and not reductions:
        return (
            "reduction_closure",
            f"missing reduction: each of the {degree} devices holds a partial "
            f"sum along {axis.value} and nothing reduces it",
        )
    copies = [op for op in ops if op.kind in (OpKind.BROADCAST, OpKind.ALL_GATHER)]
    if origin is Origin.PARTIAL and copies and (not reductions or ops.index(copies[0]) < ops.index(reductions[0])):
        return (
            "reduction_closure",
            f"{copies[0].kind.value} of the unreduced gradient along {axis.value}: every device takes one "
            "device's partial gradient in place of its own, so the other devices' contributions are lost",
        )
    if accumulated:
        first = accumulated[0]
        what = first.kind.value + (f" ({first.reduce.value})" if first.reduce else "")
        return (
            "gradient_buffer",
            f"the {first.phase.value}-phase {what} acts on the accumulated .grad with each of the {m} "
            "micro-batches, so the earlier micro-batches' gradients go through it again (docs/semantics.md, "
            '"Gradient buffers")',
        )
    if origin is not Origin.PARTIAL and reductions:
        return (
            "reduction_closure",
            f"reduction along {axis.value}, whose contributions were already {origin.value} after backward",
        )
    if len(reductions) > 1:
        return ("reduction_closure", f"duplicated reduction: reduced {len(reductions)} times along {axis.value}")
    want = "mean" if axis.splits_data else "sum"
    return (
        "normalisation",
        f"normalisation: the contributions along {axis.value} must be combined by their {want}, and the "
        "product of every scale applied to the element (its mean reductions and scales, along any axis, in "
        "any phase) is not the single-device normaliser",
    )
