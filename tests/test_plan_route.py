"""The planner builds each candidate's ``Composition`` directly from its family (one route, no
text): the object must be the one the composition language's parser gives for the candidate's
text, and that text must be canonical."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from checker._parse import parse
from checker._plan_space import Family, Space
from formal._presets import PRESETS

MODELS = ("gpt3-1.3b", "mixtral-8x7b")


@st.composite
def members(draw: st.DrawFn) -> tuple[Family, tuple[int, ...], int, bool]:
    """A family of the default space with degrees in ``AXES`` order, a micro-batch count and the
    uneven flag; degrees of axes the family has no strategy for stay 1."""
    model = PRESETS[draw(st.sampled_from(MODELS))]
    family = draw(st.sampled_from(Space().families(model)))
    tp, cp, dp = (draw(st.sampled_from((1, 2, 4, 8))) for _ in range(3))
    ep = draw(st.sampled_from((1, 2))) if model.is_moe else 1
    dpr = draw(st.sampled_from((1, 2))) if family.data.value == "hsdp" else 1
    pp = draw(st.sampled_from((2, 4))) if family.pipeline is not None else 1
    return family, (tp, cp, ep, dp, dpr, pp), draw(st.sampled_from((1, 4, 16))), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(members())
def test_a_candidate_composition_is_what_the_parser_reads_from_its_text(
    member: tuple[Family, tuple[int, ...], int, bool],
) -> None:
    family, degrees, m, uneven = member
    direct = family.composition(degrees, m, uneven)
    text = family.text(degrees, m, uneven)
    assert str(direct) == text
    assert parse(text) == direct
