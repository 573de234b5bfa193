"""Reports of an ``Analysis``: the JSON document (schema in docs/schema.md) and the terminal view.

``Report`` is what ``check`` assembles from typed results, each computed once: the analysis
(placement, memory, traffic, schedule), the verdict, the imported configuration with its
unmapped settings, and the runs beside the prediction (``--validate``, ``--simulate``). Its JSON
document and its terminal view are both read from it; nothing is added to a document after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from rich.console import Console
from rich.markup import escape

from checker._analysis import Analysis, analyze
from checker._import_common import Imported, Unmapped
from checker._numbers import gb
from checker._output import Column, fitted_table
from checker._parse import readable
from formal._costs import activation_breakdown, ceil_int, deferred_layer_activations, stage_memory
from formal._engine_effects import Engine, held_at
from formal._exact import exact
from formal._input import printable
from formal._model import ParameterCount, Transformer
from formal._num import Num, ratio
from formal._placement import Recompute
from formal._program import group_sizes
from formal._steptime import StepTime
from formal._verdict import Condition, Status, Verdict
from formal._vocab import Axis, Stage
from formal.errors import PlacementError

SCHEMA = "placement-semantics/report/1"


def _num(x: Num) -> int:
    return ceil_int(x)


def _exact(x: Num) -> str:
    return str(exact(x))


def model_json(analysis: Analysis) -> dict[str, Any]:
    m = analysis.model
    out: dict[str, Any] = {"name": getattr(m, "name", "") or "custom", "parameters": m.parameter_count()}
    if isinstance(m, Transformer):
        out.update(
            layers=m.layers,
            hidden=m.hidden,
            heads=m.heads,
            kv_heads=m.kv_heads_,
            ffn=m.ffn_,
            vocab=m.vocab,
            seq=m.seq,
            micro_batch=m.micro_batch,
            tied_embeddings=m.tied_embeddings,
            experts=m.experts,
            source=m.source,
        )
    elif isinstance(m, ParameterCount):
        out.update(kind="parameter-count", note="activations unknown for a bare parameter count")
    return out


def activations_by_group(analysis: Analysis) -> dict[str, Any] | None:
    """The most-loaded stage's activation bytes by group (``formal._costs.activation_breakdown``)
    for one micro-batch, and what the schedule multiplies them by at its peak: for a schedule that
    defers nothing, ``per_device.activations`` is ``in_flight_micro_batches`` times the ``layers``
    and ``io`` parts (each rounded up to whole bytes, so the product may exceed it by under one byte
    per part and micro-batch); ZB-H1 also keeps, per micro-batch whose backward has run, the
    ``deferred`` bytes its postponed weight-gradient passes read (all the stage's layers;
    ``PipelineSchedule.peak_activations``). None for a bare parameter count."""
    pl, model, precision, stage = analysis.placement, analysis.model, analysis.precision, analysis.memory.stage
    parts = activation_breakdown(pl, model, precision, stage)
    if parts is None or not isinstance(model, Transformer):
        return None
    sbh = model.seq * model.micro_batch * model.hidden
    deferred = deferred_layer_activations(pl, sbh, precision) * pl.stage_layers(model.layers)
    return {**parts, "deferred": _num(deferred), "in_flight_micro_batches": _exact(analysis.in_flight)}


def expressions_json(analysis: Analysis) -> dict[str, str | None]:
    """The most-loaded device's memory as expressions in the degrees (``Analysis.symbolic_memory``)."""
    sym = analysis.symbolic_memory
    return {
        "parameters": str(sym.parameters.total),
        "gradients": str(sym.gradients.total),
        "optimizer": str(sym.optimizer.total),
        "model_states": str(sym.model_states),
        "activations": None if sym.activations is None else str(sym.activations),
    }


