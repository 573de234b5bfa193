"""``python -m proofs [--json] [--jobs N] [--only SUBSTRING] [--timeout-s S]``: discharge every obligation.

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

from formal._verdict import Status
from proofs import Obligation, Result, all_obligations, discharge, discharge_index


def _timed_out(obligation: Obligation, limit: float) -> Result:
    return Result(
        obligation.name,
        obligation.statement,
        obligation.method,
        Status.UNKNOWN,
        0.0,
        reason_unknown=f"not finished within the run's limit of {limit:g} s (--timeout-s)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proofs", description=__doc__)
    parser.add_argument("--json", action="store_true", help="one JSON document instead of rows")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--only", default="", help="run the obligations whose name contains this")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=1800.0,
        help="wall-clock limit of the whole run; unfinished obligations are unknown",
    )
    args = parser.parse_args(argv)
    obligations = all_obligations()
    chosen = [i for i, o in enumerate(obligations) if args.only in o.name]
    start = time.perf_counter()
    if args.jobs > 1 and len(chosen) > 1:
        # Longest first (the two-axis and library obligations) so the pool finishes together.
        order = sorted(
            chosen, key=lambda i: not obligations[i].name.startswith(("composition.sound", "sufficiency.library"))
        )
        # Workers come from a forkserver (never a fork of a process whose BLAS or OpenMP threads
        # may be running), and the whole run has one deadline: an obligation still running then
        # is reported as unknown (timeout), never as proved, and its worker is killed.
        done: dict[int, Result] = {}
        deadline = start + args.timeout_s
        with multiprocessing.get_context("forkserver").Pool(args.jobs) as pool:
            pending = pool.imap_unordered(discharge_index, order)
            try:
                for _ in order:
                    i, result = pending.next(timeout=max(0.0, deadline - time.perf_counter()))
                    done[i] = result
            except multiprocessing.TimeoutError:
                pool.terminate()
        results = [done.get(i) or _timed_out(obligations[i], args.timeout_s) for i in chosen]
    else:
        results = []
        for i in chosen:
            left = start + args.timeout_s - time.perf_counter()
            results.append(discharge(obligations[i]) if left > 0 else _timed_out(obligations[i], args.timeout_s))
    wall = time.perf_counter() - start
    proved = sum(r.status is Status.PROVED for r in results)
    if args.json:
        print(
            json.dumps(
                {
                    "proved": proved,
                    "total": len(results),
                    "seconds": round(wall, 2),
                    "obligations": [r.as_json() for r in results],
                },
                indent=2,
            )
        )
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
