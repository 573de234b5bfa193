"""User strategies and step programs from a TOML file (``check-composition --strategies FILE``).

A strategy is described only by its modes per state (and per tensor group) along one axis; the
names it defines become usable in compositions (``zero2-skew8xtp2``). An optional ``[[program]]``
list gives the step program's P/O/G collectives explicitly, to check an implementation's
schedule rather than the derived one. ``examples/`` holds complete files; the format::

    [strategies.zero2-skew]            # a name for compositions: letters, digits inside, '-'; no 'x'
    axis = "dp"                        # dp, dpr, tp, pp, cp or ep
    description = "ZeRO-2, optimizer shards rotated by one"   # optional
    P = "R"                            # a mode: R, S, S*, M, O (or replicated, sharded, ...),
    O = "S@1"                          #   optionally @offset (shard k lives on coordinate k+offset)
    G = "S"                            #   and +hold (S* gathered once per micro-batch, held)
    A = "S"                            # optional; default S on data axes, R otherwise
    compute_sharded = ["attention"]    # optional: groups computed sharded along the axis, or "all"
                                       #   (along tp only the matrices, embedding and head split)
                                       #   (default: "all" on pp, none elsewhere)

    [strategies.zero2-skew.groups.norm]    # optional per-group modes
    P = "R"

    [[program]]                        # optional: replaces every derived P/O/G collective
    op = "all_reduce"                  # all_reduce, reduce_scatter, all_gather, broadcast, scale,
                                       #   host_to_device, device_to_host, compute, optimizer_step
    state = "G"                        # default G for reductions and scale, P for gathers, compute
    group = "norm"                     # default: every parameter group of the model
    axis = "tp"                        # required for collectives; optional for scale
    phase = "grad_sync"                # forward, backward, grad_sync, optimizer, refresh (default by op)
    reduce = "sum"                     # reductions: sum or mean (default mean on data axes, else sum)
    offset = 0                         # the shard partition a reduce-scatter or gather uses
    scale = "1/d"                      # scale: a number, a fraction "1/2" or "1/d" (the axis degree)
    buffer = "accumulated"             # gradient ops: "fresh" (this micro-batch's gradient, backward
                                       #   only) or "accumulated" (the .grad buffer); default: fresh in
                                       #   the backward, accumulated elsewhere (docs/semantics.md,
                                       #   "Gradient buffers")

An optional ``[[scalars]]`` list replaces the derived scalar program (the loss normaliser, the
global gradient norm, the clip, the fp16 overflow check): ``checker/_toml_scalars.py``.

Program order: phases run in the order above; within a phase the file's ops come first (in
file order), then the derived local steps of that phase (the forward and backward reads, the
optimizer step) unless the file lists ``compute`` or ``optimizer_step`` ops itself, then the
derived activation collectives (TP, CP, EP, PP), which a file does not replace.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from checker._parse import MODIFIERS
from checker._toml_scalars import ScalarSpec, scalar_program, scalar_specs
from formal import _num as num
from formal._input import TEXT, Schema, check_schema, load_toml, printable, read_text
from formal._model import Model
from formal._num import Num
from formal._placement import Entry, Placement, Strategy
from formal._program import Op, StepProgram, derive_program, group_sizes, shard_elements
from formal._strategies import LIBRARY, TP_SHARDED
from formal._vocab import Axis, Buffer, Group, Mode, OpKind, Phase, Reduce, State
from formal.errors import InputError, StrategyFileError

_T = TypeVar("_T")

MAX_FILE_BYTES = 1_000_000  # a strategy file is a page of text, not a data set
MAX_STRATEGIES = 100
MAX_OPS = 10_000
MAX_OFFSET = 1_000_000

PHASE_ORDER: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.GRAD_SYNC, Phase.OPTIMIZER, Phase.REFRESH)
STATES: dict[str, State] = {"P": State.PARAMETERS, "O": State.OPTIMIZER, "G": State.GRADIENTS, "A": State.ACTIVATIONS}
_NAME = re.compile(r"^[a-wyz](?:[a-wyz0-9-]*[a-wyz-])?$")  # no 'x' (it separates terms), no trailing digit
_ENTRY = re.compile(r"^\s*(?P<mode>[A-Za-z*][A-Za-z* _-]*?)\s*(?:@\s*(?P<offset>\d{1,7}))?\s*(?P<hold>\+\s*hold)?\s*$")
_GROUP = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_STRATEGY_KEYS = {"axis", "description", "source", "P", "O", "G", "A", "compute_sharded", "groups"}
_OP_KEYS = {"op", "state", "group", "axis", "phase", "reduce", "offset", "scale", "note", "buffer"}
_DEFAULT_PHASE: dict[OpKind, Phase] = {
    OpKind.ALL_REDUCE: Phase.GRAD_SYNC,
    OpKind.REDUCE: Phase.GRAD_SYNC,
    OpKind.REDUCE_SCATTER: Phase.GRAD_SYNC,
    OpKind.SCALE: Phase.GRAD_SYNC,
    OpKind.DEVICE_TO_HOST: Phase.GRAD_SYNC,
    OpKind.ALL_GATHER: Phase.FORWARD,
    OpKind.BROADCAST: Phase.REFRESH,
    OpKind.HOST_TO_DEVICE: Phase.FORWARD,
    OpKind.COMPUTE: Phase.FORWARD,
    OpKind.OPTIMIZER_STEP: Phase.OPTIMIZER,
}
_OP_KINDS = tuple(_DEFAULT_PHASE)
_MODIFIER_NAMES = {
    "sp",
    "gpipe",
    "1f1b",
    "offload",
    "offload-optimizer",
    "offload-params",
    "recompute",
    "full-recompute",
    "selective",
    "selective-recompute",
}


def _show(value: object) -> str:
    """A user's value, quoted and cut to fit one line."""
    text = repr(value).replace("\n", "\\n").replace("\r", "\\r")
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class OpSpec:
    """One ``[[program]]`` entry as written (validated against a model when a program is built)."""

    index: int  # 1-based, as a person counts the file's entries
    kind: OpKind
    state: State
    group: str | None
    axis: Axis | None
    phase: Phase
    reduce: Reduce | None
    offset: int
    scale: str | None
    buffer: Buffer | None = None

    @property
    def where(self) -> str:
        return f"program[{self.index}] ({self.kind.value})"


