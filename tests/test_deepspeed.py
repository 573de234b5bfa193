"""DeepSpeed as a second real engine: ``deepspeed_terms`` against an independent count, the
``--validate deepspeed`` refusals, and (``deepspeed`` marker, skipped without the extra) ZeRO 1-3
on 2 gloo processes measured against the prediction.

Expected bytes come from the validation model's dimensions (``checker._torch._net.NetConfig``:
a block has two norms, a fused QKV, an output projection and a 4h MLP, 12h^2 + 13h parameters)
and from DeepSpeed's documented behaviour (``deepspeed/runtime/zero/stage_1_and_2.py`` and
``stage3.py``: an fp32 partition of the flat parameters; ``reduce_bucket_size`` elements of
reduce bucket), never read back from the module under test.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from checker._parse import parse
from checker.cli import main
from formal._costs import memory
from formal._engine_deepspeed import DeepSpeedEffects, deepspeed_partition_gradients, deepspeed_terms, zero_stage
from formal._engine_effects import Engine
from formal._model import PRECISIONS, Transformer
from formal._presets import PRESETS
from formal._program import group_sizes

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
H, V, L = 64, 256, 8  # NetConfig's hidden size, vocabulary and layers
PARAMETERS = L * (12 * H * H + 13 * H) + 2 * V * H + 2 * H  # blocks, embedding and head, final norm


def _model() -> Transformer:
    return Transformer(
        "torch-small",
        layers=L,
        hidden=H,
        heads=8,
        vocab=V,
        seq=32,
        micro_batch=2,
        learned_positions=False,
        tied_embeddings=False,
    )


def stages() -> st.SearchStrategy[int]:
    return st.sampled_from([1, 2, 3])


def data_degrees() -> st.SearchStrategy[int]:
    return st.sampled_from([2, 4, 8])


def bucket_sizes() -> st.SearchStrategy[int]:
    return st.integers(1, 10**9)


def _terms(stage: int, n: int, precision: str, bucket: int) -> dict[str, tuple[int, str]]:
    model = _model()
    pl = parse(f"zero{stage}{n}").placement(model)
    prec = PRECISIONS[precision]
    mem = memory(pl, model, prec, group_sizes(model))
    fx = DeepSpeedEffects(reduce_bucket_elements=bucket)
    return {t.key: (t.bytes, t.moment) for t in deepspeed_terms(pl, model, prec, mem, fx)}


def test_parameter_count_is_the_nets() -> None:
    assert sum(_model().group_elements().values()) == PARAMETERS == 432_768


@given(stages(), data_degrees(), bucket_sizes())
def test_fp32_master_partition_and_reduce_bucket(stage: int, n: int, bucket: int) -> None:
    got = _terms(stage, n, "fp32-adam", bucket)
    # Every group's elements divide by 2, 4 and 8 here: the partition is P/n elements, fp32.
    assert got["deepspeed_fp32_master"] == (4 * PARAMETERS // n, "persistent")
    # ZeRO-3 keeps its bucket for the whole run; ZeRO-1/2 allocate theirs for backward.
    assert got["deepspeed_reduce_bucket"] == (4 * bucket, "persistent" if stage == 3 else "backward")


@given(stages(), data_degrees())
def test_no_second_master_under_mixed_precision(stage: int, n: int) -> None:
    # The mixed recipes' 12 optimizer bytes already count the fp32 master (16-bit parameters).
    got = _terms(stage, n, "zero", 1000)
    assert "deepspeed_fp32_master" not in got
    assert got["deepspeed_reduce_bucket"][0] == 1000 * PRECISIONS["zero"].gradients


def test_zero_stage_of_placements() -> None:
    model = _model()
    assert [zero_stage(parse(t).placement(model)) for t in ("zero14", "zero24", "zero34", "dp4")] == [1, 2, 3, 0]


@pytest.mark.parametrize("text", ["fsdp2", "zero38", "tp2xzero22"])
def test_validate_deepspeed_refuses_other_compositions(text: str) -> None:
    r = CliRunner().invoke(main, ["check", text, "--validate", "deepspeed"])
    assert r.exit_code == 2, r.output
    assert "--validate deepspeed" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.skipif(HAS_DEEPSPEED, reason="the message for a machine without DeepSpeed")
def test_validate_deepspeed_without_the_extra() -> None:
    r = CliRunner().invoke(main, ["check", "zero22", "--validate", "deepspeed"])
    assert r.exit_code == 2 and "DeepSpeed is not installed" in r.output


@given(data_degrees())
def test_zero2_partition_holds_whole_straddling_parameters(n: int) -> None:
    from formal._tensors import parameter_tensors

    model = _model()
    held = deepspeed_partition_gradients(model, n, DeepSpeedEffects())
    sizes = [t.elements for t in parameter_tensors(model)]
    part = PARAMETERS // n  # 432768 divides by 2n for n in 2, 4, 8: no padding
    # Each rank holds at least its partition; what it holds beyond is the parameters cut by its
    # two boundaries, at most two of them; every parameter is held by some rank.
    for h in held:
        assert part <= h <= part + 2 * max(sizes)
    assert sum(held) >= PARAMETERS
    assert len(held) == n


# --- the CLI's --engine deepspeed: the same terms, printed and in the peak ---------------------

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py): ``reduce_bucket_size`` 5e8 elements;
# ``overlap_comm`` None, True for ZeRO-3 only (``overlap_comm_valid``).
DEFAULT_BUCKET = 500_000_000


def precisions() -> st.SearchStrategy[str]:
    return st.sampled_from(["zero", "fp32-adam"])


def _token_ids(model: Transformer) -> int:
    """The int64 token ids and targets one micro-batch keeps (no pipeline: one in flight)."""
    return 2 * 8 * model.seq * model.micro_batch


@given(stages(), data_degrees(), precisions())
def test_cli_peak_adds_deepspeeds_terms(stage: int, n: int, precision: str) -> None:
    from checker._analysis import analyze

    model = _model()
    prec = PRECISIONS[precision]
    comp = parse(f"zero{stage}{n}")
    a = analyze(comp, model, prec, engine=Engine.DEEPSPEED)
    placement = int(analyze(comp, model, prec).memory.total)
    assert a.engine is not None and a.engine.modelled
    got = {t.key: t.bytes for t in a.engine.terms}
    bucket = DEFAULT_BUCKET * prec.gradients  # one bucket: overlap_comm is off for ZeRO-1/2 by default
    master = 4 * PARAMETERS // n if prec.parameters == 4 else 0  # fp32 model: a second fp32 copy
    straddling = got.get("deepspeed_straddling_gradients", 0)
    if stage == 2:  # at most the two parameters cut by the rank's boundaries, whole (see above)
        assert 0 <= straddling <= 2 * 4 * H * H * 4 * prec.gradients
    else:
        assert straddling == 0
    assert got["deepspeed_reduce_bucket"] == bucket
    assert got.get("deepspeed_fp32_master", 0) == master
    assert a.peak == placement + bucket + master + straddling + _token_ids(model)


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner(env={"COLUMNS": "80"}).invoke(main, list(args))
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.output


def test_cli_prints_the_reduce_bucket_as_its_own_line_and_in_json() -> None:
    code, out = _cli("check", "zero3", "--devices", "8", "--model", "gpt3-1.3b")
    assert code == 0
    # ZeRO-3 by name runs on DeepSpeed; 5e8 elements of 2-byte gradients: 1.0 GB
    assert "  DeepSpeed reduce bucket (500000000 elements): 1.0 GB" in out.splitlines()
    assert "engine   deepspeed: +1.0 GB on the placement's" in out
    code, text = _cli("check", "zero3", "--devices", "8", "--model", "gpt3-1.3b", "--json")
    doc = json.loads(text)
    terms = {t["name"]: t for t in doc["memory"]["engine"]["terms"]}
    assert terms["deepspeed_reduce_bucket"]["bytes"] == DEFAULT_BUCKET * 2
    assert terms["deepspeed_reduce_bucket"]["moment"] == "persistent"
    gpt = PRESETS["gpt3-1.3b"]
    assert isinstance(gpt, Transformer)
    assert doc["memory"]["peak"] == doc["memory"]["per_device"]["total"] + DEFAULT_BUCKET * 2 + _token_ids(gpt)


def test_deepspeed_notes_what_it_does_not_count() -> None:
    code, out = _cli("check", "zero2xpp2", "--devices", "4", "--model", "gpt3-1.3b")
    assert code in (0, 1)
    assert "note: DeepSpeed's pipeline engine refuses ZeRO-2/3 (runtime/pipe/engine.py)" in out
    _, out = _cli("check", "tp8", "--engine", "deepspeed")  # no ZeRO stage: nothing of DeepSpeed's counted
    assert "engine   deepspeed: its own buffers not modelled (placement only)" in out


def _imported(zero: dict[str, Any], model: Transformer | None = None) -> Any:
    from checker._import_deepspeed import import_deepspeed

    return import_deepspeed({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, devices=8, model=model)


@given(st.sampled_from([1, 2]), st.integers(1, 10**10), st.booleans())
def test_imported_bucket_settings_reach_the_terms(stage: int, size: int, overlap: bool) -> None:
    from checker._analysis import analyze

    imp = _imported({"stage": stage, "reduce_bucket_size": size, "overlap_comm": overlap})
    a = analyze(imp.composition, _model(), PRECISIONS["zero"], engine=Engine.DEEPSPEED, deepspeed=imp.deepspeed)
    assert a.engine is not None
    got = {t.key: t.bytes for t in a.engine.terms}
    # ZeRO-1/2 with overlap_comm: a second bucket (stage_1_and_2.py setup_buckets, buf_1)
    assert got["deepspeed_reduce_bucket"] == (2 if overlap else 1) * size * PRECISIONS["zero"].gradients


def test_imported_zero3_keeps_one_bucket_and_reads_float_and_auto_sizes() -> None:
    imp = _imported({"stage": 3, "reduce_bucket_size": 1.6e7, "overlap_comm": True})
    assert imp.deepspeed.reduce_bucket_elements == 16_000_000  # a JSON float DeepSpeed's pp_int reads
    pl = imp.composition.placement(_model())
    mem = memory(pl, _model(), PRECISIONS["zero"], group_sizes(_model()))
    got = {t.key: t.bytes for t in deepspeed_terms(pl, _model(), PRECISIONS["zero"], mem, imp.deepspeed)}
    assert got["deepspeed_reduce_bucket"] == 16_000_000 * 2  # ZeRO-3: one bucket whatever overlap_comm
    # Hugging Face's "auto": hidden x hidden elements (transformers integrations/deepspeed.py)
    assert _imported({"stage": 2, "reduce_bucket_size": "auto"}, _model()).deepspeed.reduce_bucket_elements == H * H
    without = _imported({"stage": 2, "reduce_bucket_size": "auto"})
    assert without.deepspeed.reduce_bucket_elements == DEFAULT_BUCKET
    assert any(u.setting == "zero_optimization.reduce_bucket_size=auto" for u in without.unmapped)
    assert not any("reduce_bucket_size" in u.setting for u in _imported({"stage": 2, "reduce_bucket_size": 9}).unmapped)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "big", True, 10**14])
def test_bad_bucket_sizes_are_one_line_exit_2(bad: Any, tmp_path: Any) -> None:
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": bad}})
    )
    code, out = _cli("check", "--from", str(config), "--devices", "8")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "reduce_bucket_size" in out, out


def _check_world(world: int, results: list[Any]) -> None:
    from checker._torch._deepspeed import REDUCE_BUCKET_ELEMENTS

    assert len(results) == 3 * world
    full, part = 4 * PARAMETERS, 4 * PARAMETERS // world
    for c in results:
        rows = {q: (p, m) for q, p, m in c.rows}
        stage = int(c.composition[4])
        params = part if stage == 3 else full
        # The prediction equals DeepSpeed's own partitions (the measured side is DeepSpeed's).
        assert c.model_states_exact and c.bucket_exact, c
        assert rows["parameters"][1] == params
        if stage != 2:  # ZeRO-2's partition holds straddling parameters whole (checked above)
            assert rows["gradients"][1] == (full if stage == 1 else part)
        assert rows["optimizer"][1] == 3 * part  # Adam's two moments and the fp32 master
        assert rows["reduce bucket"][1] == 4 * REDUCE_BUCKET_ELEMENTS
        recorded = c.measured_volume
        # ZeRO-1/2 gather the parameters once, ZeRO-3 twice (forward and backward: the validation
        # sets stage3_max_reuse_distance 0); every gradient is reduced once.
        assert recorded["all_gather"] == (2 * full if stage == 3 else full)
        if stage == 3:
            assert recorded["reduce_scatter"] == full
        else:
            assert recorded["all_reduce"] == full + 4  # the buckets and the fp32 gradient norm
        assert not c.not_modelled  # use_multi_rank_bucket_allreduce (the default): no ``reduce``


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
@pytest.mark.parametrize("world", [2, 4])
def test_zero_stages_on_gloo_processes(world: int) -> None:
    from checker._torch._deepspeed import compare_deepspeed, measure_deepspeed

    texts = tuple(f"zero{k}{world}" for k in (1, 2, 3))
    _check_world(world, [compare_deepspeed(m, world) for m in measure_deepspeed(world, texts)])


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
def test_reduce_calls_are_reported_not_modelled() -> None:
    from checker._torch._deepspeed import compare_deepspeed, measure_deepspeed

    results = [compare_deepspeed(m, 2, False) for m in measure_deepspeed(2, ("zero22",), multi_rank_allreduce=False)]
    for c in results:
        assert c.not_modelled == ("reduce",) and not c.ok
        assert c.measured_volume["reduce"] == 4 * PARAMETERS  # each gradient slice sent to its owner
        assert c.model_states_exact


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
def test_cli_validate_deepspeed_json_is_clean() -> None:
    # DeepSpeed's ranks log to stdout; the JSON on stdout must still parse (they write to stderr).
    import json
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "checker.cli", "check", "zero22", "--validate", "deepspeed", "--json"],
        capture_output=True,
        text=True,
        timeout=500,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 6, run.stderr[-2000:]  # the collective lists differ (bucket cut)
    ranks = json.loads(run.stdout)["validation"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["model_states_exact"] and r["bucket_exact"] for r in ranks)
