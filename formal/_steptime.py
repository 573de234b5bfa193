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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy as sp

from formal._costs import bubble_fraction, communication, pipeline_stages
from formal._hardware import Hardware
from formal._model import Model, Precision, Transformer
from formal._placement import Placement, Recompute
from formal._program import StepProgram, axis_factor
from formal._vocab import (
    ATTN_SCORES,
    EMBEDDING,
    EXPERTS,
    FINAL_NORM,
    HEAD,
    POSITION,
    Axis,
    OpKind,
    Phase,
    Stage,
    State,
)
from formal.errors import InputError

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


def calibrated() -> Efficiency:
    """The shipped constants (fitted by ``checker._published.fit`` on the runs the file names)."""
    data = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    c = data["constants"]
    return Efficiency(
        float(c["gemm_max"]), float(c["gemm_half"]), float(c["network"]), float(c["memory"]), data["about"]
    )


@dataclass(frozen=True)
class Runtime:
    """Settings of a run that a placement does not state. ``tp_overlap``: the TP collectives are
    decomposed and overlapped with the GEMMs (async TP: Wang et al. 2022, torchtitan).
    ``pipeline_scatter_gather``: a stage-to-stage send of a tensor replicated along tp is split
    into tp pieces over the network and all-gathered over NVLink on the receiver (Narayanan et
    al. 2021, section 4.1; Megatron-LM's default). ``pipeline_overlap``: stage-to-stage sends are
    asynchronous and run under compute (Llama 3, section 3.3.2: asynchronous point-to-point
    communication in PP). ``flash_attention``: attention runs as
    FlashAttention-2 (Dao 2023): the scores never reach HBM and the causal mask's upper half is
    skipped, so half the attention FLOPs are run and counted."""

    tp_overlap: bool = False
    pipeline_scatter_gather: bool = False
    pipeline_overlap: bool = False
    flash_attention: bool = False


@dataclass(frozen=True)
class Comm:
    """One class of collective time on one axis of one stage: seconds at the full link rate."""

    axis: Axis
    kind: str  # "exposed", "hidden", "tensor", "forward", "backward", "grad", "grad_once"
    seconds: float


@dataclass(frozen=True)
class StageInputs:
    stage: Stage
    flops: float  # training FLOPs per device per step, recomputation included
    backward_flops: float
    memory_bytes: float  # a layer's activation bytes x passes, per device per step (times ``memory``)
    comms: tuple[Comm, ...]


@dataclass(frozen=True)
class StepInputs:
    """Everything of a step but the fitted constants: ``evaluate`` turns it into a ``StepTime``."""

    stages: tuple[StageInputs, ...]
    gemm_size: float
    micro_batches: int
    pipelined: bool
    bubble: float
    optimizer_seconds: float
    host_seconds: float
    devices: int
    tokens: int  # per step, whole cluster
    model_flops: float  # per step, whole cluster, without recomputation
    hardware_flops: float  # per step, whole cluster, with recomputation
    peak_flops: float
    memory_bandwidth: float
    tp_overlap: bool


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

    def as_json(self) -> dict[str, Any]:
        return {
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


# --- FLOPs --------------------------------------------------------------------------------


def _layer_forward_per_token(model: Transformer, causal: bool = False) -> tuple[float, float]:
    """(forward FLOPs per token of one layer, of which attention scores and context); ``causal``:
    half the attention, the masked half skipped (FlashAttention-2, Dao 2023)."""
    groups = model.group_elements()
    active = sum(n for g, n in groups.items() if g not in _NON_LAYER)
    if model.is_moe:
        active -= groups.get(EXPERTS, 0) * (model.experts - model.top_k) // model.experts
    attention = 4 * model.seq * model.hidden // (2 if causal else 1)
    return 2 * active / model.layers + attention, float(attention)


def training_flops_per_token(model: Transformer, recompute: Recompute, causal: bool = False) -> tuple[float, float]:
    """(with recomputation, without): Narayanan et al. 2021 eq. 3 generalised to any layer."""
    layer, attention = _layer_forward_per_token(model, causal)
    head = 2 * model.vocab * model.hidden
    base = 3 * (model.layers * layer + head)
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: model.layers * attention, Recompute.FULL: model.layers * layer}
    return base + extra[recompute], float(base)


def _stage_forward_per_token(model: Transformer, pl: Placement, stage: Stage, causal: bool) -> tuple[float, float]:
    """(forward FLOPs per token of one stage's layers and head, of its layers alone)."""
    layer, _ = _layer_forward_per_token(model, causal)
    p = int(pl.pipeline_degree) if pl.pipelined else 1
    layers = math.ceil(model.layers / p)
    head = 2 * model.vocab * model.hidden if stage is Stage.LAST or len(pipeline_stages(pl)) == 1 else 0
    return layers * layer + head, layers * layer


# --- the inputs of one step ---------------------------------------------------------------


