"""A newcomer's first screen: the summary first, what it assumed, a what-if, and every table
inside an 80-column terminal with every number whole.

Expected values come from an independent path: the what-if from parsing the composition with
the modifier written in it, the reserve from total + reserve <= device memory on the JSON's own
bytes, the step time from the FLOPs formula of Narayanan et al. 2021 (eq. 3).
"""

from __future__ import annotations

import io
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from strategies import compositions, models

from checker._analysis import analyze
from checker._numbers import gb
from checker._output import Column, fitted_table
from checker._parse import parse, readable
from checker._report import Report, print_report, what_ifs
from checker.cli import main
from formal._engine_deepspeed import DeepSpeedEffects, zero3_settings
from formal._engine_zero3 import zero3_fetches
from formal._model import Transformer
from formal._presets import PRESETS
from formal._strategies import Composition
from formal._tensors import parameter_tensors
from formal._verdict import Condition, Obligation, Status, Verdict, Violation
from formal.errors import CompositionError

WIDTH = 80


def run(*args: str, width: int = WIDTH) -> tuple[int, str]:
    result = CliRunner(env={"COLUMNS": str(width)}).invoke(main, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout


def assert_fits(text: str, width: int = WIDTH) -> None:
    assert "…" not in text, text  # rich's ellipsis: a cell cut short
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, too_long


# --- the readable echo round-trips through the parser -----------------------------------------


@given(models(), st.data())
def test_readable_echo_parses_back_to_the_same_composition(model: Transformer, data: st.DataObject) -> None:
    composition = data.draw(compositions(model))
    text = readable(composition)
    assert parse(text) == composition
    # no strategy whose name ends in a digit is written glued to its degree (zero38)
    for strategy in composition.strategies:
        if strategy.name[-1].isdigit():
            assert f"{strategy.name}({strategy.axis.value}={strategy.degree})" in text


def test_readable_spelling_names_the_axis() -> None:
    assert readable(parse("tp2xzero3xpp4", devices=64)) == "tp2 × zero3(dp=8) × pp4"
    assert readable(parse("zero1", devices=512)) == "zero1(dp=512)"
    with pytest.raises(CompositionError, match="along the dp axis, not tp"):
        parse("zero3(tp=8)")
    code, _ = run("check", "zero3(tp=8)")
    assert code == 2


# --- tables fit the terminal ----------------------------------------------------------------

numbers = st.integers(0, 10**15).map(lambda n: f"{n:,}")
words = st.text(st.sampled_from("abcdefghij_"), min_size=1, max_size=30)
texts = st.lists(words, min_size=1, max_size=6).map(" ".join)


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[Column], list[list[str]]]:
    kinds = draw(st.lists(st.booleans(), min_size=1, max_size=10))
    columns = [
        Column(f"c{i}", numeric, draw(st.none() | st.integers(0, 9)) if i else None) for i, numeric in enumerate(kinds)
    ]
    rows = draw(
        st.lists(st.tuples(*[numbers if numeric else texts for numeric in kinds]).map(list), min_size=1, max_size=5)
    )
    return columns, rows


@given(tables(), st.integers(40, 160))
def test_a_fitted_table_shows_every_number_whole_or_drops_its_column(
    table: tuple[list[Column], list[list[str]]], width: int
) -> None:
    columns, rows = table
    console = Console(width=width, color_system=None, record=True, file=io.StringIO())
    console.print(fitted_table("t", columns, rows, width))
    text = console.export_text()
    assert "…" not in text
    lines = text.splitlines()
    header = lines[1] if len(lines) > 1 else ""
    for i, col in enumerate(columns):
        if col.numeric and re.search(rf"\b{col.header}\b", header):
            for row in rows:
                assert any(row[i] in line for line in lines), (row[i], text)
    widths = sum(3 + max(len(c.header), *(len(r[i]) for r in rows)) for i, c in enumerate(columns) if c.numeric)
    if widths + 4 <= width:  # the numbers alone fit: no line is wider than the terminal
        assert max(len(line) for line in lines) <= width


