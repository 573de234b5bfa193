"""Model presets with published dimensions; each cites its source."""

from __future__ import annotations

from formal._model import Ffn, Norm, ParameterCount, Transformer

PRESETS: dict[str, Transformer | ParameterCount] = {
    "gpt3-175b": Transformer(
        "gpt3-175b",
        layers=96,
        hidden=12288,
        heads=96,
        vocab=51200,
        seq=2048,
        source="Brown et al. 2020, Table 2.1; vocabulary padded to 51200 as Megatron (Narayanan et al. 2021)",
    ),
    "gpt3-1.3b": Transformer(
        "gpt3-1.3b",
        layers=24,
        hidden=2048,
        heads=16,
        vocab=51200,
        seq=2048,
        source="Brown et al. 2020, Table 2.1 (GPT-3 XL)",
    ),
    "llama2-7b": Transformer(
        "llama2-7b",
        layers=32,
        hidden=4096,
        heads=32,
        vocab=32000,
        seq=4096,
        ffn=11008,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        source="Touvron et al. 2023, Llama 2; Hugging Face meta-llama/Llama-2-7b-hf config.json",
    ),
    "llama2-13b": Transformer(
        "llama2-13b",
        layers=40,
        hidden=5120,
        heads=40,
        vocab=32000,
        seq=4096,
        ffn=13824,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        source="Touvron et al. 2023, Llama 2; Hugging Face meta-llama/Llama-2-13b-hf config.json",
    ),
    "llama2-70b": Transformer(
        "llama2-70b",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        vocab=32000,
        seq=4096,
        ffn=28672,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        source="Touvron et al. 2023, Llama 2 (GQA with 8 KV heads for 70B); "
        "Hugging Face meta-llama/Llama-2-70b-hf config.json",
    ),
    # Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (layers, model dimension,
    # FFN dimension, heads, 8 KV heads, vocabulary 128K = 128256 in the released config.json);
    # pre-training sequence length 8192 (section 3.4.1).
    "llama3-8b": Transformer(
        "llama3-8b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        vocab=128256,
        seq=8192,
        ffn=14336,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        source="Dubey et al. 2024, Llama 3, Table 3; Hugging Face meta-llama/Meta-Llama-3-8B config.json",
    ),
    "llama3-70b": Transformer(
        "llama3-70b",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        vocab=128256,
        seq=8192,
        ffn=28672,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        source="Dubey et al. 2024, Llama 3, Table 3; Hugging Face meta-llama/Meta-Llama-3-70B config.json",
    ),
    "llama3-405b": Transformer(
        "llama3-405b",
        layers=126,
        hidden=16384,
        heads=128,
        kv_heads=8,
        vocab=128256,
        seq=8192,
        ffn=53248,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        source="Dubey et al. 2024, Llama 3, Table 3; Hugging Face meta-llama/Llama-3.1-405B config.json",
    ),
    "mixtral-8x7b": Transformer(
        "mixtral-8x7b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        vocab=32000,
        seq=32768,
        ffn=14336,
        ffn_kind=Ffn.SWIGLU,
        norm=Norm.RMSNORM,
        bias=False,
        learned_positions=False,
        tied_embeddings=False,
        dropout=False,  # no dropout: Hugging Face LlamaConfig/MixtralConfig attention_dropout 0.0
        experts=8,
        top_k=2,
        source="Jiang et al. 2024, Mixtral of Experts, Table 1 (8 experts, top-2 routing, 32k context); "
        "Hugging Face mistralai/Mixtral-8x7B-v0.1 config.json",
    ),
    # Rajbhandari et al., ZeRO (SC'20), Figure 1: the 7.5B-parameter model on 64 devices.
    "zero-7.5b": ParameterCount(7_500_000_000, name="zero-7.5b"),
}

DEFAULT_MODEL = "llama2-7b"
DEFAULT_DEVICES = 64  # 8 nodes of 8 accelerators
DEFAULT_DEVICE_MEMORY = 80 * 10**9  # bytes: an 80 GB A100/H100
