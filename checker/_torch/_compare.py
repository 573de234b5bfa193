"""Predicted against measured, as rows: the comparison types every PyTorch driver reports in
(the fake-group table, the gloo ranks, the large-model runs)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from formal._strategies import Composition

ACTIVATION_TOLERANCE = 0.10  # Korthikanti's per-layer count against everything autograd saves
PEAK_TOLERANCE = 0.03  # the per-device peak the CLI prints against the memory tracker's peak total
PEAK = "peak total"  # the row of the per-device peak (present where a tracker measured it)


@dataclass(frozen=True)
class Row:
    quantity: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        return 0.0 if self.measured == self.predicted else (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Comparison:
    composition: Composition
    engine: str
    stage: str
    rows: tuple[Row, ...]  # parameters, gradients, optimizer, model states, activations
    predicted_calls: tuple[object, ...]
    measured_calls: tuple[object, ...]
    seconds: float
    rank: int = 0
    engine_prediction: Any = None  # formal._engine_effects.EnginePrediction of the prediction

    @property
    def peak_within(self) -> bool:
        """The per-device peak within ``PEAK_TOLERANCE`` of the tracker's (True without a peak row)."""
        return all(abs(r.error) <= PEAK_TOLERANCE for r in self.rows if r.quantity == PEAK)

    def row(self, quantity: str) -> Row:
        return next(r for r in self.rows if r.quantity == quantity)

    @property
    def calls_equal(self) -> bool:
        return Counter(self.predicted_calls) == Counter(self.measured_calls)

    @property
    def model_states_exact(self) -> bool:
        return all(r.error == 0 for r in self.rows if r.quantity not in ("activations", PEAK))

    @property
    def activations_within(self) -> bool:
        return abs(self.row("activations").error) <= ACTIVATION_TOLERANCE

    @property
    def ok(self) -> bool:
        return self.model_states_exact and self.calls_equal and self.activations_within and self.peak_within


def state_rows(predicted: Any, measured: Any) -> tuple[Row, ...]:
    """Parameters, gradients, optimizer state and their sum, predicted against measured (any
    two objects with those byte counts: a ``Prediction`` and a ``Measured``)."""
    return (
        Row("parameters", predicted.parameters, measured.parameters),
        Row("gradients", predicted.gradients, measured.gradients),
        Row("optimizer", predicted.optimizer, measured.optimizer),
        Row(
            "model states",
            predicted.parameters + predicted.gradients + predicted.optimizer,
            measured.parameters + measured.gradients + measured.optimizer,
        ),
    )


def pct(x: float) -> str:
    return "exact" if x == 0 else f"{x:+.2%}"


__all__ = ["ACTIVATION_TOLERANCE", "PEAK", "PEAK_TOLERANCE", "Comparison", "Row", "pct", "state_rows"]
