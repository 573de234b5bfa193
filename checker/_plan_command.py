"""The ``plan`` subcommand: its options, and the plan printed for a terminal.

Registered in checker/cli.py; the planning itself is ``checker._planner.plan``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from checker import _planner
from checker._conventions import CONVENTIONS
from checker._numbers import gb
from checker._plan_results import Plan, explain_pair
from checker._plan_space import AXES, Cluster, DataParallel, RankBy, Space, Workload
from formal._model import Model, Transformer
from formal._verdict import Status
from formal._vocab import Axis
from formal.errors import InputError


def _axis_values(option: str, items: Sequence[str], parse_value: Callable[[str], float]) -> list[tuple[Axis, float]]:
    out: list[tuple[Axis, float]] = []
    for item in items:
        for part in item.split(","):
            name, sep, value = part.partition("=")
            try:
                axis = Axis(name.strip().lower())
            except ValueError:
                raise InputError(
                    f"{option} {part}: unknown axis {name!r} (axes: {', '.join(a.value for a in AXES)})"
                ) from None
            if not sep:
                raise InputError(f"{option} {part}: expected AXIS=VALUE, e.g. tp=8")
            out.append((axis, parse_value(value)))
    return out


def _rate(text: str | None, own: float) -> float:
    """A bandwidth option's bytes/s, or the hardware's own figure when it is not given."""
    return _bandwidth(text) if text is not None else own


def _bandwidth(text: str) -> float:
    from checker._numbers import parse_bytes

    return float(parse_bytes(text.strip().removesuffix("/s").removesuffix("/S"), option="--bandwidth"))


def _print_plan(result: Plan) -> None:
    from rich.markup import escape

    from checker._output import Column, fitted_table, terminal
    from checker._parse import readable

    console = terminal()
    model_name = escape(getattr(result.model, "name", "") or "custom")  # a config's own text: no markup
    console.print(
        f"[bold]plan[/bold] {model_name} ({result.model.parameter_count():,} parameters) on "
        f"{result.cluster.devices} devices x {gb(result.cluster.device_memory)} "
        f"({gb(result.cluster.reserve)} reserved); global batch "
        f"{result.global_batch}; precision {result.precision.name}; ranked by "
        f"{'step time' if result.rank_by is RankBy.TIME else _ranked_by_bytes(result)}"
        + (f" (calibrated, {escape(result.hardware_note)})" if result.hardware is not None else "")
    )
    console.print(
        f"{len(result.families)} families, {result.enumerated:,} combinations, "
        f"{len(result.table):,} pass the composition rules, {result.feasible:,} fit; "
        f"{result.decided} z3 decisions ({result.solver})"
        + (f", {result.cache_hits} from the cache" if result.cache_hits else "")
        + f"; {result.seconds['total']:.2f} s"
    )
    console.print(
        "memory: the peak under each candidate's engine, as check prints it (zero*: deepspeed, "
        "fsdp/hsdp: fsdp2, dp: ddp, else megatron); screened on the placement's figure"
    )
    title = "Best compositions (GB = 1e9 bytes; ms per step: compute + bubble + comm + host)"
    columns = (
        Column("#", True),
        Column("composition", wrap=False),
        Column("b", True, 2),
        Column("memory", wrap=False),
        Column("comm/step", True, 5),
        Column("step ms", True),
        Column("bubble", True, 3),
        Column("comm ms", True, 4),
        Column("verdict"),
    )
    rows = [
        [
            str(c.rank),
            readable(c.composition()),
            str(c.micro_batch),
            gb(c.exact_memory if c.exact_memory is not None else c.memory) + f" ({c.stage})",
            gb(c.exact_communication if c.exact_communication is not None else c.communication),
            *([f"{x * 1e3:,.0f}" for x in (c.step_s, c.bubble_s, c.communication_s)] if c.timed else ["-"] * 3),
            c.status.label if c.status is not None else c.verdict_note,
        ]
        for c in result.top
    ]
    console.print(fitted_table(title, columns, rows, console.width))
    if not result.top:
        console.print("no composition fits and is proved valid")
    for c in result.top:
        for note in c.notes:
            console.print(escape(f"  #{c.rank}: {note}"), highlight=False)
    for a, b in itertools.pairwise(result.top):
        console.print(f"  #{a.rank} > #{b.rank}: " + explain_pair(a, b, result.rank_by))
    console.print("[bold]Popular alternatives[/bold]")
    for alt in result.alternatives:
        console.print(f"  {alt.label}: {alt.reason}")
    for what, why in result.refuted.items():
        console.print(f"  rejected by z3: {what}: {why}")
    _print_front(result, console.print)
    _print_sensitivity(result, console.print)


def _conventional(
    result: Plan, chosen: Model, seq: int | None, convention: str, node_size: int
) -> list[dict[str, Any]]:
    """Each shown candidate's memory as ``check --convention`` gives it for the same composition,
    micro-batch size and precision (``checker._conventions``); a candidate the convention does not
    describe (DeepSpeed's estimators without a ZeRO stage) gets the reason instead."""
    from checker._analysis import analyze
    from checker._command import sized
    from checker._conventions import conventions_json, deepspeed_json, megatron_of

    out: list[dict[str, Any]] = []
    for c in result.top:
        model = sized(chosen, c.micro_batch, seq) if isinstance(chosen, Transformer) else chosen
        analysis = analyze(c.composition(), model, result.precision)
        try:
            found = megatron_of(analysis) if convention == "megatron" else deepspeed_json(analysis, node_size)
        except InputError as err:
            out.append({"convention": convention, "not_described": str(err)})
            continue
        out.append(conventions_json(found))
    return out


def _convention_lines(result: Plan, conventional: list[dict[str, Any]]) -> list[str]:
    from checker._parse import readable

    kind = conventional[0]["convention"]
    if kind == "megatron":
        lines = ["As Megatron-LM's theoretical memory counts it (first stage; MB = 2^20 bytes):"]
    else:
        lines = [
            "As DeepSpeed's estimators print it (GiB; per CPU: a node's, x 1.5):",
            "    per CPU  |  per GPU |   Options",
        ]
    for c, found in zip(result.top, conventional, strict=True):
        name = f"  #{c.rank} {readable(c.composition())}:"
        if "not_described" in found:
            why = str(found["not_described"]).removeprefix(f"--convention {kind}: ")
            lines += [name, f"    not described: {why}"]
        elif kind == "megatron":
            lines += [name, f"    {found['line']}"]
        else:
            lines += [name, *(f"   {row['line']}" for row in found["rows"])]
    return lines


def _ranked_by_bytes(result: Plan) -> str:
    if result.hardware is None:  # nothing timed: host transfers count as bytes too
        return "bytes moved per step (collectives + host)"
    return "communication per step"


def _print_front(result: Plan, echo: Callable[..., None], shown: int = 6) -> None:
    """The Pareto front of the fitting candidates (step time, memory headroom, traffic)."""
    from rich.markup import escape

    front = result.pareto()
    if front.size == 0:
        return
    echo(
        f"[bold]Pareto front[/bold] ({front.size} candidates: none beaten on step time, headroom and traffic; "
        "costs only, not decided by z3)"
    )
    picks = sorted({round(i * (front.size - 1) / max(shown - 1, 1)) for i in range(min(shown, front.size))})
    for i in picks:
        c = result.candidate(int(front[i]))
        head = gb(result.cluster.usable_memory - result.peak(int(front[i])).total)
        step = f"{c.step_s * 1e3:>9,.0f} ms" if c.timed else f"{'-':>12}"
        numbers = f"  {step}  {head:>8} spare  {gb(c.communication):>8}/step  b{c.micro_batch}"
        if len(numbers) + 1 + len(c.text) <= 80:
            echo(escape(f"{numbers} {c.text}"), highlight=False)
        else:  # the composition on its own line: numbers are never cut
            echo(escape(numbers), highlight=False)
            echo(escape(f"    {c.text}"), highlight=False)


def _print_sensitivity(result: Plan, echo: Callable[..., None]) -> None:
    """Which of the top candidates swap when a calibrated constant moves by its uncertainty."""
    rows = result.sensitivity(max(len(result.top), 1))
    if not rows:
        return
    k = max(len(result.top), 1)
    echo(f"[bold]Sensitivity[/bold] of the top {k} by cost to each constant +- its fitted uncertainty")
    for r in rows:
        what = f"  {r['constant']} {r['move']:+.3g}: "
        if r["first_changed"] is None:
            echo(what + "same order")
        elif not r["entered"]:
            echo(what + f"same {k}, reordered from #{r['first_changed']}")
        else:
            echo(what + f"#{r['first_changed']} on changes; in: " + ", ".join(r["entered"]), highlight=False)


def plan_command() -> Any:
    """The ``plan`` subcommand (registered in checker/cli.py)."""
    import json
    import sys

    import click

    from checker._command import DEFAULT_RESERVE, RESERVE_HELP
    from checker._commands_reports import examples
    from checker._numbers import (
        MAX_BATCH,
        MAX_DEGREE,
        MAX_MICRO_BATCH,
        MAX_SEQ,
        WholeNumber,
        parse_bytes,
        parse_count,
        parse_int,
    )
    from checker._output import output_path, write_atomic
    from formal._model import PRECISIONS
    from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES

    @click.command(
        "plan",
        epilog=examples(
            "check-composition plan                                # llama2-7b on 64 devices",
            "check-composition plan --model llama3-70b --devices 512 --top 3",
            "check-composition plan --fix tp=8 --rank-by communication --json",
            "check-composition plan --csv candidates.csv",
        ),
    )
    @click.option("--model", default=None, help="Preset name or Hugging Face config.json.")
    @click.option(
        "--hardware",
        default=None,
        help="Time steps on this hardware: a preset (a100-80gb, h100-80gb, ...) or a FILE.toml; its memory, "
        "node size, links and FLOP/s are the defaults of the options below (default: the preset assumed "
        "from --device-memory, e.g. a100-80gb for 80GB; docs/planner.md).",
    )
    @click.option("--params", default=None, help="A bare parameter count instead of a model (7.5e9, 70B).")
    @click.option(
        "--largest-layer",
        default=None,
        help="With --params: the most parameters one module holds (DeepSpeed's largest_layer_params), "
        "the unit ZeRO-3 gathers and reduces; without it those buffers are unknown.",
    )
    @click.option("--devices", type=WholeNumber(1, MAX_DEGREE), default=DEFAULT_DEVICES, show_default=True)
    @click.option("--device-memory", default=None, help="Per-device memory, e.g. 80GB (default 80GB).")
    @click.option("--precision", default="zero", show_default=True, help="Bytes per element: " + ", ".join(PRECISIONS))
    @click.option("--reserve", default=DEFAULT_RESERVE, show_default=True, help=RESERVE_HELP)
    @click.option(
        "--global-batch",
        type=WholeNumber(1, MAX_BATCH),
        default=None,
        help="Sequences per step (default: one per device).",
    )
    @click.option("--seq", type=WholeNumber(1, MAX_SEQ), default=None, help="Sequence length (default: the model's).")
    @click.option(
        "--micro-batch",
        "micro_batches",
        default="1,2,4",
        show_default=True,
        help="Micro-batch sizes to consider, comma-separated.",
    )
    @click.option("--node-size", type=WholeNumber(1, MAX_DEGREE), default=None, help="Devices per node (hardware).")
    @click.option("--intra-node-bandwidth", default=None, help="NVLink per device per direction (the hardware's).")
    @click.option("--inter-node-bandwidth", default=None, help="Network per device (the hardware's).")
    @click.option("--host-bandwidth", default=None, help="PCIe per device (the hardware's).")
    @click.option("--bandwidth", multiple=True, help="Per-axis bandwidth override, e.g. dp=50GB/s.")
    @click.option("--device-flops", default=None, help="Peak FLOP/s per device (the hardware's).")
    @click.option("--fix", multiple=True, help="Pin degrees, e.g. tp=8,pp=8.")
    @click.option(
        "--data",
        "data_kinds",
        default=",".join(d.value for d in DataParallel),
        show_default=True,
        help="Data-axis strategies to consider.",
    )
    @click.option("--uneven-stages", is_flag=True, help="Allow layers not divisible by pp (uneven stages).")
    @click.option("--rank-by", type=click.Choice([r.value for r in RankBy]), default="time", show_default=True)
    @click.option("--top", type=WholeNumber(1, 10_000), default=5, show_default=True)
    @click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
    @click.option(
        "--workers",
        type=WholeNumber(1, 256),
        default=1,
        show_default=True,
        help="Evaluate the families in this many processes (spawned; for large sweeps).",
    )
    @click.option(
        "--cache/--no-cache",
        default=True,
        show_default=True,
        help="Keep z3 verdicts on disk between runs ($PLACEMENT_SEMANTICS_CACHE or ~/.cache/placement-semantics).",
    )
    @click.option("--csv", "csv_path", default=None, help="Write every fitting candidate, best first, to this file.")
    @click.option(
        "--convention",
        type=click.Choice(CONVENTIONS),
        default=None,
        help="Also give each shown candidate's memory as another tool counts it, as check --convention does: "
        "megatron (Megatron-LM's theoretical memory; needs a model with layers) or deepspeed (DeepSpeed's "
        "estimators, ZeRO candidates).",
    )
    def command(
        model: str | None,
        hardware: str | None,
        params: str | None,
        largest_layer: str | None,
        devices: int,
        device_memory: str | None,
        precision: str,
        reserve: str,
        global_batch: int | None,
        seq: int | None,
        micro_batches: str,
        node_size: int | None,
        intra_node_bandwidth: str | None,
        inter_node_bandwidth: str | None,
        host_bandwidth: str | None,
        bandwidth: tuple[str, ...],
        device_flops: str | None,
        fix: tuple[str, ...],
        data_kinds: str,
        uneven_stages: bool,
        rank_by: str,
        top: int,
        as_json: bool,
        workers: int,
        cache: bool,
        csv_path: str | None,
        convention: str | None,
    ) -> None:
        """Find the best valid composition for a model on a cluster, e.g.
        ``check-composition plan --model llama3-70b --devices 512 --device-memory 80GB``."""
        from checker._command import base_model, fail, reserve_bytes, set_outcome, sized

        try:
            csv_file = output_path(csv_path, "--csv") if csv_path is not None else None
            chosen = sized(base_model(model, params, largest_layer), None, seq)
            if convention == "megatron" and not isinstance(chosen, Transformer):
                raise InputError("--convention megatron: needs a model with layers (a preset, config.json or --model)")
            if precision not in PRECISIONS:
                raise InputError(f"--precision {precision}: unknown (known: {', '.join(PRECISIONS)})")
            parts = micro_batches.split(",")
            if len(parts) > 64:
                raise InputError(f"--micro-batch {micro_batches[:40]}...: {len(parts)} sizes (at most 64)")
            sizes = [parse_int(part, "--micro-batch", high=MAX_MICRO_BATCH) for part in parts]
            kinds = []
            for part in data_kinds.split(","):
                try:
                    kinds.append(DataParallel(part.strip().lower()))
                except ValueError:
                    raise InputError(
                        f"--data {part}: unknown (known: {', '.join(d.value for d in DataParallel)})"
                    ) from None
            pins = _axis_values("--fix", fix, lambda v: float(parse_int(v, "--fix", high=MAX_DEGREE)))
            from dataclasses import replace

            from formal._hardware import assumed_hardware, hardware_of

            named = hardware_of(hardware) if hardware is not None else None
            capacity = (
                parse_bytes(device_memory)
                if device_memory is not None
                else named.device_memory
                if named is not None
                else DEFAULT_DEVICE_MEMORY
            )
            # Without --hardware: the preset assumed from the device memory; the options given
            # on the command line override its figures either way.
            hw = named if named is not None else assumed_hardware(capacity)
            hw = replace(
                hw,
                node_size=node_size if node_size is not None else hw.node_size,
                intra_node_bandwidth=_rate(intra_node_bandwidth, hw.intra_node_bandwidth),
                inter_node_bandwidth=_rate(inter_node_bandwidth, hw.inter_node_bandwidth),
                host_bandwidth=_rate(host_bandwidth, hw.host_bandwidth),
                peak_flops=(
                    float(parse_count(device_flops, "--device-flops", high=10**21))
                    if device_flops is not None
                    else hw.peak_flops
                ),
                device_memory=capacity,
            )
            cluster = Cluster(
                devices,
                capacity,
                reserve=reserve_bytes(reserve, capacity),
                node_size=hw.node_size,
                bandwidths=tuple(_axis_values("--bandwidth", bandwidth, _bandwidth)),
            )
            # Looked up on checker._planner when called, so that a test can stand in for it.
            result = _planner.plan(
                chosen,
                cluster,
                Workload(global_batch, tuple(sizes), uneven_stages),
                PRECISIONS[precision],
                Space(data=tuple(kinds), pins=tuple((a, int(d)) for a, d in pins), every_interleave=named is not None),
                top=top,
                rank_by=RankBy(rank_by),
                hardware=hw if named is not None or isinstance(chosen, Transformer) else None,
                hardware_assumed=named is None,
                workers=workers,
                cache=_planner.VerdictCache() if cache else None,
            )
            if csv_file is not None:
                write_atomic(csv_file, result.csv(), "--csv")
        except InputError as err:
            fail(str(err))
            return
        from checker._command import EXIT_INVALID, EXIT_UNKNOWN, EXIT_VALID

        proved = bool(result.top) and all(c.status is Status.PROVED for c in result.top)
        code = EXIT_VALID if proved else EXIT_UNKNOWN if result.top else EXIT_INVALID
        set_outcome(code)
        for warning in result.warnings:
            click.echo(f"warning: {warning}", err=True)
        conventional = [] if convention is None else _conventional(result, chosen, seq, convention, hw.node_size)
        if as_json:
            doc = result.as_json()
            if convention is not None:
                for c, found in zip(doc["candidates"], conventional, strict=True):
                    c["convention"] = found
            click.echo(json.dumps(doc, indent=2))
        else:
            _print_plan(result)
            if conventional:
                click.echo("\n".join(_convention_lines(result, conventional)))
        sys.exit(code)

    return command
