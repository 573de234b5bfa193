"""Predicted against measured on real gloo processes, every rank (2 and 4 processes).

One spawn per world size runs every composition of ``GLOO_COMPOSITIONS`` on each rank, then the
same rank on the fake process group; each rank is compared with ``predict(..., rank=r)``.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from checker._parse import parse
from checker._torch._compare import ACTIVATION_TOLERANCE
from checker._torch._gloo import GLOO_COMPOSITIONS, GlooComparison, compare_world

_RUNS: dict[int, list[GlooComparison]] = {}

CASES = [(world, text) for world, texts in GLOO_COMPOSITIONS.items() for text in texts]


def ranks(world: int, text: str) -> list[GlooComparison]:
    """The comparisons of ``text`` on every rank of the ``world``-process run, in rank order."""
    if world not in _RUNS:
        _RUNS[world] = compare_world(world)
    name = str(parse(text, devices=world))
    return [g for g in _RUNS[world] if str(g.comparison.composition) == name]


@pytest.mark.parametrize(("world", "text"), CASES)
def test_every_rank_is_measured(world: int, text: str) -> None:
    got = ranks(world, text)
    assert [g.comparison.rank for g in got] == list(range(world)), text
    assert all(g.comparison.measured_calls for g in got), f"{text}: a rank recorded no collective"
    if got[0].comparison.engine == "pipelining":
        stages = [g.comparison.stage for g in got]
        assert stages == ["first"] + ["middle"] * (world - 2) + ["last"], (text, stages)


@pytest.mark.parametrize(("world", "text"), CASES)
def test_model_states_exact_on_every_rank(world: int, text: str) -> None:
    wrong = [
        (g.comparison.rank, r)
        for g in ranks(world, text)
        for r in g.comparison.rows
        if r.quantity != "activations" and r.predicted != r.measured
    ]
    assert not wrong, (text, wrong)


@pytest.mark.parametrize(("world", "text"), CASES)
def test_collective_list_equal_on_every_rank(world: int, text: str) -> None:
    wrong = []
    for g in ranks(world, text):
        pred, meas = Counter(g.comparison.predicted_calls), Counter(g.comparison.measured_calls)
        if pred != meas:
            wrong.append((g.comparison.rank, "predicted only", pred - meas, "recorded only", meas - pred))
    assert not wrong, (text, wrong)


@pytest.mark.parametrize(("world", "text"), CASES)
def test_activations_within_tolerance_on_every_rank(world: int, text: str) -> None:
    wrong = [
        (g.comparison.rank, g.comparison.stage, g.comparison.row("activations"))
        for g in ranks(world, text)
        if abs(g.comparison.row("activations").error) > ACTIVATION_TOLERANCE
    ]
    assert not wrong, (text, wrong)


@pytest.mark.parametrize(("world", "text"), CASES)
def test_gloo_measurement_equals_the_fake_group(world: int, text: str) -> None:
    """pytorch-ground-truth.md: the fake group stands in for a real rank, byte for byte."""
    wrong = [(g.comparison.rank, g.fake_differences) for g in ranks(world, text) if g.equal_to_fake is not True]
    assert not wrong, (text, wrong)
