"""The composition rules: one table, read by z3 and by the planner.

A composition is judged by the rules of this table, and nothing else: ``formal._smt`` turns each
applicable rule into a tracked z3 constraint over the composition's degrees and the model's
sizes (an unsat core names the broken rule), and ``checker._plan_rules`` evaluates the same
predicates on whole arrays of candidate meshes at once. A rule's predicate is written once,
against ``Terms``: z3 terms in one case, numpy arrays in the other, with the same arithmetic
(``%``, ``*``, ``==``, ``<=``) and two connectives the backend supplies (``implies``, ``all_of``).

Every rule has a provenance:

* **correctness**: breaking it means the placement cannot compute what one device computes
  (a tensor split that does not divide, sequence parallelism with no tensor-parallel group to
  split across, ...). z3 refutes the composition, and the planner never proposes it.
* **framework**: a restriction of one framework's implementation, not of the mathematics (Megatron-
  LM's interleaved schedule wants the micro-batch count to be a multiple of the pipeline degree).
  It is never a refutation: ``check`` prints it as a named note, and the planner keeps the
  candidate and attaches the same note.

``Setting`` says which rules apply (the model, the modifiers, the axes the composition places
on); the degrees only enter the predicates. "Present" differs by reader and is the backend's to
say: z3 asks whether the composition has a term on the axis (``tp1`` is a tp axis of degree 1),
the planner whether the degree exceeds 1 (its compositions leave degree-1 axes out).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from formal._axes import nesting_order
from formal._model import Model, Transformer
from formal._placement import Options, Strategy
from formal._strategies import Composition
from formal._vocab import ACTIVATION_GROUPS, IO_ACTIVATION_GROUPS, LAYER_GROUPS, Axis, AxisKind, Group, State


class Provenance(StrEnum):
    CORRECTNESS = "correctness"  # z3 refutes; the planner never proposes it
    FRAMEWORK = "framework"  # a named note, in check and in the planner alike


class Terms(Protocol):
    """What rule predicates are built from (z3 terms, or numpy arrays over candidate meshes)."""

    def degree(self, axis: Axis) -> Any: ...  # the axis's degree (1 where the axis is absent)

    def present(self, axis: Axis) -> Any: ...  # the composition places on this axis

    def size(self, name: str, value: int) -> Any: ...  # a model size or count, named

    def flag(self, name: str, value: bool) -> Any: ...  # a named fact about the model or modifiers

    def implies(self, a: Any, b: Any) -> Any: ...

    @property
    def micro_batches(self) -> Any: ...


@dataclass(frozen=True)
class Setting:
    """What decides which rules apply: never the degrees themselves."""

    model: Model
    options: Options
    axes: frozenset[Axis]  # the axes the composition (or the planner's family) places on
    devices: int | None = None  # the device count the degrees must multiply to, when given
    strategies_on: Mapping[Axis, tuple[str, ...]] = field(default_factory=dict)  # terms per axis
    strategies: tuple[Strategy, ...] = ()  # the strategies themselves: the placement rules read their modes

    @property
    def chunks(self) -> int:
        return self.options.chunks if self.options.chunks > 1 else 1


@dataclass(frozen=True)
class Rule:
    """One composition rule: where it applies, what must hold, and how to say it broke.

    ``explain(mesh, setting)`` and ``witness(mesh, setting)`` take concrete degrees (axis to
    degree, absent axes left out) and are only called for a rule that is broken there."""

    name: str
    provenance: Provenance
    axis: Axis | None
    applies: Callable[[Setting], bool]
    holds: Callable[[Terms, Setting], Any]
    explain: Callable[[Mapping[Axis, int], Setting], str]
    witness: Callable[[Mapping[Axis, int], Setting], dict[str, Any]]


def _product(terms: Terms, axes: tuple[Axis, ...]) -> Any:
    out: Any = 1
    for a in axes:
        out = out * terms.degree(a)
    return out


def _divides(
    size_name: str,
    value: Callable[[Model], int],
    axes: tuple[Axis, ...],
    why: str,
    when: Callable[[Setting], bool] = lambda s: True,
    name_axis: Axis | None = None,
) -> Rule:
    """``size`` divisible by the product of the degrees of ``axes`` (those present)."""
    named = name_axis or axes[-1]

    def present(s: Setting) -> tuple[Axis, ...]:
        return tuple(a for a in axes if a in s.axes)

    def applies(s: Setting) -> bool:
        return isinstance(s.model, Transformer) and bool(present(s)) and when(s)

    def holds(t: Terms, s: Setting) -> Any:
        return t.size(size_name, value(s.model)) % _product(t, present(s)) == 0

    def parts(mesh: Mapping[Axis, int], s: Setting) -> tuple[int, int, str]:
        d = 1
        for a in present(s):
            d *= mesh.get(a, 1)
        return value(s.model), d, "*".join(a.value for a in present(s))

    def explain(mesh: Mapping[Axis, int], s: Setting) -> str:
        size, d, label = parts(mesh, s)
        return f"{size_name} {size} is not divisible by {label} {d} ({size} = {size // d} x {d} + {size % d}); {why}"

    def witness(mesh: Mapping[Axis, int], s: Setting) -> dict[str, Any]:
        size, d, label = parts(mesh, s)
        return {size_name: size, label: d, "remainder": size % d}

    return Rule(f"divides[{size_name}, {named.value}]", Provenance.CORRECTNESS, named, applies, holds, explain, witness)


def _transformer(m: Model) -> Transformer:
    assert isinstance(m, Transformer)
    return m


def _orthogonality(axis: Axis) -> Rule:
    return Rule(
        f"orthogonality[{axis.value}]",
        Provenance.CORRECTNESS,
        axis,
        lambda s: axis in s.axes,
        lambda t, s: t.size(f"strategies_on_{axis.value}", len(s.strategies_on.get(axis, ("",)))) <= 1,
        lambda mesh, s: (
            f"axis {axis.value} carries {len(s.strategies_on[axis])} strategies "
            f"({', '.join(s.strategies_on[axis])}); each axis carries one strategy"
        ),
        lambda mesh, s: {"axis": axis.value, "strategies": list(s.strategies_on[axis])},
    )


def _device_count_holds(t: Terms, s: Setting) -> Any:
    assert s.devices is not None
    return _product(t, tuple(a for a in Axis if a in s.axes)) == t.size("devices", s.devices)


def _device_count_explain(mesh: Mapping[Axis, int], s: Setting) -> str:
    product = " * ".join(f"{a.value}({d})" for a, d in mesh.items())
    total = 1
    for d in mesh.values():
        total *= d
    return f"{product} = {total} != devices({s.devices})"


def _device_count_witness(mesh: Mapping[Axis, int], s: Setting) -> dict[str, Any]:
    total = 1
    for d in mesh.values():
        total *= d
    return {"degrees": {a.value: d for a, d in mesh.items()}, "product": total, "devices": s.devices}


def _layers_rule(pp: Axis, uneven: bool) -> Rule:
    def applies(s: Setting) -> bool:
        return isinstance(s.model, Transformer) and pp in s.axes and s.options.uneven_stages == uneven

    def stages(t: Terms, s: Setting) -> Any:
        return t.degree(pp) * t.size("chunks", s.chunks)

    def layers(t: Terms, s: Setting) -> Any:
        return t.size("layers", _transformer(s.model).layers)

    if uneven:  # declared uneven stages: every (virtual) stage holds a whole layer
        return Rule(
            f"stages_hold_layers[{pp.value}]",
            Provenance.CORRECTNESS,
            pp,
            applies,
            lambda t, s: stages(t, s) <= layers(t, s),
            lambda mesh, s: (
                f"pp {mesh[pp]} x chunks {s.chunks} = {mesh[pp] * s.chunks} stages exceed "
                f"the {_transformer(s.model).layers} layers; uneven stages still hold at least one "
                "whole layer each"
            ),
            lambda mesh, s: {"layers": _transformer(s.model).layers, "pp": mesh[pp], "chunks": s.chunks},
        )

    def explain(mesh: Mapping[Axis, int], s: Setting) -> str:
        n, st = _transformer(s.model).layers, mesh[pp] * s.chunks
        return (
            f"layers {n} are not divisible by pp {mesh[pp]} x chunks {s.chunks} "
            f"({n} = {n // st} x {st} + {n % st}); stages hold whole layers "
            "(declare uneven stages with the 'uneven' modifier)"
        )

    return Rule(
        "divides[layers, pp]",
        Provenance.CORRECTNESS,
        pp,
        applies,
        lambda t, s: layers(t, s) % stages(t, s) == 0,
        explain,
        lambda mesh, s: {
            "layers": _transformer(s.model).layers,
            "pp": mesh[pp],
            "chunks": s.chunks,
            "remainder": _transformer(s.model).layers % (mesh[pp] * s.chunks),
        },
    )


def _is_moe(m: Model) -> bool:
    return isinstance(m, Transformer) and m.is_moe


def _axes_of(test: Callable[[AxisKind], bool]) -> tuple[Axis, ...]:
    """The axes whose kind passes ``test``, in ``Axis`` order: the rules a kind brings live on them."""
    return tuple(a for a in Axis if test(a.kind))


_VOCABULARY = _axes_of(lambda k: k.hosts_vocabulary)  # matrices, heads and vocabulary split (Megatron tp)
_PIPELINE = _axes_of(lambda k: k.is_pipeline)
_SEQUENCE = _axes_of(lambda k: k.splits_sequence)  # context parallelism
_SEQUENCE_PARALLEL = _axes_of(lambda k: k.sequence_parallel)
_EXPERTS = _axes_of(lambda k: k.places_experts)


def _tensor_rules(tp: Axis) -> tuple[Rule, ...]:
    """What a tensor-parallel split needs of the model's sizes (Shoeybi et al. 2019, section 3)."""
    return (
        _divides("hidden", lambda m: _transformer(m).hidden, (tp,), "tensor parallelism splits the hidden dimension"),
        _divides("heads", lambda m: _transformer(m).heads, (tp,), "tensor parallelism splits attention heads"),
        _divides(
            "kv_heads",
            lambda m: _transformer(m).kv_heads_,
            (tp,),
            "each tp rank needs whole key/value heads",
            when=lambda s: _transformer(s.model).kv_heads_ != _transformer(s.model).heads,
        ),
        _divides("ffn", lambda m: _transformer(m).ffn_, (tp,), "tensor parallelism splits the FFN dimension"),
        _divides(
            "vocab",
            lambda m: _transformer(m).vocab,
            (tp,),
            "the vocabulary-parallel embedding splits the vocabulary (Megatron-LM #1754)",
        ),
    )


