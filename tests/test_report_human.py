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


def test_full_report_at_80_columns_of_the_rich_console_cuts_no_cell() -> None:
    """``print_report`` through a rich Console 80 wide (no COLUMNS variable): the summary first,
    no line wider than 80, no ellipsis, and the bytes column left out rather than cut."""
    from checker._report import Report, print_report, what_ifs
    from formal._smt import decide

    a = analyze(
        parse("tp2xzero3xpp4", devices=64),
        PRESETS["llama2-7b"],
        PRECISIONS["zero"],
        80 * 10**9,
        reserve=4 * 10**9,
    )
    verdict = decide(a.composition, a.program, a.model, devices=64)
    out = io.StringIO()
    print_report(Report(a, verdict, hints=what_ifs(a)), Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.splitlines()[0].startswith("tp2 × zero3(dp=8) × pp4")
    assert "left out bytes" in text  # the communication table's exact bytes: in --json and --csv
    for group in aggregate_collectives(to_json(a)["communication"]["collectives"]).values():
        assert f"{sum(c['bytes'] for c in group) / 1e9:,.2f}" in text
