"""The strategy library: every strategy is only a placement along one axis.

Each constructor returns a ``Strategy`` whose entries are the modes of the strategy table
(docs/semantics.md, "The strategy library"). Costs and verdicts are derived from these entries alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from formal import _num as num
from formal._model import Model, Transformer
from formal._num import Num
from formal._placement import (
    SG,
    Entry,
    Key,
    Options,
    Placement,
    R,
    Recompute,
    S,
    Strategy,
)
from formal._vocab import (
    ACTIVATION_GROUPS,
    ATTENTION,
    ATTN_SCORES,
    EMBEDDING,
    EMBEDDING_IO,
    EXPERTS,
    HEAD,
    IO_ACTIVATION_GROUPS,
    LAYER_IO,
    LINEAR_INNER,
    LOGITS,
    MLP,
    OUTPUT_IO,
    WEIGHTS,
    Axis,
    Group,
    Mode,
    State,
)
from formal.errors import CompositionError

P, O, G, A = State.PARAMETERS, State.OPTIMIZER, State.GRADIENTS, State.ACTIVATIONS  # noqa: E741 (the paper's P/O/G/A)


def _activations(axis: Axis) -> tuple[tuple[State, Group | None], Entry]:
    """Every activation group as the axis' kind holds it by default (``AxisKind.activations``):
    split along data, context, expert and pipeline axes, whole along tensor-parallel ones."""
    return ((A, None), Entry(axis.kind.activations))


def _data_parallel(
    name: str, p: Entry, o: Entry, g: Entry, description: str, source: str, axis: Axis = Axis.DP
) -> Strategy:
    return Strategy(
        name,
        axis,
        None,
        (((P, None), p), ((O, None), o), ((G, None), g), _activations(axis)),
        frozenset(),
        description,
        source,
    )


ZERO_SOURCE = "Rajbhandari et al., ZeRO, SC'20, section 5 (Figure 1)"


def dp() -> Strategy:
    return _data_parallel(
        "dp", R, R, R, "data parallel (DDP): everything replicated", "Li et al., PyTorch Distributed, VLDB'20"
    )


def dpr() -> Strategy:
    """The replicate axis of hybrid sharding (HSDP = FSDP along dp composed with this)."""
    return _data_parallel(
        "dpr", R, R, R, "data-parallel replicate axis of HSDP", "PyTorch FSDP HYBRID_SHARD", axis=Axis.DPR
    )


def zero(stage: int) -> Strategy:
    match stage:
        case 1:
            return _data_parallel("zero1", R, S, R, "ZeRO stage 1: optimizer state sharded", ZERO_SOURCE)
        case 2:
            return _data_parallel("zero2", R, S, S, "ZeRO stage 2: optimizer state and gradients sharded", ZERO_SOURCE)
        case 3:
            return _data_parallel(
                "zero3", SG, S, S, "ZeRO stage 3: parameters gathered per use, all sharded", ZERO_SOURCE
            )
        case _:
            raise CompositionError(f"zero{stage}: ZeRO stage must be 1, 2 or 3")


def fsdp() -> Strategy:
    return _data_parallel(
        "fsdp", SG, S, S, "FSDP FULL_SHARD (reshard_after_forward=True)", "Zhao et al., PyTorch FSDP, VLDB'23"
    )


def fsdp_shard_grad_op() -> Strategy:
    return _data_parallel(
        "fsdp-sgo",
        Entry(Mode.SHARDED_GATHER, keep_gathered=True),
        S,
        S,
        "FSDP SHARD_GRAD_OP (reshard_after_forward=False): gathered once per micro-batch, held through backward",
        "Zhao et al., PyTorch FSDP, VLDB'23",
    )


def hsdp() -> Strategy:
    s = fsdp()
    return Strategy(
        "hsdp",
        s.axis,
        None,
        s.entries,
        s.compute_sharded,
        "HSDP: FSDP along dp, compose with dpr for the replicate axis",
        "PyTorch FSDP HYBRID_SHARD",
    )


HPZ_SOURCE = (
    "Wang et al. 2023, ZeRO++ (arXiv 2306.10209), section 3.2 (hpZ); DeepSpeed "
    "zero_optimization.zero_hpz_partition_size"
)


def hpz_dpr() -> Strategy:
    """The across-node axis of ZeRO++'s hierarchical partitioning (hpZ), composed with ZeRO-3 on
    dp = the devices of one node: ``zero3<k>xhpz-dpr<n>`` (the ``hpz`` modifier writes it).

    Along dpr the parameters are gathered once per micro-batch in the forward and held through
    the backward, so after the forward a device holds P sharded along dp only, P/k: the secondary
    partition, from which the backward gathers within the node. FSDP2 spells the same placement
    ``fully_shard(reshard_after_forward=k)``: reshard after forward to a group of k devices
    (torch.distributed.fsdp.fully_shard docs). Optimizer state and gradients are sharded along
    dpr as along dp (reduce-scattered over the whole group, as ZeRO-3 does).
    """
    return _data_parallel(
        "hpz-dpr",
        Entry(Mode.SHARDED_GATHER, keep_gathered=True),
        S,
        S,
        "ZeRO++ hpZ across nodes: parameters gathered in forward, held through backward "
        "(compose zero3<k>xhpz-dpr<n>, or write zero3xhpz)",
        HPZ_SOURCE,
        axis=Axis.DPR,
    )


def distributed_optimizer() -> Strategy:
    s = zero(1)
    return Strategy(
        "distopt",
        s.axis,
        None,
        s.entries,
        s.compute_sharded,
        "Megatron distributed optimizer: ZeRO-1 (use --precision megatron)",
        "Megatron-LM docs, distributed optimizer",
    )


# Megatron TP: column/row-parallel matrices and vocabulary-parallel embedding/head are split;
# LayerNorms, row-parallel biases, position embedding and router are replicated.
TP_SHARDED: frozenset[Group] = frozenset({ATTENTION, MLP, EMBEDDING, HEAD, EXPERTS, WEIGHTS})


def tp() -> Strategy:
    entries: list[tuple[tuple[State, Group | None], Entry]] = []
    for state in (P, O, G):
        entries += [((state, g), S) for g in sorted(TP_SHARDED)]
    entries += [((A, LAYER_IO), R), ((A, LINEAR_INNER), S), ((A, ATTN_SCORES), S)]
    # Korthikanti 4.3: the embedding dropout and the output layer's inputs are whole on every
    # rank (split only by sequence parallelism); the logits are vocabulary-parallel.
    entries += [((A, EMBEDDING_IO), R), ((A, OUTPUT_IO), R), ((A, LOGITS), S)]
    return Strategy(
        "tp",
        Axis.TP,
        None,
        tuple(entries),
        TP_SHARDED,
        "Megatron tensor parallelism: column/row-parallel matrices, vocab-parallel embedding, replicated LayerNorm",
        "Shoeybi et al. 2019, Megatron-LM, section 3",
    )


def pp() -> Strategy:
    return Strategy(
        "pp",
        Axis.PP,
        None,
        (((P, None), S), ((O, None), S), ((G, None), S), _activations(Axis.PP)),
        None,
        "pipeline parallelism: layers split into stages",
        "Narayanan et al. 2021, PTD-P, section 2.2",
    )


def cp() -> Strategy:
    return Strategy(
        "cp",
        Axis.CP,
        None,
        (((P, None), R), ((O, None), R), ((G, None), R), _activations(Axis.CP)),
        frozenset(),
        "context parallelism: sequence split, K/V exchanged in attention",
        "Megatron-LM context parallelism (ring attention)",
    )


def ep() -> Strategy:
    entries: list[tuple[tuple[State, Group | None], Entry]] = [((st, EXPERTS), S) for st in (P, O, G)] + [
        _activations(Axis.EP)
    ]
    return Strategy(
        "ep",
        Axis.EP,
        None,
        tuple(entries),
        frozenset({EXPERTS}),
        "expert parallelism: experts split, tokens exchanged all-to-all",
        "Lepikhin et al. 2020, GShard; Megatron-LM MoE",
    )


LIBRARY: dict[str, Callable[[], Strategy]] = {
    "dp": dp,
    "ddp": dp,
    "dpr": dpr,
    "zero1": lambda: zero(1),
    "zero2": lambda: zero(2),
    "zero3": lambda: zero(3),
    "fsdp": fsdp,
    "fsdp-sgo": fsdp_shard_grad_op,
    "hsdp": hsdp,
    "hpz-dpr": hpz_dpr,
    "distopt": distributed_optimizer,
    "tp": tp,
    "pp": pp,
    "cp": cp,
    "ep": ep,
}


@dataclass(frozen=True)
class Composition:
    """Strategies on distinct axes plus modifiers. ``str(c)`` is the composition language."""

    strategies: tuple[Strategy, ...]
    options: Options = Options()  # noqa: RUF009 (frozen, immutable)
    modifiers: tuple[str, ...] = ()  # the modifier terms as written (round-trip)

    def __str__(self) -> str:
        return "x".join([str(s) for s in self.strategies] + list(self.modifiers))

    @property
    def devices(self) -> int:
        n = 1
        for s in self.strategies:
            n *= s.degree or 1
        return n

    def mesh(self) -> dict[Axis, int]:
        """Axis to degree; an axis used twice keeps the product (a rule violation, not an error)."""
        out: dict[Axis, int] = {}
        for s in self.strategies:
            out[s.axis] = out.get(s.axis, 1) * (s.degree or 1)
        return out

    def strategy_on(self, axis: Axis) -> Strategy | None:
        for s in self.strategies:
            if s.axis is axis:
                return s
        return None

    def placement(self, model: Model, *, symbolic: bool = False) -> Placement:
        """Apply the composition in one documented order (torchtitan ``parallelize`` style).

        1. each strategy's entries along its axis, for the model's groups;
        2. sequence parallelism: activations at LayerNorms/dropouts sharded along tp;
        3. tied embeddings: the embedding is replicated on the first and last stage;
        4. recomputation: activations materialized (``M``), axis-free;
        5. offload: optimizer state / parameters offloaded (``O``), axis-free.
        """
        mesh = self.mesh()
        degrees: dict[Axis, Num] = dict(mesh)
        if symbolic:  # the planner's and the JSON's expressions: one symbol per degree
            import sympy as sp

            degrees = {axis: sp.Symbol(f"d_{axis.value}", positive=True, integer=True) for axis in mesh}
        param_groups = tuple(model.group_elements())
        act_groups = ACTIVATION_GROUPS if isinstance(model, Transformer) else ()
        io_groups = IO_ACTIVATION_GROUPS if isinstance(model, Transformer) else ()
        keys: list[Key] = [(st, g) for st in (P, O, G) for g in param_groups]
        keys += [(A, g) for g in act_groups + io_groups]
        rows: dict[Key, dict[Axis, Entry]] = {k: {} for k in keys}
        for strategy in self.strategies:
            _apply_strategy(rows, strategy)
        if self.options.sequence_parallel:
            _apply_sequence_parallel(rows)
        tied = _apply_tied_embeddings(rows, model, mesh)
        local: dict[Key, Mode] = {}
        _apply_recompute(local, self.options.recompute, act_groups)
        _apply_offload(local, self.options, param_groups)
        compute = tuple(
            (
                s.axis,
                frozenset(param_groups)
                if s.compute_sharded is None
                else frozenset(g for g in param_groups if g in s.compute_sharded),
            )
            for s in self.strategies
        )
        return Placement(
            mesh=tuple(degrees.items()),
            modes=tuple((k, tuple(rows[k].items())) for k in keys),
            local=tuple(local.items()),
            compute_sharded=compute,
            options=self.options,
            tied=tied,
            layer_share=_layer_share(model, self.options, degrees),
        )


def _layer_share(model: Model, options: Options, degrees: dict[Axis, Num]) -> Num | None:
    """Declared uneven stages: the fullest stage holds ceil(L/p) of the L layers (Megatron-LM's
    layout; Llama 3 405B puts 126 layers on 16 stages, 8 on the fullest). None: even split."""
    pipeline = next((a for a in degrees if a.kind.is_pipeline), None)
    if not options.uneven_stages or not isinstance(model, Transformer) or pipeline is None:
        return None
    layers = model.layers
    return num.ratio(num.ceiling(num.ratio(layers, degrees[pipeline])), layers)


def _apply_strategy(rows: dict[Key, dict[Axis, Entry]], strategy: Strategy) -> None:
    for (state, group), row in rows.items():
        row[strategy.axis] = strategy.entry(state, group)


def _apply_sequence_parallel(rows: dict[Key, dict[Axis, Entry]]) -> None:
    # Korthikanti et al. 2022, section 4.2.2: the 10sbh of LayerNorm/dropout activations are
    # split along the sequence across the tensor-parallel group; section 4.3: so are the input
    # embeddings' dropout and the final LayerNorm's and output projection's inputs.
    for group in (LAYER_IO, EMBEDDING_IO, OUTPUT_IO):
        for axis in rows.get((A, group), {}):
            if axis.kind.sequence_parallel:
                rows[(A, group)][axis] = S


def _apply_tied_embeddings(rows: dict[Key, dict[Axis, Entry]], model: Model, mesh: dict[Axis, int]) -> frozenset[Group]:
    pipeline = next((a for a in mesh if a.kind.is_pipeline), None)
    if not model.tied_embeddings or pipeline is None:
        return frozenset()
    for st in (P, O, G):
        if (st, EMBEDDING) in rows:
            rows[(st, EMBEDDING)][pipeline] = R  # held by the first and the last stage
    return frozenset({EMBEDDING})


def _apply_recompute(local: dict[Key, Mode], recompute: Recompute, act_groups: tuple[Group, ...]) -> None:
    match recompute:
        case Recompute.NONE:
            pass
        case Recompute.SELECTIVE:  # Korthikanti section 5: recompute the attention core only
            if ATTN_SCORES in act_groups:
                local[(A, ATTN_SCORES)] = Mode.MATERIALIZED
        case Recompute.FULL:  # only each layer's input (2sbh) is kept as a checkpoint
            for g in act_groups:
                local[(A, g)] = Mode.MATERIALIZED
        case _:
            raise AssertionError(recompute)


def _apply_offload(local: dict[Key, Mode], options: Options, param_groups: tuple[Group, ...]) -> None:
    for g in param_groups:
        if options.offload_optimizer:  # ZeRO-Offload: gradients, optimizer state and update on host
            local[(O, g)] = Mode.OFFLOADED
            local[(G, g)] = Mode.OFFLOADED
        if options.offload_parameters:  # ZeRO-Infinity style: parameters fetched before each use
            local[(P, g)] = Mode.OFFLOADED
