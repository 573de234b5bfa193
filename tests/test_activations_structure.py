"""Activations from the layer's structure (formal/_saved.py) against the published formulas.

Expected figures are written here from the sources, independently of the tool's walk:

* Korthikanti et al. 2022, section 4.1: a GPT layer keeps ``sbh(34 + 5as/h)`` bytes, split
  ``10sbh`` (replicated by TP), ``24sbh`` and ``5as^2b`` (split by TP);
* Megatron-LM's ``compute_activation_memory`` (megatron/training/theoretical_memory_usage.py):
  ``sbh(18 + 4f/h)`` per layer under sequence parallelism and selective recomputation, divided by
  tp. That formula counts an ungated FFN with dropout and K/V as wide as Q; for SwiGLU and GQA the
  expectation adds what the formula leaves out, each from its source: SwiGLU's fused activation
  keeps its whole ``2f``-wide input (Megatron-LM ``SwiGLUFunction``, megatron/core/fusions/
  fused_bias_swiglu.py), ``2sbf`` bytes more; GQA's K and V are ``k/a`` of Q's width, ``4sbh(1 -
  k/a)`` bytes less; without dropout the two residual masks, ``2sbh`` bytes, are gone;
* Rajbhandari et al. 2020 (ZeRO), section 6.1, partitioned activation checkpointing: each layer's
  ``2sbh`` checkpoint divided by the model-parallel degree.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checker._parse import parse
from formal._costs import activation_breakdown, activation_memory, layer_activations
from formal._model import PRECISIONS, Ffn, Norm, Transformer
from formal._presets import PRESETS
from formal._saved import LayerShape, layer_saved_tensors
from formal._vocab import ATTN_SCORES, LAYER_IO, LINEAR_INNER
from formal.errors import ModelError

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ZERO = PRECISIONS["zero"]  # 2-byte activations, 1-byte masks, fp32 logits


@st.composite
def gpt_models(draw: st.DrawFn) -> Transformer:
    heads = draw(st.integers(1, 16))
    return Transformer(
        "gpt",
        layers=draw(st.integers(1, 8)),
        hidden=heads * draw(st.integers(1, 64)),
        heads=heads,
        vocab=draw(st.integers(1, 5000)),
        seq=draw(st.integers(1, 4096)),
        micro_batch=draw(st.integers(1, 8)),
    )


@st.composite
def llama_models(draw: st.DrawFn) -> Transformer:
    kv = draw(st.integers(1, 8))
    heads = kv * draw(st.integers(1, 8))
    return Transformer(
        "llama",
        layers=draw(st.integers(1, 8)),
        hidden=heads * draw(st.integers(1, 32)),
        heads=heads,
        kv_heads=kv,
        vocab=draw(st.integers(1, 5000)),
        seq=draw(st.integers(1, 4096)),
        micro_batch=draw(st.integers(1, 4)),
        ffn=draw(st.integers(1, 20000)),
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=draw(st.booleans()),
    )


def megatron_layer(m: Transformer) -> Fraction:
    """Megatron-LM's per-layer bytes (SP + selective, before the tp divide): sbh(18 + 4f/h)."""
    sbh = m.seq * m.micro_batch * m.hidden
    return sbh * (18 + Fraction(4 * m.ffn_, m.hidden))


def structural_correction(m: Transformer) -> Fraction:
    """What Megatron's formula leaves out, each term from its source (module docstring)."""
    sbh = m.seq * m.micro_batch * m.hidden
    sbf = m.seq * m.micro_batch * m.ffn_
    swiglu_gate = 2 * sbf if m.ffn_kind is Ffn.SWIGLU else 0
    gqa = -4 * sbh * (1 - Fraction(m.kv_heads_, m.heads))
    no_dropout = 0 if m.dropout else -2 * sbh
    return swiglu_gate + gqa + no_dropout


def per_layer_device(text: str, m: Transformer) -> Fraction:
    pl = parse(text).placement(m)
    per_layer = m.activation_bytes_per_layer(ZERO.activations, ZERO.mask_bytes)
    sbh = sp.Integer(m.seq * m.micro_batch * m.hidden)
    return Fraction(str(layer_activations(pl, per_layer, sbh, ZERO)))


@PROPERTY
@given(gpt_models())
def test_a_gpt_layer_is_korthikantis_34sbh_plus_5as2b(m: Transformer) -> None:
    s, b, h, a = m.seq, m.micro_batch, m.hidden, m.heads
    got = m.activation_bytes_per_layer(2, 1)
    assert got[LAYER_IO] == 10 * s * b * h
    assert got[LINEAR_INNER] == 24 * s * b * h
    assert got[ATTN_SCORES] == 5 * a * s * s * b


@PROPERTY
@given(gpt_models(), st.integers(1, 50000))
def test_an_ungated_ffn_of_any_width_is_megatrons_18_plus_4f_over_h(m: Transformer, ffn: int) -> None:
    m = Transformer(m.name, m.layers, m.hidden, m.heads, m.vocab, m.seq, m.micro_batch, ffn=ffn)
    got = m.activation_bytes_per_layer(2, 1)
    assert Fraction(str(got[LAYER_IO] + got[LINEAR_INNER])) == megatron_layer(m)


@PROPERTY
@given(llama_models(), st.sampled_from([1, 2, 4, 8]))
def test_swiglu_and_gqa_layers_are_megatrons_formula_plus_what_it_leaves_out(m: Transformer, tp: int) -> None:
    if m.heads % tp:
        return
    expected = (megatron_layer(m) + structural_correction(m)) / tp
    assert per_layer_device(f"tp{tp}xspxselective", m) == expected


