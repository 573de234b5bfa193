"""The step-time model (formal/_steptime.py) and the hardware presets (formal/_hardware.py).

Expected values are computed here from the published formulas (Narayanan et al. 2021 eq. 3,
Megatron's four tensor-parallel all-reduces per layer, the ring factor 2(n-1)/n), never read from
the model's own output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checker._parse import parse
from formal._hardware import PRESETS, Hardware, hardware_of, load_hardware_toml
from formal._model import PRECISIONS, Transformer
from formal._placement import Recompute
from formal._program import derive_program
from formal._steptime import Efficiency, Runtime, StepTime, evaluate, prepare, training_flops_per_token
from formal.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
ZERO = PRECISIONS["zero"]
# Constants that isolate one effect: ideal GEMMs, ideal links, no element-wise kernels.
IDEAL = Efficiency(gemm_max=1.0, gemm_half=1e-9, network=1.0, memory=0.0)


@st.composite
def gpts(draw: st.DrawFn) -> Transformer:
    heads = draw(st.sampled_from([8, 16, 32]))
    hidden = heads * draw(st.sampled_from([64, 128]))
    return Transformer(
        "gpt",
        layers=draw(st.sampled_from([8, 16, 24])),
        hidden=hidden,
        heads=heads,
        vocab=draw(st.sampled_from([32000, 51200])),
        seq=draw(st.sampled_from([512, 1024, 2048])),
        micro_batch=draw(st.sampled_from([1, 2, 4])),
    )


def timed(composition: str, model: Transformer, hw: Hardware, eff: Efficiency = IDEAL) -> StepTime:
    pl = parse(composition).placement(model)
    return evaluate(prepare(derive_program(pl, model), model, ZERO, hw), eff)


@settings(max_examples=50)
@given(gpts())
def test_full_recomputation_flops_are_narayanan_eq3(model: Transformer) -> None:
    """96 B s l h^2 (1 + s/6h + V/16lh) per step: eq. 3 counts the 24h^2 matrices of a layer and
    the logits; the model also counts biases and norms, 13h per layer beside 12h^2: at most
    13/(12h) more."""
    s, h, n_layers, v = model.seq, model.hidden, model.layers, model.vocab
    eq3 = 96 * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h)) / s  # per token
    ours, without = training_flops_per_token(model, Recompute.FULL)
    assert eq3 <= ours <= eq3 * (1 + 13 / (12 * h))
    eq3_plain = 72 * s * n_layers * h * h * (1 + s / (6 * h) + v / (12 * n_layers * h)) / s  # no recomputation
    assert eq3_plain <= without <= eq3_plain * (1 + 13 / (12 * h))


@settings(max_examples=10)
@given(gpts(), st.sampled_from([2, 4, 8]))
def test_tensor_parallel_time_is_four_all_reduces_per_layer(model: Transformer, tp: int) -> None:
    """Megatron TP: two all-reduces of b s h in the forward and two in the backward of every
    layer, one for the embedding and one for the head's input gradient (Shoeybi et al. 2019),
    and the vocabulary-parallel cross-entropy's three fp32 values per token (the logits'
    maximum, the target's logit, the sum of exponentials: Megatron-LM's
    ``_VocabParallelCrossEntropy``), each moving 2(tp-1)/tp of the tensor over NVLink, none
    overlapped."""
    hw = PRESETS["a100-80gb"]
    t = timed(f"tp{tp}", model, hw)
    b, s, h, n_layers = model.micro_batch, model.seq, model.hidden, model.layers
    moved = (4 * n_layers + 2) * b * s * h * 2 + 3 * b * s * 4
    expected = moved * 2 * (tp - 1) / tp / hw.intra_node_bandwidth
    assert dict(t.exposed)["tp"] == pytest.approx(expected, rel=1e-9)
    compute = training_flops_per_token(model, Recompute.NONE)[0] * b * s / tp / hw.peak_flops
    assert t.compute_seconds == pytest.approx(compute, rel=1e-9)


@settings(max_examples=10)
@given(gpts(), st.sampled_from([2, 8, 16, 64]))
def test_ddp_all_reduce_overlaps_the_backward(model: Transformer, dp: int) -> None:
    """DDP's bucketed all-reduce runs under the backward (Li et al. 2020): exposed is what
    exceeds the backward; across nodes it runs on the per-GPU network."""
    hw = PRESETS["h100-80gb"]
    t = timed(f"dp{dp}", model, hw)
    n = model.parameter_count()
    bw = hw.intra_node_bandwidth if dp <= hw.node_size else hw.inter_node_bandwidth
    all_reduce = n * 2 * 2 * (dp - 1) / dp / bw  # fp16 gradients, ring factor
    backward = t.compute_seconds * 2 / 3
    assert dict(t.exposed).get("dp", 0.0) == pytest.approx(max(0.0, all_reduce - backward), rel=1e-9, abs=1e-15)


@settings(max_examples=8)
@given(gpts(), st.sampled_from([2, 4]), st.sampled_from([4, 8, 16]))
def test_bubble_is_the_schedules_fraction(model: Transformer, pp: int, m: int) -> None:
    """1F1B: (p-1)/m of the busiest stage's work (Narayanan et al. 2021, section 2.2)."""
    model = replace(model, layers=8, tied_embeddings=False)  # no gradient all-reduce after the flush
    t = timed(f"pp{pp}xm{m}", model, PRESETS["a100-80gb"])
    exposed = sum(s for _, s in t.exposed)
    assert t.bubble_seconds == pytest.approx((pp - 1) / m * (t.compute_seconds + exposed), rel=1e-9)


