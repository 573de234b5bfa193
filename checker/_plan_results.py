"""The planner's results: the candidates (costs and, once decided, verdicts), the plan that holds
every rule-passing candidate as numpy columns, why one candidate ranks above another, and why
the popular composition shapes were not picked.

``checker._planner`` is the entry (docs/planner.md).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checker._numbers import gb
from checker._parse import readable
from checker._plan_space import (
    _CP,
    _DP,
    _EP,
    _PP,
    _TP,
    AXES,
    Bools,
    Cluster,
    DataParallel,
    Family,
    Floats,
    Ints,
    Offload,
    Pipeline,
    RankBy,
    Workload,
)
from formal._engine_effects import EnginePrediction, default_engine
from formal._hardware import Hardware
from formal._model import Model, ParameterCount, Precision, Transformer
from formal._rules import framework_notes, setting_for
from formal._steptime import Efficiency
from formal._strategies import Composition
from formal._verdict import Status
from formal._vocab import Axis, Stage

# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One composition with its costs (bytes, seconds) and, once decided, its z3 verdict."""

    family: Family
    degrees: tuple[int, ...]  # in AXES order
    micro_batch: int  # b, sequences per micro-batch per replica
    micro_batches: int  # m per step
    memory: float  # the placement's bytes on the most-loaded device (vectorized: the screen)
    stage: str
    traffic: tuple[float, ...]  # bytes per device per step, per axis (AXES order)
    host: float
    compute_s: float
    bubble_s: float
    communication_s: float
    host_s: float
    rank: int = 0
    exact_memory: int | None = None  # the engine's peak (``engine_peak_of``): what ``check`` prints
    exact_communication: int | None = None
    placement_memory: int | None = None  # the placement's exact figure (the paper's number)
    engine: str = ""  # the engine the peak is for (``default_engine`` of the composition's names)
    status: Status | None = None
    verdict_note: str = ""

    uneven: bool = False  # uneven stages allowed and the layers do not divide by pp
    notes: tuple[str, ...] = ()  # framework rules it breaks (formal._rules), once decided

    @property
    def text(self) -> str:
        return self.family.text(self.degrees, self.micro_batches, self.uneven)

    @property
    def communication(self) -> float:
        return float(sum(self.traffic))

    @property
    def step_s(self) -> float:
        """Seconds per step; NaN for a bare parameter count (no layers: nothing to time)."""
        return self.compute_s + self.bubble_s + self.communication_s + self.host_s

    @property
    def timed(self) -> bool:
        return not math.isnan(self.step_s)

    def composition(self) -> Composition:
        return self.family.composition(self.degrees, self.micro_batches, self.uneven)

    @property
    def readable(self) -> str:
        """The composition as people read it (``zero1(dp=2)``, not ``zero12``): for prose."""
        return readable(self.composition())

    def framework_notes(self, model: Model) -> tuple[str, ...]:
        """The framework rules this candidate breaks (``check`` prints the same notes)."""
        comp = self.composition()
        return framework_notes(setting_for(comp, model), comp.mesh())

    def as_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "composition": self.text,
            "family": str(self.family),
            "mesh": {a.value: d for a, d in zip(AXES, self.degrees, strict=True) if d > 1},
            "micro_batch_size": self.micro_batch,
            "micro_batches": self.micro_batches,
            "memory_bytes": self.exact_memory if self.exact_memory is not None else round(self.memory),
            "placement_memory_bytes": self.placement_memory
            if self.placement_memory is not None
            else round(self.memory),
            "engine": self.engine,
            "most_loaded_stage": self.stage,
            "communication_bytes": (
                self.exact_communication if self.exact_communication is not None else round(self.communication)
            ),
            "communication_by_axis": {a.value: round(v) for a, v in zip(AXES, self.traffic, strict=True) if v},
            "host_bytes": round(self.host),
            "step_seconds": (
                {
                    "total": self.step_s,
                    "compute": self.compute_s,
                    "bubble": self.bubble_s,
                    "communication": self.communication_s,
                    "host": self.host_s,
                }
                if self.timed
                else None
            ),
            "verdict": self.status.label if self.status is not None else "undecided",
            "verdict_note": self.verdict_note,
            "framework_notes": list(self.notes),
        }


