"""Measurements on real gloo processes, every rank, against the prediction and the fake group.

``measure_world(world)`` spawns ``world`` processes once (``torch.multiprocessing``, gloo over
TCP on localhost); each runs every composition of ``GLOO_COMPOSITIONS[world]`` with
``measure(..., fake=False)``, the same steps and recorders as the fake-group path, then measures
the same compositions again for its own rank on the fake process group. ``compare_world``
sets each rank's gloo measurement against ``predict(comp, NetConfig().formal(), rank=r)`` and
against its fake-group measurement (pytorch-ground-truth.md says they are identical).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path

from checker._parse import parse
from checker._torch._compare import ACTIVATION_TOLERANCE, Comparison, Row, state_rows
from checker._torch._engine import Measured, fake_group, measure
from checker._torch._isolate import run_world
from checker._torch._net import NetConfig
from checker._torch._predict import predict

# Every engine at world sizes 2 and 4 (FSDP+TP and HSDP need 4 ranks). Pipelines: as many
# micro-batches as twice the stages, so 1F1B's in-flight min(p, m) differs from GPipe's m.
GLOO_COMPOSITIONS: dict[int, tuple[str, ...]] = {
    2: ("ddp2", "fsdp2", "fsdp-sgo2", "tp2", "tp2xsp", "pp2xm4xgpipe", "pp2xm4"),
    4: ("ddp4", "fsdp4", "fsdp-sgo4", "tp4", "tp4xsp", "tp2xfsdp2", "hsdp2xdpr2", "pp4xm8xgpipe", "pp4xm8"),
}
# A wedged collective (one rank failing while the others wait) ends the run instead of hanging.
_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class RankMeasurement:
    """One composition on one rank: measured on gloo, and on the fake group as the same rank."""

    composition: str
    rank: int
    gloo: Measured
    fake: Measured | None  # None when the fake-group run was not asked for
    seconds: float  # the gloo run on this rank


@dataclass(frozen=True)
class GlooComparison:
    """A rank's gloo measurement against the prediction, and against the fake group."""

    comparison: Comparison
    fake_differences: tuple[str, ...] | None  # fields where gloo and fake differ; None: no fake run

    @property
    def equal_to_fake(self) -> bool | None:
        return None if self.fake_differences is None else not self.fake_differences


def _worker(rank: int, world: int, port: int, out: str, texts: list[str], with_fake: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = NetConfig()
    gloo: dict[str, tuple[Measured, float]] = {}
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_TIMEOUT
    )
    try:
        for text in texts:
            start = time.perf_counter()
            m = measure(parse(text, devices=world), cfg, rank, world, fake=False)
            gloo[text] = (m, time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    results: list[RankMeasurement] = []
    for text in texts:
        fake = None
        if with_fake:
            teardown = fake_group(world, rank)
            try:
                fake = measure(parse(text, devices=world), cfg, rank, world, fake=True)
            finally:
                teardown()
        m, seconds = gloo[text]
        results.append(RankMeasurement(text, rank, m, fake, seconds))
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_world(world: int, texts: tuple[str, ...] | None = None, with_fake: bool = True) -> list[RankMeasurement]:
    """Run ``texts`` (default: ``GLOO_COMPOSITIONS[world]``) on ``world`` gloo processes, one
    spawn for all of them; every rank's measurements, in composition order, then rank order."""
    chosen = list(texts if texts is not None else GLOO_COMPOSITIONS[world])
    with tempfile.TemporaryDirectory() as tmp:
        run_world(_worker, (world, _free_port(), tmp, chosen, with_fake), world, f"gloo world {world}")
        per_rank: list[list[RankMeasurement]] = []
        for r in range(world):
            with open(Path(tmp) / f"rank{r}.pkl", "rb") as f:
                per_rank.append(pickle.load(f))
    return [per_rank[r][i] for i in range(len(chosen)) for r in range(world)]


def differences(a: Measured, b: Measured) -> tuple[str, ...]:
    """The fields in which two measurements differ (collectives compared as sorted lists)."""
    out = []
    for f in fields(Measured):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "calls":
            x, y = sorted(x), sorted(y)
        if x != y:
            out.append(f.name)
    return tuple(out)


def compare(m: RankMeasurement, world: int) -> GlooComparison:
    """``m`` against ``predict(comp, NetConfig().formal(), rank=m.rank)``, as ``validate`` does
    for one rank on the fake group."""
    measured = m.gloo
    comp = parse(m.composition, devices=world)
    predicted = predict(comp, NetConfig().formal(), rank=m.rank)
    rows = (*state_rows(predicted, measured), Row("activations", predicted.activations, measured.activations))
    c = Comparison(
        comp,
        measured.engine.value,
        measured.stage,
        rows,
        predicted.calls,
        tuple(sorted(measured.calls)),
        m.seconds,
        m.rank,
    )
    return GlooComparison(c, None if m.fake is None else differences(measured, m.fake))


def compare_world(world: int, texts: tuple[str, ...] | None = None, with_fake: bool = True) -> list[GlooComparison]:
    """Measure on ``world`` gloo processes and compare every rank."""
    return [compare(m, world) for m in measure_world(world, texts, with_fake)]


def _pct(x: float) -> str:
    return "exact" if x == 0 else f"{x:+.2%}"


def format_gloo_table(world: int, results: list[GlooComparison], seconds: float) -> str:
    """One line per composition and rank: model states, activations, collectives, and whether
    the gloo measurement equals the fake group's for that rank."""
    head = (
        f"{'composition':<14}{'rank':>5} {'stage':<7}{'model states pred':>18}{'measured':>10}{'err':>7}"
        f"{'activ. pred':>12}{'measured':>10}{'err':>8}{'calls pred':>11}{'recorded':>9}{'equal':>7}"
        f"{'= fake':>8}"
    )
    lines = [f"world {world} (gloo, {world} processes, every rank): {seconds:.1f} s", head, "-" * len(head)]
    for g in results:
        c = g.comparison
        ms, act = c.row("model states"), c.row("activations")
        fake = "-" if g.equal_to_fake is None else str(g.equal_to_fake)
        lines.append(
            f"{c.composition!s:<14}{c.rank:>5} {c.stage:<7}{ms.predicted:>18}{ms.measured:>10}"
            f"{_pct(ms.error):>7}{act.predicted:>12}{act.measured:>10}{_pct(act.error):>8}"
            f"{len(c.predicted_calls):>11}{len(c.measured_calls):>9}{c.calls_equal!s:>7}{fake:>8}"
        )
        if g.fake_differences:
            lines.append(f"{'':<20}gloo differs from the fake group in: {', '.join(g.fake_differences)}")
    n = len(results)
    cs = [g.comparison for g in results]
    worst = max(cs, key=lambda c: abs(c.row("activations").error))
    lines.append(
        f"model states exact in {sum(c.model_states_exact for c in cs)}/{n}, "
        f"collective lists equal in {sum(c.calls_equal for c in cs)}/{n}, "
        f"activations within {ACTIVATION_TOLERANCE:.0%} in {sum(c.activations_within for c in cs)}/{n} "
        f"(worst {_pct(worst.row('activations').error)}: {worst.composition} rank {worst.rank}), "
        f"equal to the fake group in {sum(g.equal_to_fake is True for g in results)}/{n}"
    )
    return "\n".join(lines)


__all__ = [
    "GLOO_COMPOSITIONS",
    "GlooComparison",
    "RankMeasurement",
    "compare",
    "compare_world",
    "differences",
    "format_gloo_table",
    "measure_world",
]