def _sp_needs_tp(tp: Axis) -> Rule:
    return Rule(
        "sp_needs_tp",
        Provenance.CORRECTNESS,
        tp,
        lambda s: s.options.sequence_parallel,
        lambda t, s: t.implies(t.flag("sequence_parallel", True), t.present(tp)),
        lambda mesh, s: "sequence parallelism splits activations across the tp group, and there is no tp axis",
        lambda mesh, s: {"sequence_parallel": True, "tp": False},
    )


def _ep_needs_moe(ep: Axis) -> Rule:
    return Rule(
        "ep_needs_moe",
        Provenance.CORRECTNESS,
        ep,
        lambda s: ep in s.axes,
        lambda t, s: t.implies(t.present(ep), t.flag("moe", _is_moe(s.model))),
        lambda mesh, s: "expert parallelism needs a mixture-of-experts model, and this model is dense",
        lambda mesh, s: {"ep": mesh.get(ep, 1), "experts": getattr(s.model, "experts", 0)},
    )


def _cp_needs_attention(cp: Axis) -> Rule:
    return Rule(
        "cp_needs_attention",
        Provenance.CORRECTNESS,
        cp,
        lambda s: cp in s.axes,
        lambda t, s: t.implies(t.present(cp), t.flag("attention", isinstance(s.model, Transformer))),
        lambda mesh, s: (
            "context parallelism exchanges keys and values in attention, and a bare "
            "parameter count has no attention to split"
        ),
        lambda mesh, s: {"cp": mesh.get(cp, 1), "model": type(s.model).__name__},
    )


