"""Engine effects (``formal._engine_effects``): each named term against an independent count
from the model's own sizes, the CLI printing the same terms, and the placement's figure kept.

Expected bytes are computed here from the architecture (vocabulary, hidden size, layers) and the
engine behaviour each term names, not read back from the module.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import compositions, models

from checker._analysis import analyze
from checker._parse import parse
from checker.cli import main
from formal._costs import ceil_int
from formal._engine_effects import Engine, default_engine
from formal._model import PRECISIONS, Norm, Transformer
from formal._presets import PRESETS


def _preset(name: str) -> Transformer:
    model = PRESETS[name]
    assert isinstance(model, Transformer)
    return model


LLAMA = _preset("llama2-7b")
MIXED = PRECISIONS["zero"]  # the CLI's default: 2 + 2 + 12 bytes per parameter (ZeRO paper)


def terms(text: str, model: Transformer, engine: Engine, devices: int | None = None) -> dict[str, int]:
    a = analyze(parse(text, devices=devices), model, MIXED, engine=engine)
    assert a.engine is not None
    return {t.key: t.bytes for t in a.engine.terms}


def test_fsdp2_root_module_is_the_embedding_head_and_final_norm_unsharded() -> None:
    """FSDP2's root (``reshard_after_forward=False``) holds its whole parameters: the embedding
    and head (V x h each, untied) and the final RMSNorm (h), at the parameters' width."""
    got = terms("fsdp8", LLAMA, Engine.FSDP2)
    root = 2 * LLAMA.vocab * LLAMA.hidden + LLAMA.hidden * (2 if LLAMA.norm is Norm.LAYERNORM else 1)
    assert not LLAMA.tied_embeddings
    assert got["fsdp_root_unsharded"] == root * MIXED.parameters


def test_fsdp2_gathers_one_block_and_prefetches_the_next() -> None:
    """A block's parameters (one layer of the transformer) gathered, twice at the first block's
    backward (computing and prefetched), its gradient unsharded before the reduce-scatter."""
    got = terms("fsdp8", LLAMA, Engine.FSDP2)
    root = 2 * LLAMA.vocab * LLAMA.hidden + LLAMA.hidden
    block = (LLAMA.parameter_count() - root) // LLAMA.layers
    assert got["fsdp_blocks_gathered"] == 2 * block * MIXED.parameters
    assert got["fsdp_block_gradient"] == block * MIXED.gradient_wire


def test_ddp_keeps_a_second_copy_of_every_gradient() -> None:
    got = terms("dp8", LLAMA, Engine.DDP)
    assert got["ddp_bucket_copy"] == LLAMA.parameter_count() * MIXED.gradients


def test_cross_entropy_backward_holds_three_logit_sized_fp32_tensors() -> None:
    """log-softmax backward: the gradient of the log-probabilities, the probabilities and the
    logits' gradient, each s x b x V fp32, split by tp along the vocabulary."""
    logits = LLAMA.seq * LLAMA.micro_batch * LLAMA.vocab * 4
    assert terms("fsdp8", LLAMA, Engine.FSDP2)["loss_backward_temporaries"] == 3 * logits
    tp = terms("tp8", LLAMA, Engine.FSDP2)
    assert tp["loss_backward_temporaries"] == 3 * logits // 8
    assert tp["tp_loss_keeps_logits"] == logits // 8


def test_pipelining_keeps_outputs_and_receive_buffers() -> None:
    """GPipe's last stage holds every micro-batch's logits until its backward; 1F1B's last stage
    runs one micro-batch at a time but has a receive buffer (s x b x h) for each of the m."""
    m = 16
    logits = LLAMA.seq * LLAMA.micro_batch * LLAMA.vocab * 4
    hidden = LLAMA.seq * LLAMA.micro_batch * LLAMA.hidden * MIXED.activations
    a = analyze(parse(f"pp8xm{m}xgpipe", devices=8), LLAMA, MIXED, engine=Engine.FSDP2)
    assert a.engine is not None and a.engine.stage == "last"
    got = {t.key: t.bytes for t in a.engine.terms}
    assert got["pipeline_keeps_outputs"] == (m - 1) * logits
    from formal._costs import memory
    from formal._engine_effects import engine_prediction
    from formal._program import group_sizes
    from formal._vocab import Stage

    pl = parse(f"pp8xm{m}", devices=8).placement(LLAMA)
    last = engine_prediction(
        pl, LLAMA, MIXED, memory(pl, LLAMA, MIXED, group_sizes(LLAMA), Stage.LAST), Engine.FSDP2, Stage.LAST
    )
    got = {t.key: t.bytes for t in last.terms}
    assert got["pipeline_receive_buffers"] == (m - 1) * hidden  # 1F1B: one micro-batch in flight on the last stage
    assert "pipeline_keeps_outputs" not in got