@settings(max_examples=10)
@given(gpts(), st.sampled_from(["tp2xdp4", "zero38", "tp2xpp2xm4xdp2", "fsdp4xrecompute", "tp4xspxselective"]))
def test_breakdown_adds_up_and_faster_links_never_slow_a_step(model: Transformer, composition: str) -> None:
    hw = PRESETS["a100-40gb"]
    eff = Efficiency(0.7, 500.0, 0.8, 1.0)
    t = timed(composition, model, hw, eff)
    parts = t.compute_seconds + sum(s for _, s in t.exposed) + t.bubble_seconds + t.optimizer_seconds
    assert t.step_seconds == pytest.approx(parts + t.host_seconds, rel=1e-12)
    assert all(s >= 0 for _, s in t.exposed) and t.compute_seconds > 0
    fast = replace(
        hw, inter_node_bandwidth=hw.inter_node_bandwidth * 4, intra_node_bandwidth=hw.intra_node_bandwidth * 4
    )
    assert timed(composition, model, fast, eff).step_seconds <= t.step_seconds
    assert 0 < t.mfu < 1


def test_async_tp_hides_tensor_parallel_time_under_compute() -> None:
    model = Transformer("gpt", layers=8, hidden=4096, heads=32, vocab=51200, seq=2048, micro_batch=4)
    pl = parse("tp8").placement(model)
    program = derive_program(pl, model)
    hw = PRESETS["h100-80gb"]
    plain = evaluate(prepare(program, model, ZERO, hw), IDEAL)
    overlapped = evaluate(prepare(program, model, ZERO, hw, Runtime(tp_overlap=True)), IDEAL)
    tp = dict(plain.exposed)["tp"]
    assert tp < plain.compute_seconds  # so async TP hides all of it
    assert overlapped.step_seconds == pytest.approx(plain.step_seconds - tp, rel=1e-9)


def test_offloaded_optimizer_pays_the_host_link() -> None:
    model = Transformer("gpt", layers=4, hidden=1024, heads=16, vocab=32000, seq=1024)
    on = timed("zero28", model, PRESETS["a100-80gb"])
    off = timed("zero28xoffload", model, PRESETS["a100-80gb"])
    assert on.host_seconds == 0 and off.host_seconds > 0
    assert off.optimizer_seconds > on.optimizer_seconds  # host DRAM is slower than HBM


# --- hardware -------------------------------------------------------------------------------


