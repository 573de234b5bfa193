"""State consistency's two-step run along one axis (``formal/_smt.py`` explains the encoding).

``_T`` is a value of the model (an initial chunk value, a step's gradient, junk, or an update of
the (p, o, g) it read); ``_consistency_case`` collects what one obligation depends on (the group
erased); ``_AxisRun`` executes the program for two steps over per-device and per-host holdings
and records every read and coverage condition as a ``_Check`` against the single-device value.
``formal/_smt_consistency.py`` gives the checks to z3.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from formal._axes import Origin
from formal._placement import Entry
from formal._program import Op
from formal._smt_common import MAX_CONSISTENCY_DEVICES, PHASE_ORDER, PLACEHOLDER, G, O, P, _fraction, _Index
from formal._vocab import FIRST_STAGE_GROUPS, LAYER_GROUPS, Axis, Group, Mode, OpKind, Phase, Reduce, State
from formal.errors import InputError

_SHAPES: dict[tuple[Any, ...], int] = {}  # term shapes seen so far, interned as ints
FACTORS: dict[Fraction, int] = {}  # the constants of ``scale`` terms, interned as tags


@dataclass(frozen=True)
class _T:
    """A value in the consistency model: an atom or an update of the (p, o, g) it read.

    Heads: ``P0``/``O0`` initial chunk values, ``g`` a step's gradient of a chunk, ``junk``
    whatever memory holds where nothing was written, ``upd_p``/``upd_o`` the element-wise
    optimizer (uninterpreted: any optimizer), ``scale`` a constant (``factor``) times its
    argument (a scale of P or O: single-device training applies none).
    """

    head: str
    chunk: int = -1
    tag: int = 0
    args: tuple[_T, ...] = ()
    digest: int = field(default=0, init=False, repr=False, compare=False)
    shape: int = field(default=0, init=False, repr=False, compare=False)
    leaves: tuple[tuple[str, int], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Terms nest and are compared often: hash once. ``shape`` (the term with its chunks and
        # junk tags erased, interned as an int) and ``leaves`` (its chunks and junk tags in
        # order) let checks that differ only by a renaming of chunks be recognised cheaply.
        object.__setattr__(self, "digest", hash((self.head, self.chunk, self.tag, self.args)))
        if self.args:
            shape: tuple[Any, ...] = (self.head, self.tag, tuple(a.shape for a in self.args))
            leaves = tuple(leaf for a in self.args for leaf in a.leaves)
        else:
            shape = (self.head, self.tag if self.head == "g" else 0)
            leaves = (("junk", self.tag) if self.head == "junk" else ("chunk", self.chunk),)
        object.__setattr__(self, "shape", _SHAPES.setdefault(shape, len(_SHAPES)))
        object.__setattr__(self, "leaves", leaves)

    def __hash__(self) -> int:
        return self.digest

    def __str__(self) -> str:
        match self.head:
            case "P0" | "O0":
                return f"{self.head}[{self.chunk}]"
            case "g":
                return f"g{self.tag}[{self.chunk}]"
            case "junk":
                return f"junk{self.tag}"
            case "upd_p" | "upd_o":
                return f"{self.head}({', '.join(map(str, self.args))})"
            case "scale":
                return f"{self.factor}*{self.args[0]}"
            case _:
                raise AssertionError(self.head)

    @property
    def factor(self) -> Fraction:
        """A ``scale`` term's constant."""
        return next(f for f, tag in FACTORS.items() if tag == self.tag)

    def scaled(self, factor: Fraction) -> _T:
        """This value times ``factor`` (scales fold; junk stays junk; a factor of one is no op)."""
        if self.head == "junk":
            return self
        inner = self
        if self.head == "scale":
            factor, inner = factor * self.factor, self.args[0]
        if factor == 1:
            return inner
        return _T("scale", inner.chunk, FACTORS.setdefault(factor, len(FACTORS)), (inner,))

    def subterms(self) -> Iterator[_T]:
        yield self
        for a in self.args:
            yield from a.subterms()

    def chunks(self) -> frozenset[int]:
        return frozenset(t.chunk for t in self.subterms() if t.head in ("P0", "O0", "g"))

    @property
    def updates(self) -> int:
        return 0 if not self.args else 1 + max(a.updates for a in self.args)


