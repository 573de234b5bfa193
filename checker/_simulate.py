"""``check-composition COMPOSITION --simulate``: the composition on the executable reference.

The composition's degrees, micro-batches and options (and a user program from ``--strategies``,
re-derived for the small model) run on the reference model of ``formal._reference`` over a
simulated mesh, beside single-device training, in exact field arithmetic: the result is a match
(bit for bit) or the first read that differs, with its step, state, device and values. The user's
own model sets the verdict and costs, and the small model's shape: biases, a tied embedding and
experts where the user's model has them (so every group a user program names exists there).

``simulate`` is that run (the public ``checker.simulate``); ``run_simulation`` is the CLI's view
of it, which never raises: what the simulator cannot run is a ``NotSimulated`` answer with its
reason. ``disagreement`` compares the simulation with the z3 verdict of the same run: the two are
independent decisions of one question, so when they differ the tool has a bug, and the CLI says
so first and exits with ``EXIT_DISAGREEMENT``. The simulator is imported on first use: the CLI
does not pay for numpy's reference model unless ``--simulate`` is given.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from checker._toml import StrategyFile
from formal._model import Model, Transformer
from formal._scalars import is_scalar_rule
from formal._strategies import Composition
from formal._verdict import Condition, Status, Verdict
from formal.errors import InputError, SimulationError

if TYPE_CHECKING:
    from formal._reference import ReferenceModel
    from formal._simulator import NotSimulated, SimulationResult

MAX_SIMULATED_DEVICES = 128  # beyond this a simulation takes minutes; the verdict does not need it
EXIT_DISAGREEMENT = 5  # z3 and the executable reference disagree: a bug in the tool
DISAGREEMENT = "z3 and the executable reference disagree: this is a bug in the tool"
RERUN_SEEDS = (101, 202)  # a refuted program that matches is run on fresh data before it counts
# The conditions the simulator decides too (the composition rules are frameworks' restrictions).
SIMULATED_CONDITIONS = (Condition.GRADIENT_INTEGRITY, Condition.STATE_CONSISTENCY)


def reference_model(composition: Composition, model: Model | None = None) -> ReferenceModel:
    """The smallest reference model whose sizes the composition's degrees divide, shaped like
    ``model`` (biases, tied embedding, experts) when it is a transformer."""
    from formal._reference import ReferenceModel
    from formal._simulator import reference_for

    base = ReferenceModel()
    if isinstance(model, Transformer):
        base = ReferenceModel(tied=model.tied_embeddings, bias=model.bias, experts=4 if model.is_moe else 0)
    return reference_for(composition, base)


def simulate(
    composition: Composition,
    strategies: StrategyFile | None = None,
    model: Model | None = None,
    seed: int = 0,
) -> SimulationResult:
    """Run ``composition`` on ``reference_model(composition, model)`` over simulated devices,
    beside single-device training, in exact arithmetic.

    ``strategies``: a user strategy file whose step program (if it has one) replaces the derived
    one. ``SimulationError`` when the simulator cannot run it (sizes the degrees do not divide,
    more than ``MAX_SIMULATED_DEVICES`` devices, a user program that does not fit the reference
    model).
    """
    from formal._program import derive_program
    from formal._simulator import simulate_program

    if composition.devices > MAX_SIMULATED_DEVICES:
        raise SimulationError(f"{composition.devices} devices: the simulator runs at most {MAX_SIMULATED_DEVICES}")
    reference = reference_model(composition, model)
    transformer = reference.transformer()
    placement = composition.placement(transformer)
    if strategies is not None:
        try:
            program = strategies.program_for(placement, transformer)
        except InputError as err:  # e.g. a group of the user's model the small one does not have
            raise SimulationError(f"the user program does not fit the reference model: {err}") from err
    else:
        program = derive_program(placement, transformer)
    return simulate_program(program, reference, seed=seed)


def try_simulate(
    composition: Composition,
    strategies: StrategyFile | None = None,
    model: Model | None = None,
    seed: int = 0,
) -> SimulationResult | NotSimulated:
    """``simulate``, or why it cannot run (the reference model lacks what the program needs)."""
    from formal._simulator import NotSimulated

    try:
        return simulate(composition, strategies, model, seed)
    except InputError as err:  # SimulationError, a user program that does not fit the small model
        return NotSimulated(str(err))


def run_simulation(
    composition: Composition,
    user: StrategyFile | None = None,
    model: Model | None = None,
    verdict: Verdict | None = None,
) -> tuple[dict[str, Any], str]:
    """The ``simulation`` JSON object and the human line(s) for it.

    With ``verdict``: a match of a program z3 refuted is run again on fresh data
    (``RERUN_SEEDS``) and ``fresh_seeds_match`` says whether it matched there too, since two
    different rationals can meet by accident in the field (``formal._reference``).
    """
    start = time.perf_counter()
    result = try_simulate(composition, user, model)
    from formal._simulator import NotSimulated

    if isinstance(result, NotSimulated):
        return result.as_json(), f"simulation: {result}"
    reference = reference_model(composition, model)
    doc: dict[str, Any] = result.as_json()
    doc["reference_model"] = {
        "layers": reference.layers,
        "hidden": reference.hidden,
        "heads": reference.heads,
        "ffn": reference.ffn,
        "vocab": reference.vocab,
        "seq": reference.seq,
        "micro_batch": reference.micro_batch,
        "tied_embeddings": reference.tied,
        "bias": reference.bias,
        "experts": reference.experts,
    }
    if result.matches and verdict is not None and _refuted_on_simulated_conditions(verdict):
        doc["fresh_seeds_match"] = all(
            getattr(try_simulate(composition, user, model, seed), "matches", False) for seed in RERUN_SEEDS
        )
    line = simulation_line(result)
    scalars = _scalar_run(composition, user, model)
    if scalars is not None:
        doc["scalars"] = scalars
        line += "\n" + _scalar_line(scalars)
    doc["seconds"] = round(time.perf_counter() - start, 3)
    return doc, line


def _scalar_run(composition: Composition, user: StrategyFile | None, model: Model | None) -> dict[str, Any] | None:
    """The scalar reference (``formal/_sim_scalars.py``) on the program's scalars, three seeds;
    None when the program computes none. The training simulator does not run them."""
    from formal._program import derive_program
    from formal._sim_scalars import simulate_scalars

    transformer = reference_model(composition, model).transformer()
    placement = composition.placement(transformer)
    try:
        program = (
            user.program_for(placement, transformer) if user is not None else derive_program(placement, transformer)
        )
    except InputError:
        return None
    if not program.scalars and not placement.options.scalars.any:
        return None
    for seed in (0, *RERUN_SEEDS):
        found = simulate_scalars(program, seed)
        if found is not None:
            return {"matches": False, "seed": seed, "mismatch": found.__dict__}
    return {"matches": True, "seeds": 1 + len(RERUN_SEEDS)}


def _scalar_line(scalars: Mapping[str, Any]) -> str:
    if scalars["matches"]:
        return f"scalars: the scalar reference matches single-device training ({scalars['seeds']} seeds)"
    m = scalars["mismatch"]
    return (
        f"scalars: {m['scalar']} differs on device {m['device']}: {m['value']} where single-device "
        f"training has {m['single_device']}"
    )


def simulation_line(result: SimulationResult) -> str:
    """The human line for a simulation that ran."""
    if result.matches:
        costs = (
            "memory and traffic equal the cost model's"
            if not result.cost_mismatches
            else "cost figures differ: " + "; ".join(result.cost_mismatches[:3])
        )
        return (
            f"simulation: matches single-device training bit for bit ({result.devices} devices, "
            f"{result.steps} steps, reference model); {costs}"
        )
    d = result.divergence
    assert d is not None
    return (
        f"simulation: diverges at step {d.step}, {d.phase}, {d.state.value}.{d.group.name} {d.element} "
        f"on device {d.device} ({d.coordinates}): single device {d.expected}, simulated {d.got}"
    )


def _refuted_on_simulated_conditions(verdict: Verdict) -> bool:
    """Refuted by a rule the training simulator runs (the scalars' rules have their own reference)."""
    return verdict.status is Status.REFUTED and any(
        v.condition in SIMULATED_CONDITIONS and not is_scalar_rule(v.rule) for v in verdict.violations
    )


def disagreement(verdict: Verdict, simulation: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``disagreement`` JSON object when z3 and the simulation answer differently, else None.

    Proved but diverges: a soundness bug (z3 accepts a program that does not train like one
    device). Refuted on gradient integrity or state consistency but matching on three seeds: a
    completeness bug. Unknown (never proved) and not simulated are no answers, so never disagree.
    """
    matches = simulation.get("matches")
    if matches is None:
        return None
    z3 = verdict.status
    scalars = simulation.get("scalars")
    scalar_refuted = any(is_scalar_rule(v.rule) for v in verdict.violations)
    if z3 is Status.PROVED and matches is False:
        kind = "soundness"
    elif isinstance(scalars, Mapping) and z3 is Status.PROVED and scalars.get("matches") is False:
        kind = "soundness"
    elif isinstance(scalars, Mapping) and scalar_refuted and scalars.get("matches") is True:
        kind = "completeness"
    elif (
        z3 is Status.REFUTED
        and matches is True
        and _refuted_on_simulated_conditions(verdict)
        and simulation.get("fresh_seeds_match", True)
    ):
        kind = "completeness"
    else:
        return None
    divergence = simulation.get("divergence")
    return {
        "message": DISAGREEMENT,
        "kind": kind,
        "z3": z3.label,
        "rules": [v.rule for v in verdict.violations],
        "simulation": "matches single-device training" if matches else "diverges from single-device training",
        "divergence": divergence,
        "exit_code": EXIT_DISAGREEMENT,
    }


def disagreement_text(conflict: Mapping[str, Any]) -> str:
    """The lines the human report starts with."""
    z3 = f"z3: {conflict['z3']}" + (f" ({', '.join(conflict['rules'])})" if conflict["rules"] else "")
    sim = f"simulation: {conflict['simulation']}"
    d = conflict.get("divergence")
    if isinstance(d, Mapping):
        sim += (
            f" at step {d['step']}, {d['phase']}, {d['state']}.{d['group']} {d['element']} on device "
            f"{d['device']} ({d['coordinates']}): single device {d['expected']}, simulated {d['got']}"
        )
    return f"{conflict['message']} ({conflict['kind']})\n  {z3}\n  {sim}"


__all__ = [
    "DISAGREEMENT",
    "EXIT_DISAGREEMENT",
    "MAX_SIMULATED_DEVICES",
    "disagreement",
    "disagreement_text",
    "reference_model",
    "run_simulation",
    "simulate",
    "try_simulate",
]
