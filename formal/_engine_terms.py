"""What an engine effect is (``Term``) and where FSDP-style sharding cuts a state
(``data_axes``): shared by the engine predictor (``formal._engine_effects``) and DeepSpeed's
terms (``formal._engine_deepspeed``), which builds on them."""

from __future__ import annotations

from dataclasses import dataclass

from formal._placement import Placement
from formal._vocab import Axis, Group, State


@dataclass(frozen=True)
class Term:
    """One engine effect on one device: its name, what it holds, bytes, and when.

    ``moment``: ``persistent`` (held through the step: counted at every moment), ``forward``,
    ``loss``, ``backward`` or ``second_block`` (held at that moment only, ``MOMENTS``; the second
    block's backward also holds the ``backward`` terms). ``state``: which row of
    the memory table it adds to (``gradients``, ``optimizer``, ``activations``, ``buffers``)."""

    key: str
    label: str
    bytes: int
    moment: str
    state: str


def data_axes(pl: Placement, state: State, group: Group) -> list[Axis]:
    """Data axes along which ``group``'s ``state`` is sharded (FSDP's shard dimension)."""
    return [a for a in pl.axes if a.splits_data and pl.mode(state, group, a).is_sharded]


__all__ = ["Term", "data_axes"]