@dataclass(frozen=True)
class _Check:
    """One read (or one coverage condition) to compare with single-device training."""

    state: State
    rule: str  # the rule its failure breaks, e.g. "refresh"
    label: str  # the tracked name, e.g. "refresh[P.attention, dp]"
    target: str  # what is read, e.g. "[P.attention, dp]" (the label of another rule it may break)
    values: tuple[_T, ...]  # a read: one value; coverage: every holder's value (none: lost)
    expected: _T
    where: tuple[tuple[str, Any], ...]


Holder = tuple[bool, int, State]  # (on the host, device along the axis, state)


@dataclass(frozen=True)
class _ConsistencyCase:
    """All one state-consistency obligation depends on, with the group erased (``PLACEHOLDER``)."""

    axis: Axis
    degree: int
    entries: tuple[Entry, Entry, Entry]  # P, O, G along the axis
    local: tuple[Mode | None, Mode | None, Mode | None]  # P, O, G axis-free modes
    ops: tuple[Op, ...]
    computed_sharded: bool  # the computation itself is split along the axis (TP matrices, PP stages)
    held: bool  # parameters gathered once and held through the backward, along any axis (FSDP SGO)
    held_here: bool  # ... along this axis: what was gathered along it stays (FSDP SGO; hpZ across nodes)
    stage_group: bool = False  # along a pipeline axis, a group outside the layers (lives on one or two stages)
    first_stage: bool = False  # ... used by the first stage (the embedding); else by the last (head, final norm)
    tied: bool = False  # ... used by the first and the last stage (a tied embedding)
    complete: bool = True  # the backward's gradient is complete along the axis (not a partial sum)


def _consistency_case(index: _Index, group: Group, axis: Axis) -> _ConsistencyCase:
    return _ConsistencyCase(
        axis,
        index.degrees[axis],
        (index.entry(P, group, axis), index.entry(O, group, axis), index.entry(G, group, axis)),
        (index.local.get((P, group)), index.local.get((O, group)), index.local.get((G, group))),
        _micro_batches_unrolled(
            # a scale multiplies every device's copy whatever axis it names: every axis sees it
            [
                op
                for op in index.ops.get(group, [])
                if op.state in (P, O, G) and (op.axis in (None, axis) or op.kind is OpKind.SCALE)
            ],
            index.micro_batches,
        ),
        index.placement.computes_sharded(axis, group),
        any(index.entry(P, group, a).keep_gathered for a in index.placement.axes),
        index.entry(P, group, axis).keep_gathered,
        axis.kind.is_pipeline and group not in LAYER_GROUPS,
        axis.kind.is_pipeline and group in FIRST_STAGE_GROUPS,
        axis.kind.is_pipeline and group in index.placement.tied,
        index.origins.get((group, axis), Origin.COMPLETE) is not Origin.PARTIAL,
    )


def _micro_batches_unrolled(ops: list[Op], m: int) -> tuple[Op, ...]:
    """The ops of one step with each micro-batch's own run of them spelled out.

    With ``m > 1`` micro-batches every forward and backward op, and every gradient-sync op done
    once per micro-batch (``count == m``), runs once per micro-batch, as the simulator and a real
    training loop run them: a scale of the parameters in the backward acts ``m`` times, and the
    second micro-batch's forward reads what the first one's ops left. The consistency run tracks
    which chunks a gradient buffer holds, not its micro-batch sums (gradient integrity judges
    those), so the gradient ops keep one run, the last micro-batch's (the fresh gradient each
    micro-batch's backward produces is the same set of chunks).
    """
    if m == 1:
        return tuple(ops)

    def per_micro_batch(op: Op) -> bool:
        return op.phase in (Phase.FORWARD, Phase.BACKWARD) or (op.phase is Phase.GRAD_SYNC and op.count == m)

    each = [op for op in ops if per_micro_batch(op)]
    unrolled = [op for mb in range(m) for op in each if mb == m - 1 or op.state is not G]
    return (*unrolled, *(op for op in ops if not per_micro_batch(op)))