def _interleaved_rules(pp: Axis) -> tuple[Rule, ...]:
    return (
        Rule(
            "interleaved_needs_pp",
            Provenance.CORRECTNESS,
            pp,
            lambda s: s.chunks > 1,
            lambda t, s: t.implies(t.size("interleaved_chunks", s.chunks) > 1, t.present(pp)),
            lambda mesh, s: f"an interleaved schedule (v{s.chunks}) splits pipeline stages, and there is no pp axis",
            lambda mesh, s: {"chunks": s.chunks, "pp": False},
        ),
        # Megatron-LM's interleaved schedule (megatron/core/pipeline_parallel/schedules.py,
        # forward_backward_pipelining_with_interleaving) raises "number of microbatches is not
        # divisible by pipeline-model-parallel-size when using interleaved schedule". The
        # mathematics does not need it: any m >= 1 trains the same model.
        Rule(
            "megatron_interleaved_m_multiple_of_pp",
            Provenance.FRAMEWORK,
            pp,
            lambda s: s.chunks > 1 and pp in s.axes,
            lambda t, s: t.micro_batches % t.degree(pp) == 0,
            lambda mesh, s: (
                f"Megatron-LM's interleaved schedule needs the micro-batch count to be a multiple of pp "
                f"(m {s.options.micro_batches}, pp {mesh.get(pp, 1)}); other engines run it as is"
            ),
            lambda mesh, s: {"micro_batches": s.options.micro_batches, "pp": mesh.get(pp, 1)},
        ),
    )


