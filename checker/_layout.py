"""The framework-neutral layout that importers produce and exporters read.

A ``Layout`` is a composition in the shape frameworks configure it: one data-parallel strategy
(what it shards is read from the placement, not from its name), degrees per axis and the
axis-free options. ``composition_text`` writes it in one canonical order, so that importing
what we export gives back the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from checker._numbers import MAX_DEGREE
from checker._parse import _default_micro_batches
from formal._axes import DATA, data_axes
from formal._model import Model
from formal._placement import Options, Recompute, Strategy
from formal._scalars import scalar_terms
from formal._strategies import LIBRARY, Composition
from formal._strategies import pp as pipeline
from formal._vocab import Axis, Mode, State
from formal.errors import InputError


class ExportError(InputError):
    """Raised when a composition has no spelling in the target framework's configuration."""


class DataSharding(StrEnum):
    """What the data-parallel axis shards, read from the placement's P, O, G modes along dp."""

    NONE = "replicated"  # DDP: R R R
    OPTIMIZER = "optimizer"  # ZeRO-1: R S R
    GRADIENTS = "optimizer+gradients"  # ZeRO-2: R S S
    FULL = "full"  # ZeRO-3 / FSDP full shard: S* S S, gathered per use
    FULL_HELD = "full, held through backward"  # FSDP SHARD_GRAD_OP: S*(held) S S


@dataclass(frozen=True)
class Layout:
    """Degrees (1 = axis absent) and options; ``data_name`` is the strategy as written."""

    data_name: str
    data: DataSharding
    dp: int | None  # None: the devices left over (the composition gives no degree)
    dpr: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    options: Options = field(default_factory=Options)
    replicate: str = "dpr"  # the dpr-axis strategy: dpr (HSDP) or hpz-dpr (ZeRO++ hpZ across nodes)

    def strategy_terms(self) -> list[str]:
        dp = "" if self.dp is None else str(self.dp)
        terms = [f"tp{self.tp}"] if self.tp > 1 else []
        terms.append(f"{self.data_name}{dp}")
        terms += [
            f"{name}{d}"
            for name, d in ((self.replicate, self.dpr), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
            if d > 1
        ]
        return terms

    def modifier_terms(self) -> list[str]:
        o = self.options
        out: list[str] = []
        if o.sequence_parallel:
            out.append("sp")
        if o.micro_batches != _default_micro_batches_for(self.pp):
            out.append(f"m{o.micro_batches}")
        out += o.pipeline_schedule.modifier_terms(o.chunks)
        if o.uneven_stages:
            out.append("uneven")
        if o.offload_optimizer:
            out.append("offload")
        if o.offload_parameters:
            out.append("offload-params")
        match o.recompute:
            case Recompute.NONE:
                pass
            case Recompute.FULL:
                out.append("recompute")
            case Recompute.SELECTIVE:
                out.append("selective")
            case _:
                raise AssertionError(o.recompute)
        return out + scalar_terms(o.scalars)

    def text(self) -> str:
        return "x".join(self.strategy_terms() + self.modifier_terms())

    def composition(self, devices: int) -> Composition:
        """The ``Composition`` this layout is, built from the strategy library directly (no text):
        the terms of ``strategy_terms`` in their order, the options as they are, and the modifier
        terms ``text`` writes. A data degree left open takes the devices the other axes leave over.
        ``InputError`` when they do not divide or the product of the degrees is absurd."""
        named = [("tp", self.tp), (self.data_name, self.dp)]
        named += [(n, d) for n, d in ((self.replicate, self.dpr), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))]
        fixed = 1
        for _, d in named:
            fixed *= d or 1
        dp = self.dp
        if dp is None:
            if devices % fixed:
                raise InputError(
                    f"{self.text()}: --devices {devices} is not a multiple of the other degrees' product {fixed}"
                )
            dp = devices // fixed
        total = fixed * dp if self.dp is None else fixed
        if total > MAX_DEGREE:
            raise InputError(f"{self.text()}: {total:,} devices is absurd (at most {MAX_DEGREE:,})")
        strategies: list[Strategy] = []
        for name, d in named:
            if name == self.data_name:
                strategies.append(LIBRARY[name]().with_degree(dp))
            elif d and d > 1:
                strategies.append(LIBRARY[name]().with_degree(d))
        return Composition(tuple(strategies), self.options, tuple(self.modifier_terms()))

    @property
    def data_degree(self) -> int:
        """Replicas of the batch the data axes see together (dp x dpr; ep splits data too)."""
        assert self.dp is not None, "resolve the leftover degree first"
        return self.dp * self.dpr * self.ep


