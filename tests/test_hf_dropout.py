"""Dropout read from a Hugging Face config: it decides whether the dropout masks are kept for the
backward (Korthikanti et al. 2022, section 4.1), so a llama-style config (``attention_dropout``
0.0 by the transformers library's default) trains without masks and GPT-2 (``attn_pdrop``,
``resid_pdrop``, ``embd_pdrop`` 0.1 by default) with them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from formal._hf import transformer_from_hf
from formal.errors import ModelError

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 1000,
    "max_position_embeddings": 128,
}
GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "n_embd": 256,
    "n_layer": 2,
    "n_head": 4,
    "vocab_size": 1000,
    "n_positions": 128,
}


def test_a_llama_config_without_dropout_keys_trains_without_dropout() -> None:
    assert transformer_from_hf(dict(LLAMA)).dropout is False


def test_a_gpt2_config_without_dropout_keys_takes_gpt2s_default_rates() -> None:
    assert transformer_from_hf(dict(GPT2)).dropout is True


@given(st.sampled_from(["attention_dropout", "hidden_dropout"]), st.floats(min_value=0, max_value=0.9))
def test_any_positive_rate_means_dropout(key: str, rate: float) -> None:
    assert transformer_from_hf({**LLAMA, key: rate}).dropout is (rate > 0)


@given(st.floats(min_value=0, max_value=0.9))
def test_gpt2_without_dropout_when_every_rate_is_zero(rate: float) -> None:
    raw = {**GPT2, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": rate}
    assert transformer_from_hf(raw).dropout is (rate > 0)


@pytest.mark.parametrize("bad", ["0.1", True, -0.1, 1.0, None])
def test_a_rate_that_is_not_a_rate_is_refused(bad: object) -> None:
    with pytest.raises(ModelError, match="attention_dropout"):
        transformer_from_hf({**LLAMA, "attention_dropout": bad})
