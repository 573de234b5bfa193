"""Model presets with published dimensions; each cites its source."""

from __future__ import annotations

from formal._model import Ffn, Norm, ParameterCount, Transformer

PRESETS: dict[str, Transformer | ParameterCount] = {
    "gpt3-175b": Transformer(
        "gpt3-175b", layers=96, hidden=12288, heads=96, vocab=51200, seq=2048,
        source="Brown et al. 2020, Table 2.1; vocabulary padded to 51200 as Megatron (Narayanan et al. 2021)"),
    "gpt3-1.3b": Transformer(
        "gpt3-1.3b", layers=24, hidden=2048, heads=16, vocab=51200, seq=2048,
        source="Brown et al. 2020, Table 2.1 (GPT-3 XL)"),
    "llama2-7b": Transformer(
        "llama2-7b", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, ffn=11008,
        ffn_kind=Ffn.SWIGLU, norm=Norm.RMSNORM, bias=False, learned_positions=False, tied_embeddings=False,
        source="Touvron et al. 2023, Llama 2; Hugging Face meta-llama/Llama-2-7b-hf config.json"),
    "zero-7.5b": ParameterCount(7_500_000_000, name="zero-7.5b"),
}

DEFAULT_MODEL = "llama2-7b"
DEFAULT_DEVICES = 64  # 8 nodes of 8 accelerators
DEFAULT_DEVICE_MEMORY = 80 * 10**9  # bytes: an 80 GB A100/H100