def test_presets_carry_their_datasheet_figures() -> None:
    assert set(PRESETS) == {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "b200"}
    assert PRESETS["a100-80gb"].peak_flops == 312e12 and PRESETS["h100-80gb"].peak_flops == 989e12
    for hw in PRESETS.values():
        assert hw.node_size == 8 and "datasheet" in hw.source
        assert hw.intra_node_bandwidth > hw.inter_node_bandwidth


@settings(max_examples=12)
@given(st.sampled_from(sorted(PRESETS)))
def test_a_toml_with_every_key_reads_back_its_preset(name: str) -> None:
    """Every figure written in the file's units (GB = 1e9 bytes, TFLOP/s) reads back exactly."""
    import tempfile

    hw = PRESETS[name]
    text = (
        f'name = "{name}"\npeak_tflops = {hw.peak_flops / 1e12!r}\n'
        f"memory_bandwidth_gb_s = {hw.memory_bandwidth / 1e9!r}\n"
        f"device_memory_gb = {hw.device_memory // 10**9}\nnode_size = {hw.node_size}\n"
        f"nvlink_gb_s = {hw.intra_node_bandwidth / 1e9!r}\nnetwork_gb_s = {hw.inter_node_bandwidth / 1e9!r}\n"
        f"pcie_gb_s = {hw.host_bandwidth / 1e9!r}\nhost_memory_bandwidth_gb_s = {hw.host_memory_bandwidth / 1e9!r}\n"
    )
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "site.toml"
        path.write_text(text)
        read = load_hardware_toml(path)
    assert replace(read, source=hw.source) == hw


def test_hardware_toml_from_a_base(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text('base = "h100-80gb"\nname = "site"\nnetwork_gb_s = 25\n')
    hw = load_hardware_toml(path)
    assert hw.inter_node_bandwidth == 25e9 and hw.peak_flops == PRESETS["h100-80gb"].peak_flops
    assert hardware_of(str(path)).name == "site"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("peak_tflops = 100\n", "missing"),
        ('base = "h100-80gb"\nbogus = 1\n', "unknown key 'bogus'"),
        ('base = "h100-80gb"\nnetwork_gb_s = -1\n', "network_gb_s=-1"),
        ('base = "h100-80gb"\nnode_size = 2.5\n', "node_size"),
        ('base = "h100-80gb"\npeak_tflops = "fast"\n', "peak_tflops"),
        ('base = "tpu"\n', "base='tpu'"),
        ("peak_tflops = \n", "not valid TOML"),
        ('base = "h100-80gb"\nname = 7\n', "name must be a string"),
        ('base = "h100-80gb"\n"bad\\u001b[31m" = 1\n', "unknown key 'bad\\x1b[31m'"),  # escaped, not echoed
    ],
)
def test_bad_hardware_toml_is_refused_naming_the_key(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=None) as err:
        load_hardware_toml(path)
    assert says in str(err.value)


def test_cli_check_reports_a_time_object_and_refuses_bad_hardware(tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "checker.cli", "check"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    ok = subprocess.run(
        [*cli, "tp2xzero3", "--hardware", "a100-80gb", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    time = json.loads(ok.stdout)["time"]
    assert {"step_seconds", "mfu", "tflops_per_device", "tokens_per_second", "breakdown"} <= set(time)
    assert set(time["breakdown"]) >= {"compute", "exposed_communication", "bubble", "optimizer"}
    parts = time["breakdown"]
    total = parts["compute"] + sum(parts["exposed_communication"].values()) + parts["bubble"]
    assert time["step_seconds"] == pytest.approx(total + parts["optimizer"] + parts["host_transfers"], rel=1e-12)
    assert set(time["constants"]) == {"gemm_max", "gemm_half", "network", "memory"}
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "a100-80gb"\nnvlink_gb_s = 0\n')
    refused = subprocess.run(
        [*cli, "tp2", "--hardware", str(bad)], capture_output=True, text=True, env=env, timeout=120
    )
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "nvlink_gb_s=0" in refused.stderr
    bare = subprocess.run(
        [*cli, "tp2", "--params", "7B", "--hardware", "a100-80gb"], capture_output=True, text=True, env=env, timeout=120
    )
    assert bare.returncode == 2 and "needs a model with layers" in bare.stderr  # refused, not guessed
