"""Pipeline schedules are objects (formal/_schedules.py): every consumer asks the object, and
each object's spellings and formulas agree with one another."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import sympy as sp

from checker._layout import canonical
from checker._parse import MODIFIERS, parse
from formal._costs import activation_memory, in_flight_micro_batches, stage_in_flight
from formal._model import DEFAULT_PRECISION
from formal._presets import PRESETS
from formal._schedules import DEFAULT_SCHEDULE, SCHEDULES, PipelineSchedule, for_torchtitan, schedule_of
from formal._vocab import Stage

ROOT = Path(__file__).resolve().parents[1]
MODEL = PRESETS["gpt3-1.3b"]  # 24 layers: pp2, pp4 and v2 split them
ALL = list(SCHEDULES.values())


def _text(schedule: PipelineSchedule, pp: int = 4, chunks: int = 2, m: int | None = None) -> str:
    terms = [f"dp2xpp{pp}", *schedule.modifier_terms(chunks)]
    return "x".join(terms + ([f"m{m}"] if m is not None else []))


def test_no_consumer_matches_on_a_schedule_name() -> None:
    """Outside the schedules' own module, a schedule is constructed or passed on, never compared
    with a name: no ``is Schedule.X``, ``== Schedule.X`` or ``case Schedule.X``."""
    compare = re.compile(r"(\bis\b|\bis not\b|==|!=|\bcase\b)\s+Schedule\.")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("formal", "checker")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "_schedules.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if compare.search(line)
    ]
    assert offenders == []


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind.value)
def test_each_schedule_is_spelled_and_read_back(schedule: PipelineSchedule) -> None:
    """The schedule's modifier terms select it, and the canonical text writes them again."""
    comp = parse(_text(schedule))
    assert comp.options.schedule is schedule.kind
    assert comp.options.pipeline_schedule is schedule
    assert comp.options.virtual_stages == (2 if schedule.chunked else 1)
    again = parse(canonical(comp, MODEL))
    assert again.options.schedule is schedule.kind and again.options.virtual_stages == comp.options.virtual_stages
    if schedule.torchtitan is not None:
        assert for_torchtitan(schedule.torchtitan.upper()) is schedule.kind


def test_the_default_schedule_is_the_one_no_modifier_names() -> None:
    assert parse("dp2xpp4").options.schedule is DEFAULT_SCHEDULE
    assert schedule_of(DEFAULT_SCHEDULE).modifier_terms(1) == ()
    assert sum(s.default for s in ALL) == 1


def test_every_schedule_has_its_line_in_the_modifier_list() -> None:
    for schedule in ALL:
        assert MODIFIERS[schedule.help_term] == schedule.help
        assert schedule.chunked or schedule.term == schedule.help_term


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind.value)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_per_stage_counts_meet_the_first_and_last_stage_counts(schedule: PipelineSchedule, pp: int) -> None:
    """With enough micro-batches (m >= 2p), stage 0 holds what the first-stage count says and
    stage p - 1 what the last-stage count says, micro-batches and bytes (what a schedule keeps
    for deferred work included); a middle stage's bound holds every middle stage."""
    layers = 24
    chunks = 2 if schedule.chunked and layers % (pp * 2) == 0 else 1
    for m in (2 * pp, 3 * pp + 1):
        pl = parse(_text(schedule, pp, chunks, m)).placement(MODEL)
        assert stage_in_flight(pl, 0) == in_flight_micro_batches(pl, Stage.FIRST)
        assert stage_in_flight(pl, pp - 1) == in_flight_micro_batches(pl, Stage.LAST)
        memory = {st: activation_memory(pl, MODEL, DEFAULT_PRECISION, st) for st in Stage}
        assert activation_memory(pl, MODEL, DEFAULT_PRECISION, Stage.FIRST, 0) == memory[Stage.FIRST]
        assert activation_memory(pl, MODEL, DEFAULT_PRECISION, Stage.LAST, pp - 1) == memory[Stage.LAST]
        for i in range(1, pp - 1):
            assert stage_in_flight(pl, i) <= in_flight_micro_batches(pl, Stage.MIDDLE)
            middle, bound = activation_memory(pl, MODEL, DEFAULT_PRECISION, Stage.MIDDLE, i), memory[Stage.MIDDLE]
            assert middle is not None and bound is not None  # a Transformer has activations
            assert middle <= bound


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind.value)
def test_the_bubble_shrinks_with_micro_batches_and_vanishes_without_stages(schedule: PipelineSchedule) -> None:
    p, m = sp.Symbol("p", positive=True, integer=True), sp.Symbol("m", positive=True, integer=True)
    v = sp.Integer(2 if schedule.chunked else 1)
    bubble = sp.sympify(schedule.bubble_fraction(p, m, v))  # symbolic degrees: a sympy expression
    assert bubble.subs(p, 1).subs(m, 5) == 0
    values = [bubble.subs({p: 4, m: k}) for k in range(1, 17)]
    assert all(a > b > 0 for a, b in itertools.pairwise(values))
