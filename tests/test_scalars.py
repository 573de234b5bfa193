"""The scalars around the gradients (formal/_scalars.py): the loss normaliser, the global norm, the
clip and the fp16 overflow decision.

* The derived scalar programs of library compositions are proved, and the scalar reference
  (formal/_sim_scalars.py) agrees with single-device training on them.
* Differential: over mutated scalar programs (axes dropped from a reduction, duplicates no
  longer filtered, a group left out, the count not summed over micro-batches, the loss not
  compensated, the clip before the norm), z3 proves the scalar obligations iff the reference
  matches on three seeds.
* Witnesses a person can read, with their numbers re-derived here from the witness's own data.
"""

from __future__ import annotations

import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import compositions, models

from checker._importers import load_config
from checker._parse import parse
from checker._toml import load, loads
from formal._model import Transformer
from formal._presets import PRESETS
from formal._program import StepProgram, derive_program
from formal._scalars import ScalarKind, ScalarOp
from formal._sim_scalars import simulate_scalars
from formal._smt import decide
from formal._smt_scalars import decide_scalars
from formal._strategies import Composition
from formal._verdict import Status
from formal._vocab import Axis, Group, State

SCALARS = "xclipxfp16xper-token"


def _program(text: str, model: Transformer | None = None, toml: str | None = None) -> StepProgram:
    model = model or _tiny()
    file = loads(toml) if toml is not None else None
    c = parse(text, file.factories() if file else None)
    pl = c.placement(model)
    return file.program_for(pl, model) if file else derive_program(pl, model)


def _tiny() -> Transformer:
    return Transformer("tiny", layers=8, hidden=512, heads=8, vocab=1024, seq=256, bias=True, tied_embeddings=True)


def _proved(program: StepProgram) -> bool:
    obligations, violations = decide_scalars(program, 10_000)
    assert all(o.status is not Status.UNKNOWN for o in obligations)
    return not violations and all(o.status is Status.PROVED for o in obligations)


def _matches(program: StepProgram) -> bool:
    return all(simulate_scalars(program, seed) is None for seed in range(3))


@st.composite
def scalar_compositions(draw: st.DrawFn) -> tuple[Composition, Transformer]:
    """Library compositions with clipping, per-token loss and fp16 loss scaling."""
    model = draw(models())
    c = draw(compositions(model))
    balance = draw(st.sampled_from(["xbalance-loss", "xglobal-balance-loss"])) if model.is_moe else ""
    return parse(str(c) + SCALARS + balance), model


def _small(c: Composition) -> bool:
    return c.devices <= 64


@settings(max_examples=max(10, settings().max_examples // 8))
@given(scalar_compositions())
def test_derived_scalar_programs_are_proved_and_match(drawn: tuple[Composition, Transformer]) -> None:
    c, model = drawn
    program = derive_program(c.placement(model), model)
    kinds = {op.kind for op in program.scalars}
    every = {ScalarKind.NORMALISE_LOSS, ScalarKind.GRAD_NORM, ScalarKind.CLIP, ScalarKind.OVERFLOW_CHECK}
    assert kinds == every | ({ScalarKind.AUX_LOSS} if model.is_moe else set())
    assert _proved(program), str(c)
    if _small(c):
        assert _matches(program), str(c)


@st.composite
def scalar_mutations(draw: st.DrawFn, program: StepProgram) -> StepProgram:
    """One to three changes to a derived scalar program."""
    ops = list(program.scalars)
    axes = list(program.placement.axes)
    groups = program.placement.groups(State.PARAMETERS)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(ops) - 1))
        op = ops[i]
        change = draw(st.sampled_from(["over", "once", "groups", "micro_batches", "compensated", "move", "drop"]))
        match change:
            case "over" if axes:
                op = replace(op, over=tuple(draw(st.lists(st.sampled_from(axes), unique=True))))
            case "once" if axes:
                op = replace(op, once=tuple(draw(st.lists(st.sampled_from(axes), unique=True))))
            case "groups":
                dropped = draw(st.sampled_from(groups))
                op = replace(op, groups=frozenset(g for g in groups if g != dropped))
            case "micro_batches":
                op = replace(op, micro_batches=not op.micro_batches)
            case "compensated":
                op = replace(op, compensated=not op.compensated)
            case "move":
                j = draw(st.integers(0, len(ops) - 1))
                ops.insert(j, ops.pop(i))
                continue
            case "drop" if len(ops) > 1:
                ops.pop(i)
                continue
        ops[i] = op
    return replace(program, scalars=tuple(ops), derived=False)


