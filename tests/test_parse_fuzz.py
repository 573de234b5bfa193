"""hypothesis fuzzes the composition parser and the strategy-file loader with arbitrary text.

Whatever the text: no traceback; a composition either parses or is one ``error:`` line and exit
2 (a well-formed composition that breaks a rule is exit 1, a verdict, not an input error).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from strategies import composition_texts, strategy_files

from checker._parse import parse
from checker._toml import StrategyFile, loads
from checker.cli import main
from formal.errors import CompositionError, StrategyFileError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_error_line(stderr: str) -> bool:
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("error: ")


@FUZZ
@given(composition_texts())
def test_parser_is_total(text: str) -> None:
    try:
        composition = parse(text, devices=64)
    except CompositionError as err:
        assert str(err)  # the CLI escapes control characters the message echoes (one line)
        assert isinstance(err, ValueError)
    else:
        assert parse(str(composition), devices=64) == composition


@FUZZ
@given(strategy_files())
def test_loader_is_total(text: str) -> None:
    try:
        loaded = loads(text, "fuzz.toml")
    except StrategyFileError as err:
        assert "\n" not in str(err) and str(err).startswith("fuzz.toml")
        assert isinstance(err, ValueError)
    else:
        assert isinstance(loaded, StrategyFile)
        assert loaded.strategies or loaded.program is not None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(composition_texts())
def test_cli_on_arbitrary_compositions(text: str) -> None:
    result = CliRunner().invoke(main, ["check", text, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (0, 1, 2, 3)
    if result.exit_code == 2:
        assert one_error_line(result.stderr) and result.stdout == ""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategy_files())
def test_cli_on_arbitrary_strategy_files(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "user.toml"
        path.write_text(text, encoding="utf-8")
        result = CliRunner().invoke(main, ["check", "dp2", "--strategies", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (0, 1, 2, 3)
    if result.exit_code == 2:
        assert one_error_line(result.stderr)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[strategies.mine]\naxis='dp'\nP='Q'\n", "strategies.mine.P: 'Q' is not a mode"),
        ("[strategies.mine]\naxis='qq'\nP='R'\n", "strategies.mine.axis: 'qq' is not an axis"),
        ("[strategies.mix]\naxis='dp'\nP='R'\n", "without 'x'"),
        ("[strategies.zero1]\naxis='dp'\nP='R'\n", "already a library strategy"),
        ("[strategies.mine]\naxis='dp'\nO='R@1'\n", "@offset applies to sharded states"),
        ("[[program]]\nop='all_reduce'\n", "program[1]: a all_reduce needs axis"),
        ("[[program]]\nop='scale'\naxis='dp'\nscale='zero'\n", "program[1].scale"),
        ("a = [\n", "not valid TOML"),
        ("", "defines no [strategies.NAME], no [[program]] and no [[scalars]]"),
    ],
)
def test_loader_names_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(StrategyFileError) as info:
        loads(text, "user.toml")
    assert fragment in str(info.value)


def test_program_checked_against_the_model_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[[program]]\nop='all_reduce'\ngroup='nonesuch'\naxis='dp'\n")
    result = CliRunner().invoke(main, ["check", "dp2", "--strategies", str(path)])
    assert result.exit_code == 2 and one_error_line(result.stderr) and "nonesuch" in result.stderr
    path.write_text("[[program]]\nop='all_reduce'\naxis='tp'\n")
    result = CliRunner().invoke(main, ["check", "dp2", "--strategies", str(path)])
    assert result.exit_code == 2 and "axis tp is not in this composition" in result.stderr


def test_unreadable_and_binary_files_are_input_errors(tmp_path: Path) -> None:
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    for path in (binary, tmp_path / "missing.toml", tmp_path):
        result = CliRunner().invoke(main, ["check", "dp2", "--strategies", str(path)])
        assert result.exit_code == 2 and one_error_line(result.stderr), result.stderr


def test_a_rule_violation_is_a_verdict_not_an_input_error() -> None:
    for text in ("dp2xzero12", "tp3", "dp8xsp"):
        result = CliRunner().invoke(main, ["check", text, "--json"])
        assert result.exit_code == 1, (text, result.stderr)


def test_unknown_exits_3(z3_gives_up: None) -> None:
    result = CliRunner().invoke(main, ["check", "dp2"])
    assert result.exit_code == 3
    assert "not proved" in result.stdout
