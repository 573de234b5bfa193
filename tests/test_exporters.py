"""Exporters: importing what we export gives back the same composition (per framework, over
everything that framework can express), every modifier is carried or refused by name, foreign
strategies export to the same placement, and the DTensor view follows the placement and the step
program's gradient origins."""

from __future__ import annotations

import itertools
import json
import tomllib
from dataclasses import dataclass, replace

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_costs import transformers

from checker._analysis import analyze
from checker._exporters import Target, dtensor_placements, export, megatron_uneven_split
from checker._importers import import_deepspeed, import_megatron, import_torchtitan, megatron_tokens
from checker._layout import ExportError
from checker._parse import parse
from checker.cli import main
from formal._model import DEFAULT_PRECISION, Model, Transformer
from formal._presets import PRESETS
from formal._smt import decide
from formal._vocab import Axis

DENSE = PRESETS["llama2-7b"]  # 32 layers
MOE = PRESETS["mixtral-8x7b"]  # 32 layers, 8 experts
LLAMA3_405B = PRESETS["llama3-405b"]  # 126 layers: uneven on 4 or 16 pipeline stages


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def _default_m(pp: int) -> int:
    return 4 * pp if pp > 1 else 1  # the composition language's default (checker/_parse.py)


def _text(
    tp: int,
    data: str,
    dp: int,
    dpr: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    sp: bool = False,
    m: int = 1,
    v: int = 1,
    gpipe: bool = False,
    offload: bool = False,
    offload_params: bool = False,
    recompute: str = "",
    uneven: bool = False,
    replicate: str = "dpr",
) -> str:
    """A composition in canonical order, written independently of the code under test."""
    terms = ([f"tp{tp}"] if tp > 1 else []) + [f"{data}{dp}"]
    terms += [f"{n}{d}" for n, d in ((replicate, dpr), ("pp", pp), ("cp", cp), ("ep", ep)) if d > 1]
    terms += ["sp"] if sp else []
    terms += [f"m{m}"] if m != _default_m(pp) else []
    terms += [f"v{v}"] if v > 1 else (["gpipe"] if gpipe else [])
    terms += ["uneven"] if uneven else []
    terms += (["offload"] if offload else []) + (["offload-params"] if offload_params else [])
    terms += [recompute] if recompute else []
    return "x".join(terms)


def _round_trip(text: str, target: Target, model: Model) -> str:
    comp = parse(text)
    out = export(comp, model, target).text
    match target:
        case Target.DEEPSPEED:
            imported = import_deepspeed(json.loads(out), devices=comp.devices, model=model)
        case Target.TORCHTITAN:
            imported = import_torchtitan(tomllib.loads(out), devices=comp.devices, model=model)
        case Target.MEGATRON:
            imported = import_megatron(megatron_tokens(out), devices=comp.devices, model=model)
        case _:
            raise AssertionError(target)
    assert imported.devices == comp.devices
    assert imported.micro_batch == model.micro_batch
    assert imported.composition == parse(imported.text, devices=comp.devices)  # built, not parsed: the same
    return imported.text


degrees = st.sampled_from([1, 2, 4])
micro_batches = st.integers(1, 4)


def _expected_back(text: str, model: Model) -> str:
    """What importing an export of ``text`` must give: ``text`` itself, except that declared
    uneven stages over layers that divide by the stages are the even split (no framework key
    says 'uneven' then, and the composition's meaning is the same: ``test_every_modifier_...``)."""
    comp = parse(text)
    stages = comp.mesh().get(Axis.PP, 1) * comp.options.virtual_stages
    if comp.options.uneven_stages and isinstance(model, Transformer) and model.layers % stages == 0:
        return "x".join(t for t in text.split("x") if t != "uneven")
    return text