def stages_json(analysis: Analysis) -> list[dict[str, Any]]:
    """Memory of a device on every pipeline stage, 0 .. p-1 (``formal._costs.stage_memory``):
    whole bytes by part, as ``per_device``; one entry without a pipeline."""
    pl, model, precision = analysis.placement, analysis.model, analysis.precision
    p = int(pl.pipeline_degree) if pl.pipelined else 1
    sizes = group_sizes(model)
    return [{"stage": i, **stage_memory(pl, model, precision, sizes, i).as_ints()} for i in range(p)]


def to_json(analysis: Analysis, *, document: bool = True) -> dict[str, Any]:
    """The analysis part of the JSON document; ``document=False`` leaves out what only the
    document shows (``None``): the symbolic memory expressions and the memory of every pipeline
    stage. The terminal view reads the most-loaded device's numbers alone and is spared both."""
    pl = analysis.placement
    mem = analysis.memory
    per_device = mem.as_ints()
    collectives = [
        {
            "op": t.kind.value,
            "axis": t.axis.value,
            "state": t.state.long_name,
            "group": t.group.name,
            "phase": t.phase,
            "elements": _num(t.elements),
            "count": _num(t.count),
            "participants": _num(t.participants),
            "bytes": _num(t.bytes),
            "paper_elements": _num(t.paper_elements),
            "psi_units": _exact(ratio(t.paper_elements, analysis.model.parameter_count())),
        }
        for t in analysis.traffic
    ]
    return {
        "schema": SCHEMA,
        "composition": str(analysis.composition),
        "mesh": {axis.value: int(d) for axis, d in pl.mesh},
        "devices": analysis.composition.devices,
        "model": model_json(analysis),
        "precision": {
            "name": analysis.precision.name,
            "parameters": analysis.precision.parameters,
            "gradients": analysis.precision.gradients,
            "optimizer": analysis.precision.optimizer,
            "activations": analysis.precision.activations,
            "gradient_wire": analysis.precision.gradient_wire,
        },
        "options": {
            "sequence_parallel": pl.options.sequence_parallel,
            "recompute": pl.options.recompute.value,
            "offload_optimizer": pl.options.offload_optimizer,
            "offload_parameters": pl.options.offload_parameters,
            "schedule": pl.options.schedule.value,
            "chunks": pl.options.chunks,
            "micro_batches": pl.options.micro_batches,
            "uneven_stages": pl.options.uneven_stages,
        },
        "placement": pl.table(),
        "memory": {
            "unit": "bytes",
            "per_device": per_device,
            "host": _num(mem.host),
            "most_loaded_rank": {"pipeline_stage": mem.stage, "in_flight_micro_batches": _exact(analysis.in_flight)},
            "activations_by_group": activations_by_group(analysis),
            "peak": analysis.peak,
            "engine": None if analysis.engine is None else analysis.engine.as_json(),
            "expressions": expressions_json(analysis) if document else None,
            "per_stage": stages_json(analysis) if document else None,
            "device_memory": analysis.device_memory,
            "reserve": analysis.reserve,
            "fits": analysis.fits,
        },
        "communication": {
            "unit": "bytes",
            "per_device_per_step": _num(analysis.communication_bytes),
            "pipeline_stage": analysis.traffic_stage,
            "model_state_psi_units": _exact(analysis.model_state_psi),
            "collectives": collectives,
            "host_transfers": [
                {"op": op, "state": st.long_name, "group": g.name, "phase": ph, "bytes": _num(v)}  # type: ignore[attr-defined]
                for op, st, g, ph, v in analysis.transfers
            ],
        },
        "pipeline": {"bubble_fraction": _exact(analysis.bubble)},
        "program": [str(op) for op in analysis.program.ops],
    }


def aggregate_collectives(collectives: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], list[dict[str, Any]]]:
    """The terminal's view: one row per (op, axis, state, phase), groups summed, program order."""
    out: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for c in collectives:
        out.setdefault((c["op"], c["axis"], c["state"], c["phase"]), []).append(c)
    return out


