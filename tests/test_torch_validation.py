"""Predicted against measured on PyTorch's own engines (fake process group, world size 8).

CI installs the torch extra, so these run there; without torch they are skipped, with a reason.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from checker._parse import parse
from checker._torch._compare import ACTIVATION_TOLERANCE, PEAK, PEAK_TOLERANCE, Comparison
from checker._torch._net import NetConfig
from checker._torch._predict import Implementation, parameter_tensors, predict
from checker._torch_validate import FSDP1_RUNS, TABLE_COMPOSITIONS, TABLE_RUNS, validate
from formal._program import derive_program
from formal._vocab import OpKind

_CACHE: dict[tuple[str, int], Comparison] = {}


def compared(text: str, rank: int = 0) -> Comparison:
    if (text, rank) not in _CACHE:
        _CACHE[(text, rank)] = validate(text, rank=rank)
    return _CACHE[(text, rank)]


def test_the_table_covers_every_strategy_on_its_first_and_last_rank() -> None:
    for text in TABLE_COMPOSITIONS:
        ranks = {r for t, r in TABLE_RUNS if t == text}
        assert {0, parse(text).devices - 1} <= ranks, text
    assert {r for t, r in TABLE_RUNS if t == "pp8xm16"} == {0, 3, 7}  # first, middle, last stage


@pytest.mark.parametrize(("text", "rank"), TABLE_RUNS)
def test_model_states_per_rank_are_predicted_exactly(text: str, rank: int) -> None:
    c = compared(text, rank)
    for row in c.rows:
        if row.quantity != "activations":
            assert row.predicted == row.measured, (text, rank, row)


@pytest.mark.parametrize(("text", "rank"), TABLE_RUNS)
def test_collective_list_is_predicted_exactly(text: str, rank: int) -> None:
    c = compared(text, rank)
    assert Counter(c.predicted_calls) == Counter(c.measured_calls), (text, rank)
    assert c.measured_calls, f"{text} rank {rank}: nothing recorded"


@pytest.mark.parametrize(("text", "rank"), TABLE_RUNS)
def test_activations_within_tolerance(text: str, rank: int) -> None:
    act = compared(text, rank).row("activations")
    assert abs(act.error) <= ACTIVATION_TOLERANCE, (text, rank, act)


@pytest.mark.parametrize(("text", "rank"), FSDP1_RUNS)
def test_fsdp1_shard_grad_op_is_predicted_as_fsdp_sgo(text: str, rank: int) -> None:
    """ZeRO-2 on FSDP1: ``FullyShardedDataParallel`` with ``SHARD_GRAD_OP`` (one FlatParameter
    per block and one for the root) holds what the fsdp-sgo prediction says: the model states
    exactly, the same collectives (no backward all-gather: parameters kept from the forward),
    the activations within tolerance, and the per-device peak the CLI prints within 3% of
    ``MemTracker``'s peak total (FSDP1 keeps every block unsharded through the backward, as
    FSDP2 does with ``reshard_after_forward=False``)."""
    c = validate(text, rank=rank, fsdp1=True)
    assert c.engine == "FSDP1 SHARD_GRAD_OP"
    assert c.model_states_exact and c.calls_equal and c.activations_within, c.rows
    assert abs(c.row(PEAK).error) <= PEAK_TOLERANCE, c.row(PEAK)
    assert c.ok


def test_fsdp1_runs_only_what_it_implements_here() -> None:
    from checker._torch._engine import Runner
    from formal.errors import CompositionError

    with pytest.raises(CompositionError, match="FSDP1 runs fsdp-sgo alone"):
        Runner(parse("fsdp8"), NetConfig(), 0, 8, fake=True, fsdp1=True)


def test_the_last_stage_holds_the_output_layer() -> None:
    """Korthikanti et al. 2022, 4.3: the last stage keeps the final norm's and the head's inputs
    and the loss's logits; 1F1B's last stage runs one micro-batch at a time, GPipe's all m."""
    model = NetConfig().formal()
    per_micro_batch_layers = (
        compared("pp8xm16", 3).row("activations").predicted // 8
    )  # a middle stage: 8 micro-batches of its one layer
    last = compared("pp8xm16", 7).row("activations")
    assert last.predicted > per_micro_batch_layers  # the output layer is counted, once
    logits = model.seq * model.micro_batch * model.vocab * 4
    assert last.measured >= per_micro_batch_layers + logits  # PyTorch keeps fp32 log-probabilities
    assert abs(last.error) <= ACTIVATION_TOLERANCE


def test_each_named_effect_is_needed() -> None:
    """Switching an implementation effect off breaks the match it explains (no dead options)."""
    model = NetConfig().formal()
    cases = [
        ("fsdp8", Implementation(fsdp_root_unsharded=False), "calls"),
        ("ddp8", Implementation(ddp_bucket_copy=False), "gradients"),
        ("ddp8", Implementation(ddp_first_bucket_bytes=25 * 2**20), "calls"),
        ("tp8", Implementation(tp_embedding_full_gradient=False), "gradients"),
        ("tp8xsp", Implementation(tp_row_bias_before_reduction=False), "calls"),
    ]
    for text, impl, what in cases:
        c = compared(text)
        p = predict(parse(text, devices=8), model, impl)
        if what == "calls":
            assert Counter(p.calls) != Counter(c.measured_calls), (text, impl)
        else:
            assert p.gradients != c.row("gradients").measured, (text, impl)