@st.composite
def deepspeed_compositions(draw: st.DrawFn) -> tuple[str, Model]:
    stage = draw(st.sampled_from(["dp", "zero1", "zero2", "zero3"]))
    pp = draw(degrees) if stage in ("dp", "zero1") else 1  # DeepSpeed pipelines take ZeRO 0 or 1
    tp = draw(degrees) if stage != "zero3" else 1  # AutoTP takes ZeRO 0, 1, 2
    offload = stage != "dp" and draw(st.booleans())
    uneven = pp > 1 and draw(st.booleans())  # 126 layers: uneven on 4 stages, even on 2
    hpz = stage == "zero3" and draw(st.booleans())  # ZeRO++ hpZ: nodes of dp devices, dpr nodes
    text = _text(
        tp,
        stage,
        draw(st.sampled_from([2, 4]) if hpz else degrees),  # hpZ over nodes of 1 is refused (below)
        dpr=draw(st.sampled_from([2, 4])) if hpz else 1,
        replicate="hpz-dpr",
        pp=pp,
        m=draw(st.integers(1, 16)),
        offload=offload,
        offload_params=stage == "zero3" and draw(st.booleans()),
        recompute="recompute" if pp > 1 and draw(st.booleans()) else "",
        uneven=uneven,
    )
    return text, (LLAMA3_405B if uneven else DENSE).with_micro_batch(draw(micro_batches))


@st.composite
def torchtitan_compositions(draw: st.DrawFn) -> tuple[str, Model]:
    data = draw(st.sampled_from(["dp", "fsdp", "fsdp-sgo"]))
    sharded = data != "dp"
    tp, pp, cp = draw(degrees), draw(degrees), draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2])) if sharded and cp == 1 else 1
    v = draw(st.sampled_from([1, 2])) if pp > 1 else 1  # 32 layers split into pp x v stages
    offload = sharded and draw(st.booleans())
    dp = draw(st.sampled_from([2, 4]) if sharded else degrees)  # torchtitan: shard degree 1 disables FSDP
    uneven = pp > 1 and v == 1 and ep == 1 and draw(st.booleans())
    text = _text(
        tp,
        data,
        dp,
        dpr=draw(degrees) if sharded else 1,
        pp=pp,
        cp=cp,
        ep=ep,
        sp=tp > 1,
        m=draw(st.integers(1, 16)),
        v=v,
        gpipe=pp > 1 and v == 1 and draw(st.booleans()),
        offload=offload,
        offload_params=offload,
        recompute=draw(st.sampled_from(["", "recompute", "selective"])),
        uneven=uneven,
    )
    model = MOE if ep > 1 else LLAMA3_405B if uneven else DENSE
    return text, model.with_micro_batch(draw(micro_batches))


@st.composite
def megatron_compositions(draw: st.DrawFn) -> tuple[str, Model]:
    tp, pp, cp, ep = draw(degrees), draw(degrees), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    v = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    uneven = pp > 1 and v == 1 and ep == 1 and draw(st.booleans())
    text = _text(
        tp,
        draw(st.sampled_from(["dp", "distopt"])),
        draw(degrees),
        pp=pp,
        cp=cp,
        ep=ep,
        sp=tp > 1 and draw(st.booleans()),
        m=draw(st.integers(1, 16)),
        v=v,
        recompute=draw(st.sampled_from(["", "recompute", "selective"])),
        uneven=uneven,
    )
    model = MOE if ep > 1 else LLAMA3_405B if uneven else DENSE
    return text, model.with_micro_batch(draw(micro_batches))


@settings(max_examples=60, deadline=None)
@given(deepspeed_compositions())
def test_deepspeed_round_trip(case: tuple[str, Model]) -> None:
    text, model = case
    assert _round_trip(text, Target.DEEPSPEED, model) == _expected_back(text, model)


@settings(max_examples=60, deadline=None)
@given(torchtitan_compositions())
def test_torchtitan_round_trip(case: tuple[str, Model]) -> None:
    text, model = case
    assert _round_trip(text, Target.TORCHTITAN, model) == _expected_back(text, model)


@settings(max_examples=60, deadline=None)
@given(megatron_compositions())
def test_megatron_round_trip(case: tuple[str, Model]) -> None:
    text, model = case
    assert _round_trip(text, Target.MEGATRON, model) == _expected_back(text, model)


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


@pytest.mark.parametrize(
    ("text", "target", "why"),
    [
        ("zero28", Target.TORCHTITAN, "ZeRO 1 or 2"),  # FSDP always shards parameters
        ("fsdp-sgo8", Target.DEEPSPEED, "held through backward"),  # SHARD_GRAD_OP is not ZeRO-2
        ("zero38", Target.MEGATRON, "ZeRO 2 or 3"),
        ("zero28xpp4", Target.DEEPSPEED, "pipeline"),  # DeepSpeed refuses ZeRO-2/3 with PP
        ("tp2xfsdp4", Target.TORCHTITAN, "sequence parallelism"),  # torchtitan's TP always has SP
    ],
)
def test_refusals_name_what_cannot_be_said(text: str, target: Target, why: str) -> None:
    with pytest.raises(ExportError, match=why):
        export(parse(text), DENSE, target)


