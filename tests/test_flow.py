"""One analysis pipeline, typed from input to report: text or config -> ``Composition`` ->
``Placement`` -> ``StepProgram`` -> costs, verdict -> ``Report``, each built once.

The counts are taken by standing in for the constructors (``Composition.placement``, the
Hugging Face loader, the parser) with counters; the objects are compared with what the parser
builds from the same text, an independent path to the same composition.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

import checker._command as command
from checker._layout import DataSharding, Layout
from checker._parse import parse
from checker.cli import main
from formal._hf import load_hf_config
from formal._model import Model
from formal._placement import Options, Placement, Recompute
from formal._strategies import Composition

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
TINY_HF: dict[str, Any] = {  # a two-layer Llama, small enough for any composition here
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "intermediate_size": 128,
    "vocab_size": 1000,
}


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count concrete placements built, Hugging Face configs loaded and texts parsed."""
    counts = {"placement": 0, "hf": 0, "parse": 0}
    real_placement = Composition.placement

    def placement(self: Composition, model: Model, *, symbolic: bool = False) -> Placement:
        if not symbolic:  # the symbolic placement (degrees as symbols) gives the memory formulas
            counts["placement"] += 1
        return real_placement(self, model, symbolic=symbolic)

    def counted(key: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Composition, "placement", placement)
    monkeypatch.setattr(command, "load_hf_config", counted("hf", load_hf_config))
    monkeypatch.setattr(command, "parse", counted("parse", parse))
    return counts


def test_check_from_a_config_builds_each_object_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(TINY_HF))
    counts = _counting(monkeypatch)
    out = invoke("--from", str(CONFIGS / "deepspeed_zero2.json"), "--model", str(hf), "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["composition"] == "zero232xm2xclip"  # 256 = micro 4 x gas 2 x dp 32
    assert counts == {"placement": 1, "hf": 1, "parse": 0}  # the importer's Composition, not its text


@pytest.mark.parametrize(
    "args",
    [
        ("tp2xzero34", "--model", "gpt3-1.3b"),
        ("zero14", "--model", "gpt3-1.3b", "--strategies", "examples/broken_zero1_no_refresh.toml"),  # a program
        ("zero2-skew4", "--model", "gpt3-1.3b", "--strategies", "examples/broken_optimizer_shards.toml"),
    ],
)
def test_check_builds_the_placement_once(monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]) -> None:
    counts = _counting(monkeypatch)
    out = invoke(*args, "--json")
    assert out.exit_code in (0, 1), out.output
    assert counts == {"placement": 1, "hf": 0, "parse": 1}


