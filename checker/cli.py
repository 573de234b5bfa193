"""``check-composition``: the command users run.

Exit codes scripts can rely on: 0 valid, 1 invalid, 2 usage or input error, 3 unknown, 4
an internal error (a bug in this tool, never bad input: one ``error: internal error:`` line;
``--debug`` shows the traceback). Nothing a user types or writes in a file gives 4, and a
closed output pipe (``check-composition ... | head``) ends quietly with the verdict's code.
5: ``--simulate`` and z3 disagree (a bug in the tool; both answers are printed first).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import click

from checker._command import (
    DEFAULT_RESERVE,
    ENGINE_HELP,
    ENGINES,
    EXIT_CODES,
    EXIT_INTERNAL,
    EXIT_UNKNOWN,
    EXIT_USAGE,
    EXIT_VALID,
    EXIT_VALIDATION,
    RESERVE_HELP,
    analysis_of,
    fail,
    for_validation,
    outcome,
    print_import,
    request,
    set_outcome,
    verdict_exit,
)
from checker._numbers import MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ, WholeNumber
from checker._output import PipeClosed, output_path, terminal
from checker._parse import DEFAULT_NODE_SIZE, MODIFIERS
from checker._report import CrossCheck, Report, Timed, print_report, what_ifs
from checker._toml import load as load_strategies
from formal._input import printable
from formal._model import PRECISIONS
from formal._presets import DEFAULT_DEVICES, DEFAULT_MODEL
from formal._smt import DEFAULT_QUERY_RLIMIT, DEFAULT_RUN_RLIMIT, DEFAULT_TIMEOUT_MS, decide
from formal._strategies import LIBRARY
from formal.errors import InputError, PlacementError, SolverError

EXAMPLES = (
    """
\b
Examples:
  check-composition tp2xzero3xpp4                  # default model and cluster
  check-composition zero3 --devices 8 --params 7.5e9 --json
  check-composition tp8xpp4xdp2 --model llama2-13b --csv > steps.csv
  check-composition tp4xspxpp2xm8 --model llama2-7b --device-memory 80GB
  check-composition fsdp8xdpr2 --model gpt3-1.3b   # HSDP: shard 8, replicate 2
  check-composition tp3                            # exit 1: divides[heads, tp] (32 heads)
  check-composition zero2-skew4 --strategies examples/broken_optimizer_shards.toml --explain
  check-composition tp2xzero3xpp4 --reserve 8GB    # keep 8 GB back for the runtime
  check-composition tp2xzero3xpp4 --hardware a100-80gb   # and the step time

"""
    + EXIT_CODES
    + """

\b
Composition language: strategy terms with an optional degree joined by 'x'
(a term without a degree takes the devices left over). Modifiers:
"""
    + "\n".join(f"  {k:<15} {v}" for k, v in MODIFIERS.items())
)


# The subcommands beside ``check`` and ``strategies``, each imported when it is named (or when
# ``--help`` lists them): the planner brings numpy, the reports HTML and charts, and the default
# check needs none of them (``tests/test_cli_imports.py`` keeps it so). name -> (module, attribute);
# an attribute that is not a click command is a factory that returns one.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "compare": ("checker._commands_reports", "compare"),
    "explain": ("checker._commands_reports", "explain"),
    "export": ("checker._commands_reports", "export_command"),
    "plan": ("checker._plan_command", "plan_command"),
    "sweep": ("checker._commands_reports", "sweep"),
    "validate": ("checker._steptime_command", "validate_command"),
}


class DefaultGroup(click.Group):
    """A group whose first argument, when not a subcommand, is a composition for ``check``."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            import importlib

            module, attribute = LAZY_COMMANDS[cmd_name]
            found = getattr(importlib.import_module(module), attribute)
            self.add_command(found if isinstance(found, click.Command) else found(), cmd_name)
        return super().get_command(ctx, cmd_name)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        known = args and (args[0] in self.commands or args[0] in LAZY_COMMANDS)
        if args and not known and args[0] not in ("--help", "-h", "--version"):
            args = ["check", *args]
        end = args.index("--") if "--" in args else len(args)
        spelled = {"--explain=all": "--explain-all", "--explain=witness": "--explain"}  # --explain[=all]
        args = [spelled.get(a, a) for a in args[:end]] + args[end:]
        return super().parse_args(ctx, args)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _pipe_guard():  # --help or --version printed into a closed pipe
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        with _pipe_guard():
            return super().invoke(ctx)

    def main(self, args: Any = None, *rest: Any, **kwargs: Any) -> Any:
        """The exit-code contract around every command.

        Click's own usage errors (``--devices abc``, an unknown option) are one ``error:`` line
        and exit code 2, like ours, instead of a usage block. A closed stdout (``| head``) ends
        quietly with the code the command had decided on. Any other exception is a bug of this
        tool: one line and exit code 4, or the traceback under ``--debug`` (accepted anywhere
        before ``--``).
        """
        if kwargs.get("standalone_mode", True) is False:
            return super().main(args, *rest, **kwargs)
        kwargs["standalone_mode"] = False
        argv = list(sys.argv[1:] if args is None else args)
        end = argv.index("--") if "--" in argv else len(argv)
        debug = "--debug" in argv[:end]
        argv = [a for a in argv[:end] if a != "--debug"] + argv[end:]
        set_outcome(EXIT_VALID)
        code: Any = EXIT_VALID
        try:
            try:
                super().main(argv, *rest, **kwargs)
            except SystemExit as done:
                code = done.code
            _flush_stdout()
        except (BrokenPipeError, PipeClosed):
            _quiet_stdout()
            code = outcome()
        except click.UsageError as err:
            fail(err.format_message())
        except click.ClickException as err:
            click.echo(f"error: {printable(err.format_message())}", err=True)
            code = err.exit_code
        except click.Abort:
            click.echo("error: aborted", err=True)
            code = EXIT_USAGE
        except Exception as err:
            if debug:
                raise
            _internal_error(err)
        if args is None and _fast_exit[0]:
            _exit_now(code)
        sys.exit(code)