def test_exports_use_the_framework_names_of_the_placements() -> None:
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


def test_megatron_export_says_the_load_balancing_loss() -> None:
    moe = PRESETS["mixtral-8x7b"]
    for term, kind in (("balance-loss", "aux_loss"), ("global-balance-loss", "global_aux_loss")):
        text = export(parse(f"dp2xpp4xep8x{term}"), moe, Target.MEGATRON).text
        assert f"--moe-router-load-balancing-type {kind}" in text and "--moe-aux-loss-coeff" in text


def test_cli_export_and_convert() -> None:
    out = _cli("export", "tp2xfsdp8xpp4xsp", "--to", "torchtitan")
    assert out.returncode == 0, out.stderr
    assert tomllib.loads(out.stdout)["parallelism"]["tensor_parallel_degree"] == 2
    out = _cli("export", "tp2xdp2xpp2xspxclipxfp16", "--to", "megatron")
    assert out.returncode == 0, out.stderr
    assert "--clip-grad 1.0" in out.stdout and "--fp16" in out.stdout  # the scalars carried over
    # fp16 dynamic loss scaling has no torchtitan spelling (bf16, no loss scale): said, not dropped
    out = _cli(
        "export", "--from", "examples/configs/deepspeed_zero3_offload.json", "--devices", "16", "--to", "torchtitan"
    )
    assert out.returncode == 0, out.stderr
    assert tomllib.loads(out.stdout)["parallelism"]["data_parallel_shard_degree"] == 16
    assert "fp16 dynamic loss scaling" in out.stdout + out.stderr
    out = _cli("export", "zero28", "--to", "torchtitan")
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    out = _cli("export", "tp2xzero34", "--to", "dtensor", "--json")
    assert json.loads(out.stdout)["groups"]["mlp"]["parameters"][0].startswith("Shard(0)")


# --- every modifier: carried through export -> import, or refused by name ------------------


def _meaning(text: str, model: Model) -> tuple[object, ...]:
    """What a composition means to the checker: its placement, the fullest stage's layers,
    its options (the ``uneven`` flag aside: the layer share and the verdict say what it does),
    its memory per device and its verdict."""
    comp = parse(text)
    pl = comp.placement(model)
    analysis = analyze(comp, model, DEFAULT_PRECISION)
    verdict = decide(comp, analysis.program, model)
    layers = pl.stage_layers(model.layers) if isinstance(model, Transformer) else None
    return (pl.table(), layers, replace(comp.options, uneven_stages=False), analysis.memory.total, verdict.status)


