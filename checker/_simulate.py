"""``check-composition COMPOSITION --simulate``: the composition on the executable reference.

The composition's degrees, micro-batches and options (and a user program from ``--strategies``,
re-derived for the small model) run on the reference model of ``formal._reference`` over a
simulated mesh, beside single-device training, in exact field arithmetic: the result is a match
(bit for bit) or the first read that differs, with its step, state, device and values. The user's
own model sets only the verdict and costs; the simulation always uses the small model.

``simulate`` is that run (the public ``checker.simulate``); ``run_simulation`` is the CLI's view
of it. The simulator is imported on first use: the CLI does not pay for numpy's reference model
unless ``--simulate`` is given.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from checker._toml import StrategyFile
from formal._strategies import Composition
from formal.errors import SimulationError

if TYPE_CHECKING:
    from formal._reference import ReferenceModel
    from formal._simulator import SimulationResult

MAX_SIMULATED_DEVICES = 128  # beyond this a simulation takes minutes; the verdict does not need it


def reference_model(composition: Composition) -> ReferenceModel:
    """The smallest reference model whose sizes the composition's degrees divide."""
    from formal._reference import ReferenceModel
    from formal._simulator import reference_for

    return reference_for(composition, ReferenceModel())


def simulate(composition: Composition, strategies: StrategyFile | None = None) -> SimulationResult:
    """Run ``composition`` on ``reference_model(composition)`` over simulated devices, beside
    single-device training, in exact arithmetic.

    ``strategies``: a user strategy file whose step program (if it has one) replaces the derived
    one. ``SimulationError`` when the composition uses something the simulator does not model
    (expert parallelism, more than ``MAX_SIMULATED_DEVICES`` devices).
    """
    from formal._program import derive_program
    from formal._simulator import simulate_program

    if composition.devices > MAX_SIMULATED_DEVICES:
        raise SimulationError(f"{composition.devices} devices: the simulator runs at most {MAX_SIMULATED_DEVICES}")
    model = reference_model(composition)
    transformer = model.transformer()
    placement = composition.placement(transformer)
    if strategies is not None:
        program = strategies.program_for(placement, transformer)
    else:
        program = derive_program(placement, transformer)
    return simulate_program(program, model)


def run_simulation(composition: Composition, user: StrategyFile | None = None) -> tuple[dict[str, Any], str]:
    """The ``simulation`` JSON object and the human line(s) for it."""
    start = time.perf_counter()
    try:
        result = simulate(composition, user)
    except SimulationError as err:
        return _not_run(str(err))
    seconds = time.perf_counter() - start
    model = reference_model(composition)
    doc: dict[str, Any] = result.as_json()
    doc["reference_model"] = {
        "layers": model.layers,
        "hidden": model.hidden,
        "heads": model.heads,
        "ffn": model.ffn,
        "vocab": model.vocab,
        "seq": model.seq,
        "micro_batch": model.micro_batch,
        "tied_embeddings": model.tied,
    }
    doc["seconds"] = round(seconds, 3)
    if result.matches:
        costs = (
            "memory and traffic equal the cost model's"
            if not result.cost_mismatches
            else "cost figures differ: " + "; ".join(result.cost_mismatches[:3])
        )
        text = (
            f"simulation: matches single-device training bit for bit ({result.devices} devices, "
            f"{result.steps} steps, reference model); {costs}"
        )
    else:
        d = result.divergence
        assert d is not None
        text = (
            f"simulation: diverges at step {d.step}, {d.phase}, {d.state.value}.{d.group.name} {d.element} "
            f"on device {d.device} ({d.coordinates}): single device {d.expected}, simulated {d.got}"
        )
    return doc, text


def _not_run(reason: str) -> tuple[dict[str, Any], str]:
    return {"matches": None, "not_run": reason}, f"simulation: not run: {reason}"


__all__ = ["MAX_SIMULATED_DEVICES", "reference_model", "run_simulation", "simulate"]
