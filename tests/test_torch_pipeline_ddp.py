"""Pipelining with DDP on each stage under PyTorch's ``MemTracker``, on 4 real gloo processes
(``pp2xdp2xm4``: a 2-D (pp, dp) mesh, pp outer; ``checker._torch._ddp_tracked``): DDP cannot run
under ``FakeTensorMode``. The pipeline runs every micro-batch's backward but the last under
DDP's ``no_sync`` (``_PipelineStageBase.backward_maybe_with_nosync``), so DDP all-reduces its
buckets once a step, as the step program says. The measured peak is the tracker's, the
predicted one what ``check-composition --engine ddp`` prints for this model and precision.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from checker._torch._compare import PEAK, PEAK_TOLERANCE, Comparison

_RESULTS: list[Comparison] = []


def results() -> list[Comparison]:
    if not _RESULTS:
        from checker._torch._ddp_tracked import compare, measure_world

        _RESULTS.extend(compare(m) for m in measure_world(("pp2xdp2xm4",), world=4))
    return _RESULTS


def test_every_rank_is_measured() -> None:
    assert sorted(c.rank for c in results()) == [0, 1, 2, 3]


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_model_states_and_collectives_are_exact(rank: int) -> None:
    c = next(c for c in results() if c.rank == rank)
    assert c.model_states_exact, c.rows
    assert c.measured_calls and c.calls_equal, (c.predicted_calls, c.measured_calls)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_peak_the_cli_prints_is_within_3_percent_of_the_tracker_peak(rank: int) -> None:
    c = next(c for c in results() if c.rank == rank)
    peak = c.row(PEAK)
    assert abs(peak.error) <= PEAK_TOLERANCE, (rank, peak)
    e = c.engine_prediction
    assert e is not None and e.total == peak.predicted
    assert abs(e.placement_total - peak.measured) > PEAK_TOLERANCE * peak.measured
