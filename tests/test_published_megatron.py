"""Megatron-LM's theoretical memory (megatron/training/theoretical_memory_usage.py, NVIDIA/Megatron-LM
at 00caa53a), evaluated here from its own arguments, against the cost model with Megatron's
conventions as named terms (``formal._megatron_memory``).

Inputs: Megatron-LM's published GPT-3 175B launcher (examples/gpt3/train_gpt3_175b_distributed.sh:
96 layers, hidden 12288, 96 heads, sequence 2048, micro-batch 1, global batch 1536, tp 8, pp 16,
fp16; the vocabulary of GPT-2's 50257 tokens padded to a multiple of 128 x tp = 51200), read by
the importer from tests/data/megatron_train_gpt3_175b_distributed.sh on 128 devices (dp 1, so
1536 micro-batches); the same run with ``--sequence-parallel --recompute-granularity selective``
(Megatron's other activation formula); and Llama-2 7B (Touvron et al. 2023: 32 layers, hidden
4096, SwiGLU FFN 11008, RMSNorm, vocabulary 32000, sequence 4096, untied) at tp 8 with sequence
parallelism and selective recomputation, and on one device.

Each convention where Megatron counts differently is a term whose size is checked against its
closed form; with every term applied the cost model's figure equals Megatron's exactly. Which
is right, term by term, is argued in formal/_megatron_memory.py: the cost model counts what the
layers register and save; Megatron's formula omits biases, the position table and the attention
scores (its formula without sequence parallelism), splits replicated norms and token ids by tp,
and adds 5% for temporaries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from checker._analysis import Analysis, analyze
from checker._command import analysis_of, request
from checker._parse import parse
from formal._costs import layer_activations, memory
from formal._engine_effects import Engine, engine_prediction
from formal._megatron_memory import WITHOUT_SP_OVERHEAD, MegatronMemory, megatron_memory
from formal._model import PRECISIONS, Transformer
from formal._presets import PRESETS
from formal._vocab import Stage

MB = 1024 * 1024  # NUM_BYTES_IN_MEGABYTE
SCRIPT = Path(__file__).resolve().parent / "data" / "megatron_train_gpt3_175b_distributed.sh"
GPT3: dict[str, Any] = {
    "num_layers": 96,
    "hidden_size": 12288,
    "num_attention_heads": 96,
    "num_query_groups": 96,
    "kv_channels": 128,
    "ffn_hidden_size": 4 * 12288,
    "swiglu": False,
    "normalization": "LayerNorm",
    "padded_vocab_size": 51200,
    "untie_embeddings_and_output_weights": False,
    "seq_length": 2048,
    "micro_batch_size": 1,
    "tensor_model_parallel_size": 8,
    "pipeline_model_parallel_size": 16,
    "data_parallel_size": 1,
    "use_distributed_optimizer": False,
}


def weight_and_optimizer(args: dict[str, Any]) -> Fraction:
    """``compute_weight_and_optimizer_memory`` for a dense model, in exact arithmetic."""
    h, heads = args["hidden_size"], args["num_attention_heads"]
    query_ratio = Fraction(args["kv_channels"] * heads, h)
    gated = Fraction(3, 2) if args["swiglu"] else 1
    norm_size = 1 if args["normalization"] == "RMSNorm" else 2
    self_attn = 2 * h * h * (1 + Fraction(args["num_query_groups"], heads)) * query_ratio
    layer = 2 * h * (args["ffn_hidden_size"] * gated + norm_size) + self_attn
    embedding = h * args["padded_vocab_size"]
    block = layer * args["num_layers"] + norm_size * h
    pp, tp = args["pipeline_model_parallel_size"], args["tensor_model_parallel_size"]
    shard = (block / pp + embedding) / tp
    if args["untie_embeddings_and_output_weights"] and pp == 1:
        shard += Fraction(embedding, tp)
    per_param = 6 + Fraction(12, args["data_parallel_size"]) if args["use_distributed_optimizer"] else 18
    return Fraction(shard * per_param)


def activations_sp(args: dict[str, Any], microbatches: int, virtual: int | None = None) -> Fraction:
    """``compute_activation_memory`` (sequence parallelism + selective); ``virtual``: the
    interleaved schedule's ``virtual_pipeline_model_parallel_size``."""
    s, b, h = args["seq_length"], args["micro_batch_size"], args["hidden_size"]
    pp, tp = args["pipeline_model_parallel_size"], args["tensor_model_parallel_size"]
    total = s * b * h * (18 + Fraction(4 * args["ffn_hidden_size"], h)) * args["num_layers"]
    total += 8 * s * b * pp + s * b * h * pp
    if virtual is not None:
        total *= 1 + Fraction(pp - 1, pp * virtual)
    elif pp > 1:
        total *= min(1, Fraction(microbatches, pp))
    else:
        total += s * b * h * 4 * (1 + Fraction(args["padded_vocab_size"], h))
    return Fraction(total / tp)