@dataclass(frozen=True)
class Alternative:
    """A popular composition shape and why the planner did not pick it."""

    label: str
    reason: str
    best: Candidate | None = None


@dataclass
class _Table:
    """Every rule-passing candidate of every family, as parallel numpy columns."""

    family: Ints
    degrees: Ints
    b: Ints
    m: Ints
    memory: Floats
    last_heavier: Bools
    traffic: Floats  # (n, 6)
    host: Floats
    compute_s: Floats
    bubble_s: Floats
    communication_s: Floats
    host_s: Floats
    step_moved: Floats  # (n, moves) the step with each calibrated constant moved (Plan.moves)

    @property
    def step_s(self) -> Floats:
        return self.compute_s + self.bubble_s + self.communication_s + self.host_s

    def __len__(self) -> int:
        return int(self.family.shape[0])


@dataclass
class Plan:
    model: Model
    cluster: Cluster
    workload: Workload
    global_batch: int
    precision: Precision
    rank_by: RankBy
    families: list[Family]
    table: _Table
    fits: Bools
    order: Ints  # indices of fitting rows, best first
    enumerated: int  # (family, mesh, b) combinations before the rules
    top: list[Candidate]
    alternatives: list[Alternative]
    refuted: dict[str, str]  # family or composition -> why z3 refuted it
    decided: int
    solver: str  # "z3 (formal._smt)" or why no verdicts
    seconds: dict[str, float]
    derivations: int
    hardware: Hardware | None = None  # the calibrated step time's hardware; None: no step time (no layers)
    moves: tuple[tuple[str, float, Efficiency], ...] = ()  # constants moved by their uncertainty
    cache_hits: int = 0  # z3 verdicts read from the on-disk cache instead of decided
    hardware_assumed: bool = False  # ``hardware`` is the preset assumed from the device memory
    peaks: dict[int, EnginePrediction] = field(default_factory=dict)  # row -> its engine's peak, once computed

    def peak(self, row: int) -> EnginePrediction:
        """The row's per-device peak under its engine, as ``check`` computes it (cached)."""
        if row not in self.peaks:
            self.peaks[row] = engine_peak_of(self.candidate(row), self.model, self.precision)
        return self.peaks[row]

    def fits_exactly(self, row: int) -> bool:
        """Whether the row's engine peak plus the reserve fits the device memory."""
        return self.peak(row).total <= self.cluster.usable_memory

    @property
    def hardware_note(self) -> str:
        """``a100-80gb`` or ``a100-80gb assumed from 80 GB devices; --hardware to choose``;
        empty without a step time."""
        if self.hardware is None:
            return ""
        if not self.hardware_assumed:
            return self.hardware.name
        return f"{self.hardware.name} assumed from {gb(self.cluster.device_memory)} devices; --hardware to choose"

    def candidate(self, row: int) -> Candidate:
        return _candidate(self, row)

    def locate(self, composition: Composition, micro_batch: int = 1) -> tuple[int, Candidate] | None:
        """The published composition among the fitting candidates: (position, candidate)."""
        family, degrees = family_of(composition)
        if family not in self.families:
            return None
        fi = self.families.index(family)
        t = self.table
        hit = (t.family == fi) & np.all(t.degrees == np.array(degrees), axis=1) & (t.b == micro_batch)
        hit &= t.m == composition.options.micro_batches
        rows = np.flatnonzero(hit & self.fits)
        if rows.size == 0:
            return None
        row = int(rows[0])
        position = int(np.flatnonzero(self.order == row)[0]) + 1
        return position, self.candidate(row)

    @property
    def warnings(self) -> list[str]:
        """What the ranking cannot see: a bare parameter count has no layers, so its candidates'
        activations (0 in the memory figure) and step time (not modelled) are unknown and they
        are ranked by model states, buffers and communication bytes alone."""
        if isinstance(self.model, Transformer):
            return []
        return [
            f"{self.model.parameter_count():,} parameters without layers: activations and step time are unknown, "
            "so candidates are ranked by bytes moved per step (collectives and host transfers), "
            "without activation memory (give --model)"
        ]

    @property
    def feasible(self) -> int:
        return int(self.fits.sum())

    def pareto(self) -> Ints:
        """Rows of the fitting candidates no other fitting candidate beats on all of step time,
        memory headroom and traffic per step (and strictly on one), fastest first. A cost front:
        its members are not decided by z3 unless they are among the shown candidates."""
        rows = self.order
        if rows.size == 0:
            return rows
        t = self.table
        step = np.nan_to_num(t.step_s[rows], nan=0.0)  # untimed (no layers): headroom and traffic
        # The front is found on the screen's figure; its members are kept when their engine's
        # peak fits too, and their headroom is read from that peak.
        points = np.column_stack([step, t.memory[rows], t.traffic[rows].sum(axis=1)])
        keep: list[int] = []
        front = np.zeros((0, 3))
        for i in np.lexsort((points[:, 2], points[:, 1], points[:, 0])):
            p = points[i]
            if front.shape[0] and bool(np.any(np.all(front <= p, axis=1))):
                continue  # an earlier point is no worse on every objective (ties included)
            keep.append(int(rows[i]))
            front = np.vstack([front, p])
        return np.array([r for r in keep if self.fits_exactly(r)], dtype=np.int64)

    def sensitivity(self, k: int = 5) -> list[dict[str, Any]]:
        """How the cost ranking's top ``k`` (before z3) changes when each calibrated constant
        moves by its fitted uncertainty: the new top ``k``, who left it and who entered, and the
        first position that changed. Empty without ``hardware``."""
        if not self.moves or self.order.size == 0:
            return []
        t = self.table
        rows = self.order
        base = [int(r) for r in rows[:k]]
        out = []
        for j, (name, move, _) in enumerate(self.moves):
            moved = rows[np.argsort(t.step_moved[rows, j], kind="stable")][:k]
            new = [int(r) for r in moved]
            first = next((i + 1 for i, (a, b) in enumerate(zip(base, new, strict=True)) if a != b), None)
            out.append(
                {
                    "constant": name,
                    "move": move,
                    "top": [self.candidate(r).text for r in new],
                    "first_changed": first,
                    "left": [self.candidate(r).text for r in base if r not in new],
                    "entered": [self.candidate(r).text for r in new if r not in base],
                    "best_step_seconds": float(t.step_moved[new[0], j]),
                }
            )
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": "placement-semantics/plan/1",
            "model": getattr(self.model, "name", "") or "custom",
            "parameters": self.model.parameter_count(),
            "devices": self.cluster.devices,
            "device_memory": self.cluster.device_memory,
            "reserve": self.cluster.reserve,
            "global_batch": self.global_batch,
            "precision": self.precision.name,
            "rank_by": self.rank_by.value,
            "engine": ENGINE_RULE,
            "warnings": self.warnings,
            "counts": {
                "families": len(self.families),
                "enumerated": self.enumerated,
                "pass_rules": len(self.table),
                "fit": self.feasible,
                "z3_decisions": self.decided,
                "z3_cache_hits": self.cache_hits,
            },
            "solver": self.solver,
            "seconds": self.seconds,
            "candidates": [c.as_json() for c in self.top],
            "why": [explain_pair(a, b, self.rank_by) for a, b in itertools.pairwise(self.top)],
            "alternatives": [
                {"label": a.label, "reason": a.reason, "best": a.best.text if a.best is not None else None}
                for a in self.alternatives
            ],
            "refuted": self.refuted,
            "step_time_model": (
                f"calibrated (formal._steptime, docs/steptime.md) on {self.hardware_note}"
                if self.hardware is not None
                else "none: a bare parameter count has no layers to time (ranked by communication)"
            ),
            "hardware": self.hardware.name if self.hardware is not None else None,
            "hardware_assumed": self.hardware_assumed,
            "pareto": [
                {
                    "composition": c.text,
                    "micro_batch_size": c.micro_batch,
                    "step_seconds": c.step_s if c.timed else None,
                    "headroom_bytes": self.cluster.usable_memory - self.peak(int(r)).total,
                    "engine": self.peak(int(r)).engine.value,
                    "communication_bytes": round(c.communication),
                }
                for r, c in ((r, self.candidate(int(r))) for r in self.pareto())
            ],
            "sensitivity": self.sensitivity(max(len(self.top), 1)),
        }

    def csv(self) -> str:
        """Every fitting candidate, best first."""
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(
            [
                "position",
                "composition",
                "micro_batch_size",
                "micro_batches",
                "placement_memory_bytes",
                "stage",
                "communication_bytes",
                *[f"bytes_{a.value}" for a in AXES],
                "host_bytes",
                "step_s",
                "compute_s",
                "bubble_s",
                "communication_s",
                "host_s",
            ]
        )
        for pos, row in enumerate(self.order, start=1):
            c = self.candidate(int(row))
            w.writerow(
                [
                    pos,
                    c.text,
                    c.micro_batch,
                    c.micro_batches,
                    round(c.memory),
                    c.stage,
                    round(c.communication),
                    *[round(v) for v in c.traffic],
                    round(c.host),
                    *(
                        [f"{x:.6g}" for x in (c.step_s, c.compute_s, c.bubble_s, c.communication_s, c.host_s)]
                        if c.timed
                        else [""] * 5
                    ),
                ]
            )
        return buf.getvalue()