T, D, M = Target.TORCHTITAN, Target.DEEPSPEED, Target.MEGATRON
CARRIED = [  # (target, composition): each modifier on a base the target accepts (llama2-7b, 32 layers)
    (T, "tp2xfsdp2xpp2xsp"),
    (T, "fsdp4xpp2xm4"),
    (T, "fsdp4xpp2xv2"),
    (T, "fsdp4xpp2xgpipe"),
    (T, "fsdp4xpp2x1f1b"),
    (T, "fsdp4xpp2xuneven"),
    (T, "fsdp4xoffloadxoffload-params"),
    (T, "fsdp4xpp2xrecompute"),
    (T, "fsdp4xpp2xselective"),
    (T, "fsdp4xpp2xflash"),
    (D, "zero14xpp2xm4"),
    (D, "zero14xpp2x1f1b"),
    (D, "zero14xpp2xuneven"),
    (D, "zero14xoffload"),
    (D, "zero34xoffloadxoffload-params"),
    (D, "zero14xpp2xrecompute"),
    (D, "zero316xhpz"),
    (M, "tp2xdp2xpp2xsp"),
    (M, "dp2xpp2xm4"),
    (M, "dp2xpp2xv2"),
    (M, "dp2xpp2x1f1b"),
    (M, "dp2xpp2xuneven"),
    (M, "dp2xpp2xrecompute"),
    (M, "dp2xpp2xselective"),
    (M, "dp2xpp2xflash"),
    (T, "fsdp4xpp2xclip"),
    (D, "zero14xpp2xclip"),
    (D, "zero14xfp16"),
    (M, "tp2xdp2xpp2xspxclip"),
    (M, "dp2xpp2xper-token"),
    (M, "dp2xpp2xfp16"),
]
REFUSED = [  # (target, composition, what the one-line refusal names)
    (T, "fsdp4xoffload", "offload of only some states"),
    (T, "fsdp4xoffload-params", "offload of only some states"),
    (T, "fsdp4xsp", "sequence parallelism without tensor parallelism"),
    (D, "tp2xzero14xsp", "sequence parallelism"),
    (D, "zero14xpp2xv2", "interleaved or GPipe"),
    (D, "zero14xpp2xgpipe", "interleaved or GPipe"),
    (D, "zero14xoffload-params", "parameter offload below stage 3"),
    (D, "zero14xpp2xselective", "selective recomputation"),
    (D, "zero14xpp2xflash", "selective recomputation"),
    (M, "dp2xpp2xgpipe", "GPipe"),
    (M, "dp4xoffload", "offload"),
    (M, "dp4xoffload-params", "offload"),
    (M, "dp4xsp", "sequence parallelism without tensor parallelism"),
    (T, "fsdp4xpp2xzb", "ZB-H1"),
    (D, "zero14xpp2xzb", "zero-bubble"),
    (M, "dp2xpp2xzb", "zero-bubble"),
    (T, "fsdp16xhpz", "hierarchical partitioning"),
    (M, "zero316xhpz", "hierarchical partitioning"),
    (D, "zero216xhpz-dpr2", "hierarchical partitioning without ZeRO 3"),
    # DeepSpeed reads zero_hpz_partition_size 1 as no secondary partition: it came back as zero32
    (D, "zero31xhpz-dpr2", "hierarchical partitioning over nodes of one device"),
    (T, "fsdp4xper-token", "per token loss normalisation"),
    (D, "zero14xper-token", "per token loss normalisation"),
    (T, "fsdp4xbalance-loss", "load balancing loss"),
    (D, "zero14xglobal-balance-loss", "load balancing loss"),
]


def test_the_table_covers_every_modifier() -> None:
    from checker._parse import MODIFIERS

    spelled = {t for _, c in CARRIED + [(r[0], r[1]) for r in REFUSED] for t in c.split("x")}
    for modifier in MODIFIERS:
        word = modifier.split("<")[0]
        assert any(t == word or (word in ("m", "v") and t[:1] == word and t[1:].isdigit()) for t in spelled), modifier


@pytest.mark.parametrize(("target", "text"), CARRIED)
def test_every_modifier_the_target_can_say_survives_the_round_trip(target: Target, text: str) -> None:
    back = _round_trip(text, target, DENSE)
    assert _meaning(back, DENSE) == _meaning(text, DENSE), back


@pytest.mark.parametrize(("target", "text", "why"), REFUSED)
def test_every_modifier_the_target_cannot_say_is_refused_by_name(target: Target, text: str, why: str) -> None:
    with pytest.raises(ExportError, match=why) as err:
        export(parse(text), DENSE, target)
    assert "\n" not in str(err.value)


# --- uneven pipeline stages: each framework is told the split the composition charges -------


