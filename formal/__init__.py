"""placement-semantics: strategies as placements; costs and verdicts derived from them.

The public API is listed in ``__all__``; implementation lives in underscored modules.
"""

from formal._costs import (
    Memory,
    Traffic,
    bubble_fraction,
    communication,
    in_flight_micro_batches,
    memory,
    most_loaded,
    total_bytes,
    transfers,
)
from formal._model import (
    DEFAULT_PRECISION,
    PRECISIONS,
    Ffn,
    Model,
    Norm,
    ParameterCount,
    Precision,
    Transformer,
    megatron_parameter_count,
)
from formal._placement import Entry, Options, Placement, Recompute, Schedule, Strategy
from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES, DEFAULT_MODEL, PRESETS
from formal._program import Op, Origin, StepProgram, derive_program, gradient_origins, group_sizes
from formal._smt import decide
from formal._strategies import LIBRARY, Composition
from formal._verdict import Condition, Obligation, Status, Verdict, Violation
from formal._vocab import Axis, Group, Mode, OpKind, Phase, Reduce, State
from formal.errors import (
    CompositionError,
    InexactError,
    InputError,
    ModelError,
    PlacementError,
    SimulationError,
    SolverError,
    StrategyFileError,
)

__all__ = [
    "Condition",
    "Obligation",
    "Status",
    "Verdict",
    "Violation",
    "decide",
    "DEFAULT_DEVICES",
    "DEFAULT_DEVICE_MEMORY",
    "DEFAULT_MODEL",
    "DEFAULT_PRECISION",
    "LIBRARY",
    "PRECISIONS",
    "PRESETS",
    "Axis",
    "Composition",
    "CompositionError",
    "Entry",
    "Ffn",
    "Group",
    "InexactError",
    "InputError",
    "Memory",
    "Mode",
    "Model",
    "ModelError",
    "Norm",
    "Op",
    "OpKind",
    "Options",
    "Origin",
    "ParameterCount",
    "Phase",
    "Placement",
    "PlacementError",
    "Precision",
    "Recompute",
    "Reduce",
    "Schedule",
    "SimulationError",
    "SolverError",
    "State",
    "StepProgram",
    "Strategy",
    "StrategyFileError",
    "Traffic",
    "Transformer",
    "bubble_fraction",
    "communication",
    "derive_program",
    "gradient_origins",
    "group_sizes",
    "in_flight_micro_batches",
    "megatron_parameter_count",
    "memory",
    "most_loaded",
    "total_bytes",
    "transfers",
]
