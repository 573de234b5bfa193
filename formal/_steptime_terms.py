"""The terms of one training step for the step-time model (``formal._steptime``): FLOPs per
token from the model, and, from a step program, FLOP and byte counts per pipeline stage and per
collective class (``compute_terms``, ``state_terms``), exact or symbolic in the degrees and the
micro-batch count. ``Runtime`` holds the run settings a placement does not state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from formal._costs import bubble_fraction, communication, pipeline_stages
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

if TYPE_CHECKING:  # numpy is imported where arrays are built: a check without --hardware never loads it
    import numpy as np
    import numpy.typing as npt
    import sympy as sp

    Floats = npt.NDArray[np.float64]
    Bools = npt.NDArray[np.bool_]
    Ints = npt.NDArray[np.int64]

_NON_LAYER = frozenset({EMBEDDING, POSITION, HEAD, FINAL_NORM})


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


def _stage_layers(model: Transformer, pl: Placement) -> sp.Expr:
    """Layers on the fullest stage: ceil(L / p) (every layer on one stage without a pipeline)."""
    import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

    p = pl.pipeline_degree if pl.pipelined else sp.Integer(1)
    return sp.ceiling(sp.Integer(model.layers) / p)


# --- the terms of one step ----------------------------------------------------------------
#
# A step's time is computed in two passes. ``compute_terms`` and ``state_terms`` read a step
# program and return *terms*: FLOP and byte counts as sympy expressions, numbers for a numeric
# placement and expressions in the degree symbols and ``m`` for a symbolic one (the planner
# derives them once per family and evaluates them with numpy on every mesh). ``assemble`` turns
# evaluated terms and the hardware into ``StepInputs``, arrays with one row per step, and
# ``evaluate_batch`` applies the fitted constants and the overlap rules to every row at once.
# ``prepare`` and ``evaluate`` are the one-step forms of the same functions.
#
# ``compute_terms`` holds what depends on the pipeline schedule, sequence parallelism and
# recomputation (FLOPs, element-wise bytes, the bubble, activation collectives), ``state_terms``
# what depends on the data-axis strategy and offload (model-state collectives, the optimizer
# update, host transfers): the planner derives each from the program of a family sharing those
# choices. Activation terms are linear in the micro-batch size (Korthikanti et al. 2022's bytes,
# tokens per micro-batch), so ``assemble`` scales them by ``scale`` = b / the model's micro-batch.

KINDS: tuple[str, ...] = ("exposed", "hidden", "tensor", "forward", "backward", "grad", "grad_once")
STEP_AXES: tuple[Axis, ...] = tuple(Axis)
STEP_STAGES: tuple[Stage, ...] = tuple(Stage)  # first, middle, last
_SYNC = "sync"  # a gradient synchronisation: "grad" or "grad_once" by its count against m, per row


@dataclass(frozen=True)
class CommTerm:
    """One collective of one pipeline stage: its class for the overlap rules, and how it scales."""

    stage: Stage
    axis: Axis
    kind: str  # one of KINDS, or "sync" (resolved per row)
    per_sample: bool  # an activation collective: bytes linear in the micro-batch size
    scatter: bool  # a stage-to-stage send split over tp and gathered over NVLink


@dataclass(frozen=True)
class Terms:
    """Named counts and collectives of one part of a step (see the comment above)."""

    named: tuple[tuple[str, sp.Expr], ...]
    comms: tuple[CommTerm, ...]
    comm_bytes: tuple[sp.Expr, ...]
    comm_counts: tuple[sp.Expr, ...]

    def expressions(self) -> tuple[sp.Expr, ...]:
        """Every expression, in the order ``bind`` reads values back."""
        return (*(e for _, e in self.named), *self.comm_bytes, *self.comm_counts)

    def bind(self, values: Sequence[Floats]) -> Bound:
        """The terms with each expression replaced by its values (one per row)."""
        k, c = len(self.named), len(self.comms)
        if len(values) != k + 2 * c:
            raise AssertionError(f"{len(values)} values for {k + 2 * c} expressions")
        return Bound(
            {name: values[i] for i, (name, _) in enumerate(self.named)},
            self.comms,
            tuple(values[k : k + c]),
            tuple(values[k + c :]),
        )

    def numeric(self) -> Bound:
        """The terms of a numeric placement as one-row arrays."""
        import numpy as np
        import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

        return self.bind([np.array([float(sp.sympify(e))]) for e in self.expressions()])


@dataclass(frozen=True)
class Bound:
    """Evaluated terms: one array per expression."""

    named: Mapping[str, Floats]
    comms: tuple[CommTerm, ...]
    comm_bytes: tuple[Floats, ...]
    comm_counts: tuple[Floats, ...]


def _layer_activation_bytes(pl: Placement, model: Transformer, precision: Precision) -> sp.Expr:
    """One layer's activation bytes for one micro-batch on one device (Korthikanti et al. 2022
    section 4.1 by group, each split along the axes that split it), the attention scores left
    out: their element-wise work is fused into the attention kernels (Megatron-LM's fused
    scaled-masked softmax; FlashAttention never writes them), so only the 34 sbh remain."""
    import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    total: sp.Expr = sp.Integer(0)
    for group, nbytes in per_layer.items():
        if group == ATTN_SCORES:
            continue
        factor: sp.Expr = sp.Integer(1)
        for axis, d in pl.mesh:
            if axis.kind.is_pipeline or axis.kind.splits_batch:
                continue
            factor = factor * axis_factor(pl.entry(State.ACTIVATIONS, group, axis), d)
        total = total + nbytes * factor
    return total


def _classify(op_state: State, phase: str, axis: Axis, runtime: Runtime) -> str:
    if axis.kind.is_pipeline and op_state is State.ACTIVATIONS:
        return "hidden" if runtime.pipeline_overlap else "exposed"
    if phase in (Phase.FORWARD.value, Phase.BACKWARD.value):
        if op_state is State.PARAMETERS:
            return phase
        if op_state is State.ACTIVATIONS and axis.kind.splits_matrices:  # tensor parallelism
            return "tensor"
        return "exposed"
    if phase == Phase.GRAD_SYNC.value:
        return _SYNC
    return "exposed"


def _comms(
    program: StepProgram, precision: Precision, runtime: Runtime, activations: bool
) -> tuple[list[CommTerm], list[sp.Expr], list[sp.Expr]]:
    """The collectives of ``program`` (its activation ones, or the others), their bytes summed
    per class (stage, axis, overlap rule, scaling, count): time is linear in the bytes, and
    fewer expressions are fewer to evaluate."""
    import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

    pl = program.placement
    scatter = runtime.pipeline_scatter_gather and not pl.options.sequence_parallel
    summed: dict[tuple[CommTerm, sp.Expr], sp.Expr] = {}
    for stage in pipeline_stages(pl):
        for t in communication(program, precision, stage):
            if (t.state is State.ACTIVATIONS) != activations:
                continue
            kind = _classify(t.state, t.phase, t.axis, runtime)
            split = scatter and t.axis.kind.is_pipeline and t.state is State.ACTIVATIONS
            term = CommTerm(stage, t.axis, kind, t.state is State.ACTIVATIONS, split)
            count = sp.sympify(t.count) if kind == _SYNC else sp.Integer(1)
            key = (term, count)
            summed[key] = summed.get(key, sp.Integer(0)) + sp.sympify(t.bytes)
    return [k[0] for k in summed], list(summed.values()), [k[1] for k in summed]


def compute_terms(program: StepProgram, model: Model, precision: Precision, runtime: Runtime = Runtime()) -> Terms:
    """FLOPs and element-wise bytes per device per step of each pipeline stage, the bubble
    fraction, the GEMM size's pieces and the activation collectives of ``program``."""
    import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

    if not isinstance(model, Transformer):
        raise InputError("--hardware: step time needs a model with layers and a sequence (a preset or config.json)")
    pl = program.placement
    m = sp.sympify(pl.options.micro_batches)
    p = pl.pipeline_degree if pl.pipelined else sp.Integer(1)
    devices = sp.Integer(1)
    for _, d in pl.mesh:
        devices = devices * d
    replicas = pl.degree_where(lambda kind: kind.splits_batch)
    # tokens per step over the devices of one stage: each device's share of the stage's work
    per_device_tokens = model.micro_batch * model.seq * m * replicas * p / devices
    causal = runtime.flash_attention
    recompute = pl.options.recompute
    layer, attention = _layer_forward_per_token(model, causal)
    layers = _stage_layers(model, pl)
    stages = pipeline_stages(pl)
    head = 2 * model.vocab * model.hidden
    named: list[tuple[str, sp.Expr]] = []
    passes = 3 + (1 if recompute is Recompute.FULL else 0)
    layer_bytes = _layer_activation_bytes(pl, model, precision)
    for stage in stages:
        layers_forward = layers * layer
        forward = layers_forward + (head if stage is Stage.LAST or len(stages) == 1 else 0)
        none, selective = sp.Integer(0), attention * layers
        extra = {Recompute.NONE: none, Recompute.SELECTIVE: selective, Recompute.FULL: layers_forward}[recompute]
        named.append((f"flops:{stage.value}", (3 * forward + extra) * per_device_tokens))
        named.append((f"backward:{stage.value}", (2 * forward + extra) * per_device_tokens))
        named.append((f"memory:{stage.value}", layer_bytes * layers * passes * m))
    with_recompute, without = training_flops_per_token(model, recompute, causal)
    cp = pl.degree_where(lambda kind: kind.splits_sequence and not kind.splits_batch)
    tp = pl.degree_where(lambda kind: kind.splits_matrices)  # Megatron's column/row split
    host: sp.Expr = sp.Integer(0)
    for op in program.ops:
        if op.kind.is_transfer and op.state is State.ACTIVATIONS:
            host = host + op.elements * op.count * precision.bytes_of(op.state)
    named += [
        ("micro_batches", m),
        ("pipeline_degree", p),
        ("bubble", sp.sympify(bubble_fraction(pl))),
        ("gemm_tokens", model.micro_batch * model.seq / cp),
        ("tp", tp),
        ("flops_per_token", sp.Float(with_recompute)),
        ("model_flops_per_token", sp.Float(without)),
        ("host_bytes", host),
    ]
    terms, nbytes, counts = _comms(program, precision, runtime, activations=True)
    return Terms(tuple(named), tuple(terms), tuple(nbytes), tuple(counts))


def state_terms(program: StepProgram, precision: Precision, runtime: Runtime = Runtime()) -> Terms:
    """The model-state collectives of each pipeline stage, the optimizer update's bytes (and
    whether it runs on the host) and the host transfers of ``program``."""
    import sympy as sp  # the step-time terms are sympy expressions (symbolic for the planner)

    pl = program.placement
    update: sp.Expr = sp.Integer(0)
    host: sp.Expr = sp.Integer(0)
    for op in program.ops:
        if op.kind is OpKind.OPTIMIZER_STEP:
            per = 2 * precision.bytes_of(State.OPTIMIZER) + precision.bytes_of(State.GRADIENTS)
            update = update + op.elements * op.count * (per + 2 * precision.bytes_of(State.PARAMETERS))
        elif op.kind.is_transfer and op.state is not State.ACTIVATIONS:
            host = host + op.elements * op.count * precision.bytes_of(op.state)
    named = (
        ("update_bytes", update),
        ("offload_optimizer", sp.Integer(1 if pl.options.offload_optimizer else 0)),
        ("host_bytes", host),
    )
    terms, nbytes, counts = _comms(program, precision, runtime, activations=False)
    return Terms(named, tuple(terms), tuple(nbytes), tuple(counts))
