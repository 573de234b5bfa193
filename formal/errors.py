"""Exceptions of the placement model: one root, one subclass per kind of failure."""

from __future__ import annotations


class PlacementError(Exception):
    """Root of every exception raised by ``formal`` and ``checker``."""


class InputError(PlacementError, ValueError):
    """Raised when user input (a composition, a model, a number, a file) is malformed.

    The message echoes the user's own spelling and fits on one line.
    """


class ModelError(InputError):
    """Raised when a model description is impossible (negative sizes, absurd counts)."""


class CompositionError(InputError):
    """Raised when a composition string does not parse."""


class StrategyFileError(InputError):
    """Raised when a user strategy/program TOML file is malformed."""


class SolverError(PlacementError):
    """Raised when z3 itself fails (not when it answers unknown: that is a verdict)."""


class InexactError(PlacementError, ValueError):
    """Raised when a value that must be an exact rational (a degree, a scale, a byte count) is a
    float or a symbolic expression: it is refused, never rounded."""


class SimulationError(InputError):
    """Raised when a composition or program uses something the reference simulator does not model."""
