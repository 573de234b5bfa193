"""Memory on every pipeline stage: the JSON's ``memory.per_stage`` and the HTML report's chart.

Independent expectations: the most-loaded device is the heaviest stage (its kind and numbers are
``per_device``'s), model states depend only on the kind of stage (the first holds the embedding,
the last the head, the middle ones neither), and 1F1B's stage i keeps min(p - i, m) micro-batches
of activations (Narayanan et al. 2021, section 2.2), so activations fall from stage 0 to p - 1.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies_costs import compositions, models

from checker._analysis import analyze
from checker._html import render_html
from checker._parse import parse
from checker._report import to_json
from formal._model import PRECISIONS, Model, Transformer
from formal._presets import PRESETS

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers", "model_states", "total")


@PROPERTY
@given(compositions(), models(), st.sampled_from(sorted(PRECISIONS)))
def test_the_most_loaded_device_is_the_heaviest_stage(text: str, model: Model, precision: str) -> None:
    doc = to_json(analyze(parse(text), model, PRECISIONS[precision]))
    stages = doc["memory"]["per_stage"]
    p = doc["mesh"].get("pp", 1)
    assert [s["stage"] for s in stages] == list(range(p))
    per = doc["memory"]["per_device"]
    index = 0 if doc["memory"]["most_loaded_rank"]["pipeline_stage"] == "first" else p - 1
    assert {k: stages[index][k] for k in PARTS} == per
    totals = [s["total"] for s in stages]
    assert per["total"] == max(totals), (text, totals)
    middle = stages[1:-1]
    for key in ("parameters", "gradients", "optimizer"):  # one value per kind of stage
        assert len({s[key] for s in middle}) <= 1, (text, key)


def test_1f1b_activations_follow_the_micro_batches_each_stage_keeps() -> None:
    """Llama 2 7B on pp4 with m 16 under 1F1B: stage i keeps min(4 - i, 16) = 4 - i micro-batches
    of its 8 layers; the first and last stage add their input/output layers' activations."""
    model = PRESETS["llama2-7b"]
    assert isinstance(model, Transformer)
    doc = to_json(analyze(parse("pp4xm16", devices=4), model))
    acts = [s["activations"] for s in doc["memory"]["per_stage"]]
    # the middle stages hold layers only: 3 and 2 micro-batches of the same layers
    assert acts[1] * 2 == acts[2] * 3
    assert acts[0] > acts[1] > acts[2]
    assert doc["memory"]["per_stage"][0]["activations"] == doc["memory"]["per_device"]["activations"]


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.cells: list[str] = []
        self._in_stages = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img" and a.get("id"):
            self.ids.append(str(a["id"]))
        if tag == "section":
            self._in_stages = a.get("id") == "stages"

    def handle_data(self, data: str) -> None:
        if self._in_stages and data.strip():
            self.cells.append(data.strip())


def test_html_report_charts_every_pipeline_stage() -> None:
    doc = to_json(analyze(parse("tp2xzero3xpp4", devices=64), PRESETS["llama2-7b"]))
    page = _Images()
    page.feed(render_html(doc))
    assert page.ids == ["memory-chart", "stage-chart"]
    for stage in doc["memory"]["per_stage"]:  # every stage's total, as the JSON has it, in GB
        assert f"{stage['total'] / 1e9:,.2f}" in page.cells
    assert [c for c in page.cells if re.fullmatch(r"\d", c)] == ["0", "1", "2", "3"]
    flat = _Images()
    flat.feed(render_html(to_json(analyze(parse("zero3", devices=8), PRESETS["llama2-7b"]))))
    assert flat.ids == ["memory-chart"]  # no pipeline: the memory section is the one stage