def test_engines_without_modelled_effects_keep_the_placement_figure() -> None:
    # DeepSpeed's terms: tests/test_deepspeed.py; on fsdp8 (no ZeRO stage by its name, but its
    # placement is ZeRO-3's) DeepSpeed adds them too, so only Megatron-LM is left unmodelled.
    for engine in (Engine.MEGATRON,):
        a = analyze(parse("fsdp8", devices=8), LLAMA, MIXED, engine=engine)
        assert a.engine is not None and not a.engine.modelled
        # only what every engine keeps: the int64 token ids and targets (8 bytes a token each)
        assert {t.key: t.bytes for t in a.engine.terms} == {
            "input_ids": 8 * LLAMA.seq * LLAMA.micro_batch,
            "target_ids": 8 * LLAMA.seq * LLAMA.micro_batch,
        }
        assert a.peak == ceil_int(a.memory.total) + 16 * LLAMA.seq * LLAMA.micro_batch


def test_default_engine_by_composition() -> None:
    assert default_engine(("fsdp",)) is Engine.FSDP2
    assert default_engine(("hsdp", "dpr")) is Engine.FSDP2
    assert default_engine(("dp",)) is Engine.DDP
    assert default_engine(("tp", "zero3", "pp")) is Engine.DEEPSPEED
    assert default_engine(("tp", "pp")) is Engine.MEGATRON