@dataclass(frozen=True)
class StrategyFile:
    """The strategies and optional step program of one file."""

    path: str
    strategies: tuple[Strategy, ...]
    program: tuple[OpSpec, ...] | None
    scalars: tuple[ScalarSpec, ...] | None = None

    @property
    def gives_program(self) -> bool:
        """The file replaces part of the derived step program (``[[program]]`` or ``[[scalars]]``)."""
        return self.program is not None or self.scalars is not None

    def factories(self) -> dict[str, Callable[[], Strategy]]:
        """Name to factory, the shape ``checker._parse.parse`` accepts as ``strategies``."""
        return {s.name: _constant(s) for s in self.strategies}

    def program_for(self, placement: Placement, model: Model) -> StepProgram:
        """The step program of a placement: the file's, or the derived one when it has none."""
        derived = derive_program(placement, model)
        program = derived if self.program is None else build_program(self, self.program, placement, model, derived)
        if self.scalars is None:
            return program
        ops = scalar_program(self.path, self.scalars, placement)
        return replace(program, placement=replace(program.placement, user_program=True), scalars=ops, derived=False)


def _constant(strategy: Strategy) -> Callable[[], Strategy]:
    return lambda: strategy


# The keys the loader reads beyond its own checks of [strategies.NAME] and [[program]].
SCHEMA: Schema = {"description": TEXT}


def load(path: str | Path) -> StrategyFile:
    """Read and validate a strategy file; every problem is one ``StrategyFileError`` line."""
    where = printable(str(path), 200)
    try:
        text = read_text(path, where, limit=MAX_FILE_BYTES)
    except InputError as err:
        raise StrategyFileError(str(err)) from None
    return loads(text, where)