# ---- placement rules: what a strategy's own modes along its axis must say -----------------------
#
# These read the strategies of the setting (a composition's, or the planner's library ones), not
# the degrees: z3 sees each as a named count pinned by a tracked fact (``value[...]``), so the
# unsat core names it. They hold trivially at degree 1 (one device holds and reads everything).


def _strategy_on(s: Setting, axis: Axis) -> Strategy | None:
    return next((st for st in s.strategies if st.axis is axis), None)


def _group_devices(mesh: Mapping[Axis, int], axis: Axis) -> list[int]:
    """Device 0's group along ``axis``: the devices numbered as the simulated mesh numbers them
    (coordinates in mesh order, the last axis fastest; formal._sim_mesh)."""
    axes = list(mesh)
    stride = 1
    for a in axes[axes.index(axis) + 1 :]:
        stride *= mesh[a]
    return [k * stride for k in range(mesh[axis])]


def _split_replicated(s: Setting, axis: Axis) -> tuple[Group, ...]:
    """Groups whose computation the axis's strategy splits while neither their gradient nor their
    optimizer state is sharded there (with the optimizer state sharded, each rank's update reads
    the gradient on its own slice only, where it is complete). Along a pipeline axis the slices
    are the stages' layers: a group outside the layers (embedding, head, final norm) is computed
    whole by the stage that holds it, and a tied embedding's two stages each compute a partial
    gradient of all of it, which the all-reduce between them completes (Megatron-LM's embedding
    group, ``_allreduce_word_embedding_grads`` in megatron/core/distributed/finalize_model_grads.py),
    not a slice."""
    st = _strategy_on(s, axis)
    if st is None:
        return ()
    return tuple(
        g
        for g in s.model.group_elements()
        if st.computes_sharded(g)
        and (g in LAYER_GROUPS or not axis.kind.is_pipeline)
        and not st.entry(State.GRADIENTS, g).mode.is_sharded
        and not st.entry(State.OPTIMIZER, g).mode.is_sharded
    )


