"""The planner: the best valid composition for a model on a cluster.

How it works (docs/planner.md has the long form):

1. **Families.** A *family* is a composition with its degrees and micro-batch count left open:
   the data-axis strategy (DP, ZeRO-1/2/3, FSDP shard-grad-op, HSDP), offload, pipeline schedule,
   sequence parallelism and recomputation. Every family carries the axes tp, cp, (ep), dp, (dpr)
   and, when it pipelines, pp.
2. **Exact, then vectorized.** For each family the cost core (``Composition.placement(model,
   symbolic=True)``, ``derive_program``, ``memory``, ``communication``) produces exact sympy
   expressions in the degree symbols ``d_tp, d_cp, d_ep, d_dp, d_dpr, d_pp`` and the micro-batch
   count ``m``; they are lambdified once and evaluated with numpy on every mesh of the family.
   The expressions are derived per *component* (model-state memory, model-state traffic,
   activation memory and traffic), each keyed by only the choices it depends on, so one family
   costs no new derivation when its components are known. A degree of 1 is the same expression
   at 1 (ring factors ``(d-1)/d`` vanish, shard factors become 1), except for pp, whose presence
   is structural (stage placement, point-to-point sends). Activation terms are derived at
   micro-batch size 1 and scaled by it (Korthikanti's bytes are linear in ``b``).
3. **Rank** the candidates that pass the composition rules checkable from numbers (section 4.1
   of the semantics: divisibility, prerequisites) and whose most-loaded device fits, by the step
   time estimate (``StepTimeModel``) or by communication.
4. **Prove.** Walk the ranking from the top; every shown candidate is recomputed exactly (integer
   costs through ``checker._analysis``, cross-checking the vectorized numbers) and decided by z3
   (``formal._smt.decide``), one call per structurally distinct family first (a family refuted on
   gradient integrity or state consistency is refuted for every degree), then per candidate.
   Nothing is called valid unless z3 proved it; without ``formal._smt`` candidates are shown as
   unproved.
"""

from __future__ import annotations

import csv
import importlib
import io
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import sympy as sp

from checker._numbers import MAX_DEGREE, gb
from checker._parse import parse
from formal._costs import (
    STAGES,
    activation_memory,
    bubble_fraction,
    busiest_stage_traffic,
    ceil_int,
    communication,
    memory,
    most_loaded,
    total_bytes,
    transfers,
)
from formal._model import DEFAULT_PRECISION, Model, ParameterCount, Precision, Transformer
from formal._placement import Options, Recompute, Schedule, Strategy
from formal._program import StepProgram, derive_program, group_sizes
from formal._rules import Provenance, Setting, applicable, framework_notes, setting_for
from formal._schedules import schedule_of
from formal._strategies import LIBRARY, Composition
from formal._verdict import Condition, Status, Verdict
from formal._vocab import EXPERTS, Axis, Stage, State
from formal.errors import InputError

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Decide = Callable[[Composition, StepProgram, Model], Verdict]

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
        return Options(sequence_parallel=self.sequence_parallel, recompute=self.recompute,
                       offload_optimizer=self.offload is not Offload.NONE,
                       offload_parameters=self.offload is Offload.ALL, schedule=pipe.schedule,
                       chunks=pipe.chunks, micro_batches=micro_batches)

    def text(self, degrees: Sequence[int], micro_batches: int, uneven: bool = False) -> str:
        """The composition in the composition language, canonical (``str(parse(text)) == text``):
        strategies, then modifiers; degree-1 axes are left out. ``uneven``: the layers do not
        divide by pp, so the composition declares uneven stages."""
        d = dict(zip(AXES, degrees, strict=True))
        terms: list[str] = [f"{axis.value}{d[axis]}" for axis in (Axis.TP, Axis.CP, Axis.EP) if d[axis] > 1]
        if self.data is DataParallel.HSDP:
            terms += [f"hsdp{d[Axis.DP]}", f"dpr{d[Axis.DPR]}"]
        elif d[Axis.DP] > 1 or self.data is not DataParallel.DP:
            terms.append(f"{self.data.value}{d[Axis.DP]}")
        if self.pipeline is not None:
            terms.append(f"pp{d[Axis.PP]}")
        if not terms:
            terms.append("dp1")  # one device: the composition language needs a strategy
        if self.sequence_parallel and d[Axis.TP] > 1:
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
        return "x".join(terms)