def test_llama2_7b_under_sp_and_selective_per_layer_bytes() -> None:
    """Llama-2 7B, tp2 + SP + selective, one 4096-token sequence. Megatron's formula gives
    sbh(18 + 4 * 11008/4096)/2 = 241,172,480 bytes; SwiGLU keeps 2sbf = 90,177,536 bytes more
    and the model has no dropout masks (2sbh = 33,554,432 fewer): (241,172,480 + (90,177,536 -
    33,554,432)/2) = 269,484,032. GPT-3's constants gave 34sbh/2 = 285,212,672."""
    m = PRESETS["llama2-7b"]
    assert isinstance(m, Transformer)
    assert megatron_layer(m) / 2 == 241_172_480
    assert per_layer_device("tp2xspxselective", m) == 269_484_032


def test_without_dropout_the_scores_are_the_softmax_output_alone() -> None:
    """Korthikanti's 5as^2b is the softmax output (2), its dropout mask (1) and the dropout's
    output (2); without dropout the attention over V reads the softmax output: 2as^2b. The
    fused-attention modifier (``flash``) keeps none of them."""
    m = PRESETS["llama3-8b"]
    assert isinstance(m, Transformer) and not m.dropout
    got = m.activation_bytes_per_layer(2, 1)
    assert got[ATTN_SCORES] == 2 * m.heads * m.seq**2 * m.micro_batch
    with_dropout = Transformer(**{**m.__dict__, "dropout": True}).activation_bytes_per_layer(2, 1)
    assert with_dropout[ATTN_SCORES] == 5 * m.heads * m.seq**2 * m.micro_batch
    sbh = m.seq * m.micro_batch * m.hidden
    assert with_dropout[LAYER_IO] - got[LAYER_IO] == 2 * sbh  # the two residual masks
    assert per_layer_device("tp2xflash", m) == Fraction(str(got[LINEAR_INNER] / 2 + got[LAYER_IO]))


def test_every_saved_tensor_is_counted_once_by_name() -> None:
    s, b, h, a = sp.symbols("s b h a", positive=True)
    tensors = layer_saved_tensors(s, b, h, a, 2, 1, LayerShape(gated=True, dropout=False))
    names = [t.op for t in tensors]
    assert len(names) == len(set(names))
    assert not any("dropout" in n for n in names)


ZERO_PA = Transformer("zero-pa", layers=125, hidden=8192, heads=64, vocab=51200, seq=1024, micro_batch=32)


def test_sequence_parallel_full_recompute_splits_the_checkpoint_by_tp() -> None:
    """ZeRO's Pa example (section 6.1): L = 125 layers of h = 8192, batch 32 x 1024 tokens, MP 16.
    Checkpoints 2sbhL = 67.11 GB whole, 4.19 GB split along the 16 ranks."""
    m = ZERO_PA
    whole = 2 * m.seq * m.micro_batch * m.hidden * m.layers
    assert whole == 67_108_864_000
    assert per_layer_device("tp16xspxrecompute", m) * m.layers == Fraction(whole, 16) == 4_194_304_000
    assert per_layer_device("tp16xrecompute", m) * m.layers == whole  # no SP: each rank keeps it whole
    assert per_layer_device("tp4xcp4xspxrecompute", m) * m.layers == Fraction(whole, 16)


def test_llama3_70b_tp8_sp_recompute_activations() -> None:
    """Llama-3 70B at 8192 tokens, tp8 + SP + full recomputation, no pipeline: each rank keeps
    2sbh/8 per layer, the final norm's and head's inputs 4sbh/8 (SP) and the fp32 logits 4sbv/8
    (vocabulary-parallel), and no embedding dropout mask. Before the fix the checkpoint was
    whole: 2sbhL(1 - 1/8) = 9.4 GB more."""
    m = PRESETS["llama3-70b"]
    assert isinstance(m, Transformer)
    sbh = m.seq * m.micro_batch * m.hidden
    expected = Fraction(2 * sbh * m.layers + 4 * sbh + 4 * m.seq * m.micro_batch * m.vocab, 8)
    got = activation_memory(parse("tp8xspxrecompute").placement(m), m, ZERO)
    assert got is not None and Fraction(str(got)) == expected
    # Without SP each rank keeps the checkpoints and the output layer's inputs whole.
    whole = activation_memory(parse("tp8xrecompute").placement(m), m, ZERO)
    assert whole is not None
    assert Fraction(str(whole - got)) == Fraction(7, 8) * (2 * sbh * m.layers + 4 * sbh)
    assert Fraction(7, 8) * 2 * sbh * m.layers == 9_395_240_960


@PROPERTY
@given(st.one_of(gpt_models(), llama_models()), st.sampled_from(["tp2", "tp2xsp", "tp2xspxrecompute", "cp2"]))
def test_the_breakdown_sums_to_the_activation_memory(m: Transformer, text: str) -> None:
    if m.heads % 2:
        return
    pl = parse(text).placement(m)
    parts = activation_breakdown(pl, m, ZERO)
    total = activation_memory(pl, m, ZERO)
    assert parts is not None and total is not None
    summed = sum(parts["layers"].values()) + sum(parts["io"].values())
    # Each part is rounded up to whole bytes: at most one byte per part above the exact total.
    assert 0 <= summed - Fraction(str(total)) < len(parts["layers"]) + len(parts["io"])


def test_dropout_must_be_a_boolean() -> None:
    with pytest.raises(ModelError, match="dropout"):
        Transformer("x", 1, 8, 1, 8, 8, dropout=1)  # type: ignore[arg-type]
