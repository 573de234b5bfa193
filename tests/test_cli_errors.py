"""Bad input never shows a traceback: one ``error:`` line naming the offending value, exit code 2.

Runs the real CLI in a subprocess. Compares structure (exit code, one line, the offending value
echoed), not prose.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

from checker.cli import main

# (arguments, the offending text the one line must echo)
BAD_INPUTS: list[tuple[list[str], str]] = [
    (["foo8"], "foo8"),  # unknown strategy
    (["zero4"], "zero4"),  # unknown ZeRO stage
    (["tp0xzero3"], "tp0"),  # degree 0
    (["tp99999999"], "tp99999999"),  # absurd degree
    (["tp2xx"], "tp2xx"),  # empty term
    ([""], "empty"),  # empty composition
    (["sp"], "sp"),  # modifiers only
    (["tp2xm4xm8"], "m8"),  # a modifier given twice
    (["tp3xzero3", "--devices", "64"], "64"),  # leftover devices do not divide
    (["tpxzero3"], "tp"),  # two terms without a degree
    (["zero3", "--devices", "0"], "0"),  # degree 0 via --devices
    (["zero3", "--devices", "-3"], "-3"),
    (["zero3", "--devices", "abc"], "abc"),  # malformed number (click's own check)
    (["zero3", "--params", "7.5x9"], "7.5x9"),  # malformed number
    (["zero3", "--params", "1.2.3"], "1.2.3"),
    (["zero3", "--params", "nan"], "nan"),
    (["zero3", "--params", "inf"], "inf"),
    (["zero3", "--params", "-5"], "-5"),  # negative parameter count
    (["zero3", "--params", "0"], "0"),
    (["zero3", "--params", "0.5"], "0.5"),  # not whole
    (["zero3", "--params", "1e30"], "1e30"),  # absurd parameter count
    (["zero3", "--params", "1e999999999"], "1e999999999"),  # used to overflow Decimal
    (["zero3", "--params", "1e-999999999"], "1e-999999999"),
    (["zero3", "--params", "7.5e9", "--device-memory", "80XB"], "80XB"),  # bad --device-memory
    (["zero3", "--params", "7.5e9", "--device-memory", "-1GB"], "-1GB"),
    (["zero3", "--params", "7.5e9", "--device-memory", "abc"], "abc"),
    (["zero3", "--params", "7.5e9", "--device-memory", "0.4"], "0.4"),  # rounds to no memory
    (["zero3", "--params", "7.5e9", "--device-memory", "1e999999999GB"], "1e999999999GB"),
    (["zero3", "--precision", "fp8"], "fp8"),
    (["zero3", "--model", "no-such-model"], "no-such-model"),
    (["zero3", "--params", "7.5e9", "--model", "gpt3-1.3b"], "7.5e9"),  # both
    (["zero3", "--micro-batch", "0"], "0"),
    (["zero3", "--micro-batch", "x"], "x"),
    (["zero3", "--seq", "0"], "0"),
    (["zero3", "--no-such-option"], "--no-such-option"),
]


# A representative set runs as real processes (each pays the ~1 s sympy import); every case also
# runs in-process through click's runner, which would surface a traceback as ``exception``.
IN_SUBPROCESS = {
    "foo8",
    "zero4",
    "tp0xzero3",
    "zero3 --devices abc",
    "zero3 --params 7.5x9",
    "zero3 --params -5",
    "zero3 --params 1e999999999",
    "zero3 --params 7.5e9 --device-memory 80XB",
    "zero3 --no-such-option",
}
IDS = [" ".join(a) or "''" for a, _ in BAD_INPUTS]


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checker.cli", *args], capture_output=True, text=True, check=False, timeout=120
    )


@pytest.fixture(scope="module")
def processes() -> dict[str, subprocess.CompletedProcess[str]]:
    cases = [args for args, _ in BAD_INPUTS if " ".join(args) in IN_SUBPROCESS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return {" ".join(args): proc for args, proc in zip(cases, pool.map(run, cases), strict=True)}


def check_one_line(code: int, stdout: str, stderr: str, offending: str) -> None:
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    assert offending in lines[0]
    assert stdout == ""


@pytest.mark.parametrize(
    ("args", "offending"),
    [c for c in BAD_INPUTS if " ".join(c[0]) in IN_SUBPROCESS],
    ids=[i for i in IDS if i in IN_SUBPROCESS],
)
def test_bad_input_in_a_process(
    args: list[str], offending: str, processes: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    done = processes[" ".join(args)]
    check_one_line(done.returncode, done.stdout, done.stderr, offending)


@pytest.mark.parametrize(("args", "offending"), BAD_INPUTS, ids=IDS)
def test_bad_input_in_process(args: list[str], offending: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    check_one_line(result.exit_code, result.stdout, result.stderr, offending)


def test_a_rule_violation_is_a_verdict_not_an_input_error() -> None:
    """An axis used twice is well formed: the checker answers (exit 1), it does not refuse (2)."""
    done = run(["tp2xtp2", "--json"])
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_good_input_exits_0() -> None:
    done = run(["tp2xzero3xpp4"])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
