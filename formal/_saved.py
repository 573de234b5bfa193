"""The tensors one transformer layer saves for its backward, op by op (docs/semantics.md, "Costs").

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
section 4.1, counts what each op of a GPT layer keeps: the two LayerNorms their inputs, the QKV
linear its input, ``QK^T`` its Q and K, the softmax its output, the attention dropout its mask
and output, the attention over V its V, the output projection its input, the FFN's first linear
its input, GeLU its input, the second linear its input, and each residual dropout its mask:
``sbh(34 + 5as/h)`` bytes at 16 bits with 1-byte masks. The same walk through the layer, with
the model's structure instead of GPT-3's, gives:

* an FFN of width ``f`` (not ``4h``): the activation's input and the second linear's input are
  ``sbf`` elements each, ``4sbf`` bytes, which is Megatron-LM's ``sbh(18 + 4f/h)``
  (``compute_activation_memory``, megatron/training/theoretical_memory_usage.py);
* a gated FFN (SwiGLU): the first linear's output is ``2f`` wide (gate and up) and the fused
  activation keeps all of it (Megatron-LM's ``SwiGLUFunction`` saves its input,
  megatron/core/fusions/fused_bias_swiglu.py), then the second linear keeps its ``f``-wide
  input: ``6sbf`` bytes, ``2sbf`` more than an ungated FFN of the same width (the formula in
  theoretical_memory_usage.py counts ``4sbf`` either way);
* grouped-query attention with ``k`` of ``a`` heads for K and V: K and V are ``sbh k/a``
  elements each (the same file notes its formula assumes K and V as wide as Q);
* no dropout (Llama trains without): no masks, and the attention over V reads the softmax's
  output itself, so the scores keep ``2as^2b`` bytes instead of ``5as^2b``.

Fused attention (FlashAttention, Dao et al. 2022) is the composition's ``flash`` modifier, the
placement of selective recomputation: the scores group is not kept. The kernel keeps Q, K, V and
its output (counted above) and an fp32 log-sum-exp per head and query token (``softmax_lse``,
``4asb`` bytes, 0.1% of what a Llama-2 7B layer keeps otherwise), which is left out like the
norms' statistics below.

RMSNorm and LayerNorm both keep their input; their per-token statistics (RMSNorm's reciprocal
root mean square, LayerNorm's mean and reciprocal deviation, 4 or 8 bytes per token) are below
the ``sbh`` resolution Korthikanti counts in and are left out for both, so a GPT layer is exactly
the paper's ``34sbh + 5as^2b``.

Each tensor belongs to one of the placement's activation groups: ``LAYER_IO`` (whole on every
tensor-parallel rank, split along the sequence by sequence parallelism), ``LINEAR_INNER`` (split
by tensor parallelism), ``ATTN_SCORES`` (split by tensor parallelism, dropped by selective
recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass

from formal import _num as num
from formal._num import Num
from formal._vocab import ATTN_SCORES, LAYER_IO, LINEAR_INNER, Group


@dataclass(frozen=True)
class SavedTensor:
    """One tensor an op of a layer keeps for the backward: its name, activation group and bytes
    for one micro-batch, before any parallelism."""

    op: str
    group: Group
    bytes: Num


@dataclass(frozen=True)
class LayerShape:
    """What of a layer's structure decides its saved tensors. ``ffn`` is the FFN width ``f``
    (``None``: ``4h``), ``kv_heads`` the heads of K and V (``None``: all of them)."""

    ffn: Num | None = None
    kv_heads: Num | None = None
    gated: bool = False
    dropout: bool = True


GPT = LayerShape()


def layer_saved_tensors(
    seq: Num,
    micro_batch: Num,
    hidden: Num,
    heads: Num,
    element_bytes: int = 2,
    mask_bytes: int = 1,
    shape: LayerShape = GPT,
) -> tuple[SavedTensor, ...]:
    """Every tensor one layer keeps for one micro-batch, op by op (the module's walk)."""
    s, b, h, a = (num.canonical(x) for x in (seq, micro_batch, hidden, heads))
    f = 4 * h if shape.ffn is None else num.canonical(shape.ffn)
    kv = a if shape.kv_heads is None else num.canonical(shape.kv_heads)
    e, m = num.canonical(element_bytes), num.canonical(mask_bytes)
    sbh, sbf, as2b = s * b * h, s * b * f, a * s**2 * b
    out = [
        SavedTensor("attention norm: input", LAYER_IO, e * sbh),
        SavedTensor("QKV linear: input", LAYER_IO, e * sbh),
        SavedTensor("QK^T: Q", LINEAR_INNER, e * sbh),
        SavedTensor("QK^T: K", LINEAR_INNER, num.ratio(e * sbh * kv, a)),
        SavedTensor("attention over V: V", LINEAR_INNER, num.ratio(e * sbh * kv, a)),
    ]
    out.append(SavedTensor("softmax: output", ATTN_SCORES, e * as2b))
    if shape.dropout:
        out.append(SavedTensor("attention dropout: mask", ATTN_SCORES, m * as2b))
        out.append(SavedTensor("attention dropout: output", ATTN_SCORES, e * as2b))
    out.append(SavedTensor("output projection: input", LINEAR_INNER, e * sbh))
    if shape.dropout:
        out.append(SavedTensor("attention residual dropout: mask", LAYER_IO, m * sbh))
    out += [
        SavedTensor("MLP norm: input", LAYER_IO, e * sbh),
        SavedTensor("FFN first linear: input", LAYER_IO, e * sbh),
    ]
    if shape.gated:
        out.append(SavedTensor("SwiGLU: input (gate and up)", LINEAR_INNER, 2 * e * sbf))
    else:
        out.append(SavedTensor("GeLU: input", LINEAR_INNER, e * sbf))
    out.append(SavedTensor("FFN second linear: input", LINEAR_INNER, e * sbf))
    if shape.dropout:
        out.append(SavedTensor("MLP residual dropout: mask", LAYER_IO, m * sbh))
    return tuple(out)


def by_group(tensors: tuple[SavedTensor, ...]) -> dict[Group, Num]:
    """The saved bytes summed by activation group (every per-layer group present, 0 if none)."""
    out: dict[Group, Num] = {LAYER_IO: 0, LINEAR_INNER: 0, ATTN_SCORES: 0}
    for t in tensors:
        out[t.group] = num.expand(out[t.group] + t.bytes)
    return out
