"""The planner's top candidate against published throughput (docs/planner.md, "Top candidate
against published throughput").

    python benchmarks/bench_published_plans.py [--space same|open] [RUN-ID-SUBSTRING ...]

For every published run (``checker/data/published-throughput.json``, the ones the fit uses):
plan its model on its cluster (devices, hardware preset, global batch, the run's runtime
settings, micro-batch sizes 1, 2, 4, 4 GB reserve) ranked by the calibrated step time, and print
the top candidate's predicted figure in the run's unit beside the published one and the model's
prediction of the published layout. ``--space same``: the run's own data strategy, sequence
parallelism and recomputation, with 1F1B or any interleaving that divides the layers; ``open``:
DP, ZeRO-1/3, FSDP shard-grad-op with every schedule, sp and recomputation. No z3 (costs only).
"""

from __future__ import annotations

import argparse
import time

from checker._parse import parse
from checker._plan_results import family_of
from checker._planner import Cluster, DataParallel, Offload, Pipeline, Space, Workload, plan
from checker._published import load_runs, predicted, predictions
from formal._hardware import PRESETS as HARDWARE
from formal._model import PRECISIONS
from formal._placement import Schedule
from formal._program import derive_program
from formal._steptime import calibrated, evaluate_batch, prepare

GB = 10**9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", choices=("same", "open"), default="open")
    parser.add_argument("only", nargs="*")
    args = parser.parse_args()
    eff = calibrated()
    for run in (r for r in load_runs() if not r.excluded):
        if args.only and not any(o in run.id for o in args.only):
            continue
        comp = parse(run.composition)
        devices = 1
        for d in comp.mesh().values():
            devices *= d
        pl = comp.placement(run.model)
        replicas = 1
        for axis, d in pl.mesh:
            if axis.kind.splits_batch:
                replicas *= int(d)
        batch = run.model.micro_batch * comp.options.micro_batches * replicas
        hw = HARDWARE[run.hardware]
        if args.space == "same":
            family, _ = family_of(comp)
            space = Space(
                data=(family.data,),
                pipelines=(None, Pipeline(Schedule.ONE_F_ONE_B), Pipeline(Schedule.INTERLEAVED, 2)),
                sequence_parallel=(family.sequence_parallel,),
                recompute=(family.recompute,),
                offload=(Offload.NONE,),
                every_interleave=True,
            )
        else:
            space = Space(
                data=(DataParallel.DP, DataParallel.ZERO1, DataParallel.ZERO3, DataParallel.FSDP_SGO),
                offload=(Offload.NONE,),
                every_interleave=True,
            )
        start = time.perf_counter()
        result = plan(
            run.model.with_micro_batch(1),
            Cluster(devices, hw.device_memory, reserve=4 * GB),
            Workload(batch, (1, 2, 4), comp.options.uneven_stages),
            PRECISIONS["zero"],
            space,
            top=1,
            decide=None,
            hardware=hw,
            runtime=run.runtime,
        )
        on_published = predictions([(run, run.inputs())], eff)[0]
        if not result.order.size:
            print(f"{run.id:30} no candidate fits; model on published layout {on_published:.4g}")
            continue
        top = result.candidate(int(result.order[0]))
        sized = run.model.with_micro_batch(top.micro_batch)
        inputs = prepare(
            derive_program(top.composition().placement(sized), sized), sized, PRECISIONS["zero"], hw, run.runtime
        )
        value = predicted(run, evaluate_batch(inputs, eff), inputs)
        faster = value / run.published if run.unit != "seconds" else run.published / value
        print(
            f"{run.id:30} top b{top.micro_batch} {top.text}: {value:.4g} vs published {run.published:.4g} "
            f"({run.unit}); model on the published layout {on_published:.4g}; top/published speed {faster:.3f} "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
