"""Gradient integrity, one z3 obligation per group and axis (``formal/_smt.py`` explains it).

``_integrity_case`` collects what one obligation depends on (the group erased), and
``_decide_integrity`` runs the gradient ops symbolically over integer contributions, asks z3 for
contributions on which a device's gradient differs from the single-device one, and decodes a
model into a witness (``_classify_integrity`` names the rule it breaks).
"""

from __future__ import annotations

from dataclasses import dataclass
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
from formal._vocab import Axis, Group, Mode, OpKind, Phase, Reduce


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
    return _IntegrityCase(
        axis,
        degree,
        index.origins.get((group, axis), Origin.COMPLETE),
        index.entry(G, group, axis).mode.is_sharded,
        tuple(_gradient_ops(index, group, axis, host)),
        host,
    )


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
                # The folded aggregate holds other elements only if devices were folded: with
                # none it is empty, so a collective over one device stays the identity.
                init.append(rest_v == (z3.ToReal(z3.Int("u_rest")) if rest else 0))
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
            solver.track(
                f"free_outside_shard[{name}]", z3.And(kept[0] == values[0], *[v == 0 for v in kept[1:]], kept_rest == 0)
            )
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
    obligation = Obligation(
        f"gradient_integrity[{name}]", Condition.GRADIENT_INTEGRITY, status, answer.reason, answer.seconds, answer.core
    )
    if answer.model is None:
        return obligation, []
    model = answer.model
    ref_value = _number(model.eval(reference, model_completion=True))
    held = {str(i): _number(model.eval(read[i], model_completion=True)) for i in owners}
    rule, defect = _classify_integrity(
        origin, ops, axis, degree, late, copied if case.host and host is not None else None
    )
    witness: dict[str, Any] = {
        "defect": defect,
        "origin": origin.value,
        "degree": degree,
        "modelled_devices": k,
        "contributions": {str(i): _number(model.eval(contributions[i], model_completion=True)) for i in range(k)},
        "devices": held,
        "single_device": ref_value,
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
    explanation = (
        f"G.{group.name} along {axis.value}: {defect}; {holder} {first_bad} holds "
        f"{held.get(first_bad)} where single-device training has {ref_value}"
    )
    return obligation, [
        Violation(
            f"{rule}[{name}]", Condition.GRADIENT_INTEGRITY, G.value, group.name, axis.value, explanation, witness
        )
    ]


def _classify_integrity(
    origin: Origin, ops: list[Op], axis: Axis, degree: int, late: list[Op], copied: int | None = None
) -> tuple[str, str]:
    """The rule a wrong gradient breaks. ``copied``: the index of the device-to-host copy the
    optimizer reads (only the ops before it reach the host)."""
    if copied is not None:
        copy = ops[copied]
        if copy.phase in (Phase.FORWARD, Phase.BACKWARD):
            return (
                "transfer_after_reduction",
                f"the gradient is copied to the host in the {copy.phase.value} "
                "phase, before the backward has produced it: the host optimizer reads an incomplete gradient",
            )
        after = [op for op in ops[copied + 1 :] if op.kind.is_reduction or op.kind is OpKind.SCALE]
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
        f"normalisation: the contributions along {axis.value} must be combined by their "
        f"{want} exactly once, and the program's reductions and scales do not give that",
    )
