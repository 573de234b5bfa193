"""The scalars each importer reads (``formal/_scalars.py``): global-norm clipping, per-token loss
normalisation, fp16 loss scaling and the MoE load-balancing loss, from torchtitan's
``[training]``, DeepSpeed's JSON and Megatron-LM's arguments. Each setting is mapped or refused
here, never dropped."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from checker._import_common import ConfigError, Unmapped
from formal._scalars import GLOBAL, MICRO_BATCH, LossScale, ScalarSettings


def torchtitan_scalars(training: dict[str, Any], where: str) -> ScalarSettings:
    """``training.max_norm``: torchtitan clips by the global norm of every parameter's gradient
    (``dist_utils.clip_grad_norm_``, with the pp all-reduce of torchtitan PR #649). Mapped when
    the config states it (torchtitan's default, 1.0, clips too: write it to have it checked)."""
    if "max_norm" not in training:
        return ScalarSettings()
    value = training["max_norm"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1e12:
        raise ConfigError(f"{where}: training.max_norm={value!r}: expected a number > 0")
    return ScalarSettings(clip=True, max_norm=Fraction(str(value)))


def deepspeed_scalars(raw: dict[str, Any], where: str) -> ScalarSettings:
    """Global-norm clipping (``gradient_clipping`` > 0; DeepSpeed's default 0 clips nothing) and
    fp16 loss scaling (``fp16.loss_scale``: 0, the default, is dynamic; a positive value static)."""
    clip = raw.get("gradient_clipping", 0)
    if isinstance(clip, bool) or not isinstance(clip, int | float) or clip < 0 or clip != clip or clip > 1e12:
        raise ConfigError(f"{where}: gradient_clipping={clip!r}: expected a number >= 0")
    scale = LossScale.NONE
    fp16 = raw.get("fp16", {})
    if isinstance(fp16, dict) and fp16.get("enabled", False) in (True, "auto"):
        value = fp16.get("loss_scale", 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != value:
            raise ConfigError(f"{where}: fp16.loss_scale={value!r}: expected 0 (dynamic) or a positive scale")
        scale = LossScale.DYNAMIC if value == 0 else LossScale.STATIC
    return ScalarSettings(clip=clip > 0, max_norm=Fraction(str(clip)) if clip > 0 else None, loss_scale=scale)


def _number(values: dict[str, str], name: str, default: str, where: str) -> Fraction:
    text = values.get(name, default)
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"{where}: {name} {text!r}: expected a number") from None
    if value < 0 or value > 10**12:
        raise ConfigError(f"{where}: {name} {text}: expected a number from 0 to 1e12")
    return value


_MEG_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def megatron_scalars(values: dict[str, str], flags: set[str], where: str, notes: list[Unmapped]) -> ScalarSettings:
    """Megatron-LM's scalars (``megatron/training/arguments.py``): ``--clip-grad`` (mapped when
    given; 0 clips nothing, and Megatron's default, 1.0, clips too), ``--calculate-per-token-loss``
    (the loss divided by the token count all-reduced over dp x cp and the micro-batches), fp16
    loss scaling (dynamic unless
    ``--loss-scale`` fixes it), the MoE load-balancing loss (``--moe-aux-loss-coeff``, default 0,
    of ``--moe-router-load-balancing-type``, default ``aux_loss``)."""
    clip = _number(values, "--clip-grad", "0", where)  # the default (1.0) is mapped when stated
    scale = LossScale.NONE
    if "--fp16" in flags:
        scale = LossScale.STATIC if "--loss-scale" in values else LossScale.DYNAMIC
    elif "--loss-scale" in values:
        notes.append(Unmapped("--loss-scale", "a loss scale without --fp16: Megatron scales bf16 losses by none"))
    balancing = values.get("--moe-router-load-balancing-type", "aux_loss")
    if balancing not in _MEG_BALANCING:
        raise ConfigError(
            f"{where}: --moe-router-load-balancing-type {balancing!r}: expected one of {', '.join(_MEG_BALANCING)}"
        )
    coeff = _number(values, "--moe-aux-loss-coeff", "0", where)
    scope = ""
    if coeff and balancing in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        scope = GLOBAL if balancing == "global_aux_loss" else MICRO_BATCH
        if balancing == "seq_aux_loss":
            notes.append(
                Unmapped(
                    "--moe-router-load-balancing-type seq_aux_loss",
                    "statistics per sequence: checked as per micro-batch (the same axes split both)",
                )
            )
    return ScalarSettings(
        clip=clip > 0,
        max_norm=clip if clip > 0 else None,
        per_token="--calculate-per-token-loss" in flags,
        loss_scale=scale,
        aux_loss_coeff=coeff or None,
        balancing=scope,
    )


__all__ = ["deepspeed_scalars", "megatron_scalars", "torchtitan_scalars"]