_COUNTS = {"agree": 0, "refuted": 0}


@settings(max_examples=max(30, settings().max_examples // 3))
@given(st.data())
def test_differential_z3_proves_iff_the_scalar_reference_matches(data: st.DataObject) -> None:
    c, model = data.draw(scalar_compositions())
    if not _small(c):
        c = parse("tp2xfsdp2xpp2" + SCALARS)
    program = data.draw(scalar_mutations(derive_program(c.placement(model), model)))
    proved, matches = _proved(program), _matches(program)
    assert proved == matches, f"{c}: z3 {'proved' if proved else 'refuted'}, reference {matches}: {program.scalars}"
    _COUNTS["agree"] += 1
    _COUNTS["refuted"] += not proved


def test_the_differential_sees_both_answers() -> None:
    """The mutations are not vacuous: on a fixed set, some are refuted and some proved."""
    base = _program("tp2xzero1(dp=2)xpp2xm2" + SCALARS)
    verdicts = set()
    for over in ((), (Axis.TP,), (Axis.TP, Axis.DP, Axis.PP)):
        ops = tuple(replace(op, over=over) if op.kind is ScalarKind.GRAD_NORM else op for op in base.scalars)
        verdicts.add(_proved(replace(base, scalars=ops)))
    assert verdicts == {True, False}


# --------------------------------------------------------------------------- witnesses


def test_replicated_norms_counted_twice_along_tp_are_named() -> None:
    # The norm all-reduced over tp without filtering tensor-parallel duplicates (torchtune #2420,
    # ROCm TransformerEngine PR #715): the replicated LayerNorm weights are added by both ranks.
    toml = '[[scalars]]\nop = "grad_norm"\nover = ["tp"]\n\n[[scalars]]\nop = "clip"\n'
    program = _program("tp2xdp2xclip", toml=toml)
    _, violations = decide_scalars(program, 10_000)
    norm = next(v for v in violations if v.rule == "norm_counts_once[G.norm, tp]")
    assert "the norm counts G.norm twice along tp: devices 0 and 1 both add it" in norm.explanation
    w = norm.witness
    # the devices' norm is the sum of every device's additions of the one piece: twice its square
    piece = Fraction(str(w["squared_norms"]["piece 0"]))
    assert Fraction(str(w["devices"]["0"])) == 2 * piece == 2 * Fraction(str(w["single_device"]))
    assert not any(v.rule.startswith("norm_counts_once[G.attention") for v in violations)  # tp shards: once


def test_pipeline_stages_left_out_of_the_norm_are_named() -> None:
    # torchtitan #596: the norm of FSDP x PP reduced over the FSDP mesh only.
    toml = '[[scalars]]\nop = "grad_norm"\nover = ["dp"]\n\n[[scalars]]\nop = "clip"\n'
    program = _program("fsdp2xpp2xclip", toml=toml)
    _, violations = decide_scalars(program, 10_000)
    v = next(v for v in violations if v.rule == "norm_covers[G.attention, pp]")
    assert "is not all-reduced over pp" in v.explanation
    squares = [Fraction(str(x)) for x in v.witness["squared_norms"].values()]
    assert Fraction(str(v.witness["single_device"])) == sum(squares)
    assert Fraction(str(v.witness["devices"]["0"])) == squares[0]  # stage 0 sees its own layers only


def test_mean_of_means_under_accumulation_is_refuted_with_the_token_counts() -> None:
    # transformers PR #34191: each micro-batch divided by its own token count, then by m.
    toml = '[[scalars]]\nop = "normalise_loss"\n'
    program = _program("dp1xm2", toml=toml)
    _, violations = decide_scalars(program, 10_000)
    (v,) = violations
    assert v.rule == "token_count[loss, micro-batches]"
    tokens = v.witness["tokens"]
    mine, other = tokens["micro-batches 0"], tokens["micro-batches others"]
    assert mine != other
    assert f"micro-batch 0 has {mine} tokens, micro-batch 1 has {other}" in v.explanation
    # one token of micro-batch 0 weighs 1/(m * its count); single-device training, 1/total
    assert Fraction(v.witness["weight"]) == Fraction(1, 2 * mine) != Fraction(1, mine + other)


def test_the_global_token_count_is_proved_and_its_missing_compensation_refuted() -> None:
    good = '[[scalars]]\nop = "normalise_loss"\nover = ["dp", "cp"]\nmicro_batches = true\n'
    assert _proved(_program("dp2xcp2xm4", toml=good))
    bad = good + "compensated = false\n"
    _, violations = decide_scalars(_program("dp2xcp2xm4", toml=bad), 10_000)
    (v,) = violations
    assert v.rule == "loss_compensation[loss]"
    n = v.witness["global_tokens"]
    assert Fraction(v.witness["weight"]) == Fraction(1, 4 * n)  # averaged over dp x cp = 4


def test_equal_token_counts_make_the_mean_of_means_exact() -> None:
    toml = '[[scalars]]\nop = "normalise_loss"\ntokens = "equal"\n'
    assert _proved(_program("dp2xcp2xm4", toml=toml))
    assert _matches(_program("dp2xcp2xm4", toml=toml))


def test_an_overflow_in_one_shard_unseen_by_the_others_is_named() -> None:
    toml = '[[scalars]]\nop = "overflow_check"\nover = ["tp"]\n'
    program = _program("tp2xzero1(dp=4)xfp16", toml=toml)
    _, violations = decide_scalars(program, 10_000)
    v = next(v for v in violations if v.rule == "overflow_reduced[G.attention, dp]")
    skips = v.witness["skips"]
    assert True in skips.values() and False in skips.values()
    assert "does not see it and steps" in v.explanation
    # replicas along tp: a flag duplicated by an or is harmless, so tp is not what is named
    assert not any(x.axis == "tp" for x in violations)


def test_a_group_left_out_of_the_norm_on_one_device_is_named() -> None:
    # Regression (found by the thorough differential): with every degree 1 no axis was judged,
    # so a norm that leaves a group out was proved while the reference clipped by a smaller norm.
    program = _program("pp1xclip")
    ops = tuple(
        replace(op, groups=frozenset({Group("attention")})) if op.kind is ScalarKind.GRAD_NORM else op
        for op in program.scalars
    )
    _, violations = decide_scalars(replace(program, scalars=ops), 10_000)
    assert "norm_covers[G.mlp, pp]" in {v.rule for v in violations}
    assert not _matches(replace(program, scalars=ops))


def test_a_group_left_out_of_the_clip_is_named() -> None:
    program = _program("dp2xclip")
    ops = tuple(
        replace(op, groups=frozenset({Group("attention")})) if op.kind is ScalarKind.CLIP else op
        for op in program.scalars
    )
    _, violations = decide_scalars(replace(program, scalars=ops), 10_000)
    assert {v.rule for v in violations} >= {"clip_factor[G.mlp]"}
    assert "clip_factor[G.attention]" not in {v.rule for v in violations}


def test_per_rank_routing_statistics_under_cp_are_named() -> None:
    # The load-balancing loss of a replica's micro-batch formed from each cp rank's own tokens
    # (Megatron PR #3769 reduces the router's statistics over the tp x cp group).
    model = Transformer("tiny-moe", layers=8, hidden=512, heads=8, vocab=1024, seq=256, experts=8, top_k=2)
    program = _program("dp2xcp2xep2xbalance-loss", model, toml='[[scalars]]\nop = "aux_loss"\n')
    _, violations = decide_scalars(program, 10_000)
    (v,) = violations
    assert v.rule == "aux_loss_statistics[aux, cp]"
    w = v.witness

    # re-derive both losses from the witness: Switch's E sum_e f_e P_e, per rank (averaged) and joint
    def balance(counts: list[Fraction], probs: list[Fraction]) -> Fraction:
        n = sum(counts, Fraction(0))
        return len(counts) * sum(((c / n) * (p / n) for c, p in zip(counts, probs, strict=True)), Fraction(0))

    ranks = sorted(w["routed"])
    counts = [[Fraction(str(x)) for x in w["routed"][r]] for r in ranks]
    probs = [[Fraction(str(x)) for x in w["probabilities"][r]] for r in ranks]
    own = sum(balance(c, p) for c, p in zip(counts, probs, strict=True)) / len(ranks)
    joint = balance([sum(col) for col in zip(*counts, strict=True)], [sum(col) for col in zip(*probs, strict=True)])
    assert Fraction(str(w["loss"])) == own != joint == Fraction(str(w["single_device"]))
    # global statistics where the reference balances each replica's micro-batch: another loss
    toml = '[[scalars]]\nop = "aux_loss"\nover = ["cp", "dp"]\n'
    _, violations = decide_scalars(_program("dp2xcp2xep2xbalance-loss", model, toml=toml), 10_000)
    assert {v.rule for v in violations} == {"aux_loss_scope[aux, dp]"}
    assert not _matches(_program("dp2xcp2xep2xbalance-loss", model, toml=toml))


def test_scalar_entries_are_checked_when_read() -> None:
    for bad, says in (
        ('[[scalars]]\nop = "norm"\n', "needs op = one of"),
        ('[[scalars]]\nop = "clip"\nover = ["dp"]\n', "a clip is local"),
        ('[[scalars]]\nop = "grad_norm"\nmicro_batches = true\n', "micro_batches applies to normalise_loss"),
        ('[[scalars]]\nop = "grad_norm"\nover = ["qq"]\n', "is not an axis"),
    ):
        with pytest.raises(Exception, match=says):
            loads(bad)


def test_the_scalar_verdict_is_fast() -> None:
    program = _program("tp2xfsdp2xpp2xcp2" + SCALARS)
    start = time.perf_counter()
    assert _proved(program)
    assert time.perf_counter() - start < 10


def test_a_normaliser_op_built_in_code_matches_the_file_one() -> None:
    program = _program("dp2xm2", toml='[[scalars]]\nop = "normalise_loss"\nover = ["dp"]\nmicro_batches = true\n')
    (op,) = program.scalars
    assert op == ScalarOp(ScalarKind.NORMALISE_LOSS, None, (Axis.DP,), (), True, True, "variable", op.note)


CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def _config_verdict(path: Path, devices: int | None) -> set[str]:
    imported = load_config(path, devices=devices)
    model = imported.transformer or PRESETS[imported.model or "llama2-7b"]
    c = imported.composition
    verdict = decide(c, derive_program(c.placement(model), model), model)
    assert verdict.status is Status.PROVED, verdict.violations
    return {o.name.split("[")[0] for o in verdict.obligations}


@pytest.mark.parametrize(
    ("name", "devices", "features"),
    [
        ("torchtitan_llama3_405b_3d.toml", 384, {"clip_norm", "clip_factor"}),  # max_norm with FSDP x PP
        ("deepspeed_pipeline.json", None, {"clip_norm", "clip_factor", "loss_scale_overflow"}),  # ZeRO-1 x PP, fp16
        ("megatron_gpt3_175b.sh", None, {"clip_norm", "clip_factor"}),  # --clip-grad with TP x PP
        ("megatron_mixtral_8x7b.sh", None, {"aux_loss"}),  # --moe-aux-loss-coeff
    ],
)
def test_the_real_configs_are_proved_with_obligations_that_name_their_scalars(
    name: str, devices: int | None, features: set[str]
) -> None:
    assert features <= _config_verdict(CONFIGS / name, devices)


def test_megatron_per_token_loss_is_mapped_and_proved(tmp_path: Path) -> None:
    # --calculate-per-token-loss was refused as an unknown argument; it is the global token count
    script = (
        (CONFIGS / "megatron_gpt3_175b.sh").read_text().replace("--clip-grad", "--calculate-per-token-loss --clip-grad")
    )
    path = tmp_path / "gpt3.sh"
    path.write_text(script)
    assert "loss_normalisation" in _config_verdict(path, None)


@settings(max_examples=max(20, settings().max_examples // 5))
@given(st.data())
def test_cross_entropy_kernels_z3_iff_the_reference(data: st.DataObject) -> None:
    """Random loss kernels (normaliser reduced over some axes, logits gathered along some):
    z3 proves iff the float reference's loss equals log Z - x_target within RTOL."""
    text = data.draw(st.sampled_from(["tp2xdp2", "tp4", "tp2xpp2", "dp2xcp2", "tp2xspxcp2"]))
    program = _program(text)
    axes = list(program.placement.axes)
    over = tuple(data.draw(st.lists(st.sampled_from(axes), unique=True)))
    gathered = tuple(data.draw(st.lists(st.sampled_from(axes), unique=True)))
    op = ScalarOp(ScalarKind.CROSS_ENTROPY, over=over, gathered=gathered)
    program = replace(program, scalars=(op,), derived=False)
    assert _proved(program) == _matches(program), (text, over, gathered)


def test_gathered_logits_are_off_by_log_tp() -> None:
    # Megatron-LM #7452: the witness's normaliser on every rank is tp x the single-device one
    program = _program("tp4", toml='[[scalars]]\nop = "cross_entropy"\ngathered = ["tp"]\nover = ["tp"]\n')
    _, violations = decide_scalars(program, 10_000)
    (v,) = violations
    assert v.rule == "logits_placement[A.logits, tp]" and "log(4)" in v.explanation
    assert all(Fraction(str(x)) == 4 * Fraction(str(v.witness["single_device"])) for x in v.witness["devices"].values())
    assert _proved(_program("tp4", toml='[[scalars]]\nop = "cross_entropy"\nover = ["tp"]\n'))
    assert _proved(_program("tp4", toml='[[scalars]]\nop = "cross_entropy"\ngathered = ["tp"]\n'))  # a local kernel


def test_simulate_answers_for_the_scalars_so_a_refuted_clip_is_no_disagreement() -> None:
    # Regression: the training simulator does not clip, so a refuted scalar program matched
    # there and --simulate reported "z3 and the executable reference disagree" (exit 5).
    from checker._simulate import disagreement, run_simulation

    model = PRESETS["gpt3-1.3b"]
    for name, refuted in (("broken_clip_tp_duplicates", True), ("valid_clip_tp", False)):
        file = load(Path(__file__).resolve().parent.parent / "examples" / f"{name}.toml")
        c = parse("tp2xdp2xclip", file.factories())
        verdict = decide(c, file.program_for(c.placement(model), model), model)
        assert (verdict.status is Status.REFUTED) is refuted
        doc, line = run_simulation(c, file, model, verdict)
        assert doc["scalars"]["matches"] is not refuted and "scalars:" in line
        assert disagreement(verdict, doc) is None


def test_a_load_balancing_loss_without_experts_is_refused_in_one_line() -> None:
    # Regression (found by tests/test_fuzz_cli.py): the Mixtral script with --params 1e9 (a model
    # given by its count: no router) was an internal error; it is input the model cannot represent.
    from formal.errors import InputError

    with pytest.raises(InputError, match="needs a model with experts"):
        _program("dp2xbalance-loss")
