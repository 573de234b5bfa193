"""The scalars around the gradients: the loss normaliser, the global gradient norm, the clip
factor and the fp16 overflow decision (docs/semantics.md, "Global scalars").

Each is one number per step that every device must agree on and that single-device training
computes over the whole batch and the whole model. Under a composition each device holds a
part of what the scalar is computed from (its samples' token counts, its shards of the
gradients), so the scalar is a local value reduced over named axes, and the question is the
one the step program asks of gradients: is every contribution counted exactly once?

Settings (``ScalarSettings``, in ``Options.scalars``) say which scalars a run has: global-norm
clipping (``clip``, torchtitan ``max_norm``, DeepSpeed ``gradient_clipping``, Megatron
``--clip-grad``), a loss normalised per token over token counts that differ between ranks and
micro-batches (``per-token``, Megatron ``--calculate-per-token-loss``), fp16 dynamic loss
scaling (``fp16``, DeepSpeed ``fp16.loss_scale = 0``). The scalar program (``ScalarOp``s in
``StepProgram.scalars``) says how they are computed: derived here from the placement
(``formal._scalar_program.derive_scalars``, what torchtitan, Megatron-LM and DeepSpeed do), or given by a strategy
file's ``[[scalars]]`` entries.

What a device holds of a group's gradient along an axis when the scalars read it, after
gradient synchronisation, is a ``Holding`` (``formal._scalar_program.holding``): a distinct shard per device (FSDP and
ZeRO shards, the optimizer's shard under ZeRO-1, tensor-parallel matrices, experts, the layers of
a pipeline stage), the whole on every device (replicas: dp replicas, tp-replicated norms and
biases), the whole on one device (a first- or last-stage group along pp), or the whole on two
(a tied embedding on the first and the last stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction

from formal._vocab import Axis, Group


class LossScale(StrEnum):
    """fp16 loss scaling (Micikevicius et al. 2018): none, a fixed scale, or a dynamic one that
    skips the step and lowers the scale when a gradient overflows."""

    NONE = "none"
    STATIC = "static"
    DYNAMIC = "dynamic"


@dataclass(frozen=True)
class ScalarSettings:
    """Which scalars a training run computes around its gradients.

    ``clip``: global gradient-norm clipping to ``max_norm`` (the value is reported, the verdict
    holds for any); ``per_token``: the loss is the mean over the valid tokens of the global batch
    and token counts differ between ranks and micro-batches (padding, packing, variable lengths);
    ``loss_scale``: fp16 loss scaling; ``aux_loss_coeff``: the MoE load-balancing loss's
    coefficient, with ``balancing`` its statistics' scope (``micro-batch`` or ``global``).
    """

    clip: bool = False
    max_norm: Fraction | None = field(default=None, compare=False)  # reported; the verdict holds for any
    per_token: bool = False
    loss_scale: LossScale = LossScale.NONE
    aux_loss_coeff: Fraction | None = field(default=None, compare=False)  # reported; any positive value
    balancing: str = ""  # the load-balancing loss's statistics: "" (none), "micro-batch" or "global"

    @property
    def any(self) -> bool:
        return self.clip or self.per_token or self.loss_scale is LossScale.DYNAMIC or bool(self.balancing)

    def features(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.per_token:
            out.append("per-token loss normalisation")
        if self.clip:
            out.append("global-norm clipping" + (f" (max_norm {self.max_norm})" if self.max_norm else ""))
        if self.loss_scale is LossScale.DYNAMIC:
            out.append("fp16 dynamic loss scaling")
        elif self.loss_scale is LossScale.STATIC:
            out.append("fp16 static loss scale")
        if self.balancing:
            out.append(f"MoE load-balancing loss ({self.balancing} statistics)")
        return tuple(out)


SCALAR_MODIFIERS = ("clip", "per-token", "fp16", "balance-loss", "global-balance-loss")  # composition-language terms
MICRO_BATCH, GLOBAL = "micro-batch", "global"  # the load-balancing statistics' scope


def scalar_modifier(term: str, settings: ScalarSettings) -> ScalarSettings:
    """``settings`` with the composition-language modifier ``term`` applied."""
    match term:
        case "clip":
            return replace(settings, clip=True)
        case "per-token":
            return replace(settings, per_token=True)
        case "fp16":
            return replace(settings, loss_scale=LossScale.DYNAMIC)
        case "balance-loss":
            return replace(settings, balancing=MICRO_BATCH)
        case "global-balance-loss":
            return replace(settings, balancing=GLOBAL)
        case _:
            raise AssertionError(term)


def scalar_terms(settings: ScalarSettings) -> list[str]:
    """The composition-language modifiers that give ``settings`` (``max_norm`` is not written)."""
    out: list[str] = []
    if settings.clip:
        out.append("clip")
    if settings.per_token:
        out.append("per-token")
    if settings.loss_scale is LossScale.DYNAMIC:
        out.append("fp16")
    if settings.balancing:
        out.append("balance-loss" if settings.balancing == MICRO_BATCH else "global-balance-loss")
    return out


# The rules of the scalar obligations (the training simulator does not run the scalars: the
# scalar reference, formal/_sim_scalars.py, answers for them).
SCALAR_RULES = (
    "token_count[",
    "loss_compensation[",
    "norm_counts_once[",
    "norm_covers[",
    "clip_factor[",
    "overflow_reduced[",
    "overflow_covers[",
    "aux_loss_statistics[",
    "aux_loss_scope[",
    "logits_placement[",
)


def is_scalar_rule(rule: str) -> bool:
    """Whether a violation's rule is one of the scalars' (``decide_scalars``)."""
    return rule.startswith(SCALAR_RULES)


class ScalarKind(StrEnum):
    """The ops of a scalar program."""

    NORMALISE_LOSS = "normalise_loss"  # divide each rank's summed token losses by a token count
    GRAD_NORM = "grad_norm"  # add the squared norms of the held gradients, all-reduce (sum) the total
    CLIP = "clip"  # scale the gradients by min(1, max_norm / norm)
    OVERFLOW_CHECK = "overflow_check"  # look for inf/nan in the held gradients, all-reduce (max) the flag
    AUX_LOSS = "aux_loss"  # the MoE load-balancing loss from routing statistics all-reduced over axes
    CROSS_ENTROPY = "cross_entropy"  # the loss kernel: its softmax normaliser all-reduced over axes


@dataclass(frozen=True)
class ScalarOp:
    """One op of the scalar program; it runs after gradient synchronisation, before the step
    (``NORMALISE_LOSS``: before the backward, on the loss).

    ``groups``: the parameter groups the op covers (``None``: every one); ``over``: the axes its
    scalar is all-reduced over; ``once``: for ``GRAD_NORM``, the axes along which a group's
    squared norm is added only by the first device that holds the group's piece (Megatron-LM's
    filter of tensor-parallel duplicates and of the shared embedding); ``micro_batches``: for
    ``NORMALISE_LOSS``, the count is summed over the step's micro-batches (else each micro-batch
    divides by its own count and by m); ``compensated``: the loss is multiplied by the degrees
    of the data axes its count is reduced over, undoing the gradient synchronisation's mean
    (Hugging Face transformers multiplies by the number of processes; Megatron-LM sums the
    gradients instead, the same product); ``tokens``: ``variable`` (token counts may differ) or
    ``equal`` (every rank and micro-batch has as many valid tokens). For ``AUX_LOSS``: ``over``,
    the axes its routing statistics (tokens per expert, summed router probabilities) are
    all-reduced over before the loss is formed; ``micro_batches``, accumulated over the step's
    micro-batches (global-batch balancing). For ``CROSS_ENTROPY``: ``over``, the axes a
    vocabulary-parallel kernel all-reduces its softmax normaliser (sum of exponentials) over;
    ``gathered``, the axes along which the logits were all-gathered before the kernel.
    """

    kind: ScalarKind
    groups: frozenset[Group] | None = None
    over: tuple[Axis, ...] = ()
    once: tuple[Axis, ...] = ()
    micro_batches: bool = False
    compensated: bool = True
    tokens: str = "variable"
    note: str = ""
    gathered: tuple[Axis, ...] = ()  # CROSS_ENTROPY: axes the logits were all-gathered along before it

    def covers(self, group: Group) -> bool:
        return self.groups is None or group in self.groups

    def __str__(self) -> str:
        parts = [self.kind.value]
        if self.groups is not None:
            parts.append("groups " + ",".join(sorted(g.name for g in self.groups)))
        if self.kind is ScalarKind.AUX_LOSS:
            parts.append("statistics over " + (",".join(a.value for a in self.over) or "the device's tokens"))
            parts.append("and the micro-batches" if self.micro_batches else "per micro-batch")
        elif self.kind is ScalarKind.NORMALISE_LOSS:
            parts.append("count over " + (",".join(a.value for a in self.over) or "nothing (local)"))
            parts.append("micro-batches summed" if self.micro_batches else "per micro-batch / m")
            if not self.compensated:
                parts.append("uncompensated")
        elif self.kind is ScalarKind.CROSS_ENTROPY:
            parts.append("normaliser over " + (",".join(a.value for a in self.over) or "the device's vocabulary"))
            if self.gathered:
                parts.append("logits gathered along " + ",".join(a.value for a in self.gathered))
        elif self.kind is not ScalarKind.CLIP:
            parts.append("over " + (",".join(a.value for a in self.over) or "nothing"))
            if self.once:
                parts.append("once along " + ",".join(a.value for a in self.once))
        return " ".join(parts)


__all__ = [
    "GLOBAL",
    "MICRO_BATCH",
    "SCALAR_MODIFIERS",
    "LossScale",
    "ScalarKind",
    "ScalarOp",
    "ScalarSettings",
    "scalar_modifier",
    "scalar_terms",
    "SCALAR_RULES",
    "is_scalar_rule",
]