# The engine each candidate's peak is for: ``check``'s default by the composition's names.
ENGINE_RULE = (
    "each candidate's default engine, as check-composition prints it "
    "(zero*: deepspeed, fsdp/hsdp: fsdp2, dp: ddp, otherwise megatron)"
)


def engine_peak_of(candidate: Candidate, model: Model, precision: Precision) -> EnginePrediction:
    """The candidate's per-device peak under its default engine: ``checker._analysis.engine_peak``
    on its placement, the number ``check-composition`` prints for the same composition."""
    from checker._analysis import engine_peak
    from formal._program import group_sizes

    comp = candidate.composition()
    sized = model.with_micro_batch(candidate.micro_batch)
    engine = default_engine(tuple(s.name for s in comp.strategies))
    return engine_peak(comp.placement(sized), sized, precision, group_sizes(sized), engine)


def _candidate(plan: Plan, row: int) -> Candidate:
    t = plan.table
    pp = int(t.degrees[row][_PP])
    layers = plan.model.layers if isinstance(plan.model, Transformer) else None
    uneven = plan.workload.uneven_stages and layers is not None and layers % pp != 0
    return Candidate(
        family=plan.families[int(t.family[row])],
        degrees=tuple(int(x) for x in t.degrees[row]),
        micro_batch=int(t.b[row]),
        micro_batches=int(t.m[row]),
        memory=float(t.memory[row]),
        stage=Stage.LAST if bool(t.last_heavier[row]) else Stage.FIRST,
        traffic=tuple(float(x) for x in t.traffic[row]),
        host=float(t.host[row]),
        compute_s=float(t.compute_s[row]),
        bubble_s=float(t.bubble_s[row]),
        communication_s=float(t.communication_s[row]),
        host_s=float(t.host_s[row]),
        uneven=uneven,
    )


