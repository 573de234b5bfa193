"""The README cannot go stale: every ``check-composition`` command it shows is run here, and the
figures quoted beside a command are read out of the README's own text and compared with what
the command prints, and, where a paper gives the formula, with that formula too.

The first screen's block is ``tests/test_first_screen.py``'s, the Python example
``tests/test_public_api.py``'s; install, test and proof commands are what CI itself runs.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner

from checker.cli import main
from formal._model import Transformer
from formal._presets import DEFAULT_MODEL, PRESETS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
WRITTEN = (".html", ".png", ".svg")  # output files a command writes: put under the test's tmp_path
# Lines of the README's shell blocks that are not the tool's commands, and who runs them.
NOT_RUN_HERE = {
    "pip install": "the install itself (CI installs the package)",
    "python -m pytest": "the test suite (CI runs it)",
    "python -m proofs": "the proof runner (tests/test_proofs.py runs its obligations)",
}


@dataclass(frozen=True)
class Ran:
    code: int
    output: str  # what the terminal shows: stdout and stderr
    stdout: str


def shell_commands() -> list[str]:
    """The ``check-composition`` command lines of the README's ``bash`` blocks, comments cut off
    (a chain ``a && b && check-composition ...`` gives its last command)."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if not command or command.startswith("#"):
                continue
            last = command.split("&&")[-1].strip()
            if last.startswith("check-composition"):
                out.append(last)
            else:
                assert any(k in command for k in NOT_RUN_HERE), f"README command not accounted for: {command}"
    return out


def inline_commands() -> list[str]:
    """``check-composition ...`` in the README's prose that is a command as written (not a
    template such as ``COMPOSITION``, not PyTorch's validation, which ``-m torch`` tests run)."""
    spans = re.findall(r"`(check-composition [^`]+)`", README)
    return [s for s in spans if not re.search(r"\b[A-Z]{3,}\b", s) and "--validate" not in s]


def comment_of(command: str) -> str:
    """The comment the README writes beside ``command`` in its shell block."""
    for line in README.splitlines():
        if line.startswith(command) and "  #" in line:
            return line.split("  #", 1)[1].strip()
    raise AssertionError(f"no comment beside {command}")


