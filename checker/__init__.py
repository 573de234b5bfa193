"""placement-semantics' Python API: a composition in, its memory, communication and verdict out.

``formal`` is the model (states, modes, placements, step programs, costs, the z3 encoding, the
simulator) and never imports ``checker``, where the composition language lives; this package is
the one public entry to both::

    composition = checker.parse("tp2xzero3xpp4", devices=64)
    analysis = checker.analyze(composition, checker.PRESETS["llama2-7b"])
    verdict = checker.decide(composition, analysis.program, analysis.model)
    result = checker.simulate(composition)  # the small reference model on simulated devices
    imported = checker.load_config(Path("ds_config.json"), devices=64)  # .composition, .unmapped
    report = checker.Report(analysis, verdict)  # .as_json(): the document of docs/schema.md

The names below are re-exported from their one home (``formal`` or ``checker``'s underscored
modules); ``__all__`` lists them and ``tests/test_public_api.py`` pins it. The simulator's types
and the config readers load on first use, so that the CLI does not import the reference model
unless it simulates, nor the DeepSpeed/Megatron/torchtitan readers unless it reads a config.
"""

from __future__ import annotations

import gc as _gc
from typing import TYPE_CHECKING, Any

# Importing the package (sympy, z3, rich: several hundred thousand long-lived objects) would run
# the cyclic garbage collector some 180 times over an ever larger heap, about a tenth of the
# import's time, to free next to nothing. Collection is paused while the package imports and
# restored after (left off if the caller had turned it off).
_collecting = _gc.isenabled()
_gc.disable()
try:
    from checker._analysis import Analysis, analyze
    from checker._import_common import Imported, Unmapped
    from checker._parse import MODIFIERS, parse
    from checker._report import Report
    from checker._simulate import reference_model, simulate
    from checker._toml import StrategyFile
    from checker._toml import load as load_strategies
    from formal._costs import Memory, Traffic
    from formal._model import DEFAULT_PRECISION, PRECISIONS, Model, ParameterCount, Precision, Transformer
    from formal._placement import Entry, Options, Placement, Recompute, Schedule, Strategy
    from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES, DEFAULT_MODEL, PRESETS
    from formal._program import Op, StepProgram
    from formal._smt import decide
    from formal._strategies import LIBRARY, Composition
    from formal._verdict import Condition, Obligation, Status, Verdict, Violation
    from formal._vocab import Axis, Group, Mode, State
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
finally:
    if _collecting:
        _gc.enable()

if TYPE_CHECKING:
    from checker._importers import load_config
    from formal._reference import ReferenceModel
    from formal._simulator import Divergence, SimulationResult

_LAZY = {
    "load_config": "checker._importers",
    "Divergence": "formal._simulator",
    "SimulationResult": "formal._simulator",
    "ReferenceModel": "formal._reference",
}


def __getattr__(name: str) -> Any:
    """The simulator's types and ``load_config``, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'checker' has no attribute {name!r}")


__all__ = [
    # the four entry points, and a user strategy file
    "analyze",
    "decide",
    "load_config",
    "load_strategies",
    "parse",
    "reference_model",
    "simulate",
    # values
    "DEFAULT_DEVICES",
    "DEFAULT_DEVICE_MEMORY",
    "DEFAULT_MODEL",
    "DEFAULT_PRECISION",
    "LIBRARY",
    "MODIFIERS",
    "PRECISIONS",
    "PRESETS",
    "Analysis",
    "Axis",
    "Composition",
    "Condition",
    "Divergence",
    "Entry",
    "Group",
    "Imported",
    "Memory",
    "Mode",
    "Model",
    "Obligation",
    "Op",
    "Options",
    "ParameterCount",
    "Placement",
    "Precision",
    "Recompute",
    "ReferenceModel",
    "Report",
    "Schedule",
    "SimulationResult",
    "State",
    "Status",
    "StepProgram",
    "Strategy",
    "StrategyFile",
    "Traffic",
    "Transformer",
    "Unmapped",
    "Verdict",
    "Violation",
    # errors
    "CompositionError",
    "InexactError",
    "InputError",
    "ModelError",
    "PlacementError",
    "SimulationError",
    "SolverError",
    "StrategyFileError",
]
