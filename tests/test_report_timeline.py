"""The step timeline per pipeline stage in ``--report`` HTML, drawn from the step-time model.

The expected widths come from the model's own per-stage seconds (``StepTime.stages``), checked
first against the step they must add up to; the page is parsed with html.parser.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from checker._parse import parse
from checker.cli import main
from formal._hardware import PRESETS
from formal._model import PRECISIONS
from formal._presets import PRESETS as MODELS
from formal._program import derive_program
from formal._steptime import step_time


class _Rects(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rects: list[dict[str, str]] = []
        self.inside = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "svg" and dict(attrs).get("id") == "step-timeline":
            self.inside = True
        elif tag == "rect" and self.inside:
            a = {k: v or "" for k, v in attrs}
            if "class" in a:
                self.rects.append(a)

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.inside = False


def test_every_stage_adds_up_to_its_step_and_the_slowest_sets_it() -> None:
    model = MODELS["llama2-7b"]
    pl = parse("tp2xpp4xm8xdp2").placement(model)
    t = step_time(derive_program(pl, model), model, PRECISIONS["zero"], PRESETS["a100-80gb"])
    assert [s.stage.value for s in t.stages] == ["first", "middle", "last"]
    for s in t.stages:
        rest = s.step - s.compute - s.communication - s.bubble
        assert rest == pytest.approx(t.optimizer_seconds + t.host_seconds, rel=1e-9, abs=1e-12)
    assert max(s.step for s in t.stages) == pytest.approx(t.step_seconds)
    assert next(s for s in t.stages if s.stage is t.stage).step == pytest.approx(t.step_seconds)


def test_report_draws_each_stage_to_scale(tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    out = CliRunner().invoke(main, ["tp2xpp4xm8xdp2", "--hardware", "a100-80gb", "--report", str(page)])
    assert out.exit_code == 0, out.output
    model = MODELS["llama2-7b"]
    pl = parse("tp2xpp4xm8xdp2").placement(model)
    t = step_time(derive_program(pl, model), model, PRECISIONS["zero"], PRESETS["a100-80gb"])
    parser = _Rects()
    parser.feed(page.read_text(encoding="utf-8"))
    rows: dict[str, float] = {}
    for r in parser.rects:
        rows[r["y"]] = rows.get(r["y"], 0.0) + float(r["width"])
    assert len(rows) == len(t.stages) == 3
    widths = [rows[y] for y in sorted(rows, key=float)]
    longest = max(s.step for s in t.stages)
    for width, s in zip(widths, t.stages, strict=True):  # to scale: width / step the same for all
        assert width / widths[0] == pytest.approx(s.step / t.stages[0].step, rel=1e-3)
    assert max(widths) == pytest.approx(720 - 70 - 10, rel=1e-3) and longest == pytest.approx(t.step_seconds)
    classes = {r["class"] for r in parser.rects}
    assert {"compute", "communication", "bubble"} <= classes


def test_no_timeline_without_hardware(tmp_path: Path) -> None:
    page = tmp_path / "r.html"
    out = CliRunner().invoke(main, ["tp2xpp4xm8xdp2", "--report", str(page)])
    assert out.exit_code == 0, out.output
    assert 'id="step-timeline"' not in page.read_text(encoding="utf-8")
