"""A self-contained HTML report of one JSON report (``to_json``, plus ``verdict`` when present).

One file, no network: the memory chart is an embedded base64 PNG, the report JSON is embedded
for scripts, and every number shown is read from the JSON document.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Iterable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

from formal.errors import InputError, PlacementError

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.proved { color: #176b2c; } .refuted { color: #a11; } .unknown { color: #a60; }
code { background: #f4f4f4; padding: 0 0.2em; }
"""


def _e(x: object) -> str:
    return html.escape(str(x))


class _Html(str):
    """Markup built here from escaped parts (a nested table): put into a cell as it is."""


def _cell(c: object) -> str:
    return str(c) if isinstance(c, _Html) else _e(c)


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]], numeric: Iterable[int] = (), css: str = "") -> str:
    num = set(numeric)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="n">{_cell(c)}</td>' if i in num else f"<td>{_cell(c)}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    klass = f' class="{_e(css)}"' if css else ""
    return f"<table{klass}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _witness(value: object) -> object:
    """A witness (the z3 model's values, ``Violation.witness``) as a person reads it: a mapping as
    a table of its keys and values, a list item by item, nested alike; a scalar as it is."""
    if isinstance(value, dict):
        if not value:
            return "none"
        rows = [(k, _witness(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
        return _Html(_table(["variable", "value"], rows, css="witness"))
    if isinstance(value, list | tuple):
        return _Html("<ul>" + "".join(f"<li>{_cell(_witness(v))}</li>" for v in value) + "</ul>")
    return value


def _readable(doc: dict[str, Any]) -> str:
    """The composition as the CLI echoes it (``checker._parse.readable``: ``tp2 × zero3(dp=8) × pp4``,
    no degree glued to a strategy's digit); the document's own text when it does not parse with
    the built-in strategies (a user's strategy file)."""
    from checker._parse import parse, readable

    text = str(doc["composition"])
    devices = doc.get("devices")
    try:
        return readable(
            parse(text, devices=devices if isinstance(devices, int) and not isinstance(devices, bool) else None)
        )
    except PlacementError:
        return text


def _decimal(exact_text: object) -> str:
    """An exact ratio of the JSON (``2467779/1645121``) as a decimal for the page (``1.5``)."""
    try:
        return f"{float(Fraction(str(exact_text))):.4g}"
    except (ValueError, ZeroDivisionError):
        return str(exact_text)


def _gb(x: int | None) -> str:
    return "unknown" if x is None else f"{x / 1e9:,.2f}"


def _verdict_section(doc: dict[str, Any]) -> str:
    verdict = doc.get("verdict")
    memory = doc["memory"]
    fits = memory.get("fits")
    fit_line = (
        ""
        if fits is None
        else f'<p id="memory-verdict">Memory: <b>{"fits" if fits else "does NOT fit"}</b> in '
        f"{_gb(memory['device_memory'])} GB per device"
        + (f" with {_gb(memory['reserve'])} GB kept in reserve" if memory.get("reserve") else "")
        + ".</p>"
    )
    if not isinstance(verdict, dict):
        return (
            '<section id="verdict"><h2>Verdict</h2><p id="verdict-status">correctness verdict: '
            f"<b>not computed</b> (the report has no verdict)</p>{fit_line}</section>"
        )
    status = str(verdict.get("status", "unknown"))
    parts = [
        '<section id="verdict"><h2>Verdict</h2>',
        f'<p id="verdict-status" class="{_e(status)}">correctness verdict: <b>{_e(status)}</b></p>',
    ]
    conditions = [
        (k.replace("_", " "), verdict[k])
        for k in ("gradient_integrity", "state_consistency", "composition_rules")
        if k in verdict
    ]
    if conditions:
        parts.append(_table(["condition", "status"], conditions))
    violations = verdict.get("violations") or []
    if violations:
        parts.append("<h3>Rules violated</h3>")
        parts.append(
            _table(
                ["rule", "condition", "explanation", "witness"],
                [
                    (
                        v.get("rule"),
                        v.get("condition"),
                        v.get("explanation"),
                        _witness(v.get("witness", {})),
                    )
                    for v in violations
                ],
            )
        )
    unknown = verdict.get("unknown") or []
    if unknown:
        parts.append("<h3>Undecided obligations</h3>")
        parts.append(_table(["obligation", "reason"], [(u.get("obligation"), u.get("reason")) for u in unknown]))
    notes = verdict.get("notes") or []
    if notes:
        parts.append("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    parts.append(fit_line + "</section>")
    return "".join(parts)


_SEGMENTS = (
    ("compute", "compute", "#4e79a7"),
    ("communication", "exposed communication", "#f28e2b"),
    ("bubble", "pipeline bubble", "#bab0ac"),
    ("optimizer_and_host", "optimizer and host", "#59a14f"),
)


def timeline_svg(time: dict[str, Any], width: int = 720) -> str:
    """One bar per pipeline stage, its step split into compute, exposed communication, bubble
    and the optimizer/host tail, to scale (seconds), from the step-time model's ``stages``."""
    stages = time.get("stages") or []
    if not stages:
        return ""
    longest = max(float(st["step"]) for st in stages) or 1.0
    left, bar, gap, top = 70, 22, 10, 24
    scale = (width - left - 10) / longest
    height = top + len(stages) * (bar + gap) + 40
    parts = [
        f'<svg id="step-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="step timeline per pipeline stage">'
    ]
    for i, st in enumerate(stages):
        y = top + i * (bar + gap)
        parts.append(f'<text x="0" y="{y + bar * 0.7:.1f}" font-size="12">{_e(st["stage"])}</text>')
        x = float(left)
        for key, label, colour in _SEGMENTS:
            seconds = max(float(st[key]), 0.0)
            w = seconds * scale
            if w <= 0:
                continue
            parts.append(
                f'<rect class="{key}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="{bar}" fill="{colour}">'
                f"<title>{_e(st['stage'])} {_e(label)}: {seconds:.4g} s</title></rect>"
            )
            x += w
    axis_y = top + len(stages) * (bar + gap)
    parts.append(
        f'<text x="{left}" y="{axis_y + 12}" font-size="11">0 s</text>'
        f'<text x="{width - 10}" y="{axis_y + 12}" font-size="11" text-anchor="end">{longest:.3g} s</text>'
    )
    lx = left
    for _, label, colour in _SEGMENTS:
        parts.append(f'<rect x="{lx}" y="{axis_y + 20}" width="10" height="10" fill="{colour}"/>')
        parts.append(f'<text x="{lx + 14}" y="{axis_y + 29}" font-size="11">{_e(label)}</text>')
        lx += 14 + 7 * len(label) + 16
    parts.append("</svg>")
    return "".join(parts)


def _timeline_section(doc: dict[str, Any]) -> str:
    time = doc.get("time")
    if not isinstance(time, dict) or not time.get("stages"):
        return ""
    return (
        '<section id="timeline"><h2>Step timeline per pipeline stage</h2>'
        f"<p>{_e(time.get('hardware', ''))}: {float(time['step_seconds']):.4g} s per step, MFU "
        f"{float(time['mfu']):.1%} (the step-time model of docs/steptime.md; the slowest stage sets the step)</p>"
        + timeline_svg(time)
        + "</section>"
    )


_STAGE_PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers", "total")


def _stages_section(doc: dict[str, Any]) -> str:
    """Memory per pipeline stage (``memory.per_stage``): a stacked bar per stage and its table;
    nothing without a pipeline (one stage is the memory section itself)."""
    stages = doc["memory"].get("per_stage") or []
    if len(stages) < 2:
        return ""
    from checker._charts import stage_chart

    png = stage_chart(stages, doc["memory"].get("device_memory"), "memory per device on each pipeline stage")
    rows = [(s["stage"], *(_gb(s[k]) for k in _STAGE_PARTS)) for s in stages]
    return (
        '<section id="stages"><h2>Memory per pipeline stage (GB)</h2>'
        '<img id="stage-chart" alt="stacked bar chart of memory per device on each pipeline stage"'
        f' src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
        + _table(["stage", *_STAGE_PARTS], rows, numeric=range(1, len(_STAGE_PARTS) + 1))
        + "</section>"
    )


def render_html(doc: dict[str, Any]) -> str:
    """The HTML page for a JSON report (schema ``placement-semantics/report/1``)."""
    if "memory" not in doc or "communication" not in doc:
        raise InputError("report: not a placement-semantics JSON report (no memory/communication)")
    from checker._charts import memory_chart  # matplotlib loads only when a chart is drawn

    per = doc["memory"]["per_device"]
    png = memory_chart(
        [doc["composition"]],
        [per],
        doc["memory"].get("device_memory"),
        f"memory per device ({doc['memory']['most_loaded_rank']['pipeline_stage']} pipeline stage)",
    )
    stages_html = _stages_section(doc)
    model = doc["model"]
    prec = doc["precision"]
    mem_rows = [
        (k, f"{per[k]:,}" if per[k] is not None else "unknown", _gb(per[k]))
        for k in ("parameters", "gradients", "optimizer", "model_states", "activations", "buffers", "total")
    ]
    engine = doc["memory"].get("engine")
    if isinstance(engine, dict):  # the declared engine's terms, then the peak fits reads
        name = engine["engine"]
        mem_rows += [(f"{t['label']} ({name})", f"{t['bytes']:,}", _gb(t["bytes"])) for t in engine["terms"]]
        mem_rows.append((f"peak with {name}", f"{doc['memory']['peak']:,}", _gb(doc["memory"]["peak"])))
    coll = doc["communication"]["collectives"]
    coll_rows = [
        (
            c["op"],
            c["axis"],
            f"{c['state']}.{c['group']}",
            c["phase"],
            f"{c['elements']:,}",
            f"{c['count']:,}",
            f"{c['bytes']:,}",
            _decimal(c["psi_units"]),
        )
        for c in coll
    ]
    place_rows = [(key, ", ".join(f"{a}={m}" for a, m in cells.items())) for key, cells in doc["placement"].items()]
    imported = doc.get("imported_from")
    imported_html = ""
    if isinstance(imported, dict):
        imported_html = (
            '<section id="imported"><h2>Imported configuration</h2>'
            f"<p>{_e(imported.get('framework'))}: <code>{_e(imported.get('composition'))}</code></p>"
            + "<ul>"
            + "".join(f"<li>{_e(n)}</li>" for n in imported.get("not_mapped", []))
            + "</ul>"
            "</section>"
        )
    data = json.dumps(doc, sort_keys=True).replace("</", "<\\/")
    shown = _readable(doc)
    title = f"{shown} — placement-semantics report"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{_e(shown)}</h1>
<p>Composition text <code>{_e(doc["composition"])}</code>; {_e(doc["devices"])} devices, mesh {
        _e(" x ".join(f"{a}={d}" for a, d in doc["mesh"].items()))
    };
model <b>{_e(model["name"])}</b> ({model["parameters"]:,} parameters); precision {_e(prec["name"])}
({prec["parameters"]}/{prec["gradients"]}/{prec["optimizer"]} bytes per parameter). GB = 1e9 bytes.</p>
{_verdict_section(doc)}
{imported_html}
{_timeline_section(doc)}
<section id="memory"><h2>Memory per device</h2>
<img id="memory-chart" alt="stacked bar chart of per-device memory by state"
 src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">
{_table(["state", "bytes", "GB"], mem_rows, numeric=(1, 2))}
<p>host (offloaded): {doc["memory"]["host"]:,} bytes</p></section>
{stages_html}
<section id="collectives"><h2>Collectives per step ({doc["communication"]["per_device_per_step"]:,} bytes per device;
model states {_e(_decimal(doc["communication"]["model_state_psi_units"]))} Psi)</h2>
{
        _table(
            ["op", "axis", "state.group", "phase", "elements", "count", "bytes", "Psi units"],
            coll_rows,
            numeric=(4, 5, 6),
        )
    }
<p>pipeline bubble fraction: {_e(_decimal(doc["pipeline"]["bubble_fraction"]))}</p></section>
<section id="placement"><h2>Placement</h2>{_table(["state.group", "modes per axis"], place_rows)}</section>
<script type="application/json" id="report-data">{data}</script>
<script>/* record the decoded chart size, so a headless browser can confirm the image rendered */
const chart = document.getElementById("memory-chart");
const mark = () => chart.setAttribute("data-rendered-width", String(chart.naturalWidth));
if (chart.complete) {{ mark(); }} else {{ chart.addEventListener("load", mark); }}
</script>
</body></html>
"""


def write_report(doc: dict[str, Any], path: Path) -> None:
    """The page for ``doc`` at ``path``, all or nothing: a failed write leaves any previous report."""
    from checker._output import write_atomic

    write_atomic(path, render_html(doc), "--report")