def _split_compute_rule(axis: Axis) -> Rule:
    """Split computation over replicated state. A strategy that splits a group's computation along
    an axis (Megatron-LM's column/row-parallel linears, a pipeline's stages, experts) has each rank
    compute, and differentiate, only its own slice: its gradient exists there as slices. Held as a
    replica, each rank's gradient is right on its own slice only, and the update it drives leaves
    the rest of its replicated parameters stale (one device updates all of them every step).
    Sharding the gradient along the axis (G = "S") is what Megatron-LM's tensor parallelism does;
    sharding only the optimizer state (O = "S") also works, since each rank's update then reads the
    gradient on its own slice alone; parameters left replicated are then refreshed from the sharded
    update by the derived program."""
    count = f"split_groups_replicated_gradient_{axis.value}"

    def explain(mesh: Mapping[Axis, int], s: Setting) -> str:
        groups = _split_replicated(s, axis)
        devs = _group_devices(mesh, axis)
        names = ", ".join(g.name for g in groups)
        return (
            f"{names} computed split along {axis.value} with their gradients replicated there: devices "
            f"{', '.join(map(str, devs))} each compute the gradient of their own slice only, so device "
            f"{devs[0]}'s replica of G.{groups[0].name} is the gradient of slice 0 alone and the update leaves "
            f'the other slices of its P.{groups[0].name} stale; shard G (or O) along {axis.value} (G = "S")'
        )

    def witness(mesh: Mapping[Axis, int], s: Setting) -> dict[str, Any]:
        groups = _split_replicated(s, axis)
        return {
            "state": State.GRADIENTS.value,
            "group": groups[0].name,
            "groups": [g.name for g in groups],
            "axis": axis.value,
            "devices": _group_devices(mesh, axis),
            "gradient": "R",
            "compute": "split",
        }

    return Rule(
        f"split_compute_needs_sharded_gradient[{axis.value}]",
        Provenance.CORRECTNESS,
        axis,
        lambda s: axis in s.axes and _strategy_on(s, axis) is not None,
        lambda t, s: t.implies(t.degree(axis) > 1, t.size(count, len(_split_replicated(s, axis))) == 0),
        explain,
        witness,
    )


def _flat_shard_axes(s: Setting, state: State, group: Group) -> list[Axis]:
    """The axes along which ``state`` of ``group`` is cut into flat shards, outer first
    (``formal._axes.nesting_order``, as the simulator cuts them); along a pipeline axis, or an
    axis that splits the group's computation, the pieces are slices, not flat shards."""
    on: dict[Axis, Strategy] = {}
    for st in s.strategies:
        on.setdefault(st.axis, st)  # the first strategy on an axis, as the placement reads it
    expert_split = any(st.axis.kind.places_experts and st.computes_sharded(group) for st in s.strategies)
    out: list[Axis] = []
    for axis in nesting_order(on, expert_split):
        st = on[axis]
        structural = axis.kind.is_pipeline or (axis.kind.splits_matrices and st.computes_sharded(group))
        if not structural and st.entry(state, group).mode.is_sharded:
            out.append(axis)
    return out


def _misnested(s: Setting, outer: Axis, inner: Axis) -> tuple[tuple[Group, State], ...]:
    """(group, P or G) whose flat shard is cut along ``inner`` but not ``outer``, while the
    optimizer state's is cut along both with ``outer`` outside (or the other way round): each
    device's finer piece (block ``c_outer * d_inner + c_inner``) is then not inside its coarser
    one (block ``c_inner`` of ``d_inner``), so the update reads and writes elements the device
    does not hold, or a refresh from the optimizer's piece misses the device's own. One state
    cut along axes the other is not cut along is right only when those axes nest inside (ZeRO-1
    over dp under HSDP's replicate axis needs the replicate axis inner, which the mesh order
    does not give)."""
    out = []
    for g in s.model.group_elements():
        o_axes = _flat_shard_axes(s, State.OPTIMIZER, g)
        for state in (State.PARAMETERS, State.GRADIENTS):
            x_axes = _flat_shard_axes(s, state, g)
            # the finer cut along both axes (outer outside), the coarser along the inner alone:
            # neither piece lies inside the other's
            for fine, coarse in ((o_axes, x_axes), (x_axes, o_axes)):
                if (
                    outer in fine
                    and inner in fine
                    and fine.index(outer) < fine.index(inner)
                    and inner in coarse
                    and outer not in coarse
                    and set(coarse) <= set(fine)
                    and (g, state) not in out
                ):
                    out.append((g, state))
    return tuple(out)


