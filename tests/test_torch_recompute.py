"""Activation recomputation under PyTorch's memory tracker: ``torch.utils.checkpoint`` on each
block (``fsdp8xrecompute``) or on each block's attention core, scores, softmax, dropout and the
product with V (``fsdp8xselective``, ``tp8xspxselective``: Korthikanti et al. 2022, section 5),
on the 0.5 B-parameter model under ``FakeTensorMode`` (``checker._torch._large``), one rank of 8.

The measured numbers are PyTorch's (``FSDPMemTracker`` / ``MemTracker`` peak total, the rank's
storages, the recorded collectives); the predicted ones are what ``check-composition --engine
fsdp2`` prints for this model and precision.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from torch_runs import assert_model_states_and_calls_exact, assert_peak_within_tolerance, compared, run_label

from checker._parse import parse
from checker._torch._compare import ACTIVATION_TOLERANCE, PEAK, PEAK_TOLERANCE
from checker._torch._large import LARGE, RECOMPUTE_RUNS, saved_row
from checker._torch._predict import PYTORCH_DEFAULTS, predict

CFG = LARGE


@pytest.mark.parametrize("run", RECOMPUTE_RUNS, ids=run_label)
def test_model_states_and_collectives_are_exact(run: tuple[str, int]) -> None:
    """Recomputation changes no model state and no collective (the blocks' parameters stay
    gathered through their backward, where the recomputation runs)."""
    c, r = compared(run[0], CFG, run[1])
    assert_model_states_and_calls_exact(c, run)
    assert r.tracked.parameters == r.measured.parameters > 0


@pytest.mark.parametrize("run", RECOMPUTE_RUNS, ids=run_label)
def test_peak_the_cli_prints_is_within_3_percent_of_the_tracker_peak(run: tuple[str, int]) -> None:
    c, r = compared(run[0], CFG, run[1])
    assert_peak_within_tolerance(c, r, run)


@pytest.mark.parametrize("run", RECOMPUTE_RUNS, ids=run_label)
def test_saved_activations_are_the_checkpoints_and_the_kept_tensors(run: tuple[str, int]) -> None:
    """What autograd keeps between forward and backward: each block's input (full), or all but
    the attention core (selective), within the tolerance of the saved-tensor hooks' peak."""
    row = saved_row(*compared(run[0], CFG, run[1]))
    assert abs(row.error) <= ACTIVATION_TOLERANCE, (run, row)


@pytest.mark.parametrize("run", [r for r in RECOMPUTE_RUNS if r[0].startswith("fsdp")], ids=run_label)
def test_without_the_recomputed_layer_the_peak_is_low(run: tuple[str, int]) -> None:
    """The recomputed layer held in its backward (``recompute_working_set``) and FSDP2's previous
    reduce-scatter input (``fsdp_reduce_scatter_held``) are what the FSDP rows need: without
    them the prediction is more than 3% below the tracker."""
    c, _ = compared(run[0], CFG, run[1])
    off = replace(PYTORCH_DEFAULTS, recompute_working_set=False, fsdp_reduce_scatter_held=False)
    low = predict(parse(run[0]), LARGE.formal(), off, rank=run[1]).peak
    assert (c.row(PEAK).measured - low) / c.row(PEAK).measured > PEAK_TOLERANCE


def test_the_cli_prints_the_peak_that_is_validated() -> None:
    from checker._analysis import analyze
    from checker._torch._predict import harness_precision
    from formal._engine_effects import Engine

    c, _ = compared("fsdp8xrecompute", CFG, 0)
    a = analyze(parse("fsdp8xrecompute"), LARGE.formal(), harness_precision(), engine=Engine.FSDP2)
    assert a.peak == c.row(PEAK).predicted
