"""Costs of the placements docs/semantics.md ("The strategy library") singles out, each derived from the
placement."""

from __future__ import annotations

from fractions import Fraction

import sympy as sp

from checker._analysis import Analysis, analyze
from checker._parse import parse
from formal._costs import in_flight_micro_batches, stage_in_flight
from formal._model import PRECISIONS, ParameterCount, Transformer
from formal._presets import PRESETS
from formal._vocab import Axis, OpKind, Stage, State


def run(text: str, model: Transformer | ParameterCount, precision: str = "zero") -> Analysis:
    return analyze(parse(text), model, PRECISIONS[precision])


def frac(x: sp.Expr) -> Fraction:
    value = sp.Rational(x)
    return Fraction(int(value.p), int(value.q))


def gpt() -> Transformer:
    model = PRESETS["gpt3-1.3b"]
    assert isinstance(model, Transformer)
    return model


def test_last_stage_holds_fewer_micro_batches_than_the_first() -> None:
    """1F1B: stage 0 holds min(p, m), stage p-1 one; GPipe: m everywhere; interleaved: Megatron's
    warm-up (p - rank - 1) * 2 + (v - 1) * p chunks, plus one, in units of 1/v of the stage."""
    model = Transformer("k", layers=16, hidden=64, heads=4, vocab=1000, seq=32)
    for p, m in ((4, 16), (4, 2), (8, 8)):
        pl = parse(f"pp{p}xm{m}").placement(model)
        assert in_flight_micro_batches(pl, Stage.FIRST) == min(p, m)
        assert in_flight_micro_batches(pl, Stage.LAST) == 1
        gp = parse(f"pp{p}xm{m}xgpipe").placement(model)
        assert in_flight_micro_batches(gp, Stage.FIRST) == in_flight_micro_batches(gp, Stage.LAST) == m
        for v in (2, 4):
            il = parse(f"pp{p}xm{m}xv{v}").placement(model)
            last_chunks = min(m * v, (v - 1) * p + 1)
            assert in_flight_micro_batches(il, Stage.LAST) == sp.Rational(last_chunks, v)
            if m >= p:  # rank 0: 2(p-1) + (v-1)p + 1 chunks, Korthikanti's p (1 + (p-1)/(p v))
                assert sp.Rational(2 * (p - 1) + (v - 1) * p + 1, v) == in_flight_micro_batches(il, Stage.FIRST)


def test_every_stage_holds_its_own_warm_up() -> None:
    """Stage i of a 1F1B pipeline runs p - i forwards before its first backward (PTD-P, 2.2),
    so it holds min(p - i, m); the per-stage count meets the first and the last stage's at the
    ends and never exceeds the first stage's (the bound reported for a middle stage)."""
    model = Transformer("k", layers=16, hidden=64, heads=4, vocab=1000, seq=32)
    for text in ("pp4xm16", "pp4xm2", "pp8xm8", "pp4xm16xgpipe", "pp4xm8xv2", "pp4xm8xv4", "pp8xm16xv2"):
        pl = parse(text).placement(model)
        p = int(pl.degree(Axis.PP))
        assert stage_in_flight(pl, 0) == in_flight_micro_batches(pl, Stage.FIRST), text
        assert stage_in_flight(pl, p - 1) == in_flight_micro_batches(pl, Stage.LAST), text
        for i in range(p):
            assert stage_in_flight(pl, i) <= in_flight_micro_batches(pl, Stage.MIDDLE), (text, i)
            if "x" not in text.removeprefix(f"pp{p}x"):  # plain 1F1B
                assert stage_in_flight(pl, i) == min(p - i, pl.options.micro_batches), (text, i)


def test_most_loaded_stage_is_the_larger_and_reported() -> None:
    a = run("pp4xm16", PRESETS["llama2-7b"])
    assert a.memory.stage == "first"  # 4 micro-batches of activations outweigh the untied head
    assert a.in_flight == 4


def test_fsdp_shard_grad_op_rests_like_zero3_peaks_like_zero2_moves_like_dp() -> None:
    model = gpt()
    psi = model.parameter_count()
    sgo, full = run("fsdp-sgo8", model), run("fsdp8", model)
    assert sgo.memory.model_states == full.memory.model_states == sp.Rational(16 * psi, 8)
    # held through backward: every unsharded parameter minus the shard (2 bytes), plus the
    # gradient bucket of the largest unit (the embedding, V h elements, 2 bytes)
    assert sgo.memory.buffers == sp.Rational(2 * psi * 7, 8) + 2 * model.vocab * model.hidden
    assert sgo.memory.parameters.total + sgo.memory.buffers - 2 * model.vocab * model.hidden == 2 * psi
    assert sgo.model_state_psi == 2 and full.model_state_psi == 3
    gathers = [t for t in sgo.traffic if t.kind is OpKind.ALL_GATHER]
    assert {t.phase for t in gathers} == {"forward"}


def test_hsdp_is_zero3_along_dp_composed_with_dp_along_dpr() -> None:
    psi = 2**30
    model = ParameterCount(psi)
    hsdp = run("hsdp8xdpr2", model)
    assert hsdp.memory.model_states == run("zero38", model).memory.model_states == 2 * psi
    by_axis = {(t.kind, t.axis): t for t in hsdp.traffic}
    scatter = by_axis[(OpKind.REDUCE_SCATTER, Axis.DP)]
    reduce = by_axis[(OpKind.ALL_REDUCE, Axis.DPR)]
    assert scatter.elements == psi and reduce.elements == psi // 8  # the shard crosses replicas
    assert reduce.bytes == psi // 8 * 2 * sp.Rational(2 * (2 - 1), 2)
    assert hsdp.model_state_psi == 3 + sp.Rational(2, 8)


def test_offload_puts_optimizer_and_gradients_on_the_host() -> None:
    """ZeRO-Offload over ZeRO-3: the device keeps its parameter shard; the host keeps that
    device's gradient and optimizer shards; PCIe moves the gradient shard down and the updated
    parameter shard back each step."""
    psi, n = 2**30, 8
    a = run(f"zero3{n}xoffload", ParameterCount(psi))
    assert a.memory.model_states == sp.Rational(2 * psi, n)
    assert a.memory.host == sp.Rational((2 + 12) * psi, n)
    moved = {(op, st): v for op, st, _, _, v in a.transfers}
    assert moved[("device_to_host", State.GRADIENTS)] == sp.Rational(2 * psi, n)
    assert moved[("host_to_device", State.PARAMETERS)] == sp.Rational(2 * psi, n)
    both = run(f"zero3{n}xoffloadxoffload-params", ParameterCount(psi))
    assert both.memory.model_states == 0
    assert both.memory.host == sp.Rational(16 * psi, n)


def test_gradient_accumulation_under_zero2_reduces_every_micro_batch() -> None:
    """Rule 7: ZeRO-2 with m micro-batches has no full accumulator, so it reduce-scatters m
    times (m x traffic); ZeRO-1 accumulates into its full buffer and reduces once."""
    psi = 2**30
    z2 = run("zero28xm4", ParameterCount(psi))
    z1 = run("zero18xm4", ParameterCount(psi))
    assert frac(z2.model_state_psi) == 4 + 1  # 4 reduce-scatters + 1 refresh all-gather
    assert frac(z1.model_state_psi) == 2