def family_of(composition: Composition) -> tuple[Family, tuple[int, ...]]:
    """The family and degrees (AXES order) of a composition in the planner's space."""
    mesh = composition.mesh()
    names = {s.name for s in composition.strategies}
    data = DataParallel.DP
    for kind in DataParallel:
        if kind.value in names and kind is not DataParallel.DP:
            data = kind
    if "fsdp" in names:
        data = DataParallel.ZERO3  # FSDP FULL_SHARD: ZeRO-3's placement
    o = composition.options
    offload = Offload.ALL if o.offload_parameters else Offload.OPTIMIZER if o.offload_optimizer else Offload.NONE
    pipeline = None
    if any(a.kind.is_pipeline for a in mesh):
        pipeline = Pipeline(o.schedule, o.virtual_stages)
    family = Family(data, offload, pipeline, o.sequence_parallel, o.recompute)
    return family, tuple(mesh.get(a, 1) for a in AXES)


def explain_pair(a: Candidate, b: Candidate, rank_by: RankBy) -> str:
    """Why ``a`` ranks above ``b``: the component that differs most."""
    if rank_by is RankBy.COMMUNICATION and not a.timed and a.host != b.host:  # ranked by bytes moved
        return (
            f"{a.readable} beats {b.readable}: {gb(b.communication + b.host - a.communication - a.host)} less "
            f"moved per device per step (collectives {gb(a.communication)} vs {gb(b.communication)}, host "
            f"transfers {gb(a.host)} vs {gb(b.host)})"
        )
    if rank_by is RankBy.COMMUNICATION:
        diffs = [(b.traffic[i] - a.traffic[i], AXES[i].value) for i in range(len(AXES))]
        _, axis = max(diffs)
        return (
            f"{a.readable} beats {b.readable}: {gb(b.communication - a.communication)} less traffic per device "
            f"per step, most of it on {axis} ({gb(a.traffic[AXES.index(Axis(axis))])} vs "
            f"{gb(b.traffic[AXES.index(Axis(axis))])})"
        )
    parts = {
        "pipeline bubble": (a.bubble_s, b.bubble_s),
        "communication": (a.communication_s, b.communication_s),
        "host transfers": (a.host_s, b.host_s),
        "compute (recomputation)": (a.compute_s, b.compute_s),
    }
    name, (x, y) = max(parts.items(), key=lambda kv: kv[1][1] - kv[1][0])
    gap = b.step_s - a.step_s
    text = f"{a.readable} beats {b.readable} by {gap * 1e3:.1f} ms/step: {name} {x * 1e3:.1f} vs {y * 1e3:.1f} ms"
    if name == "communication":
        i = max(range(len(AXES)), key=lambda k: b.traffic[k] - a.traffic[k])
        text += f" ({AXES[i].value}: {gb(a.traffic[i])} vs {gb(b.traffic[i])} per step)"
    if abs(gap) < 1e-12:
        text = (
            f"{a.readable} ties with {b.readable} on step time; tie broken by traffic "
            f"({gb(a.communication)} vs {gb(b.communication)}), then memory "
            f"({gb(a.exact_memory or a.memory)} vs {gb(b.exact_memory or b.memory)})"
        )
    return text


