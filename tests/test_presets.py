"""Model presets reproduce their published parameter counts; Hugging Face configs load exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from formal._hf import load_hf_config
from formal._model import Transformer, megatron_parameter_count
from formal._presets import PRESETS
from formal._vocab import EXPERTS
from formal.errors import ModelError

# (preset, published count, significant digits published, source)
PUBLISHED = [
    ("gpt3-175b", 174.6e9, 4, "Narayanan et al. 2021 (PTD-P), Table 2: the GPT-3 configuration, 174.6B"),
    ("gpt3-175b", 175e9, 3, "Brown et al. 2020, Table 2.1: GPT-3 175B"),
    ("llama2-7b", 6.74e9, 3, "Hugging Face meta-llama/Llama-2-7b-hf, model size 6.74B params"),
    ("llama2-13b", 13.0e9, 3, "Hugging Face meta-llama/Llama-2-13b-hf, model size 13B params"),
    ("llama2-70b", 69.0e9, 3, "Hugging Face meta-llama/Llama-2-70b-hf, model size 69B params"),
    ("llama3-8b", 8.03e9, 3, "Hugging Face meta-llama/Meta-Llama-3-8B, model size 8.03B params"),
    ("llama3-70b", 70.6e9, 3, "Hugging Face meta-llama/Meta-Llama-3-70B, model size 70.6B params"),
    ("llama3-405b", 406e9, 3, "Hugging Face meta-llama/Llama-3.1-405B, model size 406B params"),
    ("mixtral-8x7b", 46.7e9, 3, "Mistral AI, 'Mixtral of experts' (Dec 2023): 46.7B total parameters"),
    ("mixtral-8x7b", 47e9, 2, "Jiang et al. 2024, Mixtral of Experts, section 2: 47B parameters"),
    ("zero-7.5b", 7.5e9, 2, "Rajbhandari et al., ZeRO (SC'20), Figure 1: Psi = 7.5B"),
]


def significant(x: float, digits: int) -> float:
    """x rounded to ``digits`` significant figures."""
    exponent = math.floor(math.log10(abs(x)))
    return round(x, digits - 1 - exponent)


@pytest.mark.parametrize(("name", "published", "digits", "source"), PUBLISHED)
def test_preset_reproduces_published_count(name: str, published: float, digits: int, source: str) -> None:
    count = PRESETS[name].parameter_count()
    assert significant(count, digits) == significant(published, digits), source


def test_rounding_helper_is_not_vacuous() -> None:
    assert significant(6_738_415_616, 3) == 6.74e9
    assert significant(6_738_415_616, 3) != 6.73e9


def test_mixtral_active_parameters_match_mistral() -> None:
    """Mistral AI (Dec 2023): 'only uses 12.9B parameters per token' (2 of 8 experts)."""
    m = PRESETS["mixtral-8x7b"]
    assert isinstance(m, Transformer) and m.is_moe
    experts = m.group_elements()[EXPERTS]
    active = m.parameter_count() - experts + experts * m.top_k // m.experts
    assert significant(active, 3) == 12.9e9


def test_gpt3_matches_megatron_formula_plus_final_layernorm() -> None:
    """Two derivations agree: per-group sizes vs Narayanan et al.'s closed form (which omits
    the final LayerNorm's 2h)."""
    m = PRESETS["gpt3-175b"]
    assert isinstance(m, Transformer)
    assert m.parameter_count() == int(megatron_parameter_count(m.layers, m.hidden, m.vocab, m.seq)) + 2 * m.hidden


def test_every_transformer_preset_cites_a_source() -> None:
    for name, m in PRESETS.items():
        if isinstance(m, Transformer):
            assert m.source, name


# --- Hugging Face config.json --------------------------------------------------------------

# The published config.json of meta-llama/Llama-2-7b-hf (architecture keys).
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "torch_dtype": "float16",
}
# mistralai/Mixtral-8x7B-v0.1 config.json.
MIXTRAL = {
    "model_type": "mixtral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
# openai-community/gpt2 config.json: 124,439,808 parameters (the widely quoted exact "124M").
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "vocab_size": 50257,
    "n_inner": None,
    "activation_function": "gelu_new",
}


def _write(tmp_path: Path, doc: dict[str, object], name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_hf_llama2_config_equals_preset(tmp_path: Path) -> None:
    m = load_hf_config(_write(tmp_path, LLAMA2_7B))
    assert m.parameter_count() == PRESETS["llama2-7b"].parameter_count()


def test_hf_mixtral_config_equals_preset(tmp_path: Path) -> None:
    m = load_hf_config(_write(tmp_path, MIXTRAL))
    assert (m.experts, m.top_k, m.kv_heads_) == (8, 2, 8)
    assert m.parameter_count() == PRESETS["mixtral-8x7b"].parameter_count()


def test_hf_gpt2_config_counts_124m(tmp_path: Path) -> None:
    assert load_hf_config(_write(tmp_path, GPT2)).parameter_count() == 124_439_808


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"model_type": "bert"}, "not supported"),
        ({"hidden_size": 4096, "n_embd": 2048}, "contradictory"),
        ({"n_shared_experts": 2}, "n_shared_experts=2"),
        ({"num_key_value_heads": 5}, "kv_heads=5"),
        ({"vocab_size": "32000"}, "vocab_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_experts_per_tok": 2}, "num_local_experts"),
    ],
)
def test_hf_bad_configs_name_the_key(tmp_path: Path, change: dict[str, object], message: str) -> None:
    doc = {**LLAMA2_7B, **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(ModelError, match=message):
        load_hf_config(_write(tmp_path, doc))


def test_hf_not_json_is_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ModelError, match="not JSON"):
        load_hf_config(path)


def test_cli_reads_hf_config_and_reports_bad_ones(tmp_path: Path) -> None:
    good = _write(tmp_path, MIXTRAL)
    out = subprocess.run(
        [sys.executable, "-m", "checker.cli", "tp2xzero3xep4", "--devices", "64", "--model", str(good), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["parameters"] == PRESETS["mixtral-8x7b"].parameter_count()
    bad = _write(tmp_path, {**MIXTRAL, "num_experts_per_tok": 9}, "bad.json")
    out = subprocess.run(
        [sys.executable, "-m", "checker.cli", "zero3", "--model", str(bad)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "num_experts_per_tok=9" in out.stderr
