"""What the CLI prints can be trusted: the activation breakdown in the JSON report, the Megatron
importer's dropout, the planner's reserve and its warning on unknown activations, and the HTML
report's heading and witness tables."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checker._analysis import analyze
from checker._parse import parse
from checker._report import to_json
from formal._model import PRECISIONS, Transformer
from formal._presets import PRESETS
from formal._model import ParameterCount
from formal._schedules import Schedule
from strategies_costs import compositions, transformers

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ZERO = PRECISIONS["zero"]  # 16-bit activations, 1-byte dropout masks (Korthikanti et al. 2022, section 4.1)


# --- 1. activations by group --------------------------------------------------------------


@PROPERTY
@given(compositions(), transformers())
def test_the_activation_groups_sum_to_the_activation_figure(text: str, model: Transformer) -> None:
    """In one document, ``in_flight_micro_batches`` × (the stage's layers + its input/output layers)
    is ``per_device.activations`` for a schedule that defers nothing; each part is rounded up to
    whole bytes, so the sum may exceed the exact figure by under one byte per part and micro-batch."""
    comp = parse(text)
    doc = to_json(analyze(comp, model, ZERO))
    memory = doc["memory"]
    parts = memory["activations_by_group"]
    assert set(parts["layer"]) == set(parts["layers"])
    count = Fraction(str(comp.placement(model).stage_layers(model.layers)))  # L/p, or the uneven share
    for name, per_layer in parts["layer"].items():  # each stage-wide part is one layer's × the layers
        assert (per_layer - 1) * count < parts["layers"][name] <= math.ceil(per_layer * count)
    in_flight = Fraction(parts["in_flight_micro_batches"])
    assert in_flight == Fraction(memory["most_loaded_rank"]["in_flight_micro_batches"])
    whole = sum(parts["layers"].values()) + sum(parts["io"].values())
    figure = memory["per_device"]["activations"]
    if comp.options.schedule is Schedule.ZERO_BUBBLE_H1 and comp.placement(model).pipelined:
        # ZB-H1 keeps at least one whole micro-batch, and at most in-flight wholes plus deferred parts
        assert whole - len(parts["layers"]) - len(parts["io"]) < figure
        assert figure <= in_flight * (whole + parts["deferred"])
        return
    assert parts["deferred"] == 0
    slack = (len(parts["layers"]) + len(parts["io"])) * in_flight
    assert 0 <= in_flight * whole - figure < slack + 1  # figure is the exact total rounded up


def test_gpt3_xl_layer_is_korthikanti_34sbh_plus_5as2b() -> None:
    """GPT-3 XL (1.3B: h 2048, a 16, s 2048, b 1) on one device at 16 bits: each layer keeps
    sbh(34 + 5as/h) = 34sbh + 5as²b bytes (Korthikanti et al. 2022, section 4.1, equation 1)."""
    model = PRESETS["gpt3-1.3b"]
    assert isinstance(model, Transformer)
    s, b, h, a = model.seq, model.micro_batch, model.hidden, model.heads
    doc = to_json(analyze(parse("dp1"), model, ZERO))
    parts = doc["memory"]["activations_by_group"]
    assert sum(parts["layer"].values()) == 34 * s * b * h + 5 * a * s * s * b
    assert parts["layer"] == {"layer_io": 10 * s * b * h, "linear_inner": 24 * s * b * h, "attn_scores": 5 * a * s * s * b}
    assert sum(parts["layers"].values()) == model.layers * (34 * s * b * h + 5 * a * s * s * b)


def test_a_bare_parameter_count_has_no_activation_groups() -> None:
    doc = to_json(analyze(parse("zero3(dp=8)"), ParameterCount(7 * 10**9)))
    assert doc["memory"]["activations_by_group"] is None and doc["memory"]["per_device"]["activations"] is None
