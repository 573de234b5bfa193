"""The composition rules the planner checks from numbers: the workload's own (the replicas divide
the global batch) and the correctness rules of ``formal._rules`` (the table z3 decides),
vectorised over the candidate meshes of a family.

``checker._planner`` is the entry (docs/planner.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import numpy as np

from checker._numbers import MAX_DEGREE
from checker._plan_space import _DP, _DPR, _EP, _PP, AXES, Bools, DataParallel, Family, Ints
from formal._model import Model
from formal._rules import Provenance, Setting, applicable
from formal._strategies import LIBRARY
from formal._vocab import Axis


def _divides(x: Ints, n: int) -> Bools:
    return cast(Bools, n % x == 0)


def mesh_rules(model: Model, global_batch: int, uneven: bool, deg: Ints, b: Ints) -> dict[str, Bools]:
    """The workload's own rule, before any family: the replicas divide the global batch (so
    that the micro-batch count m is a whole number)."""
    replicas = deg[:, _DP] * deg[:, _DPR] * deg[:, _EP] * b
    # The micro-batch count is spelled m<N> in the composition, whose degrees are bounded.
    return {"batch": _divides(replicas, global_batch), "micro_batches_bounded": global_batch // replicas <= MAX_DEGREE}


class _ArrayTerms:
    """``formal._rules.Terms`` over numpy arrays: one row per candidate mesh. An axis is present
    when its degree exceeds 1 (the planner's compositions leave degree-1 axes out)."""

    def __init__(self, deg: Ints, m: Ints) -> None:
        self._deg, self._m = deg, m

    def degree(self, axis: Axis) -> Ints:
        return self._deg[:, AXES.index(axis)]

    def present(self, axis: Axis) -> Bools:
        return self.degree(axis) > 1

    def size(self, name: str, value: int) -> int:
        return value

    def flag(self, name: str, value: bool) -> bool:
        return value

    def implies(self, a: Any, b: Any) -> Bools:
        return cast(Bools, np.logical_or(np.logical_not(a), b))

    @property
    def micro_batches(self) -> Ints:
        return self._m


def family_setting(family: Family, model: Model, uneven: bool) -> Setting:
    """The rules' setting of a family: its modifiers, every axis of the planner's mesh, and the
    library strategies it places with (its data strategy, tp, cp, ep, pp), whose modes the
    placement rules (split computation, data assignment) read."""
    strategies = (*family.data.strategies(), *(LIBRARY[a.value]() for a in (Axis.TP, Axis.CP, Axis.EP, Axis.PP)))
    return Setting(model, replace(family.options(1), uneven_stages=uneven), frozenset(AXES), strategies=strategies)


def family_rules(family: Family, model: Model, uneven: bool, deg: Ints, m: Ints) -> dict[str, Bools]:
    """The correctness rules of ``formal._rules`` (the table z3 decides), vectorised over the
    candidate meshes, and the family's own canonical form (a family with a pipeline has pp > 1,
    HSDP both of its axes, ZeRO/FSDP a dp axis: otherwise it is another family's candidate).
    Framework rules filter nothing: they become notes on the candidates that break them."""
    terms, setting = _ArrayTerms(deg, m), family_setting(family, model, uneven)
    rules: dict[str, Bools] = {}
    for rule in applicable(setting, Provenance.CORRECTNESS):
        rules[rule.name] = np.broadcast_to(np.asarray(rule.holds(terms, setting), dtype=bool), (deg.shape[0],))
    p, dp, dpr = deg[:, _PP], deg[:, _DP], deg[:, _DPR]
    if family.pipeline is None:
        rules["no_pipeline_means_pp1"] = p == 1
    else:
        rules["pipeline_needs_pp"] = p > 1
    if family.data is DataParallel.HSDP:
        rules["hsdp_needs_both_axes"] = (dp > 1) & (dpr > 1)
    else:
        rules["dpr_only_with_hsdp"] = dpr == 1
        if family.data is not DataParallel.DP:
            rules["sharding_needs_dp"] = dp > 1  # ZeRO/FSDP at dp=1 is DP
    return rules