def _default_micro_batches_for(degree: int) -> int:
    """What the composition language assumes without ``m<N>`` (one rule, in ``_parse``)."""
    return _default_micro_batches([pipeline().with_degree(degree)])


def data_sharding(comp: Composition, model: Model) -> DataSharding:
    """Classify the dp axis by its placement (so ``fsdp`` and ``zero3`` are the same thing)."""
    pl = comp.placement(model)
    dp = next((a for a in data_axes(pl.axes) if a.kind is DATA), None)  # the inner (sharding) data axis
    if dp is None:
        return DataSharding.NONE
    kinds = set()
    for group in pl.groups(State.PARAMETERS):
        p, o, g = (pl.entry(st, group, dp) for st in (State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS))
        kinds.add(_classify(p.mode, p.keep_gathered, o.mode, g.mode))
    if len(kinds) != 1 or None in kinds:
        raise ExportError(f"{comp}: the data-parallel placement is not one of DDP, ZeRO-1/2/3 or FSDP")
    kind = kinds.pop()
    assert kind is not None
    return kind


def _classify(p: Mode, held: bool, o: Mode, g: Mode) -> DataSharding | None:
    match (p, o, g):
        case (Mode.REPLICATED, Mode.REPLICATED, Mode.REPLICATED):
            return DataSharding.NONE
        case (Mode.REPLICATED, Mode.SHARDED, Mode.REPLICATED):
            return DataSharding.OPTIMIZER
        case (Mode.REPLICATED, Mode.SHARDED, Mode.SHARDED):
            return DataSharding.GRADIENTS
        case (Mode.SHARDED_GATHER, Mode.SHARDED, Mode.SHARDED):
            return DataSharding.FULL_HELD if held else DataSharding.FULL
        case _:
            return None


def layout_of(comp: Composition, model: Model) -> Layout:
    """The layout of a composition; ``ExportError`` when it is not one data strategy plus axes."""
    seen: dict[Axis, str] = {}
    for s in comp.strategies:
        if s.axis in seen:
            raise ExportError(f"{comp}: {seen[s.axis]} and {s} both act on the {s.axis.value} axis")
        seen[s.axis] = str(s)
    dpr = comp.strategy_on(Axis.DPR)
    if dpr is not None and dpr.name not in ("dpr", "hpz-dpr"):
        raise ExportError(f"{comp}: {dpr} on the replicate axis is not expressible (only dpr or hpz-dpr)")
    data = comp.strategy_on(Axis.DP)
    mesh = comp.mesh()
    return Layout(
        data_name=data.name if data is not None else "dp",
        data=data_sharding(comp, model),
        dp=mesh.get(Axis.DP, 1),
        dpr=mesh.get(Axis.DPR, 1),
        tp=mesh.get(Axis.TP, 1),
        pp=mesh.get(Axis.PP, 1),
        cp=mesh.get(Axis.CP, 1),
        ep=mesh.get(Axis.EP, 1),
        options=comp.options,
        replicate=dpr.name if dpr is not None else "dpr",
    )


def canonical(comp: Composition, model: Model) -> str:
    """The composition in canonical order: tp, data, dpr, pp, cp, ep, then the modifiers."""
    return layout_of(comp, model).text()
