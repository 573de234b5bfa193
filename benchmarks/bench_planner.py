"""Planner benchmark: candidates per second and the time of a full 1,024-device plan.

    python benchmarks/bench_planner.py [--model llama3-70b] [--devices 1024] [--runs 5] [--json]
        [--hardware a100-80gb]

Reports medians over ``--runs`` runs of:

* ``cold``: a plan in a fresh deriver (symbolic derivation + lambdify of every component, numpy
  evaluation, ranking), without z3;
* ``warm``: the same plan with the component expressions already derived (a second plan for the
  same model and precision in one process), without z3;
* ``full``: the warm plan with z3 deciding the shown candidates (``formal._smt.decide``);
* candidates per second: (family, mesh, micro-batch size) combinations evaluated per second of
  the numpy stage, and rule-passing candidates costed per second.

Every plan is ranked by the calibrated step time (``formal._steptime``: its terms derived per
family component, evaluated on every candidate, and re-evaluated with each constant moved by
its uncertainty) on ``--hardware`` (default: the preset the planner assumes for 80 GB devices).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from checker import _planner
from checker._planner import Cluster, load_decide, plan
from formal._presets import PRESETS


def _timed(**kwargs: Any) -> tuple[float, _planner.Plan]:
    start = time.perf_counter()
    result = plan(**kwargs)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--hardware", default=None, help="a hardware preset (default: assumed from 80 GB)")
    args = parser.parse_args()
    from formal._hardware import PRESETS as HARDWARE

    figures = _measure(args, HARDWARE[args.hardware] if args.hardware is not None else None)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    for key, value in figures.items():
        print(f"{key:>22}: {value:,.3f}" if isinstance(value, float) else f"{key:>22}: {value}")


def _measure(args: argparse.Namespace, hardware: Any) -> dict[str, Any]:
    model = PRESETS[args.model]
    cluster = Cluster(args.devices, 80 * 10**9)
    common: dict[str, Any] = {"model": model, "cluster": cluster, "top": args.top, "hardware": hardware}

    cold, warm, evaluate, full = [], [], [], []
    result = None
    for _ in range(args.runs):
        _planner._DERIVERS.clear()  # a fresh process's state
        seconds, result = _timed(decide=None, **common)
        cold.append(seconds)
        seconds, result = _timed(decide=None, **common)
        warm.append(seconds)
        evaluate.append(result.seconds["evaluate"])
    decide, solver = load_decide()
    decisions = 0
    if decide is not None:
        for _ in range(max(1, args.runs // 2)):
            seconds, full_result = _timed(decide=decide, **common)
            full.append(seconds)
            decisions = full_result.decided
    assert result is not None
    figures = {
        "model": args.model,
        "devices": args.devices,
        "runs": args.runs,
        "families": len(result.families),
        "combinations": result.enumerated,
        "pass_rules": len(result.table),
        "fit": result.feasible,
        "derivations": result.derivations,
        "cold_plan_s": statistics.median(cold),
        "warm_plan_s": statistics.median(warm),
        "evaluate_s": statistics.median(evaluate),
        "combinations_per_s": result.enumerated / statistics.median(evaluate),
        "candidates_per_s": len(result.table) / statistics.median(evaluate),
        "full_plan_with_z3_s": statistics.median(full) if full else None,
        "z3_decisions": decisions,
        "solver": solver,
        "best": result.top[0].text if result.top else None,
    }
    return figures


if __name__ == "__main__":
    main()
