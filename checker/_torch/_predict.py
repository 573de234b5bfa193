"""Our cost model's prediction for one rank of a PyTorch run, implementation effects included.

The numbers come from ``formal`` alone: ``memory()`` on the composition's placement and the
collectives of ``derive_program()``. What PyTorch does beyond the textbook placement is stated
in ``formal._engine_effects`` (``EngineEffects``, here also named ``Implementation``): named,
documented facts about the engine, each on or off, none a fudge factor, read by the CLI too, so
that the peak ``check-composition --engine fsdp2|ddp`` prints is the one validated here.
The formal program says *which* collectives run and on how many elements; the effects say how
the engine cuts them into calls (FSDP2 one call per ``fully_shard`` unit, DDP one per gradient
bucket, DTensor one per tensor) and which extra collectives its layers add (the
vocabulary-parallel loss). The vocabulary-parallel embedding's and head's activation
collectives are ops of the program, run on the stage that holds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import sympy as sp

from checker._torch._record import Call
from formal._axes import DATA, TENSOR, AxisKind
from formal._costs import activation_memory, memory, op_stage_factor
from formal._engine_effects import (
    Engine,
    EngineEffects,
    EnginePrediction,
    engine_prediction,
    pytorch_engine,
    stage_actions,
    zero1_axis,
)
from formal._exact import exact_int
from formal._model import PRECISIONS, Ffn, Precision, Transformer
from formal._placement import Placement
from formal._program import Op, StepProgram, derive_program, group_sizes, shard_elements
from formal._strategies import Composition
from formal._tensors import Tensor, parameter_tensors
from formal._vocab import (
    EMBEDDING,
    LAYER_GROUPS,
    LAYER_IO,
    POSITION,
    ROW_BIAS,
    Axis,
    OpKind,
    Stage,
    State,
)

P, G, A = State.PARAMETERS, State.GRADIENTS, State.ACTIVATIONS
MiB = 2**20

# The precision the PyTorch runs use: fp32 parameters, gradients and activations, Adam.
TORCH_PRECISION = PRECISIONS["fp32-adam"]


# The harness runs PyTorch on the CPU, whose dropout keeps the scaled float noise, not a 1-byte
# mask: 4-byte masks (a fact of the device, not of the engine; CUDA's dropout keeps a bool mask).
CPU_DROPOUT_MASK_BYTES = 4

# The engine effects the harness runs with: PyTorch's defaults (``formal._engine_effects``).
Implementation = EngineEffects
PYTORCH_DEFAULTS = EngineEffects()


def harness_precision(base: Precision = TORCH_PRECISION) -> Precision:
    """The precision the harness's runs have: fp32 Adam with the CPU's 4-byte dropout masks."""
    return replace(base, mask_bytes=CPU_DROPOUT_MASK_BYTES)


@dataclass(frozen=True)
class Prediction:
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # what autograd saves: the placement's, and the engine's saved inputs
    calls: tuple[Call, ...]
    stage: Stage
    engine: EnginePrediction  # the per-device peak with its engine terms, as the CLI prints it

    @property
    def peak(self) -> int:
        return self.engine.total


def _int(x: sp.Expr) -> int:
    return exact_int(x)


def pipeline_index(pl: Placement, rank: int) -> int:
    """The pipeline stage device ``rank`` runs: pp is the outer mesh dimension (rank = stage x
    the other axes' devices + the rest), as in the harness's and torchtitan's meshes."""
    p = int(pl.pipeline_degree)
    devices = 1
    for _, d in pl.mesh:
        devices *= int(d)
    return rank // (devices // p) if p > 1 else 0


def stage_of(pl: Placement, rank: int) -> Stage:
    return Stage.of(pipeline_index(pl, rank), int(pl.pipeline_degree))


def on_stage(pl: Placement, t: Tensor, rank: int) -> bool:
    """Whether pipeline rank ``rank`` holds tensor ``t`` (layers split evenly, first-stage and
    last-stage groups on their stage)."""
    model_p = int(pl.pipeline_degree)
    if model_p == 1:
        return True
    stage = stage_of(pl, rank)
    if t.layer is not None:
        return True  # counted per layer; callers use the stage's layers only
    if t.group in (EMBEDDING, POSITION):
        return stage == Stage.FIRST
    return stage == Stage.LAST


def predict(
    comp: Composition,
    model: Transformer,
    impl: EngineEffects = PYTORCH_DEFAULTS,
    rank: int = 0,
    engine: Engine | None = None,
) -> Prediction:
    """Per-rank model-state bytes, activation bytes, collective calls and peak of one steady step,
    on the PyTorch engine the harness runs ``comp`` on (``pytorch_engine``) unless ``engine``
    says otherwise. The engine's terms come from ``formal._engine_effects``, the same the CLI prints."""
    precision = harness_precision()
    pl = comp.placement(model)
    program = derive_program(pl, model)
    sizes = group_sizes(model)
    stage = stage_of(pl, rank)
    index = pipeline_index(pl, rank) if int(pl.pipeline_degree) > 1 else None
    mem = memory(pl, model, precision, sizes, stage)
    act = activation_memory(pl, model, precision, stage, index)
    assert act is not None
    mem = replace(mem, activations=act)
    chosen = engine if engine is not None else pytorch_engine(tuple(s.name for s in comp.strategies))
    engine_pred = engine_prediction(pl, model, precision, mem, chosen, stage, index, impl, data_rank=rank)
    grads = _int(mem.gradients.total) + engine_pred.persistent("gradients")
    optimizer = _int(mem.optimizer.total) + engine_pred.persistent("optimizer")
    saved = _int(act) + sum(t.bytes for t in engine_pred.terms if t.key in SAVED_BY_AUTOGRAD)
    calls = tuple(sorted(_calls(pl, program, model, impl, precision, rank, chosen)))
    return Prediction(_int(mem.parameters.total), grads, optimizer, saved, calls, stage, engine_pred)


# Engine terms that are tensors autograd saves (the table's activation row measures those only).
SAVED_BY_AUTOGRAD = frozenset({"sp_saves_gathered_inputs", "input_ids", "target_ids"})


def _on(op: Op, kind: AxisKind) -> bool:
    """Whether ``op`` runs along an axis of ``kind`` (PyTorch's engines are chosen by kind)."""
    return op.axis is not None and op.axis.kind is kind


def _has_ddp_buckets(program: StepProgram) -> bool:
    return any(op.kind is OpKind.ALL_REDUCE and op.state is G and _on(op, DATA) for op in program.ops)


def _calls(
    pl: Placement,
    program: StepProgram,
    model: Transformer,
    impl: Implementation,
    precision: Precision,
    rank: int,
    engine: Engine,
) -> Iterator[Call]:
    tensors = parameter_tensors(model)
    stage = stage_of(pl, rank)
    p = int(pl.pipeline_degree)
    per_stage = model.layers // p
    first = pipeline_index(pl, rank) * per_stage
    my_layers = set(range(first, first + per_stage)) if p > 1 else set(range(model.layers))
    # Registration order is kept: DDP's buckets follow it (reversed).
    mine = [t for t in tensors if (t.layer in my_layers if t.layer is not None else on_stage(pl, t, rank))]
    for op in program.ops:
        if not op.kind.is_collective or op.axis is None:
            continue
        n = int(op.participants if op.participants is not None else pl.degree(op.axis))
        wire = precision.op_wire_bytes(op.state, op.group)
        count = _int(op.count)
        if op.state is A:
            # This rank's share of the union over stages: the embedding's ops on the first stage,
            # the head's on the last, a middle stage's sends both ways (formal's cost model).
            calls = _int(op.count * op_stage_factor(op, pl, stage))
            modules = sum(colwise_modules(model))
            if impl.tp_input_collective_per_module and _colwise_input_op(op) and modules != 2:
                assert calls % 2 == 0, op  # one at the attention's input, one at the MLP's, per layer
                calls = calls // 2 * modules
            yield from [Call(op.kind, n, _int(op.elements) * wire)] * calls
            continue
        group_tensors = [t for t in mine if t.group is op.group]
        if not group_tensors:
            continue
        yield from _state_calls(pl, op, n, wire, count, group_tensors, impl)
    zero1 = zero1_axis(pl) if engine is Engine.DDP and impl.zero_redundancy_whole_tensors else None
    if zero1 is not None:
        # ZeRO-1 on DDP + ZeroRedundancyOptimizer: DDP all-reduces the gradients in its buckets
        # (where the program reduce-scatters), and each tensor is broadcast from its owner after
        # the step (where the program all-gathers the updated shards).
        yield from _ddp_bucket_calls(pl, program, mine, impl, precision, force=True)
        n = int(pl.degree(zero1))
        for t in mine:
            elements = _int(tensor_elements(pl, P, t, zero1))
            yield Call(OpKind.BROADCAST, n, elements * precision.wire_bytes_of(P))
    else:
        yield from _ddp_bucket_calls(pl, program, mine, impl, precision)
        yield from _fsdp_unit_calls(pl, program, mine, impl, precision, stage, rank)


def tensor_elements(pl: Placement, state: State, t: Tensor, along: Axis | None) -> sp.Expr:
    """Elements of one tensor a collective along ``along`` acts on: its shard on the other axes
    but the pipeline's, which places whole tensors on stages (``parameter_tensors`` lists the
    tensors of the rank's stage) instead of splitting them."""
    skip = {a for a in pl.axes if a.kind.is_pipeline} | ({along} if along is not None else set())
    return sp.Integer(shard_elements(pl, state, t.group, sp.Integer(t.elements), skip))


def colwise_modules(model: Transformer) -> tuple[int, int]:
    """Column-parallel modules that read a layer's attention input and its MLP input: the fused
    QKV and FC1 of the GPT layout (one each), or a Llama layout's q, k, v and gate, up
    (``formal._tensors.parameter_tensors``)."""
    return (3, 2) if model.ffn_kind is Ffn.SWIGLU else (1, 1)


def _colwise_input_op(op: Op) -> bool:
    """The backward all-reduce of a column-parallel matmul's input gradient (a partial sum over
    tp), or under sequence parallelism the forward gather of its input and the backward
    reduce-scatter of its gradient: the program's two per layer, one at the attention's input,
    one at the MLP's."""
    if op.group is not LAYER_IO or not _on(op, TENSOR):
        return False
    return (op.kind, op.phase.value) in (
        (OpKind.ALL_REDUCE, "backward"),
        (OpKind.ALL_GATHER, "forward"),
        (OpKind.REDUCE_SCATTER, "backward"),
    )


def _state_calls(
    pl: Placement, op: Op, n: int, wire: int, count: int, ts: list[Tensor], impl: Implementation
) -> Iterator[Call]:
    """Per-tensor calls (DTensor); FSDP-unit and DDP-bucket calls are emitted elsewhere."""
    if op.axis is not None and op.axis.kind.is_data and op.state in (P, G):
        return  # cut into FSDP units or DDP buckets below
    if _on(op, TENSOR) and op.kind is OpKind.ALL_REDUCE and op.state is G:
        if op.group is ROW_BIAS and impl.tp_row_bias_before_reduction:
            return
        for t in ts:
            elements = tensor_elements(pl, G, t, op.axis)
            yield from [Call(op.kind, n, _int(elements) * wire)] * count
        return
    raise AssertionError(f"no engine mapping for {op}")


def _units(pl: Placement, ts: list[Tensor], state: State, skip: Axis) -> dict[str, sp.Expr]:
    """FSDP2 units: one per block (``fully_shard`` on each), the root for everything else."""
    out: dict[str, sp.Expr] = {}
    for t in ts:
        unit = "root" if t.layer is None else f"layer{t.layer}"
        out[unit] = out.get(unit, sp.Integer(0)) + tensor_elements(pl, state, t, skip)
    return out


def _pipelined_fsdp_counts(pl: Placement, rank: int) -> dict[tuple[OpKind, str, bool], int] | None:
    """FSDP2 under ``torch.distributed.pipelining`` (``_PipelineStageBase.backward_maybe_with_nosync``:
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` for every
    micro-batch, then ``perform_reduce_grad`` after the last): the calls per step of a unit, by
    (kind, phase, root). Each unit's gradients are reduce-scattered once; a block is gathered by
    a forward unless a backward left it unsharded, and by a backward after a forward resharded
    it; the root (``reshard_after_forward`` False) is gathered once. None without a pipeline."""
    if not (pl.pipelined and int(pl.pipeline_degree) > 1):
        return None
    actions = stage_actions(pl, pipeline_index(pl, rank))  # formal._engine_effects
    forward = sum(1 for i, a in enumerate(actions) if a == "F" and (i == 0 or actions[i - 1] == "F"))
    backward = sum(1 for i, a in enumerate(actions) if a == "B" and i > 0 and actions[i - 1] == "F")
    out: dict[tuple[OpKind, str, bool], int] = {}
    for root in (False, True):
        out[(OpKind.ALL_GATHER, "forward", root)] = 1 if root else forward
        out[(OpKind.ALL_GATHER, "backward", root)] = 0 if root else backward
        out[(OpKind.REDUCE_SCATTER, "grad_sync", root)] = 1
    return out


def _fsdp_unit_calls(
    pl: Placement,
    program: StepProgram,
    ts: list[Tensor],
    impl: Implementation,
    precision: Precision,
    stage: Stage,
    rank: int = 0,
) -> Iterator[Call]:
    seen: set[tuple[OpKind, Axis, str]] = set()
    deferred = _pipelined_fsdp_counts(pl, rank) if impl.pipeline_fsdp_deferred_reduction else None
    for op in program.ops:
        if op.axis is None or not op.axis.kind.is_data or op.state not in (P, G):
            continue
        if op.kind is OpKind.ALL_REDUCE and _on(op, DATA):
            continue  # DDP buckets
        key = (op.kind, op.axis, op.phase.value)
        if key in seen:
            continue  # one program op per group; the units cover every group at once
        seen.add(key)
        n = int(pl.degree(op.axis))
        wire = precision.wire_bytes_of(op.state)
        # Elements along the op's axis: the unit's shard on the other axes (HSDP's all-reduce
        # along dpr acts on the dp shard).
        for unit, elements in sorted(_units(pl, ts, op.state, op.axis).items()):
            if (
                unit == "root"
                and op.kind is OpKind.ALL_GATHER
                and op.phase.value == "backward"
                and impl.fsdp_root_unsharded
            ):
                continue
            count = _int(op.count)
            if deferred is not None:
                count = deferred[(op.kind, op.phase.value, unit == "root")]
            yield from [Call(op.kind, n, _int(elements) * wire)] * count


def _ddp_bucket_calls(
    pl: Placement,
    program: StepProgram,
    ts: list[Tensor],
    impl: Implementation,
    precision: Precision,
    force: bool = False,
) -> Iterator[Call]:
    if not (force or _has_ddp_buckets(program)):
        return
    dp = pl.axis_where(lambda kind: kind is DATA)
    assert dp is not None  # DDP buckets run along the data axis
    n = int(pl.degree(dp))
    wire = precision.wire_bytes_of(G)
    caps = [impl.ddp_first_bucket_bytes]
    size = 0
    for t in reversed(ts):
        size += _int(tensor_elements(pl, G, t, dp)) * wire
        if size >= caps[-1]:
            yield Call(OpKind.ALL_REDUCE, n, size)
            caps.append(impl.ddp_bucket_bytes)
            size = 0
    if size:
        yield Call(OpKind.ALL_REDUCE, n, size)


__all__ = [
    "LAYER_GROUPS",
    "CPU_DROPOUT_MASK_BYTES",
    "Implementation",
    "Prediction",
    "TORCH_PRECISION",
    "harness_precision",
    "parameter_tensors",
    "predict",
]
