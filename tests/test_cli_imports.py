"""The default check stays cheap to start: importing the CLI loads no subcommand's heavy modules.

``checker/cli.py`` imports the planner (numpy), the reports (HTML, charts), PyTorch and the
config readers only when a command names them; these tests pin that in a fresh interpreter,
since this test process has imported everything already. The subcommands stay reachable
(``--help`` lists them, each one runs), and the check's fast exit keeps its exit codes and output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Modules a default check does not need: the planner and numpy, plots, PyTorch, the simulator,
# the HTML report and the other subcommands, and the DeepSpeed/Megatron/torchtitan readers.
HEAVY = (
    "numpy",
    "matplotlib",
    "torch",
    "checker._planner",
    "checker._plan_command",
    "checker._commands_reports",
    "checker._html",
    "checker._charts",
    "checker._importers",
    "checker._steptime_command",
    "formal._simulator",
    "formal._reference",
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env=env
    )


def _loaded_after(statement: str) -> list[str]:
    probe = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = _python(probe)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_loads_no_subcommand_module() -> None:
    loaded = set(_loaded_after("import checker.cli"))
    assert not [m for m in HEAVY if m in loaded]


def test_the_probe_sees_a_heavy_import() -> None:
    """The check above can fail: naming the planner loads numpy in the same kind of probe."""
    loaded = set(_loaded_after("import checker.cli\ncheck = checker.cli.main.get_command(None, 'plan')"))
    assert {"numpy", "checker._planner"} <= loaded


def test_every_subcommand_is_listed_and_loads() -> None:
    from checker.cli import LAZY_COMMANDS, main

    names = main.list_commands(None)  # type: ignore[arg-type]
    assert set(LAZY_COMMANDS) | {"check", "strategies"} <= set(names)
    for name in LAZY_COMMANDS:
        command = main.get_command(None, name)  # type: ignore[arg-type]
        assert command is not None and command.name == name


def _cli(*args: str, fast: bool = True) -> subprocess.CompletedProcess[str]:
    """``check-composition ARGS`` in a fresh process; ``fast=False``: with the interpreter's own exit."""
    slow = "" if fast else "import checker.cli\ncheck = checker.cli\ncheck._exit_now = lambda code: None\n"
    return _python(
        f"import sys\nsys.argv = ['check-composition', *{list(args)!r}]\n{slow}from checker.cli import main\nmain()"
    )


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("dp2", "--params", "1e9"), 0),
        (("tp3",), 1),
        (("zero4", "--devices", "abc"), 2),
        (("dp2", "--params", "1e9", "--json"), 0),
    ],
)
def test_the_fast_exit_prints_and_exits_as_the_interpreter_does(args: tuple[str, ...], code: int) -> None:
    fast, normal = _cli(*args), _cli(*args, fast=False)
    assert (fast.returncode, normal.returncode) == (code, code), fast.stderr + normal.stderr
    assert (fast.stdout, fast.stderr) == (normal.stdout, normal.stderr)
    assert fast.stdout.endswith("\n") if code != 2 else fast.stderr.startswith("error: ")


def test_the_fast_exit_runs_atexit_callbacks() -> None:
    """The check ends by ``os._exit`` (seen by a spy), after what a normal exit runs at the end
    (``atexit``: coverage's data, multiprocessing's clean-up)."""
    done = _python(
        "import atexit, os, sys\n"
        "real = os._exit\n"
        "def spy(code):\n"
        "    print(f'os._exit({code})', file=sys.stderr, flush=True)\n"
        "    real(code)\n"
        "os._exit = spy\n"
        "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
        "sys.argv = ['check-composition', 'tp3']\n"
        "from checker.cli import main\nmain()"
    )
    assert done.returncode == 1 and done.stderr.endswith("atexit ran\nos._exit(1)\n"), done.stderr


@pytest.mark.parametrize("collecting", [True, False])
def test_the_import_restores_the_garbage_collector(collecting: bool) -> None:
    """The collector paused while the package imports is on again after it (off if it was off)."""
    before = "" if collecting else "gc.disable()\n"
    done = _python(f"import gc\n{before}import checker.cli\nprint(gc.isenabled())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(collecting)]
