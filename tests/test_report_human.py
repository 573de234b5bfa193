"""The terminal report: readable at 100 columns, collectives aggregated, totals unchanged."""

from __future__ import annotations

import io

from rich.console import Console

from checker._analysis import analyze
from checker._parse import parse
from checker._report import aggregate_collectives, print_human, to_json
from formal._model import PRECISIONS
from formal._presets import PRESETS


def test_terminal_report_fits_100_columns_and_aggregates_groups() -> None:
    a = analyze(parse("tp2xzero3xpp4", devices=64), PRESETS["llama2-7b"], PRECISIONS["zero"], 80 * 10**9)
    out = io.StringIO()
    print_human(a, Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100
    collectives = to_json(a)["communication"]["collectives"]
    rows = aggregate_collectives(collectives)
    # per-group JSON entries fold into one row per (op, axis, state, phase), bytes preserved
    assert len(rows) < len(collectives)
    assert sum(r["bytes"] for group in rows.values() for r in group) == sum(c["bytes"] for c in collectives)
    for (op, axis, state, phase), group in rows.items():
        assert all((c["op"], c["axis"], c["state"], c["phase"]) == (op, axis, state, phase) for c in group)
        assert f"{sum(c['bytes'] for c in group):,}" in text