def decimal(value: Num | Fraction | str, digits: int = 4) -> str:
    """An exact ratio (a bubble fraction, Psi units) as a decimal for people: ``3/16`` -> ``0.1875``
    (the JSON keeps the exact string)."""
    return f"{float(Fraction(str(value))):.{digits}g}"


def _count(n: int) -> str:
    """A parameter count as people say it: 6.74B, 125M."""
    for size, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


@dataclass(frozen=True)
class WhatIf:
    """The composition with one more modifier, analysed: its peak per device and whether it fits."""

    modifier: str
    total: int
    fits: bool | None


def _with_modifier(analysis: Analysis, modifier: str) -> WhatIf:
    c = analysis.composition
    recompute = Recompute.FULL if modifier == "recompute" else Recompute.SELECTIVE
    changed = replace(c, options=replace(c.options, recompute=recompute), modifiers=(*c.modifiers, modifier))
    engine = None if analysis.engine is None else analysis.engine.engine
    other = analyze(
        changed,
        analysis.model,
        analysis.precision,
        analysis.device_memory,
        reserve=analysis.reserve,
        engine=engine,
        deepspeed=analysis.deepspeed,
    )
    return WhatIf(modifier, other.peak, other.fits)


def what_ifs(analysis: Analysis) -> tuple[WhatIf, ...]:
    """The composition analysed again with each activation modifier it lacks: ``flash`` (attention
    scores never stored) while nothing is recomputed, and ``recompute`` (full recomputation) while
    the composition does not fit. Only a Transformer's activations are known; a user's step
    program is not re-derived (the caller passes no analysis then)."""
    if not isinstance(analysis.model, Transformer):
        return ()
    options = analysis.composition.options
    wanted: list[str] = []
    if options.recompute is Recompute.NONE:
        wanted.append("flash")
    if options.recompute is not Recompute.FULL and analysis.fits is False:
        wanted.append("recompute")
    out: list[WhatIf] = []
    for modifier in wanted:
        try:
            out.append(_with_modifier(analysis, modifier))
        except PlacementError:  # the composition cannot take the modifier: no hint, not an error
            continue
    return tuple(out)


def what_if_text(analysis: Analysis, hints: tuple[WhatIf, ...]) -> str:
    """``with flash: 14.0 GB`` (the peak per device), and whether that changes the fit."""

    def one(h: WhatIf) -> str:
        changed = h.fits is not None and analysis.fits is not None and h.fits != analysis.fits
        return f"with {h.modifier}: {gb(h.total)}" + ((" (fits)" if h.fits else " (does NOT fit)") if changed else "")

    return " · ".join(one(h) for h in hints)


def global_batch(analysis: Analysis) -> int:
    """Sequences per step: micro-batch x micro-batches x data-parallel replicas (dp, dpr and ep,
    as the planner counts them)."""
    mesh = dict(analysis.placement.mesh)
    replicas = 1
    for axis in (Axis.DP, Axis.DPR, Axis.EP):
        replicas *= int(mesh.get(axis, 1))
    micro = analysis.model.micro_batch if isinstance(analysis.model, Transformer) else 1
    return int(micro) * analysis.composition.options.micro_batches * replicas


def assumptions(analysis: Analysis) -> str:
    """The settings the numbers rest on that the command line may not have said."""
    m, o, p = analysis.model, analysis.composition.options, analysis.precision
    parts: list[str] = []
    if isinstance(m, Transformer):
        parts += [f"seq {m.seq}", f"micro-batch {m.micro_batch}"]
    parts.append(f"m {o.micro_batches} (global batch {global_batch(analysis)})")
    parts.append(f"{p.parameters}/{p.gradients}/{p.optimizer} B")
    if isinstance(m, Transformer):
        if o.recompute is Recompute.NONE:
            parts += ["attention stored", "no recompute"]
        else:
            parts.append(f"{o.recompute.value} recompute")
        parts.append("dropout" if m.dropout else "no dropout")  # its masks kept for the backward, or none
    else:
        parts.append("bare parameter count: activations unknown")
    return " · ".join(parts)


