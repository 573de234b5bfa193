"""What every subcommand of ``check-composition`` shares: the exit-code contract, the one way
to report bad input, and building an analysis from the command line's words. The subcommands
(``checker/cli.py``, ``checker/_commands_reports.py``, ``checker/_plan_command.py``) import it; it
imports none of them.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path

import click

from checker._analysis import Analysis, analyze
from checker._numbers import MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ, parse_bytes, parse_count
from checker._parse import DEFAULT_NODE_SIZE, parse
from checker._toml import StrategyFile
from formal._hf import load_hf_config
from formal._input import printable
from formal._model import PRECISIONS, Model, ParameterCount, Transformer
from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES, DEFAULT_MODEL, PRESETS
from formal._strategies import Composition
from formal._verdict import Status, Verdict
from formal.errors import InputError

EXIT_VALID, EXIT_INVALID, EXIT_USAGE, EXIT_UNKNOWN, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_CODES = (
    "Exit codes: 0 valid, 1 invalid (the rule is named), 2 usage or input error, 3 unknown, "
    "4 internal error (a bug: please report it; --debug shows the traceback), "
    "5 z3 and --simulate disagree (a bug in the tool: both answers are shown first)."
)


_outcome = [EXIT_VALID]  # the exit code a command has decided on, for an output pipe closed while printing


def outcome() -> int:
    """The exit code the running command has decided on (for an output pipe closed while printing)."""
    return _outcome[0]


def set_outcome(code: int) -> None:
    """Record the command's exit code before it prints its answer (see ``DefaultGroup.main``)."""
    _outcome[0] = code


def fail(message: str) -> None:
    """One clear line on stderr and exit code 2: the CLI's only way to report bad input."""
    # The message may echo the user's own text: control characters (\r, \n, ESC, ...) are shown
    # as escapes, so that it stays one line and cannot drive the terminal.
    with contextlib.suppress(OSError):  # a closed stderr must not turn bad input into another code
        click.echo(f"error: {printable(message)}", err=True)
    sys.exit(EXIT_USAGE)


def load_model(model: str | None, params: str | None, micro_batch: int | None, seq: int | None) -> Model:
    if params is not None and model is not None:
        raise InputError(f"--params {params} and --model {model}: give one, not both")
    chosen: Model
    if params is not None:
        chosen = ParameterCount(parse_count(params), name=f"{params.strip()} parameters")
    else:
        if model is not None and not model.strip():
            raise InputError(f"--model {model!r}: empty (give a preset name or a config.json)")
        name = model or DEFAULT_MODEL
        if name in PRESETS:
            chosen = PRESETS[name]
        elif name.endswith(".json"):
            chosen = load_hf_config(Path(name))
        else:
            raise InputError(
                f"--model {name}: unknown model (presets: {', '.join(sorted(PRESETS))}; or a Hugging Face config.json)"
            )
    if micro_batch is not None:
        if not 1 <= micro_batch <= MAX_MICRO_BATCH:
            raise InputError(f"--micro-batch {micro_batch}: must be from 1 to {MAX_MICRO_BATCH:,}")
        chosen = chosen.with_micro_batch(micro_batch)
    if seq is not None:
        if not 1 <= seq <= MAX_SEQ:
            raise InputError(f"--seq {seq}: must be from 1 to {MAX_SEQ:,}")
        if isinstance(chosen, Transformer):
            chosen = replace(chosen, seq=seq)
    return chosen


def build(
    composition: str,
    devices: int | None,
    model: str | None,
    params: str | None,
    precision: str,
    device_memory: str | None,
    micro_batch: int | None = None,
    seq: int | None = None,
    strategies: StrategyFile | None = None,
    node_size: int = DEFAULT_NODE_SIZE,
) -> Analysis:
    """``strategies``: a user file whose names the composition may use, and whose program (if any)
    replaces the derived one. ``node_size``: devices per node, for the ``hpz`` modifier."""
    if devices is not None and not 1 <= devices <= MAX_DEGREE:
        raise InputError(f"--devices {devices}: must be from 1 to {MAX_DEGREE:,}")
    comp: Composition = parse(
        composition,
        strategies.factories() if strategies is not None else None,
        devices=devices if devices is not None else DEFAULT_DEVICES,
        node_size=node_size,
    )
    chosen = load_model(model, params, micro_batch, seq)
    if precision not in PRECISIONS:
        raise InputError(f"--precision {precision}: unknown (known: {', '.join(PRECISIONS)})")
    mem = parse_bytes(device_memory) if device_memory is not None else DEFAULT_DEVICE_MEMORY
    program = None
    if strategies is not None and strategies.program is not None:
        program = strategies.program_for(comp.placement(chosen), chosen)
    return analyze(comp, chosen, PRECISIONS[precision], mem, program=program)


def verdict_exit(verdict: Verdict) -> int:
    """0 valid, 1 invalid, 3 unknown (z3 gave up: never reported as valid)."""
    match verdict.status:
        case Status.PROVED:
            return EXIT_VALID
        case Status.REFUTED:
            return EXIT_INVALID
        case Status.UNKNOWN:
            return EXIT_UNKNOWN
        case _:
            raise AssertionError(verdict.status)


__all__ = [
    "EXIT_CODES",
    "EXIT_INTERNAL",
    "EXIT_INVALID",
    "EXIT_UNKNOWN",
    "EXIT_USAGE",
    "EXIT_VALID",
    "build",
    "fail",
    "load_model",
    "outcome",
    "set_outcome",
    "verdict_exit",
]
