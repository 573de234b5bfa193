"""Predicted against measured: our cost model against PyTorch's own engines, per rank.

``python -m checker._torch_validate --table`` prints the table for every strategy at world
size 8 on the fake process group; ``--equivalence`` runs the bit-for-bit and fault runs on 2
and 4 real gloo processes; ``--gloo`` measures every rank on 2 and 4 gloo processes against
the prediction and the fake group; ``--ddp-tracker`` measures DDP's per-device peak under
``MemTracker`` on 2 gloo processes; ``--large`` a 0.5 B-parameter model under FakeTensorMode;
``check-composition COMPOSITION --validate torch`` validates one.
Needs the torch extra (``pip install -e '.[torch]'``); nothing in the core imports this module.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from checker._parse import parse
from checker._torch._compare import ACTIVATION_TOLERANCE, PEAK, Comparison, Row, state_rows
from checker._torch._compare import pct as _pct
from formal._strategies import Composition
from formal._vocab import Axis

# Every engine at world size 8: DDP, ZeRO-1 (DDP + ZeroRedundancyOptimizer), FSDP2 (reshard
# after forward, and not), DTensor TP (with and without sequence parallelism), FSDP+TP, HSDP,
# pipelining (GPipe and 1F1B, 16 micro-batches so that 1F1B's in-flight min(p, m) = 8 differs
# from GPipe's 16).
TABLE_COMPOSITIONS: tuple[str, ...] = (
    "ddp8",
    "zero18",  # DDP + ZeroRedundancyOptimizer: whole tensors per rank, a broadcast per tensor
    "dp8xm4",  # gradient accumulation: 4 micro-batches, DDP's all-reduce on the last only (no_sync)
    "fsdp8xm4",  # FSDP2: gathers and reduce-scatters every micro-batch
    "fsdp8",
    "fsdp-sgo8",
    "tp8",
    "tp8xsp",
    "tp2xfsdp4",
    "hsdp4xdpr2",
    "pp8xm16xgpipe",
    "pp8xm16",
)


def table_ranks(text: str) -> tuple[int, ...]:
    """The ranks the table measures: the first and the last (for a pipeline, the first and the
    last stage), and a middle stage of a pipeline of more than two stages."""
    comp = parse(text)
    last = comp.devices - 1
    p = comp.mesh().get(Axis.PP, 1)
    middle = (p // 2 - 1,) if p > 2 else ()  # pipeline rank r runs stage r (pp is the only axis)
    return tuple(sorted({0, last, *middle}))


# (composition, rank): every strategy's first and last rank, and a pipeline's middle stage.
TABLE_RUNS: tuple[tuple[str, int], ...] = tuple((t, r) for t in TABLE_COMPOSITIONS for r in table_ranks(t))

# ZeRO-2 on FSDP1 too: ``fsdp-sgo8`` on ``FullyShardedDataParallel`` with ``SHARD_GRAD_OP``, its
# first and last rank, with the per-device peak against ``MemTracker``'s (``validate(fsdp1=True)``).
FSDP1_RUNS: tuple[tuple[str, int], ...] = tuple(("fsdp-sgo8", r) for r in table_ranks("fsdp-sgo8"))


def _measure_on_fake_group(composition: Composition | str, devices: int | None, rank: int, fsdp1: bool = False) -> Any:
    from checker._torch._engine import fake_group, measure
    from checker._torch._net import NetConfig

    comp = parse(composition, devices=devices) if isinstance(composition, str) else composition
    teardown = fake_group(comp.devices, rank)
    try:
        return measure(comp, NetConfig(), rank, comp.devices, fsdp1=fsdp1, tracked=fsdp1)
    finally:
        teardown()


def measure_isolated(
    composition: Composition | str, devices: int | None = None, rank: int = 0, fsdp1: bool = False
) -> Any:
    """One fake-group measurement in a child process of its own, so no run inherits another's
    distributed state: DeviceMesh equality ignores the rank and the group names, so meshes
    cached by an earlier run of another rank resolve to process groups that no longer exist.
    The child comes from a forkserver, never a fork of this (possibly threaded) process, and is
    waited on with a limit (``checker._torch._isolate``)."""
    from checker._torch._isolate import run_isolated

    return run_isolated(_measure_on_fake_group, (composition, devices, rank, fsdp1), f"{composition} rank {rank}")


def validate(
    composition: Composition | str, devices: int | None = None, rank: int = 0, fsdp1: bool = False
) -> Comparison:
    """Run ``composition`` (parsed first when given as text) with PyTorch on a fake process group
    (one rank) and compare. ``fsdp1``: fsdp-sgo on FSDP1 ``SHARD_GRAD_OP`` instead of FSDP2,
    with the per-device peak against ``MemTracker``'s peak total (row ``peak total``)."""
    from checker._torch._net import NetConfig
    from checker._torch._predict import predict

    comp = parse(composition, devices=devices) if isinstance(composition, str) else composition
    cfg = NetConfig()
    start = time.perf_counter()
    measured = measure_isolated(comp, None, rank, fsdp1)
    predicted = predict(comp, cfg.formal(), rank=rank)
    rows = (*state_rows(predicted, measured), Row("activations", predicted.activations, measured.activations))
    if measured.tracked_peak is not None:
        rows = (*rows, Row(PEAK, predicted.peak, measured.tracked_peak))
    return Comparison(
        comp,
        measured.engine.value,
        measured.stage,
        rows,
        predicted.calls,
        tuple(sorted(measured.calls)),
        time.perf_counter() - start,
        rank,
        predicted.engine,
    )


