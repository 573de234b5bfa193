"""Reports: explain (the cross-framework table), compare, sweep, and the HTML report, which a real
headless Chromium loads to find the chart (decoded) and the verdict."""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from checker._analysis import analyze
from checker._frameworks import model_state_formula, placement_difference, same_placement
from checker._html import render_html
from checker._parse import parse
from checker._report import to_json
from checker.cli import main
from formal._model import DEFAULT_PRECISION
from formal._presets import PRESETS
from formal._verdict import Condition, Obligation, Status, Verdict, Violation

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def _cli(*args: str) -> Ran:
    """The CLI in-process (fast); an unexpected exception fails the test instead of hiding."""
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


# --- explain ------------------------------------------------------------------------------


def test_model_state_formulas_match_semantics_table() -> None:
    """docs/semantics.md, "Costs": DP 16Psi, ZeRO-1 4Psi + 12Psi/N, ZeRO-2 2Psi + 14Psi/N, ZeRO-3 16Psi/N."""
    assert model_state_formula("dp") == "16*Psi"
    assert model_state_formula("zero1") == "4*Psi + 12*Psi/d"
    assert model_state_formula("zero2") == "2*Psi + 14*Psi/d"
    assert model_state_formula("zero3") == "16*Psi/d"


def test_confused_names_are_different_placements() -> None:
    assert same_placement("zero3", "fsdp") and same_placement("distopt", "zero1")
    assert not same_placement("fsdp-sgo", "zero2")
    diff = placement_difference("fsdp-sgo", "zero2")
    assert diff and all(key.startswith("P.") and pair == ("S*+hold", "R") for key, pair in diff.items())