# --- popular alternatives -----------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    label: str
    data: tuple[DataParallel, ...]
    tp: int | None  # None: any; else exactly
    pipelined: bool
    cp1: bool = True


def _popular(cluster: Cluster, model: Model) -> list[_Shape]:
    n, node = cluster.devices, min(cluster.node_size, cluster.devices)
    out = [
        _Shape(f"dp{n}", (DataParallel.DP,), 1, False),
        _Shape(f"zero1(dp={n})", (DataParallel.ZERO1,), 1, False),
        _Shape(f"zero2(dp={n})", (DataParallel.ZERO2,), 1, False),
        _Shape(f"zero3(dp={n}) (FSDP)", (DataParallel.ZERO3,), 1, False),
        _Shape(f"hsdp{node}xdpr{max(n // node, 1)}", (DataParallel.HSDP,), 1, False),
    ]
    if not isinstance(model, ParameterCount) and node > 1:
        out += [
            _Shape(f"tp{node} × dp{n // node}", (DataParallel.DP,), node, False),
            _Shape(
                f"tp{node} × zero1(dp={n // node}) (Megatron distributed optimizer)",
                (DataParallel.ZERO1,),
                node,
                False,
            ),
            _Shape(f"tp{node} × fsdp{n // node} (2D)", (DataParallel.ZERO3,), node, False),
            _Shape(f"tp{node} × ppN × dp (Megatron 3D)", (DataParallel.DP, DataParallel.ZERO1), node, True),
        ]
    return out