@pytest.mark.parametrize(
    "args",
    [
        ("check", "tp2xzero3xpp4"),
        (
            "check",
            "zero14",
            "--model",
            "gpt3-1.3b",
            "--strategies",
            "examples/broken_zero1_no_refresh.toml",
            "--explain",
        ),
        ("compare", "dp8", "zero1", "zero2", "zero3", "fsdp8"),
        ("sweep", "tp{}xzero3", "--values", "1,2,3,8"),
        ("plan", "--devices", "4", "--top", "3"),
        ("explain", "--all"),
        ("explain", "zero2"),
        ("export", "tp2xzero3xpp4", "--to", "dtensor"),
        ("strategies",),
    ],
    ids=lambda a: "-".join(x.lstrip("-") for x in a[:1] + tuple(x for x in a if x in ("--explain", "--all"))),
)
def test_every_command_fits_80_columns_without_cutting_a_cell(args: tuple[str, ...]) -> None:
    code, out = run(*args)
    assert code in (0, 1), out
    assert_fits(out)


# --- the first screen -----------------------------------------------------------------------

MODEL = PRESETS["llama2-7b"]
# DeepSpeed's reduce bucket with its defaults: ``reduce_bucket_size`` 5e8 elements
# (deepspeed/runtime/zero/config.py), of the recipe's 2-byte gradients; ZeRO-3 keeps it for the
# whole run (deepspeed/runtime/zero/stage3.py).
DS_BUCKET = 500_000_000 * 2
assert isinstance(MODEL, Transformer)
TOKEN = 8 * MODEL.seq * MODEL.micro_batch  # one micro-batch's int64 token ids (or targets)


def deepspeed_peak(text: str) -> int:
    """The first screen's peak under DeepSpeed (ZeRO-3 by name), counted here: the placement's
    figure, the reduce bucket, the token ids of each micro-batch the first stage holds (1F1B:
    as many as stages; without a pipeline one, and that stage keeps the targets too)."""
    c = parse(text, devices=64)
    placement = int(analyze(c, MODEL).memory.total)
    pp = next((s.degree for s in c.strategies if s.name == "pp"), None)
    ids = TOKEN * pp if pp else 2 * TOKEN
    return placement + DS_BUCKET + ids + zero3_gathered(c)


def zero3_gathered(c: Composition) -> int:
    """ZeRO-3 alone on whole tensors: what DeepSpeed's replayed fetches (formal._engine_zero3,
    DeepSpeed's defaults) hold gathered beyond the placement's one layer, at the moment it is
    most: after the forward, or at the first or second block's backward (0 beside tp or pp,
    whose gathers the placement's stand for)."""
    if [st.name for st in c.strategies] != ["zero3"] or not isinstance(MODEL, Transformer):
        return 0
    pl = c.placement(MODEL)
    f = zero3_fetches(MODEL, zero3_settings(DeepSpeedEffects()))
    layer = sum(t.elements for t in parameter_tensors(MODEL) if t.layer == 0)
    backward = [i for i, m in enumerate(f.trace) if not m.forward and m.params and m.layer is not None]
    second = next(i for i in backward if f.trace[i].layer != f.trace[backward[0]].layer)
    end = max(i for i, m in enumerate(f.trace) if m.forward)
    most = max(f.after[end], f.live[backward[0]], f.live[second]) + f.persistent_elements
    assert pl.degree(pl.axes[0]) == 64
    return 2 * (most - layer)  # 16-bit parameters


def test_summary_comes_first_then_the_assumptions_then_the_tables() -> None:
    code, out = run("check", "tp2xzero3xpp4")
    assert code == 0
    lines = out.splitlines()
    analysis = analyze(parse("tp2xzero3xpp4", devices=64), MODEL, device_memory=80 * 10**9, reserve=4 * 10**9)
    total = deepspeed_peak("tp2xzero3xpp4")
    assert lines[0].startswith("tp2 × zero3(dp=8) × pp4 on 64 devices")
    assert lines[1].startswith("verdict  VALID")
    assert lines[2].startswith(f"memory   {gb(total)} + 4.0 GB reserve <= 80.0 GB per device: fits")
    # ZeRO-3 by name: DeepSpeed, its reduce bucket and the token ids added to the placement's figure
    placement = int(analysis.memory.total)
    assert lines[3] == f"engine   deepspeed: +{gb(total - placement)} on the placement's {gb(placement)} (terms below)"
    assert "  DeepSpeed reduce bucket (500000000 elements): 1.0 GB" in lines
    assert lines[4].startswith("traffic  ")
    # 1F1B bubble (p - 1) / m with p = 4 and m = 4p = 16 (Narayanan et al. 2021)
    assert lines[5] == f"bubble   {float(Fraction(3, 16)):.1%} of the step idle (1f1b, m 16)"
    head = " ".join(lines[:10])
    # micro-batch 1, m = 16, dp = 8: 128 sequences per step
    for said in ("seq 4096", "micro-batch 1", "m 16 (global batch 128)", "2/2/12 B", "attention stored"):
        assert said in head
    assert out.index("assumes") < out.index("Memory per device") < out.index("Verdict:")
    assert "3/16" not in out  # a decimal for people; the JSON keeps the exact fraction


