"""The scalar program of a placement: what each device holds of a group's gradient when the
scalars read it (``holding``), and the scalar ops the frameworks run (``derive_scalars``).
The vocabulary (settings, ops) lives in ``formal/_scalars.py``."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from formal._placement import Placement
from formal._scalars import GLOBAL, LossScale, ScalarKind, ScalarOp
from formal._vocab import FIRST_STAGE_GROUPS, LAST_STAGE_GROUPS, LAYER_GROUPS, ROUTER, Axis, Group, State
from formal.errors import InputError

G, O = State.GRADIENTS, State.OPTIMIZER  # noqa: E741 (the paper's P/O/G)


class Holding(StrEnum):
    """What the devices along an axis hold of a group's synchronised gradient."""

    SHARD = "shard"  # device i holds piece i
    REPLICA = "replica"  # every device holds the whole
    ONE = "one"  # one device holds the whole (a first- or last-stage group along pp)
    TIED = "tied"  # the first and the last device hold the whole (a tied embedding along pp)


def holding(pl: Placement, group: Group, axis: Axis) -> Holding:
    """What the devices along ``axis`` hold of ``group``'s gradient after synchronisation."""
    if axis.kind.is_pipeline:
        if group in pl.tied:
            return Holding.TIED
        if group in FIRST_STAGE_GROUPS or group in LAST_STAGE_GROUPS:
            return Holding.ONE
        return Holding.SHARD if group in LAYER_GROUPS else Holding.REPLICA
    if pl.computes_sharded(axis, group) or pl.mode(G, group, axis).is_sharded:
        return Holding.SHARD
    # ZeRO-1 and Megatron's distributed optimizer: a full-size gradient buffer of which only the
    # optimizer's shard is reduced (reduce-scatter), so only that shard is valid.
    if pl.mode(O, group, axis).is_sharded and axis.splits_data:
        return Holding.SHARD
    return Holding.REPLICA


def holder_of_one(group: Group, degree: int) -> int:
    """The device along pp that holds a one-stage group: the first stage, or the last."""
    return degree - 1 if group in LAST_STAGE_GROUPS else 0


def holders(kind: Holding, group: Group, degree: int, piece: int) -> tuple[int, ...]:
    """The devices along an axis of ``degree`` that hold ``piece`` (SHARD: piece i of d; others: 0)."""
    match kind:
        case Holding.SHARD:
            return (piece,)
        case Holding.REPLICA:
            return tuple(range(degree))
        case Holding.ONE:
            return (holder_of_one(group, degree),)
        case Holding.TIED:
            return (0, degree - 1) if degree > 1 else (0,)
        case _:
            raise AssertionError(kind)


def pieces(kind: Holding, degree: int) -> int:
    return degree if kind is Holding.SHARD else 1


def _split_axes(pl: Placement) -> tuple[Axis, ...]:
    """Axes of degree > 1 (a reduction along an axis of degree 1 is the identity)."""
    return tuple(a for a, d in pl.mesh if d != 1)


def token_axes(pl: Placement) -> tuple[Axis, ...]:
    """The axes along which devices see different tokens of the batch (dp, dpr, cp, ep)."""
    return tuple(a for a in pl.axes if a.splits_data)


def derive_scalars(pl: Placement) -> tuple[ScalarOp, ...]:
    """The scalar program the frameworks run for ``pl.options.scalars``.

    * Per-token loss: the count of valid tokens is all-reduced over every axis that splits the
      tokens and summed over the micro-batches, and the loss compensates the gradient mean
      (Megatron-LM ``--calculate-per-token-loss``; transformers' accumulation fix, PR #34191;
      torchtitan PR #2206).
    * Clipping: every device adds the squared norm of what it holds, counting a piece only on
      its first holder along the axes it reduces over, then all-reduces over every axis along
      which some group is split (torchtitan's DTensor norm plus the pp all-reduce of PR #649;
      Megatron-LM's ``get_grad_norm_fp32`` over the model-parallel group with tensor-parallel
      duplicates filtered, and over dp under the distributed optimizer); one clip of every group.
    * Dynamic loss scaling: the overflow flag of what each device holds is all-reduced (max) over
      every axis along which some group is split (DeepSpeed's ``has_overflow`` over dp and the
      model-parallel group).
    """
    settings = pl.options.scalars
    ops: list[ScalarOp] = []
    if settings.per_token:
        ops.append(
            ScalarOp(
                ScalarKind.NORMALISE_LOSS,
                over=token_axes(pl),
                micro_batches=True,
                note="count valid tokens over the global batch",
            )
        )
    split = split_axes(pl, pl.groups(State.PARAMETERS))
    if settings.clip:
        ops.append(ScalarOp(ScalarKind.GRAD_NORM, over=split, once=split, note="global gradient norm"))
        ops.append(ScalarOp(ScalarKind.CLIP, note="clip by min(1, max_norm / norm)"))
    if settings.loss_scale is LossScale.DYNAMIC:
        ops.append(ScalarOp(ScalarKind.OVERFLOW_CHECK, over=split, note="skip the step on overflow"))
    if settings.balancing:
        if ROUTER not in pl.groups(State.PARAMETERS):
            raise InputError(
                "a load-balancing loss (balance-loss, --moe-aux-loss-coeff) needs a model with experts: "
                "this one has no router to balance"
            )
        scope = aux_scope(pl, settings.balancing == GLOBAL)
        ops.append(
            ScalarOp(
                ScalarKind.AUX_LOSS,
                over=scope,
                micro_batches=settings.balancing == GLOBAL,
                note="load-balancing statistics",
            )
        )
    return tuple(ops)


def aux_split_axes(pl: Placement) -> tuple[Axis, ...]:
    """Axes (degree > 1) along which devices route different tokens: the data axes (dp, dpr, cp,
    ep) and tp under sequence parallelism (its ranks hold sequence shards); tp without it and pp
    hold the same tokens (or the same layer's) on every rank."""
    return tuple(
        a for a in _split_axes(pl) if a.splits_data or (a.kind.sequence_parallel and pl.options.sequence_parallel)
    )


def aux_scope(pl: Placement, whole_batch: bool) -> tuple[Axis, ...]:
    """The axes the load-balancing statistics must be reduced over: for one replica's
    micro-batch (Megatron-LM's ``aux_loss``), those that split its tokens, cp and tp under
    sequence parallelism (its router reduces the tokens per expert over the tp x cp group); for
    the global batch (``global_aux_loss``), every axis that splits the tokens."""
    if whole_batch:
        return aux_split_axes(pl)
    return tuple(a for a in aux_split_axes(pl) if not a.kind.splits_batch)


def split_axes(pl: Placement, groups: Iterable[Group]) -> tuple[Axis, ...]:
    """Axes (degree > 1) along which some group's gradient is not a replica."""
    groups = tuple(groups)
    return tuple(a for a in _split_axes(pl) if any(holding(pl, g, a) is not Holding.REPLICA for g in groups))


__all__ = [
    "Holding",
    "aux_scope",
    "aux_split_axes",
    "derive_scalars",
    "holders",
    "holding",
    "pieces",
    "split_axes",
    "token_axes",
]
