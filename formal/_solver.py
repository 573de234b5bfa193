"""The one z3 wrapper of the verdict engine, and the budget every run of it is held to.

Every query of ``formal._smt`` and ``formal._activation_flow`` is a ``Solver`` (a fresh z3
solver whose constraints are tracked under readable names) checked through ``solve``, the one
place z3 is asked anything. ``solve`` keeps z3's ``reason_unknown()`` and charges the query's
work to the run's ``Budget``.

Two limits, so that the same input always gets the same verdict:

* **Work**, z3's resource limit (``rlimit``): a count of elementary solver steps, the same on
  every machine and every run. Each query may spend ``query_rlimit`` units and the whole run
  ``run_rlimit``; a query that needs more is ``unknown`` ("resource limit"), and once the run's
  units are spent the remaining obligations are ``unknown`` without being asked. This is the
  limit that decides: the library's largest query spends about 4,000 units, so the defaults
  leave a margin of four orders of magnitude.
* **Wall clock**, a safety net for a machine that stalls: each query may run ``timeout_ms`` and
  no query starts after the run's deadline. An answer cut by the clock says so ("wall-clock
  limit"): it is the one limit whose outcome can differ between runs, so it is set far beyond
  what the work limit allows.

Either way an obligation that was not decided is ``unknown``, never proved.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import z3

from formal.errors import SolverError

DEFAULT_TIMEOUT_MS = 10_000  # wall clock, per query
DEFAULT_RUN_TIMEOUT_S = 600.0  # wall clock, per run: no query starts after it
DEFAULT_QUERY_RLIMIT = 20_000_000  # z3 resource units, per query
DEFAULT_RUN_RLIMIT = 200_000_000  # z3 resource units, per run

RESOURCE_LIMIT = "resource limit"
WALL_CLOCK_LIMIT = "wall-clock limit"


@dataclass
class Budget:
    """What one run may spend: z3 resource units (deterministic) and wall-clock time."""

    query_rlimit: int = DEFAULT_QUERY_RLIMIT
    run_rlimit: int = DEFAULT_RUN_RLIMIT
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S
    used: int = 0  # resource units spent so far
    started: float = 0.0  # time.monotonic() at the start of the run

    @property
    def left(self) -> int:
        return max(0, self.run_rlimit - self.used)

    def charge(self, units: int) -> None:
        self.used += units


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("placement_semantics_budget", default=None)


@contextlib.contextmanager
def budgeted(budget: Budget) -> Iterator[Budget]:
    """Hold every query made inside the block to ``budget``."""
    budget.started = time.monotonic()
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def current_budget() -> Budget | None:
    return _BUDGET.get()


@dataclass(frozen=True)
class Answer:
    """What one ``check`` said: ``sat``, ``unsat`` or ``unknown`` (with the reason)."""

    result: str
    reason: str
    core: tuple[str, ...]
    model: z3.ModelRef | None
    seconds: float
    units: int = 0  # z3 resource units the query spent


class Solver:
    """A fresh z3 solver for one obligation; every constraint is tracked under a readable name.

    ``track(name, c)`` asserts ``literal => c`` and returns the literal; checks assume the
    literals (all of them unless told otherwise), so unsat cores are sets of names.
    ``timeout_ms`` is the wall-clock limit of each check when no run budget is active (inside
    ``budgeted``, the budget's limits apply).
    """

    def __init__(self, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> None:
        self.solver = z3.SimpleSolver()  # no tactic preamble: ~2x faster on these small queries
        self.timeout_ms = max(1, int(timeout_ms))
        self.literals: list[z3.BoolRef] = []
        self._seen: dict[str, int] = {}

    def track(self, name: str, constraint: z3.BoolRef | bool) -> z3.BoolRef:
        n = self._seen.get(name, 0) + 1
        self._seen[name] = n
        label = name if n == 1 else f"{name}#{n}"
        literal = z3.Bool(label)
        self.solver.add(z3.Implies(literal, constraint))
        self.literals.append(literal)
        return literal

    def check(self, assumptions: Sequence[z3.BoolRef] | None = None) -> Answer:
        return solve(self, self.literals if assumptions is None else assumptions)


def _units(solver: z3.Solver) -> int:
    """z3's resource counter (one per context, cumulative): read before and after a check."""
    stats = solver.statistics()
    return int(stats.get_key_value("rlimit count")) if "rlimit count" in stats.keys() else 0


def solve(tracked: Solver, assumptions: Sequence[z3.BoolRef]) -> Answer:
    """The one place z3 is asked anything."""
    budget = _BUDGET.get()
    timeout_ms, rlimit = tracked.timeout_ms, 0
    if budget is not None:
        if budget.left <= 0:
            return Answer(
                "unknown",
                f"{RESOURCE_LIMIT}: the run's {budget.run_rlimit:,} z3 resource units are spent (--rlimit)",
                (),
                None,
                0.0,
            )
        if time.monotonic() - budget.started > budget.run_timeout_s:
            return Answer("unknown", f"{WALL_CLOCK_LIMIT}: the run passed {budget.run_timeout_s:g} s", (), None, 0.0)
        timeout_ms, rlimit = budget.timeout_ms, min(budget.query_rlimit, budget.left)
    tracked.solver.set("timeout", timeout_ms)
    tracked.solver.set("rlimit", rlimit)  # 0: no limit
    before = _units(tracked.solver)
    start = time.perf_counter()
    try:
        result = tracked.solver.check(*assumptions)
    except z3.Z3Exception as err:
        raise SolverError(f"z3 failed: {err}") from err
    seconds = time.perf_counter() - start
    units = max(0, _units(tracked.solver) - before)
    if budget is not None:
        budget.charge(units)
    if result == z3.sat:
        return Answer("sat", "", (), tracked.solver.model(), seconds, units)
    if result == z3.unsat:
        core = tuple(c.decl().name() for c in tracked.solver.unsat_core())
        return Answer("unsat", "", core, None, seconds, units)
    # z3 says "canceled" (or "timeout") for either limit; the counters say which one it was.
    reason = tracked.solver.reason_unknown() or "unknown"
    if rlimit and units >= rlimit:
        reason = f"{RESOURCE_LIMIT}: the query needed more than {rlimit:,} z3 resource units (--rlimit)"
    elif reason in ("canceled", "timeout") or seconds * 1000 >= timeout_ms:
        reason = f"{WALL_CLOCK_LIMIT}: the query ran past {timeout_ms:,} ms (--timeout-ms)"
    return Answer("unknown", reason, (), None, seconds, units)


__all__ = [
    "DEFAULT_QUERY_RLIMIT",
    "DEFAULT_RUN_RLIMIT",
    "DEFAULT_RUN_TIMEOUT_S",
    "DEFAULT_TIMEOUT_MS",
    "RESOURCE_LIMIT",
    "WALL_CLOCK_LIMIT",
    "Answer",
    "Budget",
    "Solver",
    "budgeted",
    "current_budget",
    "solve",
]
