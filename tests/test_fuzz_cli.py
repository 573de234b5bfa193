"""Fuzzing the command line in-process with hostile input (strategies in tests/strategies_fuzz.py).

Whatever the command line and whatever the files it names: the exit code is one of 0 valid,
1 invalid, 2 usage or input error, 3 unknown (never 4, an internal error, and never an escaped
exception); no traceback and no control character (an ANSI escape, a carriage return) reaches
the output; an input error is exactly one ``error:`` line, last on stderr; and an output file
is either complete or as it was before (no half-written file, no temporary file left behind).

Budgets scale with the active hypothesis profile: at least 2,000 cases in all under ``ci`` (the
default), at least 50,000 under ``thorough``. Each test reports its count and time at the end
of the run.
"""

from __future__ import annotations

import errno
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_fuzz import (
    Case,
    deepspeed_configs,
    hf_configs,
    hostile_argvs,
    megatron_scripts,
    output_cases,
    strategies_files,
    torchtitan_configs,
)

from checker.cli import main
from formal.errors import InputError

# Cases per test, as multiples of the profile's max_examples (ci 100, thorough 2,000).
SHARES: dict[str, int] = {
    "argvs": 9,
    "deepspeed": 3,
    "torchtitan": 3,
    "megatron": 3,
    "hf": 3,
    "strategies": 3,
    "outputs": 1,
}
TOTAL_CI, TOTAL_THOROUGH = 2_000, 50_000
# Control characters that must never reach the terminal (newline and tab are layout).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_TEMPORARY = re.compile(r"^\..*\.tmp$")


def budget(name: str) -> int:
    return SHARES[name] * settings().max_examples


def _complete(argv: list[str], name: str, data: bytes) -> bool:
    """An output file as the tool writes it whole (the option that asked for it says its kind)."""
    if "--report" in argv:
        return data.endswith(b"</html>\n")
    if "--csv" in argv:
        return data.startswith(b"position,composition") and data.endswith(b"\n")
    if name.lower().endswith(".svg"):
        return data.rstrip().endswith(b"</svg>")
    return data.startswith(b"\x89PNG") and data.endswith(b"IEND\xaeB`\x82")


def _disk_full(*_: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def run_case(case: Case) -> Result:
    """Run one case in a fresh directory and check every property; returns click's result."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in case.files:
            path = Path(tmp, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        argv = [a.replace("{dir}", tmp) for a in case.argv]
        # color=True: click would otherwise strip ANSI escapes because the runner is no terminal,
        # hiding from this check what a terminal would receive.
        if case.disk_full:
            with mock.patch("os.fsync", _disk_full):
                result = CliRunner().invoke(main, argv, color=True)
        else:
            result = CliRunner().invoke(main, argv, color=True)
        shown = f"argv={argv!r}\nexit={result.exit_code}\nstdout={result.stdout[-2000:]!r}\nstderr={result.stderr!r}"
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            f"{shown}\nexception={result.exception!r}"
        )
        assert result.exit_code in (0, 1, 2, 3), shown
        output = result.stdout + result.stderr
        assert "Traceback" not in output, shown
        assert not _CONTROL.search(output), shown
        if result.exit_code == 2:
            errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and result.stderr.rstrip("\n").splitlines()[-1] == errors[0], shown
        left = [str(p.relative_to(tmp)) for p in Path(tmp).rglob("*") if _TEMPORARY.match(p.name)]
        assert not left, f"{shown}\ntemporary files left: {left}"
        for name, old in case.outputs:
            path = Path(tmp, name)
            now = path.read_bytes() if path.is_file() else None
            if result.exit_code == 2:
                assert now == old, f"{shown}\n{name} changed by a failed command"
            elif now is not None and now != old:
                assert _complete(argv, name, now), f"{shown}\n{name} half-written ({len(now)} bytes)"
    return result


def fuzz(name: str, cases: st.SearchStrategy[Case], summary_lines: list[str]) -> None:
    """Run ``budget(name)`` cases of ``cases``; record the count, the exit codes and the time."""
    codes: Counter[int] = Counter()

    @settings(max_examples=budget(name))
    @given(cases)
    def one(case: Case) -> None:
        codes[run_case(case).exit_code] += 1

    start = time.perf_counter()
    one()
    seconds = time.perf_counter() - start
    count = sum(codes.values())
    summary_lines.append(
        f"fuzz {name}: {count:,} cases in {seconds:.1f} s (exit codes "
        + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items()))
        + ")"
    )
    assert count >= budget(name)


FUZZ_TESTS: dict[str, Callable[[], st.SearchStrategy[Case]]] = {
    "argvs": hostile_argvs,
    "deepspeed": deepspeed_configs,
    "torchtitan": torchtitan_configs,
    "megatron": megatron_scripts,
    "hf": hf_configs,
    "strategies": strategies_files,
    "outputs": output_cases,
}


@pytest.mark.parametrize("name", list(FUZZ_TESTS))
def test_hostile_input_never_breaks_the_contract(name: str, summary_lines: list[str]) -> None:
    fuzz(name, FUZZ_TESTS[name](), summary_lines)


def test_the_budget_meets_the_profile() -> None:
    """The shares add up to the required totals: 2,000 cases under ci, 50,000 under thorough."""
    per_example = sum(SHARES.values())
    assert per_example * 100 >= TOTAL_CI
    assert per_example * 2_000 >= TOTAL_THOROUGH


# --- the harness itself can fail ------------------------------------------------------------


def test_the_harness_catches_a_half_written_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that truncates in place (as the tool once did) is caught by ``run_case``."""
    import checker._output as output

    def truncating(path: Path, data: str | bytes, option: str) -> None:
        payload = data.encode() if isinstance(data, str) else data
        path.write_bytes(payload[: len(payload) // 2])

    monkeypatch.setattr(output, "write_atomic", truncating)
    case = Case(("dp2", "--params", "1e9", "--report", "{dir}/r.html"), outputs=(("r.html", None),))
    with pytest.raises(AssertionError, match="half-written"):
        run_case(case)


def test_the_harness_catches_an_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import checker._command as command  # where the subcommands build their analysis

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("bug")

    monkeypatch.setattr(command, "analyze", broken)
    with pytest.raises(AssertionError, match="exit=4"):
        run_case(Case(("dp2", "--params", "1e9")))


def test_the_harness_catches_a_control_character(monkeypatch: pytest.MonkeyPatch) -> None:
    import checker._command as command
    import checker.cli as cli

    for module in (cli, command):  # click's own errors, and the one way to report bad input
        monkeypatch.setattr(module, "printable", lambda text, limit=None: text)
    with pytest.raises(AssertionError):
        run_case(Case(("\x1b[2Jzero4",)))


def test_the_harness_catches_a_temporary_file_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    import checker._output as output

    def leaves_temporary(path: Path, data: str | bytes, option: str) -> None:
        Path(path.parent, f".{path.name}.x.tmp").write_bytes(b"")
        raise InputError(f"{option} {path}: cannot write")

    monkeypatch.setattr(output, "write_atomic", leaves_temporary)
    with pytest.raises(AssertionError, match="temporary files left"):
        run_case(Case(("dp2", "--params", "1e9", "--report", "{dir}/r.html")))
