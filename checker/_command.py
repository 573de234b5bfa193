"""What every subcommand of ``check-composition`` shares: the exit-code contract, the one way
to report bad input, and building an analysis from the command line's words. The subcommands
(``checker/cli.py``, ``checker/_commands_reports.py``, ``checker/_plan_command.py``) import it; it
imports none of them.
"""

from __future__ import annotations

import contextlib
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click

from checker._analysis import Analysis, analyze
from checker._import_common import Imported
from checker._numbers import MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ, parse_bytes, parse_count
from checker._parse import DEFAULT_NODE_SIZE, parse
from checker._toml import StrategyFile
from formal._engine_effects import Engine, default_engine, pytorch_engine
from formal._hf import load_hf_config, seq_note
from formal._input import printable
from formal._model import PRECISIONS, Model, ParameterCount, Precision, Transformer
from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES, DEFAULT_MODEL, PRESETS
from formal._strategies import Composition
from formal._verdict import Status, Verdict
from formal._vocab import Axis
from formal.errors import InputError

EXIT_VALID, EXIT_INVALID, EXIT_USAGE, EXIT_UNKNOWN, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_VALIDATION = 6  # --validate torch: PyTorch measured what the prediction did not
EXIT_CODES = (
    "Exit codes: 0 valid, 1 invalid (the rule is named), 2 usage or input error, 3 unknown, "
    "4 internal error (a bug: please report it; --debug shows the traceback), "
    "5 z3 and --simulate disagree (a bug in the tool: both answers are shown first), "
    "6 --validate torch measured what the prediction did not (the differences are shown)."
)


