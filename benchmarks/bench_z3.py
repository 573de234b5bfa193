"""z3 time per verdict: compositions of 1 to 5 axes, models of 1 to 100 tensor groups.

Run: ``python benchmarks/bench_z3.py`` (``--repeats 5 --groups 1,10,30,100``). ``cold`` is the
median wall time of ``decide`` with nothing remembered (the step program is derived beforehand,
outside the timing); ``in z3`` the median of the time spent inside z3's ``check``; ``warm`` a
repeated call, whose obligations were all decided before; ``unshared`` the cold time with
remembering off, so that every obligation is its own z3 query (the worst case). Groups are
synthetic (``g0`` ... ``g99``), so every strategy treats them like a replicated norm weight under
``tp`` and like any other weight along the data axes and ``pp``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import formal._smt as smt
from checker._parse import parse
from formal._model import Transformer
from formal._program import derive_program
from formal._smt import clear_cache, decide
from formal._vocab import Group

AXES = ("fsdp8", "tp4", "pp4", "cp2", "dpr2")  # 1 to 5 axes: prefixes of this list
GROUPS = (1, 10, 30, 100)


@dataclass(frozen=True)
class SyntheticModel(Transformer):
    """A transformer whose parameters come in ``groups`` synthetic tensor groups."""

    groups: int = 1

    def group_elements(self) -> dict[Group, int]:
        return {Group(f"g{i}"): 1_000_000 for i in range(self.groups)}


def model_with(groups: int) -> SyntheticModel:
    return SyntheticModel("synthetic", layers=8, hidden=512, heads=8, vocab=1024, seq=256, groups=groups)


@dataclass(frozen=True)
class Cell:
    obligations: int
    distinct: int  # obligations z3 was asked (groups placed alike share one query)
    cold: float  # median seconds of a verdict with nothing remembered
    solver: float  # median seconds inside z3's check, cold
    warm: float  # median seconds when every case was decided before (a planner's repeated calls)
    unshared: float  # median seconds with remembering off: one z3 query per obligation


def bench(axes: int, groups: int, repeats: int) -> Cell:
    model = model_with(groups)
    composition = parse("x".join(AXES[:axes]))
    program = derive_program(composition.placement(model), model)
    decide(composition, program, model)  # warm the imports and z3's context
    cold, solver, warm, unshared = [], [], [], []
    for _ in range(repeats):
        clear_cache()
        start = time.perf_counter()
        verdict = decide(composition, program, model)
        cold.append(time.perf_counter() - start)
        solver.append(sum(o.seconds for o in verdict.obligations))
        assert verdict.status.label == "proved", [v.rule for v in verdict.violations]
        start = time.perf_counter()
        decide(composition, program, model)
        warm.append(time.perf_counter() - start)
        limit, smt._MEMO_LIMIT = smt._MEMO_LIMIT, 0
        clear_cache()
        start = time.perf_counter()
        decide(composition, program, model)
        unshared.append(time.perf_counter() - start)
        smt._MEMO_LIMIT = limit
    distinct = sum(1 for o in verdict.obligations if o.seconds > 0)
    return Cell(
        len(verdict.obligations),
        distinct,
        statistics.median(cold),
        statistics.median(solver),
        statistics.median(warm),
        statistics.median(unshared),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", default=",".join(map(str, GROUPS)))
    parser.add_argument("--axes", type=int, default=len(AXES))
    args = parser.parse_args()
    group_counts = [int(g) for g in args.groups.split(",")]
    print(
        f"{'composition':<26} {'groups':>6} {'obligations':>11} {'z3 queries':>10} {'cold s':>8} "
        f"{'in z3 s':>8} {'warm s':>8} {'unshared s':>10}"
    )
    for axes in range(1, args.axes + 1):
        for groups in group_counts:
            c = bench(axes, groups, args.repeats)
            print(
                f"{'x'.join(AXES[:axes]):<26} {groups:>6} {c.obligations:>11} {c.distinct:>10} {c.cold:>8.3f} "
                f"{c.solver:>8.3f} {c.warm:>8.4f} {c.unshared:>10.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
