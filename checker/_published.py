"""Published training runs against the step-time model: each run as a composition, the fit of
the model's constants, and leave-one-source-out validation (``check-composition validate --published``).

``checker/data/published-throughput.json`` is a copy of the project's shared
``data/published-throughput.json`` (sources, locators, inputs and units per entry). Inputs a
source does not state are assumptions, written beside each run here (``Run.assumptions``).
The fit is deterministic: a fixed grid over the three constants, then a fixed number of
coordinate refinements, minimising the mean squared log-ratio of predicted to published.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checker._parse import parse
from formal._hardware import PRESETS as HARDWARE
from formal._model import PRECISIONS, Ffn, Norm, Transformer
from formal._program import derive_program
from formal._steptime import CONSTANTS, Efficiency, Runtime, StepInputs, StepTimes, evaluate_batch, prepare

DATA_PATH = Path(__file__).resolve().parent / "data" / "published-throughput.json"
SOURCES = ("ptdp", "korthikanti", "mtnlg", "llama3", "torchtitan")


@dataclass(frozen=True)
class Run:
    id: str
    source: str  # one of SOURCES (the leave-one-source-out fold)
    composition: str
    model: Transformer
    hardware: str
    runtime: Runtime
    unit: str
    published: float
    assumptions: tuple[str, ...]
    excluded: str = ""  # why the run is left out of the fit and the held-out figures ("" : used)

    def inputs(self) -> StepInputs:
        comp = parse(self.composition)
        pl = comp.placement(self.model)
        return prepare(
            derive_program(pl, self.model), self.model, PRECISIONS["zero"], HARDWARE[self.hardware], self.runtime
        )


def predicted(run: Run, times: StepTimes, inputs: StepInputs, i: int = 0) -> float:
    """The model's figure for row ``i`` in the run's published unit, under the source's own FLOP
    counting."""
    devices = float(inputs.devices[i])
    match run.unit:
        case "seconds":
            return float(times.step_seconds[i])
        case "tokens/s per GPU":
            return float(times.tokens_per_second[i]) / devices
        case "TFLOP/s per GPU" if run.source == "llama3":  # model FLOPs, no recomputation counted
            return float(inputs.model_flops[i]) / (float(times.step_seconds[i]) * devices) / 1e12
        case "TFLOP/s per GPU":  # Narayanan eq. 3: recomputation counted
            return float(times.tflops_per_device[i])
    raise AssertionError(run.unit)


def predictions(pairs: Sequence[tuple[Run, StepInputs]], eff: Efficiency) -> list[float]:
    """``predicted`` of every run under ``eff``, the runs' rows evaluated in one batch."""
    batch = StepInputs.concat([inputs for _, inputs in pairs])
    times = evaluate_batch(batch, eff)
    return [predicted(run, times, batch, i) for i, (run, _) in enumerate(pairs)]


def error(run: Run, value: float) -> float:
    """Signed relative error of the prediction in the run's own unit."""
    return value / run.published - 1


def _gpt(entry: dict[str, Any], micro_batch: int) -> Transformer:
    m = entry["inputs"]["model"]
    return Transformer(
        entry["id"],
        layers=m["layers"],
        hidden=m["hidden"],
        heads=m["heads"],
        vocab=m["vocab"],
        seq=m["seq"],
        micro_batch=micro_batch,
        ffn=m["ffn"],
        source=entry["source"],
    )


def _llama(entry: dict[str, Any], seq: int, micro_batch: int) -> Transformer:
    m = entry["inputs"]["model"]
    return Transformer(
        entry["id"],
        layers=m["layers"],
        hidden=m["hidden"],
        heads=m["heads"],
        kv_heads=m["kv_heads"],
        vocab=m["vocab"],
        seq=seq,
        micro_batch=micro_batch,
        ffn=m["ffn"],
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # Llama trains without dropout (Hugging Face LlamaConfig: attention_dropout 0.0)
        source=entry["source"],
    )