def _torchtitan_split(num_stages: int, num_layers: int, input_weight: int, output_weight: int) -> list[int]:
    """Transformer layers per stage as torchtitan's ``generate_llm_fqn_per_model_part``
    (torchtitan/distributed/pipeline_parallel.py) assigns them: the embedding and the output
    layer count ``input_weight`` and ``output_weight`` layers, the total is split evenly and the
    first ``total % num_stages`` stages take one more."""
    total = num_layers + input_weight + output_weight
    each = [total // num_stages + (1 if s < total % num_stages else 0) for s in range(num_stages)]
    each[0] -= input_weight
    each[-1] -= output_weight
    return each


def test_torchtitan_is_told_to_split_the_transformer_layers_alone() -> None:
    # torchtitan's defaults (1, 1) would put 9 of llama2-7b's 32 layers on one of 4 stages
    assert max(_torchtitan_split(4, 32, 1, 1)) == 9
    for text, model, fullest in (
        ("fsdp2xpp4", DENSE, 8),
        ("fsdp2xpp4xuneven", LLAMA3_405B, 32),
        ("fsdp2xpp16xuneven", LLAMA3_405B, 8),
    ):
        par = tomllib.loads(export(parse(text), model, T).text)["parallelism"]
        weights = (par["pipeline_parallel_first_stage_less_layers"], par["pipeline_parallel_last_stage_less_layers"])
        assert isinstance(model, Transformer)
        split = _torchtitan_split(par["pipeline_parallel_degree"], model.layers, *weights)
        assert sum(split) == model.layers and max(split) == fullest, split
        assert fullest * model.layers == parse(text).placement(model).stage_layers(model.layers) * model.layers


def test_megatron_splits_llama3_405b_like_the_llama3_paper() -> None:
    """Llama 3 (Dubey et al. 2024, section 3.3.2): 126 layers on 16 stages, one layer fewer on
    the first and on the last stage."""
    args = export(parse("tp8xdp2xpp16xuneven"), LLAMA3_405B, M).text
    assert "--decoder-first-pipeline-num-layers 7" in args and "--decoder-last-pipeline-num-layers 7" in args
    assert "--decoder-first" not in export(parse("tp8xdp2xpp16xuneven"), DENSE, M).text  # 32 layers divide


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 64), st.integers(1, 256))
def test_megatron_uneven_split_is_valid_or_refused(pp: int, layers: int) -> None:
    """Megatron-LM splits the layers left by the first and last stage evenly over the others; the
    split must hold every layer, at least one per stage, at most ceil(L/pp) on any."""
    fullest = -(-layers // pp)
    try:
        first, last = megatron_uneven_split(layers, pp)
    except ExportError:
        if layers < pp:
            return
        # refused only when no (first, middle, last) split reaches the fullest-stage bound
        for middle in range(1, fullest + 1):
            for f in range(1, fullest + 1):
                rest = layers - middle * (pp - 2) - f
                assert not (pp > 2 and 1 <= rest <= fullest and fullest in (middle, f, rest)), (middle, f, rest)
        return
    middle_total = layers - first - last
    assert 1 <= first <= fullest and 1 <= last <= fullest
    if pp > 2:
        assert middle_total % (pp - 2) == 0 and 1 <= middle_total // (pp - 2) <= fullest
    else:
        assert middle_total == 0
    assert fullest in (first, last, middle_total // max(pp - 2, 1))


def test_uneven_stages_megatron_cannot_split_are_refused_by_name() -> None:
    with pytest.raises(ExportError, match="interleaved"):
        export(parse("dp2xpp4xv2xuneven"), LLAMA3_405B, M)
    with pytest.raises(ExportError, match="first/last-stage"):
        megatron_uneven_split(19, 16)  # three stages of 2 layers, the other 13 of 1


def test_deepspeed_names_the_split_it_cannot_write() -> None:
    out = export(parse("zero14xpp4xuneven"), LLAMA3_405B, D)
    assert "pipeline" in json.loads(out.text)
    assert any("uneven" in note and "32" in note for note in out.notes)  # ceil(126 / 4)


@pytest.mark.parametrize(("target", "text"), [(T, "fsdp2xpp4xuneven"), (M, "dp2xpp4xuneven")])
def test_uneven_stages_survive_the_round_trip(target: Target, text: str) -> None:
    back = _round_trip(text, target, LLAMA3_405B)
    assert _meaning(back, LLAMA3_405B) == _meaning(text, LLAMA3_405B), back


# --- the model's own flags ------------------------------------------------------------------


@st.composite
def megatron_models(draw: st.DrawFn) -> Transformer:
    """Transformers whose every architectural choice Megatron-LM has an argument for (it always
    adds a final norm): FFN kind and width, norm, grouped-query attention, a decoupled head
    width, positions, tied embeddings, biases (also on Q, K and V alone), QK norms, experts, dropout."""
    base = draw(transformers())
    experts = draw(st.sampled_from([0, 0, 2, 4]))
    return replace(
        base,
        final_norm=True,
        head_size=draw(st.none() | st.sampled_from([8, 16, 24])),
        qkv_bias=draw(st.booleans()) and not base.bias,
        qk_norm=draw(st.booleans()),
        dropout=draw(st.booleans()),
        experts=experts,
        top_k=draw(st.integers(1, experts)) if experts else 0,
    )


def _architecture(t: Transformer) -> tuple[object, ...]:
    """What decides a model's sizes, with every default spelled out (its name and source aside)."""
    return (
        t.layers,
        t.hidden,
        t.heads,
        t.kv_heads_,
        t.head_dim,
        t.ffn_,
        t.ffn_kind,
        t.norm,
        t.bias,
        t.qkv_bias or t.bias,
        t.qk_norm,
        t.learned_positions,
        t.tied_embeddings,
        t.experts,
        t.top_k,
        t.vocab,
        t.seq,
        t.dropout,
    )


def _megatron_model_back(text: str, model: Transformer) -> tuple[Transformer, str]:
    """Export ``text`` on ``model`` to Megatron-LM's arguments, import them without ``--model``:
    the model the arguments describe, and the composition."""
    comp = parse(text)
    imported = import_megatron(megatron_tokens(export(comp, model, Target.MEGATRON).text), devices=comp.devices)
    back = imported.transformer if imported.transformer is not None else PRESETS[imported.model or ""]
    assert isinstance(back, Transformer)
    return back, imported.text


@settings(max_examples=60, deadline=None)
@given(megatron_models(), st.sampled_from(["dp2", "distoptx2", "dp2xpp1"]))
def test_megatron_export_carries_the_model(model: Transformer, text: str) -> None:
    """SwiGLU, RMSNorm, GQA, head width, biases, experts, dropout and the sequence length survive
    export and import: the same architecture and parameter count, without naming a preset."""
    back, _ = _megatron_model_back(text.replace("distoptx2", "distopt2"), model)
    assert _architecture(back) == _architecture(model)
    assert back.parameter_count() == model.parameter_count()


@pytest.mark.parametrize("name", ["llama2-70b", "llama3-8b", "mixtral-8x7b", "gpt3-175b"])
def test_megatron_export_of_a_preset_imports_as_that_preset(name: str) -> None:
    model = PRESETS[name]
    assert isinstance(model, Transformer)
    comp = "tp2xdp2"
    back, composition = _megatron_model_back(comp, model)
    assert _architecture(back) == _architecture(model)
    assert composition == comp


def test_megatron_export_states_swiglu_rmsnorm_and_gqa() -> None:
    """Llama 2 70B (Touvron et al. 2023, table 1 and section 2.2: SwiGLU, RMSNorm, GQA with 8 KV
    heads of 64, rotary positions, 32,000 tokens) in Megatron-LM's own argument names."""
    out = export(parse("tp8xdp2"), PRESETS["llama2-70b"], Target.MEGATRON).text
    args = megatron_tokens(out)
    for flag in (
        "--swiglu",
        "--group-query-attention",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
    ):
        assert flag in args, flag
    pairs = dict(itertools.pairwise(args))
    assert pairs["--normalization"] == "RMSNorm"
    assert pairs["--num-query-groups"] == "8"
    assert pairs["--position-embedding-type"] == "rope"
    assert pairs["--ffn-hidden-size"] == "28672"
    assert pairs["--vocab-size"] == "32000"


def test_a_vocabulary_tp_does_not_split_is_refused() -> None:
    base = PRESETS["llama2-7b"]
    assert isinstance(base, Transformer)
    odd = replace(base, vocab=32001)
    with pytest.raises(ExportError, match="32,001 tokens does not split over tp"):
        export(parse("tp2xdp2"), odd, Target.MEGATRON)
    assert "--make-vocab-size-divisible-by 1" in export(parse("dp2"), odd, Target.MEGATRON).text


@pytest.mark.parametrize(("target", "text"), [(Target.MEGATRON, "tp2xdp4xsp"), (Target.TORCHTITAN, "tp2xfsdp4xsp")])
def test_the_sequence_length_comes_from_the_model_or_seq(target: Target, text: str) -> None:
    """``--seq`` (or the model's own length) is what the exported config trains on and what the
    importer reads back, not the default model's 4,096."""
    base = PRESETS["llama3-8b"]
    assert isinstance(base, Transformer)
    model = replace(base, seq=8192)
    comp = parse(text)
    out = export(comp, model, target).text
    if target is Target.MEGATRON:
        imported = import_megatron(megatron_tokens(out), devices=comp.devices, model=model)
    else:
        imported = import_torchtitan(tomllib.loads(out), devices=comp.devices, model=model)
    assert imported.seq == 8192
    command = ["export", text, "--to", target.value, "--model", "llama3-8b", "--seq", "16384"]
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 0, result.output
    assert ("--seq-length 16384" if target is Target.MEGATRON else "seq_len = 16384") in result.output