def _verdict_summary(verdict: Verdict) -> str:
    n = len(verdict.obligations)
    match verdict.status:
        case Status.PROVED:
            return f"VALID: trains exactly like one device (z3 proved {n} obligations)"
        case Status.REFUTED:
            rules = sorted({v.rule for v in verdict.violations})
            if len(rules) == 1:
                return f"INVALID: {rules[0]} is broken"
            return f"INVALID: {len(rules)} rules broken, e.g. {rules[0]}"
        case _:
            unknown = sum(1 for o in verdict.obligations if o.status is Status.UNKNOWN)
            return f"UNKNOWN: z3 could not decide {unknown} of {n} obligations (not proved)"


def _fit(analysis: Analysis, total: int) -> str:
    if analysis.device_memory is None:
        return f"{gb(total)} per device"
    cap, kept = analysis.device_memory, analysis.reserve
    reserve = f" + {gb(kept)} reserve" if kept else ""
    spare = cap - kept - total
    if spare >= 0:
        return f"{gb(total)}{reserve} <= {gb(cap)} per device: fits ({gb(spare)} spare)"
    return f"{gb(total)}{reserve} > {gb(cap)} per device: does NOT fit"


def engine_summary(analysis: Analysis) -> list[str]:
    """The first screen's engine line: what the declared engine adds to the placement's figure
    (the paper's number), or that its effects are not modelled."""
    e = analysis.engine
    if e is None:
        return []
    if not e.modelled:
        if e.engine in (Engine.FSDP2, Engine.DDP):  # PyTorch's units on a bare parameter count: no layers
            return [f"engine   {e.engine.value}: its units need the model's layers (placement only)"]
        return [f"engine   {e.engine.value}: its own buffers not modelled (placement only)"]
    added = e.total - e.placement_total
    sign = "+" if added >= 0 else "-"
    return [
        f"engine   {e.engine.value}: {sign}{gb(abs(added))} on the placement's {gb(e.placement_total)} (terms below)"
    ]


def _size(n: int) -> str:
    """Bytes for people at a scale that shows them (a term may be kilobytes beside gigabytes)."""
    if abs(n) >= 10**8:
        return gb(n)
    if abs(n) >= 10**5:
        return f"{n / 1e6:,.1f} MB"
    return f"{n:,} B"


def engine_lines(analysis: Analysis) -> list[str]:
    """Each engine term on its own line, with when it is held: the detail under the memory table."""
    e = analysis.engine
    if e is None or not e.modelled:
        return []
    when = {
        "forward": "end of a forward",
        "loss": "loss backward",
        "backward": "first block backward",
        "second_block": "second block backward",
    }
    out = [f"Engine terms ({e.engine.value}, {e.stage} stage; peak at the {when[e.peak_moment]}):"]
    out.append(f"  placement only (the paper's number): {gb(e.placement_total)}")
    if e.base != e.placement_total:
        out.append(f"  less the modes' generic gather buffers: -{gb(e.placement_total - e.base)}")
    for t in e.terms:
        if held_at(t, e.peak_moment):
            out.append(f"  {t.label}: {_size(t.bytes)}")
    out.append(f"  peak per device: {gb(e.total)}")
    out += [f"  note: {n}" for n in e.notes]
    return out


