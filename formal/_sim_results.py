"""What a simulation reports, and the judge that compares every read with single-device training.

``Divergence`` is the first read that differs, ``OpTraffic`` what one op of the program sent,
``SimulationResult`` the whole run with the cost model's figures beside the measured ones.
``_Judge`` holds the step being run and single-device training's record of it; a read that
differs raises ``_Diverged``, which the run loop catches.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from formal._reference import FLOAT_TOLERANCE, Arithmetic, Array, IndexArray, Numbers, ReferenceModel, StepRecord
from formal._sim_mesh import Device, _Mesh
from formal._vocab import Group, State

O = State.OPTIMIZER  # noqa: E741


@dataclass(frozen=True)
class Divergence:
    """The first read that differs from single-device training."""

    step: int
    phase: str
    micro_batch: int | None
    state: State
    group: Group
    device: Device
    coordinates: str  # "dp=1,tp=0"
    position: int
    element: str  # "layer 1 qkv[3, 0, 5]"
    expected: str
    got: str
    exact: bool  # bit-for-bit comparison (else within the float tolerance)

    def __str__(self) -> str:
        mb = f", micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        return (
            f"step {self.step} {self.phase}{mb}: {self.state.value}.{self.group.name} {self.element} "
            f"on device {self.device} ({self.coordinates}): expected {self.expected}, got {self.got}"
        )

    def as_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "phase": self.phase,
            "micro_batch": self.micro_batch,
            "state": self.state.value,
            "group": self.group.name,
            "device": self.device,
            "coordinates": self.coordinates,
            "position": self.position,
            "element": self.element,
            "expected": self.expected,
            "got": self.got,
            "comparison": "bit-for-bit" if self.exact else "tolerance",
        }


@dataclass(frozen=True)
class OpTraffic:
    """What the simulator measured for one op of the program, on its most loaded device."""

    index: int
    op: str
    calls: int  # per step
    elements: int | None  # per call (None: never called)
    bytes: Fraction  # per device per step (collectives: ring algorithm; transfers: the tensor)
    expected_bytes: Fraction | None  # the cost model's figure


@dataclass(frozen=True)
class SimulationResult:
    matches: bool
    divergence: Divergence | None
    steps: int
    devices: int
    arithmetic: Arithmetic
    traffic: tuple[OpTraffic, ...]
    memory: tuple[tuple[str, State, int, int], ...]  # (stage, state, simulated bytes, cost-model bytes)
    host: tuple[tuple[str, int, int], ...]  # (stage, simulated host bytes, cost-model host bytes)
    complete: bool  # ran every step (False when it stopped at the divergence)

    @property
    def cost_mismatches(self) -> tuple[str, ...]:
        """Every measured figure that differs from the cost model (empty: they agree)."""
        if not self.complete:
            return ()
        out = [
            f"op {t.index} {t.op}: simulated {t.bytes} bytes/step, cost model {t.expected_bytes}"
            for t in self.traffic
            if t.expected_bytes is not None and t.bytes != t.expected_bytes
        ]
        out += [
            f"{stage} {state.value}: simulated {sim} bytes, cost model {cost}"
            for stage, state, sim, cost in self.memory
            if sim != cost
        ]
        out += [
            f"{stage} host: simulated {sim} bytes, cost model {cost}" for stage, sim, cost in self.host if sim != cost
        ]
        return tuple(out)

    def as_json(self) -> dict[str, object]:
        return {
            "matches": self.matches,
            "steps": self.steps,
            "devices": self.devices,
            "arithmetic": self.arithmetic.value,
            "comparison": "bit-for-bit"
            if self.arithmetic is Arithmetic.FIELD
            else f"relative tolerance {FLOAT_TOLERANCE}",
            "divergence": None if self.divergence is None else self.divergence.as_json(),
            "cost_model_agrees": not self.cost_mismatches if self.complete else None,
            "cost_mismatches": list(self.cost_mismatches),
        }


@dataclass(frozen=True)
class NotSimulated:
    """A program the simulator does not run, and why (a typed answer, never a traceback)."""

    reason: str

    def __str__(self) -> str:
        return f"not simulated: {self.reason}"

    def as_json(self) -> dict[str, object]:
        return {"matches": None, "not_run": self.reason}


class _Diverged(Exception):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(str(divergence))
        self.divergence = divergence


class _Judge:
    """Compares reads with single-device training's record of the step being run.

    The run loop sets ``step`` and ``ref`` before each step.
    """

    def __init__(self, model: ReferenceModel, mesh: _Mesh, numbers: Numbers) -> None:
        self.model, self.mesh, self.n = model, mesh, numbers
        self.step = 0
        self.ref: StepRecord | None = None

    @property
    def record(self) -> StepRecord:
        """Single-device training's record of the current step."""
        if self.ref is None:
            raise AssertionError("no step is being run")
        return self.ref

    def check(
        self,
        state: State,
        group: Group,
        dev: Device,
        positions: IndexArray,
        got: Array,
        expected: Array,
        phase: str,
        micro_batch: int | None,
    ) -> None:
        if not len(positions):
            return
        exact = self.n.kind is Arithmetic.FIELD
        ok = self.n.equal(expected, got, exact)
        if ok.all():
            return
        bad = np.argwhere(~ok)[0]
        col = int(bad[-1])
        pos = int(positions[col])
        exp_v = expected[tuple(bad)]
        got_v = got[tuple(bad)]
        element = self.model.locate(group, pos)
        if state is O and got.ndim == 2:
            element += f" slot {int(bad[0])}"
        raise _Diverged(
            Divergence(
                self.step,
                phase,
                micro_batch,
                state,
                group,
                dev,
                self.mesh.text(dev),
                pos,
                element,
                self.n.as_text(exp_v),
                self.n.as_text(got_v),
                exact,
            )
        )
