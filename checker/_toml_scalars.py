"""The ``[[scalars]]`` entries of a strategy file: the scalar program (``formal/_scalars.py``).

They replace the derived scalar program (the loss normaliser, the global gradient norm, the
clip and the fp16 overflow check), in file order::

    [[scalars]]
    op = "grad_norm"          # normalise_loss, grad_norm, clip, overflow_check, aux_loss or
                              #   cross_entropy
    groups = ["attention"]    # optional: the parameter groups covered (default: every one)
    over = ["dp", "tp"]       # the axes the scalar is all-reduced over (default: none)
    once = ["tp"]             # grad_norm: along these only a piece's first holder adds it
    micro_batches = true      # normalise_loss: the count is summed over the step's micro-batches;
                              #   aux_loss: the routing statistics are (global-batch balancing)
    compensated = true        # normalise_loss: the loss undoes the gradient mean (default true)
    tokens = "variable"       # normalise_loss: "variable" (default) or "equal" token counts
    gathered = ["tp"]         # cross_entropy: the logits were all-gathered along these first

``normalise_loss`` with ``over = []`` and ``micro_batches = false`` is the mean of the
micro-batches' (and ranks') token means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from formal._placement import Placement
from formal._scalars import ScalarKind, ScalarOp
from formal._vocab import LOGITS, ROUTER, Axis, Group, State
from formal.errors import StrategyFileError

MAX_SCALARS = 100
_KEYS = {"op", "groups", "over", "once", "micro_batches", "compensated", "tokens", "note", "gathered"}
_ONLY: dict[str, tuple[ScalarKind, ...]] = {
    "once": (ScalarKind.GRAD_NORM,),
    "micro_batches": (ScalarKind.NORMALISE_LOSS, ScalarKind.AUX_LOSS),
    "compensated": (ScalarKind.NORMALISE_LOSS,),
    "tokens": (ScalarKind.NORMALISE_LOSS,),
    "gathered": (ScalarKind.CROSS_ENTROPY,),
    "groups": (
        ScalarKind.GRAD_NORM,
        ScalarKind.CLIP,
        ScalarKind.OVERFLOW_CHECK,
    ),
}


@dataclass(frozen=True)
class ScalarSpec:
    """One ``[[scalars]]`` entry as written (its axes and groups checked against a placement later)."""

    index: int
    op: ScalarOp
    group_names: tuple[str, ...] | None

    @property
    def where(self) -> str:
        return f"scalars[{self.index}] ({self.op.kind.value})"


def scalar_specs(where: str, body: object) -> tuple[ScalarSpec, ...]:
    if not isinstance(body, list) or not all(isinstance(o, dict) for o in body):
        raise StrategyFileError(f"{where}: 'scalars' must be a list of [[scalars]] tables")
    if len(body) > MAX_SCALARS:
        raise StrategyFileError(f"{where}: {len(body)} scalars entries; at most {MAX_SCALARS}")
    return tuple(_spec(f"{where}: scalars[{i}]", i, entry) for i, entry in enumerate(body, start=1))


def _spec(at: str, index: int, body: dict[str, Any]) -> ScalarSpec:
    unknown = set(body) - _KEYS
    if unknown:
        raise StrategyFileError(f"{at}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(_KEYS))})")
    kinds = {k.value: k for k in ScalarKind}
    kind = kinds.get(str(body.get("op", "")).strip().lower()) if isinstance(body.get("op"), str) else None
    if kind is None:
        raise StrategyFileError(f"{at}: needs op = one of {', '.join(kinds)}")
    for key, owners in _ONLY.items():
        if key in body and kind not in owners:
            names = " and ".join(o.value for o in owners)
            raise StrategyFileError(f"{at}: {key} applies to {names} only, not {kind.value}")
    if kind is ScalarKind.CLIP and ("over" in body):
        raise StrategyFileError(f"{at}: a clip is local (it applies the factor of the norm before it): no over")
    groups = _names(at, "groups", body.get("groups")) if "groups" in body else None
    over = _axes(at, "over", body.get("over", []))
    once = _axes(at, "once", body.get("once", []))
    gathered = _axes(at, "gathered", body.get("gathered", []))
    flags = {k: body.get(k, default) for k, default in (("micro_batches", False), ("compensated", True))}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise StrategyFileError(f"{at}.{key}: must be true or false")
    tokens = body.get("tokens", "variable")
    if tokens not in ("variable", "equal"):
        raise StrategyFileError(f'{at}.tokens: must be "variable" or "equal"')
    if "note" in body and not isinstance(body["note"], str):
        raise StrategyFileError(f"{at}.note: must be a string")
    op = ScalarOp(
        kind,
        None if groups is None else frozenset(Group(g) for g in groups),
        over,
        once,
        bool(flags["micro_batches"]),
        bool(flags["compensated"]),
        str(tokens),
        str(body.get("note", "from the strategy file")),
        gathered,
    )
    return ScalarSpec(index, op, groups)


def _names(at: str, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or len(value) > 1000:
        raise StrategyFileError(f"{at}.{key}: must be a list of group names")
    return tuple(value)


def _axes(at: str, key: str, value: object) -> tuple[Axis, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StrategyFileError(f"{at}.{key}: must be a list of axes ({', '.join(a.value for a in Axis)})")
    known = {a.value: a for a in Axis}
    out: list[Axis] = []
    for v in value:
        axis = known.get(v.strip().lower())
        if axis is None:
            raise StrategyFileError(f"{at}.{key}: {v[:20]!r} is not an axis ({', '.join(known)})")
        if axis in out:
            raise StrategyFileError(f"{at}.{key}: {axis.value} listed twice")
        out.append(axis)
    return tuple(out)


def scalar_program(path: str, specs: tuple[ScalarSpec, ...], pl: Placement) -> tuple[ScalarOp, ...]:
    """The file's scalar ops over a placement: every axis and group it names must exist."""
    groups = set(pl.groups(State.PARAMETERS))
    for spec in specs:
        for axis in (*spec.op.over, *spec.op.once, *spec.op.gathered):
            if axis not in pl.axes:
                raise StrategyFileError(
                    f"{path}: {spec.where}: axis {axis.value} is not in this composition "
                    f"(axes: {', '.join(a.value for a in pl.axes)})"
                )
        for name in spec.group_names or ():
            if Group(name) not in groups:
                raise StrategyFileError(
                    f"{path}: {spec.where}: group {name!r} is not a parameter group of this model "
                    f"({', '.join(g.name for g in sorted(groups))})"
                )
        if spec.op.kind is ScalarKind.AUX_LOSS and ROUTER not in groups:
            raise StrategyFileError(f"{path}: {spec.where}: the model has no experts (no router to balance)")
        if spec.op.kind is ScalarKind.CROSS_ENTROPY and (State.ACTIVATIONS, LOGITS) not in set(pl.keys()):
            raise StrategyFileError(f"{path}: {spec.where}: the model has no logits (give a transformer)")
    return tuple(spec.op for spec in specs)


__all__ = ["ScalarSpec", "scalar_program", "scalar_specs"]
