"""Subcommands that meet users where they are: ``explain``, ``compare``, ``sweep``, ``export``.

Plus the hook ``check`` uses for ``--report out.html`` (``write_report``). Every table prints
with rich, or as CSV (``--csv``) or JSON (``--json``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from checker._analysis import Analysis
from checker._command import (
    DEFAULT_RESERVE,
    ENGINE_HELP,
    ENGINES,
    EXIT_CODES,
    RESERVE_HELP,
    build,
    fail,
    print_import,
    request,
)
from checker._exporters import Target, dtensor_placements, export
from checker._frameworks import CONFUSED, all_rows, explain_row, placement_difference, placement_table
from checker._html import write_report
from checker._numbers import MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ, WholeNumber, parse_int
from checker._output import Column, fitted_table, output_path, terminal, write_atomic
from checker._parse import DEFAULT_NODE_SIZE, readable
from checker._report import decimal, to_json
from formal._input import printable
from formal._model import PRECISIONS
from formal._presets import DEFAULT_DEVICES
from formal._strategies import LIBRARY, Composition
from formal.errors import InputError, PlacementError

MAX_COMPARED = 64  # compositions side by side (and values of a sweep): a table, not a search

__all__ = ["compare", "explain", "export_command", "sweep", "write_report"]


def examples(*lines: str) -> str:
    """A subcommand's ``--help`` epilog: examples, then the exit codes (kept as written)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines) + "\n\n" + EXIT_CODES


def _fail(err: PlacementError) -> None:
    fail(str(err))


# --- table output ---------------------------------------------------------------------------


def emit(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    title: str,
    as_csv: bool,
    as_json: bool,
    fmt: Callable[[str, Any], str] | None = None,
    specs: Mapping[str, Column] | None = None,
) -> None:
    """One table three ways: rich (default), CSV (raw values) or JSON (a list of objects).

    The rich table fits the terminal (``fitted_table``): ``specs`` gives a column its header,
    whether it holds numbers and how long it stays when the terminal is narrow (a column without
    a spec is text, never dropped)."""
    if as_json:
        click.echo(json.dumps(list(rows), indent=2, default=str))
        return
    if as_csv:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_cell(row.get(k)) for k in columns})
        click.echo(buffer.getvalue(), nl=False)
        return
    # Cells may echo a user's text (a composition, an error naming a config's value): escaped, so
    # that rich reads no markup in them and no control character reaches the terminal.
    console = terminal()
    shown = [(specs or {}).get(c, Column(c)) for c in columns]
    cells = [[printable(fmt(c, row.get(c)) if fmt else _text(row.get(c))) for c in columns] for row in rows]
    console.print(fitted_table(printable(title), shown, cells, console.width))


CHECK_CSV_COLUMNS = (
    "section",
    "name",
    "stage",
    "axis",
    "state",
    "group",
    "phase",
    "elements",
    "count",
    "participants",
    "bytes",
    "detail",
)


def check_csv_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """``check --csv``: the report as rows (bytes exact, per device; collectives per step)."""
    memory = doc["memory"]
    stage = memory.get("most_loaded_rank", {}).get("pipeline_stage", "")
    rows: list[dict[str, Any]] = [
        {"section": "memory", "name": name, "stage": stage, "bytes": value}
        for name, value in memory["per_device"].items()
    ]
    rows.append({"section": "memory", "name": "host", "stage": stage, "bytes": memory.get("host")})
    if memory.get("peak") is not None:  # the per-device peak with the engine's terms
        rows.append({"section": "memory", "name": "peak", "stage": stage, "bytes": memory["peak"]})
        for t in (memory.get("engine") or {}).get("terms", []):
            rows.append({"section": "engine", "name": t["name"], "stage": t["moment"], "bytes": t["bytes"]})
    for c in doc["communication"]["collectives"]:
        rows.append(
            {
                "section": "collective",
                "name": c["op"],
                "axis": c["axis"],
                "state": c["state"],
                "group": c["group"],
                "phase": c["phase"],
                "elements": c["elements"],
                "count": c["count"],
                "participants": c["participants"],
                "bytes": c["bytes"],
            }
        )
    rows.append(
        {
            "section": "communication",
            "name": "per_device_per_step",
            "bytes": doc["communication"]["per_device_per_step"],
        }
    )
    verdict = doc["verdict"]
    for key in ("status", "gradient_integrity", "state_consistency", "composition_rules"):
        rows.append({"section": "verdict", "name": key, "detail": verdict[key]})
    for v in verdict["violations"]:
        rows.append(
            {
                "section": "violation",
                "name": v["rule"],
                "axis": v["axis"],
                "state": v["state"],
                "group": v["group"],
                "detail": v["explanation"],
            }
        )
    return rows