def _layer_activation_bytes(pl: Placement, model: Transformer, precision: Precision) -> float:
    """One layer's activation bytes for one micro-batch on one device (Korthikanti et al. 2022
    section 4.1 by group, each split along the axes that split it), the attention scores left
    out: their element-wise work is fused into the attention kernels (Megatron-LM's fused
    scaled-masked softmax; FlashAttention never writes them), so only the 34 sbh remain."""
    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    total = 0.0
    for group, nbytes in per_layer.items():
        if group == ATTN_SCORES:
            continue
        factor = sp.Integer(1)
        for axis, d in pl.mesh:
            if axis.kind.is_pipeline or axis.kind.splits_batch:
                continue
            factor = factor * axis_factor(pl.entry(State.ACTIVATIONS, group, axis), d)
        total += float(nbytes * factor)
    return total


def _bandwidths(pl: Placement, hw: Hardware) -> dict[Axis, float]:
    """NVLink when the axis and every axis inside it fit in a node; the pipeline axis outermost."""
    order = sorted(pl.mesh, key=lambda item: item[0].kind.is_pipeline)
    out: dict[Axis, float] = {}
    inner = 1
    for axis, d in order:
        inner *= int(d)
        out[axis] = hw.intra_node_bandwidth if inner <= hw.node_size else hw.inter_node_bandwidth
    return out


def _classify(op_state: State, phase: str, axis: Axis, count: sp.Expr, m: int, runtime: Runtime) -> str:
    if axis.kind.is_pipeline and op_state is State.ACTIVATIONS:
        return "hidden" if runtime.pipeline_overlap else "exposed"
    if phase in (Phase.FORWARD.value, Phase.BACKWARD.value):
        if op_state is State.PARAMETERS:
            return phase
        if op_state is State.ACTIVATIONS and axis.kind.splits_matrices:  # tensor parallelism
            return "tensor"
        return "exposed"
    if phase == Phase.GRAD_SYNC.value:
        return "grad" if sp.sympify(count) >= m else "grad_once"
    return "exposed"


def prepare(
    program: StepProgram, model: Model, precision: Precision, hardware: Hardware, runtime: Runtime = Runtime()
) -> StepInputs:
    """The hardware-dependent, constant-free part of the step time of ``program``."""
    if not isinstance(model, Transformer):
        raise InputError("--hardware: step time needs a model with layers and a sequence (a preset or config.json)")
    pl = program.placement
    if any(not sp.sympify(d).is_number for _, d in pl.mesh):
        raise InputError("--hardware: step time needs numeric degrees")
    m = int(pl.options.micro_batches)
    devices = math.prod(int(d) for _, d in pl.mesh)
    p = int(pl.pipeline_degree) if pl.pipelined else 1
    replicas = math.prod(int(d) for a, d in pl.mesh if a.kind.splits_batch)
    tokens = model.micro_batch * model.seq * m * replicas
    stage_devices = devices // p
    causal = runtime.flash_attention
    with_recompute, without = training_flops_per_token(model, pl.options.recompute, causal)
    bw = _bandwidths(pl, hardware)
    tp = int(pl.degree_where(lambda kind: kind.splits_matrices))  # Megatron's column/row split
    scatter = runtime.pipeline_scatter_gather and not pl.options.sequence_parallel and tp > 1
    recompute = pl.options.recompute
    _, attention = _layer_forward_per_token(model, causal)
    stages = []
    for stage in pipeline_stages(pl):
        forward, layers_forward = _stage_forward_per_token(model, pl, stage, causal)
        extra = {
            Recompute.NONE: 0.0,
            Recompute.SELECTIVE: attention * math.ceil(model.layers / p),
            Recompute.FULL: layers_forward,
        }[recompute]
        per_token = 3 * forward + extra
        flops = per_token * tokens / stage_devices
        backward = (2 * forward + extra) * tokens / stage_devices
        comms = []
        for t in communication(program, precision, stage):
            kind = _classify(t.state, t.phase, t.axis, t.count, m, runtime)
            seconds = float(t.bytes) / bw[t.axis]
            if scatter and t.axis.kind.is_pipeline and t.state is State.ACTIVATIONS:
                seconds = seconds / tp + float(t.bytes) * (tp - 1) / tp / hardware.intra_node_bandwidth
            comms.append(Comm(t.axis, kind, seconds))
        passes = 3 + (1 if recompute is Recompute.FULL else 0)
        layer_bytes = _layer_activation_bytes(pl, model, precision) * math.ceil(model.layers / p)
        memory = layer_bytes * passes * m
        stages.append(StageInputs(stage, flops, backward, memory, tuple(comms)))
    cp = int(pl.degree_where(lambda kind: kind.splits_sequence and not kind.splits_batch))
    mb_tokens = model.micro_batch * model.seq / cp
    gemm = 1 / (1 / mb_tokens + 1 / model.hidden + 1 / (model.ffn_ / tp))
    update_bytes = 0.0
    host_bytes = 0.0
    for op in program.ops:
        if op.kind is OpKind.OPTIMIZER_STEP:
            per = 2 * precision.bytes_of(State.OPTIMIZER) + precision.bytes_of(State.GRADIENTS)
            update_bytes += float(op.elements * op.count) * (per + 2 * precision.bytes_of(State.PARAMETERS))
        elif op.kind.is_transfer:
            host_bytes += float(op.elements * op.count * precision.bytes_of(op.state))
    update_rate = hardware.host_memory_bandwidth if pl.options.offload_optimizer else hardware.memory_bandwidth
    return StepInputs(
        stages=tuple(stages),
        gemm_size=gemm,
        micro_batches=m,
        pipelined=p > 1,
        bubble=float(bubble_fraction(pl)),
        optimizer_seconds=update_bytes / update_rate,
        host_seconds=host_bytes / hardware.host_bandwidth,
        devices=devices,
        tokens=tokens,
        model_flops=without * tokens,
        hardware_flops=with_recompute * tokens,
        peak_flops=hardware.peak_flops,
        memory_bandwidth=hardware.memory_bandwidth,
        tp_overlap=runtime.tp_overlap,
    )


