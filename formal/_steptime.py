"""Step time of one training step, read from the step program (docs/steptime.md).

Time is in floats (seconds): FLOP and byte counts are exact in the program, but rates, the
efficiency curve and overlap are measurements and models, so nothing here is exact. The model:

* compute: each device's training FLOPs per step (forward 2 x the active parameters of its
  stage's layers + 4 s h per layer per token for attention, + 2 V h for the head on the last
  stage; backward twice the forward; full recomputation adds the layers' forward again and
  selective recomputation the attention-score forward: Narayanan et al. 2021 eq. 3, Korthikanti
  et al. 2022 section 5) at ``peak x gemm_efficiency``, where the GEMM efficiency rises with the
  size of the layer's largest per-device GEMM, ``eff = gemm_max x n / (n + gemm_half)``, with
  ``n = 1 / (1/tokens + 1/hidden + 1/(ffn/tp))`` (the GEMM's arithmetic intensity up to a constant).
* each collective: its ring bytes per device (``formal._costs.communication``: 2(n-1)/n of the
  tensor for an all-reduce, (n-1)/n for a gather or scatter) over the bandwidth of its group, NVLink
  when the axis and every axis inside it fit in one node, else the per-GPU network, times the
  calibrated fraction ``network`` of the link rate that collectives reach.
* overlap, per strategy: tensor-, context- and expert-parallel activation collectives and the
  pipeline's stage-to-stage sends sit on the critical path (Megatron-LM's blocking TP collectives
  and p2p), unless ``Runtime.tp_overlap`` (async TP, as in torchtitan) hides the TP ones under
  compute; FSDP / ZeRO-3 parameter gathers are prefetched under the compute of their phase
  (PyTorch FSDP's forward and backward prefetch); a gradient reduction issued per micro-batch
  (FSDP, ZeRO-2/3) overlaps the backward; DDP's bucketed all-reduce, issued once per step, overlaps
  the last micro-batch's backward (Li et al. 2020, PyTorch DDP) except after a pipeline flush,
  where Megatron-LM and DeepSpeed's pipeline engine reduce after the last backward (exposed);
  collectives of the optimizer phase (ZeRO-1/2 parameter all-gather) are exposed.
* bubble: the schedule's bubble fraction (``formal._schedules``) of the slowest stage's
  per-micro-batch work (compute and its exposed collectives).
* element-wise kernels (norms, activations, dropout): memory-bound, ``memory`` x the bytes of
  each layer's activations (Korthikanti et al. 2022 section 4.1, 34 sbh through the placement;
  the attention scores left to the fused softmax / FlashAttention kernels) per pass (forward,
  backward counted twice, the recomputed forward) over HBM bandwidth; this is what makes a GPU
  with more FLOP/s per byte of HBM reach a smaller fraction of its peak.
* optimizer: memory-bound, the update's bytes (read G, P, O; write P, O) over HBM bandwidth,
  or over host memory bandwidth when the optimizer is offloaded; host transfers over PCIe,
  not overlapped (an upper bound).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from formal._hardware import Hardware
from formal._model import Model, Precision, Transformer
from formal._program import StepProgram
from formal._steptime_terms import _SYNC, KINDS, STEP_AXES, STEP_STAGES, Bound
from formal._steptime_terms import Runtime as Runtime
from formal._steptime_terms import Terms as Terms
from formal._steptime_terms import compute_terms as compute_terms
from formal._steptime_terms import state_terms as state_terms
from formal._steptime_terms import training_flops_per_token as training_flops_per_token
from formal._vocab import (
    EMBEDDING,
    FINAL_NORM,
    HEAD,
    POSITION,
    Axis,
    Stage,
)
from formal.errors import InputError

if TYPE_CHECKING:  # numpy is imported where arrays are built: a check without --hardware never loads it
    from formal._steptime_terms import Bools, Floats, Ints

DEFAULT_RUNTIME = Runtime()  # no run settings beyond the placement
CALIBRATION_PATH = Path(__file__).resolve().parent / "data" / "steptime-calibration.json"
_NON_LAYER = frozenset({EMBEDDING, POSITION, HEAD, FINAL_NORM})


@dataclass(frozen=True)
class Efficiency:
    """The model's fitted constants: GEMM efficiency ``gemm_max x n / (n + gemm_half)``, the
    fraction ``network`` of link bandwidth collectives reach, and ``memory``, the HBM bytes the
    element-wise kernels move per byte of a layer's activations per pass."""

    gemm_max: float
    gemm_half: float
    network: float
    memory: float
    source: str = field(default="", compare=False)

    def gemm(self, n: float) -> float:
        return self.gemm_max * n / (n + self.gemm_half)

    def gemms(self, n: Floats) -> Floats:
        """``gemm`` of every row."""
        out: Floats = self.gemm_max * n / (n + self.gemm_half)
        return out


