"""What every framework importer shares: ``ConfigError``, the result (``Imported``, with its
``Composition`` and the ``Unmapped`` settings) and the small readers that name a key as the user spelled it.

``checker._importers`` is the entry (``load_config``); this module imports none of the importers.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from checker._layout import Layout
from checker._numbers import MAX_DEGREE
from formal._engine_deepspeed import DeepSpeedEffects
from formal._input import Schema, check_schema, printable
from formal._model import Transformer
from formal._presets import DEFAULT_DEVICES
from formal._strategies import Composition
from formal.errors import InputError


class ConfigError(InputError):
    """Raised when a framework configuration has an unknown key, a bad value or a contradiction."""


class Framework(StrEnum):
    DEEPSPEED = "deepspeed"
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


@dataclass(frozen=True)
class Unmapped:
    """A setting of the configuration that the composition does not say exactly: the key or
    argument as the user spelled it (with its value where that matters) and what was assumed."""

    setting: str
    why: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.why}"

    def as_json(self) -> dict[str, str]:
        return {"setting": self.setting, "why": self.why}


@dataclass(frozen=True)
class Imported:
    """What an importer read: the composition (built once, from the ``Layout``), the run's
    numbers, and what it could not map."""

    framework: Framework
    layout: Layout
    composition: Composition
    devices: int | None  # None: not stated by the config (the CLI's --devices or default applies)
    micro_batch: int | None = None
    seq: int | None = None
    precision: str | None = None  # a PRECISIONS name suggested by the config's dtype settings
    model: str | None = None  # a preset the config names (torchtitan [model] flavor)
    unmapped: tuple[Unmapped, ...] = field(default=())
    # The model the config describes when no preset has its dimensions (Megatron's size arguments).
    transformer: Transformer | None = None
    # A DeepSpeed config's engine settings (buckets, persistence, reuse, reduction flags,
    # ``overlap_comm``): what ``formal._engine_deepspeed``'s terms read; None for other frameworks.
    deepspeed: DeepSpeedEffects | None = None

    @property
    def text(self) -> str:
        """The composition as the composition language writes it (canonical order)."""
        return str(self.composition)

    def as_json(self) -> dict[str, Any]:
        return {
            "framework": self.framework.value,
            "composition": self.text,
            "devices": self.devices,
            "micro_batch": self.micro_batch,
            "seq": self.seq,
            "precision": self.precision,
            "model": self.model if self.transformer is None else self.transformer.name,
            "not_mapped": [str(u) for u in self.unmapped],
            "unmapped": [u.as_json() for u in self.unmapped],
        }


def imported(
    framework: Framework,
    layout: Layout,
    devices: int | None,
    micro_batch: int | None = None,
    seq: int | None = None,
    precision: str | None = None,
    model: str | None = None,
    unmapped: Iterable[Unmapped] = (),
) -> Imported:
    """An ``Imported`` with its ``Composition`` built from ``layout`` on ``devices`` (the
    default device count when the config does not state it, as ``check`` assumes)."""
    try:
        composition = layout.composition(devices if devices is not None else DEFAULT_DEVICES)
    except ConfigError:
        raise
    except InputError as err:
        raise ConfigError(str(err)) from None
    return Imported(framework, layout, composition, devices, micro_batch, seq, precision, model, tuple(unmapped))


# --- small readers --------------------------------------------------------------------------


def _where(where: str, key: str) -> str:
    return f"{where}: {key}"


def _pos_int(value: Any, where: str, key: str, allow: Iterable[int] = (), high: int = MAX_DEGREE) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value not in allow):
        raise ConfigError(f"{_where(where, key)}={printable(repr(value), 60)}: expected a positive integer")
    if value > high:
        raise ConfigError(f"{_where(where, key)}={value}: absurd (at most {high:,})")
    return value


def _schema(raw: Any, schema: Schema, where: str) -> None:
    """Every key a format reads holds the declared type; anything else is one ``ConfigError`` line."""
    try:
        check_schema(raw, schema, where)
    except ConfigError:
        raise
    except InputError as err:
        raise ConfigError(str(err)) from None


def _bool(value: Any, where: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{_where(where, key)}={value!r}: expected true or false")
    return value


def _shown(value: Any) -> str:
    """A config value as the user wrote it (JSON for a non-string), cut to 60 characters."""
    return printable(json.dumps(value, sort_keys=True) if not isinstance(value, str) else value, 60)


def _check_keys(section: Mapping[str, Any], known: Iterable[str], where: str, prefix: str = "") -> None:
    names = list(known)
    for key in section:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
            raise ConfigError(f"{where}: unknown key {prefix}{key}{hint}")


def _divide(total: int, parts: Mapping[str, int], where: str, what: str) -> int:
    product = 1
    for d in parts.values():
        product *= d
    if total % product:
        shown = " x ".join(f"{k}({v})" for k, v in parts.items())
        raise ConfigError(f"{where}: {what} {total} is not divisible by {shown} = {product}")
    return total // product