def loads(text: str, where: str = "<strategies>") -> StrategyFile:
    try:
        doc = load_toml(text, where)
        check_schema(doc, SCHEMA, where)
    except InputError as err:
        raise StrategyFileError(str(err)) from None
    unknown = set(doc) - {"strategies", "program", "scalars", "description"}
    if unknown:
        raise StrategyFileError(
            f"{where}: unknown top-level key {_show(sorted(unknown)[0])} "
            "(expected [strategies.NAME] tables, [[program]] and [[scalars]] entries)"
        )
    tables = doc.get("strategies", {})
    if not isinstance(tables, dict):
        raise StrategyFileError(f"{where}: 'strategies' must be a table of [strategies.NAME] tables")
    if len(tables) > MAX_STRATEGIES:
        raise StrategyFileError(f"{where}: {len(tables)} strategies; at most {MAX_STRATEGIES}")
    strategies = tuple(_strategy(where, name, body) for name, body in tables.items())
    program = None
    if "program" in doc:
        ops = doc["program"]
        if not isinstance(ops, list) or not all(isinstance(o, dict) for o in ops):
            raise StrategyFileError(f"{where}: 'program' must be a list of [[program]] tables")
        if len(ops) > MAX_OPS:
            raise StrategyFileError(f"{where}: {len(ops)} program entries; at most {MAX_OPS}")
        program = tuple(_op(where, i, body) for i, body in enumerate(ops, start=1))
    scalars = scalar_specs(where, doc["scalars"]) if "scalars" in doc else None
    if not strategies and program is None and scalars is None:
        raise StrategyFileError(f"{where}: defines no [strategies.NAME], no [[program]] and no [[scalars]]")
    return StrategyFile(where, strategies, program, scalars)


def _strategy(where: str, name: object, body: object) -> Strategy:
    if name in LIBRARY:
        raise StrategyFileError(f"{where}: strategy name {name!r} is already a library strategy")
    if not isinstance(name, str) or not _NAME.match(name):
        raise StrategyFileError(
            f"{where}: strategy name {_show(name)}: use lower-case letters, digits and '-', "
            "starting with a letter, not ending in a digit (the degree), without 'x' "
            "(it separates terms)"
        )
    if name in _MODIFIER_NAMES or name in MODIFIERS:
        raise StrategyFileError(f"{where}: strategy name {name!r} is a composition modifier")
    at = f"{where}: strategies.{name}"
    if not isinstance(body, dict):
        raise StrategyFileError(f"{at}: must be a table")
    unknown = set(body) - _STRATEGY_KEYS
    if unknown:
        raise StrategyFileError(
            f"{at}: unknown key {_show(sorted(unknown)[0])} (known: {', '.join(sorted(_STRATEGY_KEYS))})"
        )
    if "axis" not in body:
        raise StrategyFileError(f"{at}: needs axis = one of {', '.join(a.value for a in Axis)}")
    axis = _axis(at, body["axis"])
    entries: list[tuple[tuple[State, Group | None], Entry]] = []
    for key, state in STATES.items():
        if key in body:
            entries.append(((state, None), _entry(f"{at}.{key}", body[key])))
    if "A" not in body:  # activations are split along every data axis (each replica its samples)
        entries.append(((State.ACTIVATIONS, None), Entry(Mode.SHARDED if axis.splits_data else Mode.REPLICATED)))
    groups = body.get("groups", {})
    if not isinstance(groups, dict):
        raise StrategyFileError(f"{at}.groups: must be a table of [strategies.{name}.groups.GROUP] tables")
    for group_name, modes in groups.items():
        g_at = f"{at}.groups.{group_name}"
        if not _GROUP.fullmatch(group_name):
            raise StrategyFileError(f"{at}.groups: group name {_show(group_name)} is not a name")
        if not isinstance(modes, dict) or not modes:
            raise StrategyFileError(f"{g_at}: must be a table of modes (P, O, G, A)")
        for key, value in modes.items():
            if key not in STATES:
                raise StrategyFileError(f"{g_at}: unknown key {_show(key)} (expected P, O, G or A)")
            entries.append(((STATES[key], Group(group_name)), _entry(f"{g_at}.{key}", value)))
    if not any(state is not State.ACTIVATIONS for (state, _), _ in entries):
        raise StrategyFileError(f"{at}: gives no mode for P, O or G")
    compute = _compute_sharded(at, body.get("compute_sharded", "all" if axis.kind.is_pipeline else []), axis)
    for text_key in ("description", "source"):
        if text_key in body and not isinstance(body[text_key], str):
            raise StrategyFileError(f"{at}.{text_key}: must be a string")
    strategy = Strategy(
        name,
        axis,
        None,
        tuple(entries),
        compute,
        str(body.get("description", "user strategy")),
        str(body.get("source", where)),
    )
    problem = strategy.problem()
    if problem is not None:
        raise StrategyFileError(f"{at}: {problem}")
    return strategy


