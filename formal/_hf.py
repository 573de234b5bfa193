"""Read a local Hugging Face ``config.json`` (or a model directory holding one) into a
``Transformer`` (no network, no transformers).

The reader is driven by the config's fields (``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
``vocab_size``, ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``, the MoE fields
``num_local_experts`` / ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``);
what the fields do not say, the family's modelling code in ``transformers`` fixes, and
``FAMILIES`` records it per ``model_type``: Qwen2 puts biases on q, k and v only
(``modeling_qwen2.py``: ``q_proj = nn.Linear(..., bias=True)``), Qwen3 normalises queries and
keys with an RMSNorm over ``head_dim`` (``q_norm``, ``k_norm``), Gemma ties the embeddings by
default and gates its GELU MLP with three matrices like SwiGLU, Phi-3 fuses ``qkv_proj`` and
``gate_up_proj`` (the same counts). GPT-2 is LayerNorm, GELU, biases and learned positions.
A ``model_type`` not in ``FAMILIES``, and a field known to change the count that ``Transformer``
cannot say (shared experts, dense layers among MoE ones, low-rank attention), is refused by name
rather than approximated.

The training sequence length is not in a model's config: ``max_position_embeddings`` is its
context window. It is used only when nothing else gives the length, and ``seq_note`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from formal._input import BOOL, TEXT, Expect, Schema, check_schema, integer, printable, read_document
from formal._model import MAX_SEQ, Ffn, Norm, Transformer
from formal.errors import InputError, ModelError


@dataclass(frozen=True)
class Family:
    """What a family's modelling code fixes that its config does not state."""

    qkv_bias: bool = False  # biases on q, k, v (not o, not the MLP) whatever attention_bias says
    qk_norm: bool = False
    tied_default: bool = False  # tie_word_embeddings when the config leaves it out
    acts: tuple[str, ...] = ("silu", "swish")  # the gated MLP's activation (three matrices)
    moe: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "mixtral": Family(moe=True),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True, moe=True),
    "gemma": Family(tied_default=True, acts=("gelu", "gelu_pytorch_tanh")),
    "phi3": Family(),
}
GPT2_LIKE = ("gpt2",)
LLAMA_LIKE = tuple(FAMILIES)
SUPPORTED = LLAMA_LIKE + GPT2_LIKE

# Fields that change the parameter count in a way ``Transformer`` does not represent: refused
# when they hold anything but the value that leaves the layout as above.
_UNREPRESENTED: dict[str, tuple[object, ...]] = {
    "n_shared_experts": (None, 0),  # DeepSeek shared experts
    "shared_expert_intermediate_size": (None, 0),  # Qwen2-MoE shared expert
    "first_k_dense_replace": (None, 0),  # dense layers before the MoE ones
    "moe_layer_freq": (None, 1),
    "decoder_sparse_step": (None, 1),  # MoE every k-th layer only
    "mlp_only_layers": (None, []),
    "q_lora_rank": (None,),  # DeepSeek multi-head latent attention
    "kv_lora_rank": (None,),
    "num_nextn_predict_layers": (None, 0),  # multi-token prediction heads
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "num_global_key_value_heads": (None,),
}

# Hugging Face key aliases: GPT-2 configs spell the same quantity differently.
_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "n_embd"),
    "layers": ("num_hidden_layers", "n_layer"),
    "heads": ("num_attention_heads", "n_head"),
    "seq": ("max_position_embeddings", "n_positions"),
    "ffn": ("intermediate_size", "n_inner"),
}


_SIZE = integer(1, 2**40, nullable=True)  # a dimension; the parameter count bounds their products
# The keys this reader gives a meaning to, and what each must hold (others are ignored).
SCHEMA: Schema = {
    "model_type": Expect("a string", (str,), nullable=True),
    **{
        key: _SIZE
        for keys in _ALIASES.values()
        for key in keys
        if key not in ("max_position_embeddings", "n_positions")
    },
    "max_position_embeddings": integer(1, MAX_SEQ, nullable=True),
    "n_positions": integer(1, MAX_SEQ, nullable=True),
    "vocab_size": _SIZE,
    "num_key_value_heads": _SIZE,
    "head_dim": _SIZE,
    "num_local_experts": integer(1, 2**20, nullable=True),
    "num_experts": integer(1, 2**20, nullable=True),
    "num_experts_per_tok": integer(1, 2**20, nullable=True),
    "moe_intermediate_size": _SIZE,
    "hidden_act": TEXT,
    "hidden_activation": Expect("a string", (str,), nullable=True),
    "attention_bias": Expect("true or false", (bool,), nullable=True),
    "mlp_bias": Expect("true or false", (bool,), nullable=True),
    "tie_word_embeddings": Expect(BOOL.label, BOOL.types, nullable=True),
    "_name_or_path": Expect("a string", (str,), nullable=True),
}

