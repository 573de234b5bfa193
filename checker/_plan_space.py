"""The planner's search space: the families (a composition with its degrees and micro-batch count
left open), the inputs (cluster, workload, which choices to enumerate) and the meshes.

``checker._planner`` is the entry (docs/planner.md); this module imports none of the planner's others.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt
import sympy as sp

from formal._model import Model, ParameterCount
from formal._placement import Options, Recompute, Schedule, Strategy
from formal._schedules import schedule_of
from formal._strategies import LIBRARY, Composition
from formal._vocab import Axis
from formal.errors import InputError

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

# Mesh axes, innermost first: Megatron-LM's rank order tp-cp-ep-dp-pp (parallel_state.py),
# with HSDP's replicate axis outside its shard axis. The order decides which groups fit in a node.
AXES: tuple[Axis, ...] = (Axis.TP, Axis.CP, Axis.EP, Axis.DP, Axis.DPR, Axis.PP)
DEGREES: tuple[sp.Symbol, ...] = tuple(sp.Symbol(f"d_{a.value}", positive=True, integer=True) for a in AXES)
MICRO_BATCHES = sp.Symbol("m", positive=True, integer=True)
_ARGS = (*DEGREES, MICRO_BATCHES)
_TP, _CP, _EP, _DP, _DPR, _PP = range(6)


class DataParallel(StrEnum):
    """The strategy on the data axis (ZeRO stage or FSDP mode)."""

    DP = "dp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"  # = FSDP FULL_SHARD (same placement)
    FSDP_SGO = "fsdp-sgo"
    HSDP = "hsdp"  # FSDP along dp composed with a replicate axis dpr

    def strategies(self) -> tuple[Strategy, ...]:
        match self:
            case DataParallel.HSDP:
                return (LIBRARY["hsdp"](), LIBRARY["dpr"]())
            case _:
                return (LIBRARY[self.value](),)


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # ZeRO-Offload: gradients, optimizer state and the update on the host
    ALL = "all"  # ZeRO-Infinity: parameters too

    @property
    def modifiers(self) -> tuple[str, ...]:
        match self:
            case Offload.NONE:
                return ()
            case Offload.OPTIMIZER:
                return ("offload",)
            case Offload.ALL:
                return ("offload", "offload-params")
            case _:
                raise AssertionError(self)


def offloads_for(data: DataParallel) -> tuple[Offload, ...]:
    """The offload choices implementations support: DeepSpeed's ``offload_optimizer`` needs ZeRO
    stage 1-3 and ``offload_param`` stage 3 (DeepSpeed config docs, "Parameter offloading")."""
    match data:
        case DataParallel.ZERO1 | DataParallel.ZERO2:
            return (Offload.NONE, Offload.OPTIMIZER)
        case DataParallel.ZERO3:
            return (Offload.NONE, Offload.OPTIMIZER, Offload.ALL)
        case _:
            return (Offload.NONE,)


@dataclass(frozen=True, order=True)
class Pipeline:
    """A pipeline schedule; ``chunks`` model chunks per device for the interleaved one."""

    schedule: Schedule
    chunks: int = 1

    @property
    def modifiers(self) -> tuple[str, ...]:
        return schedule_of(self.schedule).modifier_terms(self.chunks)

    def __str__(self) -> str:
        return schedule_of(self.schedule).label(self.chunks)


@dataclass(frozen=True)
class Family:
    """A composition with its degrees and micro-batch count left open."""

    data: DataParallel
    offload: Offload
    pipeline: Pipeline | None
    sequence_parallel: bool
    recompute: Recompute

    def __str__(self) -> str:
        parts = [self.data.value]
        if self.sequence_parallel:
            parts.append("sp")
        if self.pipeline is not None:
            parts.append(f"pp({self.pipeline})")
        if self.recompute is not Recompute.NONE:
            parts.append(f"recompute={self.recompute.value}")
        if self.offload is not Offload.NONE:
            parts.append(f"offload={self.offload.value}")
        return "x".join(parts)

    def options(self, micro_batches: int) -> Options:
        pipe = self.pipeline or Pipeline(Schedule.ONE_F_ONE_B)
        return Options(
            sequence_parallel=self.sequence_parallel,
            recompute=self.recompute,
            offload_optimizer=self.offload is not Offload.NONE,
            offload_parameters=self.offload is Offload.ALL,
            schedule=pipe.schedule,
            chunks=pipe.chunks,
            micro_batches=micro_batches,
        )

    def composition(self, degrees: Sequence[int], micro_batches: int, uneven: bool = False) -> Composition:
        """The family's member at ``degrees`` (in ``AXES`` order), built directly: the planner's
        one route from a family to a ``Composition``. Degree-1 axes are left out, as the
        canonical text leaves them out. ``uneven``: the layers do not divide by pp, so the
        composition declares uneven stages."""
        d = dict(zip(AXES, degrees, strict=True))
        strategies: list[Strategy] = [
            LIBRARY[axis.value]().with_degree(d[axis]) for axis in (Axis.TP, Axis.CP, Axis.EP) if d[axis] > 1
        ]
        data = self.data.strategies()
        if self.data is DataParallel.HSDP:
            strategies += [data[0].with_degree(d[Axis.DP]), data[1].with_degree(d[Axis.DPR])]
        elif d[Axis.DP] > 1 or self.data is not DataParallel.DP:
            strategies.append(data[0].with_degree(d[Axis.DP]))
        if self.pipeline is not None:
            strategies.append(LIBRARY["pp"]().with_degree(d[Axis.PP]))
        if not strategies:
            strategies.append(LIBRARY["dp"]().with_degree(1))  # one device: a strategy is needed
        options = replace(
            self.options(micro_batches),
            sequence_parallel=self.sequence_parallel and d[Axis.TP] > 1,
            uneven_stages=uneven and self.pipeline is not None,
        )
        return Composition(tuple(strategies), options, self._modifier_terms(d[Axis.TP], micro_batches, uneven))

    def text(self, degrees: Sequence[int], micro_batches: int, uneven: bool = False) -> str:
        """The composition in the composition language, canonical (``str(parse(text)) == text``):
        strategies, then modifiers; degree-1 axes are left out."""
        return str(self.composition(degrees, micro_batches, uneven))

    def _modifier_terms(self, tp: int, micro_batches: int, uneven: bool) -> tuple[str, ...]:
        """The modifier terms of a member, in the planner's order: sp, the schedule, uneven, m,
        recomputation, offload."""
        terms: list[str] = []
        if self.sequence_parallel and tp > 1:
            terms.append("sp")
        if self.pipeline is not None:
            terms += self.pipeline.modifiers
            if uneven:
                terms.append("uneven")
        if micro_batches > 1 or self.pipeline is not None:
            terms.append(f"m{micro_batches}")
        match self.recompute:
            case Recompute.FULL:
                terms.append("recompute")
            case Recompute.SELECTIVE:
                terms.append("selective")
            case Recompute.NONE:
                pass
            case _:
                raise AssertionError(self.recompute)
        terms += self.offload.modifiers
        return tuple(terms)


# --- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """Devices, their memory and node size, and per-axis link overrides. The rates (FLOP/s,
    NVLink, network, PCIe, HBM) are the step-time model's ``formal._hardware.Hardware``: the
    planner's ``hardware``, or the preset assumed from ``device_memory``."""

    devices: int
    device_memory: int  # bytes
    node_size: int = 8
    bandwidths: tuple[tuple[Axis, float], ...] = ()  # per-axis overrides (bytes/s)
    reserve: int = 0  # bytes kept back for the runtime (``--reserve``): a fit is peak + reserve <= device_memory

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise InputError(f"--devices {self.devices}: must be at least 1")
        if not 0 <= self.reserve < self.device_memory:
            raise InputError(f"--reserve {self.reserve:,} bytes: leaves nothing of {self.device_memory:,} bytes")
        if self.node_size < 1:
            raise InputError(f"--node-size {self.node_size}: must be at least 1")
        for axis, bw in self.bandwidths:
            if not bw > 0:
                raise InputError(f"--bandwidth {axis.value}={bw}: must be positive")

    @property
    def usable_memory(self) -> int:
        """Bytes of each device the training state may take: the device memory less the reserve."""
        return self.device_memory - self.reserve


