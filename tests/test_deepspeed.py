"""DeepSpeed as a second real engine: ``deepspeed_terms`` and ``deepspeed_collectives`` against
independent counts, the importer's engine settings, the ``--validate deepspeed`` refusals, and
(``deepspeed`` marker, skipped without the extra) ZeRO 1-3 on 2 and 4 gloo processes measured
against the prediction: model states and the collectives list, call by call.

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


@given(stages(), data_degrees())
def test_the_reduce_bucket_holds_the_reduction_type_not_the_accumulation_type(stage: int, n: int) -> None:
    # 16-bit parameters accumulating in fp32 (the deepspeed recipe): the bucket is still 16-bit,
    # ZeRO-1/2's torch.empty(reduce_bucket_size, dtype=self.dtype) and ZeRO-3's ipg buckets of
    # communication_data_type (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py).
    assert _terms(stage, n, "deepspeed", 1000)["deepspeed_reduce_bucket"][0] == 1000 * 2


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
    # ZeRO-3 with DeepSpeed's defaults: every tensor of the small model has at most 1e5 elements,
    # so all are persistent, held whole all step, where the placement counts one layer gathered.
    layer = 12 * H * H + 13 * H
    gathered = (PARAMETERS - layer) * prec.parameters if stage == 3 else 0
    for moment in ("forward", "loss", "backward"):
        assert got.get(f"deepspeed_zero3_gathered_{moment}", 0) == gathered
    assert a.peak == placement + bucket + master + straddling + gathered + _token_ids(model)


def _cli(*args: str) -> tuple[int, str]:
    r = CliRunner(env={"COLUMNS": "80"}).invoke(main, list(args))
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.output


def test_cli_prints_the_reduce_bucket_as_its_own_line_and_in_json() -> None:
    code, out = _cli("check", "zero3", "--devices", "8", "--model", "gpt3-1.3b")
    assert code == 0
    # ZeRO-3 by name runs on DeepSpeed; 5e8 elements of 2-byte gradients: 1.0 GB
    assert "  DeepSpeed reduce bucket (500000000 elements): 1.0 GB" in out.splitlines()
    code, text = _cli("check", "zero3", "--devices", "8", "--model", "gpt3-1.3b", "--json")
    doc = json.loads(text)
    engine = doc["memory"]["engine"]
    terms = {t["name"]: t for t in engine["terms"]}
    assert terms["deepspeed_reduce_bucket"]["bytes"] == DEFAULT_BUCKET * 2
    assert terms["deepspeed_reduce_bucket"]["moment"] == "persistent"
    gpt = PRESETS["gpt3-1.3b"]
    assert isinstance(gpt, Transformer)
    # ZeRO-3's gathered parameters at the peak's moment (tests/test_zero3_fetches.py) beside the bucket
    gathered = terms[f"deepspeed_zero3_gathered_{engine['peak_moment']}"]["bytes"]
    assert doc["memory"]["peak"] == doc["memory"]["per_device"]["total"] + DEFAULT_BUCKET * 2 + gathered + _token_ids(
        gpt
    )
    added = (DEFAULT_BUCKET * 2 + gathered + _token_ids(gpt)) / 1e9
    assert f"engine   deepspeed: +{added:.1f} GB on the placement's" in out


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
        # The prediction equals DeepSpeed's own partitions and its collectives list, call by
        # call (kind, group size, bytes, count): the measured side is DeepSpeed's.
        assert c.model_states_exact and c.bucket_exact and c.calls_equal and c.ok, c
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
            assert recorded["all_reduce"] == 8  # the fp64 gradient norm
            assert _counted([b for k, _, b in c.measured_calls if k == "reduce_scatter"]) == ZERO3_BUCKETS
        else:
            assert recorded["all_reduce"] == full + 4  # the buckets and the fp32 gradient norm
            buckets = ZERO1_BUCKETS if stage == 1 else ZERO2_BUCKETS
            assert _counted([b for k, _, b in c.measured_calls if k == "all_reduce"]) == buckets | {1: 1}
        assert not c.not_modelled
        assert {n for _, n, _ in c.measured_calls} == {world}  # every call over the data ranks


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
def test_reduce_calls_are_modelled() -> None:
    from checker._torch._deepspeed import compare_deepspeed, measure_deepspeed

    texts = ("zero12", "zero22")
    results = [compare_deepspeed(m, 2, False) for m in measure_deepspeed(2, texts, multi_rank_allreduce=False)]
    for c in results:
        assert c.ok and c.calls_equal and c.model_states_exact, c
        assert c.measured_volume["reduce"] == 4 * PARAMETERS  # each gradient slice sent to its owner
        assert c.measured_volume["all_reduce"] == 4  # the norm only
    zero1 = [b for k, _, b in results[0].measured_calls if k == "reduce"]
    assert 4 * 64 in zero1  # the bucket cut by the partition boundary (hand count above)


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
def test_zero3_defaults_keep_the_small_model_persistent() -> None:
    from checker._torch._deepspeed import compare_deepspeed, measure_deepspeed

    measured = measure_deepspeed(2, ("zero32",), zero3="defaults")
    for c in [compare_deepspeed(m, 2, zero3="defaults") for m in measured]:
        assert c.ok and c.calls_equal, c
        gathers = [b for k, _, b in c.measured_calls if k == "all_gather"]
        assert len(gathers) == 1 + 12 * L + 2 + 1 and sum(gathers) == 4 * PARAMETERS  # after the step only


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
def test_zero3_reuse_distance_saves_the_gathers_deepspeed_saves() -> None:
    from checker._torch._deepspeed import compare_deepspeed, measure_deepspeed

    measured = measure_deepspeed(2, ("zero32",), zero3="reuse")
    for c in [compare_deepspeed(m, 2, zero3="reuse") for m in measured]:
        assert c.ok and c.calls_equal, c
        # Fewer gathers than released-after-use (every module twice), more than once each.
        gathers = [b for k, _, b in c.measured_calls if k == "all_gather"]
        assert 4 * PARAMETERS < sum(gathers) < 8 * PARAMETERS and len(gathers) < len(MODULES) * 2


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
@pytest.mark.parametrize(("world", "zero3"), [(2, "prefetch"), (4, "prefetch"), (2, "prefetch-reuse")])
def test_zero3_prefetch_is_replayed_call_for_call(world: int, zero3: str) -> None:
    # stage3_prefetch_bucket_size 20,000 elements (and 100, with a reuse distance of 20,000):
    # DeepSpeed's gathers, grouped as its prefetches group them, equal the replay's
    # (formal._engine_zero3), and so does the most it holds gathered at once, measured from the
    # parameters' own status after every collective.
    from checker._torch._deepspeed import compare_deepspeed, measure_deepspeed

    measured = measure_deepspeed(world, (f"zero3{world}",), zero3=zero3)
    for c in [compare_deepspeed(m, world, zero3=zero3) for m in measured]:
        assert c.ok and c.calls_equal and c.gathered_exact, c
        gathered = dict((q, m) for q, _, m in c.rows)["gathered (peak)"]
        assert 0 < gathered <= 4 * PARAMETERS
        if zero3 == "prefetch":
            # every prefetched use marks its parameter kept: at the peak every parameter is gathered
            assert gathered == 4 * PARAMETERS
            gathers = [b for k, _, b in c.measured_calls if k == "all_gather"]
            assert len(gathers) < len(MODULES)  # fewer calls than modules: the prefetch groups them


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
    assert run.returncode == 0, run.stderr[-2000:]  # valid, and DeepSpeed measured the prediction
    doc = json.loads(run.stdout)["validation"]
    assert doc["ok"] and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert all(r["model_states_exact"] and r["bucket_exact"] and r["collectives"]["equal"] for r in doc["ranks"])


# ---- the collectives list (``deepspeed_collectives``) --------------------------------------
#
# The validation's buckets, by hand from the net's tensors (registration order: embedding
# V*H = 16384; per block ln1 2H = 128, qkv 3H^2 + 3H = 12480, proj H^2 + H = 4160, ln2 128,
# fc1 4H^2 + 4H = 16640, fc2 4H^2 + H = 16448; final norm 128; head 16384) and DeepSpeed's rule
# (a gradient that would take the bucket past 20,000 elements sends the bucket first).
BUCKET = 20_000
# ZeRO-1 in registration order: [embed, ln1] [qkv, proj, ln2] [fc1] [fc2, next ln1 or final norm] [head]
ZERO1_BUCKETS = {16384 + 128: 1, 12480 + 4160 + 128: L, 16640: L, 16448 + 128: L, 16384: 1}
# ZeRO-2 in backward order (reverse registration: a linear's bias before its weight):
# [head, norm, fc2.b] [fc2.w, fc1.b] [fc1.w, ln2, proj.b] [proj.w, qkv.b, qkv.w, ln1, fc2.b of the
# block before] ... the first block's last bucket without that bias, then [embed].
ZERO2_BUCKETS = {
    16384 + 128 + 64: 1 + L,
    16384 + 256: L,
    4096 + 12480 + 128 + 64: L - 1,
    4096 + 12480 + 128: 1,
    16384: 1,
}
# ZeRO-3, modules in reverse order, each module's tensors together: [head, norm] [fc2] [fc1, ln2]
# [proj, qkv, ln1] ... [embed]; every module gathered in the forward and again in the backward.
# ([fc1, ln2] and [proj, qkv, ln1] are both 16,768 elements.)
ZERO3_BUCKETS = {16384 + 128: 1, 16448: L, 16640 + 128: 2 * L, 16384: 1}
assert 16640 + 128 == 4160 + 12480 + 128
MODULES = [16384, *[128, 12480, 4160, 128, 16640, 16448] * L, 128, 16384]


def _collectives(text: str, **settings: Any) -> tuple[dict[str, list[int]], tuple[str, ...]]:
    from formal._engine_deepspeed import deepspeed_collectives

    model = _model()
    fx = DeepSpeedEffects(**({"reduce_bucket_elements": BUCKET} | settings))
    terms, notes = deepspeed_collectives(parse(text).placement(model), model, PRECISIONS["fp32-adam"], fx)
    out: dict[str, list[int]] = {}
    for t in terms:
        out.setdefault(t.kind.value, []).extend(t.calls)
    return out, notes


def _counted(calls: list[int], nbytes: int = 4) -> dict[int, int]:
    from collections import Counter

    return {k // nbytes: v for k, v in Counter(calls).items()}


@pytest.mark.parametrize("n", [2, 4])
def test_zero1_and_zero2_buckets_are_the_hand_counted_ones(n: int) -> None:
    one, notes = _collectives(f"zero1{n}")
    assert not notes
    assert _counted(one["all_reduce"]) == ZERO1_BUCKETS | {1: 1}  # and the fp32 gradient norm
    assert one["all_gather"] == [4 * PARAMETERS]  # one all_gather_into_tensor of the flat buffer
    two, _ = _collectives(f"zero2{n}")
    assert _counted(two["all_reduce"]) == ZERO2_BUCKETS | {1: 1}
    # ZeRO-1 under overlap_comm reduces from the hooks, in ZeRO-2's order.
    assert _counted(_collectives(f"zero1{n}", overlap_comm=True)[0]["all_reduce"]) == ZERO2_BUCKETS | {1: 1}


def test_zero1_reduce_calls_split_the_bucket_at_the_partition_boundary() -> None:
    # Two ranks: the boundary is at P/2 = 216,384 = 16384 + 4 blocks of 49,984 + 64, inside
    # block 4's ln1: the bucket [fc2 of block 3, ln1 of block 4] goes 16448 + 64 elements to
    # rank 0 and 64 to rank 1; every other bucket to one owner.
    got, _ = _collectives("zero12", allreduce_gradients=False)
    expected = dict(ZERO1_BUCKETS)
    expected[16448 + 128] -= 1
    expected[16448 + 64] += 1  # the same size as [embed, ln1]
    assert _counted(got["reduce"]) == expected | {64: 1}
    assert got["all_reduce"] == [4]  # the norm only


@pytest.mark.parametrize("n", [2, 4])
def test_zero3_fetches_every_module_twice_without_reuse_or_persistence(n: int) -> None:
    off = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_elements": 0}
    got, notes = _collectives(f"zero3{n}", **off)
    assert not notes
    assert sorted(got["all_gather"]) == sorted(4 * m for m in MODULES * 2)  # every size divides by n
    assert _counted(got["reduce_scatter"]) == ZERO3_BUCKETS
    assert got["all_reduce"] == [8]  # the fp64 gradient norm


def test_zero3_reuse_distance_keeps_the_modules_used_again_soon() -> None:
    # stage3_max_reuse_distance 50,000: after its forward use a module stays gathered when the
    # trace reaches its backward use within 50,000 elements. The head (used again at once), the
    # final norm (16384 + 16384 elements between) and the last fc2 (128 + 2 x 16384 + 128 =
    # 33,024) are; the last fc1 is not (33,024 + 16,448 = 49,472 < 50,000 reaches fc2's backward,
    # 65,920 after it, before its own). Three backward gathers fewer.
    from collections import Counter

    off = {"param_persistence_threshold": 0, "max_reuse_distance": 50_000, "prefetch_bucket_elements": 0}
    got, _ = _collectives("zero32", **off)
    assert Counter(got["all_gather"]) == Counter(4 * m for m in MODULES * 2) - Counter([4 * 16384, 4 * 128, 4 * 16448])


def test_zero3_defaults_keep_a_small_model_persistent() -> None:
    # Every tensor has at most 1e5 elements: all persistent, no fetch in forward or backward,
    # one gather per tensor after the step; the buckets are unchanged.
    from formal._tensors import parameter_tensors

    got, notes = _collectives("zero32")
    assert not notes
    assert sorted(got["all_gather"]) == sorted(4 * t.elements for t in parameter_tensors(_model()))
    assert len(got["all_gather"]) == 1 + 12 * L + 2 + 1  # embedding, 12 a block, final norm, head
    assert _counted(got["reduce_scatter"]) == ZERO3_BUCKETS


def test_zero3_a_prefetch_bucket_as_large_as_the_model_gathers_it_once() -> None:
    # At the root's hook (the trace's first module, no parameters of its own) the prefetch pops
    # the whole queue and gathers every parameter in one call; each popped use marks the
    # parameter's latest use, so none is released before its backward use, and nothing is
    # gathered again. Every size divides by 2: the call moves 4 x PARAMETERS bytes.
    off = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_elements": 10**9}
    got, notes = _collectives("zero32", **off)
    assert not notes
    assert got["all_gather"] == [4 * PARAMETERS]
    assert _counted(got["reduce_scatter"]) == ZERO3_BUCKETS


def test_collectives_outside_one_zero_axis_are_not_modelled() -> None:
    for text in ("dp4", "tp2xzero22"):
        terms, notes = _collectives(text)
        assert not terms and len(notes) == 1 and "modelled" in notes[0], notes


def tensor_sizes() -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(1, 5000), min_size=1, max_size=30)


@given(stages(), data_degrees(), st.integers(1, 200_000), st.booleans())
def test_every_gradient_is_reduced_once(stage: int, n: int, bucket: int, multi: bool) -> None:
    # Whatever the bucket, the gradient calls carry every parameter's gradient once (ZeRO-3's
    # reduce-scatter its padded shards), each call at most a bucket or one tensor's slices.
    got, _ = _collectives(f"zero{stage}{n}", reduce_bucket_elements=bucket, allreduce_gradients=multi)
    if stage == 3:
        assert sum(got["reduce_scatter"]) == 4 * PARAMETERS
        return
    kind = "all_reduce" if multi else "reduce"
    calls = [c for c in got[kind] if c != 4]  # less the norm (no bucket is one element)
    assert sum(calls) == 4 * PARAMETERS
    assert max(calls) <= 4 * max(bucket, 16384 + 256)
    if not multi:  # per owner: at least as many calls as buckets
        assert len(calls) >= len(
            [c for c in _collectives(f"zero{stage}{n}", reduce_bucket_elements=bucket)[0]["all_reduce"] if c != 4]
        )


@given(data_degrees(), st.integers(0, 10**7))
def test_zero3_reuse_distance_only_saves_backward_gathers(n: int, reuse: int) -> None:
    # Without persistence, each module is gathered in the forward once; the backward re-gathers
    # a module only if it was released: at most once more. A distance covering the whole trace
    # keeps every module from its forward use to its backward one.
    got, _ = _collectives(
        f"zero3{n}", param_persistence_threshold=0, max_reuse_distance=reuse, prefetch_bucket_elements=0
    )
    total = sum(got["all_gather"])
    assert 4 * PARAMETERS <= total <= 8 * PARAMETERS
    if reuse >= 2 * PARAMETERS:
        assert total == 4 * PARAMETERS
    if reuse == 0:
        assert total == 8 * PARAMETERS


# ---- the importer reads the engine settings -----------------------------------------------


def test_importer_reads_the_engine_settings() -> None:
    from checker._import_deepspeed import deepspeed_effects

    raw = {
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 5e7,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": "auto",
            "use_multi_rank_bucket_allreduce": False,
        },
    }
    fx = deepspeed_effects(raw)
    assert fx.reduce_bucket_elements == 50_000_000 and fx.max_reuse_distance == 0
    assert fx.param_persistence_threshold == DeepSpeedEffects().param_persistence_threshold  # "auto": default
    assert not fx.allreduce_gradients and fx.overlap_comm  # overlap_comm defaults on for ZeRO-3
    assert fx.overflow_check and not fx.fp16
    assert not deepspeed_effects({"zero_optimization": {"stage": 2}}).overlap_comm


def test_imported_prefetch_and_live_limit_reach_the_replay() -> None:
    # A config's prefetch bucket and live-parameter limit are read (with or without stage3_) and
    # change the replayed gathers: a limit of 0 leaves no room to prefetch, whatever the bucket.
    from checker._import_deepspeed import deepspeed_effects
    from formal._engine_deepspeed import deepspeed_collectives

    def gathers(**zero: Any) -> list[int]:
        fx = deepspeed_effects({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}})
        pl = parse("zero32").placement(_model())
        terms, _ = deepspeed_collectives(pl, _model(), PRECISIONS["fp32-adam"], fx)
        return [b for t in terms if t.kind.value == "all_gather" for b in t.calls]

    fx = deepspeed_effects({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6}})
    assert fx.max_live_parameters == 1_000_000
    assert deepspeed_effects({"zero_optimization": {"max_live_parameters": 7}}).max_live_parameters == 7
    whole = gathers(stage3_prefetch_bucket_size=10**9, stage3_max_reuse_distance=0)
    assert whole == [4 * PARAMETERS]  # one gather of everything (the hand count above)
    none = gathers(stage3_prefetch_bucket_size=10**9, stage3_max_live_parameters=0, stage3_max_reuse_distance=0)
    unprefetched = gathers(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    assert none == unprefetched and len(none) == 2 * len(MODULES)


def test_settings_beyond_the_terms_are_reported_not_modelled() -> None:
    from checker._import_deepspeed import deepspeed_effects

    raw = {
        "communication_data_type": "fp16",
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "zero_quantized_weights": True},
    }
    fx = deepspeed_effects(raw)
    assert len(fx.unmodelled) == 3
    _, notes = _collectives("zero32", unmodelled=fx.unmodelled)
    assert len(notes) == 3 and all("DeepSpeed's collectives under" in n for n in notes)
    assert not deepspeed_effects({"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}).unmodelled
    # Accumulated micro-batches: the reductions per micro-batch are not modelled.
    _, notes = _collectives("zero22xm4")
    assert any("4 accumulated micro-batches" in n for n in notes)


@pytest.mark.parametrize(
    "zero",
    [{"reduce_bucket_size": 0}, {"reduce_bucket_size": 1.5}, {"overlap_comm": "yes"}, {"max_reuse_distance": -1}],
)
def test_importer_refuses_bad_engine_settings(zero: dict[str, Any]) -> None:
    from checker._import_common import ConfigError
    from checker._import_deepspeed import deepspeed_effects

    with pytest.raises(ConfigError, match="zero_optimization"):
        deepspeed_effects({"zero_optimization": {"stage": 2, **zero}})


def test_importer_says_what_the_bucket_keys_change() -> None:
    from checker._import_deepspeed import import_deepspeed

    zero = {"stage": 2, "reduce_bucket_size": 5e8, "use_multi_rank_bucket_allreduce": False, "max_reuse_distance": 0}
    notes = {
        u.setting.split("=")[0]: u.why
        for u in import_deepspeed({"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}, devices=8).unmapped
    }
    for key in ("use_multi_rank_bucket_allreduce", "max_reuse_distance"):
        assert "formal._engine_deepspeed" in notes[f"zero_optimization.{key}"]
    # the bucket is read into the engine's terms (memory and collectives), so it is not a note
    assert "zero_optimization.reduce_bucket_size" not in notes
    assert "same volume" not in notes["zero_optimization.use_multi_rank_bucket_allreduce"]
    engine = import_deepspeed({"zero_optimization": zero, "train_micro_batch_size_per_gpu": 1}, devices=8).deepspeed
    assert engine is not None and not engine.allreduce_gradients and engine.max_reuse_distance == 0


def test_the_validation_text_fits_80_columns() -> None:
    # The summary line of a ZeRO-3 rank and a long term label wrap at 80 columns, none cut.
    from checker._torch._deepspeed import DSComparison, format_deepspeed
    from formal._engine_terms import Term

    label = "ZeRO-3 gathered parameters less one layer (prefetch 0, reuse 0)"
    rows = (("parameters", 1, 1), ("reduce bucket", 2, 2), ("gathered (peak)", 3, 4))
    c = DSComparison(
        "zero34", 0, 4, rows, (), (), {}, {}, ("n" * 100,), 1.0, (Term("k", label, -199936, "forward", "buffers"),)
    )
    out = format_deepspeed([c])
    assert max(len(line) for line in out.splitlines()) <= 80
    words = " ".join(out.split())
    assert "gathered exact: False" in words and f"+ {label}: -199936 B, forward" in words
