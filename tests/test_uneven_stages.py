"""Declared uneven pipeline stages (docs/semantics.md, "Composition rules", rule 1: the layers divide
by pp x chunks unless uneven stages are declared).

Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B (126 layers) trains on
pp 16, so the stages cannot hold equal layer counts; Megatron-LM's layout gives the fullest
stage ceil(126/16) = 8 layers, which is what the cost model charges.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import cast

import sympy as sp
from click.testing import CliRunner

from checker._parse import MODIFIERS, parse
from checker.cli import main
from formal._costs import activation_memory, state_memory
from formal._model import DEFAULT_PRECISION, Transformer
from formal._presets import PRESETS
from formal._program import group_sizes
from formal._vocab import LAYER_GROUPS, Axis, State

LLAMA3_405B = cast(Transformer, PRESETS["llama3-405b"])


def test_modifier_parses_and_round_trips() -> None:
    assert "uneven" in MODIFIERS
    c = parse("tp8xpp16xdp2xuneven")
    assert c.options.uneven_stages
    assert str(c) == "tp8xpp16xdp2xuneven"
    assert str(parse(str(c))) == str(c)
    assert not parse("tp8xpp16xdp2").options.uneven_stages


def test_uneven_given_twice_is_an_error() -> None:
    import pytest

    from formal.errors import CompositionError

    with pytest.raises(CompositionError, match="uneven"):
        parse("pp16xunevenxuneven")


def test_fullest_stage_holds_ceil_of_layers_over_pp() -> None:
    assert LLAMA3_405B.layers == 126
    pl = parse("pp16xuneven").placement(LLAMA3_405B)
    assert pl.layer_share == sp.Rational(8, 126)
    assert pl.stage_layers(LLAMA3_405B.layers) == 8
    nbytes = DEFAULT_PRECISION.bytes_of(State.PARAMETERS)
    elements = LLAMA3_405B.group_elements()
    rows = dict(state_memory(pl, State.PARAMETERS, group_sizes(LLAMA3_405B), DEFAULT_PRECISION).by_group)
    layer_groups = [g for g in elements if g in LAYER_GROUPS]
    assert layer_groups
    for g in layer_groups:
        # Computed independently: the group's total over 126 layers, 8 of them on this stage.
        assert rows[g] == sp.Integer(elements[g] * nbytes) * sp.Rational(8, 126)
        assert isinstance(rows[g], int | Fraction)  # exact, never a float
    total = sum((rows[g] for g in layer_groups), sp.Integer(0))
    assert total == sp.Rational(8 * nbytes * sum(elements[g] for g in layer_groups), 126)


def test_activations_count_the_fullest_stage() -> None:
    uneven = parse("pp16xunevenxm16").placement(LLAMA3_405B)
    even = parse("pp16xm16").placement(LLAMA3_405B)
    a_uneven = activation_memory(uneven, LLAMA3_405B, DEFAULT_PRECISION)
    a_even = activation_memory(even, LLAMA3_405B, DEFAULT_PRECISION)
    assert a_uneven is not None and a_even is not None
    # With dropout the first stage also keeps p = 16 micro-batches of the input embeddings'
    # dropout mask, sbhp (Korthikanti et al. 2022, section 4.3, 1-byte masks, t = 1), whatever
    # its layers; Llama 3 trains without dropout, so it keeps none.
    m = LLAMA3_405B
    embedding = m.seq * m.micro_batch * m.hidden * 16 if m.dropout else 0
    assert Fraction(a_uneven - embedding) / (a_even - embedding) == sp.Rational(8 * 16, 126)  # 8 layers, not 126/16


def test_divisible_layers_are_unchanged() -> None:
    model = cast(Transformer, PRESETS["llama2-7b"])  # 32 layers
    assert model.layers % 4 == 0
    even = parse("tp2xpp4xdp2xm8").placement(model)
    uneven = parse("tp2xpp4xdp2xm8xuneven").placement(model)
    assert uneven.layer_share == sp.Rational(1, 4)
    assert uneven.stage_layers(model.layers) == even.stage_layers(model.layers) == 8
    sizes = group_sizes(model)
    for state in (State.PARAMETERS, State.GRADIENTS, State.OPTIMIZER):
        assert (
            state_memory(even, state, sizes, DEFAULT_PRECISION).by_group
            == state_memory(uneven, state, sizes, DEFAULT_PRECISION).by_group
        )
    assert activation_memory(even, model, DEFAULT_PRECISION) == activation_memory(uneven, model, DEFAULT_PRECISION)
    assert even.degree(Axis.PP) == 4


def test_check_proves_llama3_405b_with_uneven_stages() -> None:
    out = CliRunner().invoke(main, ["tp8xpp16xdp2xuneven", "--model", "llama3-405b", "--devices", "256", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["verdict"]["status"] == "proved"
    assert report["options"]["uneven_stages"] is True


def test_check_refutes_llama3_405b_without_uneven() -> None:
    out = CliRunner().invoke(main, ["tp8xpp16xdp2", "--model", "llama3-405b", "--devices", "256"])
    assert out.exit_code == 1, out.output
    assert "divides[layers, pp]" in out.output


def test_uneven_stages_still_hold_a_layer_each() -> None:
    out = CliRunner().invoke(main, ["pp256xuneven", "--model", "llama3-405b", "--devices", "256", "--json"])
    assert out.exit_code == 1, out.output
    report = json.loads(out.output)
    assert report["verdict"]["status"] == "refuted"
    assert [v["rule"] for v in report["verdict"]["violations"]] == ["stages_hold_layers[pp]"]
