"""DDP's per-device peak against PyTorch's ``MemTracker`` on 2 real gloo processes.

DDP cannot run under ``FakeTensorMode``, so its rows (plain DDP, ZeRO-1 through
``ZeroRedundancyOptimizer``, gradient accumulation over real micro-batches) are measured on real
tensors (``checker._torch._ddp_tracked``): one spawn of two CPU processes, one torch thread each,
on the small validation model (``NetConfig()``, about 30 s; ``python -m checker._torch_validate
--ddp-tracker`` runs the larger ``DDP_MODEL`` of the docs' table).
The peak checked is the one ``check-composition --engine ddp`` prints for the same model and
precision; the placement's own figure, which lacks DDP's bucket copy of the gradients, is not
within the tolerance (the engine term is what closes it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from checker._analysis import analyze
from checker._parse import parse
from checker._torch._compare import PEAK, PEAK_TOLERANCE, Comparison
from checker._torch._ddp_tracked import DDP_COMPOSITIONS, compare, ddp_ok, measure_world
from checker._torch._net import NetConfig
from checker._torch._predict import harness_precision
from formal._engine_effects import Engine

_RUN: list[Comparison] = []
MODEL = NetConfig()


def runs() -> list[Comparison]:
    if not _RUN:
        _RUN.extend(compare(m, MODEL) for m in measure_world(cfg=MODEL))
    return _RUN


def _of(text: str) -> list[Comparison]:
    name = str(parse(text, devices=2))
    return [c for c in runs() if str(c.composition) == name]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("text", DDP_COMPOSITIONS)
def test_ddp_peak_within_tolerance_of_memtracker_on_every_rank(text: str) -> None:
    got = _of(text)
    assert [c.rank for c in got] == [0, 1]
    for c in got:
        assert c.model_states_exact, (text, c.rank, c.rows)
        assert c.calls_equal, (text, c.rank)
        assert abs(c.row(PEAK).error) <= PEAK_TOLERANCE, (text, c.rank, c.row(PEAK))
        assert ddp_ok(c)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("text", DDP_COMPOSITIONS)
def test_the_peak_checked_is_the_one_the_cli_prints(text: str) -> None:
    comp = parse(text, devices=2)
    cli = analyze(comp, MODEL.formal(), harness_precision(), engine=Engine.DDP).peak
    for c in _of(text):
        assert c.row(PEAK).predicted == cli
        # without DDP's terms (the bucket copy of the gradients) the figure is low by more than
        # the tolerance: the measurement distinguishes the engine term
        placement = c.engine_prediction.placement_total
        assert (c.row(PEAK).measured - placement) / c.row(PEAK).measured > PEAK_TOLERANCE
