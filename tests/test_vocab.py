"""The vocabulary's values round-trip through their compact spelling."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_costs import compositions

from checker._parse import parse
from formal._placement import Entry
from formal._strategies import LIBRARY
from formal._verdict import Condition, Status, Verdict
from formal._vocab import Axis, Mode, OpKind, State
from formal.errors import CompositionError


@settings(max_examples=200, deadline=None)
@given(compositions())
def test_parse_of_str_round_trips(text: str) -> None:
    c = parse(text)
    assert parse(str(c)) == c
    assert str(parse(str(c))) == str(c)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(sorted(LIBRARY)), st.integers(1, 64), st.integers(1, 4096))
def test_a_term_without_degree_takes_the_devices_left_over(name: str, degree: int, k: int) -> None:
    c = parse(f"tp{degree}x{name}" if LIBRARY[name]().axis.value != "tp" else name, devices=degree * k)
    assert c.devices == degree * k
    assert parse(str(c)) == c


def test_mode_symbols_and_long_names_round_trip() -> None:
    for mode in Mode:
        assert Mode.parse(mode.value) is mode
        assert Mode.parse(mode.long_name) is mode
        assert Mode.parse(f" {mode.long_name.upper().replace('-', '_')} ") is mode
    assert str(Entry(Mode.SHARDED_GATHER, offset=1, keep_gathered=True)) == "S*@1+hold"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789x*×-_ ", max_size=20))
def test_parse_is_total(text: str) -> None:
    """Every string parses or raises CompositionError (a ValueError naming the input)."""
    try:
        c = parse(text, devices=64)
    except CompositionError as err:
        assert isinstance(err, ValueError)
        assert "\n" not in str(err)
    else:
        assert parse(str(c), devices=64) == c


def test_ordered_enums_print_their_names_and_keep_their_json_labels() -> None:
    """``print(verdict.status)`` says PROVED, not 2; the JSON keeps its lower-case labels."""
    for enum in (Status, Condition):
        for member in enum:
            assert str(member) == member.name and f"{member}" == member.name
            assert member.label == member.name.lower()
    assert Status.REFUTED < Status.UNKNOWN < Status.PROVED  # still ordered
    verdict = Verdict((), ())
    assert str(verdict.status) == "PROVED"
    assert json.loads(json.dumps(verdict.as_json()))["status"] == "proved"


def test_vocabulary_enums_print_their_spelling() -> None:
    """The string enums print the spelling the composition language and the JSON use."""
    assert (str(Axis.DP), str(Mode.SHARDED_GATHER), str(State.PARAMETERS), str(OpKind.ALL_REDUCE)) == (
        "dp",
        "S*",
        "P",
        "all_reduce",
    )
