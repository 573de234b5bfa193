"""``python -m proofs [--json] [--jobs N] [--only SUBSTRING]``: discharge every obligation.

One row per obligation (name, statement, method, status, seconds). Exit 1 unless every
obligation is proved: refuted, unknown and timed-out obligations all fail the run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from formal._verdict import Status
from proofs import Result, all_obligations, discharge


def _discharge_index(index: int) -> Result:
    return discharge(all_obligations()[index])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proofs", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON document instead of rows")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--only", default="", help="run the obligations whose name contains this")
    args = parser.parse_args(argv)
    obligations = all_obligations()
    chosen = [i for i, o in enumerate(obligations) if args.only in o.name]
    start = time.perf_counter()
    if args.jobs > 1 and len(chosen) > 1:
        # Longest first (the two-axis and library obligations) so the pool finishes together.
        order = sorted(chosen, key=lambda i: not obligations[i].name.startswith(("composition.sound",
                                                                                 "sufficiency.library")))
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            done = dict(zip(order, pool.map(_discharge_index, order), strict=True))
        results = [done[i] for i in chosen]
    else:
        results = [discharge(obligations[i]) for i in chosen]
    wall = time.perf_counter() - start
    proved = sum(r.status is Status.PROVED for r in results)
    if args.json:
        print(json.dumps({"proved": proved, "total": len(results), "seconds": round(wall, 2),
                          "obligations": [r.as_json() for r in results]}, indent=2))
    else:
        width = max((len(r.name) for r in results), default=10)
        for r in results:
            print(f"{r.name:<{width}}  {r.method:<14}  {r.status.label:<7}  {r.seconds:7.2f}s  {r.statement}")
            if r.status is not Status.PROVED:
                print(f"{'':<{width}}  -> {r.detail or r.reason_unknown}")
        print(f"{proved}/{len(results)} obligations proved in {wall:.1f}s wall clock")
    return 0 if proved == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
