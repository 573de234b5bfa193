"""DeepSpeed's memory-estimator documentation, every printed figure, reproduced by the cost model.

Source: DeepSpeed, docs/code-docs/source/memory.rst ("Memory Requirements", microsoft/DeepSpeed),
which prints ``estimate_zero2_model_states_mem_needs_all_{live,cold}`` and
``estimate_zero3_model_states_mem_needs_all_{live,cold}`` for t5-3b on one node of 8 GPUs, and a
worked ZeRO-3 example for t5-large on 4 GPUs; and Hugging Face Transformers' DeepSpeed guide,
which prints the ZeRO-3 tables for bigscience/T0_3B on 1 and 2 GPUs. The estimators (deepspeed/runtime/zero/stage3.py,
stage_1_and_2.py) print bytes / 2**30 to two decimals ("GB" there is GiB), ``int()`` each figure,
and multiply the CPU figure (per node) by ``additional_buffer_factor`` = 1.5; the GPU figure is per
device. The t5 parameter counts come from the architecture (Raffel et al. 2020; the Hugging Face
t5-3b and t5-large config.json), counted here independently of the cost model.

Ours: per device, model states + the modes' buffers under the ``deepspeed`` recipe (2-byte
parameters, 4-byte gradient partition, 12-byte Adam + master); per node, the host memory of
``formal._engine_deepspeed.deepspeed_host_memory`` (initialisation with or without
``deepspeed.zero.Init``, or the offloaded states when larger) times the node's devices.

Where the two differ the test states the difference and why (``test_zero2_gpu_*``): DeepSpeed's
ZeRO-2 estimate keeps every fp16 gradient live (4 bytes a parameter before the partitions); the
cost model keeps the fp16 gradients of one unit at a time, reduced through a bucket, which is what
ZeRO-2 does (``stage_1_and_2.py``: gradients are copied into the ``ipg`` bucket and reduced as
backward produces them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from checker._analysis import Analysis, analyze
from checker._parse import parse
from formal._engine_deepspeed import INIT_BYTES, deepspeed_host_memory
from formal._model import PRECISIONS, ParameterCount, Transformer
from formal._tensors import parameter_tensors
from formal.errors import ModelError

GIB = Decimal(2**30)
BUFFER_FACTOR = Fraction(3, 2)  # additional_buffer_factor, the estimators' default
GPUS = 8  # "HW: Setup with 1 node, 8 GPUs per node."


def t5_parameters(
    d_model: int, d_ff: int, layers: int, heads: int, d_kv: int, vocab: int, gated: bool = False
) -> tuple[int, int]:
    """(total parameters, largest module's own parameters) of Hugging Face's ``T5Model``:
    a shared embedding (tied to both stacks), per encoder block self-attention q, k, v, o
    (``d_model x heads d_kv``, no biases) and a feed-forward ``wi``, ``wo``, each after an
    RMS-style layer norm of ``d_model``; a decoder block adds cross-attention and its norm; the
    first block of each stack holds the relative position bias (32 buckets x heads); each stack
    ends in a final norm. DeepSpeed's ``model_to_params`` counts shared tensors once. ``gated``:
    T5 v1.1's gated-GELU feed-forward, ``wi_0`` and ``wi_1`` beside ``wo``."""
    attention = 4 * d_model * heads * d_kv
    ffn = (3 if gated else 2) * d_model * d_ff
    encoder = layers * (attention + ffn + 2 * d_model) + 32 * heads + d_model
    decoder = layers * (2 * attention + ffn + 3 * d_model) + 32 * heads + d_model
    shared = vocab * d_model
    largest = max(shared, d_model * d_ff, heads * d_kv * d_model)
    return shared + encoder + decoder, largest


# t5-3b: d_model 1024, d_ff 16384, 24 layers, 32 heads of 128, vocabulary 32128.
T5_3B, T5_3B_LARGEST = t5_parameters(1024, 16384, 24, 32, 128, 32128)
COLD_3B, COLD_3B_LARGEST = 2851 * 10**6, 32 * 10**6  # "total_params=2851e6, largest_layer_params=32e6"

# ZeRO-3 rows as printed: (cpu_offload, cpu_offload_params, zero_init) -> (per CPU, per GPU) GB
ZERO3_LIVE = {
    (True, True, True): ("71.71", "0.12"),
    (True, True, False): ("127.48", "0.12"),
    (True, False, True): ("63.74", "0.79"),
    (True, False, False): ("127.48", "0.79"),
    (False, False, True): ("1.47", "6.10"),
    (False, False, False): ("127.48", "6.10"),
}
ZERO3_COLD = {
    (True, True, True): ("71.69", "0.12"),
    (True, True, False): ("127.45", "0.12"),
    (True, False, True): ("63.72", "0.78"),
    (True, False, False): ("127.45", "0.78"),
    (False, False, True): ("1.43", "6.09"),
    (False, False, False): ("127.45", "6.09"),
}
# ZeRO-2 rows: cpu_offload -> (per CPU, per GPU) GB
ZERO2_LIVE = {True: ("127.48", "5.31"), False: ("127.48", "15.93")}
ZERO2_COLD = {True: ("127.45", "5.31"), False: ("127.45", "15.93")}


def gb(value: Fraction) -> Decimal:
    """DeepSpeed's ``f"{v/2**30:.2f}GB"`` of ``int(v)``."""
    return (Decimal(int(value)) / GIB).quantize(Decimal("0.01"), ROUND_HALF_EVEN)


def fraction(value: object) -> Fraction:
    exact = sp.nsimplify(value)
    return Fraction(int(exact.p), int(exact.q))


def composition(stage: int, offload: bool, offload_params: bool, gpus: int = GPUS) -> str:
    return f"zero{stage}{gpus}" + ("xoffload" if offload else "") + ("xoffload-params" if offload_params else "")


def analysis(text: str, model: ParameterCount | Transformer) -> Analysis:
    return analyze(parse(text), model, PRECISIONS["deepspeed"])


def device_bytes(a: Analysis) -> Fraction:
    return fraction(a.memory.model_states + (a.memory.buffers or 0))


def node_host_bytes(a: Analysis, model: ParameterCount | Transformer, zero_init: bool, gpus: int = GPUS) -> Fraction:
    host = deepspeed_host_memory(a.placement, model, a.memory, zero_init)
    return host.per_node(gpus) * BUFFER_FACTOR


def test_t5_counts_are_the_printed_model_lines() -> None:
    """ "SW: Model with 2851M total params, 32M largest layer params." (``int(x / 1e6)``); the
    t5-large example: "total params: 737.67M", "largest layer params: 32.90M"."""
    assert (T5_3B // 10**6, T5_3B_LARGEST // 10**6) == (2851, 32)
    large, large_largest = t5_parameters(1024, 4096, 24, 16, 64, 32128)
    assert f"{large / 1e6:6.2f}M" == "737.67M" and f"{large_largest / 1e6:6.2f}M" == " 32.90M"


@pytest.mark.parametrize(
    ("total", "largest", "printed"), [(T5_3B, T5_3B_LARGEST, ZERO3_LIVE), (COLD_3B, COLD_3B_LARGEST, ZERO3_COLD)]
)
def test_zero3_estimator_table(
    total: int, largest: int, printed: dict[tuple[bool, bool, bool], tuple[str, str]]
) -> None:
    """Both ZeRO-3 tables (live model and cold counts), every row, per CPU and per GPU."""
    model = ParameterCount(total, largest_layer=largest)
    for (offload, offload_params, zero_init), (cpu, gpu) in printed.items():
        a = analysis(composition(3, offload, offload_params), model)
        assert gb(device_bytes(a)) == Decimal(gpu), (offload, offload_params, zero_init)
        assert gb(node_host_bytes(a, model, zero_init)) == Decimal(cpu), (offload, offload_params, zero_init)


# Hugging Face Transformers' DeepSpeed guide (docs/source/en/deepspeed.md, "Memory requirements";
# the 2-GPU table in its earlier main_classes/deepspeed.md): bigscience/T0_3B, T5 v1.1 XL
# (d_model 2048, gated d_ff 5120, 24 + 24 layers, 32 heads of 64, vocabulary 32128).
T0_3B, T0_3B_LARGEST = t5_parameters(2048, 5120, 24, 32, 64, 32128, gated=True)
T0_3B_TABLES = {
    1: {
        (True, True, True): ("70.00", "0.25"),
        (True, True, False): ("70.00", "0.25"),
        (True, False, True): ("62.23", "5.43"),
        (True, False, False): ("62.23", "5.43"),
        (False, False, True): ("0.37", "46.91"),
        (False, False, False): ("15.56", "46.91"),
    },
    2: {
        (True, True, True): ("70.00", "0.25"),
        (True, True, False): ("70.00", "0.25"),
        (True, False, True): ("62.23", "2.84"),
        (True, False, False): ("62.23", "2.84"),
        (False, False, True): ("0.74", "23.58"),
        (False, False, False): ("31.11", "23.58"),
    },
}


@pytest.mark.parametrize("gpus", sorted(T0_3B_TABLES))
def test_t0_3b_tables_of_the_transformers_guide(gpus: int) -> None:
    """ "SW: Model with 2783M total params, 65M largest layer params." (the shared embedding),
    then every row on 1 and on 2 GPUs of one node."""
    assert (T0_3B // 10**6, T0_3B_LARGEST // 10**6) == (2783, 65)
    model = ParameterCount(T0_3B, largest_layer=T0_3B_LARGEST)
    for (offload, offload_params, zero_init), (cpu, gpu) in T0_3B_TABLES[gpus].items():
        a = analysis(composition(3, offload, offload_params, gpus), model)
        assert gb(device_bytes(a)) == Decimal(gpu), (gpus, offload, offload_params, zero_init)
        assert gb(node_host_bytes(a, model, zero_init, gpus)) == Decimal(cpu), (gpus, offload, zero_init)


@pytest.mark.parametrize(("total", "printed"), [(T5_3B, ZERO2_LIVE), (COLD_3B, ZERO2_COLD)])
def test_zero2_estimator_table_cpu_and_offloaded_gpu(total: int, printed: dict[bool, tuple[str, str]]) -> None:
    """ZeRO-2 (no ``zero.Init``: every process builds the fp32 model): per CPU both rows, per
    GPU the offloaded row (2 bytes a parameter: the fp16 weights). Without ``--largest-layer``
    the buffers are unknown and not counted, as in DeepSpeed's ZeRO-2 estimate."""
    model = ParameterCount(total)
    for offload, (cpu, gpu) in printed.items():
        a = analysis(composition(2, offload, False), model)
        assert a.memory.buffers is None
        assert gb(node_host_bytes(a, model, zero_init=False)) == Decimal(cpu), offload
        if offload:
            assert gb(device_bytes(a)) == Decimal(gpu)


@pytest.mark.parametrize(("total", "printed"), [(T5_3B, ZERO2_LIVE), (COLD_3B, ZERO2_COLD)])
def test_zero2_gpu_without_offload_counts_every_fp16_gradient(total: int, printed: dict[bool, tuple[str, str]]) -> None:
    """The one printed figure we do not reproduce, and why: DeepSpeed prints ``4 P + 16 P / N``
    (15.93 GB), every fp16 gradient held at once; the cost model holds ``2 P + 16 P / N`` (10.62
    GB) plus one unit's fp16 gradient in the reduce bucket, since ZeRO-2 reduces each gradient
    into its bucket as backward produces it. The difference is exactly the fp16 gradients."""
    model = ParameterCount(total)
    a = analysis(composition(2, False, False), model)
    ours = device_bytes(a)
    deepspeed = 4 * total + int(Fraction(16 * total, GPUS))
    assert gb(Fraction(deepspeed)) == Decimal(printed[False][1])
    assert deepspeed - ours == 2 * total
    assert gb(ours) == Decimal("10.62")


def test_t5_large_worked_example() -> None:
    """memory.rst's ZeRO-3 example, t5-large on 4 GPUs, printed in MiB (``>> 20``):
    largest layer memory 125MB, case 1 (no offload) 3291MB, case 2 (offload both) 125MB,
    case 3 (offload optimizer) 477MB."""
    total, largest = t5_parameters(1024, 4096, 24, 16, 64, 32128)
    model = ParameterCount(total, largest_layer=largest)
    cases = {"zero34": 3291, "zero34xoffloadxoffload-params": 125, "zero34xoffload": 477}
    for text, mib in cases.items():
        a = analyze(parse(text), model, PRECISIONS["deepspeed"])
        assert int(device_bytes(a)) >> 20 == mib, text
    a = analyze(parse("zero34"), model, PRECISIONS["deepspeed"])
    assert int(fraction(a.memory.buffers)) >> 20 == 125  # largest_layer_memory = 4 * largest_layer_params


def test_zero_init_only_changes_the_build() -> None:
    """Host memory while the model is built: the whole fp32 model per process without
    ``zero.Init``, one fp32 module with it; the run's offloaded states are the same."""
    model = ParameterCount(COLD_3B, largest_layer=COLD_3B_LARGEST)
    a = analysis(composition(3, True, False), model)
    with_init = deepspeed_host_memory(a.placement, model, a.memory, zero_init=True)
    without = deepspeed_host_memory(a.placement, model, a.memory, zero_init=False)
    assert with_init.initialisation == INIT_BYTES * COLD_3B_LARGEST
    assert without.initialisation == INIT_BYTES * COLD_3B
    assert with_init.steady == without.steady == 16 * COLD_3B // GPUS  # fp32 gradient + Adam partition
    with pytest.raises(ModelError, match="ZeRO-3 only"):
        deepspeed_host_memory(analysis("zero28", model).placement, model, analysis("zero28", model).memory, True)
    with pytest.raises(ModelError, match="largest module is unknown"):
        bare = ParameterCount(COLD_3B)
        b = analysis("zero38", bare)
        deepspeed_host_memory(b.placement, bare, b.memory, zero_init=True)


def test_largest_layer_scales_with_tensor_parallelism_not_the_pipeline() -> None:
    """A unit is gathered whole along the data axis, split by tp like every weight, and sits on
    one pipeline stage: tp2 halves the gather buffer, pp2 leaves it."""
    model = ParameterCount(COLD_3B, largest_layer=COLD_3B_LARGEST)
    one = fraction(analysis("zero38", model).memory.buffers)
    assert one == 4 * COLD_3B_LARGEST
    assert fraction(analyze(parse("tp2xzero38"), model, PRECISIONS["deepspeed"]).memory.buffers) == one / 2
    assert fraction(analyze(parse("zero38xpp2"), model, PRECISIONS["deepspeed"]).memory.buffers) == one


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checker.cli", *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_cli_largest_layer_reproduces_the_zero3_gpu_row() -> None:
    """``check-composition zero3 --devices 8 --params 2851e6 --largest-layer 32e6 --precision
    deepspeed``: the cold table's 6.09 GB per GPU (no offload)."""
    done = cli("zero3", "--devices", "8", "--params", "2851e6", "--largest-layer", "32e6", "--precision", "deepspeed")
    assert done.returncode == 0, done.stderr
    done = cli(
        "zero3", "--devices", "8", "--params", "2851e6", "--largest-layer", "32e6", "--precision", "deepspeed", "--json"
    )
    per_device = json.loads(done.stdout)["memory"]["per_device"]
    assert per_device["buffers"] == 4 * COLD_3B_LARGEST
    assert gb(Fraction(per_device["model_states"] + per_device["buffers"])) == Decimal("6.09")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--params", "2851e6", "--largest-layer", "3e9"), "--largest-layer"),
        (("--params", "2851e6", "--largest-layer", "0"), "--largest-layer 0"),
        (("--params", "2851e6", "--largest-layer", "1.5"), "--largest-layer 1.5"),
        (("--params", "2851e6", "--largest-layer", "many"), "--largest-layer many"),
        (("--largest-layer", "32e6"), "needs --params"),
        (("--model", "gpt3-1.3b", "--largest-layer", "32e6"), "needs --params"),
    ],
)
def test_cli_refuses_a_bad_largest_layer_in_one_line(args: tuple[str, ...], says: str) -> None:
    done = cli("zero3", "--devices", "8", *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr


def test_zero2_offload_fits_11b_in_40gb() -> None:
    """memory.rst, ZeRO-2 with ``"cpu_offload": true`` (2 bytes a parameter on the GPU): "a 40GB
    GPU can fit ~11B param model ... the model weights take about 22GB and the remaining 18GB are
    used by other components"."""
    states = analysis(composition(2, True, False), ParameterCount(11 * 10**9)).memory.model_states
    assert Fraction(int(states), 10**9) == 22
    assert 40 - 22 == 18


@st.composite
def gpt_models(draw: st.DrawFn) -> Transformer:
    heads = draw(st.integers(1, 8))
    return Transformer(
        "g",
        layers=draw(st.integers(1, 3)),
        hidden=heads * draw(st.integers(1, 64)),
        heads=heads,
        vocab=draw(st.integers(1, 4000)),
        seq=draw(st.integers(1, 4096)),
        ffn=draw(st.one_of(st.none(), st.integers(1, 3000))),
        bias=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()),
        learned_positions=draw(st.booleans()),
    )


@settings(max_examples=40, deadline=None)
@given(gpt_models())
def test_largest_module_is_the_largest_registered_module(model: Transformer) -> None:
    """``Transformer.largest_module`` (what ``zero.Init`` builds at a time) is the largest sum of
    one module's own tensors (a weight and its bias) among the tensors the model registers
    (``formal._tensors.parameter_tensors``), as DeepSpeed's ``model_to_params`` finds it."""
    modules: dict[str, int] = {}
    for t in parameter_tensors(model):
        owner = t.name.rsplit(".", 1)[0]
        modules[owner] = modules.get(owner, 0) + t.elements
    assert model.largest_module == max(modules.values())
    a = analysis("zero38", model)
    init = deepspeed_host_memory(a.placement, model, a.memory, zero_init=True).initialisation
    assert init == INIT_BYTES * max(modules.values())


@pytest.mark.parametrize(("modifiers", "key"), [("", (False, False)), ("xoffload", (True, False))])
def test_cli_convention_deepspeed_prints_the_cold_rows(modifiers: str, key: tuple[bool, bool]) -> None:
    """``check-composition zero3 --devices 8 --params 2851e6 --largest-layer 32e6 --precision
    deepspeed --convention deepspeed``: the cold table's rows with and without ``zero_init``."""
    args = ["zero3" + modifiers, "--devices", "8", "--params", "2851e6", "--largest-layer", "32e6"]
    args += ["--precision", "deepspeed", "--convention", "deepspeed"]
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    conv = json.loads(done.stdout)["conventions"]
    assert conv["zero_stage"] == 3 and conv["devices_per_node"] == 8
    for row in conv["rows"]:
        cpu, gpu = ZERO3_COLD[(*key, row["zero_init"])]
        assert gb(Fraction(row["per_cpu"])) == Decimal(cpu) and gb(Fraction(row["per_gpu"])) == Decimal(gpu)
        assert f"{cpu}GB" in row["line"] and f"{gpu}GB" in row["line"]
    screen = cli(*args)
    assert screen.returncode == 0 and all(row["line"] in screen.stdout for row in conv["rows"])
    assert max(len(line) for line in screen.stdout.splitlines()) <= 80


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("tp8",), "needs a ZeRO stage"),
        (("zero3", "--devices", "8", "--params", "2851e6"), "largest module is unknown"),
        (("zero3", "--devices", "8", "--csv"), "not in --csv"),
    ],
)
def test_cli_convention_deepspeed_refusals_are_one_line(args: tuple[str, ...], says: str) -> None:
    done = cli(*args, "--convention", "deepspeed")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0]