def test_the_loss_statistics_are_the_programs_logits_exchange() -> None:
    """``loss_parallel`` all-reduces three fp32 values per token over the vocabulary shards
    (torch/distributed/tensor/parallel/loss.py: the maximum, the sum of exponentials, the
    target's logit), as Megatron-LM's ``_VocabParallelCrossEntropy`` does: 3 m calls of b s x 4
    bytes on a tp rank, measured. The prediction has them from the step program's
    ``all_reduce(A.logits, tp)`` op, not from an engine term."""
    model = NetConfig().formal()
    tokens = model.micro_batch * model.seq * 4
    for text in ("tp8",):  # (under sp the row-parallel biases' gradients are b s x 4 bytes too)
        pl = parse(text, devices=8).placement(model)
        loss = [x for x in compared(text).measured_calls if getattr(x, "kind", None) is OpKind.ALL_REDUCE]
        loss = [x for x in loss if getattr(x, "bytes", None) == tokens]
        assert len(loss) == 3 * pl.options.micro_batches, text
        program = [op for op in derive_program(pl, model).ops if op.group.name == "logits"]
        assert [(op.kind, int(op.elements) * 4, int(op.count)) for op in program] == [
            (OpKind.ALL_REDUCE, tokens, len(loss))
        ], text


def test_gpipe_holds_every_micro_batch_and_1f1b_the_pipeline_depth() -> None:
    gpipe, one = compared("pp8xm16xgpipe").row("activations"), compared("pp8xm16").row("activations")
    assert gpipe.measured > 1.9 * one.measured  # 16 against min(p, m) = 8 micro-batches in flight
    assert gpipe.predicted == 2 * one.predicted


def test_fsdp_traffic_is_one_and_a_half_ddp() -> None:
    """pytorch-ground-truth.md: full shard gathers twice and reduce-scatters once (3 Psi in
    ZeRO units, minus the root kept unsharded), DDP all-reduces once (2 Psi)."""

    def volume(text: str) -> dict[OpKind, int]:
        out: dict[OpKind, int] = {}
        for call in compared(text).measured_calls:
            out[call.kind] = out.get(call.kind, 0) + call.bytes  # type: ignore[attr-defined]
        return out

    ddp, fsdp = volume("ddp8"), volume("fsdp8")
    params = sum(t.elements for t in parameter_tensors(NetConfig().formal())) * 4
    assert ddp == {OpKind.ALL_REDUCE: params}
    assert fsdp[OpKind.REDUCE_SCATTER] == params
    assert params < fsdp[OpKind.ALL_GATHER] < 2 * params


@pytest.mark.parametrize("text", ["dp8", "fsdp8", "tp8xsp", "tp2xfsdp4", "hsdp4xdpr2"])
def test_the_cli_prints_the_numbers_the_validator_checks(text: str) -> None:
    """``check --engine`` on the harness's model and precision: the same engine terms and peak
    as the validator's prediction (one home for the effects: ``formal._engine_effects``)."""
    from checker._analysis import analyze
    from checker._command import Request, for_validation
    from checker._torch._predict import harness_precision
    from formal._model import PRECISIONS

    comp = parse(text, devices=8)
    model = NetConfig().formal()
    req = for_validation(Request(comp, model, PRECISIONS["zero"], None, 8), None)
    assert req.engine is not None
    a = analyze(comp, model, harness_precision(), engine=req.engine)
    p = predict(comp, model)
    assert a.engine == p.engine and a.peak == p.peak


def test_tensor_layout_adds_up_to_the_formal_groups() -> None:
    model = NetConfig().formal()
    assert sum(t.elements for t in parameter_tensors(model)) == model.parameter_count()


def test_cli_prints_predicted_and_measured(capsys: pytest.CaptureFixture[str]) -> None:
    from click.testing import CliRunner

    from checker.cli import main

    result = CliRunner().invoke(main, ["check", "hsdp4xdpr2", "--validate", "torch", "--json"])
    assert result.exit_code == 0, result.output
    import json

    doc = json.loads(result.output)
    v = doc["validation"]
    assert v["model_states_exact"] and v["collectives"]["equal"]
    assert v["bytes"]["parameters"]["predicted"] == v["bytes"]["parameters"]["measured"]


def test_cli_rejects_a_composition_without_an_engine() -> None:
    from click.testing import CliRunner

    from checker.cli import main

    result = CliRunner().invoke(main, ["check", "tp2xzero3xpp4", "--validate", "torch"])
    assert result.exit_code == 2
    assert "no PyTorch engine" in result.output
