"""Machine-checked obligations for placement semantics: run ``python -m proofs``.

``all_obligations()`` lists every obligation (sufficiency, necessity, composition, costs,
refinement, programs, scalars) in a stable order; ``proofs/README.md`` maps each paper claim to its written proof,
its obligation and its Lean theorem.
"""

from __future__ import annotations

from proofs._obligation import Obligation, Result, discharge


def all_obligations() -> list[Obligation]:
    from proofs import (
        activations,
        composition,
        costs,
        holdings,
        necessity,
        programs,
        refinement,
        scalars,
        sufficiency,
    )

    return (
        sufficiency.obligations()
        + necessity.obligations()
        + activations.obligations()
        + composition.obligations()
        + costs.obligations()
        + refinement.obligations()
        + programs.obligations()
        + holdings.obligations()
        + scalars.obligations()
    )


def discharge_index(index: int) -> tuple[int, Result]:
    """Discharge ``all_obligations()[index]`` (a worker's task: pickled by module and name)."""
    return index, discharge(all_obligations()[index])


__all__ = ["Obligation", "Result", "all_obligations", "discharge", "discharge_index"]