def _axis(at: str, value: object) -> Axis:
    if isinstance(value, str):
        for axis in Axis:
            if value.strip().lower() == axis.value:
                return axis
    raise StrategyFileError(f"{at}.axis: {_show(value)} is not an axis ({', '.join(a.value for a in Axis)})")


def _entry(at: str, value: object) -> Entry:
    match = _ENTRY.match(value) if isinstance(value, str) else None
    if match is None:
        raise StrategyFileError(
            f'{at}: {_show(value)} is not a mode (R, S, S*, M or O, optionally @offset and +hold, e.g. "S*@1")'
        )
    try:
        mode = Mode.parse(match["mode"])
    except ValueError:
        raise StrategyFileError(
            f"{at}: {_show(match['mode'])} is not a mode ({', '.join(f'{m.value} ({m.long_name})' for m in Mode)})"
        ) from None
    offset = int(match["offset"] or 0)
    if offset > MAX_OFFSET:
        raise StrategyFileError(f"{at}: offset {offset} is absurd (at most {MAX_OFFSET})")
    hold = match["hold"] is not None
    if hold and mode is not Mode.SHARDED_GATHER:
        raise StrategyFileError(f"{at}: +hold applies to S* (gathered) states only, not {mode.value}")
    if offset and not mode.is_sharded:
        raise StrategyFileError(f"{at}: @offset applies to sharded states (S, S*) only, not {mode.value}")
    return Entry(mode, offset, hold)


def _compute_sharded(at: str, value: object, axis: Axis) -> frozenset[Group] | None:
    """The groups the strategy computes split. Along an axis that splits matrices (tensor
    parallelism), only groups with a tensor-parallel dimension can be split (``TP_SHARDED``: the
    column/row-parallel matrices and the vocabulary-parallel embedding and head; norms and
    row-parallel biases are replicated, Shoeybi et al. 2019, section 3): "all" means those, and
    a list naming another group is refused."""
    if value == "all":
        return TP_SHARDED if axis.kind.splits_matrices else None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise StrategyFileError(f'{at}.compute_sharded: must be "all" or a list of group names')
    groups = frozenset(Group(v) for v in value)
    if axis.kind.splits_matrices and groups - TP_SHARDED:
        odd = sorted(g.name for g in groups - TP_SHARDED)[0]
        raise StrategyFileError(
            f"{at}.compute_sharded: {odd} cannot be computed split along {axis.value}: it has no "
            f"tensor-parallel dimension (splittable: {', '.join(sorted(g.name for g in TP_SHARDED))})"
        )
    return groups


