"""``check --simulate``: a disagreement between z3 and the executable reference is never silent, and
a program the simulator cannot run is a typed "not simulated" answer, never a traceback.

The disagreements are constructed in-process: the simulator is handed a real program that differs
from the one z3 judges (a gradient reduction dropped, or the derived program instead of a broken
user program), so both answers are real computations and only their pairing is staged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import formal._simulator as simulator
from checker._parse import parse
from checker._simulate import DISAGREEMENT, EXIT_DISAGREEMENT, reference_model
from checker.cli import main
from formal._model import Transformer
from formal._presets import PRESETS
from formal._program import StepProgram, derive_program
from formal._vocab import OpKind, State

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ("check", "tp2xspxdp2", "--model", "gpt3-1.3b", "--simulate")
BROKEN = str(ROOT / "examples" / "broken_sp_layernorm.toml")  # z3 refutes: G.norm not reduced across tp


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _run_instead(monkeypatch: pytest.MonkeyPatch, change: Callable[[StepProgram], StepProgram]) -> None:
    """The simulator runs ``change(program)`` in place of the program it is given."""
    real = simulator.simulate_program

    def staged(program: StepProgram, model: Any, **kwargs: Any) -> Any:
        return real(change(program), model, **kwargs)

    monkeypatch.setattr(simulator, "simulate_program", staged)


def _drop_gradient_reductions(program: StepProgram) -> StepProgram:
    return program.with_ops(op for op in program.ops if not (op.state is State.GRADIENTS and op.kind.is_reduction))


def _reference_transformer() -> Transformer:
    """The small model ``--simulate`` runs for ``COMMAND`` (shaped like gpt3-1.3b: biases, tied)."""
    model = PRESETS["gpt3-1.3b"]
    assert isinstance(model, Transformer)
    return reference_model(parse("tp2xspxdp2"), model).transformer()


def _derived_instead(program: StepProgram) -> StepProgram:
    return derive_program(program.placement, _reference_transformer())


def test_agreement_keeps_the_verdicts_exit_code() -> None:
    valid = invoke(*COMMAND)
    assert valid.exit_code == 0 and DISAGREEMENT not in valid.output
    assert "simulation: matches" in valid.output
    refuted = invoke(*COMMAND, "--strategies", BROKEN)
    assert refuted.exit_code == 1 and DISAGREEMENT not in refuted.output
    assert "simulation: diverges" in refuted.output


def test_a_proof_the_simulation_contradicts_is_reported_first_and_exits_5(monkeypatch: pytest.MonkeyPatch) -> None:
    _run_instead(monkeypatch, _drop_gradient_reductions)
    human = invoke(*COMMAND)
    assert human.exit_code == EXIT_DISAGREEMENT == 5, human.output
    lines = human.output.splitlines()
    assert lines[0] == f"{DISAGREEMENT} (soundness)"
    assert lines[1].strip() == "z3: proved" and lines[2].strip().startswith("simulation: diverges")
    assert "single device" in lines[2] and "simulated" in lines[2]
    assert "Verdict" in human.output  # the usual report follows
    machine = invoke(*COMMAND, "--json")
    assert machine.exit_code == 5
    doc = json.loads(machine.stdout)
    assert next(iter(doc)) == "disagreement"  # the first key
    conflict = doc["disagreement"]
    assert conflict["message"] == DISAGREEMENT and conflict["kind"] == "soundness"
    assert conflict["z3"] == doc["verdict"]["status"] == "proved"
    assert doc["simulation"]["matches"] is False and conflict["divergence"] == doc["simulation"]["divergence"]
    assert conflict["exit_code"] == 5


def test_a_refutation_the_simulation_contradicts_on_three_seeds_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """z3 judges the broken user program; the simulator is handed the derived one, which matches."""
    _run_instead(monkeypatch, _derived_instead)
    result = invoke(*COMMAND, "--strategies", BROKEN, "--json")
    assert result.exit_code == 5, result.output
    doc = json.loads(result.stdout)
    conflict = doc["disagreement"]
    assert conflict["kind"] == "completeness" and conflict["z3"] == "refuted"
    assert any("norm" in rule for rule in conflict["rules"])
    assert doc["simulation"]["matches"] is True and doc["simulation"]["fresh_seeds_match"] is True


def test_a_refutation_a_fresh_seed_confirms_is_no_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    """A match on the first seed only (an accident of the field) is not taken as a disagreement."""
    real = simulator.simulate_program

    def staged(program: StepProgram, model: Any, **kwargs: Any) -> Any:
        if kwargs.get("seed", 0) == 0:
            program = _derived_instead(program)
        return real(program, model, **kwargs)

    monkeypatch.setattr(simulator, "simulate_program", staged)
    result = invoke(*COMMAND, "--strategies", BROKEN, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert "disagreement" not in doc and doc["simulation"]["fresh_seeds_match"] is False


def test_exit_code_5_is_documented_where_the_others_are() -> None:
    assert "5 z3 and --simulate disagree" in " ".join(invoke("check", "--help").stdout.split())
    for doc in ("README.md", "docs/schema.md"):
        assert "5" in (ROOT / doc).read_text() and "disagree" in (ROOT / doc).read_text(), doc


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("check", "dp256"), "256 devices: the simulator runs at most 128"),
        (("check", "dp2", "--params", "1e9"), ""),
    ],
)
def test_what_cannot_be_simulated_is_said_in_one_line(args: tuple[str, ...], reason: str) -> None:
    result = invoke(*args, "--simulate", "--json")
    assert result.exit_code in (0, 1, 3), result.output
    simulation = json.loads(result.stdout)["simulation"]
    if reason:
        assert simulation["matches"] is None and reason in simulation["not_run"]
    human = invoke(*args, "--simulate")
    assert "Traceback" not in human.output
    if reason:
        assert f"simulation: not simulated: {reason}" in human.output


def test_a_user_program_naming_a_group_the_reference_model_lacks_is_not_simulated(tmp_path: Path) -> None:
    """The reference model has no learned position embedding (gpt3-1.3b has one)."""
    program = tmp_path / "p.toml"
    program.write_text('[[program]]\nop = "all_reduce"\nstate = "G"\ngroup = "position"\naxis = "dp"\n')
    result = invoke("check", "dp2", "--model", "gpt3-1.3b", "--strategies", str(program), "--simulate")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1 and "Traceback" not in result.output  # z3 refutes the program
    line = next(x for x in result.output.splitlines() if x.startswith("simulation:"))
    assert line.startswith("simulation: not simulated: the user program does not fit the reference model")
    assert "position" in line


@pytest.mark.parametrize("group", ["row_bias", "experts", "router"])
def test_a_user_program_naming_any_group_of_the_users_model_is_simulated(tmp_path: Path, group: str) -> None:
    """The reference model has the user model's groups (biases, router, experts), so a user program
    naming them runs; it used to end in an internal error."""
    program = tmp_path / "p.toml"
    program.write_text(
        f'[[program]]\nop = "all_reduce"\nstate = "G"\ngroup = "{group}"\naxis = "dp"\nreduce = "mean"\n'
    )
    model = "gpt3-1.3b" if group == "row_bias" else "mixtral-8x7b"
    result = invoke("check", "dp2", "--model", model, "--strategies", str(program), "--simulate", "--json")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    doc = json.loads(result.stdout)
    assert doc["simulation"]["matches"] is False  # only one group reduced: the others diverge
    assert doc["verdict"]["status"] == "refuted" and "disagreement" not in doc
    assert result.exit_code == 1


def test_only_the_gradient_reductions_matter_to_the_staged_soundness_case() -> None:
    """The staging helper really removes reductions (else the soundness test could not fail)."""
    transformer = _reference_transformer()
    program = derive_program(parse("tp2xspxdp2").placement(transformer), transformer)
    dropped = _drop_gradient_reductions(program)
    assert any(op.kind.is_reduction and op.state is State.GRADIENTS for op in program.ops)
    assert not any(op.kind is OpKind.ALL_REDUCE and op.state is State.GRADIENTS for op in dropped.ops)


def test_a_real_disagreement_class_is_never_silent(tmp_path: Path) -> None:
    """Unstaged: experts replicated along ep but computed split there diverge in the simulator (a
    rank reads zeros for the other ranks' experts). Whatever z3 answers, the exit code and the
    report's first line follow from the pair of answers: proved and diverging is exit 5, said first."""
    strategy = tmp_path / "ep.toml"
    strategy.write_text('[strategies.ep-rep]\naxis = "ep"\nP = "R"\nO = "R"\nG = "R"\ncompute_sharded = ["experts"]\n')
    args = ("check", "ep-rep2", "--model", "mixtral-8x7b", "--strategies", str(strategy), "--simulate")
    doc = json.loads(invoke(*args, "--json").stdout)
    assert doc["simulation"]["matches"] is False
    human = invoke(*args)
    if doc["verdict"]["status"] == "proved":
        assert human.exit_code == 5 and human.output.startswith(f"{DISAGREEMENT} (soundness)")
        assert doc["disagreement"]["kind"] == "soundness"
    else:
        assert human.exit_code == 1 and DISAGREEMENT not in human.output and "disagreement" not in doc