def summary_lines(analysis: Analysis, verdict: Verdict) -> list[str]:
    """The first screen: what was checked, the verdict, the peak per device against the device
    memory with its reserve, the traffic per step and the pipeline bubble."""
    c, m = analysis.composition, analysis.model
    name = getattr(m, "name", "") or "custom"
    bubble = Fraction(str(exact(analysis.bubble)))
    o = c.options
    stall = f"{float(bubble):.1%} of the step idle ({o.schedule.value}, m {o.micro_batches})" if bubble else "none"
    traffic = ceil_int(analysis.communication_bytes)
    what = name if isinstance(m, ParameterCount) else f"model {name} ({_count(m.parameter_count())} params)"
    return [
        f"{readable(c)} on {c.devices} device{'' if c.devices == 1 else 's'} · {what}",
        f"verdict  {_verdict_summary(verdict)}",
        f"memory   {_fit(analysis, analysis.peak)}",
        *engine_summary(analysis),
        f"traffic  {gb(traffic)} per device per step · model states {decimal(analysis.model_state_psi, 3)} Psi",
        f"bubble   {stall}",
    ]


def print_human(analysis: Analysis, console: Console) -> None:
    """The detail tables: memory per device, communication per step, totals."""
    doc = to_json(analysis, document=False)
    m = doc["model"]
    per = doc["memory"]["per_device"]
    stage = doc["memory"]["most_loaded_rank"]["pipeline_stage"]
    rows = [
        [key, "unknown" if per[key] is None else f"{per[key]:,}", "unknown" if per[key] is None else gb(per[key])]
        for key in ("parameters", "gradients", "optimizer", "model_states", "activations", "buffers", "total")
    ]
    if doc["memory"]["host"]:
        rows.append(["host (offloaded)", f"{doc['memory']['host']:,}", gb(doc["memory"]["host"])])
    columns = (Column("state"), Column("bytes", True, 1), Column("GB", True))
    title = f"Memory per device (most loaded: {stage} pipeline stage; GB = 1e9 bytes)"
    console.print(fitted_table(title, columns, rows, console.width))
    for line in engine_lines(analysis):
        console.print(escape(line), highlight=False)
    comm_rows: list[list[str]] = []
    for (op, axis, state, phase), group in aggregate_collectives(doc["communication"]["collectives"]).items():
        moved = sum(r["bytes"] for r in group)
        psi = Fraction(sum(r["paper_elements"] for r in group), m["parameters"])
        comm_rows.append(
            [
                op,
                axis,
                state,
                phase,
                f"{sum(r['count'] for r in group):,}",
                f"{moved:,}",
                f"{moved / 1e9:,.2f}",
                "-" if state == "activations" else f"{float(psi):.3g}",
            ]
        )
    comm_columns = (
        Column("op"),
        Column("axis"),
        Column("state", keep=3),
        Column("phase", keep=4),
        Column("calls", True, 2),
        Column("bytes", True, 1),
        Column("GB", True),
        Column("Psi", True, 5),
    )
    title = "Communication per device per step (ring algorithms; --json lists every group)"
    console.print(fitted_table(title, comm_columns, comm_rows, console.width))
    busiest = doc["communication"].get("pipeline_stage", Stage.FIRST)
    where = f" (pipeline stage sending the most: {busiest})" if doc["mesh"].get("pp", 1) > 1 else ""
    console.print(
        f"total {doc['communication']['per_device_per_step']:,} bytes "
        f"({gb(doc['communication']['per_device_per_step'])}) per device per step{where}; "
        f"model states {decimal(doc['communication']['model_state_psi_units'])} Psi "
        "(ZeRO paper units)"
    )
    if doc["communication"]["host_transfers"]:
        moved = sum(t["bytes"] for t in doc["communication"]["host_transfers"])
        console.print(f"host-device transfers: {moved:,} bytes per step (PCIe, not network)")


def verdict_json(verdict: Verdict, explain: bool = False) -> dict[str, Any]:
    """The ``verdict`` object of the JSON report; ``explain`` adds every obligation with its core."""
    doc = verdict.as_json()
    if explain:
        doc["explain"] = [
            {
                "obligation": o.name,
                "condition": o.condition.label,
                "status": o.status.label,
                "core": list(o.core),
                "reason_unknown": o.reason_unknown,
                "seconds": round(o.seconds, 6),
            }
            for o in verdict.obligations
        ]
    return doc


