"""Exporters: importing what we export gives back the same composition (per framework, over
everything that framework can express), foreign strategies export to the same placement, and the
DTensor view follows the placement and the step program's gradient origins."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from checker._exporters import Target, dtensor_placements, export
from checker._importers import import_deepspeed, import_megatron, import_torchtitan, megatron_tokens
from checker._layout import ExportError
from checker._parse import parse
from checker.cli import main
from formal._model import Model, Transformer
from formal._presets import PRESETS

DENSE = PRESETS["llama2-7b"]  # 32 layers
MOE = PRESETS["mixtral-8x7b"]  # 32 layers, 8 experts

@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str



def _default_m(pp: int) -> int:
    return 4 * pp if pp > 1 else 1  # the composition language's default (checker/_parse.py)


def _text(tp: int, data: str, dp: int, dpr: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sp: bool = False,
          m: int = 1, v: int = 1, gpipe: bool = False, offload: bool = False, offload_params: bool = False,
          recompute: str = "") -> str:
    """A composition in canonical order, written independently of the code under test."""
    terms = ([f"tp{tp}"] if tp > 1 else []) + [f"{data}{dp}"]
    terms += [f"{n}{d}" for n, d in (("dpr", dpr), ("pp", pp), ("cp", cp), ("ep", ep)) if d > 1]
    terms += ["sp"] if sp else []
    terms += [f"m{m}"] if m != _default_m(pp) else []
    terms += [f"v{v}"] if v > 1 else (["gpipe"] if gpipe else [])
    terms += (["offload"] if offload else []) + (["offload-params"] if offload_params else [])
    terms += [recompute] if recompute else []
    return "x".join(terms)


def _round_trip(text: str, target: Target, model: Model) -> str:
    comp = parse(text)
    out = export(comp, model, target).text
    match target:
        case Target.DEEPSPEED:
            imported = import_deepspeed(json.loads(out), devices=comp.devices)
        case Target.TORCHTITAN:
            imported = import_torchtitan(tomllib.loads(out), devices=comp.devices, model=model)
        case Target.MEGATRON:
            imported = import_megatron(megatron_tokens(out), devices=comp.devices, model=model)
        case _:
            raise AssertionError(target)
    assert imported.devices == comp.devices
    assert imported.micro_batch == model.micro_batch
    return imported.composition


degrees = st.sampled_from([1, 2, 4])
micro_batches = st.integers(1, 4)


@st.composite
def deepspeed_compositions(draw: st.DrawFn) -> tuple[str, Model]:
    stage = draw(st.sampled_from(["dp", "zero1", "zero2", "zero3"]))
    pp = draw(degrees) if stage in ("dp", "zero1") else 1  # DeepSpeed pipelines take ZeRO 0 or 1
    tp = draw(degrees) if stage != "zero3" else 1  # AutoTP takes ZeRO 0, 1, 2
    offload = stage != "dp" and draw(st.booleans())
    text = _text(tp, stage, draw(degrees), pp=pp, m=draw(st.integers(1, 16)), offload=offload,
                 offload_params=stage == "zero3" and draw(st.booleans()),
                 recompute="recompute" if pp > 1 and draw(st.booleans()) else "")
    return text, DENSE.with_micro_batch(draw(micro_batches))


@st.composite
def torchtitan_compositions(draw: st.DrawFn) -> tuple[str, Model]:
    data = draw(st.sampled_from(["dp", "fsdp", "fsdp-sgo"]))
    sharded = data != "dp"
    tp, pp, cp = draw(degrees), draw(degrees), draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2])) if sharded and cp == 1 else 1
    v = draw(st.sampled_from([1, 2])) if pp > 1 else 1  # 32 layers split into pp x v stages
    offload = sharded and draw(st.booleans())
    dp = draw(st.sampled_from([2, 4]) if sharded else degrees)  # torchtitan: shard degree 1 disables FSDP
    text = _text(tp, data, dp, dpr=draw(degrees) if sharded else 1, pp=pp, cp=cp, ep=ep, sp=tp > 1,
                 m=draw(st.integers(1, 16)), v=v, gpipe=pp > 1 and v == 1 and draw(st.booleans()),
                 offload=offload, offload_params=offload,
                 recompute=draw(st.sampled_from(["", "recompute", "selective"])))
    return text, (MOE if ep > 1 else DENSE).with_micro_batch(draw(micro_batches))


@st.composite
def megatron_compositions(draw: st.DrawFn) -> tuple[str, Model]:
    tp, pp, cp, ep = draw(degrees), draw(degrees), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    text = _text(tp, draw(st.sampled_from(["dp", "distopt"])), draw(degrees), pp=pp, cp=cp, ep=ep,
                 sp=tp > 1 and draw(st.booleans()), m=draw(st.integers(1, 16)),
                 v=draw(st.sampled_from([1, 2])) if pp > 1 else 1,
                 recompute=draw(st.sampled_from(["", "recompute", "selective"])))
    return text, (MOE if ep > 1 else DENSE).with_micro_batch(draw(micro_batches))


@settings(max_examples=60, deadline=None)
@given(deepspeed_compositions())
def test_deepspeed_round_trip(case: tuple[str, Model]) -> None:
    text, model = case
    assert _round_trip(text, Target.DEEPSPEED, model) == text


@settings(max_examples=60, deadline=None)
@given(torchtitan_compositions())
def test_torchtitan_round_trip(case: tuple[str, Model]) -> None:
    text, model = case
    assert _round_trip(text, Target.TORCHTITAN, model) == text


@settings(max_examples=60, deadline=None)
@given(megatron_compositions())
def test_megatron_round_trip(case: tuple[str, Model]) -> None:
    text, model = case
    assert _round_trip(text, Target.MEGATRON, model) == text


DATA = ["dp", "zero1", "zero2", "zero3", "fsdp", "fsdp-sgo", "hsdp", "distopt"]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DATA), st.sampled_from([Target.DEEPSPEED, Target.TORCHTITAN, Target.MEGATRON]), degrees)
def test_any_data_strategy_exports_to_its_placement_or_is_refused(data: str, target: Target, tp: int) -> None:
    """zero3, fsdp and hsdp are one placement: whatever a framework calls it, the imported
    composition places every state group exactly as the original does."""
    text = _text(tp, data, 4, sp=tp > 1 and target is Target.TORCHTITAN)
    try:
        back = _round_trip(text, target, DENSE)
    except ExportError:
        return
    original, imported = parse(text).placement(DENSE), parse(back).placement(DENSE)
    assert imported.table() == original.table()
    assert imported.options == original.options


@pytest.mark.parametrize(("text", "target", "why"), [
    ("zero28", Target.TORCHTITAN, "ZeRO 1 or 2"),  # FSDP always shards parameters
    ("fsdp-sgo8", Target.DEEPSPEED, "held through backward"),  # SHARD_GRAD_OP is not ZeRO-2
    ("zero38", Target.MEGATRON, "ZeRO 2 or 3"),
    ("zero28xpp4", Target.DEEPSPEED, "pipeline"),  # DeepSpeed refuses ZeRO-2/3 with PP
    ("tp2xfsdp4", Target.TORCHTITAN, "sequence parallelism"),  # torchtitan's TP always has SP
])
def test_refusals_name_what_cannot_be_said(text: str, target: Target, why: str) -> None:
    with pytest.raises(ExportError, match=why):
        export(parse(text), DENSE, target)


def test_exports_use_the_framework_names_of_semantics_section_2() -> None:
    assert json.loads(export(parse("zero28"), DENSE, Target.DEEPSPEED).text)["zero_optimization"]["stage"] == 2
    assert json.loads(export(parse("fsdp8"), DENSE, Target.DEEPSPEED).text)["zero_optimization"]["stage"] == 3
    tt = tomllib.loads(export(parse("fsdp-sgo8"), DENSE, Target.TORCHTITAN).text)
    assert tt["parallelism"]["fsdp_reshard_after_forward"] == "never"
    assert "--use-distributed-optimizer" in export(parse("zero18"), DENSE, Target.MEGATRON).text
    hsdp = tomllib.loads(export(parse("fsdp4xdpr2"), DENSE, Target.TORCHTITAN).text)["parallelism"]
    assert (hsdp["data_parallel_shard_degree"], hsdp["data_parallel_replicate_degree"]) == (4, 2)


def test_dtensor_follows_placement_and_gradient_origins() -> None:
    without_sp = dtensor_placements(parse("tp2xzero34").placement(DENSE))
    with_sp = dtensor_placements(parse("tp2xzero34xsp").placement(DENSE))
    assert without_sp["mesh_dims"] == ["tp", "dp"] and without_sp["mesh_shape"] == [2, 4]
    attn = without_sp["groups"]["attention"]
    assert attn["parameters"][0].startswith("Shard(0)") and "Shard(1) wo" in attn["parameters"][0]
    assert attn["parameters"][1].startswith("Shard(0) -> all-gather")  # ZeRO-3 gathers per use
    assert attn["gradients_after_backward"][1] == "Partial(avg)"  # data split along dp
    # LayerNorm weights: replicated by TP; their gradients are partial along tp only under SP
    # (Korthikanti et al. 2022 4.2.2; Megatron-LM #1446 when the reduction is forgotten).
    assert without_sp["groups"]["norm"]["gradients_after_backward"][0] == "Replicate()"
    assert with_sp["groups"]["norm"]["gradients_after_backward"][0] == "Partial(sum)"
    zero1 = dtensor_placements(parse("zero14").placement(DENSE))["groups"]["mlp"]
    assert zero1["parameters"] == ["Replicate()"] and zero1["optimizer"] == ["Shard(0)"]
    assert "host" in dtensor_placements(parse("zero34xoffload").placement(DENSE))["groups"]["mlp"]["optimizer"][0]
    tied = dtensor_placements(parse("dp2xpp2").placement(PRESETS["gpt3-1.3b"]))["groups"]["embedding"]
    assert "first and last stage" in tied["pp"]


def test_interleaved_needs_layers_that_split() -> None:
    assert isinstance(DENSE, Transformer)
    with pytest.raises(ExportError, match="do not split"):
        export(parse("dp2xpp4xv3"), DENSE, Target.MEGATRON)  # 32 layers, 12 virtual stages


def _cli(*args: str) -> Ran:
    """The CLI in-process (fast); an unexpected exception fails the test instead of hiding."""
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def test_cli_export_and_convert() -> None:
    out = _cli("export", "tp2xfsdp8xpp4xsp", "--to", "torchtitan")
    assert out.returncode == 0, out.stderr
    assert tomllib.loads(out.stdout)["parallelism"]["tensor_parallel_degree"] == 2
    out = _cli("export", "--from", "examples/configs/deepspeed_zero3_offload.json", "--devices", "16",
               "--to", "torchtitan")
    assert out.returncode == 0, out.stderr
    parallelism = tomllib.loads(out.stdout)["parallelism"]
    assert parallelism["data_parallel_shard_degree"] == 16
    out = _cli("export", "zero28", "--to", "torchtitan")
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = _cli("export", "tp2xzero34", "--to", "dtensor", "--json")
    assert json.loads(out.stdout)["groups"]["mlp"]["parameters"][0].startswith("Shard(0)")