_fast_exit = [False]  # set by a command whose every output is written when it returns (``check``)


def _exit_now(code: Any) -> None:
    """End the process with ``code`` without the interpreter's teardown, when that is safe.

    Tearing down the modules and objects of a check (sympy's caches, z3's contexts) takes about a
    tenth of a second and does nothing the user can see. ``os._exit`` skips it, after what a normal
    exit would still do: the ``atexit`` callbacks (coverage, multiprocessing's clean-up) and the
    flush of stdout and stderr. Only for the real process (``main()`` with the command line: not
    click's test runner, whose streams are replaced) with no other thread alive, an integer code,
    and no PyTorch loaded (its own teardown is left to the interpreter); otherwise, and whenever
    the flush fails (a closed pipe), ``sys.exit`` as before.
    """
    import atexit
    import threading

    real_streams = sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__
    if not (real_streams and threading.active_count() == 1 and "torch" not in sys.modules):
        return
    if code is not None and not (isinstance(code, int) and not isinstance(code, bool)):
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        _quiet_stdout()
    os._exit(code or 0)


@contextlib.contextmanager
def _pipe_guard() -> Iterator[None]:
    """A closed output pipe as ``PipeClosed``, which click's own handler (exit code 1) lets pass."""
    try:
        yield
    except OSError as err:
        if err.errno != errno.EPIPE:
            raise
        raise PipeClosed() from err


def _flush_stdout() -> None:
    """Flush now, so that a closed pipe is met here rather than at interpreter exit."""
    sys.stdout.flush()


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush cannot fail again (the
    recipe of the Python documentation on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor behind stdout (a test runner)
        pass


def _internal_error(err: BaseException) -> None:
    text = printable(f"{type(err).__name__}: {err}", 300)
    with contextlib.suppress(OSError):
        click.echo(f"error: internal error: {text} (run with --debug for the traceback)", err=True)
    sys.exit(EXIT_INTERNAL)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXAMPLES)
@click.version_option(package_name="placement-semantics")
@click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    help="On an internal error (exit 4), show the traceback instead of one line (anywhere on the line).",
)
def main() -> None:
    """Will this parallelism composition train exactly like one device, how much memory does
    each device hold, and how many bytes cross the network per step?"""