def _csv_cell(value: Any) -> str:
    if isinstance(value, dict):
        return "; ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return "; ".join(str(v) for v in value)
    return "" if value is None else str(value)


def _text(value: Any) -> str:
    return _csv_cell(value)


def _gb_fmt(column: str, value: Any) -> str:
    """A summary cell for people: bytes as GB (the header says GB), exact ratios as decimals."""
    if isinstance(value, int) and not isinstance(value, bool) and column.endswith("bytes"):
        return f"{value / 1e9:,.2f}"
    if column in ("model_state_psi", "bubble") and isinstance(value, str):
        return decimal(value)
    if column == "fits" and isinstance(value, bool):
        return "yes" if value else "NO"
    return _text(value)


# The summary's columns for people: short headers, and which go first in a narrow terminal
# (parts of the total before the total, the Psi units before the bytes they restate).
SUMMARY_SPECS = {
    "value": Column("value", True),
    "composition": Column("composition", wrap=False),
    "devices": Column("devices", True, 2),
    "parameters_bytes": Column("params GB", True, 4),
    "gradients_bytes": Column("grads GB", True, 3),
    "optimizer_bytes": Column("optim GB", True, 5),
    "activations_bytes": Column("activ GB", True, 6),
    "buffers_bytes": Column("buffers GB", True, 1),
    "total_bytes": Column("total GB", True),
    "peak_bytes": Column("peak GB", True),
    "engine": Column("engine", keep=1),
    "fits": Column("fits"),
    "network_bytes": Column("comm GB", True, 8),
    "model_state_psi": Column("Psi", True, 0),
    "bubble": Column("bubble", True, 7),
    "error": Column("error", keep=9),
}


_model_options = [
    click.option(
        "--devices", type=WholeNumber(1, MAX_DEGREE), default=None, help=f"Device count (default {DEFAULT_DEVICES})."
    ),
    click.option("--model", default=None, help="Preset name or Hugging Face config.json."),
    click.option("--params", default=None, help="A bare parameter count instead of a model (7.5e9, 70B)."),
    click.option("--precision", default="zero", show_default=True, help="Bytes per element: " + ", ".join(PRECISIONS)),
    click.option("--device-memory", default=None, help="Per-device memory, e.g. 80GB."),
    click.option(
        "--micro-batch", type=WholeNumber(1, MAX_MICRO_BATCH), default=None, help="Micro-batch size per replica."
    ),
    click.option("--seq", type=WholeNumber(1, MAX_SEQ), default=None, help="Sequence length."),
]
_reserve_option = click.option("--reserve", default=DEFAULT_RESERVE, show_default=True, help=RESERVE_HELP)
_engine_option = click.option("--engine", type=click.Choice(ENGINES), default=None, help=ENGINE_HELP)
_node_option = click.option(
    "--node-size",
    type=WholeNumber(1, MAX_DEGREE),
    default=DEFAULT_NODE_SIZE,
    show_default=True,
    help="Devices per node: the hpz modifier's intra-node group (zero3xhpz).",
)
_table_options = [
    click.option("--csv", "as_csv", is_flag=True, help="Print the table as CSV."),
    click.option("--json", "as_json", is_flag=True, help="Print the table as JSON."),
]