def _run(entry: dict[str, Any]) -> Run:
    i, eid = entry["inputs"], entry["id"]
    unit, value = entry["unit"], float(entry["published_value"])
    common = {"id": eid, "unit": unit, "published": value}
    if eid.startswith("ptdp-"):
        b = 1
        m = i["global_batch"] // (i["dp"] * b)
        pp = f"xpp{i['pp']}xm{m}" if i["pp"] > 1 else (f"xm{m}" if m > 1 else "")
        return Run(
            source="ptdp",
            composition=f"tp{i['tp']}{pp}xdp{i['dp']}xrecompute",
            model=_gpt(entry, b),
            hardware="a100-80gb",
            runtime=Runtime(pipeline_scatter_gather=True),
            assumptions=("micro-batch 1 (not stated)", "1F1B without interleaving (chunks not stated per row)"),
            **common,
        )
    if eid.startswith("korthikanti-"):
        b, v = i["micro_batch"], i["pipeline_interleaving"]
        m = i["global_batch"] // (i["dp"] * b)
        seqsel = "seqsel" in eid
        terms = [f"tp{i['tp']}"] + (["sp", "selective"] if seqsel else ["recompute"])
        if i["pp"] > 1:
            terms += [f"pp{i['pp']}"] + ([f"v{v}"] if v > 1 else [])
        if m > 1:
            terms.append(f"m{m}")
        return Run(
            source="korthikanti",
            composition="x".join(terms),
            model=_gpt(entry, b),
            hardware="a100-80gb",
            runtime=Runtime(pipeline_scatter_gather=True),
            assumptions=(),
            **common,
        )
    if eid.startswith("mtnlg-"):
        m = i["global_batch"] // i["dp"]
        return Run(
            source="mtnlg",
            composition=f"tp{i['tp']}xpp{i['pp']}xm{m}xdp{i['dp']}xrecompute",
            model=_gpt(entry, 1),
            hardware="a100-80gb",
            runtime=Runtime(),
            assumptions=("micro-batch 1 (not stated)", "A100 80GB as on Selene (the 40GB peak is the same)"),
            **common,
        )
    if eid.startswith("llama3-"):
        m = i["batch_per_dp"]
        cp = f"xcp{i['cp']}" if i["cp"] > 1 else ""
        return Run(
            source="llama3",
            composition=f"tp{i['tp']}xsp{cp}xpp{i['pp']}xunevenxv4xm{m}xzero1{i['dp']}",
            model=_llama(entry, i["seq"], 1),
            hardware="h100-80gb",
            runtime=Runtime(flash_attention=True, pipeline_overlap=True),
            assumptions=(
                "micro-batch 1 sequence, m = batch per DP group",
                "tensor parallelism with sequence parallelism: the paper's TP cites Korthikanti et al. "
                "2023, whose tensor parallelism shards the norms' and dropouts' activations by sequence "
                "(each TP rank then sends its 1/tp of a stage's output)",
                "FSDP without resharding, gradients reduced once per step: zero1's program "
                "(one reduce-scatter, one all-gather per step)",
                "4 interleaved chunks per stage (the paper tunes the schedule; chunks not stated)",
                "FLOPs counted as 6N + 6 l s h per token, causal attention at half (the paper's count is not given)",
            ),
            **common,
        )
    if eid.startswith("torchtitan-"):
        recompute = "recompute" if i["recompute"] == "full AC" else "selective"
        return Run(
            source="torchtitan",
            composition=f"tp{i['tp']}xspxfsdp{i['fsdp']}x{recompute}",
            model=_llama(entry, 8192, i["local_batch"]),
            hardware="h100-80gb",
            runtime=Runtime(tp_overlap=bool(i["async_tp"]), flash_attention=True),
            excluded="power-capped H100 (96 GB HBM2e, 500 W): no preset, and its clock under the cap is not published",
            assumptions=(
                "seq 8192 (torchtitan default; not restated)",
                "H100 80GB SXM figures for the 96 GB 500 W parts",
                "causal attention run at half its FLOPs (FlashAttention in torchtitan)",
                "per-op SAC modelled as selective recomputation" if recompute == "selective" else "full AC",
            ),
            **common,
        )
    raise AssertionError(eid)


def load_runs(path: Path = DATA_PATH) -> tuple[Run, ...]:
    data = json.loads(path.read_text(encoding="utf-8"))
    return tuple(_run(e) for e in data["entries"])


# --- fit ----------------------------------------------------------------------------------

GEMM_MAX = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
GEMM_HALF = (32.0, 128.0, 512.0, 2048.0)
NETWORK = (0.3, 0.5, 0.7, 0.9)
MEMORY = (0.0, 0.5, 1.0, 2.0)
REFINEMENTS = 30
Point = tuple[float, float, float, float]


def _loss(pairs: Sequence[tuple[Run, StepInputs]], eff: Efficiency) -> float:
    """Mean squared log-ratio of predicted to published over the runs."""
    values = predictions(pairs, eff)
    return sum(math.log(v / run.published) ** 2 for (run, _), v in zip(pairs, values, strict=True)) / len(pairs)


def fit(pairs: Sequence[tuple[Run, StepInputs]], source: str = "") -> Efficiency:
    """Least squares on the log-ratios: a grid, then coordinate refinement with halving steps."""

    def make(x: Point) -> Efficiency:
        return Efficiency(x[0], x[1], x[2], x[3], source)

    def score(x: Point) -> float:
        if not (0 < x[0] <= 1 and x[1] > 0 and 0 < x[2] <= 1 and 0 <= x[3] <= MEMORY[-1]):
            return math.inf
        return _loss(pairs, make(x))

    grid = ((a, h, n, k) for a in GEMM_MAX for h in GEMM_HALF for n in NETWORK for k in MEMORY)
    best = min(grid, key=score)
    steps = [0.05, best[1] / 2, 0.1, 0.5]
    current = score(best)
    for _ in range(REFINEMENTS):
        improved = False
        for k in range(4):
            for sign in (1, -1):
                trial = list(best)
                trial[k] += sign * steps[k]
                cand = (trial[0], trial[1], trial[2], trial[3])
                s = score(cand)
                if s < current:
                    best, current, improved = cand, s, True
        if not improved:
            steps = [s / 2 for s in steps]
    return make(best)