SEQ_FROM_CONFIG = "max_position_embeddings"


def seq_note(model: Transformer) -> str | None:
    """What to say when ``model``'s sequence length is its config's context window, else None."""
    if SEQ_FROM_CONFIG in model.source:
        return (
            f"sequence length {model.seq:,} is the model config's max_position_embeddings (its context "
            "window, not a training length); give --seq or a training config's sequence length"
        )
    return None


def load_hf_config(path: Path) -> Transformer:
    """A ``Transformer`` from a Hugging Face ``config.json`` or a model directory holding one;
    ``ModelError`` names the bad key."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {printable(str(path), 200)}: a directory without config.json")
        path = path / "config.json"
    where = str(path)
    label = f"--model {printable(where, 200)}"
    try:
        raw = read_document(path, label, "json")
    except InputError as err:
        raise ModelError(str(err)) from None
    if not isinstance(raw, dict):
        raise ModelError(f"{label}: expected a JSON object {{...}}, got {type(raw).__name__}")
    return transformer_from_hf(raw, where)


def transformer_from_hf(raw: dict[str, Any], where: str = "config.json") -> Transformer:
    """A ``Transformer`` from a parsed config; every key it reads must hold what ``SCHEMA`` says."""
    try:
        check_schema(raw, SCHEMA, printable(where, 200))
    except InputError as err:
        raise ModelError(str(err)) from None
    model_type = raw.get("model_type")
    if model_type is None:
        raise ModelError(f"{where}: missing key 'model_type' (supported: {', '.join(SUPPORTED)})")
    if model_type not in SUPPORTED:
        raise ModelError(
            f"{where}: model_type {printable(str(model_type), 60)!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)}); describe it with --params instead"
        )
    for key, neutral in _UNREPRESENTED.items():
        if key in raw and raw[key] not in neutral:
            raise ModelError(
                f"{where}: {key}={printable(repr(raw[key]), 60)} changes the parameter layout in a way "
                "that is not represented; describe the model with --params instead"
            )
    hidden = _int(raw, where, "hidden")
    layers = _int(raw, where, "layers")
    heads = _int(raw, where, "heads")
    seq = _int(raw, where, "seq")
    vocab = _required_int(raw, where, "vocab_size")
    # The name reaches the terminal: control characters (ANSI escapes) are shown, not sent.
    name = printable(str(raw.get("_name_or_path") or Path(where).parent.name or model_type), 120)
    seq_source = f"sequence length from {SEQ_FROM_CONFIG}"
    if model_type in GPT2_LIKE:
        ffn = _optional_int(raw, where, "ffn")
        _check_head_dim(raw, where, hidden, heads)
        return _build(
            where,
            name=name,
            layers=layers,
            hidden=hidden,
            heads=heads,
            vocab=vocab,
            seq=seq,
            ffn=ffn,
            ffn_kind=Ffn.GELU,
            norm=Norm.LAYERNORM,
            bias=True,
            learned_positions=True,
            tied_embeddings=bool(raw.get("tie_word_embeddings", True)),
            dropout=_dropout(raw, where, ("attn_pdrop", "resid_pdrop", "embd_pdrop"), 0.1),
            source=f"Hugging Face config {where} (GPT-2 layout; {seq_source})",
        )
    family = FAMILIES[model_type]
    ffn = _int(raw, where, "ffn")
    kv_heads = raw.get("num_key_value_heads", heads)
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0:
        raise ModelError(f"{where}: num_key_value_heads={kv_heads!r} must be a positive integer")
    head_dim = raw.get("head_dim")
    decoupled = head_dim is not None and head_dim * heads != hidden
    act = raw.get("hidden_activation") or raw.get("hidden_act") or family.acts[0]
    if act not in family.acts:
        raise ModelError(
            f"{where}: hidden_act {printable(str(act), 40)!r} with model_type {model_type!r}: "
            f"expected {' or '.join(repr(a) for a in family.acts)} (a gated MLP)"
        )
    if raw.get("mlp_bias"):
        raise ModelError(f"{where}: mlp_bias=true is not representable (biases on the MLP only)")
    qkv_bias = family.qkv_bias
    if raw.get("attention_bias"):
        if not qkv_bias:
            raise ModelError(
                f"{where}: attention_bias=true is not representable (biases on q, k, v and o but not the MLP)"
            )
    experts, top_k = 0, 0
    expert_keys = [k for k in ("num_local_experts", "num_experts") if raw.get(k) is not None]
    if family.moe or expert_keys:
        if not family.moe:
            raise ModelError(f"{where}: {expert_keys[0]} with model_type {model_type!r} (a dense family)")
        if not expert_keys:
            raise ModelError(f"{where}: missing key 'num_local_experts' (or 'num_experts')")
        experts = _required_int(raw, where, expert_keys[0])
        top_k = _required_int(raw, where, "num_experts_per_tok")
        if top_k > experts:
            raise ModelError(f"{where}: num_experts_per_tok={top_k} > {expert_keys[0]}={experts}")
        if raw.get("moe_intermediate_size") is not None:  # every layer's MLP is the experts
            ffn = _required_int(raw, where, "moe_intermediate_size")
    elif raw.get("num_experts_per_tok") is not None:
        raise ModelError(f"{where}: num_experts_per_tok without num_local_experts")
    return _build(
        where,
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq=seq,
        kv_heads=kv_heads if kv_heads != heads else None,
        ffn=ffn,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=bool(raw.get("tie_word_embeddings", family.tied_default)),
        experts=experts,
        top_k=top_k,
        head_size=head_dim if decoupled else None,
        qkv_bias=qkv_bias,
        qk_norm=family.qk_norm,
        dropout=_dropout(raw, where, ("attention_dropout", "hidden_dropout", "resid_pdrop", "dropout"), 0.0),
        source=f"Hugging Face config {where} ({model_type} layout; {seq_source}"
        + ("; head_dim decoupled: parameters exact, activations by hidden_size)" if decoupled else ")"),
    )


def _dropout(raw: dict[str, Any], where: str, keys: tuple[str, ...], default: float) -> bool:
    """Whether the model trains with dropout: any of ``keys`` above 0, each absent key taking the
    transformers library's default for the family (GPT2Config: 0.1; LlamaConfig and the llama-like
    configs: ``attention_dropout`` 0.0). Dropout decides whether masks are kept for the backward."""
    rates = []
    for key in keys:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
            raise ModelError(f"{where}: {key}={value!r} must be a dropout rate in [0, 1)")
        rates.append(value)
    return any(r > 0 for r in rates)


def _build(where: str, **fields: Any) -> Transformer:
    try:
        return Transformer(**fields)
    except ModelError as err:
        raise ModelError(f"{where}: {err}") from None


def _check_head_dim(raw: dict[str, Any], where: str, hidden: int, heads: int) -> None:
    head_dim = raw.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        raise ModelError(
            f"{where}: head_dim={head_dim} x num_attention_heads={heads} = {head_dim * heads} "
            f"!= hidden_size={hidden} (decoupled head_dim is not representable)"
        )


def _int(raw: dict[str, Any], where: str, quantity: str) -> int:
    value = _optional_int(raw, where, quantity)
    if value is None:
        keys = _ALIASES[quantity]
        raise ModelError(f"{where}: missing key {keys[0]!r}" + (f" (or {keys[1]!r})" if len(keys) > 1 else ""))
    return value


def _optional_int(raw: dict[str, Any], where: str, quantity: str) -> int | None:
    keys = _ALIASES[quantity]
    present = {k: raw[k] for k in keys if k in raw and raw[k] is not None}
    if not present:
        return None
    values = list(present.values())
    if any(v != values[0] for v in values):
        shown = ", ".join(f"{k}={v}" for k, v in present.items())
        raise ModelError(f"{where}: contradictory keys {shown}")
    key, value = next(iter(present.items()))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"{where}: {key}={value!r} must be a positive integer")
    return value


def _required_int(raw: dict[str, Any], where: str, key: str) -> int:
    if key not in raw:
        raise ModelError(f"{where}: missing key {key!r}")
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelError(f"{where}: {key}={value!r} must be a positive integer")
    return value