def test_the_what_if_is_the_analysis_with_the_modifier_written_in() -> None:
    _, out = run("check", "tp2xzero3xpp4")
    assert f"with flash: {gb(deepspeed_peak('tp2xzero3xpp4xflash'))}" in out  # the same engine's peak
    # at 40 GB ZeRO-3 over 64 devices does not fit, with flash it does: the hint says so
    alone, lighter = deepspeed_peak("zero3"), deepspeed_peak("zero3xflash")
    assert alone + 4 * 10**9 > 40 * 10**9 >= lighter + 4 * 10**9
    code, out = run("check", "zero3", "--device-memory", "40GB")
    assert code == 0 and "does NOT fit" in out
    assert f"with flash: {gb(lighter)} (fits)" in out


def test_reserve_is_kept_back_from_the_device_memory() -> None:
    _, doc_text = run("check", "dp8", "--devices", "8", "--model", "gpt3-1.3b", "--json")
    doc = json.loads(doc_text)
    total = doc["memory"]["peak"]  # with the engine's terms (DDP's bucket copy): the number fits reads
    assert doc["memory"]["reserve"] == 4 * 10**9  # the stated default
    memory = str(total + 2 * 10**9)  # room for the total, not for the total and 4 GB
    tight = json.loads(
        run("check", "dp8", "--devices", "8", "--model", "gpt3-1.3b", "--device-memory", memory, "--json")[1]
    )
    assert tight["memory"]["fits"] is False
    none = ("--reserve", "0", "--json")
    loose = json.loads(
        run("check", "dp8", "--devices", "8", "--model", "gpt3-1.3b", "--device-memory", memory, *none)[1]
    )
    assert loose["memory"]["fits"] is True and loose["memory"]["reserve"] == 0
    code, _ = run("check", "dp8", "--devices", "8", "--model", "gpt3-1.3b", "--reserve", "90GB")
    assert code == 2


def test_step_time_on_the_first_screen_when_hardware_is_given() -> None:
    """With ``--hardware`` the summary gives the step-time model's estimate (docs/steptime.md);
    its throughput figures follow from the step time by their definitions: tokens/s is the global
    batch's tokens over the step, MFU the model FLOPs (Narayanan et al. 2021, eq. 3, without
    recomputation) over the step and the cluster's peak (A100: 312 TFLOP/s dense bf16)."""
    args = ("check", "dp8", "--devices", "8", "--hardware", "a100-80gb")
    _, out = run(*args)
    doc = json.loads(run(*args, "--json")[1])
    time = doc["time"]
    m = MODEL
    assert isinstance(m, Transformer)
    tokens = 8 * m.seq  # micro-batch 1, one micro-batch, 8 replicas
    flops = 3 * (2 * m.parameter_count() + 4 * m.layers * m.seq * m.hidden) * tokens  # eq. 3, no recompute
    assert time["tokens_per_second"] == pytest.approx(tokens / time["step_seconds"], rel=1e-9)
    # eq. 3's 6N-style count against the model's layer-by-layer count (SwiGLU's three matrices,
    # attention as Llama has it): the two agree within a few per cent, not exactly.
    assert time["mfu"] == pytest.approx(flops / (time["step_seconds"] * 8 * 312e12), rel=0.025)
    line = next(x for x in out.splitlines() if x.startswith("step "))
    assert f"{time['step_seconds']:.3g} s on a100-80gb" in line and f"MFU {time['mfu']:.1%}" in line
    plain = run("check", "dp8", "--devices", "8")[1]
    assert not [x for x in plain.splitlines() if x.startswith("step ")]  # no hardware, no estimate


# --- explain, help, fractions ----------------------------------------------------------------


def test_explain_gives_the_witness_and_leaves_unsat_cores_to_explain_all() -> None:
    _, short = run("check", "dp2xpp2", "--model", "gpt3-1.3b", "--explain")
    _, full = run("check", "dp2xpp2", "--model", "gpt3-1.3b", "--explain=all")
    assert "Unsat cores" not in short and "--explain=all prints them" in short
    assert "Unsat cores" in full and "integrity[G.embedding, pp]" in full
    assert len(short.splitlines()) < len(full.splitlines())
    _, before = run("--explain", "dp2xpp2", "--model", "gpt3-1.3b")  # the flag before the composition
    assert before == short
    _, spelled = run("check", "dp2xpp2", "--model", "gpt3-1.3b", "--explain-all")
    assert spelled == full