def _with(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def wrap(f: Any) -> Any:
        for option in reversed(options):
            f = option(f)
        return f

    return wrap


def _analyze(composition: str, kw: dict[str, Any]) -> Analysis:
    analysis: Analysis = build(
        composition,
        kw["devices"],
        kw["model"],
        kw["params"],
        kw["precision"],
        kw["device_memory"],
        kw["micro_batch"],
        kw["seq"],
        node_size=kw["node_size"],
        reserve=kw["reserve"],
        engine=kw.get("engine"),
    )
    return analysis


# --- compare and sweep ----------------------------------------------------------------------

SUMMARY_COLUMNS = (
    "composition",
    "devices",
    "parameters_bytes",
    "gradients_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "buffers_bytes",
    "total_bytes",
    "peak_bytes",
    "engine",
    "fits",
    "network_bytes",
    "model_state_psi",
    "bubble",
)


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """One row of a JSON report: bytes per device by state, traffic, bubble."""
    per = doc["memory"]["per_device"]
    return {
        "composition": doc["composition"],
        "devices": doc["devices"],
        **{f"{k}_bytes": per[k] for k in ("parameters", "gradients", "optimizer", "activations", "buffers")},
        "total_bytes": per["total"],
        "peak_bytes": doc["memory"].get("peak", per["total"]),  # with the engine's terms (what fits reads)
        "engine": (doc["memory"].get("engine") or {}).get("engine", ""),
        "fits": doc["memory"]["fits"],
        "network_bytes": doc["communication"]["per_device_per_step"],
        "model_state_psi": doc["communication"]["model_state_psi_units"],
        "bubble": doc["pipeline"]["bubble_fraction"],
    }


def chart_format(path: Path) -> str:
    from checker._charts import chart_format as fmt  # matplotlib loads only when a chart is drawn

    return fmt(path)


def _chart_path(chart: str | None) -> tuple[Path, str] | None:
    """``--chart FILE``: its format and a writable destination, checked before any work."""
    if chart is None:
        return None
    fmt = chart_format(Path(chart))
    return output_path(chart, "--chart"), fmt


def _write_chart(path: Path, data: bytes) -> None:
    write_atomic(path, data, "--chart")
    click.echo(f"chart written to {printable(str(path))}", err=True)


@click.command(
    "compare",
    epilog=examples(
        "check-composition compare dp8 zero1 zero2 zero3 fsdp8",
        "check-composition compare tp8xpp8 tp2xzero3xpp4 --model llama2-70b --devices 64 --csv",
        "check-composition compare zero3 fsdp8xdpr8 --chart memory.png",
    ),
)
@click.argument("compositions", nargs=-1, required=True)
@_with([*_model_options, _reserve_option, _engine_option, _node_option, *_table_options])
@click.option("--chart", default=None, help="Write a stacked memory chart (.png or .svg).")
def compare(compositions: tuple[str, ...], chart: str | None, as_csv: bool, as_json: bool, **kw: Any) -> None:
    """Compare COMPOSITIONS side by side, e.g. compare dp8 zero1 zero2 zero3 fsdp8."""
    try:
        if len(compositions) > MAX_COMPARED:
            raise InputError(f"compare: {len(compositions)} compositions (at most {MAX_COMPARED})")
        destination = _chart_path(chart)
        analyses = [_analyze(c, kw) for c in compositions]
        docs = [to_json(a, document=False) for a in analyses]  # the rows read the numbers alone
        rows = [{**summary(d), "composition": typed} for d, typed in zip(docs, compositions, strict=True)]
        shown = [{**r, "composition": readable(a.composition)} for r, a in zip(rows, analyses, strict=True)]
        if destination is not None:
            from checker._charts import memory_chart

            path, fmt = destination
            device_memory = docs[0]["memory"]["device_memory"]
            _write_chart(
                path,
                memory_chart(
                    [r["composition"] for r in rows],
                    [d["memory"]["per_device"] for d in docs],
                    device_memory,
                    f"memory per device, {docs[0]['model']['name']}",
                    fmt,
                ),
            )
    except PlacementError as err:
        _fail(err)
        return
    title = f"compositions on {docs[0]['model']['name']} (GB = 1e9 bytes)"
    emit(rows if as_csv or as_json else shown, SUMMARY_COLUMNS, title, as_csv, as_json, _gb_fmt, SUMMARY_SPECS)


@click.command(
    "sweep",
    epilog=examples(
        "check-composition sweep 'tp{}xzero3' --values 1,2,4,8",
        "check-composition sweep 'tp2xzero3xpp4xm{}' --values 4,8,16,32 --json",
        "check-composition sweep 'zero3xpp{}' --values 1,2,4 --chart sweep.svg",
    ),
)
@click.argument("template")
@click.option("--values", required=True, help="Comma-separated values for {} in TEMPLATE, e.g. 1,2,4,8.")
@_with([*_model_options, _reserve_option, _engine_option, _node_option, *_table_options])
@click.option("--chart", default=None, help="Write memory and traffic against the value (.png or .svg).")
def sweep(template: str, values: str, chart: str | None, as_csv: bool, as_json: bool, **kw: Any) -> None:
    """Vary one degree: sweep 'tp{}xzero3' --values 1,2,4,8 (a value that does not fit the
    devices is reported in its row, not fatal)."""
    try:
        if template.count("{}") != 1:
            raise InputError(f"{template}: put exactly one {{}} where the swept value goes (e.g. tp{{}}xzero3)")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if not items:
            raise InputError(f"--values {values}: expected positive integers separated by commas")
        if len(items) > MAX_COMPARED:
            raise InputError(f"--values {values[:40]}...: {len(items)} values (at most {MAX_COMPARED})")
        numbers = [parse_int(v, "--values") for v in items]
        destination = _chart_path(chart)
        rows: list[dict[str, Any]] = []
        shown: list[dict[str, Any]] = []
        docs: list[tuple[str, dict[str, Any]]] = []
        for n in numbers:
            v = str(n)
            text = template.replace("{}", v)
            try:
                analysis = _analyze(text, kw)
            except InputError as err:
                rows.append({"value": n, "composition": text, "error": str(err)})
                shown.append(rows[-1])
                continue
            doc = to_json(analysis, document=False)
            docs.append((v, doc))
            rows.append({"value": n, **summary(doc), "error": None})
            shown.append({**rows[-1], "composition": readable(analysis.composition)})
        if not docs:
            raise InputError(f"{template}: no value of {values} gives a valid composition ({rows[0]['error']})")
        if destination is not None:
            from checker._charts import sweep_chart

            path, fmt = destination
            first = docs[0][1]
            _write_chart(
                path,
                sweep_chart(
                    [v for v, _ in docs],
                    [d["memory"]["per_device"] for _, d in docs],
                    [d["communication"]["per_device_per_step"] for _, d in docs],
                    first["memory"]["device_memory"],
                    f"{template} on {first['model']['name']}",
                    fmt,
                ),
            )
    except PlacementError as err:
        _fail(err)
        return
    failed = as_csv or as_json or any(r.get("error") for r in rows)  # people see no empty error column
    columns = ("value", *SUMMARY_COLUMNS, *(["error"] if failed else []))
    title = f"sweep {template} (GB = 1e9 bytes)"
    emit(rows if as_csv or as_json else shown, columns, title, as_csv, as_json, _gb_fmt, SUMMARY_SPECS)


# --- explain --------------------------------------------------------------------------------

# ``explain --all`` in a narrow terminal: the exported config keys go first, the names stay.
EXPLAIN_SPECS = {
    "model_state_bytes": Column("model-state bytes"),
    "known_as": Column("known as", keep=3),
    "configs": Column("configs", keep=1),
    "same_placement_as": Column("same placement as", keep=2),
}


def _explain_precisions(as_csv: bool, as_json: bool) -> None:
    """The named precision recipes (``--precision``): bytes per element of each state."""
    from formal._model import PRECISIONS

    rows = [
        {
            "precision": name,
            "P": p.parameters,
            "G": p.gradients,
            "O": p.optimizer,
            "sum": p.parameters + p.gradients + p.optimizer,
            "A": p.activations,
            "what": p.description,
        }
        for name, p in PRECISIONS.items()
    ]
    emit(
        rows,
        ("precision", "P", "G", "O", "sum", "A", "what"),
        "--precision: bytes per element of parameters P, gradients G, optimizer state O "
        "(per parameter: sum) and activations A",
        as_csv,
        as_json,
    )


@click.command(
    "explain",
    epilog=examples(
        "check-composition explain zero2            # its placement and framework names",
        "check-composition explain fsdp --degree 16",
        "check-composition explain --all --csv      # every strategy, one row each",
        "check-composition explain precisions       # what --precision zero, megatron, ... hold",
    ),
)
@click.argument("strategy", required=False)
@click.option("--all", "show_all", is_flag=True, help="The cross-framework table of every strategy.")
@click.option(
    "--degree",
    type=WholeNumber(1, MAX_DEGREE),
    default=8,
    show_default=True,
    help="Degree used to instantiate the strategy.",
)
@_with(_table_options)
def explain(strategy: str | None, show_all: bool, degree: int, as_csv: bool, as_json: bool) -> None:
    """Show a strategy's placement and what each framework calls it (explain zero2, explain --all)."""
    try:
        if degree < 1:
            raise InputError(f"--degree {degree}: must be at least 1")
        if show_all == (strategy is not None):
            raise InputError("give a STRATEGY (e.g. zero2), precisions, or --all")
        if show_all:
            rows = [r.as_json() for r in all_rows(degree)]
            emit(
                rows,
                ("strategy", "axis", "modes", "model_state_bytes", "known_as", "configs", "same_placement_as"),
                f"strategies as placements (degree {degree}; model-state bytes per device, Psi parameters, "
                "2+2+12 bytes)",
                as_csv,
                as_json,
                specs=EXPLAIN_SPECS,
            )
            return
        assert strategy is not None
        name = strategy.strip().lower()
        if name in ("precisions", "precision"):
            _explain_precisions(as_csv, as_json)
            return
        if name == "hpz":  # a modifier: it needs a composition and a node size, which explain has not
            raise InputError(
                "hpz: a modifier of a zero3/fsdp term, not a strategy (check zero3<N>xhpz --node-size K "
                "shows its placement; explain hpz-dpr the across-node axis)"
            )
        if name not in LIBRARY:
            raise InputError(f"{strategy}: unknown strategy (known: {', '.join(sorted(LIBRARY))})")
        row = explain_row(name, degree)
        table = placement_table(name, degree)
        axis = row.axis
        modes = [
            {"state.group": k, axis: cells.get(axis, "R"), "local": cells.get("local", "")}
            for k, cells in table.items()
        ]
        differences: dict[str, dict[str, str]] = {
            other: {k: f"{a} vs {b}" for k, (a, b) in placement_difference(name, other, degree).items()}
            for pair in CONFUSED
            if name in pair
            for other in pair
            if other != name
        }
        confused = [{"versus": other, "differences": diff} for other, diff in differences.items()]
        if as_json:
            click.echo(json.dumps({**row.as_json(), "placement": modes, "confused_with": confused}, indent=2))
            return
        if as_csv:
            emit(modes, ("state.group", axis, "local"), "", True, False)
            return
        console = terminal()
        console.print(f"[bold]{name}[/bold] (axis {axis}): {row.description}")
        console.print(
            f"model-state bytes per device: {row.model_states}  (Psi parameters, d = {axis} degree, "
            "mixed-precision Adam 2+2+12)"
        )
        if row.same_placement_as:
            console.print(f"same placement as: {', '.join(row.same_placement_as)}")
        emit(
            modes,
            ("state.group", axis, "local"),
            f"placement of {readable(Composition((LIBRARY[name]().with_degree(degree),)))} (modes along {axis})",
            False,
            False,
        )
        names = [{"framework": k, "name": v} for k, v in row.known_as.items()]
        names += [{"framework": f"{k} (exported)", "name": v} for k, v in row.configs.items()]
        emit(names, ("framework", "name"), "what frameworks call it", False, False)
        for other, diff in differences.items():
            verdict = "; ".join(f"{k}: {v}" for k, v in diff.items()) if diff else "the same placement"
            console.print(f"{name} vs {other}: {verdict}")
    except PlacementError as err:
        _fail(err)


# --- export ---------------------------------------------------------------------------------


@click.command(
    "export",
    epilog=examples(
        "check-composition export tp2xfsdp8xsp --to torchtitan",
        "check-composition export zero3 --devices 8 --to deepspeed > ds_config.json",
        "check-composition export --from ds_config.json --to megatron",
        "check-composition export tp2xzero3xpp4 --to dtensor --json",
    ),
)
@click.argument("composition", required=False)
@click.option(
    "--to",
    "target",
    type=click.Choice([t.value for t in Target]),
    required=True,
    help="torchtitan TOML, DeepSpeed JSON, Megatron arguments, or DTensor placements.",
)
@click.option("--from", "from_path", default=None, help="Convert a DeepSpeed/torchtitan/Megatron config instead.")
@_with([*_model_options, _node_option])
@click.option("--json", "as_json", is_flag=True, help="dtensor: print JSON instead of a table.")
@click.option("--csv", "as_csv", is_flag=True, help="dtensor: print CSV instead of a table.")
def export_command(
    composition: str | None, target: str, from_path: str | None, as_json: bool, as_csv: bool, **kw: Any
) -> None:
    """Write COMPOSITION (or --from CONFIG) as a framework configuration: export tp2xfsdp8xsp --to torchtitan."""
    try:
        req = request(
            composition,
            kw["devices"],
            kw["model"],
            kw["params"],
            kw["precision"],
            kw["device_memory"],
            kw["micro_batch"],
            kw["seq"],
            node_size=kw["node_size"],
            from_path=from_path,
        )
        if req.imported is not None:
            print_import(req.imported)
        comp, model = req.composition, req.model
        tgt = Target(target)
        if tgt is Target.DTENSOR:
            doc = dtensor_placements(comp.placement(model))
            rows = [
                {"group": g, "state": st, **dict(zip(doc["mesh_dims"], cells, strict=True)), "pp": body.get("pp", "")}
                for g, body in doc["groups"].items()
                for st, cells in body.items()
                if st != "pp"
            ]
            if as_json:
                click.echo(json.dumps(doc, indent=2))
            else:
                emit(
                    rows,
                    ("group", "state", *doc["mesh_dims"], "pp"),
                    f"DTensor placements of {readable(comp)} (mesh {doc['mesh_dims']} = {doc['mesh_shape']})",
                    as_csv,
                    False,
                )
            return
        out = export(comp, model, tgt)
    except PlacementError as err:
        _fail(err)
        return
    click.echo(out.text, nl=not out.text.endswith("\n"))
    for note in out.notes:
        click.echo(f"note: {note}", err=True)
