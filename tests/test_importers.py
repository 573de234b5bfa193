"""Importers: realistic configs (examples/configs/, written from each framework's docs) map to the
compositions the frameworks' own rules imply; unknown or contradictory keys give one clear line."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from checker._importers import (
    ConfigError,
    import_deepspeed,
    import_megatron,
    import_torchtitan,
    launcher_world_size,
    load_config,
    megatron_tokens,
)
from checker._parse import parse
from formal._model import Transformer
from formal._presets import PRESETS

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


# Expected compositions follow each framework's documented arithmetic:
# DeepSpeed train_batch_size = micro x gas x dp (dp = world / (tp x pp)); its pipeline engine runs
# gradient_accumulation_steps micro-batches; torchtitan world = dp_replicate x dp_shard x cp x tp x pp,
# reshard_after_forward "default" = not pp; Megatron dp = world / (tp x pp x cp), micro-batches =
# global / (micro x dp), chunks = layers / (pp x layers-per-virtual-stage).
@pytest.mark.parametrize(
    ("name", "devices", "composition", "world", "micro", "model"),
    [
        ("deepspeed_zero2.json", 32, "zero232xm2xclip", 32, 4, None),  # 256 = 4 x 2 x 32
        ("deepspeed_zero3_offload.json", 16, "zero316xm8xoffloadxoffload-paramsxclipxfp16", 16, 1, None),
        (
            "deepspeed_pipeline.json",
            None,
            "zero116xpp4xrecomputexclipxfp16",
            64,
            2,
            None,
        ),  # 512 = 2 x 16 x 16; m16 = 4p
        ("torchtitan_llama3_8b.toml", 8, "fsdp8xselectivexclip", 8, 1, "llama3-8b"),
        ("torchtitan_llama3_70b.toml", 64, "tp8xfsdp8xspxrecomputexclip", 64, 8, "llama3-70b"),
        (
            "torchtitan_llama3_405b_3d.toml",
            384,
            "tp8xfsdp-sgo4xdpr2xpp6xspxm16xv3xrecomputexclip",
            384,
            1,
            "llama3-405b",
        ),
        ("megatron_gpt3_175b.sh", None, "tp8xdistopt8xpp16xspxm192xv2xselectivexclip", 1024, 1, "gpt3-175b"),
        ("megatron_mixtral_8x7b.sh", None, "distopt2xpp4xep8xrecomputexbalance-loss", 64, 1, "mixtral-8x7b"),
    ],
)
def test_example_configs_import(
    name: str, devices: int | None, composition: str, world: int, micro: int, model: str | None
) -> None:
    imported = load_config(CONFIGS / name, devices=devices)
    assert imported.text == composition
    assert imported.composition == parse(composition, devices=world)  # the parser agrees, object for object
    assert imported.devices == world
    assert imported.micro_batch == micro
    assert imported.model == model


def test_every_example_config_is_tested() -> None:
    tested = {
        "deepspeed_zero2.json",
        "deepspeed_zero3_offload.json",
        "deepspeed_pipeline.json",
        "torchtitan_llama3_8b.toml",
        "torchtitan_llama3_70b.toml",
        "torchtitan_llama3_405b_3d.toml",
        "megatron_gpt3_175b.sh",
        "megatron_mixtral_8x7b.sh",
    }
    assert {p.name for p in CONFIGS.iterdir()} == tested


def test_torchtitan_notes_what_it_could_not_map() -> None:
    raw = tomllib.loads((CONFIGS / "torchtitan_llama3_8b.toml").read_text())
    del raw["activation_checkpoint"]
    imported = import_torchtitan(raw, devices=8)
    assert imported.composition == parse("fsdp8xclip")  # torchtitan's default (every 2nd layer) has no spelling
    assert any(u.setting == "[activation_checkpoint]" and "upper bound" in u.why for u in imported.unmapped)


def test_megatron_launcher_world_size() -> None:
    assert launcher_world_size("torchrun --nproc_per_node 8 --nnodes 128 pretrain_gpt.py --bf16") == 1024
    assert launcher_world_size("torchrun --nproc-per-node=4 pretrain_gpt.py") == 4
    assert launcher_world_size("python pretrain_gpt.py --bf16") is None


def _ds(name: str = "deepspeed_zero2.json") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((CONFIGS / name).read_text())
    return doc


def _tt(name: str = "torchtitan_llama3_70b.toml") -> dict[str, Any]:
    return tomllib.loads((CONFIGS / name).read_text())


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return doc


@pytest.mark.parametrize(
    ("doc", "devices", "message"),
    [
        (_set(_ds(), "zero_optimisation", {"stage": 2}), 32, "did you mean zero_optimization"),
        (_set(_ds(), "zero_optimization.stage", 4), 32, "stage must be 0, 1, 2 or 3"),
        (
            _set(_ds(), "zero_optimization.offload_param", {"device": "cpu"}),
            32,
            "offload_param is valid only with stage 3",
        ),
        (_set(_ds(), "zero_optimization.overlap_com", True), 32, "zero_optimization.overlap_com"),
        (_set(_set(_ds(), "pipeline", {"stages": 4}), "train_batch_size", 64), 32, "supports ZeRO stage 0 or 1"),
        (_set(_ds(), "fp16", {"enabled": True}), 32, "both on"),
        (_ds(), 64, "train_batch_size 256 != micro(4) x gas(2) x dp(64)"),
        (_set(_ds(), "tensor_parallel", {"autotp_size": 2}), 64, "tensor_parallel"),  # fine with stage 2...
    ],
)
def test_deepspeed_bad_configs(doc: dict[str, Any], devices: int, message: str) -> None:
    if message == "tensor_parallel":  # ...but contradicts stage 3
        assert import_deepspeed(doc, devices=64).composition == parse("tp2xzero232xm2xclip")  # 256 = 4 x 2 x 32
        doc = _set(doc, "zero_optimization.stage", 3)
        message = "AutoTP training supports stages 0, 1 and 2"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_deepspeed(doc, devices=devices)


@pytest.mark.parametrize(
    ("doc", "devices", "message"),
    [
        (_set(_tt(), "parallelism.tensor_parallel_degre", 8), 64, "did you mean parallelism.tensor_parallel_degree"),
        (_set(_tt(), "parallelism.fsdp_reshard_after_forward", "sometimes"), 64, "default, always or never"),
        (_set(_tt(), "parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"), 64, "not mapped"),
        (_set(_tt(), "parallelism.data_parallel_shard_degree", 4), 64, "= 32 != --devices 64"),
        (_set(_tt(), "activation_checkpoint.mode", "sometimes"), 64, "activation_checkpoint.mode"),
        (_set(_tt(), "trainin", {"steps": 1}), 64, "did you mean \\[training"),
        (_set(_tt(), "parallelism.expert_parallel_degree", 3), 64, "must divide data_parallel_shard_degree"),
    ],
)
def test_torchtitan_bad_configs(doc: dict[str, Any], devices: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        import_torchtitan(doc, devices=devices)


@pytest.mark.parametrize(
    ("args", "devices", "message"),
    [
        ("--tensor-model-parallel-size 2 --tensor-parallel 4", 8, "unknown argument --tensor-parallel"),
        ("--tensor-model-parallel-size $TP", 8, "expand shell variables"),
        ("--sequence-parallel", 8, "needs --tensor-model-parallel-size > 1"),
        ("--expert-model-parallel-size 3", 8, "must divide the data-parallel size 8"),
        ("--micro-batch-size 2 --global-batch-size 100", 8, "--global-batch-size 100 is not divisible"),
        ("--recompute-granularity full", 8, "--recompute-method uniform or block"),
        ("--recompute-activations --recompute-granularity full --recompute-method uniform", 8, "contradicts"),
        ("--use-torch-fsdp2", 8, "fsdp"),
        ("--num-layers 33 --hidden-size 4096 --num-attention-heads 32", 8, "contradicts --model llama2-7b"),
    ],
)
def test_megatron_bad_arguments(args: str, devices: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        import_megatron(megatron_tokens(args), devices=devices, model=PRESETS["llama2-7b"])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "checker.cli", *args], capture_output=True, text=True, check=False)


def test_cli_from_deepspeed_gives_a_checked_report() -> None:
    out = _cli("--from", str(CONFIGS / "deepspeed_zero3_offload.json"), "--devices", "16", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["imported_from"]["framework"] == "deepspeed"
    assert doc["options"]["offload_optimizer"] and doc["options"]["offload_parameters"]
    assert doc["precision"]["name"] == "deepspeed"  # the config's fp16 recipe, since --precision was not given
    assert doc["memory"]["host"] > 0  # offloaded states live on the host


def test_cli_bad_config_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(_set(_ds(), "zero_optimization.stage", 2) | {"pipeline": {"stages": 2}}))
    out = _cli("--from", str(bad))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = _cli("tp2xzero3", "--from", str(CONFIGS / "deepspeed_zero2.json"))
    assert out.returncode == 2 and "give one, not both" in out.stderr


# --- uneven pipeline stages, as each framework splits the layers ---------------------------


def _megatron(*extra: str, layers: int = 126) -> list[str]:
    size = ["--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048", "--vocab-size", "32000"]
    return ["--num-layers", str(layers), *size, "--pipeline-model-parallel-size", "4", *extra]


@pytest.mark.parametrize(
    ("first", "last", "layers", "uneven"),
    [
        (31, 31, 126, True),  # 31 + 2 x 32 + 31: the fullest holds ceil(126 / 4) = 32
        (30, None, 126, True),  # the other three share 96 evenly: 32 each
        (32, 32, 128, False),  # layers that divide, split evenly: the even split
    ],
)
def test_megatron_first_and_last_stage_layers_are_uneven_stages(
    first: int, last: int | None, layers: int, uneven: bool
) -> None:
    extra = ["--decoder-first-pipeline-num-layers", str(first)]
    extra += [] if last is None else ["--decoder-last-pipeline-num-layers", str(last)]
    imported = import_megatron(_megatron(*extra, layers=layers), devices=8)
    assert imported.composition.options.uneven_stages is uneven
    # no --global-batch-size: one micro-batch per step (m1)
    assert imported.composition == parse("dp2xpp4xm1" + ("xuneven" if uneven else ""), devices=8)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--decoder-first-pipeline-num-layers", "30", "--decoder-last-pipeline-num-layers", "30"), "holds 33"),
        (("--decoder-first-pipeline-num-layers", "29"), "cannot share the remaining 97"),
        (("--decoder-first-pipeline-num-layers", "0"), "must be at least 1"),
        (("--decoder-first-pipeline-num-layers", "102"), "the fullest stage holds 102"),  # 102, 8, 8, 8
    ],
)
def test_megatron_splits_no_composition_charges_are_refused(extra: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        import_megatron(_megatron(*extra), devices=8)


def _tt_split(layers: int, stages: int, first: int, last: int) -> list[int]:
    """torchtitan's ``generate_llm_fqn_per_model_part``: embedding and output weigh ``first`` and
    ``last`` layers, the total is split evenly, the first ``total % stages`` stages one more."""
    total = layers + first + last
    each = [total // stages + (1 if s < total % stages else 0) for s in range(stages)]
    return [each[0] - first, *each[1:-1], each[-1] - last]


@pytest.mark.parametrize(("model", "weights"), [("llama2-7b", None), ("llama2-7b", 0), ("llama3-405b", 0)])
def test_torchtitan_reads_its_own_split_of_the_layers(model: str, weights: int | None) -> None:
    par: dict[str, Any] = {"pipeline_parallel_degree": 4, "data_parallel_shard_degree": 2}
    if weights is not None:
        par |= {"pipeline_parallel_first_stage_less_layers": 0, "pipeline_parallel_last_stage_less_layers": 0}
    chosen = PRESETS[model]
    imported = import_torchtitan(
        {"parallelism": par, "activation_checkpoint": {"mode": "none"}}, devices=8, model=chosen
    )
    assert isinstance(chosen, Transformer)
    layers = chosen.layers
    split = _tt_split(layers, 4, *((1, 1) if weights is None else (0, 0)))
    assert imported.composition.options.uneven_stages is (layers % 4 != 0)
    noted = [u for u in imported.unmapped if "less_layers" in u.setting]
    assert bool(noted) is (max(split) > -(-layers // 4))  # 9 of 32 on one stage with the defaults
    if noted:
        assert f"up to {max(split)} of the {layers}" in noted[0].why


# DeepSpeed's gradient accumulation type (``data_types.grad_accum_dtype``): the engine takes the
# model's own when it is unset (deepspeed/runtime/engine.py ``get_data_types``), and its ZeRO
# optimizers keep the reduced gradient partition in it (stage_1_and_2.py ``averaged_gradients``,
# stage3.py ``grad_partitions_flat_buffer``): 2 + 2 + 12 bytes in 16-bit, 2 + 4 + 12 in fp32.
@pytest.mark.parametrize(
    ("stage", "model", "accumulation", "offload", "recipe"),
    [
        (2, "bf16", None, False, "zero"),
        (3, "fp16", None, False, "zero"),
        (3, "bf16", "bf16", False, "zero"),
        (2, "bf16", "fp32", False, "deepspeed"),
        (1, "bf16", "torch.float32", False, "deepspeed"),  # ZeRO-1: BF16_Optimizer's fp32 gradients
        (3, "bf16", None, True, "deepspeed"),  # CPU Adam reads an fp32 gradient partition on the host
        (3, None, None, False, "fp32"),
        (2, None, "float", False, "fp32"),
    ],
)
def test_deepspeed_precision_follows_the_gradient_accumulation_type(
    stage: int, model: str | None, accumulation: str | None, offload: bool, recipe: str
) -> None:
    doc = _set(_ds(), "zero_optimization.stage", stage)
    doc.pop("bf16")
    if model is not None:
        doc[model] = {"enabled": True}
    if accumulation is not None:
        doc["data_types"] = {"grad_accum_dtype": accumulation}
    if offload:
        doc = _set(doc, "zero_optimization.offload_optimizer", {"device": "cpu"})
    assert import_deepspeed(doc, devices=32).precision == recipe


@pytest.mark.parametrize(
    ("stage", "model", "accumulation", "message"),
    [
        (0, "bf16", "fp32", "only under ZeRO"),  # the engine refuses the mix without ZeRO
        (2, None, "bf16", "not modelled"),
        (2, "bf16", "int8", "fp16, bf16 or fp32"),
        (2, "bf16", 32, "expected a string"),
    ],
)
def test_deepspeed_gradient_accumulation_types_refused(
    stage: int, model: str | None, accumulation: object, message: str
) -> None:
    doc = _set(_ds(), "zero_optimization.stage", stage)
    doc.pop("bf16")
    if model is not None:
        doc[model] = {"enabled": True}
    doc["data_types"] = {"grad_accum_dtype": accumulation}
    with pytest.raises(ConfigError, match=message):
        import_deepspeed(doc, devices=32)


def test_deepspeed_unknown_data_types_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown key data_types\.grad_acum_dtype"):
        import_deepspeed(_ds() | {"data_types": {"grad_acum_dtype": "fp32"}}, devices=32)