CONSTANTS: tuple[str, ...] = ("gemm_max", "gemm_half", "network", "memory")
# Where each constant means something: an efficiency or link fraction in (0, 1], a positive
# half-size, a non-negative byte factor.
_RANGES: dict[str, tuple[float, float]] = {
    "gemm_max": (1e-6, 1.0),
    "gemm_half": (1e-6, math.inf),
    "network": (1e-6, 1.0),
    "memory": (0.0, math.inf),
}


def uncertainty() -> dict[str, float]:
    """The shipped constants' fitted uncertainty (the jackknife standard error over the
    leave-one-source-out fits, ``checker._published.jackknife``)."""
    data = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    return {name: float(data["uncertainty"][name]) for name in CONSTANTS}


def perturbations(eff: Efficiency, spread: Mapping[str, float]) -> tuple[tuple[str, float, Efficiency], ...]:
    """``eff`` with each constant moved by -1 and +1 of its uncertainty (kept in its range):
    (constant, signed move, constants)."""
    out = []
    for name in CONSTANTS:
        low, high = _RANGES[name]
        for sign in (-1.0, 1.0):
            value = min(high, max(low, getattr(eff, name) + sign * spread[name]))
            if value != getattr(eff, name):
                out.append((name, value - getattr(eff, name), replace(eff, **{name: value})))
    return tuple(out)


def calibrated() -> Efficiency:
    """The shipped constants (fitted by ``checker._published.fit`` on the runs the file names)."""
    data = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    c = data["constants"]
    return Efficiency(
        float(c["gemm_max"]), float(c["gemm_half"]), float(c["network"]), float(c["memory"]), data["about"]
    )


@dataclass(frozen=True)
class StageTime:
    """One pipeline stage's step: its compute, exposed collectives, bubble, and the rest of the
    step (optimizer update and host transfers) to ``step`` seconds."""

    stage: Stage
    compute: float
    communication: float
    bubble: float
    step: float

    def as_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage.value,
            "compute": self.compute,
            "communication": self.communication,
            "bubble": self.bubble,
            "optimizer_and_host": self.step - self.compute - self.communication - self.bubble,
            "step": self.step,
        }


@dataclass(frozen=True)
class StepTime:
    step_seconds: float
    compute_seconds: float
    bubble_seconds: float
    optimizer_seconds: float
    host_seconds: float
    exposed: tuple[tuple[str, float], ...]  # per axis, exposed collective seconds
    gemm_efficiency: float
    stage: Stage
    mfu: float
    tflops_per_device: float
    tokens_per_second: float
    stages: tuple[StageTime, ...] = ()  # every pipeline stage (the slowest is ``stage``)

    def as_json(self) -> dict[str, Any]:
        return {
            "stages": [st.as_json() for st in self.stages],
            "step_seconds": self.step_seconds,
            "mfu": self.mfu,
            "tflops_per_device": self.tflops_per_device,
            "tokens_per_second": self.tokens_per_second,
            "gemm_efficiency": self.gemm_efficiency,
            "stage": self.stage.value,
            "breakdown": {
                "compute": self.compute_seconds,
                "exposed_communication": dict(self.exposed),
                "bubble": self.bubble_seconds,
                "optimizer": self.optimizer_seconds,
                "host_transfers": self.host_seconds,
            },
        }

    def line(self) -> str:
        comm = sum(s for _, s in self.exposed)
        return (
            f"step {self.step_seconds:.3g} s: compute {self.compute_seconds:.3g} s, exposed comm {comm:.3g} s, "
            f"bubble {self.bubble_seconds:.3g} s, optimizer {self.optimizer_seconds + self.host_seconds:.3g} s; "
            f"MFU {self.mfu:.1%}, {self.tflops_per_device:.0f} TFLOP/s per device, "
            f"{self.tokens_per_second:,.0f} tokens/s"
        )


# --- evaluated terms in: arrays of step inputs out ----------------------------------------


