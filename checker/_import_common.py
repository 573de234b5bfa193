"""What every framework importer shares: ``ConfigError``, the result (``Imported``) and the small
readers that name a key as the user spelled it.

``checker._importers`` is the entry (``load_config``); this module imports none of the importers.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from checker._layout import Layout
from checker._numbers import MAX_DEGREE
from formal._input import Schema, check_schema, printable
from formal.errors import InputError


class ConfigError(InputError):
    """Raised when a framework configuration has an unknown key, a bad value or a contradiction."""


class Framework(StrEnum):
    DEEPSPEED = "deepspeed"
    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


@dataclass(frozen=True)
class Imported:
    """What an importer read: the composition, the run's numbers, and what it could not map."""

    framework: Framework
    layout: Layout
    devices: int | None  # None: not stated by the config (the CLI's --devices or default applies)
    micro_batch: int | None = None
    seq: int | None = None
    precision: str | None = None  # a PRECISIONS name suggested by the config's dtype settings
    model: str | None = None  # a preset the config names (torchtitan [model] flavor)
    notes: tuple[str, ...] = field(default=())

    @property
    def composition(self) -> str:
        return self.layout.text()

    def as_json(self) -> dict[str, Any]:
        return {
            "framework": self.framework.value,
            "composition": self.composition,
            "devices": self.devices,
            "micro_batch": self.micro_batch,
            "seq": self.seq,
            "precision": self.precision,
            "model": self.model,
            "not_mapped": list(self.notes),
        }


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