# --- inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """Devices and links. Defaults: NVIDIA Selene / DGX A100 as in Narayanan et al. 2021
    (8 A100 80GB per node; NVLink 600 GB/s bidirectional = 300 GB/s per direction; 8 HDR
    InfiniBand 200 Gb/s NICs per node = 25 GB/s per GPU; 312 TFLOP/s dense bf16 per A100) and
    PCIe 4.0 x16 (~32 GB/s) to the host."""

    devices: int
    device_memory: int  # bytes
    node_size: int = 8
    intra_node_bandwidth: float = 300e9  # bytes/s per device, one direction
    inter_node_bandwidth: float = 25e9  # bytes/s per device
    host_bandwidth: float = 32e9  # bytes/s per device, PCIe
    device_flops: float = 312e12  # FLOP/s per device
    bandwidths: tuple[tuple[Axis, float], ...] = ()  # per-axis overrides (bytes/s)

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise InputError(f"--devices {self.devices}: must be at least 1")
        if self.node_size < 1:
            raise InputError(f"--node-size {self.node_size}: must be at least 1")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth", "device_flops"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name}={getattr(self, name)}: must be positive")
        for axis, bw in self.bandwidths:
            if not bw > 0:
                raise InputError(f"--bandwidth {axis.value}={bw}: must be positive")


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
        None, Pipeline(Schedule.ONE_F_ONE_B), Pipeline(Schedule.GPIPE),
        Pipeline(Schedule.INTERLEAVED, 2), Pipeline(Schedule.INTERLEAVED, 4),
    )
    sequence_parallel: tuple[bool, ...] = (False, True)
    recompute: tuple[Recompute, ...] = tuple(Recompute)
    offload: tuple[Offload, ...] = tuple(Offload)
    pins: tuple[tuple[Axis, int], ...] = ()

    def families(self, model: Model) -> list[Family]:
        bare = isinstance(model, ParameterCount)  # no activations: schedules, sp and recompute moot
        pipes = [p for p in self.pipelines if p is None or not bare or schedule_of(p.schedule).default]
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


# --- the step-time model ------------------------------------------------------------------


@dataclass(frozen=True)
class StepTimeModel:
    """Step time = compute x (1 + bubble) + sum over axes of traffic / bandwidth + host / PCIe.

    * compute: training FLOPs per step over (devices x device FLOP/s), at peak; FLOPs per token
      are 3 x (2 Psi_active + 4 l s h) (forward 2 Psi + attention scores 4 l s h, backward twice
      that: Narayanan et al. 2021 eq. 3), plus one more forward with full recomputation and the
      attention-score forward (4 l s h) with selective recomputation (Korthikanti et al. 2022).
      Psi_active counts top_k of the experts for an MoE model. A bare parameter count has no
      sequence and no layers: its compute is left out and it is ranked by communication time.
    * bubble: the pipeline bubble fraction of the cost core, (p-1)/m or (p-1)/(v m), of compute.
    * communication: no overlap with compute (an upper bound); each axis at the bandwidth of its
      groups: intra-node when the axis and every axis inside it fit in one node (order
      tp, cp, ep, dp, dpr, pp), else inter-node, unless overridden per axis.
    """

    cluster: Cluster

    def flops_per_token(self, model: Model, recompute: Recompute) -> float:
        if not isinstance(model, Transformer):
            return 0.0
        groups = model.group_elements()
        active = sum(groups.values())
        if model.is_moe:
            active -= groups.get(EXPERTS, 0) * (model.experts - model.top_k) // model.experts
        attention = 4 * model.layers * model.seq * model.hidden
        forward = 2 * active + attention
        match recompute:
            case Recompute.NONE:
                extra = 0
            case Recompute.SELECTIVE:
                extra = attention
            case Recompute.FULL:
                extra = forward
            case _:
                raise AssertionError(recompute)
        return float(3 * forward + extra)

    def compute_seconds(self, model: Model, recompute: Recompute, tokens: int) -> float:
        return self.flops_per_token(model, recompute) * tokens / (self.cluster.devices * self.cluster.device_flops)

    def bandwidths(self, degrees: Ints) -> Floats:
        """Bytes/s per (candidate, axis) from the node size and the overrides."""
        inner = np.cumprod(degrees, axis=1)
        c = self.cluster
        bw = np.where(inner <= c.node_size, c.intra_node_bandwidth, c.inter_node_bandwidth).astype(np.float64)
        for axis, value in c.bandwidths:
            bw[:, AXES.index(axis)] = value
        return bw


# --- exact expressions, vectorized --------------------------------------------------------

_VMAX = sp.Function("vmax")
_VMIN = sp.Function("vmin")


def _vmax(*xs: Floats) -> Floats:
    out = xs[0]
    for x in xs[1:]:
        out = np.maximum(out, x)
    return out


def _vmin(*xs: Floats) -> Floats:
    out = xs[0]
    for x in xs[1:]:
        out = np.minimum(out, x)
    return out


@dataclass(frozen=True)
class Vectorized:
    """Exact sympy expressions in the degree symbols and ``m``, evaluated with numpy."""

    expressions: tuple[sp.Expr, ...]
    function: Callable[..., Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, expressions: Iterable[sp.Expr]) -> Vectorized:
        exprs = tuple(sp.sympify(e) for e in expressions)
        unknown = set().union(*(e.free_symbols for e in exprs)) - set(_ARGS)
        assert not unknown, f"unexpected symbols {unknown}"  # the core only uses these
        # Max/Min print as numpy.amax of a tuple, which breaks on scalar/array mixes.
        vector = [e.replace(sp.Max, _VMAX).replace(sp.Min, _VMIN) for e in exprs]
        fn = sp.lambdify(_ARGS, vector, modules=[{"vmax": _vmax, "vmin": _vmin}, "numpy"], docstring_limit=0)
        return cls(exprs, fn)

    def __call__(self, columns: Floats) -> list[Floats]:
        n = columns.shape[0]
        values = self.function(*columns.T)
        return [np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)) for v in values]


@dataclass(frozen=True)
class _StatesKey:
    data: DataParallel
    offload: Offload
    pipelined: bool


@dataclass(frozen=True)
class _StateTrafficKey:
    data: DataParallel
    offload: Offload
    pipelined: bool
    sequence_parallel: bool


@dataclass(frozen=True)
class _ActivationKey:
    pipeline: Pipeline | None
    sequence_parallel: bool
    recompute: Recompute


class Deriver:
    """Derives and caches the component expressions of families for one model and precision."""

    def __init__(self, model: Model, precision: Precision, uneven_stages: bool = False) -> None:
        self.model = model.with_micro_batch(1)  # activation terms are scaled by b afterwards
        self.precision = precision
        # Pipelined families charged ceil(L/p) layers per stage (equal to L/p where p divides L).
        self.uneven_stages = uneven_stages
        self.sizes = group_sizes(self.model)
        self._states: dict[_StatesKey, Vectorized] = {}
        self._state_traffic: dict[_StateTrafficKey, Vectorized] = {}
        self._activations: dict[_ActivationKey, Vectorized] = {}
        self.derivations = 0

    def representative(self, family: Family) -> Composition:
        """The family with every axis present (degree 2) and ``m`` symbolic."""
        strategies: list[Strategy] = [LIBRARY["tp"](), LIBRARY["cp"]()]
        if self.model.is_moe:
            strategies.append(LIBRARY["ep"]())
        strategies += family.data.strategies()
        if family.pipeline is not None:
            strategies.append(LIBRARY["pp"]())
        options = family.options(cast(int, MICRO_BATCHES))  # the core reads it through sp.sympify
        if self.uneven_stages and family.pipeline is not None:
            options = replace(options, uneven_stages=True)
        return Composition(tuple(s.with_degree(2) for s in strategies), options)

    def _placement_program(self, family: Family) -> tuple[Any, StepProgram]:
        pl = self.representative(family).placement(self.model, symbolic=True)
        self.derivations += 1
        return pl, derive_program(pl, self.model, self.sizes)

    def states(self, family: Family) -> Vectorized:
        """[model states + buffers on the first stage, on the last stage, host bytes per step]."""
        key = _StatesKey(family.data, family.offload, family.pipeline is not None)
        if key not in self._states:
            base = replace(family, sequence_parallel=False, recompute=Recompute.NONE,
                           pipeline=Pipeline(Schedule.ONE_F_ONE_B) if key.pipelined else None)
            pl, program = self._placement_program(base)
            exprs: list[sp.Expr] = []
            for stage in (Stage.FIRST, Stage.LAST):
                mem = memory(pl, self.model, self.precision, self.sizes, stage)
                exprs.append(mem.model_states + (mem.buffers if mem.buffers is not None else 0))
            exprs.append(sum((t[4] for t in transfers(program, self.precision)), sp.Integer(0)))
            self._states[key] = Vectorized.of(exprs)
        return self._states[key]

    def state_traffic(self, family: Family) -> Vectorized:
        """Bytes per device per step of model-state collectives, one expression per axis, for a
        device of each pipeline stage (first, middle, last: ``op_stage_factor``)."""
        key = _StateTrafficKey(family.data, family.offload, family.pipeline is not None, family.sequence_parallel)
        if key not in self._state_traffic:
            base = replace(family, recompute=Recompute.NONE,
                           pipeline=Pipeline(Schedule.ONE_F_ONE_B) if key.pipelined else None)
            _, program = self._placement_program(base)
            self._state_traffic[key] = Vectorized.of(
                [x for stage in STAGES for x in _per_axis(
                    t for t in communication(program, self.precision, stage) if t.state is not State.ACTIVATIONS)])
        return self._state_traffic[key]

    def activations(self, family: Family) -> Vectorized:
        """[activation bytes first stage, last stage, bubble fraction, traffic per axis for a device
        of each pipeline stage (first, middle, last)...] at b=1."""
        key = _ActivationKey(family.pipeline, family.sequence_parallel, family.recompute)
        if key not in self._activations:
            base = replace(family, data=DataParallel.DP, offload=Offload.NONE)
            pl, program = self._placement_program(base)
            exprs: list[sp.Expr] = []
            for stage in (Stage.FIRST, Stage.LAST):
                act = activation_memory(pl, self.model, self.precision, stage)
                exprs.append(act if act is not None else sp.Integer(0))
            exprs.append(bubble_fraction(pl))
            for stage in STAGES:
                exprs += _per_axis(t for t in communication(program, self.precision, stage)
                                   if t.state is State.ACTIVATIONS)
            self._activations[key] = Vectorized.of(exprs)
        return self._activations[key]


def _per_axis(traffic: Iterable[Any]) -> list[sp.Expr]:
    out = {axis: sp.Integer(0) for axis in AXES}
    for t in traffic:
        out[t.axis] += t.bytes
    return [out[a] for a in AXES]


# --- meshes and the composition rules checkable from numbers ------------------------------


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


def _divides(x: Ints, n: int) -> Bools:
    return cast(Bools, n % x == 0)


def mesh_rules(model: Model, global_batch: int, uneven: bool, deg: Ints, b: Ints) -> dict[str, Bools]:
    """The workload's own rule, before any family: the replicas divide the global batch (so
    that the micro-batch count m is a whole number)."""
    replicas = deg[:, _DP] * deg[:, _DPR] * deg[:, _EP] * b
    # The micro-batch count is spelled m<N> in the composition, whose degrees are bounded.
    return {"batch": _divides(replicas, global_batch), "micro_batches_bounded": global_batch // replicas <= MAX_DEGREE}


class _ArrayTerms:
    """``formal._rules.Terms`` over numpy arrays: one row per candidate mesh. An axis is present
    when its degree exceeds 1 (the planner's compositions leave degree-1 axes out)."""

    def __init__(self, deg: Ints, m: Ints) -> None:
        self._deg, self._m = deg, m

    def degree(self, axis: Axis) -> Ints:
        return self._deg[:, AXES.index(axis)]

    def present(self, axis: Axis) -> Bools:
        return self.degree(axis) > 1

    def size(self, name: str, value: int) -> int:
        return value

    def flag(self, name: str, value: bool) -> bool:
        return value

    def implies(self, a: Any, b: Any) -> Bools:
        return cast(Bools, np.logical_or(np.logical_not(a), b))

    @property
    def micro_batches(self) -> Ints:
        return self._m


def family_setting(family: Family, model: Model, uneven: bool) -> Setting:
    """The rules' setting of a family: its modifiers, every axis of the planner's mesh."""
    return Setting(model, replace(family.options(1), uneven_stages=uneven), frozenset(AXES))


def family_rules(family: Family, model: Model, uneven: bool, deg: Ints, m: Ints) -> dict[str, Bools]:
    """The correctness rules of ``formal._rules`` (the table z3 decides), vectorised over the
    candidate meshes, and the family's own canonical form (a family with a pipeline has pp > 1,
    HSDP both of its axes, ZeRO/FSDP a dp axis: otherwise it is another family's candidate).
    Framework rules filter nothing: they become notes on the candidates that break them."""
    terms, setting = _ArrayTerms(deg, m), family_setting(family, model, uneven)
    rules: dict[str, Bools] = {}
    for rule in applicable(setting, Provenance.CORRECTNESS):
        rules[rule.name] = np.broadcast_to(np.asarray(rule.holds(terms, setting), dtype=bool), (deg.shape[0],))
    p, dp, dpr = deg[:, _PP], deg[:, _DP], deg[:, _DPR]
    if family.pipeline is None:
        rules["no_pipeline_means_pp1"] = p == 1
    else:
        rules["pipeline_needs_pp"] = p > 1
    if family.data is DataParallel.HSDP:
        rules["hsdp_needs_both_axes"] = (dp > 1) & (dpr > 1)
    else:
        rules["dpr_only_with_hsdp"] = dpr == 1
        if family.data is not DataParallel.DP:
            rules["sharding_needs_dp"] = dp > 1  # ZeRO/FSDP at dp=1 is DP
    return rules


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One composition with its costs (bytes, seconds) and, once decided, its z3 verdict."""

    family: Family
    degrees: tuple[int, ...]  # in AXES order
    micro_batch: int  # b, sequences per micro-batch per replica
    micro_batches: int  # m per step
    memory: float  # bytes on the most-loaded device (vectorized; exact below when confirmed)
    stage: str
    traffic: tuple[float, ...]  # bytes per device per step, per axis (AXES order)
    host: float
    compute_s: float
    bubble_s: float
    communication_s: float
    host_s: float
    rank: int = 0
    exact_memory: int | None = None
    exact_communication: int | None = None
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
        return self.compute_s + self.bubble_s + self.communication_s + self.host_s

    def composition(self) -> Composition:
        return parse(self.text)

    def framework_notes(self, model: Model) -> tuple[str, ...]:
        """The framework rules this candidate breaks (``check`` prints the same notes)."""
        comp = self.composition()
        return framework_notes(setting_for(comp, model), comp.mesh())

    def as_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "composition": self.text, "family": str(self.family),
            "mesh": {a.value: d for a, d in zip(AXES, self.degrees, strict=True) if d > 1},
            "micro_batch_size": self.micro_batch, "micro_batches": self.micro_batches,
            "memory_bytes": self.exact_memory if self.exact_memory is not None else round(self.memory),
            "most_loaded_stage": self.stage,
            "communication_bytes": (self.exact_communication if self.exact_communication is not None
                                    else round(self.communication)),
            "communication_by_axis": {a.value: round(v) for a, v in zip(AXES, self.traffic, strict=True) if v},
            "host_bytes": round(self.host),
            "step_seconds": {"total": self.step_s, "compute": self.compute_s, "bubble": self.bubble_s,
                             "communication": self.communication_s, "host": self.host_s},
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
    def feasible(self) -> int:
        return int(self.fits.sum())

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": "placement-semantics/plan/1",
            "model": getattr(self.model, "name", "") or "custom",
            "parameters": self.model.parameter_count(),
            "devices": self.cluster.devices, "device_memory": self.cluster.device_memory,
            "global_batch": self.global_batch, "precision": self.precision.name,
            "rank_by": self.rank_by.value,
            "counts": {"families": len(self.families), "enumerated": self.enumerated,
                       "pass_rules": len(self.table), "fit": self.feasible, "z3_decisions": self.decided},
            "solver": self.solver,
            "seconds": self.seconds,
            "candidates": [c.as_json() for c in self.top],
            "why": [explain_pair(a, b, self.rank_by) for a, b in itertools.pairwise(self.top)],
            "alternatives": [{"label": a.label, "reason": a.reason,
                              "best": a.best.text if a.best is not None else None} for a in self.alternatives],
            "refuted": self.refuted,
            "step_time_model": (StepTimeModel.__doc__ or "").strip(),
        }

    def csv(self) -> str:
        """Every fitting candidate, best first."""
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["position", "composition", "micro_batch_size", "micro_batches", "memory_bytes", "stage",
                    "communication_bytes", *[f"bytes_{a.value}" for a in AXES], "host_bytes",
                    "step_s", "compute_s", "bubble_s", "communication_s", "host_s"])
        for pos, row in enumerate(self.order, start=1):
            c = self.candidate(int(row))
            w.writerow([pos, c.text, c.micro_batch, c.micro_batches, round(c.memory), c.stage,
                        round(c.communication), *[round(v) for v in c.traffic], round(c.host),
                        f"{c.step_s:.6g}", f"{c.compute_s:.6g}", f"{c.bubble_s:.6g}",
                        f"{c.communication_s:.6g}", f"{c.host_s:.6g}"])
        return buf.getvalue()


def _candidate(plan: Plan, row: int) -> Candidate:
    t = plan.table
    pp = int(t.degrees[row][_PP])
    layers = plan.model.layers if isinstance(plan.model, Transformer) else None
    uneven = plan.workload.uneven_stages and layers is not None and layers % pp != 0
    return Candidate(
        family=plan.families[int(t.family[row])], degrees=tuple(int(x) for x in t.degrees[row]),
        micro_batch=int(t.b[row]), micro_batches=int(t.m[row]), memory=float(t.memory[row]),
        stage=Stage.LAST if bool(t.last_heavier[row]) else Stage.FIRST,
        traffic=tuple(float(x) for x in t.traffic[row]), host=float(t.host[row]),
        compute_s=float(t.compute_s[row]), bubble_s=float(t.bubble_s[row]),
        communication_s=float(t.communication_s[row]), host_s=float(t.host_s[row]), uneven=uneven,
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
    if Axis.PP in mesh:
        pipeline = Pipeline(o.schedule, o.virtual_stages)
    family = Family(data, offload, pipeline, o.sequence_parallel, o.recompute)
    return family, tuple(mesh.get(a, 1) for a in AXES)


def explain_pair(a: Candidate, b: Candidate, rank_by: RankBy) -> str:
    """Why ``a`` ranks above ``b``: the component that differs most."""
    if rank_by is RankBy.COMMUNICATION:
        diffs = [(b.traffic[i] - a.traffic[i], AXES[i].value) for i in range(len(AXES))]
        _, axis = max(diffs)
        return (f"{a.text} beats {b.text}: {gb(b.communication - a.communication)} less traffic per device "
                f"per step, most of it on {axis} ({gb(a.traffic[AXES.index(Axis(axis))])} vs "
                f"{gb(b.traffic[AXES.index(Axis(axis))])})")
    parts = {
        "pipeline bubble": (a.bubble_s, b.bubble_s),
        "communication": (a.communication_s, b.communication_s),
        "host transfers": (a.host_s, b.host_s),
        "compute (recomputation)": (a.compute_s, b.compute_s),
    }
    name, (x, y) = max(parts.items(), key=lambda kv: kv[1][1] - kv[1][0])
    gap = b.step_s - a.step_s
    text = f"{a.text} beats {b.text} by {gap * 1e3:.1f} ms/step: {name} {x * 1e3:.1f} vs {y * 1e3:.1f} ms"
    if name == "communication":
        i = max(range(len(AXES)), key=lambda k: b.traffic[k] - a.traffic[k])
        text += f" ({AXES[i].value}: {gb(a.traffic[i])} vs {gb(b.traffic[i])} per step)"
    if abs(gap) < 1e-12:
        text = (f"{a.text} ties with {b.text} on step time; tie broken by traffic "
                f"({gb(a.communication)} vs {gb(b.communication)}), then memory "
                f"({gb(a.exact_memory or a.memory)} vs {gb(b.exact_memory or b.memory)})")
    return text


# --- the planner --------------------------------------------------------------------------


def load_decide() -> tuple[Decide | None, str]:
    """``formal._smt.decide`` when it exists; otherwise None and why."""
    try:
        module = importlib.import_module("formal._smt")
    except ImportError as err:
        return None, f"no z3 verdicts: formal._smt not importable ({err})"
    decide = getattr(module, "decide", None)
    if decide is None:
        return None, "no z3 verdicts: formal._smt has no decide()"
    return cast(Decide, decide), "z3 (formal._smt.decide)"


_DERIVERS: dict[tuple[Model, Precision, bool], Deriver] = {}


def deriver_for(model: Model, precision: Precision, uneven_stages: bool = False) -> Deriver:
    key = (model.with_micro_batch(1), precision, uneven_stages)
    if key not in _DERIVERS:
        _DERIVERS[key] = Deriver(model, precision, uneven_stages)
    return _DERIVERS[key]


def plan(model: Model, cluster: Cluster, workload: Workload = Workload(), precision: Precision = DEFAULT_PRECISION,
         space: Space = Space(), top: int = 5, rank_by: RankBy = RankBy.TIME,
         decide: Decide | str | None = "auto", max_decisions: int = 60) -> Plan:
    """Enumerate, evaluate, rank and prove (see the module docstring)."""
    clock = {"start": time.perf_counter()}
    if top < 1:
        raise InputError(f"--top {top}: must be at least 1")
    n = cluster.devices
    global_batch = workload.global_batch if workload.global_batch is not None else n
    if global_batch < 1:
        raise InputError(f"--global-batch {global_batch}: must be at least 1")
    for bsz in workload.micro_batch_sizes:
        if bsz < 1:
            raise InputError(f"micro-batch size {bsz}: must be at least 1")
    pins = {AXES.index(a): d for a, d in space.pins}
    for axis, d in space.pins:
        if d < 1 or n % d:
            raise InputError(f"--fix {axis.value}={d}: must divide --devices {n}")
    deriver = deriver_for(model, precision, workload.uneven_stages)
    timing = StepTimeModel(cluster)
    families = space.families(model)
    tokens = global_batch * (model.seq if isinstance(model, Transformer) else 0)

    all_meshes = meshes(n, len(AXES), pins)
    deg = np.repeat(all_meshes, len(workload.micro_batch_sizes), axis=0)
    b = np.tile(np.array(workload.micro_batch_sizes, dtype=np.int64), all_meshes.shape[0])
    base_ok = np.ones(deg.shape[0], dtype=bool)
    for mask in mesh_rules(model, global_batch, workload.uneven_stages, deg, b).values():
        base_ok &= mask
    deg, b = deg[base_ok], b[base_ok]
    replicas = deg[:, _DP] * deg[:, _DPR] * deg[:, _EP] * b
    m = global_batch // replicas
    bandwidth = timing.bandwidths(deg)
    enumerated = len(families) * all_meshes.shape[0] * len(workload.micro_batch_sizes)
    clock["enumerate"] = time.perf_counter()

    blocks: list[_Table] = []
    for fi, family in enumerate(families):
        ok = np.ones(deg.shape[0], dtype=bool)
        for mask in family_rules(family, model, workload.uneven_stages, deg, m).values():
            ok &= mask
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            continue
        blocks.append(_evaluate(deriver, timing, family, fi, deg[rows], b[rows], m[rows], bandwidth[rows],
                                timing.compute_seconds(model, family.recompute, tokens)))
    table = _concat(blocks)
    clock["evaluate"] = time.perf_counter()

    # The ZeRO paper's capacity tables are exact at the boundary (16 Psi / N = 32 GB): allow
    # float rounding here, and confirm every shown candidate with exact integers.
    fits = table.memory <= cluster.device_memory * (1 + 1e-12)
    fit_rows = np.flatnonzero(fits)
    comm = table.traffic.sum(axis=1)
    if rank_by is RankBy.TIME:
        keys = (table.memory[fit_rows], comm[fit_rows], table.step_s[fit_rows])
    else:
        keys = (table.memory[fit_rows], table.step_s[fit_rows], comm[fit_rows])
    order = fit_rows[np.lexsort(keys)]
    clock["rank"] = time.perf_counter()

    decide_fn, solver = load_decide() if decide == "auto" else (cast(Decide | None, decide), "given decide()")
    if decide_fn is None and decide != "auto":
        solver = "no z3 verdicts: decide disabled"
    result = Plan(model, cluster, workload, global_batch, precision, rank_by, families, table, fits,
                  order.astype(np.int64), enumerated, [], [], {}, 0, solver, {}, deriver.derivations)
    _prove_top(result, deriver, decide_fn, top, max_decisions)
    clock["prove"] = time.perf_counter()
    result.alternatives = _alternatives(result)
    clock["explain"] = time.perf_counter()
    stamps = list(clock.items())
    result.seconds = {name: round(t - prev, 4) for (_, prev), (name, t) in itertools.pairwise(stamps)}
    result.seconds["total"] = round(stamps[-1][1] - stamps[0][1], 4)
    result.derivations = deriver.derivations
    return result


def _evaluate(deriver: Deriver, timing: StepTimeModel, family: Family, fi: int, deg: Ints, b: Ints, m: Ints,
              bandwidth: Floats, compute_s: float) -> _Table:
    cols = np.column_stack([deg.astype(np.float64), m.astype(np.float64)])
    first_s, last_s, host = deriver.states(family)(cols)
    straffic = np.column_stack(deriver.state_traffic(family)(cols))
    act = deriver.activations(family)(cols)
    bf = b.astype(np.float64)
    first = first_s + bf * act[0]
    last = last_s + bf * act[1]
    n = deg.shape[0]
    # Per pipeline stage (first, middle, last), per axis; the device that sends the most counts
    # (a middle stage exists beyond two stages; the first wins a tie, as in busiest_stage_traffic).
    per_stage = (straffic + bf[:, None] * np.column_stack(act[3:])).reshape(n, len(STAGES), len(AXES))
    totals = per_stage.sum(axis=2)
    totals[:, 1] = np.where(deg[:, _PP] > 2, totals[:, 1], -np.inf)
    traffic = per_stage[np.arange(n), np.argmax(totals, axis=1), :]
    return _Table(
        family=np.full(n, fi, dtype=np.int64), degrees=deg, b=b, m=m,
        memory=np.maximum(first, last), last_heavier=last > first, traffic=traffic, host=np.asarray(host),
        compute_s=np.full(n, compute_s), bubble_s=act[2] * compute_s,
        communication_s=(traffic / bandwidth).sum(axis=1), host_s=host / timing.cluster.host_bandwidth,
    )


def _concat(blocks: list[_Table]) -> _Table:
    if not blocks:
        z = np.zeros(0)
        zi = np.zeros(0, dtype=np.int64)
        return _Table(zi, np.zeros((0, len(AXES)), dtype=np.int64), zi, zi, z, np.zeros(0, dtype=bool),
                      np.zeros((0, len(AXES))), z, z, z, z, z)
    return _Table(*(np.concatenate([getattr(bl, f) for bl in blocks]) for f in (
        "family", "degrees", "b", "m", "memory", "last_heavier", "traffic", "host", "compute_s", "bubble_s",
        "communication_s", "host_s")))


def exact_costs(candidate: Candidate, model: Model, precision: Precision) -> tuple[int, int, str, StepProgram]:
    """Exact integer memory of the most-loaded device and bytes per step, from the core."""
    comp = candidate.composition()
    sized = model.with_micro_batch(candidate.micro_batch)
    pl = comp.placement(sized)
    program = derive_program(pl, sized)
    mem = most_loaded(pl, sized, precision, group_sizes(sized))
    traffic = busiest_stage_traffic(program, precision)[1]
    return ceil_int(mem.total), ceil_int(total_bytes(traffic)), mem.stage, program


_STRUCTURAL = (Condition.GRADIENT_INTEGRITY, Condition.STATE_CONSISTENCY)


def _prove_top(result: Plan, deriver: Deriver, decide: Decide | None, top: int, max_decisions: int) -> None:
    """Walk the ranking: confirm costs exactly, then let z3 decide, until ``top`` are shown."""
    refuted_families: set[int] = set()
    for row in result.order:
        if len(result.top) >= top or result.decided >= max_decisions:
            break
        cand = result.candidate(int(row))
        fi = int(result.table.family[row])
        if fi in refuted_families:
            continue
        mem, comm, stage, program = exact_costs(cand, result.model, result.precision)
        if mem > result.cluster.device_memory:
            continue  # within float rounding of the capacity, and over it exactly
        cand = replace(cand, exact_memory=mem, exact_communication=comm, stage=stage)
        if decide is None:
            result.top.append(replace(cand, rank=len(result.top) + 1, status=None,
                                      verdict_note="unproved: " + result.solver))
            continue
        verdict = decide(cand.composition(), program, result.model.with_micro_batch(cand.micro_batch))
        result.decided += 1
        if verdict.status is Status.PROVED:
            result.top.append(replace(cand, rank=len(result.top) + 1, status=Status.PROVED, verdict_note="proved",
                                      notes=cand.framework_notes(result.model)))
            continue
        rules = ", ".join(v.rule for v in verdict.violations) or ", ".join(
            f"{o.name}: {o.reason_unknown}" for o in verdict.obligations if o.status is Status.UNKNOWN)
        if verdict.status is Status.REFUTED and any(v.condition in _STRUCTURAL for v in verdict.violations):
            refuted_families.add(fi)
            result.refuted[str(cand.family)] = f"refuted on {cand.text}: {rules}"
        else:
            result.refuted[cand.text] = f"{verdict.status.label}: {rules}"


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
        _Shape(f"zero1{n}", (DataParallel.ZERO1,), 1, False),
        _Shape(f"zero2{n}", (DataParallel.ZERO2,), 1, False),
        _Shape(f"zero3{n} (FSDP)", (DataParallel.ZERO3,), 1, False),
        _Shape(f"hsdp{node}xdpr{max(n // node, 1)}", (DataParallel.HSDP,), 1, False),
    ]
    if not isinstance(model, ParameterCount) and node > 1:
        out += [
            _Shape(f"tp{node}xdp{n // node}", (DataParallel.DP,), node, False),
            _Shape(f"tp{node}xzero1{n // node} (Megatron distributed optimizer)", (DataParallel.ZERO1,), node, False),
            _Shape(f"tp{node}xfsdp{n // node} (2D)", (DataParallel.ZERO3,), node, False),
            _Shape(f"tp{node}xppNxdp (Megatron 3D)", (DataParallel.DP, DataParallel.ZERO1), node, True),
        ]
    return out


def _alternatives(result: Plan) -> list[Alternative]:
    t = result.table
    out: list[Alternative] = []
    best_row = int(result.order[0]) if result.order.size else None
    position = np.full(len(t), -1, dtype=np.int64)
    position[result.order] = np.arange(1, result.order.size + 1)
    for shape in _popular(result.cluster, result.model):
        fam_ok = np.array([f.data in shape.data and (f.pipeline is not None) == shape.pipelined
                           and f.offload is Offload.NONE for f in result.families], dtype=bool)
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
            out.append(Alternative(shape.label, "no mesh of this shape passes the composition rules "
                                   f"(divisibility by {shape.label}'s degrees, global batch {result.global_batch})"))
            continue
        fitting = rows[result.fits[rows]]
        if fitting.size == 0:
            lightest = int(rows[np.argmin(t.memory[rows])])
            c = result.candidate(lightest)
            out.append(Alternative(shape.label, f"{c.text}: {gb(c.memory)} per device > "
                                   f"{gb(result.cluster.device_memory)} (the lightest variant: "
                                   f"b={c.micro_batch}, recompute {c.family.recompute.value})", c))
            continue
        row = int(fitting[np.argmin(position[fitting])])
        c = result.candidate(row)
        if best_row is not None and row == best_row:
            out.append(Alternative(shape.label, f"{c.text} is the planner's first choice", c))
            continue
        lead = result.candidate(best_row) if best_row is not None else c
        metric = (f"{c.step_s * 1e3:.1f} vs {lead.step_s * 1e3:.1f} ms per step"
                  if result.rank_by is RankBy.TIME else f"{gb(c.communication)} vs {gb(lead.communication)} per step")
        out.append(Alternative(shape.label, f"fits as {c.text} but ranks #{position[row]}: {metric}; "
                               + explain_pair(lead, c, result.rank_by), c))
    return out


__all__ = [
    "AXES", "Alternative", "Candidate", "Cluster", "DataParallel", "Deriver", "Family", "Offload", "Pipeline",
    "Plan", "RankBy", "Space", "StepTimeModel", "Vectorized", "Workload", "exact_costs", "explain_pair",
    "family_of", "load_decide", "meshes", "plan",
]


# --- the command --------------------------------------------------------------------------


def _axis_values(option: str, items: Sequence[str], parse_value: Callable[[str], float]) -> list[tuple[Axis, float]]:
    out: list[tuple[Axis, float]] = []
    for item in items:
        for part in item.split(","):
            name, sep, value = part.partition("=")
            try:
                axis = Axis(name.strip().lower())
            except ValueError:
                raise InputError(f"{option} {part}: unknown axis {name!r} "
                                 f"(axes: {', '.join(a.value for a in AXES)})") from None
            if not sep:
                raise InputError(f"{option} {part}: expected AXIS=VALUE, e.g. tp=8")
            out.append((axis, parse_value(value)))
    return out


def _bandwidth(text: str) -> float:
    from checker._numbers import parse_bytes

    return float(parse_bytes(text.strip().removesuffix("/s").removesuffix("/S"), option="--bandwidth"))


def _print_plan(result: Plan) -> None:
    from rich.markup import escape
    from rich.table import Table

    from checker._output import terminal

    console = terminal(160)  # compositions are long; do not wrap them
    model_name = escape(getattr(result.model, "name", "") or "custom")  # a config's own text: no markup
    console.print(f"[bold]plan[/bold] {model_name} ({result.model.parameter_count():,} parameters) on "
                  f"{result.cluster.devices} devices x {gb(result.cluster.device_memory)}; global batch "
                  f"{result.global_batch}; precision {result.precision.name}; ranked by "
                  f"{'step time' if result.rank_by is RankBy.TIME else 'communication per step'}")
    console.print(f"{len(result.families)} families, {result.enumerated:,} combinations, "
                  f"{len(result.table):,} pass the composition rules, {result.feasible:,} fit; "
                  f"{result.decided} z3 decisions ({result.solver}); {result.seconds['total']:.2f} s")
    table = Table(title="Best compositions (GB = 1e9 bytes; ms per step: compute + bubble + comm + host)")
    for col in ("#", "composition", "b", "memory", "comm/step", "step ms", "bubble", "comm ms", "verdict"):
        table.add_column(col, justify="left" if col in ("composition", "verdict") else "right")
    for c in result.top:
        table.add_row(str(c.rank), c.text, str(c.micro_batch),
                      gb(c.exact_memory if c.exact_memory is not None else c.memory) + f" ({c.stage})",
                      gb(c.exact_communication if c.exact_communication is not None else c.communication),
                      f"{c.step_s * 1e3:,.0f}", f"{c.bubble_s * 1e3:,.0f}", f"{c.communication_s * 1e3:,.0f}",
                      c.status.label if c.status is not None else c.verdict_note)
    console.print(table)
    if not result.top:
        console.print("no composition fits and is proved valid")
    for c in result.top:
        for note in c.notes:
            console.print(escape(f"  #{c.rank}: {note}"), highlight=False)
    for a, b in itertools.pairwise(result.top):
        console.print(f"  #{a.rank} > #{b.rank}: " + explain_pair(a, b, result.rank_by))
    console.print("[bold]Popular alternatives[/bold]")
    for alt in result.alternatives:
        console.print(f"  {alt.label}: {alt.reason}")
    for what, why in result.refuted.items():
        console.print(f"  rejected by z3: {what}: {why}")


def plan_command() -> Any:
    """The ``plan`` subcommand (registered in checker/cli.py)."""
    import json
    import sys

    import click

    from checker._numbers import (
        MAX_BATCH,
        MAX_DEGREE,
        MAX_MICRO_BATCH,
        MAX_SEQ,
        WholeNumber,
        parse_bytes,
        parse_count,
        parse_int,
    )
    from checker._output import output_path, write_atomic
    from formal._model import PRECISIONS
    from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES

    @click.command("plan")
    @click.option("--model", default=None, help="Preset name or Hugging Face config.json.")
    @click.option("--params", default=None, help="A bare parameter count instead of a model (7.5e9, 70B).")
    @click.option("--devices", type=WholeNumber(1, MAX_DEGREE), default=DEFAULT_DEVICES, show_default=True)
    @click.option("--device-memory", default=None, help="Per-device memory, e.g. 80GB (default 80GB).")
    @click.option("--precision", default="zero", show_default=True, help="Bytes per element: " + ", ".join(PRECISIONS))
    @click.option("--global-batch", type=WholeNumber(1, MAX_BATCH), default=None,
                  help="Sequences per step (default: one per device).")
    @click.option("--seq", type=WholeNumber(1, MAX_SEQ), default=None, help="Sequence length (default: the model's).")
    @click.option("--micro-batch", "micro_batches", default="1,2,4", show_default=True,
                  help="Micro-batch sizes to consider, comma-separated.")
    @click.option("--node-size", type=WholeNumber(1, MAX_DEGREE), default=8, show_default=True,
                  help="Devices per node.")
    @click.option("--intra-node-bandwidth", default="300GB/s", show_default=True)
    @click.option("--inter-node-bandwidth", default="25GB/s", show_default=True)
    @click.option("--host-bandwidth", default="32GB/s", show_default=True)
    @click.option("--bandwidth", multiple=True, help="Per-axis bandwidth override, e.g. dp=50GB/s.")
    @click.option("--device-flops", default="312e12", show_default=True, help="Peak FLOP/s per device.")
    @click.option("--fix", multiple=True, help="Pin degrees, e.g. tp=8,pp=8.")
    @click.option("--data", "data_kinds", default=",".join(d.value for d in DataParallel), show_default=True,
                  help="Data-axis strategies to consider.")
    @click.option("--uneven-stages", is_flag=True, help="Allow layers not divisible by pp (uneven stages).")
    @click.option("--rank-by", type=click.Choice([r.value for r in RankBy]), default="time", show_default=True)
    @click.option("--top", type=WholeNumber(1, 10_000), default=5, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
    @click.option("--csv", "csv_path", default=None, help="Write every fitting candidate, best first, to this file.")
    def command(model: str | None, params: str | None, devices: int, device_memory: str | None, precision: str,
                global_batch: int | None, seq: int | None, micro_batches: str, node_size: int,
                intra_node_bandwidth: str, inter_node_bandwidth: str, host_bandwidth: str,
                bandwidth: tuple[str, ...], device_flops: str, fix: tuple[str, ...], data_kinds: str,
                uneven_stages: bool, rank_by: str, top: int, as_json: bool, csv_path: str | None) -> None:
        """Find the best valid composition for a model on a cluster, e.g.
        ``check-composition plan --model llama3-70b --devices 512 --device-memory 80GB``."""
        from checker.cli import fail, load_model, set_outcome

        try:
            csv_file = output_path(csv_path, "--csv") if csv_path is not None else None
            chosen = load_model(model, params, None, seq)
            if precision not in PRECISIONS:
                raise InputError(f"--precision {precision}: unknown (known: {', '.join(PRECISIONS)})")
            parts = micro_batches.split(",")
            if len(parts) > 64:
                raise InputError(f"--micro-batch {micro_batches[:40]}...: {len(parts)} sizes (at most 64)")
            sizes = [parse_int(part, "--micro-batch", high=MAX_MICRO_BATCH) for part in parts]
            kinds = []
            for part in data_kinds.split(","):
                try:
                    kinds.append(DataParallel(part.strip().lower()))
                except ValueError:
                    raise InputError(f"--data {part}: unknown (known: "
                                     f"{', '.join(d.value for d in DataParallel)})") from None
            pins = _axis_values("--fix", fix, lambda v: float(parse_int(v, "--fix", high=MAX_DEGREE)))
            cluster = Cluster(
                devices, parse_bytes(device_memory) if device_memory is not None else DEFAULT_DEVICE_MEMORY,
                node_size=node_size, intra_node_bandwidth=_bandwidth(intra_node_bandwidth),
                inter_node_bandwidth=_bandwidth(inter_node_bandwidth), host_bandwidth=_bandwidth(host_bandwidth),
                device_flops=float(parse_count(device_flops, "--device-flops", high=10**21)),
                bandwidths=tuple(_axis_values("--bandwidth", bandwidth, _bandwidth)))
            result = plan(chosen, cluster, Workload(global_batch, tuple(sizes), uneven_stages),
                          PRECISIONS[precision], Space(data=tuple(kinds), pins=tuple((a, int(d)) for a, d in pins)),
                          top=top, rank_by=RankBy(rank_by))
            if csv_file is not None:
                write_atomic(csv_file, result.csv(), "--csv")
        except InputError as err:
            fail(str(err))
            return
        from checker.cli import EXIT_INVALID, EXIT_UNKNOWN, EXIT_VALID

        proved = bool(result.top) and all(c.status is Status.PROVED for c in result.top)
        code = EXIT_VALID if proved else EXIT_UNKNOWN if result.top else EXIT_INVALID
        set_outcome(code)
        if as_json:
            click.echo(json.dumps(result.as_json(), indent=2))
        else:
            _print_plan(result)
        sys.exit(code)

    return command