def _nesting_rule(outer: Axis, inner: Axis) -> Rule:
    """Nested shards. A state cut into flat shards along several axes is cut outer axis first
    (``_flat_shard_axes``); the optimizer reads and writes P and G at its own piece, so that
    piece must lie inside the device's P and G shards. Cut along ``outer`` and ``inner`` while P
    (or G) is cut along ``inner`` alone, it does not: the pieces nest the other way."""
    count = f"misnested_{outer.value}_{inner.value}"

    def explain(mesh: Mapping[Axis, int], s: Setting) -> str:
        g, state = _misnested(s, outer, inner)[0]
        d_outer, d_inner = mesh.get(outer, 2), mesh.get(inner, 2)
        return (
            f"O.{g.name} is sharded along {outer.value} and {inner.value} ({outer.value} outer), "
            f"{state.value}.{g.name} along {inner.value} alone: the device at {outer.value}=0, "
            f"{inner.value}=1 updates block 1 of {d_outer * d_inner}, outside its {state.value} shard (blocks "
            f"{d_outer} to {2 * d_outer - 1}), so it reads elements it does not hold; shard "
            f"{state.value} along {outer.value} too, or O along {inner.value} alone"
        )

    def witness(mesh: Mapping[Axis, int], s: Setting) -> dict[str, Any]:
        g, state = _misnested(s, outer, inner)[0]
        return {
            "state": state.value,
            "group": g.name,
            "outer": outer.value,
            "inner": inner.value,
            "optimizer_axes": [a.value for a in _flat_shard_axes(s, State.OPTIMIZER, g)],
            "state_axes": [a.value for a in _flat_shard_axes(s, state, g)],
        }

    return Rule(
        f"nested_shards[{outer.value}, {inner.value}]",
        Provenance.CORRECTNESS,
        None,
        lambda s: outer in s.axes and inner in s.axes and bool(_misnested(s, outer, inner)),
        lambda t, s: t.implies(
            t.degree(outer) > 1, t.implies(t.degree(inner) > 1, t.size(count, len(_misnested(s, outer, inner))) == 0)
        ),
        explain,
        witness,
    )


def _same_data(s: Setting, axis: Axis) -> tuple[Group, ...]:
    """Activation groups the axis's strategy replicates: along a data axis, every rank on the same data."""
    st = _strategy_on(s, axis)
    if st is None:
        return ()
    groups = ACTIVATION_GROUPS + IO_ACTIVATION_GROUPS
    return tuple(g for g in groups if not st.entry(State.ACTIVATIONS, g).mode.is_sharded)


def _data_rule(axis: Axis) -> Rule:
    """Data assignment. Along a data axis the activations' mode is how the batch is split: sharded,
    each rank reads its own samples (PyTorch's DistributedSampler, Megatron-LM's data-parallel
    rank offsets; along cp its own chunk of every sequence). Replicated, every rank reads the
    same samples of its size: averaging their gradients trains one device on 1/d of the global
    batch, not on the global batch. The sequence is split for cp, the samples elsewhere."""
    count = f"replicated_activation_groups_{axis.value}"

    def parts(mesh: Mapping[Axis, int], s: Setting) -> tuple[str, int, int]:
        b = s.model.micro_batch * s.options.micro_batches
        if axis.kind.splits_sequence and isinstance(s.model, Transformer):
            return "tokens", s.model.seq // mesh[axis], s.model.seq
        total = b
        for a, d in mesh.items():
            if a.kind.splits_batch:
                total *= d
        return "samples", b, total

    def explain(mesh: Mapping[Axis, int], s: Setting) -> str:
        unit, each, total = parts(mesh, s)
        devs = _group_devices(mesh, axis)
        who = ", ".join(map(str, devs[:-1])) + f" and {devs[-1]} " + ("both" if len(devs) == 2 else "all")
        span = f"{unit} 0-{each - 1}" if each > 1 else f"{unit[:-1]} 0"
        whole = "of each sequence's " if unit == "tokens" else "of the global batch's "
        return (
            f"devices {who} read {span}: the activations are replicated along {axis.value}, "
            f"so every {axis.value} rank computes on the same {unit}, and averaging their gradients "
            f"trains on {each} {whole}{total} {unit}, not on all of them (one device on 1/{mesh[axis]}); "
            f'split the data along {axis.value} (A = "S", a DistributedSampler)'
        )

    def witness(mesh: Mapping[Axis, int], s: Setting) -> dict[str, Any]:
        unit, each, total = parts(mesh, s)
        groups = _same_data(s, axis)
        return {
            "state": State.ACTIVATIONS.value,
            "group": groups[0].name,
            "groups": [g.name for g in groups],
            "axis": axis.value,
            "devices": _group_devices(mesh, axis),
            unit: [0, each - 1],
            "of": total,
            "activations": "R",
        }

    return Rule(
        f"data_assignment[{axis.value}]",
        Provenance.CORRECTNESS,
        axis,
        lambda s: axis in s.axes and _strategy_on(s, axis) is not None,
        lambda t, s: t.implies(t.degree(axis) > 1, t.size(count, len(_same_data(s, axis))) == 0),
        explain,
        witness,
    )


