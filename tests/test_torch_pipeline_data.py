"""Pipelining with data parallelism under PyTorch's memory tracker: ``pp4xfsdp2xm8`` (1F1B and
GPipe), each stage's module wrapped with FSDP2 on a 2-D (pp, dp) mesh, the 0.5 B-parameter model
under ``FakeTensorMode`` (``checker._torch._large``), the first and the last stage of 8 ranks;
and ``pp4xdp2xm8`` (DDP on each stage) on the small model's fake-group table.

``torch.distributed.pipelining`` runs every micro-batch's backward with FSDP2's gradient
synchronisation and resharding after backward off and reduce-scatters once after the last
(``pipeline_fsdp_deferred_reduction``): the measured collectives and the tracker's peak are
PyTorch's, the predicted ones what ``check-composition --engine fsdp2`` prints.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from torch_runs import assert_model_states_and_calls_exact, assert_peak_within_tolerance, compared, run_label

from checker._parse import parse
from checker._torch._compare import PEAK, PEAK_TOLERANCE
from checker._torch._large import LARGE, PIPELINE_DATA_RUNS
from checker._torch._predict import PYTORCH_DEFAULTS, predict
from checker._torch._record import Call
from formal._engine_effects import stage_actions

CFG = LARGE

DEFERRED_OFF = replace(PYTORCH_DEFAULTS, pipeline_fsdp_deferred_reduction=False)


@pytest.mark.parametrize("run", PIPELINE_DATA_RUNS, ids=run_label)
def test_model_states_and_collectives_are_exact(run: tuple[str, int]) -> None:
    c, r = compared(run[0], CFG, run[1])
    assert_model_states_and_calls_exact(c, run)
    assert r.tracked.parameters == r.measured.parameters > 0


@pytest.mark.parametrize("run", PIPELINE_DATA_RUNS, ids=run_label)
def test_peak_the_cli_prints_is_within_3_percent_of_the_tracker_peak(run: tuple[str, int]) -> None:
    c, r = compared(run[0], CFG, run[1])
    assert_peak_within_tolerance(c, r, run)


def test_one_reduce_scatter_per_unit_and_a_gather_per_resharded_use() -> None:
    """1F1B on stage 0 of 4, 8 micro-batches: F F F F (B F) x 4 B B B B. A block is gathered by
    the four warm-up forwards, by each backward that follows a forward (five), never by a forward
    after a backward (left unsharded): 9 gathers per block; the root once; one reduce-scatter per
    unit. Counted here from the recorded calls of the 2 blocks and the root."""
    assert "".join(stage_actions(parse("pp4xfsdp2xm8").placement(LARGE.formal()), 0)) == "FFFF" + "BF" * 4 + "BBBB"
    c, _ = compared("pp4xfsdp2xm8", CFG, 0)
    h, v = LARGE.hidden, LARGE.vocab
    block = (12 * h * h + 13 * h) * 4  # fp32 bytes of one block: the unit an all-gather outputs
    root = v * h * 4
    recorded = [call for call in c.measured_calls if isinstance(call, Call) and call.group_size == 2]
    calls = Counter((call.kind.value, call.bytes) for call in recorded)
    assert calls[("all_gather", block)] == 2 * 9 and calls[("reduce_scatter", block)] == 2
    assert calls[("all_gather", root)] == 1 and calls[("reduce_scatter", root)] == 1


@pytest.mark.parametrize("run", PIPELINE_DATA_RUNS[:2], ids=run_label)
def test_without_the_deferred_reduction_the_prediction_is_wrong(run: tuple[str, int]) -> None:
    """FSDP2's own per-micro-batch reduction would predict 8 reduce-scatters a unit and one
    block's unsharded gradient: the calls differ and the peak is more than 3% low."""
    c, _ = compared(run[0], CFG, run[1])
    off = predict(parse(run[0]), LARGE.formal(), DEFERRED_OFF, rank=run[1])
    assert Counter(off.calls) != Counter(c.measured_calls)
    assert (c.row(PEAK).measured - off.peak) / c.row(PEAK).measured > PEAK_TOLERANCE


@pytest.mark.parametrize("rank", [0, 7])
def test_ddp_on_each_stage_matches_on_the_small_model(rank: int) -> None:
    """``pp4xdp2xm8``: DDP wraps each stage (the pipeline's ``no_sync`` on all but the last
    micro-batch's backward): model states (the bucket copy included) and the calls exact."""
    from checker._torch_validate import validate

    c = validate("pp4xdp2xm8", rank=rank)
    assert c.model_states_exact and c.calls_equal and c.activations_within, c