def format_comparison(c: Comparison) -> str:
    """Predicted against measured, side by side, for one composition."""
    lines = [
        f"{c.composition} on {c.engine}, rank {c.rank} ({c.stage} stage), world {c.composition.devices}, "
        f"{c.seconds:.1f} s",
        f"  {'bytes per rank':<16}{'predicted':>12}{'measured':>12}{'error':>10}",
    ]
    for r in c.rows:
        lines.append(f"  {r.quantity:<16}{r.predicted:>12}{r.measured:>12}{_pct(r.error):>10}")
    pred, meas = Counter(c.predicted_calls), Counter(c.measured_calls)
    lines.append(f"  {'collectives':<40}{'predicted':>10}{'recorded':>10}")
    for call in sorted(set(pred) | set(meas), key=str):
        mark = "" if pred[call] == meas[call] else "   <- differs"
        lines.append(f"  {call!s:<40}{pred[call]:>10}{meas[call]:>10}{mark}")
    lines.append(
        f"  model states exact: {c.model_states_exact}; collective list equal: {c.calls_equal}; "
        f"activations within {ACTIVATION_TOLERANCE:.0%}: {c.activations_within}"
    )
    if c.engine_prediction is not None:
        e = c.engine_prediction
        lines.append(f"  predicted peak {e.total} B on {e.engine.value} (placement only {e.placement_total} B):")
        lines += [f"    {t.label}: {t.bytes} B ({t.moment})" for t in e.terms]
    return "\n".join(lines)


def format_table(comparisons: Sequence[Comparison]) -> str:
    """One line per strategy: model states, activations and collectives, predicted against measured."""
    head = (
        f"{'composition':<14}{'rank':>5} {'stage':<7}{'engine':<20}"
        f"{'model states pred':>18}{'measured':>10}{'err':>7}"
        f"{'activ. pred':>12}{'measured':>10}{'err':>8}{'calls pred':>11}{'recorded':>9}{'equal':>7}"
    )
    lines = [head, "-" * len(head)]
    for c in comparisons:
        ms, act = c.row("model states"), c.row("activations")
        lines.append(
            f"{c.composition!s:<14}{c.rank:>5} {c.stage:<7}{c.engine:<20}"
            f"{ms.predicted:>18}{ms.measured:>10}{_pct(ms.error):>7}"
            f"{act.predicted:>12}{act.measured:>10}{_pct(act.error):>8}"
            f"{len(c.predicted_calls):>11}{len(c.measured_calls):>9}{c.calls_equal!s:>7}"
        )
    worst = max(comparisons, key=lambda c: abs(c.row("activations").error))
    lines.append(
        f"worst activation error: {_pct(worst.row('activations').error)} ({worst.composition}, "
        f"rank {worst.rank}); "
        f"model states exact in {sum(c.model_states_exact for c in comparisons)}/{len(comparisons)}, "
        f"collective lists equal in {sum(c.calls_equal for c in comparisons)}/{len(comparisons)}"
    )
    return "\n".join(lines)


def format_equivalence(world: int) -> tuple[str, bool]:
    from checker._torch._exact import equivalence

    start = time.perf_counter()
    outcomes = equivalence(world)
    lines = [
        f"world {world} (gloo, {world} processes): exact-arithmetic premise "
        f"(float32 reference == float64, every run): {all(o.premise for o in outcomes)}; "
        f"{time.perf_counter() - start:.1f} s"
    ]
    for o in outcomes:
        z3 = "z3 absent" if o.z3 is None else f"z3 {o.z3.name}"
        agree = str(o.ranks_agree) if o.shared else "n/a"  # n/a: no parameter on two ranks (pipeline)
        lines.append(
            f"  {o.case.label():<32} bit-for-bit {o.matches!s:<6} ranks agree {agree:<6} "
            f"max |diff| {o.max_difference:<10g} {z3:<12} as predicted: {o.expected}"
        )
    return "\n".join(lines), all(o.expected for o in outcomes)


