"""What the PyTorch validation rows share (import after ``pytest.importorskip("torch")``): one
comparison per (composition, model, rank), cached for the module's tests, and the two checks
every row of the validation table meets (docs/torch-validation.md)."""

from __future__ import annotations

from collections import Counter

from checker._torch._compare import PEAK, PEAK_TOLERANCE, Comparison
from checker._torch._large import LargeResult, compare_large, large_ok
from checker._torch._net import NetConfig

_CACHE: dict[tuple[str, NetConfig, int], tuple[Comparison, LargeResult]] = {}


def compared(text: str, cfg: NetConfig, rank: int) -> tuple[Comparison, LargeResult]:
    """``compare_large`` once per (composition, model, rank)."""
    if (text, cfg, rank) not in _CACHE:
        _CACHE[(text, cfg, rank)] = compare_large(text, cfg, rank)
    return _CACHE[(text, cfg, rank)]


def run_label(run: tuple[str, int]) -> str:
    return f"{run[0]}-rank{run[1]}"


def assert_model_states_and_calls_exact(c: Comparison, run: tuple[str, int]) -> None:
    """Every row but activations and the peak predicted exactly; the collective lists equal."""
    for row in c.rows:
        if row.quantity not in ("activations", PEAK):
            assert row.predicted == row.measured, (run, row)
    assert c.measured_calls and Counter(c.predicted_calls) == Counter(c.measured_calls), run


def assert_peak_within_tolerance(c: Comparison, r: LargeResult, run: tuple[str, int]) -> None:
    """The peak the CLI prints (the engine prediction) within 3% of the tracker's, and closer to
    it than the placement's figure alone."""
    peak = c.row(PEAK)
    assert peak.measured == r.tracked.peak["Total"] > 0
    assert abs(peak.error) <= PEAK_TOLERANCE, (run, peak)
    e = c.engine_prediction
    assert e is not None and e.total == peak.predicted
    assert abs(e.placement_total - peak.measured) > abs(peak.predicted - peak.measured)
    assert large_ok(c, r), run
