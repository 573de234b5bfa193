"""One analysis of a composition: text -> composition -> placement -> program -> costs.

Everything downstream (human report, JSON, HTML) reads an ``Analysis``; nothing re-derives a
placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from formal import _num as num
from formal._costs import (
    Memory,
    Traffic,
    bubble_fraction,
    busiest_stage_traffic,
    in_flight_micro_batches,
    memory,
    model_state_paper_units,
    most_loaded,
    total_bytes,
    transfers,
)
from formal._engine_deepspeed import DeepSpeedEffects
from formal._engine_effects import Engine, EnginePrediction, engine_prediction
from formal._exact import exact
from formal._model import DEFAULT_PRECISION, Model, Precision
from formal._num import Num
from formal._placement import Placement
from formal._program import StepProgram, derive_program, group_sizes
from formal._strategies import Composition
from formal._vocab import Group, Stage


@dataclass(frozen=True)
class Analysis:
    composition: Composition
    model: Model
    precision: Precision
    placement: Placement
    program: StepProgram
    memory: Memory
    traffic: tuple[Traffic, ...]
    transfers: tuple[tuple[str, object, object, str, Num], ...]
    device_memory: int | None
    traffic_stage: Stage = Stage.FIRST  # the pipeline stage whose device sends the most (``traffic``'s)
    reserve: int = 0  # bytes of device memory kept back for the runtime (``--reserve``)
    engine: EnginePrediction | None = None  # the declared engine's terms on its most-loaded device
    deepspeed: DeepSpeedEffects | None = None  # DeepSpeed's settings (an imported config's; None: defaults)

    @property
    def peak(self) -> int:
        """The per-device peak a user reads: the engine's (placement + its named terms) when an
        engine is declared, else the placement's own figure (the paper's number)."""
        if self.engine is not None:
            return self.engine.total
        return int(num.ceiling(exact(self.memory.total)))

    @property
    def communication_bytes(self) -> Num:
        return total_bytes(self.traffic)

    @property
    def model_state_psi(self) -> Num:
        """Model-state traffic in units of the parameter count (ZeRO paper, section 7)."""
        return exact(num.ratio(model_state_paper_units(self.traffic), self.model.parameter_count()))

    @property
    def fits(self) -> bool | None:
        """Whether the most-loaded device's total and the runtime's ``reserve`` fit its memory."""
        if self.device_memory is None:
            return None
        return bool(self.peak + self.reserve <= self.device_memory)

    @property
    def bubble(self) -> Num:
        return bubble_fraction(self.placement)

    @cached_property
    def symbolic_memory(self) -> Memory:
        """The most-loaded device's memory as expressions in the degrees (``d_dp``, ...): the
        composition's placement with every degree a symbol. Derived when first read (the JSON's
        ``expressions``), never for the terminal report, which shows numbers only."""
        symbolic = self.composition.placement(self.model, symbolic=True)
        return most_loaded(symbolic, self.model, self.precision, group_sizes(self.model))

    @property
    def in_flight(self) -> Num:
        return in_flight_micro_batches(self.placement, self.memory.stage)  # of the most-loaded stage


def analyze(
    composition: Composition,
    model: Model,
    precision: Precision = DEFAULT_PRECISION,
    device_memory: int | None = None,
    program: StepProgram | None = None,
    reserve: int = 0,
    engine: Engine | None = None,
    deepspeed: DeepSpeedEffects | None = None,
) -> Analysis:
    """Placement, step program, memory (the most-loaded pipeline stage) and communication (the
    stage that sends the most) of ``composition`` on ``model``, bytes per ``precision``
    (default: the ZeRO paper's mixed-precision Adam, 2 + 2 + 12 bytes per parameter).

    ``device_memory`` (bytes) and ``reserve`` (bytes kept back for the
    runtime) set ``Analysis.fits``; ``program`` replaces the derived step
    program (a user's, of this composition's placement, which is then read from it). The placement
    is built once; the symbolic one (degrees as symbols) is derived only when the memory
    expressions are read (``Analysis.symbolic_memory``).
    ``engine``: the training engine whose effects are added (``formal._engine_effects``), on the
    pipeline stage where placement and effects together are largest; None: the placement only.
    ``deepspeed``: DeepSpeed's settings for ``Engine.DEEPSPEED`` (None: DeepSpeed's defaults).
    """
    if program is None:
        placement = composition.placement(model)
        program = derive_program(placement, model)
    else:  # a user's program, derived from the composition's placement: that placement, not a new one
        placement = program.placement
    sizes = group_sizes(model)
    mem = most_loaded(placement, model, precision, sizes)
    traffic_stage, traffic = busiest_stage_traffic(program, precision)
    engine_pred = None if engine is None else engine_peak(placement, model, precision, sizes, engine, deepspeed)
    return Analysis(
        composition=composition,
        model=model,
        precision=precision,
        placement=placement,
        program=program,
        memory=mem,
        traffic=traffic,
        transfers=transfers(program, precision),
        device_memory=device_memory,
        traffic_stage=traffic_stage,
        reserve=reserve,
        engine=engine_pred,
        deepspeed=deepspeed,
    )


def engine_peak(
    placement: Placement,
    model: Model,
    precision: Precision,
    sizes: Mapping[Group, Num],
    engine: Engine,
    deepspeed: DeepSpeedEffects | None = None,
) -> EnginePrediction:
    """The engine's prediction on the device with the largest peak (first or last pipeline
    stage; without a pipeline the one kind of device)."""
    stages = (Stage.FIRST, Stage.LAST) if placement.pipelined and placement.pipeline_degree != 1 else (Stage.FIRST,)
    candidates = [
        engine_prediction(
            placement,
            model,
            precision,
            memory(placement, model, precision, sizes, st),
            engine,
            st,
            deepspeed=deepspeed,
        )
        for st in stages
    ]
    return max(candidates, key=lambda e: e.total)