def run(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> Ran:
    """The command in-process from the repository root (its ``examples/`` paths), files it writes
    under ``tmp_path``, in an 80-column terminal."""
    monkeypatch.chdir(ROOT)
    args = [str(tmp_path / a) if a.endswith(WRITTEN) else a for a in shlex.split(command)[1:]]
    result = CliRunner(env={"COLUMNS": "80"}).invoke(main, [*args, *extra])
    assert "Traceback" not in result.output, result.output
    return Ran(result.exit_code, result.output, result.stdout)


def figure(pattern: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in the README's text (which must say it exactly once); a space
    in ``pattern`` matches any run of white space (the prose wraps its lines)."""
    found = re.findall(pattern.replace(" ", r"\s+"), README)
    assert len(found) == 1, (pattern, found)
    return found[0] if isinstance(found[0], tuple) else (found[0],)


def gb(nbytes: int | Fraction, digits: int = 1) -> str:
    return f"{float(nbytes) / 1e9:.{digits}f}"


# --- one check per command ----------------------------------------------------------------------

Check = Callable[[str, Path, pytest.MonkeyPatch], None]


def check_first_screen(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run(command, tmp_path, monkeypatch).code == 0  # its screen: tests/test_first_screen.py


def check_zero3_units(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``# 16/8 bytes per parameter, 3 Psi per step``: the ZeRO paper (Rajbhandari et al. 2020,
    section 5 and 7): ZeRO-3 keeps (2 + 2 + K) Psi / N_d bytes with K = 12, and moves 3 Psi."""
    num, den, psi = re.fullmatch(r"(\d+)/(\d+) bytes per parameter, (\d+) Psi per step", comment_of(command)).groups()  # type: ignore[union-attr]
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 0
    doc = json.loads(ran.stdout)
    params = doc["model"]["parameters"]
    assert params == 7_500_000_000
    per_parameter = Fraction(doc["memory"]["per_device"]["model_states"], params)
    assert per_parameter == Fraction(int(num), int(den)) == Fraction(2 + 2 + 12, doc["devices"])
    assert Fraction(doc["communication"]["model_state_psi_units"]) == int(psi) == 3


def check_tp3(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``# exit 1: divides[heads, tp] (32 heads)``: the default model's 32 heads (Llama 2 7B,
    Touvron et al. 2023, table 1) do not split over 3 devices."""
    code, rule, heads = re.fullmatch(r"exit (\d): (\S+, \S+) \((\d+) heads\)", comment_of(command)).groups()  # type: ignore[union-attr]
    model = PRESETS[DEFAULT_MODEL]
    assert isinstance(model, Transformer) and model.heads == int(heads) == 32 and model.heads % 3
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == int(code) == 1
    assert rule in ran.output


def check_broken_sp(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``# exit 1``: the example program forgets the tp reduction of the norms' gradients under
    sequence parallelism; --explain prints a counterexample."""
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == int(re.fullmatch(r"exit (\d)", comment_of(command)).group(1)) == 1  # type: ignore[union-attr]
    assert "INVALID" in ran.output and "Counterexamples" in ran.output
    assert "single-device training has" in ran.output  # the witness: what one device would hold


def check_plan(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = run(command, tmp_path, monkeypatch, "--json")
    assert ran.code == 0
    doc = json.loads(ran.stdout)
    assert doc["candidates"], doc.keys()


def check_deepspeed_import(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prose beside it: proved, does not fit, N GB per device of which M GB activations at S
    tokens, and with ``recompute`` added to the printed composition R GB."""
    total, acts, name, seq, recomputed = figure(
        r"Here the verdict is `proved` but the memory does not fit: (\d+) GB per device, (\d+) GB of it "
        r"(Llama-3 8B) activations at (\d+) tokens; adding `recompute` to the printed composition brings it to "
        r"([\d.]+) GB"
    )
    ran = run(command, tmp_path, monkeypatch, "--json")
    assert ran.code == 0
    doc = json.loads(ran.stdout)
    assert doc["verdict"]["status"] == "proved"
    assert doc["memory"]["fits"] is False
    per = doc["memory"]["per_device"]
    assert gb(per["total"], 0) == total and gb(per["activations"], 0) == acts
    assert doc["model"]["name"] == "llama3-8b" and name == "Llama-3 8B" and doc["model"]["seq"] == int(seq)
    printed = doc["composition"]
    again = run(
        f"check-composition {printed}xrecompute --devices 16 --model llama3-8b", tmp_path, monkeypatch, "--json"
    )
    assert gb(json.loads(again.stdout)["memory"]["per_device"]["total"]) == recomputed


def check_html_report(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html") and "memory" in page.lower()


def check_torchtitan_export(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 0
    toml = tomllib.loads(ran.stdout)
    assert toml["parallelism"]["data_parallel_shard_degree"] == 16  # zero3 over the 16 devices
    assert toml["training"]["enable_cpu_offload"] is True


def check_compare(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One cluster size for all five, and the prose's optimizer figures: 12 bytes per parameter
    replicated, 12/N_d with ZeRO-1 (Rajbhandari et al. 2020, section 5.1: P_os)."""
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 0 and (tmp_path / "mem.png").stat().st_size > 0
    rows = json.loads(run(command.replace(" --chart mem.png", ""), tmp_path, monkeypatch, "--json").stdout)
    assert {r["devices"] for r in rows} == {8}
    replicated, sharded = figure(
        r"ZeRO-1\s+cuts the ([\d.]+) GB of optimizer state data parallelism keeps on each device to ([\d.]+) GB"
    )
    psi = PRESETS[DEFAULT_MODEL].parameter_count()
    by_name = {r["composition"]: r for r in rows}
    assert gb(by_name["dp"]["optimizer_bytes"]) == gb(12 * psi) == replicated
    assert gb(by_name["zero1"]["optimizer_bytes"]) == gb(Fraction(12 * psi, 8)) == sharded


def check_sweep(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 0 and (tmp_path / "sweep.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")
    for degree in (1, 2, 4, 8):
        assert f"tp{degree}" in ran.output


def check_broken_clip(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example strategy file counts the replicated norms' squared gradients on every tp rank:
    the global gradient norm's once-only rule is broken (exit 1)."""
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 1
    assert "INVALID" in ran.output and "norm_counts_once" in ran.output


def check_runs(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran = run(command, tmp_path, monkeypatch)
    assert ran.code == 0 and ran.output.strip()


CHECKS: dict[str, Check] = {
    "check-composition tp2xzero3xpp4": check_first_screen,
    "check-composition zero3 --devices 8 --params 7.5e9 --json": check_zero3_units,
    "check-composition tp3": check_tp3,
    "check-composition tp2xspxdp2 --model gpt3-1.3b --strategies examples/broken_sp_layernorm.toml --explain": (
        check_broken_sp
    ),
    "check-composition plan --model llama3-70b --devices 512 --device-memory 80GB": check_plan,
    "check-composition --from examples/configs/deepspeed_zero3_offload.json --devices 16 --model llama3-8b": (
        check_deepspeed_import
    ),
    "check-composition --from examples/configs/deepspeed_zero3_offload.json --devices 16 --model llama3-8b "
    "--report report.html": check_html_report,
    "check-composition export --from examples/configs/deepspeed_zero3_offload.json --devices 16 --to torchtitan": (
        check_torchtitan_export
    ),
    "check-composition compare dp zero1 zero2 zero3 fsdp --devices 8 --chart mem.png": check_compare,
    "check-composition sweep 'tp{}xzero3' --values 1,2,4,8 --chart sweep.svg": check_sweep,
    "check-composition tp2xdp2xclip --strategies examples/broken_clip_tp_duplicates.toml": check_broken_clip,
    "check-composition strategies": check_runs,
    "check-composition explain zero2": check_runs,
}
SLOW = {"check-composition plan --model llama3-70b --devices 512 --device-memory 80GB"}  # the planner's search


def test_every_readme_command_is_checked_and_every_check_is_in_the_readme() -> None:
    shown = shell_commands() + inline_commands()
    assert len(shown) >= 10
    assert set(shown) == set(CHECKS), set(shown) ^ set(CHECKS)


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CHECKS])
def test_readme_command(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    CHECKS[command](command, tmp_path, monkeypatch)
