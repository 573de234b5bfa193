"""The step-time model against published training runs (checker/data/published-throughput.json).

The published values are the expected values; the held-out figures come from constants fitted
without the run's source (leave one source out). The bounds pinned here are the ones the model
achieves today (docs/steptime.md, "Accuracy"): 9.0% mean and 16.5% max held out, within the goal
of 10% and 25%, on the 24 runs the hardware presets describe (the 4 torchtitan runs on
power-capped H100s are left out of the fit and reported apart).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checker._published import DATA_PATH, Row, calibration_document, fit, load_runs, summary, validation
from formal._steptime import CALIBRATION_PATH, Efficiency, calibrated

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data" / "published-throughput.json"

# What the model achieves (checker._published.validation), pinned so that a change that makes
# it worse fails; the goal is <= 10% mean and <= 25% max held out.
Validated = tuple[Efficiency, list[Row], list[Row], list[Row]]
HELD_OUT_MEAN = 0.091
HELD_OUT_MAX = 0.166
FIT_MEAN = 0.057


@pytest.fixture(scope="module")
def validated() -> Validated:
    return validation()


def test_every_entry_keeps_its_provenance() -> None:
    data = json.loads(DATA_PATH.read_text(encoding="utf-8"))
    assert "about" in data
    for e in data["entries"]:
        assert e["source"] and e["locator"] and e["unit"] and e["published_value"] > 0
    if SHARED.exists():  # the copy is the project's shared file, unchanged
        assert json.loads(SHARED.read_text(encoding="utf-8")) == data


def test_shipped_constants_are_the_fit_on_the_training_set_they_name() -> None:
    shipped = json.loads(CALIBRATION_PATH.read_text(encoding="utf-8"))
    runs = tuple(r for r in load_runs() if not r.excluded)
    assert shipped["training_set"] == [r.id for r in runs]
    refit = fit([(r, r.inputs()) for r in runs])
    assert calibration_document(refit, runs)["constants"] == shipped["constants"]
    assert calibrated() == refit


def test_held_out_error_is_pinned(validated: Validated) -> None:
    _, fit_rows, held, excluded = validated
    assert {r.run.id for r in held} == {r.run.id for r in fit_rows}  # every run held out once
    assert {r.run.source for r in excluded} == {"torchtitan"} and len(fit_rows) == 24
    mean, worst = summary(held)
    assert mean <= HELD_OUT_MEAN and worst <= HELD_OUT_MAX
    assert summary(fit_rows)[0] <= FIT_MEAN


# Pairs the model orders against the published order, pinned: Llama 3's 131K-context row (cp16)
# is predicted faster per GPU than the 8K row on 16,384 GPUs, published slower. Its attention
# FLOPs (the paper's count is not given) dominate at that length; see docs/steptime.md.
KNOWN_MISORDERED = {("llama3-405b-t4-row2", "llama3-405b-t4-row3")}


def test_same_model_runs_rank_in_the_published_order(
    validated: Validated,
) -> None:
    """Two runs of one model whose published throughputs differ (Korthikanti et al. 2022 Table 5:
    sequence parallelism + selective recomputation against full recomputation; MT-NLG on 2240,
    2800 and 3360 GPUs; torchtitan async TP against vanilla; Llama 3's rows): the model orders
    them as published, but for the pinned known pairs."""
    _, fit_rows, _, excluded = validated
    by_model: dict[tuple[str, int, int], list[Row]] = {}
    for row in [*fit_rows, *excluded]:
        m = row.run.model
        by_model.setdefault((row.run.source, m.layers, m.hidden), []).append(row)
    pairs = 0
    wrong = set()
    for rows in by_model.values():
        for a, b in itertools.combinations(rows, 2):
            if a.run.unit != b.run.unit or a.run.published == b.run.published:
                continue
            pairs += 1
            sign = -1 if a.run.unit == "seconds" else 1  # seconds: less is faster
            if (sign * a.run.published > sign * b.run.published) != (sign * a.predicted > sign * b.predicted):
                wrong.add((a.run.id, b.run.id))
    assert pairs >= 8
    assert wrong == KNOWN_MISORDERED


def test_korthikanti_seqsel_beats_full_recomputation() -> None:
    """The named case: 22B on 8 A100, 1.42 s with full recomputation, 1.10 s with sequence
    parallelism and selective recomputation (Korthikanti et al. 2022 Table 5)."""
    runs = {r.id: r for r in load_runs()}
    eff = calibrated()
    from formal._steptime import evaluate

    full = evaluate(runs["korthikanti-t5-22B-full"].inputs(), eff).step_seconds
    seqsel = evaluate(runs["korthikanti-t5-22B-seqsel"].inputs(), eff).step_seconds
    assert seqsel < full


def test_validate_published_prints_both_summaries() -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "checker.cli", "validate", "--published"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "fit (in-sample): mean |error|" in out.stdout
    assert "held-out (leave one source out): mean |error|" in out.stdout
    assert "left out of the fit: torchtitan-asynctp-8b-async: power-capped H100" in out.stdout
    assert out.stdout.count("korthikanti-t5-") == 8


def test_llama_runs_train_without_dropout_and_gpt_runs_with_it() -> None:
    """Llama models have no dropout (Hugging Face LlamaConfig: attention_dropout 0.0), so their
    element-wise bytes carry no masks; Megatron's GPT runs keep dropout (its 0.1 defaults)."""
    for run in load_runs():
        llama = run.source in ("llama3", "torchtitan")
        assert run.model.dropout is not llama, run.id
