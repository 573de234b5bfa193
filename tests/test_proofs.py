"""The proof obligations cannot pass vacuously, and ``python -m proofs`` runs as CI runs it.

Deleting any single condition from the sufficiency hypotheses makes the inductive step fail:
z3 then finds a program, a model and an optimizer on which a read or a live copy differs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from formal._verdict import Status
from proofs._machine import AxisClass, MeshAxis, conditions, symbolic_features
from proofs.sufficiency import step_obligation

MESHES = [(MeshAxis(cls, 2),) for cls in AxisClass]
CASES = [(mesh, name) for mesh in MESHES for name in conditions(mesh, symbolic_features(mesh))]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: str(m[0]))
def test_every_program_satisfying_both_conditions_is_proved(mesh: tuple[MeshAxis, ...]) -> None:
    assert step_obligation(mesh).status is Status.PROVED


@pytest.mark.parametrize(("mesh", "condition"), CASES, ids=[f"{m[0]}-{n}" for m, n in CASES])
def test_deleting_one_condition_refutes_the_step(mesh: tuple[MeshAxis, ...], condition: str) -> None:
    outcome = step_obligation(mesh, drop=frozenset({condition}))
    assert outcome.status is Status.REFUTED, (condition, outcome)


def test_every_condition_kind_is_exercised() -> None:
    kinds = {name.split("[")[0] for _, name in CASES}
    assert kinds == {
        "grad_reduced_once",
        "grad_not_reduced",
        "grad_normalised",
        "gather_before_forward",
        "gather_before_backward",
        "kv_exchanged",
        "aligned_gradients",
        "aligned_parameters",
        "aligned_refresh",
        "refreshed",
        "fetch_before_forward",
        "fetch_before_backward",
    }


def test_python_m_proofs_exits_zero_and_reports_rows() -> None:
    # The fast families here (the full run is CI's ``python -m proofs`` step).
    for family in ("necessity.", "costs.", "sufficiency.normalisation", "programs.", "scalars."):
        done = subprocess.run(
            [sys.executable, "-m", "proofs", "--json", "--jobs", "1", "--only", family],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert report["total"] > 0 and report["proved"] == report["total"]
        for row in report["obligations"]:
            assert {"name", "statement", "method", "status", "seconds"} <= row.keys()