# --- constants in: seconds out ------------------------------------------------------------


def _spread(pooled: Mapping[Axis, float], exposed: float, into: dict[Axis, float]) -> None:
    total = sum(pooled.values())
    if total <= 0 or exposed <= 0:
        return
    for axis, s in pooled.items():
        into[axis] = into.get(axis, 0.0) + exposed * s / total


def evaluate(inputs: StepInputs, eff: Efficiency) -> StepTime:
    """Seconds of one step under ``eff`` (the slowest stage's)."""
    rate = inputs.peak_flops * eff.gemm(inputs.gemm_size)
    best: StepTime | None = None
    for st in inputs.stages:
        compute = st.flops / rate + eff.memory * st.memory_bytes / inputs.memory_bandwidth
        backward = st.backward_flops / rate
        forward = compute - backward
        pools: dict[str, dict[Axis, float]] = {}
        for c in st.comms:
            pool = pools.setdefault(c.kind, {})
            pool[c.axis] = pool.get(c.axis, 0.0) + c.seconds / eff.network
        per_mb: dict[Axis, float] = {}
        after: dict[Axis, float] = {}
        for axis, s in pools.get("exposed", {}).items():
            per_mb[axis] = per_mb.get(axis, 0.0) + s
        hidden = pools.get("hidden", {})  # asynchronous sends, under the compute
        _spread(hidden, sum(hidden.values()) - compute, per_mb)
        tp = pools.get("tensor", {})
        if inputs.tp_overlap:
            _spread(tp, sum(tp.values()) - compute, per_mb)
        else:
            _spread(tp, sum(tp.values()), per_mb)
        _spread(pools.get("forward", {}), sum(pools.get("forward", {}).values()) - forward, per_mb)
        backward_pool = dict(pools.get("backward", {}))
        for axis, s in pools.get("grad", {}).items():
            backward_pool[axis] = backward_pool.get(axis, 0.0) + s
        _spread(backward_pool, sum(backward_pool.values()) - backward, per_mb)
        once = pools.get("grad_once", {})
        window = 0.0 if inputs.pipelined else backward / inputs.micro_batches
        _spread(once, sum(once.values()) - window, after)
        busy = compute + sum(per_mb.values())
        bubble = inputs.bubble * busy
        step = busy + bubble + sum(after.values()) + inputs.optimizer_seconds + inputs.host_seconds
        exposed: dict[Axis, float] = dict(per_mb)
        for axis, s in after.items():
            exposed[axis] = exposed.get(axis, 0.0) + s
        result = StepTime(
            step_seconds=step,
            compute_seconds=compute,
            bubble_seconds=bubble,
            optimizer_seconds=inputs.optimizer_seconds,
            host_seconds=inputs.host_seconds,
            exposed=tuple((a.value, s) for a, s in sorted(exposed.items(), key=lambda kv: kv[0].value)),
            gemm_efficiency=eff.gemm(inputs.gemm_size),
            stage=st.stage,
            mfu=inputs.model_flops / (step * inputs.devices * inputs.peak_flops),
            tflops_per_device=inputs.hardware_flops / (step * inputs.devices) / 1e12,
            tokens_per_second=inputs.tokens / step,
        )
        if best is None or result.step_seconds > best.step_seconds:
            best = result
    assert best is not None
    return best


def step_time(
    program: StepProgram,
    model: Model,
    precision: Precision,
    hardware: Hardware,
    eff: Efficiency | None = None,
    runtime: Runtime = Runtime(),
) -> StepTime:
    """The step time of ``program`` on ``hardware`` (default constants: ``calibrated()``)."""
    return evaluate(prepare(program, model, precision, hardware, runtime), eff or calibrated())