def _op(where: str, index: int, body: dict[str, Any]) -> OpSpec:
    at = f"{where}: program[{index}]"
    unknown = set(body) - _OP_KEYS
    if unknown:
        raise StrategyFileError(f"{at}: unknown key {_show(sorted(unknown)[0])} (known: {', '.join(sorted(_OP_KEYS))})")
    kind = _choice(at, "op", body.get("op"), {k.value: k for k in _OP_KINDS})
    default_state = (
        "G"
        if kind.is_reduction or kind in (OpKind.REDUCE, OpKind.SCALE, OpKind.DEVICE_TO_HOST)
        else ("O" if kind is OpKind.OPTIMIZER_STEP else "P")
    )
    state = _choice(
        at, "state", body.get("state", default_state), {k: v for k, v in STATES.items() if v is not State.ACTIVATIONS}
    )
    if kind is OpKind.COMPUTE and state is not State.PARAMETERS:
        raise StrategyFileError(f"{at}: compute reads parameters (state P), not {state.value}")
    if kind is OpKind.OPTIMIZER_STEP and state is not State.OPTIMIZER:
        raise StrategyFileError(f"{at}: optimizer_step belongs to the optimizer state (state O), not {state.value}")
    group = body.get("group")
    if group == "all":
        group = None
    elif group is not None and (not isinstance(group, str) or not _GROUP.fullmatch(group)):
        raise StrategyFileError(f"{at}.group: {_show(group)} is not a group name")
    axis = None if body.get("axis") is None else _axis(at, body["axis"])
    needs_axis = kind.is_collective
    if needs_axis and axis is None:
        raise StrategyFileError(f"{at}: a {kind.value} needs axis = one of {', '.join(a.value for a in Axis)}")
    if not needs_axis and kind is not OpKind.SCALE and axis is not None:
        raise StrategyFileError(f"{at}: a {kind.value} is local and takes no axis")
    phase = _choice(at, "phase", body.get("phase", _DEFAULT_PHASE[kind].value), {p.value: p for p in Phase})
    reduce = None
    if kind.is_reduction or kind.is_rooted:
        default = Reduce.MEAN.value if axis is not None and axis.splits_data else Reduce.SUM.value
        reduce = _choice(at, "reduce", body.get("reduce", default), {r.value: r for r in Reduce})
    elif "reduce" in body:
        raise StrategyFileError(f"{at}: reduce applies to all_reduce, reduce and reduce_scatter, not {kind.value}")
    offset = body.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= MAX_OFFSET:
        raise StrategyFileError(f"{at}.offset: {_show(offset)} must be an integer from 0 to {MAX_OFFSET}")
    scale = None
    if kind is OpKind.SCALE:
        if "scale" not in body:
            raise StrategyFileError(f'{at}: a scale needs scale = a number, "1/2" or "1/d"')
        scale = _scale_text(at, body["scale"])
    elif "scale" in body:
        raise StrategyFileError(f"{at}: scale applies to scale ops only, not {kind.value}")
    if "note" in body and not isinstance(body["note"], str):
        raise StrategyFileError(f"{at}.note: must be a string")
    return OpSpec(index, kind, state, group, axis, phase, reduce, offset, scale, _buffer(at, body, kind, state, phase))


def _buffer(at: str, body: dict[str, Any], kind: OpKind, state: State, phase: Phase) -> Buffer | None:
    """The gradient buffer an op names (docs/semantics.md, "Gradient buffers"); None: the default."""
    if "buffer" not in body:
        return None
    buffer = _choice(at, "buffer", body["buffer"], {b.value: b for b in Buffer})
    if state is not State.GRADIENTS or kind in (OpKind.COMPUTE, OpKind.OPTIMIZER_STEP):
        raise StrategyFileError(f"{at}: buffer applies to gradient ops (state G), not {kind.value} of {state.value}")
    if buffer is Buffer.FRESH and phase is not Phase.BACKWARD:
        raise StrategyFileError(
            f'{at}: buffer = "fresh" in the {phase.value} phase: a micro-batch\'s fresh gradient exists only in '
            "the backward, before it is added to the accumulated .grad"
        )
    return buffer


def _choice(at: str, key: str, value: object, options: Mapping[str, _T]) -> _T:
    lowered = {k.lower(): v for k, v in options.items()}
    if isinstance(value, str) and value.strip().lower() in lowered:
        return lowered[value.strip().lower()]
    if value is None:
        raise StrategyFileError(f"{at}: needs {key} = one of {', '.join(options)}")
    raise StrategyFileError(f"{at}.{key}: {_show(value)} is not one of {', '.join(options)}")