def activations_without_sp(args: dict[str, Any], microbatches: int) -> Fraction:
    """``compute_activation_memory_without_sp``, non-interleaved."""
    s, b, h = args["seq_length"], args["micro_batch_size"], args["hidden_size"]
    pp, tp = args["pipeline_model_parallel_size"], args["tensor_model_parallel_size"]
    total = s * b * h * (10 + Fraction(24, tp)) * args["num_layers"]
    total += 8 * s * b * pp + s * b * h * pp
    if pp > 1:
        total *= min(1, Fraction(microbatches, pp))
    else:
        total += (Fraction(s * b * args["padded_vocab_size"], tp) + s * b * h) * 2
    return Fraction(total * Fraction(105, 100))


def ours(a: Analysis) -> MegatronMemory:
    pl = a.placement
    first = memory(pl, a.model, a.precision, a.model.group_elements(), Stage.FIRST)
    prediction = engine_prediction(pl, a.model, a.precision, first, Engine.MEGATRON, Stage.FIRST)
    assert isinstance(a.model, Transformer)
    return megatron_memory(pl, a.model, a.precision, first, prediction)


def terms(m: MegatronMemory) -> dict[str, Fraction]:
    return {t.key: t.bytes for t in (*m.weight_terms, *m.activation_terms)}


def printed(weights: Fraction, acts: Fraction) -> str:
    """report_theoretical_memory's line."""
    w, a = float(weights) / MB, float(acts) / MB
    return f"weight and optimizer={w:.2f} MB, activation={a:.2f} MB, total={w + a:.2f} MB"


def test_gpt3_175b_launcher_as_published() -> None:
    """The launcher has neither sequence parallelism nor selective recomputation: Megatron's
    formula without sequence parallelism (10 + 24/t a layer, no attention scores, +5%)."""
    req = request(None, 128, None, None, "megatron", None, from_path=str(SCRIPT))
    a = analysis_of(req)
    assert a.precision.name == "megatron-fp16"  # --fp16: 2 + 2 + 16 bytes (Megatron Core's docs: 20)
    assert (int(a.placement.pipeline_degree), int(a.placement.options.micro_batches)) == (16, 1536)
    m = ours(a)
    assert not m.sequence_parallel_formula
    assert m.weights_and_optimizer == weight_and_optimizer(GPT3)
    assert m.activations == activations_without_sp(GPT3, 1536)
    assert printed(m.weights_and_optimizer, m.activations) == printed(
        weight_and_optimizer(GPT3), activations_without_sp(GPT3, 1536)
    )
    # the terms, each from its closed form (20 bytes a parameter, first stage: 6 of 96 layers)
    h, s, t, p, layers = 12288, 2048, 8, 16, 6
    got = terms(m)
    assert got["linear_biases"] == -20 * layers * (Fraction(7 * h, t) + 2 * h)  # qkv, fc1 split; proj, fc2 not
    assert got["position_table"] == -20 * s * h
    assert got["norms_split_by_tp"] == -20 * layers * 4 * h * (1 - Fraction(1, t))
    assert got["final_norm_spread"] == 20 * Fraction(2 * h, p * t)
    # the formula's 18 bytes a parameter for an fp16 run's 20: 10% less of what it counts
    assert got["bytes_per_parameter"] == -(m.weights_and_optimizer / 18) * 2
    scores = 5 * 96 * s * s // t  # 5 a s^2 b / t a layer: Megatron's formula leaves them out
    assert got["layer_formula"] == -scores * 96
    assert got["overhead"] == (m.activations / WITHOUT_SP_OVERHEAD) * (WITHOUT_SP_OVERHEAD - 1)
    assert m.ours_weights_and_optimizer == Fraction(int(a.memory.model_states))


def test_gpt3_175b_with_sequence_parallelism_and_selective() -> None:
    """Megatron's other formula, sbh(18 + 4f/h)/t a layer: equal to the cost model's layer for
    GPT; the one difference is the input ids, which Megatron divides by tp."""
    model = PRESETS["gpt3-175b"]
    a = analyze(parse("tp8xspxselectivexpp16xm1536"), model, PRECISIONS["megatron"])
    m = ours(a)
    assert m.sequence_parallel_formula
    assert m.weights_and_optimizer == weight_and_optimizer(GPT3)
    assert m.activations == activations_sp(GPT3, 1536)
    got = terms(m)
    assert got["layer_formula"] == 0
    assert got["input_ids"] == -8 * 2048 * 16 * (1 - Fraction(1, 8))


LLAMA2_7B: dict[str, Any] = {
    **GPT3,
    "num_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_query_groups": 32,
    "ffn_hidden_size": 11008,
    "swiglu": True,
    "normalization": "RMSNorm",
    "padded_vocab_size": 32000,
    "untie_embeddings_and_output_weights": True,
    "seq_length": 4096,
    "pipeline_model_parallel_size": 1,
}