# How many of a shape's screened rows (best first) are checked against their engine's peak.
_ALTERNATIVE_TRIES = 20


def _alternatives(result: Plan) -> list[Alternative]:
    t = result.table
    out: list[Alternative] = []
    best_row = int(result.order[0]) if result.order.size else None
    position = np.full(len(t), -1, dtype=np.int64)
    position[result.order] = np.arange(1, result.order.size + 1)
    for shape in _popular(result.cluster, result.model):
        fam_ok = np.array(
            [
                f.data in shape.data and (f.pipeline is not None) == shape.pipelined and f.offload is Offload.NONE
                for f in result.families
            ],
            dtype=bool,
        )
        sel = fam_ok[t.family] if len(t) else np.zeros(0, dtype=bool)
        if shape.tp is not None:
            sel &= t.degrees[:, _TP] == shape.tp
        if shape.cp1:
            sel &= (t.degrees[:, _CP] == 1) & (t.degrees[:, _EP] == 1)
        if not shape.pipelined:
            sel &= t.degrees[:, _PP] == 1
        if shape.data != (DataParallel.HSDP,) and shape.tp is not None and not shape.pipelined:
            sel &= t.degrees[:, _DP] == result.cluster.devices // shape.tp
        rows = np.flatnonzero(sel)
        if rows.size == 0:
            out.append(
                Alternative(
                    shape.label,
                    "no mesh of this shape passes the composition rules "
                    f"(divisibility by {shape.label}'s degrees, global batch {result.global_batch})",
                )
            )
            continue
        fitting = rows[result.fits[rows]]
        # The best-placed screened row whose engine peak fits too (a few tried, best first).
        fitting = fitting[np.argsort(position[fitting], kind="stable")]
        fitting = np.array([r for r in fitting[:_ALTERNATIVE_TRIES] if result.fits_exactly(int(r))], dtype=np.int64)
        if fitting.size == 0:
            lightest = int(rows[np.argmin(t.memory[rows])])
            c = result.candidate(lightest)
            out.append(
                Alternative(
                    shape.label,
                    f"{c.readable}: {gb(result.peak(lightest).total)} per device + "
                    f"{gb(result.cluster.reserve)} reserve > "
                    f"{gb(result.cluster.device_memory)} (the lightest variant: "
                    f"b={c.micro_batch}, recompute {c.family.recompute.value})",
                    c,
                )
            )
            continue
        row = int(fitting[np.argmin(position[fitting])])
        c = result.candidate(row)
        if best_row is not None and row == best_row:
            out.append(Alternative(shape.label, f"{c.readable} is the planner's first choice", c))
            continue
        lead = result.candidate(best_row) if best_row is not None else c
        metric = (
            f"{c.step_s * 1e3:.1f} vs {lead.step_s * 1e3:.1f} ms per step"
            if result.rank_by is RankBy.TIME
            else f"{gb(c.communication)} vs {gb(lead.communication)} per step"
        )
        out.append(
            Alternative(
                shape.label,
                f"fits as {c.readable} but ranks #{position[row]}: {metric}; " + explain_pair(lead, c, result.rank_by),
                c,
            )
        )
    return out