# Device memory the training state cannot use (``--reserve``): the CUDA context each process
# creates (hundreds of MB to over 1 GB, by CUDA version and device: "CUDA context" in the PyTorch
# notes on CUDA semantics), NCCL's communicator buffers (NCCL_BUFFSIZE, 4 MiB per channel and
# peer by default, per communicator: NCCL's environment-variable documentation) and the caching
# allocator's fragmentation (PyTorch's "Memory management" notes, ``torch.cuda.memory_reserved``
# beyond ``memory_allocated``). 4 GB is 5% of an 80 GB device: an estimate, stated in every report.
DEFAULT_RESERVE = "4GB"
RESERVE_HELP = (
    "Device memory kept back for the CUDA context, NCCL buffers and allocator fragmentation; "
    "'fits' means total + reserve <= device memory."
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


def base_model(model: str | None, params: str | None, largest_layer: str | None = None) -> Model:
    """The model a command names (a preset, a Hugging Face config.json, or a bare parameter
    count, with ``--largest-layer`` its largest gather unit), loaded once; ``sized`` sets its
    micro-batch and sequence."""
    if params is not None and model is not None:
        raise InputError(f"--params {params} and --model {model}: give one, not both")
    if largest_layer is not None and params is None:
        raise InputError(
            f"--largest-layer {largest_layer}: needs --params (a model's own modules give its largest unit)"
        )
    if params is not None:
        largest = None if largest_layer is None else parse_count(largest_layer, "--largest-layer")
        return ParameterCount(parse_count(params), name=f"{params.strip()} parameters", largest_layer=largest)
    if model is not None and not model.strip():
        raise InputError(f"--model {model!r}: empty (give a preset name or a config.json)")
    name = model or DEFAULT_MODEL
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") or Path(name).is_dir():
        return load_hf_config(Path(name))
    raise InputError(
        f"--model {name}: unknown model (presets: {', '.join(sorted(PRESETS))}; or a Hugging Face config.json)"
    )


def sized(chosen: Model, micro_batch: int | None, seq: int | None) -> Model:
    """``chosen`` with ``--micro-batch`` and ``--seq`` applied (a bare parameter count has no sequence)."""
    if micro_batch is not None:
        if not 1 <= micro_batch <= MAX_MICRO_BATCH:
            raise InputError(f"--micro-batch {micro_batch}: must be from 1 to {MAX_MICRO_BATCH:,}")
        chosen = chosen.with_micro_batch(micro_batch)
    if seq is not None:
        if not 1 <= seq <= MAX_SEQ:
            raise InputError(f"--seq {seq}: must be from 1 to {MAX_SEQ:,}")
        if isinstance(chosen, Transformer):
            chosen = with_seq(chosen, seq)
    return chosen


def with_seq(model: Transformer, seq: int) -> Transformer:
    """``model`` trained at ``seq`` tokens. A learned position table keeps its rows (its
    parameter count does not change with the training length); a sequence longer than the
    table has no position embedding for its tail and is refused."""
    if model.learned_positions:
        rows = model.position_rows
        if seq > rows:
            raise InputError(
                f"--seq {seq}: {model.name or 'the model'} has a learned position table of {rows:,} "
                f"positions; a longer sequence has no position embedding (at most --seq {rows})"
            )
        return replace(model, seq=seq, positions=rows)
    return replace(model, seq=seq)


def load_model(model: str | None, params: str | None, micro_batch: int | None, seq: int | None) -> Model:
    return sized(base_model(model, params), micro_batch, seq)


@dataclass(frozen=True)
class Request:
    """What one command analyses, each object built once from the command line (and ``--from``):
    the composition, the model, the precision, the device memory, and where they came from."""

    composition: Composition
    model: Model
    precision: Precision
    device_memory: int | None
    devices: int | None  # as given or stated by the config (None: the composition's own product)
    strategies: StrategyFile | None = None
    imported: Imported | None = None
    reserve: int = 0  # bytes of device memory kept back for the runtime (``--reserve``)
    engine: Engine | None = None  # the training engine whose effects the peak includes (``--engine``)


ENGINE_HELP = (
    "The training engine whose own buffers the peak includes (fsdp2, ddp: PyTorch's; deepspeed: its "
    "reduce bucket and fp32 master; megatron: the placement's figure). Default: by the composition (fsdp/hsdp: fsdp2, "
    "dp/ddp: ddp, zero*: deepspeed, otherwise megatron) or the imported config's framework."
)
ENGINES = tuple(e.value for e in Engine)


def engine_of(comp: Composition, imported: Imported | None, declared: str | None) -> Engine:
    """``--engine`` as declared, else the imported config's framework (DeepSpeed, Megatron-LM;
    torchtitan runs FSDP2), else the composition's default (``default_engine``)."""
    if declared is not None:
        if declared not in ENGINES:
            raise InputError(f"--engine {declared}: unknown (known: {', '.join(ENGINES)})")
        return Engine(declared)
    if imported is not None:
        return {"deepspeed": Engine.DEEPSPEED, "megatron": Engine.MEGATRON}.get(imported.framework.value, Engine.FSDP2)
    return default_engine(tuple(s.name for s in comp.strategies))


def for_validation(req: Request, declared: str | None) -> Request:
    """``--validate torch`` checks the prediction for the PyTorch engine the harness runs the
    composition on (``pytorch_engine``): that engine unless ``--engine`` names another, which is
    refused (the numbers printed would not be the numbers validated)."""
    torch_engine = pytorch_engine(tuple(s.name for s in req.composition.strategies))
    if declared is not None and Engine(declared) is not torch_engine:
        raise InputError(
            f"--engine {declared} with --validate torch: the harness runs this composition on "
            f"{torch_engine.value}; give --engine {torch_engine.value} or leave --engine out"
        )
    return replace(req, engine=torch_engine)


def _given(option: str) -> bool:
    """Whether the user typed the option (a config's value fills it only when not)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None or option not in ctx.params:
        return False
    return ctx.get_parameter_source(option) is not click.core.ParameterSource.DEFAULT


def _check_node_size(imported: Imported, node_size: int) -> None:
    """An explicit ``--node-size`` must agree with the node of a config's hpZ (DeepSpeed's
    ``zero_hpz_partition_size``): the config's composition is used as it is, never re-split."""
    hpz = imported.composition.strategy_on(Axis.DPR)
    data = imported.composition.strategy_on(Axis.DP)
    if hpz is not None and hpz.name == "hpz-dpr" and data is not None and data.degree != node_size:
        raise InputError(
            f"--node-size {node_size} contradicts the config's hpZ partition of {data.degree} devices "
            f"({imported.text}); leave --node-size out or make them agree"
        )


