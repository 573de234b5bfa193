"""The planner's process pool (``plan --workers N``) and its on-disk cache of z3 verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from checker._plan_cache import VerdictCache, version_hash
from checker._planner import Cluster, DataParallel, Offload, Pipeline, Space, Workload, plan
from checker.cli import main
from formal._placement import Recompute, Schedule
from formal._presets import PRESETS
from formal._verdict import Status

GB = 10**9
SMALL = Space(
    data=(DataParallel.DP, DataParallel.ZERO1),
    pipelines=(None, Pipeline(Schedule.ONE_F_ONE_B)),
    sequence_parallel=(False,),
    recompute=(Recompute.NONE,),
    offload=(Offload.NONE,),
)


def test_a_pool_of_workers_gives_the_serial_plan() -> None:
    """Families dealt to two spawned workers come back in family order: the same table and ranking."""
    model = PRESETS["llama2-7b"]
    serial = plan(model, Cluster(16, 80 * GB), Workload(32, (1,)), space=SMALL, decide=None)
    pooled = plan(model, Cluster(16, 80 * GB), Workload(32, (1,)), space=SMALL, decide=None, workers=2)
    assert np.array_equal(serial.order, pooled.order)
    assert np.array_equal(serial.table.degrees, pooled.table.degrees)
    assert np.allclose(serial.table.step_s, pooled.table.step_s, rtol=0, atol=0)


def test_a_second_run_reads_its_verdicts_from_the_cache(tmp_path: Path) -> None:
    model = PRESETS["llama2-7b"]
    first = VerdictCache(tmp_path)
    one = plan(model, Cluster(16, 80 * GB), Workload(32, (1,)), space=SMALL, top=2, cache=first)
    assert one.decided >= 2 and one.cache_hits == 0
    assert first.directory.parent.parent == tmp_path and first.directory.name == version_hash()
    second = VerdictCache(tmp_path)
    two = plan(model, Cluster(16, 80 * GB), Workload(32, (1,)), space=SMALL, top=2, cache=second)
    assert two.decided == 0 and two.cache_hits == len(two.top) == 2 and second.hits == 2
    assert [(c.text, c.status) for c in two.top] == [(c.text, c.status) for c in one.top]
    assert all(c.status is Status.PROVED for c in two.top)


def test_an_unreadable_cache_file_is_a_miss(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path)
    cache.directory.mkdir(parents=True)
    family = VerdictCache.family_key("dp", PRESETS["llama2-7b"])
    cache._file(family).write_text("{not json", encoding="utf-8")
    assert cache.get(family, "dp16 b1") is None and cache.misses == 1


def test_cli_workers_and_cache(tmp_path: Path) -> None:
    env = {"PLACEMENT_SEMANTICS_CACHE": str(tmp_path)}
    args = ["plan", "--devices", "8", "--data", "dp,zero1", "--top", "1", "--json"]
    first = CliRunner(env=env).invoke(main, args)
    second = CliRunner(env=env).invoke(main, args)
    assert first.exit_code == second.exit_code == 0, first.output
    assert json.loads(second.stdout)["counts"]["z3_cache_hits"] == 1
    assert json.loads(second.stdout)["counts"]["z3_decisions"] == 0
    bad = CliRunner().invoke(main, ["plan", "--devices", "8", "--workers", "0"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: ")
