"""The parameter tensors a formal ``Transformer`` implies, in registration order.

Engines cut the formal groups into tensors: DDP buckets them in reverse registration order,
``ZeroRedundancyOptimizer`` assigns whole tensors to ranks, DTensor reduces one tensor per call.
The layout here is the GPT block as Megatron-LM lays it out (fused QKV, GELU MLP, LayerNorm or
RMSNorm, optional biases, learned positions, untied head); its sizes add up to the formal groups
(checked on every call).
"""

from __future__ import annotations

from dataclasses import dataclass

from formal._model import Ffn, Norm, Transformer
from formal._vocab import ATTENTION, EMBEDDING, FINAL_NORM, HEAD, MLP, NORM, POSITION, ROW_BIAS, Group
from formal.errors import ModelError


@dataclass(frozen=True)
class Tensor:
    """One parameter tensor of the formal model, in registration order."""

    name: str
    group: Group
    elements: int
    layer: int | None  # None: not in a transformer block


def parameter_tensors(model: Transformer) -> list[Tensor]:
    """The parameter tensors a GPT-style model registers, in order, from the formal description
    (fused QKV, GELU MLP, LayerNorm or RMSNorm, optional biases, learned positions, untied head),
    or a Llama-style one (separate q, k, v and o, gate, up and down matrices, no biases).
    Their sizes add up to the formal groups (checked)."""
    if model.is_moe or model.qkv_bias or model.qk_norm:
        raise ModelError(f"{model.name}: the tensor layout covers dense GPT and Llama-style models only")
    if model.ffn_kind is Ffn.SWIGLU and model.bias:
        raise ModelError(f"{model.name}: the Llama-style tensor layout has no biases")
    h, f, hd = model.hidden, model.ffn_, model.head_dim
    qkv = model.heads * hd + 2 * model.kv_heads_ * hd
    out: list[Tensor] = [Tensor("embed.weight", EMBEDDING, model.vocab * h, None)]
    if model.learned_positions:
        out.append(Tensor("pos.weight", POSITION, model.position_rows * h, None))

    def norm(prefix: str, group: Group, layer: int | None) -> list[Tensor]:
        ts = [Tensor(f"{prefix}.weight", group, h, layer)]
        if model.norm is Norm.LAYERNORM:
            ts.append(Tensor(f"{prefix}.bias", group, h, layer))
        return ts

    def linear(prefix: str, group: Group, bias_group: Group, n_in: int, n_out: int, layer: int) -> list[Tensor]:
        ts = [Tensor(f"{prefix}.weight", group, n_in * n_out, layer)]
        if model.bias:
            ts.append(Tensor(f"{prefix}.bias", bias_group, n_out, layer))
        return ts

    for i in range(model.layers):
        pre = f"layers.{i}"
        out += norm(f"{pre}.ln1", NORM, i)
        if model.ffn_kind is Ffn.SWIGLU:
            # Llama's layout (Hugging Face LlamaDecoderLayer): separate q, k, v (k and v as wide
            # as the kv heads), the output projection, the gate, up and down matrices, no biases.
            kv = model.kv_heads_ * hd
            for name, n_in, n_out in (
                ("q", h, model.heads * hd),
                ("k", h, kv),
                ("v", h, kv),
                ("o", model.heads * hd, h),
            ):
                out += linear(f"{pre}.{name}", ATTENTION, ATTENTION, n_in, n_out, i)
            out += norm(f"{pre}.ln2", NORM, i)
            for name, n_in, n_out in (("gate", h, f), ("up", h, f), ("down", f, h)):
                out += linear(f"{pre}.{name}", MLP, MLP, n_in, n_out, i)
            continue
        out += linear(f"{pre}.qkv", ATTENTION, ATTENTION, h, qkv, i)
        out += linear(f"{pre}.proj", ATTENTION, ROW_BIAS, model.heads * hd, h, i)
        out += norm(f"{pre}.ln2", NORM, i)
        out += linear(f"{pre}.fc1", MLP, MLP, h, f, i)
        out += linear(f"{pre}.fc2", MLP, ROW_BIAS, f, h, i)
    if model.final_norm:
        out += norm("norm", FINAL_NORM, None)
    if not model.tied_embeddings:
        out.append(Tensor("head.weight", HEAD, model.vocab * h, None))
    totals: dict[Group, int] = {}
    for t in out:
        totals[t.group] = totals.get(t.group, 0) + t.elements
    assert totals == model.group_elements(), (totals, model.group_elements())
    return out


__all__ = ["Tensor", "parameter_tensors"]