_SHOWN = 8  # violations listed without --explain


def print_witnesses(verdict: Verdict, console: Console, every: bool = False) -> None:
    """``--explain``, before the tables: each broken rule with its explanation, and the witness
    (the counterexample's fields, values to re-run) of the first; ``every`` (``--explain=all``)
    gives every rule's witness. A rule whose witness repeats the first's but for its group says
    so in one line."""
    if not verdict.violations:
        return
    console.print(f"Counterexamples ({len(verdict.violations)} broken rules; the first in full):", highlight=False)
    first = verdict.violations[0].witness
    for i, v in enumerate(verdict.violations):
        console.print(
            f"[bold red]{escape(v.rule)}[/bold red] ({v.condition.label}): {escape(v.explanation)}", highlight=False
        )
        if i == 0 or every:
            console.print(
                escape("    " + " · ".join(f"{k}: {value}" for k, value in v.witness.items())), highlight=False
            )
        elif v.witness != first:
            differs = [f"{k}: {value}" for k, value in v.witness.items() if first.get(k) != value]
            console.print(escape("    differs from the first in: " + " · ".join(differs)), highlight=False)
    console.print()


def print_verdict(verdict: Verdict, console: Console, explain: bool = False, cores: bool = False) -> None:
    """Verdict per condition, the rules that fired (with witnesses under ``explain``), notes;
    ``cores`` adds the unsat cores of the proved obligations (``--explain=all``).

    Rule names contain brackets (``refresh[P.attention, dp]``): ``fitted_table`` escapes every
    cell and the lines below escape every dynamic text, so that rich does not read them as markup.
    """
    rows = []
    for condition in Condition:
        fired = sorted({v.rule for v in verdict.violations if v.condition is condition})
        shown = ", ".join(fired[:4]) + (f" (+{len(fired) - 4} more)" if len(fired) > 4 else "")
        rows.append([condition.label.replace("_", " "), verdict.condition_status(condition).label, shown or "-"])
    title = f"Verdict: {verdict.status.label.upper()} ({len(verdict.obligations)} z3 obligations)"
    columns = (Column("condition"), Column("status"), Column("rules that fired"))
    console.print(fitted_table(title, columns, rows, console.width))
    if not explain:  # under --explain the violations came first (``print_witnesses``)
        for v in verdict.violations[:_SHOWN]:
            console.print(
                f"[bold red]{escape(v.rule)}[/bold red] ({v.condition.label}): {escape(v.explanation)}",
                highlight=False,
            )
        if len(verdict.violations) > _SHOWN:
            console.print(f"... {len(verdict.violations) - _SHOWN} more violations (--explain or --json lists all)")
    for o in verdict.obligations:
        if o.status is Status.UNKNOWN:
            console.print(
                f"[yellow]unknown[/yellow] {escape(o.name)}: z3 said {escape(repr(o.reason_unknown))} (not proved)",
                highlight=False,
            )
    proved = [o for o in verdict.obligations if o.status is Status.PROVED and o.core]
    if cores:
        console.print("Unsat cores of the proved obligations (tracked constraint names):")
        for o in proved:
            console.print(escape(f"  {o.name}: {', '.join(o.core)}"), highlight=False)
    elif explain and proved:
        console.print(f"{len(proved)} proved obligations have unsat cores: --explain=all prints them")
    for note in verdict.notes:
        console.print(escape(f"note: {note}"), highlight=False)


@dataclass(frozen=True)
class CrossCheck:
    """A run beside the prediction (PyTorch's measurements, the simulator): the JSON object its
    runner writes and the line(s) the terminal shows for it."""

    doc: Mapping[str, Any]
    text: str


@dataclass(frozen=True)
class Timed:
    """The step time on named hardware (``--hardware``: a preset or a TOML file; docs/steptime.md)."""

    hardware: str
    time: StepTime

    def as_json(self) -> dict[str, Any]:
        from checker._steptime_command import time_json

        return time_json(self.time, self.hardware)