@main.command(epilog=EXAMPLES)
@click.argument("composition", required=False)
@click.option(
    "--devices",
    type=WholeNumber(1, MAX_DEGREE),
    default=None,
    help=f"Device count (default {DEFAULT_DEVICES}, or the product of the degrees).",
)
@click.option("--model", default=None, help=f"Preset name or Hugging Face config.json (default {DEFAULT_MODEL}).")
@click.option("--params", default=None, help="A bare parameter count instead of a model (7.5e9, 70B).")
@click.option(
    "--convention",
    type=click.Choice(["megatron", "deepspeed"]),
    default=None,
    help="Also give the memory as another tool counts it: megatron, Megatron-LM's theoretical "
    "memory footprint with each of its conventions as a named difference; deepspeed, ours as "
    "DeepSpeed's estimators print it (per GPU, per CPU with and without zero.Init; "
    "--node-size devices a node) (docs/semantics.md).",
)
@click.option(
    "--largest-layer",
    default=None,
    help="With --params: the most parameters one module holds (DeepSpeed's largest_layer_params, "
    "e.g. 32.9e6), the unit ZeRO-3 gathers and reduces; without it those buffers are unknown.",
)
@click.option(
    "--precision",
    default="zero",
    show_default=True,
    help="Bytes per element: " + ", ".join(PRECISIONS) + " (explain precisions shows each).",
)
@click.option("--device-memory", default=None, help="Per-device memory, e.g. 80GB (1e9) or 80GiB (2^30).")
@click.option(
    "--micro-batch",
    type=WholeNumber(1, MAX_MICRO_BATCH),
    default=None,
    help="Micro-batch size per replica (Megatron's b).",
)
@click.option("--seq", type=WholeNumber(1, MAX_SEQ), default=None, help="Sequence length.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report (docs/schema.md).")
@click.option(
    "--csv",
    "as_csv",
    is_flag=True,
    help="Print one CSV row per memory quantity, collective and verdict condition (exact bytes).",
)
@click.option(
    "--from",
    "from_path",
    default=None,
    help="Read the composition from a DeepSpeed .json, torchtitan .toml or Megatron arguments file.",
)
@click.option("--report", default=None, help="Also write a self-contained HTML report (chart, collectives, verdict).")
@click.option(
    "--strategies",
    "strategies_path",
    default=None,
    metavar="FILE",
    help="A TOML file of user strategies (and optionally a step program); see examples/.",
)
@click.option("--explain", is_flag=True, help="Every broken rule with its counterexample (witness), first.")
@click.option(
    "--explain-all",
    "explain_all",
    is_flag=True,
    help="(or --explain=all) --explain and the unsat core of every proved obligation (tracked constraint names).",
)
@click.option("--reserve", default=DEFAULT_RESERVE, show_default=True, help=RESERVE_HELP)
@click.option("--engine", type=click.Choice(ENGINES), default=None, help=ENGINE_HELP)
@click.option(
    "--rlimit",
    type=WholeNumber(1, 10**12),
    default=DEFAULT_RUN_RLIMIT,
    show_default=True,
    help="z3 resource units (counted solver steps) for the whole verdict: the deterministic limit, "
    "the same answer on every run; what it cuts short is 'unknown' (exit 3), never valid.",
)
@click.option(
    "--timeout-ms",
    type=WholeNumber(1, 3_600_000),
    default=DEFAULT_TIMEOUT_MS,
    show_default=True,
    help="Wall-clock limit per z3 query, a safety net for a stalled machine (its outcome can vary "
    "between runs); a timeout is 'unknown' (exit 3), never valid.",
)
@click.option(
    "--validate",
    type=click.Choice(["torch", "deepspeed"]),
    default=None,
    help="Also run the composition with PyTorch (torch: fake process group, small model) or with "
    "DeepSpeed (deepspeed: zero1/zero2/zero3 on 2-4 gloo processes; the deepspeed extra) and "
    "print predicted against measured.",
)
@click.option(
    "--node-size",
    type=WholeNumber(1, MAX_DEGREE),
    default=DEFAULT_NODE_SIZE,
    show_default=True,
    help="Devices per node: the hpz modifier's intra-node group (zero3xhpz).",
)
@click.option(
    "--simulate",
    is_flag=True,
    help="Also run the composition on the small reference model over simulated devices beside "
    "single-device training: match, or the first diverging element.",
)
@click.option(
    "--hardware",
    default=None,
    help="Estimate the step time on a GPU preset (v100-32gb, a100-40gb, a100-80gb, h100-80gb, h200, b200) "
    "or a FILE.toml (docs/steptime.md).",
)
def check(
    composition: str | None,
    devices: int | None,
    model: str | None,
    params: str | None,
    precision: str,
    device_memory: str | None,
    micro_batch: int | None,
    seq: int | None,
    as_json: bool,
    from_path: str | None = None,
    report: str | None = None,
    strategies_path: str | None = None,
    explain: bool = False,
    explain_all: bool = False,
    reserve: str = DEFAULT_RESERVE,
    timeout_ms: int = DEFAULT_TIMEOUT_MS,
    validate: str | None = None,
    simulate: bool = False,
    as_csv: bool = False,
    rlimit: int = DEFAULT_RUN_RLIMIT,
    node_size: int = DEFAULT_NODE_SIZE,
    hardware: str | None = None,
    engine: str | None = None,
    largest_layer: str | None = None,
    convention: str | None = None,
) -> None:
    """Check COMPOSITION (e.g. tp2xzero3xpp4) or --from CONFIG: memory, communication and verdict.

    Exit codes: 0 valid, 1 invalid (a rule is broken), 2 usage or input error, 3 unknown, 4 internal error,
    5 z3 and --simulate disagree (a bug in the tool), 6 --validate torch measured what the prediction
    did not (model states, collectives or activations outside the tolerance)."""
    if as_json and as_csv:
        fail("--json and --csv: choose one")
        return
    try:
        report_path = output_path(report, "--report") if report is not None else None
        user = load_strategies(strategies_path) if strategies_path is not None else None
        req = request(
            composition,
            devices,
            model,
            params,
            precision,
            device_memory,
            micro_batch,
            seq,
            strategies=user,
            node_size=node_size,
            from_path=from_path,
            reserve=reserve,
            engine=engine,
            largest_layer=largest_layer,
        )
        if validate == "torch":  # the prediction checked is the one printed: PyTorch's engine
            req = for_validation(req, engine)
        if req.imported is not None:
            print_import(req.imported)
        analysis = analysis_of(req)
        conventional = None
        if convention is not None:
            if as_csv:
                raise InputError(f"--convention {convention}: shown on the screen and in --json, not in --csv")
            from checker._conventions import deepspeed_json, megatron_of

            conventional = megatron_of(analysis) if convention == "megatron" else deepspeed_json(analysis, node_size)
        step = None
        if hardware is not None:
            from checker._steptime_command import time_of

            step = Timed(hardware, time_of(analysis, hardware))
    except InputError as err:
        fail(str(err))
        return
    except PlacementError as err:
        fail(str(err))
        return
    try:
        verdict = decide(
            analysis.composition,
            analysis.program,
            analysis.model,
            timeout_ms=timeout_ms,
            devices=req.devices,
            rlimit=rlimit,
            query_rlimit=min(rlimit, DEFAULT_QUERY_RLIMIT),
        )
    except SolverError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(EXIT_UNKNOWN)
    except InputError as err:  # an op the verdict does not model (a rooted reduce): refused
        fail(str(err))
        return
    validation = None
    if validate is not None:  # PyTorch's own measurements beside the prediction
        if validate == "deepspeed":
            from checker._torch._deepspeed import cli_validation
        else:
            from checker._torch_validate import cli_validation

        try:
            validation = CrossCheck(*cli_validation(analysis.composition))
        except InputError as err:
            fail(str(err))
            return
    simulation = conflict = None
    code = verdict_exit(verdict)
    if validation is not None and not validation.doc.get("ok", False) and code == EXIT_VALID:
        code = EXIT_VALIDATION  # PyTorch's measurement disagrees with the prediction
    if simulate:  # the executable reference beside the verdict; a disagreement is said first
        from checker._simulate import EXIT_DISAGREEMENT, disagreement, disagreement_text, run_simulation

        simulation = CrossCheck(*run_simulation(analysis.composition, user, analysis.model, verdict))
        found = disagreement(verdict, simulation.doc)
        if found is not None:
            conflict = CrossCheck(found, disagreement_text(found))
            code = EXIT_DISAGREEMENT
    hints = what_ifs(analysis) if not (as_json or as_csv) else ()
    if req.strategies is not None and req.strategies.gives_program:
        hints = ()  # a user's step program is not re-derived for another composition
    result = Report(
        analysis,
        verdict,
        explain or explain_all,
        req.imported,
        validation,
        simulation,
        explain_all,
        hints,
        step,
        disagreement=conflict,
    )
    doc = result.as_json() if (report_path is not None or as_json or as_csv) else {}  # not on the screen
    if report_path is not None:
        from checker._html import write_report

        try:
            write_report(doc, report_path)
        except InputError as err:
            fail(str(err))
    set_outcome(code)
    if conventional is not None:
        from checker._conventions import conventions_json, conventions_lines
    if as_json:
        if conventional is not None:
            doc["conventions"] = conventions_json(conventional)
        click.echo(json.dumps(doc, indent=2))
    elif as_csv:
        from checker._commands_reports import CHECK_CSV_COLUMNS, check_csv_rows, emit

        if conflict is not None:
            click.echo(conflict.text, err=True)
        emit(check_csv_rows(doc), CHECK_CSV_COLUMNS, "", True, False)
    else:
        print_report(result, terminal())
        if conventional is not None:
            click.echo("\n".join(["", *conventions_lines(conventional)]))
    _fast_exit[0] = True  # everything is printed or written: no teardown needed (``_exit_now``)
    sys.exit(code)


@main.command(
    "strategies",
    epilog="\b\nExamples:\n  check-composition strategies\n  check-composition strategies | grep zero\n\n" + EXIT_CODES,
)
def list_strategies() -> None:
    """List the strategy library and the modifiers."""
    from checker._output import Column, fitted_table

    rows = []
    for name, make in sorted(LIBRARY.items()):
        s = make()
        rows.append([name, f"axis {s.axis.value}", s.description])
    rows += [[mod, "modifier", text] for mod, text in MODIFIERS.items()]
    console = terminal()
    columns = (Column("name", wrap=False), Column("kind", wrap=False), Column("what it places"))
    console.print(fitted_table("strategies and modifiers", columns, rows, console.width))


if __name__ == "__main__":
    main()
