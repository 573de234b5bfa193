"""What the CLI prints can be trusted: the activation breakdown in the JSON report, the Megatron
importer's dropout, the planner's reserve and its warning on unknown activations, and the HTML
report's heading and witness tables."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies_costs import compositions, transformers

from checker._analysis import analyze
from checker._html import render_html
from checker._import_common import ConfigError
from checker._import_megatron import import_megatron
from checker._parse import parse
from checker._report import to_json
from checker.cli import main
from formal._model import PRECISIONS, ParameterCount, Transformer
from formal._presets import DEFAULT_MODEL, PRESETS
from formal._schedules import Schedule
from formal._verdict import Condition, Obligation, Status, Verdict, Violation

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
    sbh = s * b * h
    assert parts["layer"] == {"layer_io": 10 * sbh, "linear_inner": 24 * sbh, "attn_scores": 5 * a * s * s * b}
    assert sum(parts["layers"].values()) == model.layers * (34 * s * b * h + 5 * a * s * s * b)


def test_a_bare_parameter_count_has_no_activation_groups() -> None:
    doc = to_json(analyze(parse("zero3(dp=8)"), ParameterCount(7 * 10**9)))
    assert doc["memory"]["activations_by_group"] is None and doc["memory"]["per_device"]["activations"] is None


# --- 2. Megatron dropout -----------------------------------------------------------------

MEG_GPT = [  # GPT-3 XL's dimensions (Brown et al. 2020, Table 2.1) with GPT-2's tokenizer
    "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
    "--seq-length", "2048", "--tokenizer-type", "GPT2BPETokenizer",
]  # fmt: skip
rates = st.sampled_from(["0", "0.0", "0.1", "0.05", "1e-1", "0.00"])


@given(st.none() | rates, st.none() | rates, st.booleans())
@settings(max_examples=30, deadline=None)
def test_megatron_dropout_is_off_only_when_both_rates_are_zero(
    attention: str | None, hidden: str | None, sized: bool
) -> None:
    """Megatron-LM's defaults are 0.1 for both (``megatron/training/arguments.py``); the model
    keeps dropout masks unless both rates are zero (Korthikanti et al. 2022, section 4.1)."""
    args = list(MEG_GPT) if sized else []
    if attention is not None:
        args += ["--attention-dropout", attention]
    if hidden is not None:
        args += ["--hidden-dropout", hidden]
    out = import_megatron(args, devices=8)
    off = attention is not None and hidden is not None and Fraction(attention) == 0 == Fraction(hidden)
    model = out.transformer or PRESETS[out.model or DEFAULT_MODEL]  # what check analyses
    assert isinstance(model, Transformer)
    expected = PRESETS["gpt3-1.3b"] if sized else PRESETS[DEFAULT_MODEL]
    assert isinstance(expected, Transformer)
    same = ("layers", "hidden", "heads", "kv_heads_", "ffn_", "ffn_kind", "norm", "bias", "experts")
    assert all(getattr(model, k) == getattr(expected, k) for k in same)
    if sized or attention is not None or hidden is not None:  # the rates (default 0.1) decide
        assert model.dropout is not off
    else:  # the default model, which the arguments do not describe, keeps its own setting
        assert model.dropout is expected.dropout
    one_zero = [r for r in (attention, hidden) if r is not None and Fraction(r) == 0]
    assert any("one dropout setting" in u.why for u in out.unmapped) == (len(one_zero) == 1 and not off)


def test_megatron_dropout_zero_applies_to_a_given_model_and_drops_the_masks(tmp_path: Path) -> None:
    """Through ``check --from``: no dropout removes the masks, so the per-layer activations are
    Korthikanti et al. 2022's 34sbh + 5as²b (section 4.1) less the two sbh residual masks, the as²b
    score mask, and the dropout's 2as²b output (without dropout the V product reads the softmax
    output it already keeps): 32sbh + 2as²b."""
    script = tmp_path / "train.sh"
    rates = " --bf16 --attention-dropout 0 --hidden-dropout 0\n"
    script.write_text("torchrun pretrain_gpt.py " + " ".join(MEG_GPT) + rates)
    ran = CliRunner().invoke(main, ["check", "--from", str(script), "--model", "gpt3-1.3b", "--devices", "1", "--json"])
    assert ran.exit_code == 0, ran.output
    doc = json.loads(ran.stdout)
    m = PRESETS["gpt3-1.3b"]
    assert isinstance(m, Transformer)
    s, b, h, a = m.seq, m.micro_batch, m.hidden, m.heads
    layer = doc["memory"]["activations_by_group"]["layer"]
    assert doc["precision"]["activations"] == 2  # --bf16
    assert sum(layer.values()) == 32 * s * b * h + 2 * a * s * s * b


def test_megatron_dropout_rate_that_is_not_a_rate_is_refused() -> None:
    with pytest.raises(ConfigError, match="--hidden-dropout"):
        import_megatron(["--hidden-dropout", "1.5"], devices=8)
    with pytest.raises(ConfigError, match="--attention-dropout"):
        import_megatron(["--attention-dropout", "none"], devices=8)


# --- 3. plan --reserve -------------------------------------------------------------------

PSI = 7 * 10**9  # ZeRO-3 on 8 devices keeps 16 Psi / 8 bytes of model states (Rajbhandari et al. 2020, Figure 1)
# ZeRO-3 by name runs on DeepSpeed, which keeps a reduce bucket of ``reduce_bucket_size`` = 5e8
# elements (deepspeed/runtime/zero/config.py) of 2-byte gradients for the whole run (stage3.py).
DS_BUCKET = 500_000_000 * 2


def _json(*args: str) -> dict[str, Any]:
    ran = CliRunner().invoke(main, list(args))
    if ran.exception is not None and not isinstance(ran.exception, SystemExit):
        raise ran.exception
    doc: dict[str, Any] = json.loads(ran.stdout)
    return doc


@given(st.sampled_from(["0", "1GB", "4GB", "6.5GB"]), st.sampled_from([-1, 0, 1, -(10**9)]))
@settings(max_examples=6, deadline=None)
def test_plan_and_check_agree_on_fit_with_the_same_reserve(reserve: str, delta: int) -> None:
    """A composition fits when its peak + reserve <= device memory, in ``check`` and ``plan``
    alike; here the peak is ZeRO-3's 16 Psi / N and DeepSpeed's reduce bucket, so the device
    memory is set at the boundary."""
    kept = 0 if reserve == "0" else int(Fraction(reserve.removesuffix("GB")) * 10**9)
    capacity = 16 * PSI // 8 + DS_BUCKET + kept + delta
    common = ["--params", "7e9", "--device-memory", str(capacity), "--reserve", reserve]
    checked = _json("check", "zero3(dp=8)", *common, "--json")
    pins = ["--fix", "dp=8,tp=1,pp=1,cp=1", "--data", "zero3", "--micro-batch", "1", "--top", "10"]
    planned = _json("plan", *common, "--devices", "8", *pins, "--json")
    fits = 16 * PSI // 8 + DS_BUCKET + kept <= capacity
    assert checked["memory"]["fits"] is fits and checked["memory"]["reserve"] == kept
    shown = [c for c in planned["candidates"] if c["composition"] == checked["composition"]]  # no offload
    assert planned["reserve"] == kept and bool(shown) is fits
    assert all(c["memory_bytes"] + kept <= capacity for c in planned["candidates"])


def test_plan_takes_checks_default_reserve() -> None:
    assert _json("plan", "--params", "7e9", "--devices", "8", "--top", "1", "--json")["reserve"] == 4 * 10**9


# --- 4. plan's warning on unknown activations ------------------------------------------


def _plan(*args: str) -> tuple[str, str]:
    ran = CliRunner().invoke(main, ["plan", "--devices", "8", "--top", "1", "--data", "zero3", *args])
    if ran.exception is not None and not isinstance(ran.exception, SystemExit):
        raise ran.exception
    return ran.stdout, ran.stderr


@given(st.sampled_from(["7e9", "70B", "1.3e9"]), st.booleans())
@settings(max_examples=4, deadline=None)
def test_plan_on_a_bare_parameter_count_warns_once(params: str, as_json: bool) -> None:
    """A parameter count has no layers: activations and step time unknown, said once on stderr
    and in the JSON's ``warnings``; the candidates are ranked by communication, with no step
    time (null in the JSON, '-' in the table) rather than a made-up one."""
    out, err = _plan("--params", params, *(["--json"] if as_json else []))
    lines = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "activations and step time are unknown" in lines[0]
    if as_json:
        doc = json.loads(out)
        assert doc["warnings"] == [lines[0].removeprefix("warning: ")]
        assert doc["rank_by"] == "communication" and doc["hardware"] is None
        assert doc["candidates"] and all(c["step_seconds"] is None for c in doc["candidates"])
        assert all(p["step_seconds"] is None for p in doc["pareto"])


def test_plan_on_a_model_with_layers_does_not_warn() -> None:
    out, err = _plan("--model", "gpt3-1.3b", "--json")
    assert "warning:" not in err and json.loads(out)["warnings"] == []


# --- 5. the HTML report's heading and witnesses ------------------------------------------


class _Page(HTMLParser):
    """The page's <h1> text and its witness tables, each as (key, value) rows, nested tables'
    rows kept apart (a table inside a cell is its own table)."""

    def __init__(self) -> None:
        super().__init__()
        self.h1 = ""
        self._in_h1 = False
        self.witnesses: list[list[tuple[str, str]]] = []
        self._stack: list[list[list[str]] | None] = []  # per open table: its rows (None: not a witness)
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h1":
            self._in_h1 = True
        elif tag == "table":
            self._stack.append([] if ("class", "witness") in attrs else None)
        elif tag == "tr" and self._stack and self._stack[-1] is not None:
            self._stack[-1].append([])
        elif tag == "td" and self._stack and self._stack[-1] is not None:
            self._cell = []
            self._stack[-1][-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "h1":
            self._in_h1 = False
        elif tag == "table" and self._stack:
            rows = self._stack.pop()
            if rows is not None:
                self.witnesses.append([(r[0], r[1]) for r in rows if len(r) == 2])

    def handle_data(self, data: str) -> None:
        if self._in_h1:
            self.h1 += data
        if self._stack and self._stack[-1] is not None and self._stack[-1] and self._stack[-1][-1]:
            self._stack[-1][-1][-1] += data


def _page(doc: dict[str, Any]) -> _Page:
    parser = _Page()
    parser.feed(render_html(doc))
    return parser


witness_values = st.recursive(
    st.integers(-(10**6), 10**6) | st.text('abcdefgh_.<>&"', min_size=1, max_size=6),
    lambda inner: st.dictionaries(st.text("xyz_dptc", min_size=1, max_size=4), inner, min_size=1, max_size=3),
    max_leaves=6,
)


@given(
    st.sampled_from(["tp2xzero3xpp4xsp", "zero3", "tp4xdpxcp2", "hsdpxdpr2"]),
    st.dictionaries(st.text("abcdefg_", min_size=1, max_size=5), witness_values, min_size=1, max_size=4),
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_html_report_heads_with_the_readable_echo_and_tabulates_witnesses(
    text: str, witness: dict[str, Any]
) -> None:
    comp = parse(text, devices=64)
    doc = to_json(analyze(comp, PRESETS["llama2-7b"], ZERO, 80 * 10**9))
    violation = Violation("rule[G.norm, tp]", Condition.GRADIENT_INTEGRITY, "G", "norm", "tp", "why", witness)
    doc["verdict"] = Verdict(
        obligations=(Obligation("g", Condition.GRADIENT_INTEGRITY, Status.REFUTED),), violations=(violation,)
    ).as_json()
    page = _page(doc)
    # The heading is the composition as the CLI echoes it: strategies joined by " × ", a degree
    # glued to a strategy's final digit written with its axis (zero3(dp=8), never zero38).
    terms = [f"{s.name}({s.axis.value}={s.degree})" if s.name[-1].isdigit() else str(s) for s in comp.strategies]
    assert page.h1 == " × ".join(terms + list(comp.modifiers))
    assert "{" not in page.h1
    # The witness is a table of its variables, not JSON: the top table's keys are the witness's.
    top = page.witnesses[-1]  # the outermost table closes last
    assert [k for k, _ in top] == sorted(witness, key=str)
    for key, shown in top:
        value = witness[key]
        if not isinstance(value, dict):
            assert shown == str(value)
    nested = sum(_tables(v) for v in witness.values())
    assert len(page.witnesses) == 1 + nested


def _tables(value: object) -> int:
    return 1 + sum(_tables(v) for v in value.values()) if isinstance(value, dict) else 0