def request(
    composition: str | None,
    devices: int | None,
    model: str | None,
    params: str | None,
    precision: str,
    device_memory: str | None,
    micro_batch: int | None = None,
    seq: int | None = None,
    strategies: StrategyFile | None = None,
    node_size: int = DEFAULT_NODE_SIZE,
    from_path: str | None = None,
    reserve: str = DEFAULT_RESERVE,
    engine: str | None = None,
    largest_layer: str | None = None,
) -> Request:
    """COMPOSITION parsed, or ``--from CONFIG`` imported (never both), and the model loaded once.

    With ``--from`` the config's batch, sequence, precision and preset fill the options the user
    left at their defaults (an explicit option wins); the importer's ``Composition`` is used as
    it is. ``strategies``: a user file whose names the composition may use. ``node_size``: devices
    per node, for the ``hpz`` modifier. ``reserve``: device memory kept back for the runtime
    (``--reserve``, a size such as 4GB; at most the device memory)."""
    if devices is not None and not 1 <= devices <= MAX_DEGREE:
        raise InputError(f"--devices {devices}: must be from 1 to {MAX_DEGREE:,}")
    if largest_layer is not None and params is None:
        base_model(model, params, largest_layer)  # refused: one line
    imported: Imported | None = None
    if from_path is None:
        if composition is None:
            raise InputError("give a COMPOSITION (e.g. tp2xzero3xpp4) or --from CONFIG")
        comp: Composition = parse(
            composition,
            strategies.factories() if strategies is not None else None,
            devices=devices if devices is not None else DEFAULT_DEVICES,
            node_size=node_size,
        )
        chosen = sized(base_model(model, params, largest_layer), micro_batch, seq)
        if seq is None and isinstance(chosen, Transformer) and (note := seq_note(chosen)):
            with contextlib.suppress(OSError):
                click.echo(f"note: {note}", err=True)
    else:
        if composition is not None:
            raise InputError(f"{composition} and --from {from_path}: give one, not both")
        given = base_model(model, params, largest_layer) if (model or params) else None
        from checker._importers import load_config  # the config readers, only for --from

        imported = load_config(Path(from_path), devices=devices, model=given, seq=seq)
        comp = imported.composition
        base = imported.transformer or given or base_model(imported.model, None)  # the import's dropout wins
        chosen = sized(
            base,
            micro_batch if micro_batch is not None else imported.micro_batch,
            seq if seq is not None else imported.seq,
        )
        if _given("node_size"):
            _check_node_size(imported, node_size)
        if imported.precision and not _given("precision"):
            precision = imported.precision
        devices = imported.devices if devices is None else devices
    if precision not in PRECISIONS:
        raise InputError(f"--precision {precision}: unknown (known: {', '.join(PRECISIONS)})")
    mem = parse_bytes(device_memory) if device_memory is not None else DEFAULT_DEVICE_MEMORY
    kept = reserve_bytes(reserve, mem)
    chosen_engine = engine_of(comp, imported, engine)
    return Request(comp, chosen, PRECISIONS[precision], mem, devices, strategies, imported, kept, chosen_engine)


def reserve_bytes(reserve: str, device_memory: int | None) -> int:
    """``--reserve`` in bytes (``0`` in any unit: no headroom); refused when it leaves nothing of
    the device memory. ``check`` and ``plan`` read it alike."""
    nothing = re.fullmatch(r"[ \t]*0+(\.0*)?[ \t]*([kmgt]i?)?b?[ \t]*", reserve.lower())  # --reserve 0: no headroom
    kept = 0 if nothing else parse_bytes(reserve, "--reserve")
    if device_memory is not None and kept >= device_memory:
        raise InputError(f"--reserve {reserve}: leaves nothing of the {device_memory / 1e9:,.1f} GB device memory")
    return kept


def analysis_of(req: Request) -> Analysis:
    """The request's analysis: its placement built once (a user program is derived from it)."""
    program = None
    if req.strategies is not None and req.strategies.gives_program:
        program = req.strategies.program_for(req.composition.placement(req.model), req.model)
    return analyze(
        req.composition,
        req.model,
        req.precision,
        req.device_memory,
        program=program,
        reserve=req.reserve,
        engine=req.engine,
        deepspeed=None if req.imported is None else req.imported.deepspeed,
    )


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
    reserve: str = DEFAULT_RESERVE,
    engine: str | None = None,
) -> Analysis:
    """The analysis of one composition text (``compare``, ``sweep``): ``request`` then ``analysis_of``."""
    return analysis_of(
        request(
            composition,
            devices,
            model,
            params,
            precision,
            device_memory,
            micro_batch,
            seq,
            strategies,
            node_size,
            reserve=reserve,
            engine=engine,
        )
    )


def print_import(imported: Imported) -> None:
    """What ``--from`` read, on stderr; the config's own values are shown with control characters escaped."""
    with contextlib.suppress(OSError):
        click.echo(f"imported {imported.framework.value}: {printable(imported.text)}", err=True)
        for u in imported.unmapped:
            click.echo(f"  not mapped / assumed: {printable(str(u))}", err=True)


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
    "DEFAULT_RESERVE",
    "EXIT_CODES",
    "EXIT_INTERNAL",
    "EXIT_INVALID",
    "EXIT_UNKNOWN",
    "EXIT_USAGE",
    "EXIT_VALID",
    "EXIT_VALIDATION",
    "ENGINES",
    "ENGINE_HELP",
    "engine_of",
    "for_validation",
    "RESERVE_HELP",
    "Request",
    "analysis_of",
    "base_model",
    "build",
    "fail",
    "load_model",
    "request",
    "sized",
    "outcome",
    "print_import",
    "set_outcome",
    "verdict_exit",
]
