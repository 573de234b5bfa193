"""The verdict's solver budget counts work, not time: the same input gets the same verdict on every
run, whatever ran before it in the process, and whatever the budget cuts short is unknown."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from checker._parse import parse
from formal._presets import PRESETS
from formal._program import derive_program
from formal._smt import clear_cache, decide
from formal._verdict import Status, Verdict

MODEL = PRESETS["gpt3-1.3b"]


def _verdict(text: str, **limits: int) -> Verdict:
    comp = parse(text, devices=16)
    return decide(comp, derive_program(comp.placement(MODEL), MODEL), MODEL, **limits)


def _shape(v: Verdict) -> list[tuple[str, Status, str]]:
    return [(o.name, o.status, o.reason_unknown) for o in v.obligations]


def test_a_full_run_reports_the_units_it_spent() -> None:
    clear_cache()
    v = _verdict("tp2xzero3xpp4")
    assert v.status is Status.PROVED
    assert 0 < v.units < v.rlimit
    assert v.as_json()["solver"] == {"resource_units": v.units, "resource_budget": v.rlimit}


@settings(max_examples=12, deadline=None)
@given(
    st.sampled_from(["dp4", "zero3", "tp2xzero3xpp4", "fsdp4xdpr2xtp2", "tp2xspxpp2xm4xdp2"]),
    st.fractions(min_value=0, max_value=1),
)
def test_a_budget_cut_is_unknown_cold_and_warm(text: str, share: object) -> None:
    clear_cache()
    full = _verdict(text).units
    budget = max(1, int(full * share))  # type: ignore[operator]
    clear_cache()
    for v in (_verdict(text, rlimit=budget), _verdict(text, rlimit=budget)):  # cold, then remembered answers
        assert v.units <= budget
        if budget < full:
            assert v.status is Status.UNKNOWN  # cut short: never proved
        cut = [o for o in v.obligations if o.status is Status.UNKNOWN]
        assert all(o.reason_unknown.startswith("resource limit") for o in cut)
        assert (v.status is Status.UNKNOWN) == bool(cut)


def test_remembered_answers_are_charged_what_they_cost() -> None:
    clear_cache()
    cold = _verdict("tp2xzero3xpp4")
    warm = _verdict("tp2xzero3xpp4")
    # The composition rules and the activation exchanges are asked again; every other answer is
    # remembered and charged its cold cost, so the two runs spend (nearly) the same units.
    assert abs(cold.units - warm.units) <= cold.units // 100


def test_a_spent_budget_leaves_the_remaining_obligations_unasked() -> None:
    clear_cache()
    v = _verdict("tp2xzero3xpp4", rlimit=1)
    unknown = [o for o in v.obligations if o.status is Status.UNKNOWN]
    assert len(unknown) == len(v.obligations)
    assert any("are spent" in o.reason_unknown for o in unknown)


def test_the_cli_answers_the_same_way_on_every_run() -> None:
    """A budget that cuts the run part-way: three fresh processes give the identical verdict."""
    answers = set()
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-m", "checker.cli", "tp2xzero3xpp4", "--rlimit", "20000", "--json"],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        assert done.returncode == 3, done.stderr
        verdict = json.loads(done.stdout)["verdict"]
        assert 0 < len(verdict["unknown"]) < verdict["obligations"]  # part-way, not at the first query
        answers.add(json.dumps([verdict["status"], verdict["unknown"], verdict["solver"]]))
    assert len(answers) == 1


def test_a_remembered_answer_is_not_reused_under_a_smaller_query_limit() -> None:
    """Each query may spend ``query_rlimit`` units and one unit decides nothing: every obligation
    is unknown, cold and after the same obligations were decided (and remembered) under the
    default per-query limit. An answer decided with more units is not one the smaller limit gets."""
    clear_cache()
    cold = _verdict("tp2xzero3xpp4", query_rlimit=1)
    assert _verdict("tp2xzero3xpp4").status is Status.PROVED  # remembered under the default limit
    warm = _verdict("tp2xzero3xpp4", query_rlimit=1)
    assert _shape(warm) == _shape(cold)
    for v in (cold, warm):
        assert v.status is Status.UNKNOWN
        assert all(o.status is Status.UNKNOWN for o in v.obligations)
        assert all(
            o.reason_unknown.startswith("resource limit: the query needed more than 1 z3 resource units")
            for o in v.obligations
        )


def test_no_query_starts_after_the_runs_wall_clock_deadline() -> None:
    """A run whose deadline has passed asks z3 nothing more: with no time at all every obligation
    is unknown, for the wall clock, never proved."""
    clear_cache()
    v = _verdict("tp2xzero3xpp4", run_timeout_s=0)
    assert v.status is Status.UNKNOWN and v.units == 0
    assert all(
        o.status is Status.UNKNOWN and o.reason_unknown.startswith("wall-clock limit: the run passed")
        for o in v.obligations
    )