def test_cli_explain_zero2_json_and_all_csv() -> None:
    out = _cli("explain", "zero2", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["modes"] == {"P": "R", "O": "S", "G": "S", "A": "S"}
    assert "stage 2" in doc["known_as"]["DeepSpeed"] and doc["configs"]["deepspeed"] == "zero_optimization.stage=2"
    assert any(c["versus"] == "fsdp-sgo" and c["differences"] for c in doc["confused_with"])
    out = _cli("explain", "--all", "--csv")
    rows = {r["strategy"]: r for r in csv.DictReader(io.StringIO(out.stdout))}
    assert {"dp", "zero1", "zero2", "zero3", "fsdp", "fsdp-sgo", "hsdp", "distopt", "tp", "pp", "cp", "ep"} <= set(rows)
    assert "zero1" in rows["distopt"]["same_placement_as"]
    assert "--use-distributed-optimizer" in rows["zero1"]["configs"]
    assert _cli("explain", "zero4").returncode == 2


# --- compare and sweep --------------------------------------------------------------------


def test_compare_reproduces_abstract_ratios(tmp_path: Path) -> None:
    """Seed abstract: ZeRO-3 holds 8x less model state than DP at N = 8, for 1.5x the traffic."""
    chart = tmp_path / "compare.png"
    out = _cli(
        "compare",
        "dp8",
        "zero1",
        "zero2",
        "zero3",
        "fsdp8",
        "--params",
        "7.5e9",
        "--devices",
        "8",
        "--json",
        "--chart",
        str(chart),
    )
    assert out.returncode == 0, out.stderr
    rows = {r["composition"]: r for r in json.loads(out.stdout)}
    dp, z3 = rows["dp8"], rows["zero3"]
    model_states = {k: sum(r[f"{s}_bytes"] for s in ("parameters", "gradients", "optimizer")) for k, r in rows.items()}
    assert model_states["dp8"] == 8 * model_states["zero3"] == 8 * model_states["fsdp8"]
    assert [rows[k]["model_state_psi"] for k in ("dp8", "zero1", "zero2", "zero3")] == ["2", "2", "2", "3"]
    assert z3["network_bytes"] * 2 == dp["network_bytes"] * 3
    assert chart.read_bytes().startswith(PNG_MAGIC)
    out = _cli("compare", "dp8", "zero3", "--params", "7.5e9", "--devices", "8", "--csv")
    assert [r["composition"] for r in csv.DictReader(io.StringIO(out.stdout))] == ["dp8", "zero3"]


def test_sweep_varies_one_degree(tmp_path: Path) -> None:
    chart = tmp_path / "sweep.svg"
    out = _cli("sweep", "tp{}xzero3", "--values", "1,2,4,8,3", "--devices", "64", "--json", "--chart", str(chart))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    ok = [r for r in rows if r["error"] is None]
    assert [r["value"] for r in ok] == [1, 2, 4, 8]
    activations = [r["activations_bytes"] for r in ok]
    assert activations == sorted(activations, reverse=True) and activations[0] > activations[-1]
    assert "not a multiple" in next(r["error"] for r in rows if r["value"] == 3)
    assert chart.read_text().lstrip().startswith("<?xml")
    assert _cli("sweep", "tpxzero3", "--values", "1,2").returncode == 2


# --- HTML report --------------------------------------------------------------------------


def _doc_with_verdict() -> dict[str, object]:
    analysis = analyze(parse("tp2xzero3xpp4xsp", devices=64), PRESETS["llama2-7b"], DEFAULT_PRECISION, 80 * 10**9)
    doc = to_json(analysis)
    verdict = Verdict(
        obligations=(Obligation("gradient_integrity", Condition.GRADIENT_INTEGRITY, Status.REFUTED),),
        violations=(
            Violation(
                "reduction_closure[G.norm, tp]",
                Condition.GRADIENT_INTEGRITY,
                "G",
                "norm",
                "tp",
                "LayerNorm gradients not reduced across tp under sequence parallelism",
                {"tp": 2},
            ),
        ),
    )
    doc["verdict"] = verdict.as_json()
    return doc


def test_html_report_is_self_contained_and_shows_verdict() -> None:
    page = render_html(_doc_with_verdict())
    assert 'id="memory-chart"' in page and "data:image/png;base64," in page
    assert "reduction_closure[G.norm, tp]" in page and "refuted" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from the network


def test_cli_report_flag_writes_the_page(tmp_path: Path) -> None:
    report = tmp_path / "out.html"
    out = _cli("--from", "examples/configs/deepspeed_zero2.json", "--devices", "32", "--report", str(report))
    assert out.returncode in (0, 1), out.stderr  # 1 when a verdict refutes the composition
    page = report.read_text()
    assert 'id="memory-chart"' in page and 'id="verdict"' in page and 'id="imported"' in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.mark.skipif(_chromium() is None, reason="no Chromium installed (.ci/run installs Debian's chromium)")
def test_headless_chromium_renders_chart_and_verdict(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render_html(_doc_with_verdict()))
    profile = tmp_path / "profile"
    profile.mkdir()
    browser = _chromium()
    assert browser is not None
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60, check=False
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'id="verdict-status"' in html and "refuted" in html
    assert "reduction_closure[G.norm, tp]" in html
    # The inline script ran after the browser decoded the embedded PNG: its natural width is real.
    marker = html.split('data-rendered-width="', 1)
    assert len(marker) == 2, "the chart's render marker is missing"
    assert int(marker[1].split('"', 1)[0]) > 100
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert shot.read_bytes().startswith(PNG_MAGIC)


def test_check_csv_carries_the_report_rows_exactly() -> None:
    """``check --csv``: one row per memory quantity, collective and verdict condition; the
    bytes are the JSON report's exact integers and the collectives add up to the step total."""
    import csv as csv_module
    import io
    import json as json_module

    from click.testing import CliRunner

    from checker.cli import main as cli_main

    runner = CliRunner()
    args = ["check", "tp2xzero3xpp4", "--devices", "64"]
    as_json = json_module.loads(runner.invoke(cli_main, [*args, "--json"]).output)
    out = runner.invoke(cli_main, [*args, "--csv"])
    assert out.exit_code == 0, out.output
    rows = list(csv_module.DictReader(io.StringIO(out.output)))
    memory = {r["name"]: int(r["bytes"]) for r in rows if r["section"] == "memory"}
    assert {k: memory[k] for k in as_json["memory"]["per_device"]} == as_json["memory"]["per_device"]
    collectives = [r for r in rows if r["section"] == "collective"]
    assert len(collectives) == len(as_json["communication"]["collectives"])
    total = next(int(r["bytes"]) for r in rows if r["name"] == "per_device_per_step")
    assert sum(int(r["bytes"]) for r in collectives) == total == as_json["communication"]["per_device_per_step"]
    verdict = {r["name"]: r["detail"] for r in rows if r["section"] == "verdict"}
    assert verdict["status"] == as_json["verdict"]["status"] == "proved"


def test_check_csv_and_json_together_is_a_usage_error() -> None:
    from click.testing import CliRunner

    from checker.cli import main as cli_main

    out = CliRunner().invoke(cli_main, ["check", "dp8", "--csv", "--json"])
    assert out.exit_code == 2
    assert "choose one" in out.output
