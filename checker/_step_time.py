"""``check``'s step time when hardware is given (``--device-flops``, bandwidths): the planner's
model (``checker._plan_costs.StepTimeModel``) applied to one analysed composition.

Step time = compute x (1 + bubble) + per axis, the bytes each device moves along it over that
axis's bandwidth + host-device bytes over PCIe. Compute is the training FLOPs per step
(Narayanan et al. 2021, eq. 3, with recomputation's extra forward) at peak FLOP/s; communication
does not overlap compute (an upper bound). A bare parameter count has no FLOPs per token: its
step time is its communication time alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from checker._analysis import Analysis
from checker._plan_costs import StepTimeModel
from checker._plan_space import AXES, Cluster
from formal._costs import ceil_int
from formal._exact import exact
from formal._model import Transformer

__all__ = ["StepTime", "step_time"]


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, by part."""

    compute_s: float
    bubble_s: float
    communication_s: float
    host_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.communication_s + self.host_s


def step_time(analysis: Analysis, cluster: Cluster, sequences: int) -> StepTime:
    """The step time of ``analysis`` on ``cluster``; ``sequences``: the global batch per step."""
    timing = StepTimeModel(cluster)
    model = analysis.model
    tokens = sequences * (model.seq if isinstance(model, Transformer) else 0)
    compute = timing.compute_seconds(model, analysis.composition.options.recompute, tokens)
    mesh = dict(analysis.placement.mesh)
    degrees = np.array([[int(mesh.get(axis, 1)) for axis in AXES]], dtype=np.int64)
    bandwidth = timing.bandwidths(degrees)[0]
    communication = 0.0
    for t in analysis.traffic:
        communication += ceil_int(t.bytes) / float(bandwidth[AXES.index(t.axis)])
    host = sum(ceil_int(v) for *_, v in analysis.transfers) / cluster.host_bandwidth
    bubble = float(Fraction(str(exact(analysis.bubble))))
    return StepTime(compute, compute * bubble, communication, host)