@dataclass(frozen=True)
class StepInputs:
    """Everything of a batch of steps but the fitted constants, one row per step (per-stage
    columns in ``STEP_STAGES`` order, per-axis ones in ``STEP_AXES`` order); ``evaluate_batch``
    turns it into ``StepTimes``."""

    flops: Floats  # (n, 3) training FLOPs per device per step, recomputation included
    backward_flops: Floats  # (n, 3)
    memory_bytes: Floats  # (n, 3) a layer's activation bytes x passes, per device per step (times ``memory``)
    present: Bools  # (n, 3) the stage exists
    comm: Floats  # (n, 3, len(KINDS), len(STEP_AXES)) collective seconds at the full link rate
    gemm_size: Floats
    micro_batches: Floats
    pipelined: Bools
    bubble: Floats
    optimizer_seconds: Floats
    host_seconds: Floats
    devices: Floats
    tokens: Floats  # per step, whole cluster
    model_flops: Floats  # per step, whole cluster, without recomputation
    hardware_flops: Floats  # per step, whole cluster, with recomputation
    peak_flops: Floats
    memory_bandwidth: Floats
    tp_overlap: Bools

    def __len__(self) -> int:
        return int(self.flops.shape[0])

    def take(self, rows: Ints) -> StepInputs:
        """The batch of the given rows."""
        return StepInputs(**{f.name: getattr(self, f.name)[rows] for f in fields(StepInputs)})

    @staticmethod
    def concat(batches: Sequence[StepInputs]) -> StepInputs:
        """One batch of the rows of several."""
        import numpy as np

        return StepInputs(**{f.name: np.concatenate([getattr(b, f.name) for b in batches]) for f in fields(StepInputs)})


def bandwidths(mesh: Sequence[tuple[Axis, Floats]], hardware: Hardware) -> dict[Axis, Floats]:
    """Link bytes/s per axis and row: NVLink when the axis and every axis inside it (in mesh
    order, the pipeline axis outermost) fit in a node, else the per-GPU network."""
    import numpy as np

    order = sorted(mesh, key=lambda item: item[0].kind.is_pipeline)
    out: dict[Axis, Floats] = {}
    inner: Floats | None = None
    for axis, d in order:
        inner = d if inner is None else inner * d
        out[axis] = np.where(inner <= hardware.node_size, hardware.intra_node_bandwidth, hardware.inter_node_bandwidth)
    return out


def assemble(
    compute: Bound,
    state: Bound,
    mesh: Sequence[tuple[Axis, Floats]],
    scale: Floats,
    model: Transformer,
    hardware: Hardware,
    runtime: Runtime = DEFAULT_RUNTIME,
    overrides: Mapping[Axis, float] | None = None,
) -> StepInputs:
    """Step inputs of every row: ``mesh`` the degree of each axis per row (mesh order), ``scale``
    the micro-batch size over the model's, ``overrides`` per-axis link rates (bytes/s)."""
    import numpy as np

    n = scale.shape[0]
    c = compute.named
    ones = np.ones(n)
    flops = np.zeros((n, len(STEP_STAGES)))
    backward = np.zeros_like(flops)
    memory = np.zeros_like(flops)
    present = np.zeros(flops.shape, dtype=bool)
    p = c["pipeline_degree"] * ones
    for i, stage in enumerate(STEP_STAGES):
        if f"flops:{stage.value}" not in c:
            continue
        flops[:, i] = c[f"flops:{stage.value}"] * scale
        backward[:, i] = c[f"backward:{stage.value}"] * scale
        memory[:, i] = c[f"memory:{stage.value}"] * scale
        present[:, i] = {Stage.FIRST: True, Stage.MIDDLE: p > 2, Stage.LAST: p >= 2}[stage]
    bw = bandwidths(mesh, hardware)
    for axis, value in (overrides or {}).items():
        bw[axis] = np.full(n, value)
    m = c["micro_batches"] * ones
    tp = c["tp"] * ones
    comm = np.zeros((n, len(STEP_STAGES), len(KINDS), len(STEP_AXES)))
    grad, once = KINDS.index("grad"), KINDS.index("grad_once")
    for bound in (compute, state):
        for term, nbytes, count in zip(bound.comms, bound.comm_bytes, bound.comm_counts, strict=True):
            volume = nbytes * (scale if term.per_sample else 1.0)
            seconds = volume / bw[term.axis]
            if term.scatter:
                seconds = seconds / tp + volume * (tp - 1) / tp / hardware.intra_node_bandwidth
            s, a = STEP_STAGES.index(term.stage), STEP_AXES.index(term.axis)
            if term.kind == _SYNC:
                every = count * ones >= m  # issued every micro-batch: under the backward
                comm[:, s, grad, a] += np.where(every, seconds, 0.0)
                comm[:, s, once, a] += np.where(every, 0.0, seconds)
            else:
                comm[:, s, KINDS.index(term.kind), a] += seconds
    devices = ones.copy()
    replicas = ones.copy()
    for axis, d in mesh:
        devices = devices * d
        if axis.kind.splits_batch:
            replicas = replicas * d
    tokens = model.micro_batch * scale * model.seq * m * replicas
    gemm_tokens = c["gemm_tokens"] * scale
    ffn = model.ffn_ / tp
    gemm = 1 / (1 / gemm_tokens + 1 / model.hidden + 1 / ffn)
    on_host = state.named["offload_optimizer"] * ones > 0
    update_rate = np.where(on_host, hardware.host_memory_bandwidth, hardware.memory_bandwidth)
    host = state.named["host_bytes"] * ones + c["host_bytes"] * scale
    return StepInputs(
        flops=flops,
        backward_flops=backward,
        memory_bytes=memory,
        present=present,
        comm=comm,
        gemm_size=gemm,
        micro_batches=m,
        pipelined=p > 1,
        bubble=c["bubble"] * ones,
        optimizer_seconds=state.named["update_bytes"] * ones / update_rate,
        host_seconds=host / hardware.host_bandwidth,
        devices=devices,
        tokens=tokens,
        model_flops=c["model_flops_per_token"] * tokens,
        hardware_flops=c["flops_per_token"] * tokens,
        peak_flops=np.full(n, hardware.peak_flops),
        memory_bandwidth=np.full(n, hardware.memory_bandwidth),
        tp_overlap=np.full(n, runtime.tp_overlap),
    )


