"""Read a local Hugging Face ``config.json`` into a ``Transformer`` (no network, no transformers).

Supported families are those whose parameter layout ``Transformer`` represents exactly:
Llama / Mistral / Mixtral (RMSNorm, SwiGLU, no biases, RoPE) and GPT-2 (LayerNorm, GELU, biases,
learned positions, tied embeddings). Any other ``model_type`` is refused with the list of
supported ones rather than approximated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from formal._input import BOOL, TEXT, Expect, Schema, check_schema, integer, printable, read_document
from formal._model import MAX_SEQ, Ffn, Norm, Transformer
from formal.errors import InputError, ModelError

LLAMA_LIKE = ("llama", "mistral", "mixtral")
GPT2_LIKE = ("gpt2",)
SUPPORTED = LLAMA_LIKE + GPT2_LIKE

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
    "num_experts_per_tok": integer(1, 2**20, nullable=True),
    "hidden_act": TEXT,
    "attention_bias": Expect("true or false", (bool,), nullable=True),
    "mlp_bias": Expect("true or false", (bool,), nullable=True),
    "tie_word_embeddings": Expect(BOOL.label, BOOL.types, nullable=True),
    "_name_or_path": Expect("a string", (str,), nullable=True),
}


def load_hf_config(path: Path) -> Transformer:
    """A ``Transformer`` from a Hugging Face ``config.json``; ``ModelError`` names the bad key."""
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
            f"{where}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED)}); describe it with --params instead"
        )
    hidden = _int(raw, where, "hidden")
    layers = _int(raw, where, "layers")
    heads = _int(raw, where, "heads")
    seq = _int(raw, where, "seq")
    vocab = _required_int(raw, where, "vocab_size")
    # The name reaches the terminal: control characters (ANSI escapes) are shown, not sent.
    name = printable(str(raw.get("_name_or_path") or Path(where).parent.name or model_type), 120)
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
            source=f"Hugging Face config {where} (GPT-2 layout)",
        )
    ffn = _int(raw, where, "ffn")
    kv_heads = raw.get("num_key_value_heads", heads)
    if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads <= 0:
        raise ModelError(f"{where}: num_key_value_heads={kv_heads!r} must be a positive integer")
    _check_head_dim(raw, where, hidden, heads)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"{where}: hidden_act {act!r} with model_type {model_type!r}: expected 'silu' (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise ModelError(f"{where}: {key}=true is not representable (biases on some linears only)")
    experts, top_k = 0, 0
    if model_type == "mixtral" or "num_local_experts" in raw:
        experts = _required_int(raw, where, "num_local_experts")
        top_k = _required_int(raw, where, "num_experts_per_tok")
        if top_k > experts:
            raise ModelError(f"{where}: num_experts_per_tok={top_k} > num_local_experts={experts}")
    elif "num_experts_per_tok" in raw:
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
        tied_embeddings=bool(raw.get("tie_word_embeddings", False)),
        experts=experts,
        top_k=top_k,
        source=f"Hugging Face config {where} ({model_type} layout)",
    )


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
