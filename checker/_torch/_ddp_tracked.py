"""DDP's per-device peak under PyTorch's ``MemTracker``, on real gloo processes.

DDP cannot run under ``FakeTensorMode`` (``checker._torch._large``: its reducer allocates real
buckets and its hooks need real tensors), so its rows of the tracker table are measured on real
tensors instead: ``measure_world`` spawns ``world`` CPU processes (``spawn``, one torch thread
each, a gloo group over TCP on localhost with a timeout), and each rank builds the composition
with the harness's ``Runner`` (``DistributedDataParallel`` with its default buckets;
``ZeroRedundancyOptimizer`` for ``zero1``; ``no_sync`` on all but the last micro-batch for
``m<N>``), steps once, then steps again under ``torch.distributed._tools.mem_tracker.MemTracker``
(``track_external(model, optimizer)``) and ``CommRecorder``. The tracker's peak total of that
steady step is compared with the peak ``check-composition --engine ddp`` prints for the same
model and precision (``checker._torch._predict.predict``: placement and engine terms).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from checker._parse import parse
from checker._torch._compare import PEAK, Comparison, Row, state_rows
from checker._torch._engine import Measured
from checker._torch._isolate import run_world
from checker._torch._large import Tracked
from checker._torch._net import NetConfig

# The DDP-engine rows (plain DDP, ZeRO-1 through ZeroRedundancyOptimizer, gradient accumulation
# over real micro-batches) at two processes: the table's ``ddp8``, ``zero18`` and ``dp8xm4``.
DDP_COMPOSITIONS: tuple[str, ...] = ("ddp2", "zero12", "dp2xm4")
# DDP on each stage of a pipeline (a 2-D (pp, dp) mesh, pp outer) at four processes.
PIPELINE_DDP_COMPOSITIONS: tuple[str, ...] = ("pp2xdp2xm4",)
# A model whose activations are a good part of the peak (about 40%), small enough for real
# tensors on two shared CPU cores: 10.2 M parameters, about 0.34 GB per rank at the peak.
DDP_MODEL = NetConfig(layers=4, hidden=384, heads=6, vocab=4096, seq=256, batch=2)
# A wedged collective (one rank failing while the other waits) ends the run instead of hanging.
_TIMEOUT = timedelta(minutes=3)


@dataclass(frozen=True)
class DDPTracked:
    """One composition on one rank: the storages and calls, and ``MemTracker``'s view."""

    composition: str
    rank: int
    world: int
    measured: Measured
    tracked: Tracked
    seconds: float


