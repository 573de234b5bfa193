"""The planner's costs: each family's exact cost expressions (sympy, in the degree symbols and
``m``), and the calibrated step-time model's terms (``formal._steptime``), derived once per
component and evaluated with numpy on every mesh.

``checker._planner`` is the entry (docs/planner.md, "Exact, then vectorized").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import sympy as sp

from checker._plan_space import (
    _ARGS,
    AXES,
    MICRO_BATCHES,
    DataParallel,
    Family,
    Floats,
    Offload,
    Pipeline,
)
from formal._costs import STAGES, activation_memory, bubble_fraction, communication, memory, transfers
from formal._model import Model, Precision
from formal._placement import Recompute, Schedule, Strategy
from formal._program import StepProgram, derive_program, group_sizes
from formal._steptime import Runtime, Terms, compute_terms, state_terms
from formal._strategies import LIBRARY, Composition
from formal._vocab import Stage, State

# --- exact expressions, vectorized --------------------------------------------------------

_VMAX = sp.Function("vmax")
_VMIN = sp.Function("vmin")


def _vmax(*xs: Floats) -> Floats:
    out = xs[0]
    for x in xs[1:]:
        out = np.maximum(out, x)
    return out


def _vmin(*xs: Floats) -> Floats:
    out = xs[0]
    for x in xs[1:]:
        out = np.minimum(out, x)
    return out


@dataclass(frozen=True)
class Vectorized:
    """Exact sympy expressions in the degree symbols and ``m``, evaluated with numpy."""

    expressions: tuple[sp.Expr, ...]
    function: Callable[..., Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, expressions: Iterable[sp.Expr]) -> Vectorized:
        exprs = tuple(sp.sympify(e) for e in expressions)
        unknown = set().union(*(e.free_symbols for e in exprs)) - set(_ARGS)
        assert not unknown, f"unexpected symbols {unknown}"  # the core only uses these
        # Max/Min print as numpy.amax of a tuple, which breaks on scalar/array mixes.
        vector = [e.replace(sp.Max, _VMAX).replace(sp.Min, _VMIN) for e in exprs]
        fn = sp.lambdify(_ARGS, vector, modules=[{"vmax": _vmax, "vmin": _vmin}, "numpy"], docstring_limit=0)
        return cls(exprs, fn)

    def __call__(self, columns: Floats) -> list[Floats]:
        n = columns.shape[0]
        values = self.function(*columns.T)
        return [np.broadcast_to(np.asarray(v, dtype=np.float64), (n,)) for v in values]


@dataclass(frozen=True)
class _StatesKey:
    data: DataParallel
    offload: Offload
    pipelined: bool


@dataclass(frozen=True)
class _StateTrafficKey:
    data: DataParallel
    offload: Offload
    pipelined: bool
    sequence_parallel: bool


@dataclass(frozen=True)
class _ActivationKey:
    pipeline: Pipeline | None
    sequence_parallel: bool
    recompute: Recompute


class Deriver:
    """Derives and caches the component expressions of families for one model and precision."""

    def __init__(self, model: Model, precision: Precision, uneven_stages: bool = False) -> None:
        self.model = model.with_micro_batch(1)  # activation terms are scaled by b afterwards
        self.precision = precision
        # Pipelined families charged ceil(L/p) layers per stage (equal to L/p where p divides L).
        self.uneven_stages = uneven_stages
        self.sizes = group_sizes(self.model)
        self._states: dict[_StatesKey, Vectorized] = {}
        self._state_traffic: dict[_StateTrafficKey, Vectorized] = {}
        self._activations: dict[_ActivationKey, Vectorized] = {}
        self._programs: dict[Family, tuple[Any, StepProgram]] = {}
        self._step_compute: dict[tuple[_ActivationKey, Runtime], tuple[Terms, Vectorized]] = {}
        self._step_state: dict[tuple[_StateTrafficKey, Runtime], tuple[Terms, Vectorized]] = {}
        self.derivations = 0

    def representative(self, family: Family) -> Composition:
        """The family with every axis present (degree 2) and ``m`` symbolic."""
        strategies: list[Strategy] = [LIBRARY["tp"](), LIBRARY["cp"]()]
        if self.model.is_moe:
            strategies.append(LIBRARY["ep"]())
        strategies += family.data.strategies()
        if family.pipeline is not None:
            strategies.append(LIBRARY["pp"]())
        options = family.options(cast(int, MICRO_BATCHES))  # the core reads it through sp.sympify
        if self.uneven_stages and family.pipeline is not None:
            options = replace(options, uneven_stages=True)
        return Composition(tuple(s.with_degree(2) for s in strategies), options)

    def _placement_program(self, family: Family) -> tuple[Any, StepProgram]:
        if family not in self._programs:
            pl = self.representative(family).placement(self.model, symbolic=True)
            self.derivations += 1
            self._programs[family] = (pl, derive_program(pl, self.model, self.sizes))
        return self._programs[family]

    def _state_base(self, family: Family) -> Family:
        return replace(
            family,
            recompute=Recompute.NONE,
            pipeline=Pipeline(Schedule.ONE_F_ONE_B) if family.pipeline is not None else None,
        )

    def step_compute(self, family: Family, runtime: Runtime) -> tuple[Terms, Vectorized]:
        """The step-time terms of the family's compute and activation collectives
        (``formal._steptime.compute_terms``), at b=1, from the program ``activations`` reads."""
        key = (_ActivationKey(family.pipeline, family.sequence_parallel, family.recompute), runtime)
        if key not in self._step_compute:
            _, program = self._placement_program(replace(family, data=DataParallel.DP, offload=Offload.NONE))
            terms = compute_terms(program, self.model, self.precision, runtime)
            self._step_compute[key] = (terms, Vectorized.of(terms.expressions()))
        return self._step_compute[key]

    def step_state(self, family: Family, runtime: Runtime) -> tuple[Terms, Vectorized]:
        """The step-time terms of the family's model-state collectives, optimizer update and host
        transfers (``formal._steptime.state_terms``), from the program ``state_traffic`` reads."""
        tk = _StateTrafficKey(family.data, family.offload, family.pipeline is not None, family.sequence_parallel)
        key = (tk, runtime)
        if key not in self._step_state:
            _, program = self._placement_program(self._state_base(family))
            terms = state_terms(program, self.precision, runtime)
            self._step_state[key] = (terms, Vectorized.of(terms.expressions()))
        return self._step_state[key]

    def states(self, family: Family) -> Vectorized:
        """[model states + buffers on the first stage, on the last stage, host bytes per step]."""
        key = _StatesKey(family.data, family.offload, family.pipeline is not None)
        if key not in self._states:
            base = replace(
                family,
                sequence_parallel=False,
                recompute=Recompute.NONE,
                pipeline=Pipeline(Schedule.ONE_F_ONE_B) if key.pipelined else None,
            )
            pl, program = self._placement_program(base)
            exprs: list[sp.Expr] = []
            for stage in (Stage.FIRST, Stage.LAST):
                mem = memory(pl, self.model, self.precision, self.sizes, stage)
                exprs.append(mem.model_states + (mem.buffers if mem.buffers is not None else 0))
            exprs.append(sum((t[4] for t in transfers(program, self.precision)), sp.Integer(0)))
            self._states[key] = Vectorized.of(exprs)
        return self._states[key]

    def state_traffic(self, family: Family) -> Vectorized:
        """Bytes per device per step of model-state collectives, one expression per axis, for a
        device of each pipeline stage (first, middle, last: ``op_stage_factor``)."""
        key = _StateTrafficKey(family.data, family.offload, family.pipeline is not None, family.sequence_parallel)
        if key not in self._state_traffic:
            _, program = self._placement_program(self._state_base(family))
            self._state_traffic[key] = Vectorized.of(
                [
                    x
                    for stage in STAGES
                    for x in _per_axis(
                        t for t in communication(program, self.precision, stage) if t.state is not State.ACTIVATIONS
                    )
                ]
            )
        return self._state_traffic[key]

    def activations(self, family: Family) -> Vectorized:
        """[activation bytes first stage, last stage, bubble fraction, traffic per axis for a device
        of each pipeline stage (first, middle, last)...] at b=1."""
        key = _ActivationKey(family.pipeline, family.sequence_parallel, family.recompute)
        if key not in self._activations:
            base = replace(family, data=DataParallel.DP, offload=Offload.NONE)
            pl, program = self._placement_program(base)
            exprs: list[sp.Expr] = []
            for stage in (Stage.FIRST, Stage.LAST):
                act = activation_memory(pl, self.model, self.precision, stage)
                exprs.append(act if act is not None else sp.Integer(0))
            exprs.append(bubble_fraction(pl))
            for stage in STAGES:
                exprs += _per_axis(
                    t for t in communication(program, self.precision, stage) if t.state is State.ACTIVATIONS
                )
            self._activations[key] = Vectorized.of(exprs)
        return self._activations[key]


def _per_axis(traffic: Iterable[Any]) -> list[sp.Expr]:
    out = {axis: sp.Integer(0) for axis in AXES}
    for t in traffic:
        out[t.axis] += t.bytes
    return [out[a] for a in AXES]
