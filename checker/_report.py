"""Reports of an ``Analysis``: the JSON document (schema in docs/schema.md) and the terminal view.

``Report`` is what ``check`` assembles from typed results, each computed once: the analysis
(placement, memory, traffic, schedule), the verdict, the imported configuration with its
unmapped settings, and the runs beside the prediction (``--validate``, ``--simulate``). Its JSON
document and its terminal view are both read from it; nothing is added to a document after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import sympy as sp
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from checker._analysis import Analysis
from checker._import_common import Imported, Unmapped
from checker._numbers import gb
from formal._costs import ceil_int
from formal._exact import exact
from formal._input import printable
from formal._model import ParameterCount, Transformer
from formal._verdict import Condition, Status, Verdict
from formal._vocab import Stage

SCHEMA = "placement-semantics/report/1"


def _num(x: sp.Expr) -> int:
    return ceil_int(x)


def _exact(x: sp.Expr) -> str:
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


def to_json(analysis: Analysis) -> dict[str, Any]:
    pl = analysis.placement
    mem = analysis.memory
    per_device = mem.as_ints()
    sym = analysis.symbolic_memory
    expressions = {
        "parameters": str(sym.parameters.total),
        "gradients": str(sym.gradients.total),
        "optimizer": str(sym.optimizer.total),
        "model_states": str(sym.model_states),
        "activations": None if sym.activations is None else str(sym.activations),
    }
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
            "psi_units": _exact(t.paper_elements / analysis.model.parameter_count()),
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
            "expressions": expressions,
            "device_memory": analysis.device_memory,
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


def print_human(analysis: Analysis, console: Console) -> None:
    doc = to_json(analysis)
    m = doc["model"]
    # The model's name may come from a user's config.json: escaped, so that rich reads no markup in it.
    console.print(
        f"[bold]{escape(doc['composition'])}[/bold] on {doc['devices']} devices "
        f"(mesh {' x '.join(f'{a}={d}' for a, d in doc['mesh'].items())}); "
        f"model {escape(m['name'])} ({m['parameters']:,} params); precision {doc['precision']['name']} "
        f"({doc['precision']['parameters']}/{doc['precision']['gradients']}/"
        f"{doc['precision']['optimizer']} B/param)"
    )
    per = doc["memory"]["per_device"]
    stage = doc["memory"]["most_loaded_rank"]["pipeline_stage"]
    table = Table(title=f"Memory per device (most loaded: {stage} pipeline stage; GB = 1e9 bytes)")
    table.add_column("state")
    table.add_column("bytes", justify="right")
    table.add_column("GB", justify="right")
    for key in ("parameters", "gradients", "optimizer", "model_states", "activations", "buffers", "total"):
        value = per[key]
        table.add_row(key, "unknown" if value is None else f"{value:,}", "unknown" if value is None else gb(value))
    if doc["memory"]["host"]:
        table.add_row("host (offloaded)", f"{doc['memory']['host']:,}", gb(doc["memory"]["host"]))
    console.print(table)
    if doc["memory"]["fits"] is not None:
        verdict = "fits" if doc["memory"]["fits"] else "does NOT fit"
        console.print(f"{verdict} in {gb(doc['memory']['device_memory'])} per device")
    comm = Table(title="Communication per device per step (ring algorithms; --json lists every group)")
    for col in ("op", "axis", "state", "phase", "calls", "bytes", "GB", "Psi"):
        comm.add_column(col, justify="left" if col in ("op", "axis", "state", "phase") else "right")
    for (op, axis, state, phase), rows in aggregate_collectives(doc["communication"]["collectives"]).items():
        moved = sum(r["bytes"] for r in rows)
        psi = Fraction(sum(r["paper_elements"] for r in rows), m["parameters"])
        comm.add_row(
            op,
            axis,
            state,
            phase,
            f"{sum(r['count'] for r in rows):,}",
            f"{moved:,}",
            f"{moved / 1e9:,.2f}",
            "-" if state == "activations" else f"{float(psi):.3g}",
        )
    console.print(comm)
    busiest = doc["communication"].get("pipeline_stage", Stage.FIRST)
    where = f" (pipeline stage sending the most: {busiest})" if doc["mesh"].get("pp", 1) > 1 else ""
    console.print(
        f"total {doc['communication']['per_device_per_step']:,} bytes "
        f"({gb(doc['communication']['per_device_per_step'])}) per device per step{where}; "
        f"model states {float(Fraction(doc['communication']['model_state_psi_units'])):.4g} Psi "
        "(ZeRO paper units)"
    )
    if doc["communication"]["host_transfers"]:
        moved = sum(t["bytes"] for t in doc["communication"]["host_transfers"])
        console.print(f"host-device transfers: {moved:,} bytes per step (PCIe, not network)")
    if doc["pipeline"]["bubble_fraction"] != "0":
        console.print(f"pipeline bubble fraction {doc['pipeline']['bubble_fraction']}")


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


def print_verdict(verdict: Verdict, console: Console, explain: bool = False) -> None:
    """Verdict per condition, the rules that fired (with witnesses under ``explain``), notes.

    Rule names contain brackets (``refresh[P.attention, dp]``): every dynamic text is escaped so
    that rich does not read it as markup.
    """
    table = Table(title=f"Verdict: {verdict.status.label.upper()} ({len(verdict.obligations)} z3 obligations)")
    table.add_column("condition")
    table.add_column("status")
    table.add_column("rules that fired")
    for condition in Condition:
        fired = sorted({v.rule for v in verdict.violations if v.condition is condition})
        shown = ", ".join(fired[:4]) + (f" (+{len(fired) - 4} more)" if len(fired) > 4 else "")
        table.add_row(
            condition.label.replace("_", " "), verdict.condition_status(condition).label, escape(shown) or "-"
        )
    console.print(table)
    limit = None if explain else 8
    for v in verdict.violations[:limit]:
        console.print(
            f"[bold red]{escape(v.rule)}[/bold red] ({v.condition.label}): {escape(v.explanation)}", highlight=False
        )
        if explain:
            for key, value in v.witness.items():
                console.print(escape(f"    {key}: {value}"), highlight=False)
    if limit is not None and len(verdict.violations) > limit:
        console.print(f"... {len(verdict.violations) - limit} more violations (--explain or --json lists all)")
    for o in verdict.obligations:
        if o.status is Status.UNKNOWN:
            console.print(
                f"[yellow]unknown[/yellow] {escape(o.name)}: z3 said {escape(repr(o.reason_unknown))} (not proved)",
                highlight=False,
            )
    if explain:
        console.print("Unsat cores of the proved obligations (tracked constraint names):")
        for o in verdict.obligations:
            if o.status is Status.PROVED and o.core:
                console.print(escape(f"  {o.name}: {', '.join(o.core)}"), highlight=False)
    for note in verdict.notes:
        console.print(escape(f"note: {note}"), highlight=False)


@dataclass(frozen=True)
class CrossCheck:
    """A run beside the prediction (PyTorch's measurements, the simulator): the JSON object its
    runner writes and the line(s) the terminal shows for it."""

    doc: Mapping[str, Any]
    text: str


@dataclass(frozen=True)
class Report:
    """One ``check``: the typed results its JSON document and terminal view are read from."""

    analysis: Analysis
    verdict: Verdict
    explain: bool = False
    imported: Imported | None = None
    validation: CrossCheck | None = None
    simulation: CrossCheck | None = None
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
        doc = {**to_json(self.analysis), "verdict": verdict_json(self.verdict, self.explain), **extra}
        if self.disagreement is not None:  # the first key: a bug in the tool comes before anything else
            return {"disagreement": dict(self.disagreement.doc), **doc}
        return doc


def print_report(report: Report, console: Console) -> None:
    """The terminal view: the import's unmapped settings, memory and traffic, the verdict, and the
    runs beside the prediction; a disagreement between z3 and the simulation comes first."""
    if report.disagreement is not None:
        console.print(escape(report.disagreement.text), highlight=False, soft_wrap=True)
    if report.unmapped:
        console.print("Settings of the imported configuration the composition does not say exactly:")
        for u in report.unmapped:
            console.print(escape(f"  {printable(u.setting)}: {printable(u.why)}"), highlight=False, soft_wrap=True)
    print_human(report.analysis, console)
    print_verdict(report.verdict, console, report.explain)
    for run in (report.validation, report.simulation):
        if run is not None:
            console.print(escape(run.text), highlight=False, soft_wrap=True)
