"""The DeepSpeed importer's precision recipe: the model's data type (``fp16``, ``bf16``) and the
gradient accumulation type (``data_types.grad_accum_dtype``), as DeepSpeed's engine reads them."""

from __future__ import annotations

from typing import Any

from checker._import_common import ConfigError, Unmapped, _check_keys, _shown

# DeepSpeed's ``DtypeEnum`` (deepspeed/runtime/config.py): the names a data type may be given by.
_DS_DTYPES = {
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"),
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
}


def ds_precision(raw: dict[str, Any], where: str, notes: list[Unmapped], stage: int, offload: bool) -> str:
    """The precision recipe of the config's model and gradient-accumulation data types.

    DeepSpeed's engine takes the gradient-accumulation type from ``data_types.grad_accum_dtype``,
    the model's own when unset (``engine.get_data_types``), and its ZeRO optimizers keep the
    reduced gradient partition in it (``stage_1_and_2.py``'s ``averaged_gradients``,
    ``stage3.py``'s ``grad_partitions_flat_buffer``; ZeRO-1 in bf16 with fp32 accumulation runs
    ``BF16_Optimizer``, whose fp32 gradients are full size). So a 16-bit model accumulating in its
    own type holds 2 + 2 + 12 bytes per parameter (the ``zero`` recipe), in fp32 2 + 4 + 12 (the
    ``deepspeed`` recipe, DeepSpeed's estimators' 18 bytes); with the optimizer offloaded, CPU Adam
    reads an fp32 gradient partition on the host (``deepspeed``). Without ZeRO the engine refuses
    a mix (``_do_optimizer_sanity_check``: "unsupported mix of model_dtype and grad_accum_dtype")."""
    enabled = []
    for key in ("fp16", "bf16"):
        section = raw.get(key, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: {key} must be an object")
        flag = section.get("enabled", False)
        if flag == "auto" or flag is True:
            enabled.append(key)
        elif flag is not False:
            raise ConfigError(f'{where}: {key}.enabled={flag!r}: expected true, false or "auto"')
    if len(enabled) > 1:
        raise ConfigError(f"{where}: fp16.enabled and bf16.enabled are both on")
    model = enabled[0] if enabled else "fp32"
    types = raw.get("data_types", {})
    if not isinstance(types, dict):
        raise ConfigError(f"{where}: data_types must be an object")
    _check_keys(types, ("grad_accum_dtype",), where, "data_types.")
    given = types.get("grad_accum_dtype")
    if given is None:
        accum = model
    elif not isinstance(given, str) or given.strip().lower() not in _DS_DTYPES:
        raise ConfigError(
            f"{where}: data_types.grad_accum_dtype={_shown(given)}: a gradient accumulation type of fp16, bf16 "
            "or fp32 (DeepSpeed's DtypeEnum names)"
        )
    else:
        accum = _DS_DTYPES[given.strip().lower()]
    if accum != model and stage == 0:
        raise ConfigError(
            f"{where}: data_types.grad_accum_dtype={_shown(given)} with a {model} model: DeepSpeed accumulates "
            "in another type than the model's only under ZeRO (its engine refuses the mix)"
        )
    if model == "fp32":
        if accum != "fp32":
            raise ConfigError(
                f"{where}: data_types.grad_accum_dtype={_shown(given)} with an fp32 model: a 16-bit accumulation "
                "of fp32 gradients is not modelled"
            )
        return "fp32"
    if accum == "fp32" or offload:
        why = "accumulated in fp32" if accum == "fp32" else "the offloaded optimizer's on the host"
        notes.append(
            Unmapped(
                model if given is None else f"{model}, data_types.grad_accum_dtype={_shown(given)}",
                f"recipe 'deepspeed': fp32 gradients ({why}), 2 + 4 + 12 bytes",
            )
        )
        return "deepspeed"
    notes.append(
        Unmapped(
            model if given is None else f"{model}, data_types.grad_accum_dtype={_shown(given)}",
            f"recipe 'zero': {model} gradients (accumulated in {model}), 2 + 2 + 12 bytes",
        )
    )
    return "zero"


__all__ = ["ds_precision"]
