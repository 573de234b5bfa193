"""Configurations as people have them: Megatron-LM's own launch scripts (shell variables and
arrays), Hugging Face configs of the llama-like families, and DeepSpeed keys that change memory
or traffic. The shell is checked against bash itself; parameter counts against the published
figures and a count written out here, independently of ``formal._model``."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from checker._command import request
from checker._importers import ConfigError, import_deepspeed, import_megatron, load_config, megatron_tokens
from formal._hf import load_hf_config, seq_note, transformer_from_hf
from formal._model import Transformer
from formal.errors import ModelError

DATA = Path(__file__).resolve().parent / "data"
# A script in the layout of Megatron-LM's examples/gpt3 launcher (arrays, variables), written for
# these tests with GPT-3 175B's published size and PTD-P's layout.
GPT3_SCRIPT = DATA / "megatron_train_gpt3_175b_distributed.sh"
BASH = shutil.which("bash")

# --- the shell, against bash ----------------------------------------------------------------

_WORD_CHARS = st.sampled_from("abcXYZ019-_=.,/: '\"$")
words = st.text(_WORD_CHARS, min_size=1, max_size=8)


@st.composite
def scripts(draw: st.DrawFn) -> str:
    """Launch scripts that hand their arguments to ``pretrain_gpt.py`` through variables and arrays."""
    args = draw(st.lists(words, min_size=1, max_size=6))
    style = draw(st.sampled_from(["array", "quoted-array", "string", "vars", "append", "default"]))
    quoted = [shlex.quote(a) for a in args]
    match style:
        case "array":
            body = "ARGS=(\n" + "".join(f"    {q} # note (a comment)\n" for q in quoted) + ")\n"
            call = "${ARGS[@]}"
        case "quoted-array":
            body = "ARGS=(" + " ".join(quoted) + ")\n"
            call = '"${ARGS[@]}"'
        case "string":
            body = f"ARGS={shlex.quote(' '.join(args))}\n"
            call = "$ARGS"
        case "vars":
            body = "".join(f"export V{k}={q}\n" for k, q in enumerate(quoted))
            call = " \\\n    ".join(f'"${{V{k}}}"' if k % 2 else f"$V{k}" for k in range(len(args)))
        case "append":
            body = "ARGS=()\n" + "".join(f"ARGS+=({q})\n" for q in quoted)
            call = "${ARGS[*]}"
        case _:
            body = f"B={quoted[0]}\n"
            call = '"${UNSET_IN_TEST:-$B}" ' + " ".join(quoted[1:])
    nodes = draw(st.integers(1, 4))
    return (
        f"#!/bin/bash\nN={nodes}\nW=$(( $N * 8 ))\n{body}torchrun --nproc_per_node $((W / N)) pretrain_gpt.py {call}\n"
    )


def _bash_words(script: str) -> list[str]:
    """What bash passes to the launcher (globbing off, as Megatron arguments have no patterns)."""
    assert BASH is not None
    prefix = "set -f\ntorchrun() { printf '%s\\0' \"$@\"; }\n"
    out = subprocess.run(
        [BASH, "-c", prefix + script], capture_output=True, check=True, timeout=30, env={"PATH": "/usr/bin:/bin"}
    )
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.skipif(BASH is None, reason="needs bash")
@given(scripts())
def test_script_words_are_what_bash_runs(script: str) -> None:
    words_ = _bash_words(script)
    k = words_.index("pretrain_gpt.py")
    assert megatron_tokens(script) == words_[k + 1 :]


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_a_script_in_megatrons_example_layout_expands_as_bash_does() -> None:
    script = GPT3_SCRIPT.read_text()
    # bash with the positional parameters spelled as the reader keeps them (not set by the script)
    positional = " ".join(shlex.quote(f"${k}") for k in range(1, 6))
    run = script.replace("torchrun ", "torchrun_ ", 1)
    assert BASH is not None
    out = subprocess.run(
        [BASH, "-c", f"set -f; torchrun_() {{ printf '%s\\0' \"$@\"; }}; set -- {positional}\n{run}"],
        capture_output=True,
        check=True,
        timeout=30,
    )
    words_ = out.stdout.decode().split("\0")[:-1]
    k = next(i for i, w in enumerate(words_) if w.endswith(".py"))
    assert megatron_tokens(script) == words_[k + 1 :]


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_arguments_in_a_quoted_string_over_lines_expand_as_bash_does() -> None:
    # The older Megatron-LM example layout (examples/pretrain_gpt_distributed.sh): a string of
    # arguments over continued lines, launched unquoted so that the shell splits it.
    script = (
        "GPUS_PER_NODE=8\nNNODES=${NNODES:-2}\n"
        'DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES"\n'
        'GPT_ARGS="\n    --num-layers 24 \\\n    --hidden-size 1024 \\\n    --num-attention-heads 16 \\\n'
        '    --seq-length 1024 \\\n    --lr 0.00015\n"\n'
        "torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \\\n    $GPT_ARGS \\\n    --save $CHECKPOINT_PATH\n"
    )
    words_ = _bash_words(script.replace("$CHECKPOINT_PATH", "'$CHECKPOINT_PATH'"))
    assert megatron_tokens(script) == words_[words_.index("pretrain_gpt.py") + 1 :]
    assert words_[:4] == ["--nproc_per_node", "8", "--nnodes", "2"]


@pytest.mark.parametrize(
    "line",
    [
        "TP=$(nproc)\ntorchrun pretrain_gpt.py --tensor-model-parallel-size $TP",
        "torchrun pretrain_gpt.py --data-path `ls /data`",
        'X="$(cat args.txt)"\npython pretrain_gpt.py $X',
    ],
)
def test_command_substitution_is_refused_in_one_line(line: str) -> None:
    with pytest.raises(ConfigError, match=r"command substitution .* is not run") as err:
        megatron_tokens(line)
    assert "\n" not in str(err.value)


def test_command_substitution_for_the_launcher_is_not_stated(tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text(
        "NODES=$(scontrol show hostnames | wc -l)\n"
        "torchrun --nproc_per_node 8 --nnodes $NODES pretrain_gpt.py --tensor-model-parallel-size 8 2>&1 | tee log\n"
    )
    imported = load_config(script, devices=None)
    assert imported.devices == 8  # nnodes not stated: one node, as torchrun's default
    assert imported.text.startswith("tp8")


# --- Megatron-LM's published GPT-3 175B script ---------------------------------------------


def _gpt_count(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """Narayanan et al. 2021, section 5.1: 12lh^2 + 13lh + (V + s)h, plus the final LayerNorm's
    2h that their formula leaves out."""
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden + 2 * hidden


def test_a_gpt3_175b_launch_script_imports_with_its_own_model() -> None:
    req = request(None, 128, None, None, "megatron", None, from_path=str(GPT3_SCRIPT))
    model = req.model
    assert isinstance(model, Transformer)
    # The script's own arguments; GPT-2's 50,257 tokens padded to a multiple of 128 x tp(8) = 1024.
    assert (model.layers, model.hidden, model.heads, model.seq, model.vocab) == (96, 12288, 96, 2048, 51200)
    assert model.parameter_count() == _gpt_count(96, 12288, 51200, 2048)
    assert round(model.parameter_count() / 1e8) == 1746  # Narayanan et al. 2021, Table 2: 174.6B
    assert req.imported is not None
    # 1536 = micro 1 x dp 1 x 1536 micro-batches; --clip-grad 1.0 and --fp16 (dynamic loss scaling)
    assert req.imported.text == "tp8xdp1xpp16xm1536xclipxfp16"
    assert req.imported.precision == "megatron-fp16"  # --fp16
    settings = {u.setting for u in req.imported.unmapped}
    assert "launcher" in settings  # NUM_NODES=1: 8 processes, --devices 128 used
    assert any(s.startswith("--rampup-batch-size 16 16 5859375") for s in settings)


def test_a_gpt3_175b_launch_script_on_one_node_needs_more_devices() -> None:
    with pytest.raises(ConfigError, match=r"nproc_per_node x nnodes 8 is not divisible by tp\(8\) x pp\(16\)"):
        load_config(GPT3_SCRIPT, devices=None)


# --- a Megatron model from its size arguments ----------------------------------------------

_LLAMA_ARGS = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --swiglu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --tokenizer-type NullTokenizer "
    "--vocab-size 128000"
)


def _llama_count(layers: int, h: int, heads: int, kv: int, ffn: int, vocab: int, tied: bool, hd: int = 0) -> int:
    """A llama-like decoder written out: q, k, v, o; three MLP matrices; two RMSNorms a layer;
    the final norm; the embedding and (untied) output."""
    hd = hd or h // heads
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    return layers * (attention + 3 * h * ffn + 2 * h) + h + vocab * h * (1 if tied else 2)


def test_megatron_model_from_llama_like_arguments() -> None:
    imported = import_megatron(megatron_tokens(_LLAMA_ARGS), devices=8)
    model = imported.transformer
    assert model is not None and imported.model is None  # no preset has these sizes
    # Megatron-LM (arguments.py): --swiglu without --ffn-hidden-size is int(4h x 2/3 / 64) x 64.
    ffn = int((4 * 4096 * 2 / 3) / 64) * 64
    # NullTokenizer: 128,000 + the end-of-document token, padded to a multiple of 128.
    vocab = -(-128001 // 128) * 128
    assert (model.ffn_, model.vocab, model.kv_heads_) == (ffn, vocab, 8)
    assert model.parameter_count() == _llama_count(32, 4096, 32, 8, ffn, vocab, tied=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--num-layers 32 --tensor-model-parallel-size 2", "without --hidden-size --num-attention-heads"),
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8", "vocabulary size is not stated"),
        (_LLAMA_ARGS.replace("RMSNorm", "ScaleNorm"), "--normalization ScaleNorm"),
    ],
)
def test_megatron_model_arguments_that_do_not_say_a_model_are_refused(args: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        import_megatron(megatron_tokens(args), devices=8)


def test_megatron_without_size_arguments_says_the_default_model_is_used() -> None:
    imported = import_megatron(megatron_tokens("--tensor-model-parallel-size 2"), devices=8)
    assert imported.transformer is None
    assert any(u.setting == "model" and "default model" in u.why for u in imported.unmapped)


# --- Hugging Face configs of the llama-like families ---------------------------------------

# Architecture keys of the published config.json files (Hugging Face model repositories).
QWEN2_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
GEMMA_7B = {
    "model_type": "gemma",
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "intermediate_size": 24576,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "hidden_act": "gelu",
}
GEMMA_2B = {
    **GEMMA_7B,
    "hidden_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "intermediate_size": 16384,
}
PHI3_MINI = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 8192,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _load(tmp_path: Path, doc: dict[str, object]) -> Transformer:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return load_hf_config(path)


def test_qwen2_7b_counts_its_published_7_61b(tmp_path: Path) -> None:
    m = _load(tmp_path, QWEN2_7B)
    # Qwen2 (modeling_qwen2.py): biases on q, k and v only: 3584 + 2 x 4 x 128 per layer.
    expected = _llama_count(28, 3584, 28, 4, 18944, 152064, tied=False) + 28 * (3584 + 2 * 512)
    assert m.parameter_count() == expected
    assert f"{expected / 1e9:.2f}" == "7.62"  # Qwen/Qwen2-7B model card: "7.61B" (7.6156B, truncated)
    assert int(expected / 1e7) == 761


def test_qwen3_8b_counts_its_published_8_2b(tmp_path: Path) -> None:
    m = _load(tmp_path, QWEN3_8B)
    # Qwen3: an RMSNorm over head_dim (128) on queries and on keys in every layer.
    expected = _llama_count(36, 4096, 32, 8, 12288, 151936, tied=False) + 36 * 2 * 128
    assert m.parameter_count() == expected
    # Qwen/Qwen3-8B model card: 8.2B parameters, 6.95B non-embedding.
    assert round(expected / 1e8) == 82
    assert round((expected - 2 * 151936 * 4096) / 1e7) == 695


def test_qwen3_moe_counts_its_published_30_5b(tmp_path: Path) -> None:
    m = _load(tmp_path, QWEN3_30B_A3B)
    h, hd, layers = 2048, 128, 48
    attention = h * 32 * hd + 2 * h * 4 * hd + 32 * hd * h + 2 * hd  # with the q and k norms
    experts = 128 * 3 * h * 768 + h * 128  # experts of moe_intermediate_size and the router
    expected = layers * (attention + experts + 2 * h) + h + 2 * 151936 * h
    assert (m.experts, m.top_k) == (128, 8)
    assert m.parameter_count() == expected
    assert round(expected / 1e8) == 305  # Qwen/Qwen3-30B-A3B model card: 30.5B in total


@pytest.mark.parametrize(
    ("doc", "non_embedding"),
    [
        # Gemma Team 2024, "Gemma: Open Models Based on Gemini Research and Technology", Table 2
        (GEMMA_2B, 1_981_884_416),
        (GEMMA_7B, 7_751_248_896),
    ],
)
def test_gemma_counts_its_published_non_embedding_parameters(
    tmp_path: Path, doc: dict[str, object], non_embedding: int
) -> None:
    m = _load(tmp_path, doc)
    h = m.hidden
    heads, kv = int(str(doc["num_attention_heads"])), int(str(doc["num_key_value_heads"]))
    expected = _llama_count(m.layers, h, heads, kv, m.ffn_, 256000, tied=True, hd=256)
    assert m.tied_embeddings  # Gemma ties its embeddings by default
    assert m.parameter_count() == expected
    assert expected - 256000 * h == non_embedding


def test_phi3_mini_counts_its_published_3_8b(tmp_path: Path) -> None:
    m = _load(tmp_path, PHI3_MINI)
    expected = _llama_count(32, 3072, 32, 32, 8192, 32064, tied=False)
    assert m.parameter_count() == expected
    assert round(expected / 1e9, 1) == 3.8  # Abdin et al. 2024, Phi-3 Technical Report: 3.8B


def test_a_model_directory_is_read_through_its_config_json(tmp_path: Path) -> None:
    folder = tmp_path / "Qwen2-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_7B))
    m = load_hf_config(folder)
    assert m.name == "Qwen2-7B"
    assert m.parameter_count() == _load(tmp_path, QWEN2_7B).parameter_count()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"without config\.json"):
        load_hf_config(tmp_path / "empty")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 20480}, "not supported"),
        ({"n_shared_experts": 2}, "n_shared_experts=2"),
        ({"first_k_dense_replace": 1}, "first_k_dense_replace=1"),
        ({"model_type": "qwen3", "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, "a dense family"),
    ],
)
def test_fields_that_change_the_count_unrepresented_are_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ModelError, match=message):
        transformer_from_hf({**QWEN2_7B, **change})


def test_a_context_window_taken_as_the_sequence_is_said(tmp_path: Path) -> None:
    m = _load(tmp_path, QWEN2_7B)
    note = seq_note(m)
    assert note is not None and "131,072" in note and "max_position_embeddings" in note
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}))
    noted = load_config(config, devices=8, model=m)
    assert any(u.setting == "sequence length" and "131,072" in u.why for u in noted.unmapped)
    assert not any(u.setting == "sequence length" for u in load_config(config, devices=8, model=m, seq=4096).unmapped)


# --- DeepSpeed keys that change memory or traffic ------------------------------------------


def test_deepspeed_keys_that_change_memory_or_traffic_are_reported() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": 1,
        "communication_data_type": "fp32",
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_max_live_parameters": 1e9,
            "stage3_param_persistence_threshold": 1e5,
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
            "offload_optimizer": {"device": "cpu", "ratio": 0.3},
        },
    }
    imported = import_deepspeed(raw, devices=8)
    settings = {u.setting.split("=")[0] for u in imported.unmapped}
    zero = [
        "allgather_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_param_persistence_threshold",
        "zero_quantized_weights",
        "zero_quantized_gradients",
        "offload_optimizer.ratio",
    ]
    assert {"communication_data_type", "optimizer.type", *(f"zero_optimization.{k}" for k in zero)} <= settings
    # the reduce bucket is a term of DeepSpeed's peak (formal._engine_deepspeed): read, not reported
    assert "zero_optimization.reduce_bucket_size" not in settings
    assert imported.deepspeed is not None and imported.deepspeed.reduce_bucket_elements == 500_000_000
    adam = import_deepspeed({**raw, "optimizer": {"type": "AdamW"}}, devices=8)
    assert not any(u.setting.startswith("optimizer") for u in adam.unmapped)  # Adam's 12 bytes: modelled


def test_a_script_of_no_preset_size_is_checked_with_its_own_model(tmp_path: Path) -> None:
    script = tmp_path / "train.sh"
    script.write_text(f"MODEL=({_LLAMA_ARGS})\ntorchrun --nproc_per_node 8 pretrain_gpt.py ${{MODEL[@]}}\n")
    req = request(None, None, None, None, "megatron", None, from_path=str(script))
    assert isinstance(req.model, Transformer)
    assert req.model.parameter_count() == _llama_count(32, 4096, 32, 8, 10880, 128000 + 128, tied=False)
    assert req.model.seq == 8192 and req.devices == 8


def test_a_hf_model_without_seq_says_its_context_window_is_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mistral = {**QWEN2_7B, "model_type": "mistral", "max_position_embeddings": 32768}
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    req = request("zero3", 8, str(tmp_path), None, "zero", None)
    assert isinstance(req.model, Transformer) and req.model.seq == 32768
    assert "max_position_embeddings" in capsys.readouterr().err
    request("zero3", 8, str(tmp_path), None, "zero", None, seq=4096)
    assert capsys.readouterr().err == ""  # --seq given: nothing assumed


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("use", ['"$@"', "$@", "${@}", "$*"])
def test_the_scripts_own_arguments_are_read_as_none_and_said(tmp_path: Path, use: str) -> None:
    script = tmp_path / "train.sh"
    script.write_text(
        f"EXTRA=({use})\ntorchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 2 {use}\n"
    )
    imported = load_config(script, devices=None)
    assert imported.text == "tp2xdp4"
    assert any(u.setting == "$@" for u in imported.unmapped)
    assert _bash_words(script.read_text())[-1] == "2"  # bash, run without arguments, passes none