@dataclass(frozen=True)
class Report:
    """One ``check``: the typed results its JSON document and terminal view are read from."""

    analysis: Analysis
    verdict: Verdict
    explain: bool = False
    imported: Imported | None = None
    validation: CrossCheck | None = None
    simulation: CrossCheck | None = None
    cores: bool = False  # --explain=all: the unsat cores too (terminal only; the JSON lists them under explain)
    hints: tuple[WhatIf, ...] = ()  # the composition with one more modifier (``what_ifs``)
    step: Timed | None = None  # with --hardware: the step-time model's estimate
    disagreement: CrossCheck | None = None  # z3 and the simulation disagree: said first

    @property
    def unmapped(self) -> tuple[Unmapped, ...]:
        """What the imported configuration says that the composition does not (empty without ``--from``)."""
        return () if self.imported is None else self.imported.unmapped

    def as_json(self) -> dict[str, Any]:
        """The report document of docs/schema.md, in its key order."""
        extra: dict[str, Any] = {}
        if self.imported is not None:
            extra["imported_from"] = self.imported.as_json()
        if self.validation is not None:
            extra["validation"] = dict(self.validation.doc)
        if self.simulation is not None:
            extra["simulation"] = dict(self.simulation.doc)
        if self.step is not None:
            extra["time"] = self.step.as_json()
        doc = {**to_json(self.analysis), "verdict": verdict_json(self.verdict, self.explain), **extra}
        if self.disagreement is not None:  # the first key: a bug in the tool comes before anything else
            return {"disagreement": dict(self.disagreement.doc), **doc}
        return doc


def print_report(report: Report, console: Console) -> None:
    """The terminal view, first screen first: the summary (what was checked, the verdict, peak
    memory against the device with its reserve, traffic, bubble, and the step time when hardware
    is given), the assumptions the numbers rest on, a what-if
    when one modifier changes the fit, the import's unmapped settings; then the detail tables, the
    verdict's rules and the runs beside the prediction. A disagreement between z3 and the
    simulation comes before all of it."""
    if report.disagreement is not None:  # a bug in the tool comes before anything else
        console.print(escape(report.disagreement.text), highlight=False, soft_wrap=True)
    a = report.analysis
    for line in summary_lines(a, report.verdict):
        console.print(escape(line), highlight=False)
    if report.step is not None:
        t = report.step.time
        comm = sum(seconds for _, seconds in t.exposed)
        console.print(
            escape(
                f"step     {t.step_seconds:.3g} s on {printable(report.step.hardware, 40)} · MFU {t.mfu:.1%} · "
                f"{t.tflops_per_device:.0f} TFLOP/s per device · {t.tokens_per_second:,.0f} tokens/s"
            ),
            highlight=False,
        )
        console.print(
            f"         compute {t.compute_seconds:.3g} s · exposed comm {comm:.3g} s · bubble "
            f"{t.bubble_seconds:.3g} s · optimizer {t.optimizer_seconds + t.host_seconds:.3g} s",
            highlight=False,
        )
    console.print(escape(f"assumes  {assumptions(a)}"), highlight=False)
    if report.hints:
        console.print(f"what-if  {what_if_text(a, report.hints)}", highlight=False)
    if report.unmapped:
        console.print("Settings of the imported configuration the composition does not say exactly:")
        for u in report.unmapped:
            console.print(escape(f"  {printable(u.setting)}: {printable(u.why)}"), highlight=False)
    console.print()
    if report.explain:
        print_witnesses(report.verdict, console, report.cores)
    print_human(a, console)
    print_verdict(report.verdict, console, report.explain, report.cores)
    for run in (report.validation, report.simulation):
        if run is not None:
            console.print(escape(run.text), highlight=False, soft_wrap=True)
