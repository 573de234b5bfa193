"""Measurement children are safe to start after torch has run threaded kernels here, and no wait
on a child is unbounded.

The hazard: a child forked from a process whose OpenMP worker threads are alive deadlocks in its
first parallel region (``layer_norm``), because fork copies the thread pool's bookkeeping but
not its threads. Before the children came from a forkserver, this test's first case hung on a
loaded two-core machine.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

import torch

from checker._torch._isolate import MeasurementTimeout, run_isolated, run_world
from checker._torch_validate import measure_isolated


def _start_openmp_threads() -> None:
    """Run parallel CPU kernels so that this process's OpenMP pool has live worker threads."""
    torch.set_num_threads(max(2, len(os.sched_getaffinity(0))))
    x = torch.randn(512, 4096)
    for _ in range(3):
        torch.nn.functional.layer_norm(x, (4096,))
        x @ x.T


def test_a_measurement_started_after_threaded_kernels_finishes() -> None:
    _start_openmp_threads()
    start = time.monotonic()
    measured = measure_isolated("ddp2", 2, 1)
    assert measured.parameters > 0 and measured.activations > 0
    assert measured.calls, "a DDP step records its gradient all-reduce"
    _start_openmp_threads()  # and again, with the pool's threads still alive
    assert measure_isolated("tp2", 2, 0).calls
    assert time.monotonic() - start < 240


def test_a_child_that_never_returns_is_killed_at_its_limit() -> None:
    start = time.monotonic()
    with pytest.raises(MeasurementTimeout, match=r"sleeper: the measurement did not finish in 2 s"):
        run_isolated(time.sleep, (600,), "sleeper", timeout_s=2)
    assert time.monotonic() - start < 60


def test_a_child_that_raises_reports_its_error() -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        run_isolated(int, ("not a number",), "int")


def _wedged_rank(rank: int, seconds: float) -> None:
    if rank == 1:  # one rank waits forever, as on a collective the others never join
        time.sleep(seconds)


def test_a_world_with_a_wedged_rank_is_killed_at_its_limit() -> None:
    start = time.monotonic()
    with pytest.raises(MeasurementTimeout, match=r"wedged: 2 processes did not finish in 3 s"):
        run_world(_wedged_rank, (600.0,), 2, "wedged", timeout_s=3)
    assert time.monotonic() - start < 90


def test_a_world_whose_ranks_return_finishes() -> None:
    run_world(_wedged_rank, (0.0,), 2, "quick", timeout_s=120)