def prepare(
    program: StepProgram, model: Model, precision: Precision, hardware: Hardware, runtime: Runtime = DEFAULT_RUNTIME
) -> StepInputs:
    """The hardware-dependent, constant-free part of the step time of ``program`` (one row)."""
    import numpy as np
    import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

    if not isinstance(model, Transformer):
        raise InputError("--hardware: step time needs a model with layers and a sequence (a preset or config.json)")
    pl = program.placement
    if any(not sp.sympify(d).is_number for _, d in pl.mesh):
        raise InputError("--hardware: step time needs numeric degrees")
    mesh = [(axis, np.array([float(d)])) for axis, d in pl.mesh]
    return assemble(
        compute_terms(program, model, precision, runtime).numeric(),
        state_terms(program, precision, runtime).numeric(),
        mesh,
        np.ones(1),
        model,
        hardware,
        runtime,
    )


# --- constants in: seconds out ------------------------------------------------------------


@dataclass(frozen=True)
class StepTimes:
    """``StepTime`` of every row of a batch (arrays); per-stage columns in ``STEP_STAGES`` order."""

    step_seconds: Floats
    compute_seconds: Floats  # the slowest stage's
    bubble_seconds: Floats
    optimizer_seconds: Floats
    host_seconds: Floats
    exposed: Floats  # (n, len(STEP_AXES)) the slowest stage's exposed collective seconds
    gemm_efficiency: Floats
    stage: Ints  # index into STEP_STAGES of the slowest stage
    mfu: Floats
    tflops_per_device: Floats
    tokens_per_second: Floats
    stage_compute: Floats  # (n, 3) every stage's compute, exposed collectives, bubble, total
    stage_communication: Floats
    stage_bubble: Floats
    stage_step: Floats  # -inf where the stage does not exist

    def row(self, i: int) -> StepTime:
        return StepTime(
            step_seconds=float(self.step_seconds[i]),
            compute_seconds=float(self.compute_seconds[i]),
            bubble_seconds=float(self.bubble_seconds[i]),
            optimizer_seconds=float(self.optimizer_seconds[i]),
            host_seconds=float(self.host_seconds[i]),
            exposed=tuple(
                (a.value, float(self.exposed[i, k])) for k, a in enumerate(STEP_AXES) if self.exposed[i, k] > 0
            ),
            gemm_efficiency=float(self.gemm_efficiency[i]),
            stage=STEP_STAGES[int(self.stage[i])],
            mfu=float(self.mfu[i]),
            tflops_per_device=float(self.tflops_per_device[i]),
            tokens_per_second=float(self.tokens_per_second[i]),
            stages=tuple(
                StageTime(
                    stage,
                    float(self.stage_compute[i, k]),
                    float(self.stage_communication[i, k]),
                    float(self.stage_bubble[i, k]),
                    float(self.stage_step[i, k]),
                )
                for k, stage in enumerate(STEP_STAGES)
                if math.isfinite(self.stage_step[i, k])
            ),
        )


