"""Hypothesis profiles: ``ci`` (the default: a few minutes on two cores) and ``thorough``.

Select with ``pytest --hypothesis-profile=thorough`` (or ``HYPOTHESIS_PROFILE=thorough``). The
differential tests scale their example counts from the active profile's ``max_examples`` (the
exploring test: 80 programs under ``ci``, ten times ``max_examples`` otherwise, i.e. 20,000 under
``thorough``; ``EXPLORE_PROGRAMS`` and ``EXPLORE_SECONDS`` bound a long run by count and time).
"""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=2_000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The planner's z3 verdict cache (checker/_plan_cache.py) of a test run lives in a fresh
# directory of its own, never the user's cache.
os.environ.setdefault("PLACEMENT_SEMANTICS_CACHE", tempfile.mkdtemp(prefix="placement-semantics-cache-"))

_SUMMARY = pytest.StashKey[list[str]]()

# Slow groups, by module, so that ``pytest -m "not slow"`` is the fast subset a developer runs
# (about three minutes on two cores): the PyTorch engines, the proof runner, the thousand-program
# differential run and the CLI run as subprocesses. CI runs everything.
_GROUPS = {
    "torch": (
        "test_torch_equivalence",
        "test_torch_gloo",
        "test_torch_large",
        "test_torch_validation",
        "test_torch_isolation",
        "test_torch_ddp_tracker",
        "test_torch_recompute",
        "test_torch_pipeline_data",
        "test_torch_pipeline_ddp",
        "test_torch_llama",
    ),
    "proofs": ("test_proofs",),
    "differential": ("test_differential",),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        owner = item.module if isinstance(item, pytest.Function) else None  # a test function's module
        module = owner.__name__.rpartition(".")[2] if owner is not None else ""
        for marker, modules in _GROUPS.items():
            if module in modules:
                item.add_marker(getattr(pytest.mark, marker))
                item.add_marker(pytest.mark.slow)


@pytest.fixture
def z3_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every z3 query answers ``unknown`` (reason "timeout"), as a real timeout would."""
    import formal._smt as smt
    import formal._solver as solver

    real = solver.solve

    def gives_up(tracked: solver.Solver, assumptions: object) -> solver.Answer:
        answer = real(tracked, assumptions)  # type: ignore[arg-type]
        return solver.Answer("unknown", "timeout", (), None, answer.seconds)

    monkeypatch.setattr(solver, "solve", gives_up)
    monkeypatch.setattr(smt, "_MEMO", {})  # remembered answers would bypass the patched solver


@pytest.fixture
def summary_lines(request: pytest.FixtureRequest) -> list[str]:
    """Lines a test wants printed at the end of the run (case counts, disagreements, times)."""
    return request.config.stash.setdefault(_SUMMARY, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(_SUMMARY, [])
    if lines:
        terminalreporter.section("differential testing")
        for line in lines:
            terminalreporter.write_line(line)