@dataclass
class _AxisRun:
    """Two steps of a program along one axis for one group: holdings, reads, coverage."""

    case: _ConsistencyCase
    checks: list[_Check] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.group = PLACEHOLDER
        self.axis = self.case.axis
        self.degree = self.case.degree
        self.entry = dict(zip((P, O, G), self.case.entries, strict=True))
        self.local = dict(zip((P, O, G), self.case.local, strict=True))
        self.ops = list(self.case.ops)
        # a group outside the layers along pp lives on the first and the last stage: both modelled
        ends = {0, self.degree - 1} if self.case.stage_group else {0}
        raw = sorted(
            {e.offset % self.degree for e in self.entry.values()} | {op.offset % self.degree for op in self.ops} | ends
        )
        if self.degree <= MAX_CONSISTENCY_DEVICES:
            self.d = self.degree
            self.offsets = {o: o for o in raw}
        else:
            self.d = max(MAX_CONSISTENCY_DEVICES, len(raw))
            self.offsets = {o: i for i, o in enumerate(raw)}
        self.hold: dict[Holder, dict[int, _T]] = {
            (host, i, st): {} for host in (False, True) for i in range(self.d) for st in (P, O, G)
        }
        self.ref: dict[State, list[_T]] = {st: [_T(f"{st.value}0", k) for k in range(self.d)] for st in (P, O)}
        self.junk = 0
        # Per device, the gradient chunks reduced along the axis (or complete when produced): a
        # reduce-scatter leaves them in the buffer, as ``reduce_scatter_tensor`` leaves its input,
        # and drops the partial sums it did not reduce (what an update must not read).
        self.reduced: dict[int, set[int]] = {i: set() for i in range(self.d)}
        self.names = {
            "P": f"P.{self.group.name}, {self.axis.value}",
            "O": f"O.{self.group.name}, {self.axis.value}",
            "G": f"G.{self.group.name}, {self.axis.value}",
        }

    # -- partitions and holdings
    def off(self, offset: int) -> int:
        return self.offsets.get(offset % self.degree, 0)

    # A group outside the layers along a pipeline axis (``stage_group``) is not cut into per-stage
    # chunks: it is whole where it lives (the simulator's ``_Layout``, docs/semantics.md, "Groups
    # outside the layers along a pipeline"). ``R``: on the first and the last stage; ``S``: on the
    # stage that uses it (the first for the embedding, the last for the head and the final norm);
    # computed by that stage, and by both for a tied embedding. Collectives along pp run between
    # the first and the last stage.
    @property
    def ends(self) -> list[int]:
        """The first and the last stage (the members of a stage group's collectives along pp)."""
        return sorted({0, self.off(self.degree - 1)})

    @property
    def owner(self) -> int:
        return 0 if self.case.first_stage else self.off(self.degree - 1)

    def computes(self, device: int) -> bool:
        """Whether ``device``'s computation uses the group (always, outside a stage group)."""
        if not self.case.stage_group:
            return True
        return device == self.owner or (self.case.tied and device in self.ends)

    def piece(self, device: int, offset: int) -> list[int]:
        """A stage group's piece of a collective along pp on ``device``: a tied embedding's two
        stages split it in halves; otherwise the stage that computes it has all of it."""
        ends = self.ends
        if device not in ends:
            return []
        if self.case.tied and len(ends) == 2:
            half = (ends.index(device) - self.off(offset)) % 2
            cut = (self.d + 1) // 2
            return list(range(cut)) if half == 0 else list(range(cut, self.d))
        return list(range(self.d)) if self.computes(device) else []

    def partition(self, entry: Entry, device: int) -> list[int]:
        if self.case.stage_group:
            match entry.mode:
                case Mode.REPLICATED | Mode.OFFLOADED:
                    holds = device in self.ends
                case Mode.SHARDED | Mode.SHARDED_GATHER:
                    holds = device == self.owner
                case _:
                    holds = False
            return list(range(self.d)) if holds else []
        match entry.mode:
            case Mode.REPLICATED | Mode.OFFLOADED:
                return list(range(self.d))
            case Mode.SHARDED | Mode.SHARDED_GATHER:
                return [(device - self.off(entry.offset)) % self.d]
            case Mode.MATERIALIZED:
                return []
            case _:
                raise AssertionError(entry.mode)

    def on_host(self, state: State) -> bool:
        return self.local[state] is Mode.OFFLOADED or self.entry[state].mode is Mode.OFFLOADED

    def fresh_junk(self) -> _T:
        self.junk += 1
        return _T("junk", tag=self.junk)

    def initialise(self) -> None:
        for st in (P, O):
            host = self.on_host(st)
            for i in range(self.d):
                for k in self.partition(self.entry[st], i):
                    self.hold[(host, i, st)][k] = self.ref[st][k]
        if self.on_host(O) and not self.on_host(P):
            # ZeRO-Offload: the fp32 master parameters live with the optimizer state on the host.
            for i in range(self.d):
                for k in self.partition(self.entry[O], i):
                    self.hold[(True, i, P)][k] = self.ref[P][k]

    def contribute(self, holder: Holder, chunk: int) -> _T:
        """What a holder supplies for ``chunk``: its copy, else its one shard (misaligned), else junk."""
        held = self.hold[holder]
        if chunk in held:
            return held[chunk]
        if len(held) == 1:
            return next(iter(held.values()))
        return self.fresh_junk()

    # -- checks
    def check(self, state: State, rule: str, values: tuple[_T, ...], expected: _T, **where: Any) -> None:
        if rule in ("alignment_og", "alignment_op"):
            label = f"alignment[O/{'G' if rule == 'alignment_og' else 'P'}.{self.group.name}, {self.axis.value}]"
            rule = "alignment"
        elif rule == "fetch_before_use":
            label = f"fetch_before_use[P.{self.group.name}]"
        else:
            label = f"{rule}[{self.names[state.value]}]"
        self.checks.append(
            _Check(state, rule, label, f"[{self.names[state.value]}]", values, expected, tuple(where.items()))
        )

    def compute_rule(self, full: bool) -> str:
        entry = self.entry[P]
        if self.local[P] is Mode.OFFLOADED:
            return "fetch_before_use"
        if entry.mode.is_sharded and full:
            return "gather_before_use"
        if entry.mode is Mode.REPLICATED and (self.entry[O].mode.is_sharded or self.on_host(O)):
            return "refresh"
        return "agreement"

    # -- ops
    def run(self) -> None:
        self.initialise()
        for step in (0, 1):
            gradient = [_T("g", k, step) for k in range(self.d)]
            updated = produced = trimmed = False
            phase: Phase | None = None
            for n, op in enumerate(self.ops):
                where = {"step": step, "op": n, "phase": op.phase.value, "kind": op.kind.value}
                if phase in (Phase.FORWARD, Phase.BACKWARD) and op.phase is not phase:
                    self.free_parameters(after_backward=phase is Phase.BACKWARD)
                phase = op.phase
                after_backward = PHASE_ORDER.index(op.phase) > PHASE_ORDER.index(Phase.BACKWARD)
                if not produced and (after_backward or (op.phase is Phase.BACKWARD and op.state is G)):
                    self.produce(gradient)  # the backward ran without a listed read of this group
                    produced = True
                if not trimmed and op.phase in (Phase.OPTIMIZER, Phase.REFRESH):
                    self.free_outside_shard()
                    trimmed = True
                if op.kind.is_collective and self.degree == 1:
                    continue  # one device along the axis: a collective exchanges nothing (the identity)
                match op.kind:
                    case OpKind.ALL_GATHER:
                        self.gather(op)
                    case OpKind.REDUCE_SCATTER:
                        self.reduce_scatter(op)
                    case OpKind.ALL_REDUCE:
                        self.all_reduce(op)
                    case OpKind.BROADCAST:
                        for i in self.ends[1:] if self.case.stage_group else range(1, self.d):
                            self.hold[(False, i, op.state)] = dict(self.hold[(False, 0, op.state)])
                            if op.state is G:
                                self.reduced[i] = set(self.reduced[0])
                    case OpKind.HOST_TO_DEVICE:
                        for i in range(self.d):
                            self.hold[(False, i, op.state)].update(self.hold[(True, i, op.state)])
                    case OpKind.DEVICE_TO_HOST:
                        for i in range(self.d):
                            host, device = self.hold[(True, i, op.state)], self.hold[(False, i, op.state)]
                            # The copy writes the device's partition of the state (its shard where
                            # the state is sharded along the axis: ZeRO-Offload copies each rank's
                            # gradient partition, as the simulator does): where the device holds
                            # nothing of it (freed, never fetched) the host gets junk.
                            for k in self.partition(self.entry[op.state], i):
                                host[k] = device[k] if k in device else self.fresh_junk()
                    case OpKind.COMPUTE if op.state is P:
                        self.compute(op, gradient, where)
                        produced = produced or op.phase is Phase.BACKWARD
                    case OpKind.OPTIMIZER_STEP:
                        self.optimizer_step(op, gradient, where, update_reference=not updated)
                        updated = True
                    case OpKind.SCALE if op.state is not G:
                        factor = _fraction(op.scale)
                        for i in range(self.d):
                            held = self.hold[(False, i, op.state)]
                            for k in held:
                                held[k] = held[k].scaled(factor)
                    case OpKind.SCALE:
                        pass  # a gradient's magnitude: gradient integrity judges it (not which element is held)
                    case _:
                        raise InputError(f"{op}: a {op.kind.value} of {op.state.long_name} is not modelled")
            if phase in (Phase.FORWARD, Phase.BACKWARD):
                self.free_parameters(after_backward=phase is Phase.BACKWARD)
            if not updated:
                self.update_reference(gradient)
            for st in (P, O):
                for k in range(self.d):
                    holders = tuple(dict.fromkeys(h[k] for (_, _, s), h in self.hold.items() if s is st and k in h))
                    self.check(
                        st, "coverage", holders, self.ref[st][k], step=step, op=len(self.ops), chunk=k, at="end of step"
                    )
            for key in self.hold:
                if key[2] is G:
                    self.hold[key] = {}  # gradients live for one step

    def needs_all(self, full: bool) -> bool:
        """Whether a device's computation reads every chunk: where it needs the whole tensor,
        or holds a whole copy of a group whose computation the axis does not split (a split
        computation reads its own slice, whatever the parameters' mode, as the simulator's
        ``_Layout.compute`` does)."""
        whole = self.entry[P].mode in (Mode.REPLICATED, Mode.OFFLOADED)
        return full or (whole and not (self.case.computed_sharded and not self.case.stage_group))

    def split_gradient(self) -> bool:
        """Whether each device's backward covers its own chunk only: the computation is split
        along the axis (a tp slice, a pipeline stage's layers, an ep rank's experts), whatever the
        parameters' mode (a replicated copy does not make a split computation whole). A group
        outside the layers along pp is whole on the stages that compute it."""
        return self.case.computed_sharded and not self.case.stage_group

    def produce(self, gradient: list[_T]) -> None:
        """The backward's gradient on every device: the chunks its computation covers."""
        split = self.split_gradient()
        for i in range(self.d):
            if not self.computes(i):
                self.hold[(False, i, G)] = {}
                continue
            self.hold[(False, i, G)] = {k: gradient[k] for k in ([i] if split else range(self.d))}
            self.reduced[i] = set(self.hold[(False, i, G)]) if self.case.complete else set()

    def free_outside_shard(self) -> None:
        """After gradient synchronisation a sharded gradient is kept only on its shard."""
        if not self.entry[G].mode.is_sharded:
            return
        for i in range(self.d):
            own = self.partition(self.entry[G], i)
            self.hold[(False, i, G)] = {k: v for k, v in self.hold[(False, i, G)].items() if k in own}

    def gather(self, op: Op) -> None:
        if self.case.stage_group:
            values = {k: self.contribute((False, i, op.state), k) for i in self.ends for k in self.piece(i, op.offset)}
            for i in self.ends:
                self.hold[(False, i, op.state)].update(values)
            return
        o = self.off(op.offset)
        values = {k: self.contribute((False, (k + o) % self.d, op.state), k) for k in range(self.d)}
        reduced = {k for k in range(self.d) if k in self.reduced[(k + o) % self.d]}
        for i in range(self.d):
            self.hold[(False, i, op.state)] = dict(values)
            if op.state is G:
                self.reduced[i] = set(reduced)

    def combined(self, op: Op, chunk: int) -> _T:
        """A reduction's result for a chunk: junk unless every device holds the same value. A
        gradient's magnitude is gradient integrity's to judge, so it is that value; a parameter
        or an optimizer moment is that value under a mean (of equal copies) and ``degree`` times
        it under a sum (single-device training applies no such factor)."""
        members = self.ends if self.case.stage_group else range(self.d)
        held = [self.hold[(False, i, op.state)].get(chunk) for i in members]
        first = held[0]
        if first is None or any(h != first for h in held):
            return self.fresh_junk()
        if op.state is G or op.reduce is not Reduce.SUM:
            return first
        return first.scaled(Fraction(len(held) if self.case.stage_group else self.degree))

    def reduce_scatter(self, op: Op) -> None:
        """Each device's piece gets the reduced chunk. The rest of the buffer stays as it was, as
        ``reduce_scatter_tensor`` leaves its input (the simulator alike): a parameter or an
        optimizer moment keeps it; a gradient keeps the piece alone within the backward and the
        synchronisation (which free the rest), and after them also the chunks already reduced
        along the axis (its partial sums are never readable)."""
        if self.case.stage_group:
            pieces = {i: {k: self.combined(op, k) for k in self.piece(i, op.offset)} for i in self.ends}
            for i, piece in pieces.items():
                if op.state is G:
                    self.hold[(False, i, op.state)] = piece
                else:
                    self.hold[(False, i, op.state)].update(piece)
            return
        o = self.off(op.offset)
        mine = {i: (i - o) % self.d for i in range(self.d)}
        values = {i: self.combined(op, mine[i]) for i in range(self.d)}
        for i in range(self.d):
            if op.state is G:
                held = self.hold[(False, i, op.state)]
                # Within the backward and the synchronisation the rest is freed with it (only
                # the piece a reduce-scatter left is held after synchronisation); after it nothing
                # frees the input buffer, whose reduced chunks stay readable.
                after_sync = op.phase in (Phase.OPTIMIZER, Phase.REFRESH)
                kept = {k: v for k, v in held.items() if after_sync and k in self.reduced[i] and k != mine[i]}
                self.hold[(False, i, op.state)] = {**kept, mine[i]: values[i]}
                self.reduced[i] = {*kept, mine[i]}
            else:
                self.hold[(False, i, op.state)][mine[i]] = values[i]

    def all_reduce(self, op: Op) -> None:
        if self.case.stage_group:  # the first and the last stage, the whole group
            values = {k: self.combined(op, k) for k in range(self.d)}
            for i in self.ends:
                self.hold[(False, i, op.state)] = dict(values)
            return
        chunks = {k for i in range(self.d) for k in self.hold[(False, i, op.state)]}
        values = {k: self.combined(op, k) for k in chunks}
        for i in range(self.d):
            held = self.hold[(False, i, op.state)]
            for k in list(held):
                held[k] = values[k]
            if op.state is G:
                self.reduced[i] = set(held)

    def compute(self, op: Op, gradient: list[_T], where: dict[str, Any]) -> None:
        full = self.needs_all(self.axis in op.full or self.case.stage_group)
        rule = self.compute_rule(full)
        for i in range(self.d):
            if not self.computes(i):
                continue
            held = self.hold[(False, i, P)]
            needed = list(range(self.d)) if full else [i]  # a sharded computation uses shard i
            for k in needed:
                if k in held:
                    value = held[k]
                elif not full and len(held) == 1:
                    value = next(iter(held.values()))
                else:
                    value = self.fresh_junk()
                self.check(P, rule, (value,), self.ref[P][k], **where, device=i, chunk=k, holder="device")
            if op.phase is Phase.BACKWARD:
                split = self.axis not in op.full and self.split_gradient()
                self.hold[(False, i, G)] = {k: gradient[k] for k in ([i] if split else needed)}
                self.reduced[i] = set(self.hold[(False, i, G)]) if self.case.complete else set()

    def free_parameters(self, after_backward: bool) -> None:
        """At the end of the forward and of the backward: transient copies are freed (gathered
        shards of others, fetched offloaded parameters), unless held through the backward."""
        entry = self.entry[P]
        # Held through the backward: what was gathered along a holding axis stays; along the other
        # axes the device keeps its shard (ZeRO++ hpZ holds across nodes and frees within the node,
        # whose shards the backward gathers again), its fetched shard too when P is offloaded.
        if not after_backward and self.case.held_here:
            return
        for i in range(self.d):
            if self.local[P] is Mode.OFFLOADED and (after_backward or not self.case.held):
                self.hold[(False, i, P)] = {}
            else:
                own = self.partition(entry, i)
                self.hold[(False, i, P)] = {k: v for k, v in self.hold[(False, i, P)].items() if k in own}

    def in_place(self, updater: Holder, chunk: int) -> bool:
        """Offloaded parameters live on the host: an optimizer on the device reads and writes them
        there in place, whatever transient copy the device holds (as the simulator does)."""
        host, device, state = updater
        return not host and state is P and self.local[P] is Mode.OFFLOADED and chunk in self.hold[(True, device, P)]

    def read_for_update(self, updater: Holder, chunk: int) -> _T:
        """What an update reads for ``chunk``: its copy, else its one shard (misaligned), else junk."""
        host, device, state = updater
        if self.in_place(updater, chunk):
            return self.hold[(True, device, P)][chunk]
        held = self.hold[updater]
        if chunk in held:
            return held[chunk]
        if not host and chunk in self.hold[(True, device, state)]:
            return self.hold[(True, device, state)][chunk]  # offloaded parameters, read in place
        if len(held) == 1:
            return next(iter(held.values()))
        return self.fresh_junk()

    def optimizer_step(self, op: Op, gradient: list[_T], where: dict[str, Any], *, update_reference: bool) -> None:
        """Each holder updates the chunks of the step's partition (``op.offset`` along an axis
        where the optimizer state is sharded, as the simulator does), reading P, O and G there."""
        host = self.on_host(O)
        entry = self.entry[O]
        partition = Entry(entry.mode, op.offset) if entry.mode.is_sharded else entry
        writes: list[tuple[Holder, int, _T]] = []
        for i in range(self.d):
            at = "host" if host else "device"
            # a stage group's offset along pp rotates which stage's holding this one updates
            who = (i - self.off(op.offset)) % self.d if self.case.stage_group and entry.mode.is_sharded else i
            for k in self.partition(partition, who):
                o_value = self.read_for_update((host, i, O), k)
                g_value = self.read_for_update((host, i, G), k)
                p_value = self.read_for_update((host, i, P), k)
                ctx = {**where, "device": i, "chunk": k, "holder": at}
                self.check(O, "agreement", (o_value,), self.ref[O][k], **ctx)
                self.check(G, "alignment_og", (g_value,), gradient[k], **ctx)
                self.check(P, "alignment_op", (p_value,), self.ref[P][k], **ctx)
                args = (p_value, o_value, g_value)
                for state, head in ((O, "upd_o"), (P, "upd_p")):
                    target = self.write_target((host, i, state), k)
                    if target is not None:
                        writes.append((target[0], target[1], _T(head, k, args=args)))
        if update_reference:
            self.update_reference(gradient)
        for holder, k, value in writes:
            self.hold[holder][k] = value

    def write_target(self, updater: Holder, chunk: int) -> tuple[Holder, int] | None:
        host, device, state = updater
        if self.in_place(updater, chunk):
            return (True, device, P), chunk
        if chunk in self.hold[updater]:
            return updater, chunk
        if not host and chunk in self.hold[(True, device, state)]:
            return (True, device, state), chunk
        if len(self.hold[updater]) == 1:
            return updater, next(iter(self.hold[updater]))  # misaligned: overwrites another chunk
        return None

    def update_reference(self, gradient: list[_T]) -> None:
        for k in range(self.d):
            args = (self.ref[P][k], self.ref[O][k], gradient[k])
            self.ref[P][k] = _T("upd_p", k, args=args)
            self.ref[O][k] = _T("upd_o", k, args=args)
