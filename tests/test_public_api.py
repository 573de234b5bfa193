"""The public APIs: ``formal``'s and ``checker``'s are what their ``__all__`` list, every listed
name exists and comes from its one home, and the README's Python example runs and prints what
the ZeRO paper says."""

from __future__ import annotations

import contextlib
import io
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

import checker
import formal
from checker._analysis import analyze
from checker._parse import parse
from checker._simulate import run_simulation
from checker.cli import main
from formal._simulator import SimulationResult
from formal._smt import decide

PUBLIC = {
    "Axis",
    "Composition",
    "CompositionError",
    "Condition",
    "InexactError",
    "DEFAULT_DEVICES",
    "DEFAULT_DEVICE_MEMORY",
    "DEFAULT_MODEL",
    "DEFAULT_PRECISION",
    "Entry",
    "Ffn",
    "Group",
    "InputError",
    "LIBRARY",
    "Memory",
    "Mode",
    "Model",
    "ModelError",
    "Norm",
    "Obligation",
    "Op",
    "OpKind",
    "Options",
    "Origin",
    "PRECISIONS",
    "PRESETS",
    "ParameterCount",
    "Phase",
    "Placement",
    "PlacementError",
    "Precision",
    "Recompute",
    "Reduce",
    "Schedule",
    "SimulationError",
    "SolverError",
    "State",
    "Status",
    "StepProgram",
    "Strategy",
    "StrategyFileError",
    "Traffic",
    "Transformer",
    "Verdict",
    "Violation",
    "bubble_fraction",
    "communication",
    "decide",
    "derive_program",
    "gradient_origins",
    "group_sizes",
    "in_flight_micro_batches",
    "megatron_parameter_count",
    "memory",
    "most_loaded",
    "total_bytes",
    "transfers",
}


def test_public_api_is_pinned() -> None:
    assert set(formal.__all__) == PUBLIC
    assert len(formal.__all__) == len(PUBLIC)  # no name listed twice


def test_every_public_name_resolves() -> None:
    for name in formal.__all__:
        assert getattr(formal, name) is not None, name


# --- checker: the public entry (formal never imports the composition language) ---------------

CHECKER_PUBLIC = {
    "analyze",
    "decide",
    "load_config",
    "load_strategies",
    "parse",
    "reference_model",
    "simulate",
    "DEFAULT_DEVICES",
    "DEFAULT_DEVICE_MEMORY",
    "DEFAULT_MODEL",
    "DEFAULT_PRECISION",
    "LIBRARY",
    "MODIFIERS",
    "PRECISIONS",
    "PRESETS",
    "Analysis",
    "Axis",
    "Composition",
    "Condition",
    "Divergence",
    "Entry",
    "Group",
    "Imported",
    "Memory",
    "Mode",
    "Model",
    "Obligation",
    "Op",
    "Options",
    "ParameterCount",
    "Placement",
    "Precision",
    "Recompute",
    "ReferenceModel",
    "Report",
    "Schedule",
    "SimulationResult",
    "State",
    "Status",
    "StepProgram",
    "Strategy",
    "StrategyFile",
    "Traffic",
    "Transformer",
    "Unmapped",
    "Verdict",
    "Violation",
    "CompositionError",
    "InexactError",
    "InputError",
    "ModelError",
    "PlacementError",
    "SimulationError",
    "SolverError",
    "StrategyFileError",
}
README = Path(__file__).resolve().parents[1] / "README.md"


def test_checker_public_api_is_pinned() -> None:
    assert set(checker.__all__) == CHECKER_PUBLIC
    assert len(checker.__all__) == len(CHECKER_PUBLIC)
    for name in checker.__all__:
        assert getattr(checker, name) is not None, name
    assert not hasattr(checker, "no_such_name")


def test_checker_reexports_each_name_from_its_one_home() -> None:
    """No second definition: the names formal also exports are formal's own objects, the entry
    points are the ones the CLI runs."""
    for name in set(checker.__all__) & set(formal.__all__):
        assert getattr(checker, name) is getattr(formal, name), name
    assert checker.parse is parse and checker.analyze is analyze and checker.decide is decide
    assert checker.SimulationResult is SimulationResult


def test_a_config_in_a_report_out_through_the_public_api() -> None:
    """``load_config`` gives a ``Composition`` (the one the parser reads from its text) and what it
    could not map; ``Report`` of its analysis and verdict is the CLI's JSON document."""
    root = Path(__file__).resolve().parents[1]
    imported = checker.load_config(root / "examples" / "configs" / "deepspeed_zero2.json", devices=None)
    assert imported.composition == checker.parse("zero232xm2xclip")  # 256 = micro 4 x gas 2 x dp 32
    assert all(isinstance(u, checker.Unmapped) and u.setting and u.why for u in imported.unmapped)
    model = checker.PRESETS["gpt3-1.3b"]
    analysis = checker.analyze(imported.composition, model)
    verdict = checker.decide(imported.composition, analysis.program, model)
    doc = checker.Report(analysis, verdict, imported=imported).as_json()
    assert doc["composition"] == "zero232xm2xclip" and doc["verdict"]["status"] == "proved"
    assert doc["imported_from"]["unmapped"] == [u.as_json() for u in imported.unmapped]


def _readme_example() -> str:
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks: list[str] = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the Python API section has one example"
    return blocks[0]


def test_the_readme_example_prints_the_zero_papers_figures() -> None:
    """Rajbhandari et al., ZeRO (SC'20): with mixed-precision Adam (K = 12) a model holds
    (2 + 2 + K) Psi = 16 Psi bytes of model states, and P_os+g+p divides all of it by N_d
    (section 5, Figure 1): 16/8 = 2 bytes per parameter on 8 devices; its communication is
    3 Psi per step, 1.5x data parallelism's 2 Psi (section 7.2.2). ZeRO-3 is exact data
    parallelism: proved, and bit for bit equal to one device."""
    code = _readme_example()
    assert len(code.strip().splitlines()) <= 12
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})  # the README's own text, nothing else
    lines = out.getvalue().split()
    assert len(lines) == 4, lines
    assert Fraction(lines[0]) == Fraction(16, 8)
    assert Fraction(lines[1]) == 3 and Fraction(lines[1]) / 2 == Fraction(3, 2)
    assert lines[2] == "PROVED"
    assert lines[3] == "True"


def test_simulate_is_the_clis_simulation() -> None:
    """``checker.simulate`` is what ``--simulate`` runs: the same result, field for field."""
    composition = parse("tp2xzero12")
    result = checker.simulate(composition)
    assert isinstance(result, SimulationResult) and result.matches and result.devices == 4
    doc, _ = run_simulation(composition)
    cli = CliRunner().invoke(main, ["tp2xzero12", "--simulate", "--json"])
    assert cli.exit_code == 0, cli.output
    from_cli = json.loads(cli.stdout)["simulation"]
    for key, value in result.as_json().items():
        assert doc[key] == value == from_cli[key], key


def test_simulate_refuses_what_it_does_not_model() -> None:
    with pytest.raises(checker.SimulationError, match="at most"):
        checker.simulate(parse("dp256"))
    assert run_simulation(parse("dp256"))[0]["matches"] is None