def _worker(rank: int, world: int, port: int, out: str, texts: list[str], cfg: NetConfig) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from checker._torch._engine import Runner
    from checker._torch._large import _measured, _tracked, _tracker
    from checker._torch._record import CommRecorder

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_TIMEOUT
    )
    results: list[DDPTracked] = []
    try:
        for text in texts:
            start = time.perf_counter()
            runner = Runner(parse(text, devices=world), cfg, rank, world, fake=False)
            model, schedule = runner.build()
            opt = runner._optimizer(model)
            # The steady step is the third, as ``checker._torch._engine.measure``'s: the first
            # allocates the optimizer state, after it DDP rebuilds its buckets in ready order.
            for i in range(2):
                runner.bucket_buffers.clear()  # the second step's hooks see the rebuilt buckets
                runner.step(model, schedule, opt, i)
            tracker = _tracker(runner, model, opt)
            # The buckets were allocated before the tracker started: given to it, as external
            # tensors (its Buffer category), they count from the step's start, as they are held.
            tracker.track_external(*runner.bucket_buffers.values())
            recorder = CommRecorder()
            with tracker, recorder:
                runner.step(model, schedule, opt, 2)
            measured = _measured(runner, model, opt, recorder)
            # DDP's bucket buffers (seen by the harness's communication hook) are the gradients'
            # second copy; MemTracker files them under its Activation category.
            measured = replace(measured, gradients=measured.gradients + sum(runner.bucket_bytes.values()))
            tracked = _tracked(tracker, opt, measured)
            results.append(DDPTracked(text, rank, world, measured, tracked, time.perf_counter() - start))
            del model, opt, tracker
    finally:
        dist.destroy_process_group()
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_world(
    texts: tuple[str, ...] = DDP_COMPOSITIONS, world: int = 2, cfg: NetConfig = DDP_MODEL
) -> list[DDPTracked]:
    """Every rank's measurement of ``texts`` on ``world`` gloo processes (one spawn for all),
    in composition order, then rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        run_world(_worker, (world, _free_port(), tmp, list(texts), cfg), world, f"DDP tracker world {world}")
        per_rank = []
        for r in range(world):
            with open(Path(tmp) / f"rank{r}.pkl", "rb") as f:
                per_rank.append(pickle.load(f))
    return [per_rank[r][i] for i in range(len(texts)) for r in range(world)]


def compare(m: DDPTracked, cfg: NetConfig = DDP_MODEL) -> Comparison:
    """``m`` against the prediction for its rank: model states against the storages (DDP's
    buckets included), parameters and optimizer state against the tracker's categories (its
    Gradient category leaves the buckets out), and the peak the CLI prints against the
    tracker's peak total."""
    from checker._torch._predict import predict

    comp = parse(m.composition, devices=m.world)
    predicted = predict(comp, cfg.formal(), rank=m.rank)
    t = m.tracked
    rows = (
        *state_rows(predicted, m.measured),
        Row("tracker parameters", predicted.parameters, t.parameters),
        Row("tracker optimizer", predicted.optimizer, t.optimizer),
        Row(PEAK, predicted.peak, t.peak["Total"]),
    )
    return Comparison(
        comp,
        m.measured.engine.value,
        m.measured.stage,
        rows,
        predicted.calls,
        tuple(sorted(m.measured.calls)),
        m.seconds,
        m.rank,
        predicted.engine,
    )


def format_ddp(results: list[Comparison], cfg: NetConfig = DDP_MODEL) -> str:
    """One line per composition and rank: model states, the peak against the tracker's."""
    from checker._torch._compare import pct

    params = cfg.formal().parameter_count()
    head = (
        f"{'composition':<14}{'rank':>5}{'model states pred':>18}{'measured':>11}{'err':>7}"
        f"{'peak pred':>12}{'tracker':>12}{'err':>8}{'placement':>12}{'err':>8}{'calls':>6}{'equal':>6}{'s':>6}"
    )
    world = results[0].composition.devices if results else 0
    lines = [f"{cfg}: {params / 1e6:.1f} M parameters, fp32 Adam, {world} gloo processes", head, "-" * len(head)]
    for c in results:
        ms, pk = c.row("model states"), c.row(PEAK)
        exact = "exact" if c.model_states_exact else pct(ms.error)
        # the placement's own figure (the paper's number, no engine terms) against the same peak
        alone = Row("placement", c.engine_prediction.placement_total, pk.measured)
        lines.append(
            f"{c.composition!s:<14}{c.rank:>5}{ms.predicted:>18}{ms.measured:>11}{exact:>7}"
            f"{pk.predicted:>12}{pk.measured:>12}{pct(pk.error):>8}{alone.predicted:>12}{pct(alone.error):>8}"
            f"{len(c.measured_calls):>6}{c.calls_equal!s:>6}{c.seconds:>6.1f}"
        )
    if results:
        worst = max(results, key=lambda c: abs(c.row(PEAK).error))
        lines.append(
            f"worst peak error against the tracker's peak total: {pct(worst.row(PEAK).error)} "
            f"({worst.composition}, rank {worst.rank}); model states exact in "
            f"{sum(c.model_states_exact for c in results)}/{len(results)}"
        )
    return "\n".join(lines)


def ddp_ok(c: Comparison) -> bool:
    """Model states exact, the collective list equal, the peak within ``PEAK_TOLERANCE``."""
    return c.model_states_exact and c.calls_equal and c.peak_within


__all__ = [
    "DDP_COMPOSITIONS",
    "DDP_MODEL",
    "PIPELINE_DDP_COMPOSITIONS",
    "DDPTracked",
    "compare",
    "ddp_ok",
    "format_ddp",
    "measure_world",
]
