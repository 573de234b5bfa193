"""Published figures, reproduced exactly under each source's own rounding and unit convention.

Expected values come from the publications (or from the publication's own formula, evaluated
here independently of the cost model), never from our output. Sources sit beside the numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import pytest
import sympy as sp

from checker._analysis import Analysis, analyze
from checker._parse import parse
from formal._costs import STAGES, activation_memory, bubble_fraction, communication
from formal._model import PRECISIONS, ParameterCount, Transformer, megatron_parameter_count
from formal._presets import PRESETS
from formal._vocab import EMBEDDING_IO, LAYER_IO, LOGITS, OUTPUT_IO, Axis, OpKind, Stage, State

# A copy of the project's shared/data/published-examples.json, kept beside the tests so that a
# fresh clone runs them without the shared folder.
PUBLISHED = json.loads((Path(__file__).resolve().parent / "data" / "published-examples.json").read_text())
CASES = {case["id"]: case for case in PUBLISHED["cases"]}
GB = Decimal(10**9)  # the ZeRO paper's GB


def analysis(
    composition: str, model: Transformer | ParameterCount, precision: str = "zero", devices: int | None = None
) -> Analysis:
    return analyze(parse(composition, devices=devices), model, PRECISIONS[precision])


def model_states(composition: str, psi: int, precision: str = "zero") -> Fraction:
    """Exact model-state bytes per device (sympy Rational -> Fraction)."""
    value = sp.nsimplify(analysis(composition, ParameterCount(psi), precision).memory.model_states)
    return Fraction(int(value.p), int(value.q))


def psi_units(composition: str, psi: int = 7_500_000_000) -> Fraction:
    value = sp.nsimplify(analysis(composition, ParameterCount(psi)).model_state_psi)
    return Fraction(int(value.p), int(value.q))


def decimal(value: Fraction) -> Decimal:
    return Decimal(value.numerator) / Decimal(value.denominator)


# --- the seed abstract and introduction (shared/data/published-examples.json) -------------------


def test_abstract_zero3_uses_8x_less_memory_at_1_5x_the_communication() -> None:
    case = CASES["abstract-zero3-vs-dp"]
    n = case["inputs"]["devices"]
    psi = 7_500_000_000
    ratio_memory = model_states(f"dp{n}", psi) / model_states(f"zero3{n}", psi)
    ratio_comm = psi_units(f"zero3{n}") / psi_units(f"dp{n}")
    assert ratio_memory == case["expected"]["memory_ratio_dp_over_zero3"]
    assert ratio_comm == Fraction(str(case["expected"]["communication_ratio_zero3_over_dp"]))


def test_intro_70b_model_state_is_1120_gb() -> None:
    case = CASES["intro-70b-model-state"]
    psi = case["inputs"]["parameters"]
    expected = case["expected"]["model_state_bytes_per_device"]
    assert model_states("dp1", psi) == expected
    assert model_states("dp8", psi) == expected  # replication: every device holds all of it


# --- ZeRO (Rajbhandari et al., SC'20) --------------------------------------------------------

ZERO_STAGES = {"dp": "dp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3"}


def test_zero_figure1_7_5b_on_64_devices() -> None:
    """Figure 1: Psi = 7.5B, N_d = 64, K = 12; GB = 1e9 bytes, printed to one decimal."""
    case = CASES["zero-fig1-7.5b-64"]
    psi, n = case["inputs"]["parameters"], case["inputs"]["dp"]
    assert PRECISIONS["zero"].optimizer == case["inputs"]["K"]
    for key, expected in case["expected_gb"].items():
        gb = (decimal(model_states(f"{ZERO_STAGES[key]}{n}", psi)) / GB).quantize(Decimal("0.1"), ROUND_HALF_UP)
        assert gb == Decimal(str(expected)), key


def test_zero_communication_in_psi_units() -> None:
    """Section 7: DP, P_os and P_os+g move 2 Psi; P_os+g+p 3 Psi ((d-1)/d dropped)."""
    for key, expected in CASES["zero-comm"]["expected_psi_units"].items():
        for n in (2, 8, 64):
            assert psi_units(f"{ZERO_STAGES[key]}{n}") == expected, (key, n)


# ZeRO Table 1 (arXiv 1910.02054v3, section 5.4): per-device model-state memory in GB (1e9) for
# P_os, P_os+g, P_os+g+p at K = 12. The 7.5B column is rounded half up (two decimals below 10 GB,
# one above); the 128B and 1T columns are truncated (integers from 100 GB, one decimal below),
# e.g. 4187.5 -> 4187 and 2218.75 -> 2218.
ZERO_TABLE1: dict[int, dict[int, tuple[str, str, str]]] = {
    7_500_000_000: {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30"),
        16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.47"),
        1024: ("30.1", "15.1", "0.12"),
    },
    128_000_000_000: {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32"),
        256: ("518", "263", "8"),
        1024: ("513", "257", "2"),
    },
    1_000_000_000_000: {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4187", "2218", "250"),
        256: ("4046", "2054", "62.5"),
        1024: ("4011", "2013", "15.6"),
    },
}


def _table1_format(gb: Decimal, psi: int) -> Decimal:
    if psi == 7_500_000_000:
        places = Decimal("0.01") if gb < 10 else Decimal("0.1")
        return gb.quantize(places, ROUND_HALF_UP)
    places = Decimal("1") if gb >= 100 else Decimal("0.1")
    return gb.quantize(places, ROUND_FLOOR)


@pytest.mark.parametrize("psi", sorted(ZERO_TABLE1))
def test_zero_table1_per_device_memory(psi: int) -> None:
    for n, printed in ZERO_TABLE1[psi].items():
        for stage, text in zip(("zero1", "zero2", "zero3"), printed, strict=True):
            gb = decimal(model_states(f"{stage}{n}", psi)) / GB
            assert _table1_format(gb, psi) == Decimal(text), (psi, n, stage, gb)


# ZeRO Table 2 (section 5.4): the largest model whose states fit in 32 GB per V100 (GB = 1e9),
# 64-way DP, MP = 1: baseline 2B, P_os 7.6B, P_os+g 14.4B, P_os+g+p 128B. The paper's rows for
# MP = m are m times the MP = 1 figures (MP = 16: 32B, 121.6B, 230.4B, 2T).
ZERO_TABLE2_MP1 = {"dp": "2", "zero1": "7.6", "zero2": "14.4", "zero3": "128"}
ZERO_TABLE2_MP16 = {"dp": "32", "zero1": "121.6", "zero2": "230.4", "zero3": "2048"}


def test_zero_table2_largest_model_in_32gb() -> None:
    probe = 2**40  # any count: bytes per parameter do not depend on it
    for stage, printed in ZERO_TABLE2_MP1.items():
        per_param = model_states(f"{stage}64", probe) / probe
        billions = decimal(Fraction(32 * 10**9) / per_param) / Decimal(10**9)
        assert billions.quantize(Decimal("0.1"), ROUND_HALF_UP).normalize() == Decimal(printed).normalize()
        # MP = 16 (Megatron TP shards every weight of a bare count): exactly 16x the bytes saved.
        per_param_mp = model_states(f"tp16x{stage}64", probe) / probe
        assert per_param / per_param_mp == 16
        assert Decimal(printed) * 16 == Decimal(ZERO_TABLE2_MP16[stage])


# --- Megatron-LM ------------------------------------------------------------------------------

# Narayanan et al. 2021 (PTD-P), Table 1: (heads, hidden, layers) and the parameter count in
# billions, one decimal; V = 51200, s = 2048; counted with 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh))
# (section 5.1), which omits the final LayerNorm.
PTDP_TABLE1 = [
    (24, 2304, 24, "1.7"),
    (32, 3072, 30, "3.6"),
    (32, 4096, 36, "7.5"),
    (48, 6144, 40, "18.4"),
    (64, 8192, 48, "39.1"),
    (80, 10240, 60, "76.1"),
    (96, 12288, 80, "145.6"),
    (128, 16384, 96, "310.1"),
    (128, 20480, 105, "529.6"),
    (160, 25600, 128, "1008.0"),
]


@pytest.mark.parametrize(("heads", "hidden", "layers", "billions"), PTDP_TABLE1)
def test_ptdp_table1_parameter_counts(heads: int, hidden: int, layers: int, billions: str) -> None:
    gpt = Transformer("gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048, final_norm=False)
    formula = megatron_parameter_count(layers, hidden, 51200, 2048)
    # the closed form, expanded by hand: 12 l h^2 + 13 l h + (V + s) h
    assert formula == 12 * layers * hidden**2 + 13 * layers * hidden + (51200 + 2048) * hidden
    assert gpt.parameter_count() == formula
    printed = (Decimal(gpt.parameter_count()) / Decimal(10**9)).quantize(Decimal("0.1"), ROUND_HALF_UP)
    assert printed == Decimal(billions)
    with_final_norm = Transformer("gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)
    assert with_final_norm.parameter_count() == formula + 2 * hidden  # the final LayerNorm's weight and bias


# Megatron Core docs, "Distributed Optimizer": bytes per parameter, non-distributed and with the
# distributed optimizer over d data-parallel ranks.
MEGATRON_DISTOPT = {
    "megatron-fp16": (20, Fraction(4), Fraction(16)),  # fp16 params, fp16 grads: 20, 4 + 16/d
    "megatron": (18, Fraction(6), Fraction(12)),  # bf16 params, fp32 grads: 18, 6 + 12/d
    "fp32": (16, Fraction(8), Fraction(8)),  # fp32 params, fp32 grads: 16, 8 + 8/d
}


@pytest.mark.parametrize("precision", sorted(MEGATRON_DISTOPT))
def test_megatron_distributed_optimizer_bytes_per_parameter(precision: str) -> None:
    plain, fixed, per_rank = MEGATRON_DISTOPT[precision]
    psi = 10**9
    for d in (1, 2, 8, 64):
        assert model_states(f"dp{d}", psi, precision) == plain * psi
        assert model_states(f"distopt{d}", psi, precision) == (fixed + per_rank / d) * psi


# --- DeepSpeed's estimators (deepspeed/runtime/zero/stage3.py and stage_1_and_2.py) -----------


def deepspeed_zero3_estimate(
    total_params: int,
    largest_layer_params: int,
    gpus_per_node: int,
    nodes: int,
    cpu_offload: bool,
    cpu_offload_params: bool,
) -> tuple[Fraction, Fraction]:
    """``estimate_zero3_model_states_mem_needs`` (zero_init=True), before its
    ``additional_buffer_factor`` and ``int()``: (CPU bytes per node, GPU bytes per device)."""
    total_gpus = nodes * gpus_per_node
    gpus_factor = Fraction(1, nodes)
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            return total_params * 18 * gpus_factor, Fraction(largest_layer_memory)
        return total_params * 16 * gpus_factor, largest_layer_memory + Fraction(2 * total_params, total_gpus)
    return Fraction(largest_layer_params * 4 * gpus_per_node), largest_layer_memory + Fraction(
        18 * total_params, total_gpus
    )


def deepspeed_zero2_estimate(
    total_params: int, gpus_per_node: int, nodes: int, cpu_offload: bool
) -> tuple[Fraction, Fraction]:
    """``estimate_zero2_model_states_mem_needs`` before ``additional_buffer_factor`` and ``int()``."""
    total_gpus = nodes * gpus_per_node
    if cpu_offload:
        return Fraction(total_params * max(4 * total_gpus, 16)), Fraction(2 * total_params)
    return Fraction(total_params * 4 * gpus_per_node), 4 * total_params + Fraction(16 * total_params, total_gpus)


def _device_bytes(a: Analysis) -> Fraction:
    value = sp.nsimplify(a.memory.model_states + (a.memory.buffers or 0))
    return Fraction(int(value.p), int(value.q))


def _host_bytes(a: Analysis) -> Fraction:
    value = sp.nsimplify(a.memory.host)
    return Fraction(int(value.p), int(value.q))


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize(
    ("modifiers", "offload", "offload_params"),
    [("", False, False), ("xoffload", True, False), ("xoffloadxoffload-params", True, True)],
)
def test_deepspeed_zero3_estimator(gpus: int, modifiers: str, offload: bool, offload_params: bool) -> None:
    """GPT-3 XL: its word embedding (V h) is the largest module DeepSpeed's ``model_to_params``
    finds and also our largest gather unit, so both count 4 bytes (fp16 gather + fp16 gradient
    bucket) per element of it; one node of ``gpus`` devices."""
    model = PRESETS["gpt3-1.3b"]
    assert isinstance(model, Transformer)
    largest_module = model.vocab * model.hidden
    a = analysis(f"zero3{gpus}{modifiers}", model, "deepspeed")
    cpu, gpu = deepspeed_zero3_estimate(model.parameter_count(), largest_module, gpus, 1, offload, offload_params)
    assert _device_bytes(a) == gpu
    if offload:  # host bytes are per device; DeepSpeed's CPU figure is per node
        assert _host_bytes(a) * gpus == cpu


@pytest.mark.parametrize("gpus", [1, 2, 4, 8, 64])
def test_deepspeed_zero2_estimator(gpus: int) -> None:
    """Without offload DeepSpeed counts every fp16 gradient live (4 Psi = fp16 params + fp16
    grads, plus 16/N for fp32 grads and Adam): exactly our ZeRO-2 model states plus 2 Psi.
    With optimizer offload: 2 Psi on the device; on the host 16 Psi per node (the max() with
    4 N only matters past 4 devices, where DeepSpeed loads fp32 weights per process)."""
    psi = 1_310_720_000
    _, gpu = deepspeed_zero2_estimate(psi, gpus, 1, cpu_offload=False)
    assert model_states(f"zero2{gpus}", psi, "deepspeed") + 2 * psi == gpu
    a = analysis(f"zero2{gpus}xoffload", ParameterCount(psi), "deepspeed")
    cpu, gpu = deepspeed_zero2_estimate(psi, gpus, 1, cpu_offload=True)
    assert Fraction(int(a.memory.as_ints()["model_states"] or 0)) == gpu
    if gpus <= 4:
        assert _host_bytes(a) * gpus == cpu


# --- Korthikanti et al. 2022, Table 2: activation bytes per layer ----------------------------

SYMS = {name: sp.Symbol(name, positive=True) for name in ("s", "b", "h", "a", "t")}
KORTHIKANTI_SIZES = [  # (layers, hidden, heads, seq, micro_batch, t)
    (2, 64, 4, 32, 1, 2),
    (4, 128, 8, 64, 2, 4),
    (3, 96, 6, 48, 3, 2),
    (1, 256, 16, 128, 4, 8),
]
KORTHIKANTI_CASES = {  # formula key -> composition (t substituted)
    "none": "dp1",
    "tp": "tp{t}",
    "tp_sp": "tp{t}xsp",
    "tp_selective": "tp{t}xselective",
    "tp_sp_selective": "tp{t}xspxselective",
    "full_recompute": "dp1xrecompute",
}


IO_SYMS = {**SYMS, **{name: sp.Symbol(name, positive=True) for name in ("L", "p", "v", "delta_p1")}}
IO_FORMULA = sp.sympify(CASES["korthikanti-io-activations"]["formulas"]["extra_first_stage"], locals=IO_SYMS)


def korthikanti_io_bytes(key: str, values: dict[sp.Symbol, int], p: int = 1, output: bool | None = None) -> sp.Expr:
    """Section 4.3's input/output-layer bytes: ``p`` micro-batches of the input embeddings'
    dropout mask, and the output layer when ``output`` (the paper's delta_{p=1}; default p == 1).
    The paper states them with sequence parallelism (everything divided by t); without it only
    the vocabulary-parallel logits are split, so the sbh terms are the formula at t = 1 and the
    logits term 4sbv/t is kept apart."""
    delta = int(p == 1) if output is None else int(output)
    at = {IO_SYMS["p"]: p, IO_SYMS["delta_p1"]: delta}
    if "sp" in key:
        return IO_FORMULA.subs(at).subs(values)
    s_, b_, v_, t_ = values[SYMS["s"]], values[SYMS["b"]], values[IO_SYMS["v"]], values[SYMS["t"]]
    logits = 4 * s_ * b_ * v_ * delta
    return IO_FORMULA.subs(at).subs({**values, SYMS["t"]: 1}) - logits + logits / sp.Integer(t_)


@pytest.mark.parametrize("key", sorted(KORTHIKANTI_CASES))
def test_korthikanti_table2_activation_formulas(key: str) -> None:
    """Table 2 per layer, plus section 4.3's input and output layers (once per model)."""
    formula = sp.sympify(CASES["korthikanti-activations"]["formulas"][key], locals=SYMS)
    for layers, hidden, heads, seq, micro, t in KORTHIKANTI_SIZES:
        model = Transformer("k", layers=layers, hidden=hidden, heads=heads, vocab=1000, seq=seq, micro_batch=micro)
        pl = parse(KORTHIKANTI_CASES[key].format(t=t)).placement(model)
        ours = activation_memory(pl, model, PRECISIONS["zero"])
        values = {
            SYMS["s"]: seq,
            SYMS["b"]: micro,
            SYMS["h"]: hidden,
            SYMS["a"]: heads,
            SYMS["t"]: t,
            IO_SYMS["L"]: layers,
            IO_SYMS["v"]: 1000,
        }
        io_values = values if "{t}" in KORTHIKANTI_CASES[key] else {**values, SYMS["t"]: 1}  # no tp axis
        assert ours == layers * formula.subs(values) + korthikanti_io_bytes(key, io_values), (key, layers, hidden)


def test_korthikanti_first_stage_holds_p_micro_batches() -> None:
    """Section 4.2.3: under 1F1B the first stage holds p micro-batches of L/p layers, i.e. the
    whole model's activations of one micro-batch when m >= p; interleaving multiplies by
    1 + (p-1)/(p v). Section 4.3: it also keeps p micro-batches of the input embeddings' dropout
    mask, sbhp/t, and none of the output layer's activations (the delta_{p=1} term)."""
    model = Transformer("k", layers=8, hidden=64, heads=4, vocab=1000, seq=32)
    values = {
        SYMS["s"]: 32,
        SYMS["b"]: 1,
        SYMS["h"]: 64,
        SYMS["a"]: 4,
        SYMS["t"]: 1,
        IO_SYMS["L"]: 8,
        IO_SYMS["v"]: 1000,
    }
    layers_one = 8 * sp.sympify(CASES["korthikanti-activations"]["formulas"]["none"], locals=SYMS).subs(values)
    for p, m in ((2, 8), (4, 8), (4, 2)):
        live = min(p, m)  # micro-batches in flight; the paper's p when m >= p
        embedding = korthikanti_io_bytes("none", values, p) * sp.Rational(live, p)
        first = activation_memory(parse(f"pp{p}xm{m}").placement(model), model, PRECISIONS["zero"], Stage.FIRST)
        assert first == layers_one * sp.Rational(live, p) + embedding
        for v in (2, 4):
            inter = activation_memory(parse(f"pp{p}xm{m}xv{v}").placement(model), model, PRECISIONS["zero"])
            assert inter == (layers_one * sp.Rational(live, p) + embedding) * (1 + sp.Rational(p - 1, p * v))


def test_korthikanti_output_layer_lives_on_the_last_stage() -> None:
    """Section 4.3's output layer (final norm and head inputs 4sbh, fp32 logits 4sbv), on the
    last stage only, once per micro-batch it holds: 1 under 1F1B, m under GPipe."""
    model = Transformer("k", layers=8, hidden=64, heads=4, vocab=1000, seq=32)
    values = {
        SYMS["s"]: 32,
        SYMS["b"]: 1,
        SYMS["h"]: 64,
        SYMS["a"]: 4,
        SYMS["t"]: 1,
        IO_SYMS["L"]: 8,
        IO_SYMS["v"]: 1000,
    }
    layers_one = 8 * sp.sympify(CASES["korthikanti-activations"]["formulas"]["none"], locals=SYMS).subs(values)
    output = korthikanti_io_bytes("none", values, p=0, output=True)
    assert output == 4 * 32 * 64 * (1 + sp.Rational(1000, 64))  # 4sbh(1 + v/h), t = 1
    for p, m, schedule, live in ((2, 8, "", 1), (4, 8, "xgpipe", 8)):
        last = activation_memory(parse(f"pp{p}xm{m}{schedule}").placement(model), model, PRECISIONS["zero"], Stage.LAST)
        assert last == (layers_one / p + output) * live


# --- PTD-P (Narayanan et al. 2021): bubble and communication ----------------------------------


def test_ptdp_bubble_fractions() -> None:
    formulas = CASES["ptdp-bubble"]["formulas"]
    p_, m_, v_ = sp.symbols("p m v", positive=True)
    one_f_one_b = sp.sympify(formulas["1f1b_bubble_fraction"], locals={"p": p_, "m": m_})
    interleaved = sp.sympify(formulas["interleaved_bubble_fraction"], locals={"p": p_, "m": m_, "v": v_})
    for p, m, v in ((2, 4, 2), (4, 16, 2), (8, 32, 4), (4, 8, 3)):
        model = Transformer("k", layers=24, hidden=64, heads=4, vocab=1000, seq=32)
        assert bubble_fraction(parse(f"pp{p}xm{m}").placement(model)) == one_f_one_b.subs({p_: p, m_: m})
        assert bubble_fraction(parse(f"pp{p}xm{m}xv{v}").placement(model)) == interleaved.subs({p_: p, m_: m, v_: v})


def test_ptdp_tensor_and_pipeline_communication() -> None:
    """Section 3.2: per layer and micro-batch, TP does two all-reduces of b s h in the forward
    pass and two in the backward; with sequence parallelism an all-gather and a reduce-scatter
    replace each all-reduce at the same volume (Korthikanti et al. 2022, 4.2.2). PP sends
    b s h per micro-batch forward and backward, v times more when interleaved (2.2.2).

    The per-layer formula leaves out the vocabulary-parallel input and output layers (Shoeybi
    et al. 2019, section 3): the embedding table is split by vocabulary, so "an all-reduce (g
    operator) is required after the input embedding" (forward, first stage), and the output
    embedding reads its input whole on every rank (Megatron's f: identity forward, all-reduce
    of its input gradient backward, last stage); each b s h, once per micro-batch. With
    sequence parallelism (Korthikanti et al. 2022, 4.3) each all-reduce becomes a
    reduce-scatter and an all-gather in the other pass, at the same volume. Per device: the
    first stage does the embedding's, the last the head's. A device of a pipeline is an end of
    2v - [first] - [last] stage boundaries (v chunks), each one send or receive per micro-batch
    and pass. The loss over the vocabulary-split logits (Megatron-LM's
    ``_VocabParallelCrossEntropy.forward``, ``tensor_parallel/cross_entropy.py``) all-reduces
    three fp32 values per token on the last stage, the logits' maximum, the target's logit and
    the sum of exponentials: 3 m all-reduces of b s, with or without sequence parallelism (the
    head reads the whole sequence)."""
    L, h, s, b, t, p, m, v = 8, 64, 32, 2, 4, 2, 8, 2
    model = Transformer("k", layers=L, hidden=h, heads=4, vocab=1024, seq=s, micro_batch=b)
    bsh = b * s * h
    precision = PRECISIONS["zero"]
    for comp in (f"tp{t}xpp{p}xm{m}", f"tp{t}xspxpp{p}xm{m}"):
        program = analysis(comp, model).program
        for stage, vocab_group in ((Stage.FIRST, EMBEDDING_IO), (Stage.LAST, OUTPUT_IO)):
            tp = [
                x
                for x in communication(program, precision, stage)
                if x.axis is Axis.TP and x.state is State.ACTIVATIONS
            ]
            layers = [x for x in tp if x.group is LAYER_IO]
            loss = [x for x in tp if x.group is LOGITS]
            vocab = [x for x in tp if x.group not in (LAYER_IO, LOGITS)]
            assert {x.group for x in vocab} == {vocab_group}, (comp, stage)
            if stage is Stage.LAST:
                assert [(x.kind, int(x.elements), int(x.count)) for x in loss] == [(OpKind.ALL_REDUCE, b * s, 3 * m)]
                assert sum(Fraction(int(x.bytes)) for x in loss) == 3 * m * b * s * 4 * Fraction(2 * (t - 1), t)
            else:
                assert not loss
            tp = [x for x in tp if x.group is not LOGITS]
            calls = sum(int(x.count) for x in layers if x.kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER))
            assert calls == 4 * (L // p) * m  # 2 forward + 2 backward per layer of the stage
            assert all(int(x.elements) == bsh for x in tp)
            ring = Fraction(2 * (t - 1), t)  # all-reduce, or all-gather + reduce-scatter
            assert sum(Fraction(int(x.bytes)) for x in layers) == 4 * (L // p) * m * bsh * 2 * ring
            # the stage's vocabulary layer: one exchange per micro-batch
            assert sum(int(x.count) for x in vocab if x.kind in (OpKind.ALL_REDUCE, OpKind.ALL_GATHER)) == m
            assert sum(Fraction(int(x.bytes)) for x in vocab) == m * bsh * 2 * ring
    for comp, chunks in ((f"pp{p}xm{m}", 1), (f"pp{p}xm{m}xv{v}", v)):
        a = analysis(comp, model)
        for stage in (Stage.FIRST, Stage.LAST):
            sends = [x for x in communication(a.program, precision, stage) if x.kind is OpKind.SEND_RECV]
            ends = 2 * chunks - 1  # both devices of a two-stage pipeline are a first or a last stage
            assert sum(int(x.bytes) for x in sends) == 2 * m * ends * bsh * 2  # fwd + bwd, 2-byte activations
        assert a.traffic_stage == "first"  # equal traffic: the first stage is reported


def test_a_middle_stage_sends_both_ways_and_the_busiest_stage_is_reported() -> None:
    """pp4: the first and last stage are an end of one boundary, a middle stage of two, so it
    moves twice the activations; the report gives the stage whose device sends the most."""
    model = Transformer(
        "k", layers=8, hidden=64, heads=4, vocab=1024, seq=32, micro_batch=2, tied_embeddings=False
    )  # no embedding all-reduce between the ends
    bsh, m = 2 * 32 * 64, 8
    a = analysis(f"pp4xm{m}", model)
    precision = PRECISIONS["zero"]
    per_stage = {st: sum(int(x.bytes) for x in communication(a.program, precision, st)) for st in STAGES}
    assert per_stage[Stage.FIRST] == per_stage[Stage.LAST] == 2 * m * bsh * 2
    assert per_stage[Stage.MIDDLE] == 2 * per_stage[Stage.FIRST]
    assert a.traffic_stage == "middle" and int(a.communication_bytes) == per_stage[Stage.MIDDLE]


# --- the CLI acceptance: check-composition ... --params 7.5e9 --json -------------------

CLI_EXPECTED = {  # model-state bytes per device / Psi at N = 8, and Psi units (ZeRO paper)
    "dp": (Fraction(16), 2),
    "zero1": (4 + Fraction(12, 8), 2),
    "zero2": (2 + Fraction(14, 8), 2),
    "zero3": (Fraction(16, 8), 3),
}


def run_cli(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "checker.cli", *args], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert isinstance(doc, dict)
    return doc


def test_cli_zero_stages_at_8_devices() -> None:
    psi = 7_500_000_000
    docs = {}
    for stage, (per_param, units) in CLI_EXPECTED.items():
        doc = run_cli(stage, "--devices", "8", "--params", "7.5e9", "--json")
        memory, comm = doc["memory"], doc["communication"]
        assert isinstance(memory, dict) and isinstance(comm, dict)
        assert memory["unit"] == "bytes" and comm["unit"] == "bytes"
        assert memory["per_device"]["model_states"] == per_param * psi
        assert Fraction(comm["model_state_psi_units"]) == units
        assert doc["mesh"] == {"dp": 8} and doc["devices"] == 8
        docs[stage] = doc
    dp, z3 = cast(dict[str, Any], docs["dp"]), cast(dict[str, Any], docs["zero3"])
    assert Fraction(dp["memory"]["per_device"]["model_states"], z3["memory"]["per_device"]["model_states"]) == 8
    assert Fraction(z3["communication"]["model_state_psi_units"]) / Fraction(
        dp["communication"]["model_state_psi_units"]
    ) == Fraction(3, 2)
