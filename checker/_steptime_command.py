"""The CLI's step-time pieces: ``check --hardware`` (the ``time`` object, one terminal line) and
``validate --published`` (every published run, predicted against published).

``checker/cli.py`` only calls ``time_of`` and registers ``validate_command``.
"""

from __future__ import annotations

from typing import Any

import click

from checker._analysis import Analysis
from formal._hardware import hardware_of
from formal._steptime import StepTime, calibrated, step_time


def time_of(analysis: Analysis, hardware: str) -> StepTime:
    """The step time of the checked composition on ``hardware`` (a preset or a .toml file);
    an ``InputError`` for a bad file or a model without layers."""
    return step_time(analysis.program, analysis.model, analysis.precision, hardware_of(hardware), calibrated())


def time_json(time: StepTime, hardware: str) -> dict[str, Any]:
    doc = time.as_json()
    doc["hardware"] = hardware
    eff = calibrated()
    doc["constants"] = {
        "gemm_max": eff.gemm_max,
        "gemm_half": eff.gemm_half,
        "network": eff.network,
        "memory": eff.memory,
    }
    return doc


@click.command("validate")
@click.option(
    "--published",
    is_flag=True,
    required=True,
    help="Predict every published run (checker/data/published-throughput.json) and print the errors.",
)
def validate_command(published: bool) -> None:
    """Step-time model against published training runs: in-sample (constants fitted on all runs)
    and leave-one-source-out (fitted without the run's source). Mean and max |error| of each."""
    from checker._published import summary, validation

    eff, fit_rows, held, excluded = validation()
    click.echo(
        f"constants fitted on all runs not left out: gemm_max {eff.gemm_max:.4g}, gemm_half {eff.gemm_half:.4g}, "
        f"network {eff.network:.4g}, memory {eff.memory:.4g}"
    )
    for row in excluded:
        click.echo(f"left out of the fit: {row.run.id}: {row.run.excluded}")
    by_id = {r.run.id: r for r in held}
    click.echo(f"{'run':<34} {'unit':<16} {'published':>10} {'fit':>10} {'err':>7} {'held-out':>10} {'err':>7}")
    for row in [*fit_rows, *excluded]:
        h = by_id.get(row.run.id)
        held_cols = f"{h.predicted:>10.4g} {h.error:>+7.1%}" if h is not None else "  (left out of the fit)"
        click.echo(
            f"{row.run.id:<34} {row.run.unit:<16} {row.run.published:>10.4g} {row.predicted:>10.4g} "
            f"{row.error:>+7.1%} {held_cols}"
        )
    groups = [("fit (in-sample)", fit_rows), ("held-out (leave one source out)", held)]
    if excluded:
        groups.append(("left out of the fit", excluded))
    for name, rows in groups:
        mean, worst = summary(rows)
        click.echo(f"{name}: mean |error| {mean:.1%}, max {worst:.1%} over {len(rows)} runs")