@settings(max_examples=25, deadline=None)
@given(models(), st.data(), st.sampled_from(list(Engine)))
def test_peak_is_the_largest_moment_and_fits_reads_it(model: Transformer, data: st.DataObject, engine: Engine) -> None:
    comp = data.draw(compositions(model))
    a = analyze(comp, model, MIXED, device_memory=10**9, engine=engine)
    assert a.engine is not None
    e = a.engine
    assert e.total == max(e.moments.values())
    assert a.fits == (a.peak <= 10**9)
    assert all(t.bytes != 0 for t in e.terms)
    if not e.modelled:  # the placement's figure and the token ids only
        assert e.total == ceil_int(a.memory.total) + sum(t.bytes for t in e.terms)
        assert {t.key for t in e.terms} <= {"input_ids", "target_ids"}


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(main, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stdout


def test_cli_prints_each_term_on_its_own_line_and_the_placement_figure() -> None:
    code, out = cli("check", "fsdp8", "--devices", "8")
    assert code == 0
    root = (2 * LLAMA.vocab * LLAMA.hidden + LLAMA.hidden) * MIXED.parameters
    assert f"FSDP2 root module unsharded: {root / 1e9:.1f} GB" in out
    assert "placement only (the paper's number)" in out
    assert out.splitlines()[3].startswith("engine   fsdp2: +")
    assert all(len(line) <= 80 for line in out.splitlines())


def test_cli_json_peak_is_the_engine_total_and_megatron_keeps_the_placement() -> None:
    doc = json.loads(cli("check", "fsdp8", "--devices", "8", "--json")[1])
    mem = doc["memory"]
    assert mem["engine"]["engine"] == "fsdp2" and mem["peak"] == mem["engine"]["total"]
    assert mem["engine"]["placement_total"] == mem["per_device"]["total"] < mem["peak"]
    root = next(t for t in mem["engine"]["terms"] if t["name"] == "fsdp_root_unsharded")
    assert root["bytes"] == (2 * LLAMA.vocab * LLAMA.hidden + LLAMA.hidden) * MIXED.parameters
    plain = json.loads(cli("check", "fsdp8", "--devices", "8", "--engine", "megatron", "--json")[1])
    ids = 2 * 8 * LLAMA.seq * LLAMA.micro_batch  # token ids and targets, int64
    assert plain["memory"]["peak"] == plain["memory"]["per_device"]["total"] + ids


def test_validate_refuses_an_engine_the_harness_does_not_run() -> None:
    code, _ = cli("check", "fsdp8", "--devices", "8", "--engine", "megatron", "--validate", "torch")
    assert code == 2


def test_a_failed_validation_exits_6(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--validate torch``: a measurement outside the prediction's tolerance is exit code 6, a
    match 0 (the harness itself replaced: this checks how its answer reaches the exit code)."""
    import checker._torch_validate as tv

    mp = monkeypatch
    for ok, expected in ((False, 6), (True, 0)):
        mp.setattr(tv, "cli_validation", lambda comp, ok=ok: ({"ok": ok}, f"validated: {ok}"))
        code, out = cli("check", "fsdp8", "--devices", "8", "--validate", "torch")
        assert code == expected and f"validated: {ok}" in out


def test_zero1_on_ddp_partitions_whole_tensors() -> None:
    """ZeroRedundancyOptimizer assigns each tensor whole to one rank, largest first: the ranks'
    loads add up to the model, the embedding (the largest tensor, V x h) sits on rank 0 alone
    at first, and the most-loaded rank holds at least an even share."""
    from formal._engine_effects import whole_tensor_owners, zero1_axis
    from formal._tensors import parameter_tensors

    gpt = PRESETS["gpt3-1.3b"]
    assert isinstance(gpt, Transformer)
    pl = parse("zero18", devices=8).placement(gpt)
    axis = zero1_axis(pl)
    assert axis is not None
    owners = whole_tensor_owners(pl, gpt, axis)
    tensors = parameter_tensors(gpt)
    loads = [sum(t.elements for t, r in zip(tensors, owners, strict=True) if r == k) for k in range(8)]
    assert sum(loads) == gpt.parameter_count()
    assert owners[0] == 0 and tensors[0].name == "embed.weight"
    a = analyze(parse("zero18", devices=8), gpt, MIXED, engine=Engine.DDP)
    assert a.engine is not None
    term = next(t for t in a.engine.terms if t.key == "zero_redundancy_whole_tensors")
    even = -(-gpt.parameter_count() * MIXED.optimizer // 8)
    assert term.bytes == max(loads) * MIXED.optimizer - even >= 0


def test_html_report_shows_the_engine_terms_and_the_peak() -> None:
    from checker._html import render_html
    from checker._report import to_json

    a = analyze(parse("fsdp8", devices=8), LLAMA, MIXED, engine=Engine.FSDP2)
    page = render_html(to_json(a))
    assert "FSDP2 root module unsharded (fsdp2)" in page
    assert f"{a.peak:,}" in page and "peak with fsdp2" in page


def test_compare_shows_the_peak_beside_the_placement_total() -> None:
    code, out = cli("compare", "fsdp8", "dp8", "--devices", "8", "--json")
    assert code == 0
    rows = {r["composition"]: r for r in json.loads(out)}
    assert rows["fsdp8"]["engine"] == "fsdp2" and rows["dp8"]["engine"] == "ddp"
    # DDP's bucket copy: the peak holds every gradient twice (2 bytes each in the default recipe)
    extra = rows["dp8"]["peak_bytes"] - rows["dp8"]["total_bytes"]
    assert extra >= LLAMA.parameter_count() * MIXED.gradients
    plain = json.loads(cli("compare", "dp8", "--devices", "8", "--engine", "megatron", "--json")[1])
    ids = 2 * 8 * LLAMA.seq * LLAMA.micro_batch
    assert plain[0]["peak_bytes"] == plain[0]["total_bytes"] + ids


# A GPT model as Korthikanti et al. 2022 count it (FFN 4h, dropout, multi-head attention).
GPT = Transformer(
    "gpt-test", layers=8, hidden=1024, heads=16, vocab=32000, seq=2048, micro_batch=2, learned_positions=False
)


def test_recomputation_holds_one_layer_recomputed_in_its_backward() -> None:
    """``torch.utils.checkpoint`` keeps what the recomputed forward saves until the region's
    backward: Korthikanti's whole layer, ``sbh(34 + 5as/h)`` bytes at 16 bits, under full
    recomputation; the attention core, ``5as^2b``, under selective; split by tp."""
    s, b, h, a = GPT.seq, GPT.micro_batch, GPT.hidden, GPT.heads
    layer, core = 34 * s * b * h + 5 * a * s * s * b, 5 * a * s * s * b
    assert terms("fsdp8xrecompute", GPT, Engine.FSDP2)["recompute_working_set"] == layer
    assert terms("fsdp8xselective", GPT, Engine.FSDP2)["recompute_working_set"] == core
    assert terms("tp8xspxselective", GPT, Engine.FSDP2)["recompute_working_set"] == core // 8
    assert "recompute_working_set" not in terms("fsdp8", GPT, Engine.FSDP2)


def test_fsdp2_second_block_holds_the_first_blocks_reduce_scatter_input() -> None:
    """At the second block's backward the first block's gradient (reduce-scatter input, one
    block's elements at the gradient's wire width) is still held and the first block's saved
    activations are freed: its checkpoint, ``2sbh``, under full recomputation. With a layer's
    small checkpoint that moment holds more than the first block's backward."""
    s, b, h = GPT.seq, GPT.micro_batch, GPT.hidden
    block = 12 * h * h + 13 * h  # QKV, projection, two FFN matrices, their biases, two LayerNorms
    a = analyze(parse("fsdp8xrecompute"), GPT, MIXED, engine=Engine.FSDP2)
    assert a.engine is not None
    got = {t.key: t.bytes for t in a.engine.terms}
    assert got["fsdp_reduce_scatter_held"] == block * MIXED.gradient_wire
    assert got["first_block_freed"] == -2 * s * b * h
    moments = a.engine.moments
    assert moments["second_block"] == moments["backward"] + block * MIXED.gradient_wire - 2 * s * b * h
    # without recomputation the first block's backward holds more (a whole layer is freed)
    plain = analyze(parse("fsdp8"), GPT, MIXED, engine=Engine.FSDP2).engine
    assert plain is not None and plain.moments["second_block"] < plain.moments["backward"]


def test_softmax_backward_holds_two_score_sized_gradients_unless_attention_is_fused() -> None:
    """``aten::_softmax_backward_data`` reads the probabilities' gradient and writes the scores':
    two ``a s^2 b`` tensors at the activation width in a block's backward, split by tp; none
    where the attention is one fused kernel (``flash``), which never materialises the scores."""
    s, b, a = GPT.seq, GPT.micro_batch, GPT.heads
    scores = a * s * s * b * MIXED.activations
    assert terms("fsdp8", GPT, Engine.FSDP2)["attention_backward_temporaries"] == 2 * scores
    assert terms("tp8", GPT, Engine.FSDP2)["attention_backward_temporaries"] == 2 * scores // 8
    flash = terms("fsdp8xflash", GPT, Engine.FSDP2)
    assert "attention_backward_temporaries" not in flash and "recompute_working_set" not in flash


def test_pipelining_with_fsdp2_holds_the_stage_gradients_unsharded() -> None:
    """``torch.distributed.pipelining`` turns FSDP2's gradient synchronisation off for every
    micro-batch and reduce-scatters once after the last: a stage's whole gradients (its layers,
    and the embedding on the first stage) are held through the step, not one block's."""
    h, v = GPT.hidden, GPT.vocab
    block = 12 * h * h + 13 * h
    a = analyze(parse("pp4xfsdp2xm8"), GPT, MIXED, engine=Engine.FSDP2)
    assert a.engine is not None
    got = {t.key: t.bytes for t in a.engine.terms}
    layers = GPT.layers // 4
    assert got["pipeline_fsdp_unsharded_gradients"] == (layers * block + v * h) * MIXED.gradient_wire
    assert "fsdp_block_gradient" not in got and "fsdp_reduce_scatter_held" not in got


def test_sequence_parallel_saves_each_column_parallel_modules_gathered_input() -> None:
    """DTensor's ``ColwiseParallel(input_layouts=Shard(1))`` saves the gathered input of each
    module: GPT's QKV and FC1 (two, where the placement counts two sequence shards), a Llama
    layer's q, k, v and gate, up (five), and the head's input once."""
    full = 2 * LLAMA.seq * LLAMA.micro_batch * LLAMA.hidden  # one layer input at 2 bytes
    shard = full // 8
    per_layer = 5 * full - 2 * shard
    got = terms("tp8xsp", LLAMA, Engine.FSDP2)["sp_saves_gathered_inputs"]
    assert got == LLAMA.layers * per_layer + (full - shard)
    gpt_full = 2 * GPT.seq * GPT.micro_batch * GPT.hidden
    gpt = terms("tp8xsp", GPT, Engine.FSDP2)["sp_saves_gathered_inputs"]
    assert gpt == (GPT.layers * 2 + 1) * (gpt_full - gpt_full // 8)