def test_validate_gets_the_analysed_composition_with_user_strategies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--validate`` is handed the composition object ``check`` analysed: a user strategy's name
    is not re-parsed without its file."""
    import checker._torch_validate as validation

    seen: list[Composition] = []

    def fake(composition: Composition) -> tuple[dict[str, Any], str]:
        seen.append(composition)
        return {"engine": "stand-in"}, "validation: stand-in"

    monkeypatch.setattr(validation, "cli_validation", fake)
    strategies = "examples/broken_optimizer_shards.toml"
    out = invoke("zero2-skew4", "--model", "gpt3-1.3b", "--strategies", strategies, "--validate", "torch", "--json")
    assert out.exit_code == 1, out.output
    from checker._toml import load

    assert seen == [parse("zero2-skew4", load(strategies).factories(), devices=4)]
    assert json.loads(out.stdout)["validation"] == {"engine": "stand-in"}


def test_the_report_shows_what_the_import_could_not_map() -> None:
    config = str(CONFIGS / "torchtitan_llama3_8b.toml")
    doc = json.loads(invoke("--from", config, "--devices", "8", "--json").stdout)
    unmapped = doc["imported_from"]["unmapped"]
    assert {"setting", "why"} == set(unmapped[0])
    assert any(u["setting"] == 'activation_checkpoint.selective_ac_option="op"' for u in unmapped)
    assert doc["imported_from"]["not_mapped"] == [f"{u['setting']}: {u['why']}" for u in unmapped]
    human = invoke("--from", config, "--devices", "8").stdout
    assert "does not say exactly" in human and 'selective_ac_option="op"' in human


# --- a Layout is the composition the parser reads from its text ---------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Layout, int]:
    """A layout as an importer builds one, and a device count for a data degree left open."""
    data = draw(st.sampled_from(["dp", "zero1", "zero2", "zero3", "fsdp", "fsdp-sgo", "distopt"]))
    dp = draw(st.sampled_from([None, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    degrees = {k: draw(st.sampled_from([1, 2])) for k in ("tp", "cp", "ep")}
    replicate = "hpz-dpr" if data == "zero3" and draw(st.booleans()) else "dpr"
    dpr = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([4 * pp if pp > 1 else 1, 3, 8]))
    options = Options(
        sequence_parallel=degrees["tp"] > 1 and draw(st.booleans()),
        recompute=draw(st.sampled_from(list(Recompute))),
        offload_optimizer=draw(st.booleans()),
        micro_batches=m,
        uneven_stages=pp > 1 and draw(st.booleans()),
    )
    fixed = pp * dpr * degrees["tp"] * degrees["cp"] * degrees["ep"]
    devices = fixed * draw(st.sampled_from([1, 2, 4]))
    layout = Layout(data, DataSharding.NONE, dp, dpr=dpr, pp=pp, options=options, replicate=replicate, **degrees)
    return layout, devices


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_a_layout_builds_the_composition_its_text_parses_to(case: tuple[Layout, int]) -> None:
    layout, devices = case
    assert layout.composition(devices) == parse(layout.text(), devices=devices)


# --- --node-size wherever a composition with hpz can appear ---------------------------------


def _rows(*args: str) -> list[dict[str, Any]]:
    out = invoke(*args, "--json")
    assert out.exit_code == 0, out.output
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def _without_name(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "composition"}


def test_compare_and_sweep_take_the_node_size_of_hpz() -> None:
    # ZeRO++ hpZ on 32 devices in nodes of 4: zero34xhpz-dpr8, spelled out for the parser
    common = ("--devices", "32", "--model", "gpt3-1.3b")
    hpz4, spelled = _rows("compare", "zero3xhpz", "zero34xhpz-dpr8", "--node-size", "4", *common)
    (hpz8,) = _rows("compare", "zero3xhpz", *common)  # the default node of 8: zero38xhpz-dpr4
    assert _without_name(hpz4) == _without_name(spelled)
    # the secondary partition (P/k per device, ZeRO++ 3.2) is larger in nodes of 4 than of 8,
    # and the backward's gather moves within a node of the other size
    assert hpz4["buffers_bytes"] > hpz8["buffers_bytes"]
    assert hpz4["model_state_psi"] != hpz8["model_state_psi"]
    swept = _rows("sweep", "zero3{}xhpz", "--values", "16,32", "--node-size", "4", "--model", "gpt3-1.3b")
    for row, nodes in zip(swept, (4, 8), strict=True):
        assert row["error"] is None
        (expected,) = _rows("compare", f"zero34xhpz-dpr{nodes}", "--devices", str(4 * nodes), "--model", "gpt3-1.3b")
        assert {k: row[k] for k in expected if k != "composition"} == _without_name(expected)


def test_export_takes_the_node_size_and_explain_refuses_hpz_by_name() -> None:
    out = invoke("export", "zero3xhpz", "--devices", "32", "--node-size", "4", "--to", "deepspeed")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["zero_optimization"]["zero_hpz_partition_size"] == 4
    refused = invoke("explain", "hpz")
    assert refused.exit_code == 2 and "hpz: a modifier" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("node_size", "code"), [(None, 0), ("8", 0), ("4", 2)])
def test_an_explicit_node_size_must_agree_with_the_configs_hpz(
    tmp_path: Path, node_size: str | None, code: int
) -> None:
    """The config's composition is used as it is: a --node-size that would split it otherwise is
    a contradiction (one line, exit 2), not silently ignored."""
    config = tmp_path / "ds.json"
    zero = {"stage": 3, "zero_hpz_partition_size": 8}
    config.write_text(
        json.dumps(
            {
                "train_batch_size": 32,
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "zero_optimization": zero,
            }
        )
    )
    args = ["--from", str(config), "--model", "gpt3-1.3b", "--json"] + (
        [] if node_size is None else ["--node-size", node_size]
    )
    out = invoke(*args)
    assert out.exit_code == code, out.output
    if code == 0:
        assert json.loads(out.stdout)["composition"] == "zero38xhpz-dpr4"  # 32 devices, nodes of 8
    else:
        assert "--node-size 4 contradicts" in out.stderr and len(out.stderr.strip().splitlines()) == 1
