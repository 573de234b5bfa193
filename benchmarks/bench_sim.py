"""Benchmark (not a test): simulated compositions per second on the reference model.

Each run simulates every composition below (derived step program, exact field arithmetic, two
checked steps plus the read-back step, cost accounting) and reports, per composition, the median
seconds and the median simulated compositions per second over the set.

    python benchmarks/bench_sim.py [-n 5] [COMPOSITION ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from checker._parse import parse
from formal._reference import ReferenceModel
from formal._simulator import reference_for, simulate

DEFAULT = [
    "dp2",
    "zero32",
    "fsdp4",
    "tp2",
    "tp2xsp",
    "pp2xm4",
    "cp2",
    "zero22xm2",
    "hsdp2xdpr2",
    "dp2xoffload",
    "tp2xzero32xpp2",
    "tp2xspxcp2xpp2",
    "pp2xv2xm2",
    "tp2xrecompute",
    "tp2xzero34xpp4",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--runs", type=int, default=5)
    ap.add_argument("compositions", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    cases = [(text, parse(text)) for text in args.compositions]
    per: dict[str, list[float]] = {text: [] for text, _ in cases}
    rounds = []
    for _ in range(args.runs):
        start = time.perf_counter()
        for text, composition in cases:
            t0 = time.perf_counter()
            result = simulate(composition, reference_for(composition, ReferenceModel()))
            per[text].append(time.perf_counter() - t0)
            assert result.matches and not result.cost_mismatches, (text, result.divergence, result.cost_mismatches)
        rounds.append(len(cases) / (time.perf_counter() - start))
    for text, composition in cases:
        print(f"{text:<18} {composition.devices:>3} devices  {statistics.median(per[text]) * 1e3:8.1f} ms")
    print(
        f"median: {statistics.median(rounds):.1f} simulated compositions per second "
        f"({len(cases)} compositions, {args.runs} runs)"
    )


if __name__ == "__main__":
    main()