@pytest.mark.parametrize("command", ["check", "compare", "sweep", "plan", "explain", "export", "strategies"])
def test_every_subcommand_help_has_examples_and_exit_codes(command: str) -> None:
    code, out = run(command, "--help")
    assert code == 0
    examples = out.split("Examples:", 1)[-1]
    assert "Examples:" in out and "  check-composition " in examples
    assert "Exit codes: 0 valid" in out


def test_html_headings_show_decimals_not_fractions() -> None:
    from checker._html import render_html
    from checker._report import to_json

    doc = to_json(analyze(parse("tp2xzero3xpp4", devices=64), PRESETS["gpt3-1.3b"]))
    assert "/" in doc["communication"]["model_state_psi_units"] or "/" in doc["pipeline"]["bubble_fraction"]
    page = render_html(doc)
    for heading in re.findall(r"<h2>(.*?)</h2>", page, re.S):
        assert not re.search(r"\d+/\d+", heading), heading
    assert "3/16" not in page.split('<script type="application/json"')[0]


def test_readme_first_screen_is_what_the_cli_prints() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- first-screen: check-composition tp2xzero3xpp4 -->", 1)[1]
    shown = block.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    _, out = run("check", "tp2xzero3xpp4")
    assert [line.rstrip() for line in out.splitlines()[: len(shown)]] == shown


@st.composite
def verdicts(draw: st.DrawFn) -> Verdict:
    """Verdicts of each status, with rule names and witnesses shaped like the solver's."""
    rules = draw(st.lists(st.sampled_from(["refresh[P.attention, dp]", "divides[heads, tp]", "sync[G.mlp, pp]"])))
    violations = tuple(
        Violation(rule, draw(st.sampled_from(list(Condition))), explanation=f"{rule} is broken", witness={"step": 1})
        for rule in rules
    )
    status = draw(st.sampled_from([Status.PROVED, Status.UNKNOWN]))
    obligations = (Obligation("integrity", Condition.GRADIENT_INTEGRITY, status, "timeout", core=("a", "b")),)
    return Verdict(obligations, violations, notes=tuple(draw(st.lists(texts, max_size=2))))


def report_fits(model: Transformer, data: st.DataObject, verdict: Verdict, width: int, explain: bool) -> None:
    composition = data.draw(compositions(model))
    analysis = analyze(composition, model, device_memory=80 * 10**9, reserve=4 * 10**9)
    out = io.StringIO()
    report = Report(analysis, verdict, explain, hints=what_ifs(analysis))
    print_report(report, Console(file=out, width=width, color_system=None))
    text = out.getvalue()
    assert_fits(text, width)
    assert " ".join(text.split()).startswith(" ".join(readable(composition).split()))  # wrapped at narrow widths
    first_screen = text.split("Memory per device")[0]
    assert "assumes  " in first_screen and "global batch" in first_screen


@settings(max_examples=12)  # each example analyses twice; the slow variant draws 300
@given(models(), st.data(), verdicts(), st.integers(60, 120), st.booleans())
def test_a_report_fits_any_terminal_width(
    model: Transformer, data: st.DataObject, verdict: Verdict, width: int, explain: bool
) -> None:
    report_fits(model, data, verdict, width, explain)


@pytest.mark.slow
@settings(max_examples=300)
@given(models(), st.data(), verdicts(), st.integers(60, 120), st.booleans())
def test_a_report_fits_any_terminal_width_thoroughly(
    model: Transformer, data: st.DataObject, verdict: Verdict, width: int, explain: bool
) -> None:
    report_fits(model, data, verdict, width, explain)


@pytest.mark.parametrize(("model", "said"), [("llama2-7b", "no dropout"), ("gpt3-1.3b", "dropout")])
def test_the_assumptions_say_whether_dropout_masks_are_kept(model: str, said: str) -> None:
    """Dropout decides whether masks are kept for the backward (Korthikanti et al. 2022, 4.1):
    Llama trains without it, GPT-3 with it, and the first screen says which it assumed."""
    _, out = run("check", "dp8", "--devices", "8", "--model", model)
    assumed = " ".join(out.split("assumes", 1)[1].split("\n", 2)[:2]).split(" · ")
    assert said in [part.strip() for part in assumed]