def as_json(c: Comparison) -> dict[str, Any]:
    return {
        "composition": str(c.composition),
        "engine": c.engine,
        "rank": c.rank,
        "stage": c.stage,
        "bytes": {r.quantity: {"predicted": r.predicted, "measured": r.measured, "error": r.error} for r in c.rows},
        "collectives": {
            "predicted": [str(x) for x in c.predicted_calls],
            "recorded": [str(x) for x in c.measured_calls],
            "equal": c.calls_equal,
        },
        "model_states_exact": c.model_states_exact,
        "activations_within": c.activations_within,
        "ok": c.ok,
        "prediction": None if c.engine_prediction is None else c.engine_prediction.as_json(),
    }


def cli_validation(composition: Composition) -> tuple[dict[str, Any], str]:
    """For ``check-composition --validate torch``: the JSON object and the side-by-side text of
    the composition ``check`` analysed (the object itself, user strategies included).

    Raises ``InputError`` (one clear line, exit 2) without torch or without an engine."""
    from formal.errors import CompositionError, InputError

    try:
        import torch  # noqa: F401
    except ImportError as err:
        raise InputError("--validate torch: PyTorch is not installed (pip install -e '.[torch]')") from err
    try:
        c = validate(composition)
    except CompositionError as err:
        raise InputError(f"--validate torch: {err}") from err
    note = "validated on the small model of checker._torch._net (not --model), fp32 Adam, fake process group"
    return as_json(c), note + "\n" + format_comparison(c)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checker._torch_validate", description=__doc__)
    parser.add_argument("compositions", nargs="*", help="compositions to validate (default: the table's)")
    parser.add_argument("--table", action="store_true", help="the table at world size 8")
    parser.add_argument("--equivalence", action="store_true", help="bit-for-bit runs on 2 and 4 gloo processes")
    parser.add_argument(
        "--gloo",
        action="store_true",
        help="measure every rank on 2 and 4 gloo processes, against the prediction and the fake group",
    )
    parser.add_argument(
        "--ddp-tracker",
        action="store_true",
        help="DDP, ZeRO-1, accumulation (2 gloo processes) and DDP on pipeline stages (4) under MemTracker",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help="a 0.5 B-parameter model under FakeTensorMode with MemTracker (checker._torch._large)",
    )
    args = parser.parse_args(argv)
    ok = True
    if args.table or not (args.compositions or args.equivalence or args.gloo or args.large or args.ddp_tracker):
        comparisons = [validate(t, rank=r) for t, r in TABLE_RUNS]
        comparisons += [validate(t, rank=r, fsdp1=True) for t, r in FSDP1_RUNS]
        print(format_table(comparisons))
        ok &= all(c.ok for c in comparisons)
    for text in args.compositions:
        c = validate(text)
        print(format_comparison(c))
        ok &= c.ok
    if args.equivalence:
        for world in (2, 4):
            text, good = format_equivalence(world)
            print(text)
            ok &= good
    if args.gloo:
        ok &= _print_gloo()
    if args.large:
        from checker._torch._large import (
            LARGE_RUNS,
            LLAMA,
            LLAMA_RUNS,
            PIPELINE_DATA_RUNS,
            RECOMPUTE_RUNS,
            compare_large,
            format_large,
            large_ok,
        )

        runs = (*LARGE_RUNS, *RECOMPUTE_RUNS, *PIPELINE_DATA_RUNS)
        large = [compare_large(t, rank=r) for t, r in runs]
        print(format_large(large))
        llama = [compare_large(t, LLAMA, r) for t, r in LLAMA_RUNS]
        print(format_large(llama, LLAMA))
        ok &= all(large_ok(c, r) for c, r in (*large, *llama))
    if args.ddp_tracker:
        from checker._torch._ddp_tracked import PIPELINE_DDP_COMPOSITIONS, compare, ddp_ok, format_ddp, measure_world

        for ddp in (
            [compare(m) for m in measure_world()],
            [compare(m) for m in measure_world(PIPELINE_DDP_COMPOSITIONS, 4)],
        ):
            print(format_ddp(ddp))
            ok &= all(ddp_ok(c) for c in ddp)
    return 0 if ok else 1


def _print_gloo() -> bool:
    """Every rank on 2 and 4 gloo processes (``checker._torch._gloo``): the per-rank table."""
    from checker._torch._gloo import compare_world, format_gloo_table

    good = True
    for world in (2, 4):
        start = time.perf_counter()
        results = compare_world(world)
        print(format_gloo_table(world, results, time.perf_counter() - start))
        good &= all(g.comparison.ok and g.equal_to_fake is True for g in results)
    return good


if __name__ == "__main__":
    sys.exit(main())