@dataclass(frozen=True)
class Row:
    run: Run
    predicted: float
    error: float
    held_out: bool


def _rows(pairs: Sequence[tuple[Run, StepInputs]], eff: Efficiency, held_out: bool) -> list[Row]:
    if not pairs:
        return []
    values = predictions(pairs, eff)
    return [Row(run, v, error(run, v), held_out) for (run, _), v in zip(pairs, values, strict=True)]


def validation(
    runs: Iterable[Run] | None = None, fitted: Callable[[Sequence[tuple[Run, StepInputs]]], Efficiency] = fit
) -> tuple[Efficiency, list[Row], list[Row], list[Row]]:
    """(constants fitted on every run not excluded, in-sample rows, leave-one-source-out rows,
    rows of the excluded runs under the constants fitted on all the others)."""
    every = [(r, r.inputs()) for r in (runs if runs is not None else load_runs())]
    pairs = [p for p in every if not p[0].excluded]
    everything = fitted(pairs)
    fit_rows = _rows(pairs, everything, held_out=False)
    excluded_rows = _rows([p for p in every if p[0].excluded], everything, held_out=True)
    held: list[Row] = []
    for source, constants in fold_fits(pairs, fitted).items():
        held += _rows([p for p in pairs if p[0].source == source], constants, held_out=True)
    return everything, fit_rows, held, excluded_rows


def fold_fits(
    pairs: Sequence[tuple[Run, StepInputs]],
    fitted: Callable[[Sequence[tuple[Run, StepInputs]]], Efficiency] = fit,
) -> dict[str, Efficiency]:
    """The constants fitted without each source (the leave-one-source-out folds)."""
    out = {}
    for source in SOURCES:
        train = [p for p in pairs if p[0].source != source]
        if train and len(train) < len(pairs):
            out[source] = fitted(train)
    return out


def jackknife(folds: Sequence[Efficiency]) -> dict[str, float]:
    """The delete-one-group jackknife standard error of each constant over the folds' fits
    (Efron and Tibshirani 1993, ch. 11: sqrt((g - 1) / g x sum (theta_i - mean)^2) for g groups):
    how far a constant moves when the runs of one source are not there to fit it."""
    g = len(folds)
    out = {}
    for name in CONSTANTS:
        values = [getattr(f, name) for f in folds]
        mean = sum(values) / g
        out[name] = math.sqrt((g - 1) / g * sum((v - mean) ** 2 for v in values))
    return out


def summary(rows: Sequence[Row]) -> tuple[float, float]:
    errors = [abs(r.error) for r in rows]
    return sum(errors) / len(errors), max(errors)


def calibration_document(
    eff: Efficiency, runs: Sequence[Run], uncertainty: dict[str, float] | None = None
) -> dict[str, Any]:
    """What ``formal/data/steptime-calibration.json`` holds: the constants, their provenance and
    (given) their jackknife uncertainty over the leave-one-source-out folds."""
    return {
        "about": (
            "Constants of the step-time model (formal/_steptime.py), fitted by checker._published.fit "
            "(grid then coordinate refinement, least squares on log(predicted/published)) on the runs of "
            "checker/data/published-throughput.json (a copy of the project's shared/data file) named in "
            "training_set, from: "
            + ", ".join(sorted({r.source for r in runs}))
            + ". The torchtitan runs are left out (power-capped hardware no preset describes). "
            "Regenerate: python -m checker._published --write."
        ),
        "training_set": [r.id for r in runs],
        "constants": {
            "gemm_max": eff.gemm_max,
            "gemm_half": eff.gemm_half,
            "network": eff.network,
            "memory": eff.memory,
        },
        **({"uncertainty": uncertainty} if uncertainty is not None else {}),
    }


if __name__ == "__main__":  # regenerate the shipped constants
    import sys

    from formal._steptime import CALIBRATION_PATH

    all_runs = tuple(r for r in load_runs() if not r.excluded)
    all_pairs = [(r, r.inputs()) for r in all_runs]
    fitted_all = fit(all_pairs)
    spread = jackknife(list(fold_fits(all_pairs).values()))
    text = json.dumps(calibration_document(fitted_all, all_runs, spread), indent=1) + "\n"
    if "--write" in sys.argv:
        CALIBRATION_PATH.write_text(text, encoding="utf-8")
    print(text, end="")