RULES: tuple[Rule, ...] = (
    *(_orthogonality(a) for a in Axis),
    Rule(
        "device_count",
        Provenance.CORRECTNESS,
        None,
        lambda s: s.devices is not None,
        _device_count_holds,
        _device_count_explain,
        _device_count_witness,
    ),
    *(r for tp in _VOCABULARY for r in _tensor_rules(tp)),
    *(_layers_rule(pp, uneven) for pp in _PIPELINE for uneven in (False, True)),
    *(
        _divides("seq", lambda m: _transformer(m).seq, (cp,), "context parallelism splits the sequence")
        for cp in _SEQUENCE
    ),
    _divides(
        "seq",
        lambda m: _transformer(m).seq,
        _SEQUENCE + _SEQUENCE_PARALLEL,
        "sequence parallelism splits the sequence across tp",
        when=lambda s: s.options.sequence_parallel and any(a in s.axes for a in _SEQUENCE_PARALLEL),
    ),
    *(
        _divides(
            "experts",
            lambda m: _transformer(m).experts,
            (ep,),
            "expert parallelism places whole experts",
            when=lambda s: _is_moe(s.model),
        )
        for ep in _EXPERTS
    ),
    *(_sp_needs_tp(tp) for tp in _SEQUENCE_PARALLEL),
    *(_ep_needs_moe(ep) for ep in _EXPERTS),
    *(_cp_needs_attention(cp) for cp in _SEQUENCE),
    *(r for pp in _PIPELINE for r in _interleaved_rules(pp)),
    *(_split_compute_rule(a) for a in Axis),
    *(_nesting_rule(u, v) for u in Axis for v in Axis if u is not v and not (u.kind.is_pipeline or v.kind.is_pipeline)),
    *(_data_rule(a) for a in Axis if a.kind.splits_data),
)


def setting_for(composition: Composition, model: Model, devices: int | None = None) -> Setting:
    """The setting of a concrete composition: the axes it has terms on, and its terms per axis."""
    mesh = composition.mesh()
    return Setting(
        model,
        composition.options,
        frozenset(mesh),
        devices,
        {axis: tuple(str(s) for s in composition.strategies if s.axis is axis) for axis in mesh},
        composition.strategies,
    )


def applicable(setting: Setting, provenance: Provenance | None = None) -> tuple[Rule, ...]:
    """The rules of the table that apply in ``setting`` (of one provenance, if given)."""
    return tuple(r for r in RULES if (provenance is None or r.provenance is provenance) and r.applies(setting))


def framework_notes(setting: Setting, mesh: Mapping[Axis, int]) -> tuple[str, ...]:
    """The framework rules a concrete composition breaks, each as one named note."""
    notes = []
    for rule in applicable(setting, Provenance.FRAMEWORK):
        if not rule.holds(Concrete(mesh, setting), setting):
            notes.append(f"framework rule {rule.name}: {rule.explain(mesh, setting)}")
    return tuple(notes)


@dataclass(frozen=True)
class Concrete:
    """``Terms`` over plain integers: a concrete composition's degrees."""

    mesh: Mapping[Axis, int]
    setting: Setting

    def degree(self, axis: Axis) -> int:
        return self.mesh.get(axis, 1)

    def present(self, axis: Axis) -> bool:
        return axis in self.mesh

    def size(self, name: str, value: int) -> int:
        return value

    def flag(self, name: str, value: bool) -> bool:
        return value

    def implies(self, a: Any, b: Any) -> bool:
        return (not a) or bool(b)

    @property
    def micro_batches(self) -> int:
        return self.setting.options.micro_batches


__all__ = [
    "RULES",
    "Concrete",
    "Provenance",
    "Rule",
    "Setting",
    "Terms",
    "applicable",
    "framework_notes",
    "setting_for",
]