@pytest.mark.parametrize(("composition", "tp"), [("tp8xspxselective", 8), ("dp1", 1)])
def test_llama2_7b(composition: str, tp: int) -> None:
    """Llama-2 7B: no biases and no position table, so the weights differ only by the norms
    divided by tp; the activations by Megatron's layer formula, which counts an ungated FFN
    with dropout (``2sbf`` less for SwiGLU's saved input, ``2sbh`` more for the masks Llama
    does not keep), plus the token-id conventions."""
    model = PRESETS["llama2-7b"]
    assert isinstance(model, Transformer) and model.seq == 4096 and model.ffn_ == 11008
    args = {**LLAMA2_7B, "tensor_model_parallel_size": tp}
    a = analyze(parse(composition), model, PRECISIONS["megatron"])
    m = ours(a)
    assert m.weights_and_optimizer == weight_and_optimizer(args)
    expected = activations_sp(args, 1) if m.sequence_parallel_formula else activations_without_sp(args, 1)
    assert m.activations == expected
    got = terms(m)
    assert got["linear_biases"] == got["position_table"] == 0
    assert got["norms_split_by_tp"] == -18 * 32 * 2 * 4096 * (1 - Fraction(1, tp))
    if tp == 8:
        sbh, sbf = 4096 * 4096, 4096 * 11008
        assert got["layer_formula"] == (2 * sbh - 2 * sbf) * 32 / tp


def test_per_layer_line_under_sequence_parallelism() -> None:
    """``compute_activation_memory``'s verbose line, "Activation memory footprint per transformer
    layer: 102.0 MB" for GPT-3 175B at tp 8: sbh(18 + 4f/h)/t in MiB to one decimal, the cost
    model's layer under tp8xspxselective."""
    args = GPT3
    s, b, h = args["seq_length"], args["micro_batch_size"], args["hidden_size"]
    megatron = s * b * h * (18 + Fraction(4 * args["ffn_hidden_size"], h)) / 8
    a = analyze(parse("tp8xspxselectivexpp16xm1536"), PRESETS["gpt3-175b"], PRECISIONS["megatron"])
    assert isinstance(a.model, Transformer)
    per_layer = a.model.activation_bytes_per_layer(2, 1)
    ours_layer = Fraction(str(layer_activations(a.placement, per_layer, s * b * h, a.precision)))
    assert f"{float(megatron) / MB:.1f} MB" == f"{float(ours_layer) / MB:.1f} MB" == "102.0 MB"


def test_gpt3_175b_interleaved() -> None:
    """``--num-layers-per-virtual-pipeline-stage 3`` (v = 2): Megatron multiplies the first stage's
    activations by ``1 + (p - 1)/(p v)``, 23.5 micro-batches' worth, as the cost model does; its
    ids are counted for 23.5 micro-batches too, ours for the 24 whole ones in flight."""
    a = analyze(parse("tp8xspxselectivexpp16xm1536xv2"), PRESETS["gpt3-175b"], PRECISIONS["megatron"])
    m = ours(a)
    assert m.activations == activations_sp(GPT3, 1536, virtual=2)
    assert terms(m)["input_ids"] == 8 * 2048 * Fraction(47, 2) / 8 - 8 * 2048 * 24


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checker.cli", *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_cli_convention_megatron_prints_megatrons_line() -> None:
    """``check-composition --from <the 175B launcher> --devices 128 --convention megatron``: the
    JSON's ``conventions.line`` is ``report_theoretical_memory``'s line from Megatron's formula,
    and the screen shows it with each term; each term's bytes add up to it."""
    done = run_cli("--from", str(SCRIPT), "--devices", "128", "--convention", "megatron", "--json")
    assert done.returncode == 0, done.stderr
    conv = json.loads(done.stdout)["conventions"]
    assert conv["line"] == printed(weight_and_optimizer(GPT3), activations_without_sp(GPT3, 1536))
    for part in ("weights_and_optimizer", "activations"):
        summed = Fraction(conv["ours"][part]) + sum(Fraction(t["bytes"]) for t in conv["terms"] if t["part"] == part)
        assert summed == Fraction(conv[part])
    screen = run_cli("--from", str(SCRIPT), "--devices", "128", "--convention", "megatron")
    assert screen.returncode == 0, screen.stderr
    assert conv["line"] in screen.stdout and "5% for temporaries" in screen.stdout
    assert max(len(line) for line in screen.stdout.splitlines()) <= 80


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("tp8xspxselective", "--csv"), "not in --csv"),
        (("tp8", "--params", "7e9"), "needs a model with layers"),
        (("tp8", "--model", "mixtral-8x7b"), "dense models only"),
    ],
)
def test_cli_convention_refusals_are_one_line(args: tuple[str, ...], says: str) -> None:
    done = run_cli(*args, "--convention", "megatron")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0]
