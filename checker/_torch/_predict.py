"""Our cost model's prediction for one rank of a PyTorch run, implementation effects included.

The numbers come from ``formal`` alone: ``memory()`` on the composition's placement and the
collectives of ``derive_program()``. What PyTorch does beyond the textbook placement is stated
as ``Implementation``: named, documented facts about the engine, each on or off, none a fudge
factor. The formal program says *which* collectives run and on how many elements; the
implementation says how the engine cuts them into calls (FSDP2 one call per ``fully_shard``
unit, DDP one per gradient bucket, DTensor one per tensor) and which extra collectives its
layers add (the vocabulary-parallel loss). The vocabulary-parallel embedding's and head's
activation collectives are ops of the program, run on the stage that holds them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import sympy as sp

from checker._torch._record import Call
from formal._axes import DATA, TENSOR, AxisKind
from formal._costs import (
    activation_memory,
    holds_io_activations,
    in_flight_micro_batches,
    memory,
    op_stage_factor,
    stage_in_flight,
)
from formal._exact import exact, exact_int
from formal._model import PRECISIONS, Ffn, Norm, Precision, Transformer
from formal._placement import Placement
from formal._program import Op, StepProgram, derive_program, group_sizes, shard_elements
from formal._strategies import Composition
from formal._vocab import (
    ATTENTION,
    EMBEDDING,
    FINAL_NORM,
    HEAD,
    LAYER_GROUPS,
    MLP,
    NORM,
    OUTPUT_IO,
    POSITION,
    ROW_BIAS,
    Axis,
    Group,
    OpKind,
    Stage,
    State,
)
from formal.errors import ModelError

P, G, A = State.PARAMETERS, State.GRADIENTS, State.ACTIVATIONS
MiB = 2**20

# The precision the PyTorch runs use: fp32 parameters, gradients and activations, Adam.
TORCH_PRECISION = PRECISIONS["fp32-adam"]


@dataclass(frozen=True)
class Implementation:
    """What PyTorch 2.13 does beyond the placement (pytorch-ground-truth.md). Each field names
    one effect; the defaults are the engine's own defaults, as the harness runs it."""

    # FSDP2: ``reshard_after_forward=None`` on the root module means False, so the root's
    # parameters (here embedding, final norm, head) stay unsharded from forward into backward:
    # backward all-gathers only the blocks.
    fsdp_root_unsharded: bool = True
    # DDP without ``gradient_as_bucket_view``: the reducer keeps its own flat buckets, a second
    # full copy of every gradient. Buckets fill in reverse registration order (the gradient-ready
    # order of a sequential model), the first closing at 1 MiB
    # (``dist._DEFAULT_FIRST_BUCKET_BYTES``), the others at ``bucket_cap_mb`` = 25 MiB; a bucket
    # closes once it reaches its cap. One all-reduce per bucket.
    ddp_bucket_copy: bool = True
    ddp_first_bucket_bytes: int = 1 * MiB
    ddp_bucket_bytes: int = 25 * MiB
    # DTensor's embedding backward on a row-sharded (vocabulary-parallel) table returns a
    # Replicate gradient: every tp rank holds the full-vocabulary embedding gradient.
    tp_embedding_full_gradient: bool = True
    # DTensor ``RowwiseParallel`` adds its (replicated) bias to the partial sum before the
    # reduction, so under sequence parallelism the bias gradient is complete (Megatron adds it
    # after the reduce-scatter, where the gradient is partial and must be all-reduced).
    tp_row_bias_before_reduction: bool = True
    # ``loss_parallel`` cross-entropy over vocabulary-sharded logits: all-reduces of one value
    # per token (max, sum of exponentials, target logit), fp32.
    tp_loss_reductions: int = 3
    # DTensor ``ColwiseParallel(input_layouts=Shard(1))`` saves the all-gathered input of the
    # QKV and FC1 matmuls (and of the head) for backward; Megatron (Korthikanti et al. 2022,
    # sections 4.2.2 and 4.3) keeps only the sequence shard and all-gathers it again in
    # backward. Two of LAYER_IO's four activations per sbh, and one of OUTPUT_IO's two, are
    # then held whole, not split by tp.
    sp_saves_gathered_inputs: bool = True
    # PyTorch's CPU dropout keeps the scaled float noise, not a 1-byte mask: 4-byte masks.
    dropout_mask_bytes: int = 4

    def precision(self, base: Precision = TORCH_PRECISION) -> Precision:
        return replace(base, mask_bytes=self.dropout_mask_bytes)


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor of the formal model, in registration order."""

    name: str
    group: Group
    elements: int
    layer: int | None  # None: not in a transformer block


def parameter_tensors(model: Transformer) -> list[Tensor]:
    """The parameter tensors a GPT-style model registers, in order, from the formal description
    (fused QKV, GELU MLP, LayerNorm or RMSNorm, optional biases, learned positions, untied head).
    Their sizes add up to the formal groups (checked)."""
    if model.ffn_kind is not Ffn.GELU or model.is_moe:
        raise ModelError(f"{model.name}: the tensor layout covers dense GELU models only")
    h, f, hd = model.hidden, model.ffn_, model.head_dim
    qkv = model.heads * hd + 2 * model.kv_heads_ * hd
    out: list[Tensor] = [Tensor("embed.weight", EMBEDDING, model.vocab * h, None)]
    if model.learned_positions:
        out.append(Tensor("pos.weight", POSITION, model.seq * h, None))

    def norm(prefix: str, group: Group, layer: int | None) -> list[Tensor]:
        ts = [Tensor(f"{prefix}.weight", group, h, layer)]
        if model.norm is Norm.LAYERNORM:
            ts.append(Tensor(f"{prefix}.bias", group, h, layer))
        return ts

    def linear(prefix: str, group: Group, bias_group: Group, n_in: int, n_out: int, layer: int) -> list[Tensor]:
        ts = [Tensor(f"{prefix}.weight", group, n_in * n_out, layer)]
        if model.bias:
            ts.append(Tensor(f"{prefix}.bias", bias_group, n_out, layer))
        return ts

    for i in range(model.layers):
        pre = f"layers.{i}"
        out += norm(f"{pre}.ln1", NORM, i)
        out += linear(f"{pre}.qkv", ATTENTION, ATTENTION, h, qkv, i)
        out += linear(f"{pre}.proj", ATTENTION, ROW_BIAS, model.heads * hd, h, i)
        out += norm(f"{pre}.ln2", NORM, i)
        out += linear(f"{pre}.fc1", MLP, MLP, h, f, i)
        out += linear(f"{pre}.fc2", MLP, ROW_BIAS, f, h, i)
    if model.final_norm:
        out += norm("norm", FINAL_NORM, None)
    if not model.tied_embeddings:
        out.append(Tensor("head.weight", HEAD, model.vocab * h, None))
    totals: dict[Group, int] = {}
    for t in out:
        totals[t.group] = totals.get(t.group, 0) + t.elements
    assert totals == model.group_elements(), (totals, model.group_elements())
    return out


@dataclass(frozen=True)
class Prediction:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    calls: tuple[Call, ...]
    stage: Stage


def _int(x: sp.Expr) -> int:
    return exact_int(x)


def stage_of(pl: Placement, rank: int) -> Stage:
    return Stage.of(rank, int(pl.pipeline_degree))


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
    comp: Composition, model: Transformer, impl: Implementation = Implementation(), rank: int = 0
) -> Prediction:
    """Per-rank model-state bytes, activation bytes and collective calls of one steady step."""
    precision = impl.precision()
    pl = comp.placement(model)
    program = derive_program(pl, model)
    sizes = group_sizes(model)
    stage = stage_of(pl, rank)
    mem = memory(pl, model, precision, sizes, stage)
    grads = mem.gradients.total
    if _has_ddp_buckets(program) and impl.ddp_bucket_copy:
        grads += _ddp_reduced_bytes(program, precision)
    if impl.tp_embedding_full_gradient:
        grads += _embedding_gradient_replicas(pl, model, precision, stage)
    index = rank if int(pl.pipeline_degree) > 1 else None  # pipeline rank r runs stage r
    act = activation_memory(pl, model, precision, stage, index)
    assert act is not None
    act += _sequence_parallel_gathered_inputs(pl, model, impl, precision, stage, index)
    calls = tuple(sorted(_calls(pl, program, model, impl, precision, rank)))
    return Prediction(_int(mem.parameters.total), _int(grads), _int(mem.optimizer.total), _int(act), calls, stage)


def _sequence_parallel_gathered_inputs(
    pl: Placement,
    model: Transformer,
    impl: Implementation,
    precision: Precision,
    stage: Stage,
    index: int | None = None,
) -> sp.Expr:
    tp = pl.axis_where(lambda kind: kind is TENSOR)
    t = sp.Integer(1) if tp is None else pl.degree(tp)
    if not impl.sp_saves_gathered_inputs or tp is None or t == 1 or not pl.mode(A, _layer_io(), tp).is_sharded:
        return sp.Integer(0)
    sbh = sp.Integer(model.seq * model.micro_batch * model.hidden)
    layers = sp.Integer(model.layers) / pl.pipeline_degree
    whole = precision.activations * sbh * (1 - 1 / t)  # one gathered input beyond its shard
    extra = 2 * whole * layers  # the QKV and FC1 inputs
    if holds_io_activations(pl, OUTPUT_IO, stage):
        extra += whole  # the head's input
    return exact(extra * (in_flight_micro_batches(pl, stage) if index is None else stage_in_flight(pl, index)))


def _on(op: Op, kind: AxisKind) -> bool:
    """Whether ``op`` runs along an axis of ``kind`` (PyTorch's engines are chosen by kind)."""
    return op.axis is not None and op.axis.kind is kind


def _has_ddp_buckets(program: StepProgram) -> bool:
    return any(op.kind is OpKind.ALL_REDUCE and op.state is G and _on(op, DATA) for op in program.ops)


def _ddp_reduced_bytes(program: StepProgram, precision: Precision) -> sp.Expr:
    return sum(
        (
            op.elements * precision.bytes_of(G)
            for op in program.ops
            if op.kind is OpKind.ALL_REDUCE and op.state is G and _on(op, DATA)
        ),
        sp.Integer(0),
    )


def _embedding_gradient_replicas(pl: Placement, model: Transformer, precision: Precision, stage: Stage) -> sp.Expr:
    """The full-vocabulary gradient DTensor keeps on each tp rank, beyond the rank's shard,
    while the gradient is the persistent one (not reduce-scattered away by FSDP)."""
    tp = pl.axis_where(lambda kind: kind is TENSOR)
    if tp is None or EMBEDDING not in pl.groups(G) or not pl.computes_sharded(tp, EMBEDDING):
        return sp.Integer(0)
    if any(pl.mode(G, EMBEDDING, ax).is_sharded for ax in pl.axes if ax.splits_data):
        return sp.Integer(0)
    if stage != Stage.FIRST and int(pl.pipeline_degree) > 1:
        return sp.Integer(0)
    shard = shard_elements(pl, G, EMBEDDING, sp.Integer(model.group_elements()[EMBEDDING]), None, stage)
    return (shard * pl.degree(tp) - shard) * precision.bytes_of(G)


def _calls(
    pl: Placement, program: StepProgram, model: Transformer, impl: Implementation, precision: Precision, rank: int
) -> Iterator[Call]:
    tensors = parameter_tensors(model)
    stage = stage_of(pl, rank)
    p = int(pl.pipeline_degree)
    per_stage = model.layers // p
    my_layers = set(range(rank * per_stage, (rank + 1) * per_stage)) if p > 1 else set(range(model.layers))
    # Registration order is kept: DDP's buckets follow it (reversed).
    mine = [t for t in tensors if (t.layer in my_layers if t.layer is not None else on_stage(pl, t, rank))]
    for op in program.ops:
        if not op.kind.is_collective or op.axis is None:
            continue
        n = int(op.participants if op.participants is not None else pl.degree(op.axis))
        wire = precision.wire_bytes_of(op.state)
        count = _int(op.count)
        if op.state is A:
            # This rank's share of the union over stages: the embedding's ops on the first stage,
            # the head's on the last, a middle stage's sends both ways (formal's cost model).
            calls = _int(op.count * op_stage_factor(op, pl, stage))
            yield from [Call(op.kind, n, _int(op.elements) * wire)] * calls
            continue
        group_tensors = [t for t in mine if t.group is op.group]
        if not group_tensors:
            continue
        yield from _state_calls(pl, op, n, wire, count, group_tensors, impl)
    yield from _ddp_bucket_calls(pl, program, mine, impl, precision)
    yield from _fsdp_unit_calls(pl, program, mine, impl, precision, stage)
    yield from _loss_parallel_calls(pl, model, impl, stage)


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
            elements = shard_elements(pl, G, t.group, sp.Integer(t.elements), op.axis)
            yield from [Call(op.kind, n, _int(elements) * wire)] * count
        return
    raise AssertionError(f"no engine mapping for {op}")


def _units(pl: Placement, ts: list[Tensor], state: State, skip: Axis) -> dict[str, sp.Expr]:
    """FSDP2 units: one per block (``fully_shard`` on each), the root for everything else."""
    out: dict[str, sp.Expr] = {}
    for t in ts:
        unit = "root" if t.layer is None else f"layer{t.layer}"
        out[unit] = out.get(unit, sp.Integer(0)) + shard_elements(pl, state, t.group, sp.Integer(t.elements), skip)
    return out


def _fsdp_unit_calls(
    pl: Placement, program: StepProgram, ts: list[Tensor], impl: Implementation, precision: Precision, stage: Stage
) -> Iterator[Call]:
    seen: set[tuple[OpKind, Axis, str]] = set()
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
            yield from [Call(op.kind, n, _int(elements) * wire)] * _int(op.count)


def _ddp_bucket_calls(
    pl: Placement, program: StepProgram, ts: list[Tensor], impl: Implementation, precision: Precision
) -> Iterator[Call]:
    if not _has_ddp_buckets(program):
        return
    dp = pl.axis_where(lambda kind: kind is DATA)
    assert dp is not None  # DDP buckets run along the data axis
    n = int(pl.degree(dp))
    wire = precision.wire_bytes_of(G)
    caps = [impl.ddp_first_bucket_bytes]
    size = 0
    for t in reversed(ts):
        size += _int(shard_elements(pl, G, t.group, sp.Integer(t.elements), dp)) * wire
        if size >= caps[-1]:
            yield Call(OpKind.ALL_REDUCE, n, size)
            caps.append(impl.ddp_bucket_bytes)
            size = 0
    if size:
        yield Call(OpKind.ALL_REDUCE, n, size)


def _loss_parallel_calls(pl: Placement, model: Transformer, impl: Implementation, stage: Stage) -> Iterator[Call]:
    """``loss_parallel``'s fp32 per-token all-reduces on the last stage, when tp splits the head."""
    tp = pl.axis_where(lambda kind: kind is TENSOR)
    t = 1 if tp is None else int(pl.degree(tp))
    head = HEAD if HEAD in pl.groups(P) else EMBEDDING
    if tp is None or t == 1 or not holds_io_activations(pl, OUTPUT_IO, stage) or not pl.computes_sharded(tp, head):
        return
    tokens = model.micro_batch * model.seq * 4  # the loss's statistics are fp32
    yield from [Call(OpKind.ALL_REDUCE, t, tokens)] * (impl.tp_loss_reductions * pl.options.micro_batches)


def _layer_io() -> Group:
    from formal._vocab import LAYER_IO

    return LAYER_IO


__all__ = ["LAYER_GROUPS", "Implementation", "Prediction", "TORCH_PRECISION", "parameter_tensors", "predict"]