@dataclass(frozen=True)
class Workload:
    """What one step processes. ``global_batch`` in sequences (default: one per device)."""

    global_batch: int | None = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    uneven_stages: bool = False  # allow layers % pp != 0 (e.g. Llama 3 405B's 126 layers on pp16)


@dataclass(frozen=True)
class Space:
    """Which choices to enumerate; ``pins`` fixes degrees (``{Axis.TP: 8}``)."""

    data: tuple[DataParallel, ...] = tuple(DataParallel)
    pipelines: tuple[Pipeline | None, ...] = (
        None,
        Pipeline(Schedule.ONE_F_ONE_B),
        Pipeline(Schedule.GPIPE),
        Pipeline(Schedule.INTERLEAVED, 2),
        Pipeline(Schedule.INTERLEAVED, 4),
        Pipeline(Schedule.ZERO_BUBBLE_H1),
    )
    sequence_parallel: tuple[bool, ...] = (False, True)
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    offload: tuple[Offload, ...] = tuple(Offload)
    pins: tuple[tuple[Axis, int], ...] = ()
    # With an interleaved schedule among ``pipelines``: also every chunk count v >= 2 that
    # divides the layers (Megatron-LM needs layers % (pp x v) == 0; the composition rules check
    # it per mesh), not only the listed ones.
    every_interleave: bool = False

    def pipeline_choices(self, model: Model) -> list[Pipeline | None]:
        pipes = list(self.pipelines)
        layers = getattr(model, "layers", None)
        if (
            self.every_interleave
            and isinstance(layers, int)
            and any(p is not None and schedule_of(p.schedule).chunked for p in pipes)
        ):
            chunked = next(p.schedule for p in pipes if p is not None and schedule_of(p.schedule).chunked)
            for v in divisors(layers):
                extra = Pipeline(chunked, v)
                if v >= 2 and extra not in pipes:
                    pipes.append(extra)
        return pipes

    def families(self, model: Model) -> list[Family]:
        bare = isinstance(model, ParameterCount)  # no activations: schedules, sp and recompute moot
        pipes = [p for p in self.pipeline_choices(model) if p is None or not bare or schedule_of(p.schedule).default]
        sps = [s for s in self.sequence_parallel if not (bare and s)]
        rcs = [r for r in self.recompute if not (bare and r is not Recompute.NONE)]
        out = []
        for data, pipe, sp_, rc in itertools.product(self.data, pipes, sps, rcs):
            for off in offloads_for(data):
                if off in self.offload:
                    out.append(Family(data, off, pipe, sp_, rc))
        return out


class RankBy(StrEnum):
    TIME = "time"
    COMMUNICATION = "communication"


# --- meshes -------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def meshes(devices: int, axes: int, pins: Mapping[int, int]) -> Ints:
    """Every tuple of ``axes`` degrees whose product is ``devices`` (pinned positions fixed)."""
    out: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...], left: int) -> None:
        i = len(prefix)
        if i == axes - 1:
            if pins.get(i, left) == left:
                out.append((*prefix, left))
            return
        for d in divisors(left):
            if pins.get(i, d) == d:
                grow((*prefix, d), left // d)

    grow((), devices)
    return np.array(out, dtype=np.int64).reshape(-1, axes)