# The overlap rules: each group of collective classes hides under a window of compute; what
# exceeds it is exposed. Exposed time is shared out over the axes in proportion to their seconds
# (for the breakdown only: the step needs the totals).
_EXPOSED = KINDS.index("exposed")
_GROUPS: tuple[tuple[int, ...], ...] = (
    (KINDS.index("hidden"),),  # asynchronous sends, under the compute
    (KINDS.index("tensor"),),  # under the compute with async TP, else exposed
    (KINDS.index("forward"),),  # prefetched parameter gathers, under the forward
    (KINDS.index("backward"), KINDS.index("grad")),  # under the backward
    (KINDS.index("grad_once"),),  # once per step, under the last micro-batch's backward
)


def evaluate_batch(inputs: StepInputs, eff: Efficiency) -> StepTimes:
    """Seconds of every step of the batch under ``eff`` (each the slowest stage's)."""
    import numpy as np

    x = inputs
    gemm_eff = eff.gemms(x.gemm_size)
    rate = (x.peak_flops * gemm_eff)[:, None]
    compute = x.flops / rate + eff.memory * x.memory_bytes / x.memory_bandwidth[:, None]
    backward = x.backward_flops / rate
    forward = compute - backward
    totals = x.comm.sum(axis=-1) / eff.network  # (n, stages, kinds)
    windows = (
        compute,
        np.where(x.tp_overlap[:, None], compute, 0.0),
        forward,
        backward,
        np.where(x.pipelined[:, None], 0.0, backward / x.micro_batches[:, None]),
    )
    exposed = [
        np.maximum(totals[:, :, list(kinds)].sum(axis=-1) - window, 0.0)
        for kinds, window in zip(_GROUPS, windows, strict=True)
    ]
    per_mb = totals[:, :, _EXPOSED] + exposed[0] + exposed[1] + exposed[2] + exposed[3]
    after = exposed[4]
    busy = compute + per_mb
    bubble = x.bubble[:, None] * busy
    extra = (x.optimizer_seconds + x.host_seconds)[:, None]
    step = np.where(x.present, busy + bubble + after + extra, -np.inf)
    slowest = np.argmax(step, axis=1)  # the first stage on a tie
    rows = np.arange(len(x))
    seconds = step[rows, slowest]
    pooled = x.comm[rows, slowest] / eff.network  # (n, kinds, axes) of the slowest stage
    axes = pooled[:, _EXPOSED, :].copy()
    for kinds, group_exposed in zip(_GROUPS, exposed, strict=True):
        part = pooled[:, list(kinds), :].sum(axis=1)
        total = part.sum(axis=-1, keepdims=True)
        share = np.divide(part, total, out=np.zeros_like(part), where=total > 0)
        axes += share * group_exposed[rows, slowest][:, None]
    return StepTimes(
        step_seconds=seconds,
        compute_seconds=compute[rows, slowest],
        bubble_seconds=bubble[rows, slowest],
        optimizer_seconds=x.optimizer_seconds,
        host_seconds=x.host_seconds,
        exposed=axes,
        gemm_efficiency=np.broadcast_to(gemm_eff, seconds.shape).astype(np.float64),
        stage=slowest.astype(np.int64),
        mfu=x.model_flops / (seconds * x.devices * x.peak_flops),
        tflops_per_device=x.hardware_flops / (seconds * x.devices) / 1e12,
        tokens_per_second=x.tokens / seconds,
        stage_compute=compute,
        stage_communication=per_mb + after,
        stage_bubble=bubble,
        stage_step=step,
    )


def evaluate(inputs: StepInputs, eff: Efficiency) -> StepTime:
    """Seconds of one step under ``eff`` (the slowest stage's); ``inputs`` holds one row."""
    if len(inputs) != 1:
        raise AssertionError(f"evaluate: {len(inputs)} rows (evaluate_batch takes many)")
    return evaluate_batch(inputs, eff).row(0)


def step_time(
    program: StepProgram,
    model: Model,
    precision: Precision,
    hardware: Hardware,
    eff: Efficiency | None = None,
    runtime: Runtime = DEFAULT_RUNTIME,
) -> StepTime:
    """The step time of ``program`` on ``hardware`` (default constants: ``calibrated()``)."""
    return evaluate(prepare(program, model, precision, hardware, runtime), eff or calibrated())