def _scale_text(at: str, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise StrategyFileError(f'{at}.scale: {_show(value)} must be a number, "1/2" or "1/d"')
    text = str(value).strip().lower().replace(" ", "")
    if text in ("1/d", "d"):
        return text
    try:
        frac = Fraction(text)
    except (ValueError, ZeroDivisionError, OverflowError):
        raise StrategyFileError(f'{at}.scale: {_show(value)} must be a number, "1/2" or "1/d"') from None
    if frac == 0 or abs(frac.numerator) > 10**12 or frac.denominator > 10**12:
        raise StrategyFileError(f"{at}.scale: {_show(value)} must be a non-zero, reasonable rational")
    return str(frac)


def _scale_value(spec: OpSpec, degree: Num) -> Num:
    match spec.scale:
        case "1/d":
            return num.ratio(1, degree)
        case "d":
            return degree
        case None:
            return 1
        case text:
            frac = Fraction(text)
            return num.canonical(frac)


def build_program(
    file: StrategyFile, specs: tuple[OpSpec, ...], placement: Placement, model: Model, derived: StepProgram
) -> StepProgram:
    """The file's program over a placement (see the module docstring for the order)."""
    pl = replace(placement, user_program=True)
    sizes = group_sizes(model)
    groups = pl.groups(State.PARAMETERS)
    m = num.canonical(pl.options.micro_batches)
    user: list[Op] = []
    for spec in specs:
        if spec.axis is not None and spec.axis not in pl.axes:
            raise StrategyFileError(
                f"{file.path}: {spec.where}: axis {spec.axis.value} is not in this composition "
                f"(axes: {', '.join(a.value for a in pl.axes)})"
            )
        if spec.group is not None and Group(spec.group) not in groups:
            raise StrategyFileError(
                f"{file.path}: {spec.where}: group {spec.group!r} is not a parameter group of "
                f"this model ({', '.join(g.name for g in groups)})"
            )
        targets = groups if spec.group is None else (Group(spec.group),)
        for g in targets:
            user.append(_spec_op(spec, g, pl, sizes[g], m))
    owns_local = any(op.kind in (OpKind.COMPUTE, OpKind.OPTIMIZER_STEP) for op in user)
    ops: list[Op] = []
    for phase in PHASE_ORDER:
        ops += [op for op in user if op.phase is phase]
        if not owns_local:
            ops += [
                op for op in derived.ops if op.phase is phase and op.kind in (OpKind.COMPUTE, OpKind.OPTIMIZER_STEP)
            ]
        ops += [op for op in derived.ops if op.phase is phase and op.state is State.ACTIVATIONS]
    return StepProgram(pl, tuple(ops), derived.origins, derived=False)


def _spec_op(spec: OpSpec, g: Group, pl: Placement, size: Num, m: Num) -> Op:
    count = m if spec.phase in (Phase.FORWARD, Phase.BACKWARD) else 1
    note = "from the strategy file"
    match spec.kind:
        case OpKind.COMPUTE:
            full = frozenset(axis for axis in pl.axes if not pl.computes_sharded(axis, g))
            return Op(OpKind.COMPUTE, spec.state, g, None, spec.phase, count=count, full=full, note=note)
        case OpKind.OPTIMIZER_STEP:
            return Op(
                OpKind.OPTIMIZER_STEP,
                spec.state,
                g,
                None,
                spec.phase,
                shard_elements(pl, spec.state, g, size, None),
                offset=spec.offset,
                note=note,
            )
        case OpKind.SCALE:
            degree = pl.degree(spec.axis) if spec.axis is not None else 1
            scale = _scale_value(spec, degree)
            return Op(OpKind.SCALE, spec.state, g, spec.axis, spec.phase, scale=scale, note=note, buffer=spec.buffer)
        case OpKind.HOST_TO_DEVICE | OpKind.DEVICE_TO_HOST:
            return Op(
                spec.kind,
                spec.state,
                g,
                None,
                spec.phase,
                shard_elements(pl, spec.state, g, size, None),
                count,
                note=note,
                buffer=spec.buffer,
            )
        case OpKind.ALL_REDUCE | OpKind.REDUCE | OpKind.REDUCE_SCATTER | OpKind.ALL_GATHER | OpKind.BROADCAST:
            assert spec.axis is not None  # validated when the file was read
            participants = 2 if spec.axis.kind.is_pipeline and g in pl.tied else None
            return Op(
                spec.kind,
                spec.state,
                g,
                spec.axis,
                spec.phase,
                shard_elements(pl, spec.state, g, size, spec.axis),
                count,
                spec.reduce,
                participants=participants,
                offset=spec.offset,
                note=note,
                buffer=spec.buffer,
            )
        case _:
            raise AssertionError(spec.kind)


__all__ = ["OpSpec", "StrategyFile", "build_program", "load", "loads"]
