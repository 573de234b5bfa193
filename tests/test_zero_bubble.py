"""ZB-H1, the zero-bubble schedule of Qi, Wan, Huang and Lin, "Zero Bubble Pipeline
Parallelism" (ICLR 2024, arXiv 2401.10241), section 2.1: the composition modifier ``zb``.

Expected values come from the paper's formulas, Korthikanti et al.'s activation sizes and an
event simulation of the schedule written here from the paper's description, never from the
cost model's output."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import cast

import pytest
import sympy as sp
from click.testing import CliRunner

from checker._exporters import Target, export
from checker._layout import ExportError
from checker._parse import parse
from checker._planner import DataParallel, Deriver, Family, Offload, Pipeline
from checker._torch._engine import engine_for
from checker.cli import main
from formal._costs import activation_memory, bubble_fraction, communication, in_flight_micro_batches
from formal._model import DEFAULT_PRECISION, Transformer
from formal._placement import Recompute
from formal._presets import PRESETS
from formal._program import derive_program
from formal._schedules import Schedule
from formal._simulator import simulate
from formal._smt import decide
from formal._verdict import Status
from formal._vocab import Stage
from formal.errors import CompositionError

GPT3 = cast(Transformer, PRESETS["gpt3-1.3b"])  # Brown et al. 2020: 24 layers, h 2048, 16 heads, s 2048, v 51200


# --- the schedule itself, simulated from the paper's description ---------------------------


def _orders(p: int, m: int, split: bool) -> list[list[tuple[str, int]]]:
    """Each stage's passes in order. F and B in 1F1B's order (stage i warms up with
    min(p - i - 1, m) forwards, then alternates forward and backward); with ``split`` (ZB-H1)
    stage i runs the W of micro-batch j after the B of micro-batch j + i and the rest at the end,
    so every stage keeps the same number of micro-batches in flight (section 2.1); without,
    each W follows its own B (1F1B's one backward)."""
    out = []
    for i in range(p):
        warm = min(p - i - 1, m)
        ops: list[tuple[str, int]] = [("F", j) for j in range(warm)]
        f, w = warm, 0
        for b in range(m):
            if f < m:
                ops.append(("F", f))
                f += 1
            ops.append(("B", b))
            if not split or b - w >= i:
                ops.append(("W", w))
                w += 1
        ops += [("W", j) for j in range(w, m)]
        out.append(ops)
    return out


def _simulate(p: int, m: int, split: bool, whole: int = 0, deferred: int = 0) -> tuple[Fraction, list[int]]:
    """Run the passes with T_F = T_B = T_W = 1 (the paper's assumption for its handcrafted
    schedules) and no communication time. F on stage i waits for F on stage i - 1; B on stage i
    for B on stage i + 1 (1F1B: for that stage's whole backward, B and W) or, on the last stage,
    for its own F; W for its own B. Returns the bubble (idle over compute, m (T_F + T_B + T_W))
    and each stage's peak activation bytes: a forward adds ``whole``, a backward turns it into
    ``deferred`` (what W reads), a W frees that."""
    orders, clock, nxt = _orders(p, m, split), [0] * p, [0] * p
    done: dict[tuple[str, int, int], int] = {}  # (pass, stage, micro-batch): its finishing time
    held, peak = [0] * p, [0] * p
    progressed = True
    while progressed:
        progressed = False
        for i in range(p):
            while nxt[i] < len(orders[i]):
                kind, j = orders[i][nxt[i]]
                if kind == "F":
                    deps = [("F", i - 1, j)] if i > 0 else []
                elif kind == "B":
                    deps = [("F", i, j)] if i == p - 1 else [("B" if split else "W", i + 1, j)]
                else:
                    deps = [("B", i, j)]
                if any(d not in done for d in deps):
                    break
                done[(kind, i, j)] = clock[i] = max([clock[i]] + [done[d] for d in deps]) + 1
                held[i] += {"F": whole, "B": deferred - whole, "W": -deferred}[kind]
                peak[i] = max(peak[i], held[i])
                nxt[i] += 1
                progressed = True
    assert all(nxt[i] == len(orders[i]) for i in range(p)), "the schedule deadlocked"
    return Fraction(max(clock) - 3 * m, 3 * m), peak


def test_the_simulation_reproduces_1f1b_bubble() -> None:
    """The simulation's premise: unsplit, it is 1F1B, whose bubble is (p - 1)/m (Narayanan et
    al. 2021, section 2.2) for every m, and stage i holds min(p - i, m) micro-batches."""
    for p in range(1, 7):
        for m in range(1, 13):
            bubble, peak = _simulate(p, m, split=False, whole=1, deferred=1)
            assert bubble == Fraction(p - 1, m), (p, m)
            assert peak == [min(p - i, m) for i in range(p)], (p, m)


def _zb(p: int, m: int, extra: str = "") -> str:
    return f"dp2xpp{p}xzbxm{m}{extra}"


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
def test_bubble_is_the_papers_third_of_1f1b(p: int) -> None:
    """Qi et al. 2024, section 2: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W) against 1F1B's
    (p - 1)(T_F + T_B + T_W); with T_F = T_B = T_W and m micro-batches of T_F + T_B + T_W each,
    (p - 1)/(3m), a third of 1F1B's (p - 1)/m."""
    for m in (p, 2 * p, 4 * p, 4 * p + 3):
        zb = bubble_fraction(parse(_zb(p, m)).placement(GPT3))
        one_f_one_b = bubble_fraction(parse(f"dp2xpp{p}xm{m}").placement(GPT3))
        assert zb == sp.Rational(p - 1, 3 * m) == one_f_one_b / 3, (p, m)
        assert _simulate(p, m, split=True)[0] == Fraction(p - 1, 3 * m)


def test_bubble_with_fewer_micro_batches_than_stages_is_the_schedules() -> None:
    """Below m = p the paper's formula does not hold (fewer W passes than the drain needs): the
    cost model follows the schedule, as the simulation runs it; at m = 1 nothing overlaps, and
    the bubble is the forward and backward chain, 2(p - 1) units of 3."""
    for p in range(2, 7):
        for m in range(1, p + 1):
            expected = _simulate(p, m, split=True)[0]
            assert bubble_fraction(parse(_zb(p, m)).placement(GPT3)) == sp.Rational(
                expected.numerator, expected.denominator
            )
        assert _simulate(p, 1, split=True)[0] == Fraction(2 * (p - 1), 3)


# --- memory ---------------------------------------------------------------------------------

SBH = GPT3.seq * GPT3.micro_batch * GPT3.hidden
LAYER = 34 * SBH + 5 * GPT3.heads * GPT3.seq**2 * GPT3.micro_batch  # Korthikanti et al. 2022, 4.1
W_READS = 32 * SBH  # Qi et al.'s runtime: w_mem_approx = 32 * hidden_size (per sb), 16-bit


def _io(stage: Stage, t: int = 1, sequence_parallel: bool = False) -> int:
    """Korthikanti et al. 2022, section 4.3: the first stage keeps the input dropout's mask
    (sbh bytes), the last the final norm's and the head's inputs (4sbh) and fp32 logits (4sbv)."""
    split = t if sequence_parallel else 1
    if stage == Stage.FIRST:
        return SBH // split
    if stage == Stage.LAST:
        return 4 * SBH // split + 4 * GPT3.seq * GPT3.micro_batch * GPT3.vocab // t
    return 0


@pytest.mark.parametrize("p", [2, 4, 8])
def test_stage_zero_holds_1f1bs_peak_and_later_stages_their_deferred_weight_inputs(p: int) -> None:
    """ZB-H1 keeps 1F1B's peak memory (Qi et al. 2024, section 2.1: the first worker, with the
    most activations, does not exceed 1F1B's). Stage i holds 1F1B's min(p - i, m) micro-batches
    whole and, for the i whose W it has deferred, what W reads: 32sbh per layer."""
    m = 4 * p
    layers = GPT3.layers // p
    zb = parse(_zb(p, m)).placement(GPT3)
    base = parse(f"dp2xpp{p}xm{m}").placement(GPT3)
    for i in range(p):
        stage = Stage.of(i, p)
        whole = layers * LAYER + _io(stage)
        expected = (p - i) * whole + i * layers * W_READS
        assert activation_memory(zb, GPT3, DEFAULT_PRECISION, stage, i) == expected, i
        assert activation_memory(base, GPT3, DEFAULT_PRECISION, stage, i) == (p - i) * whole, i
        assert _simulate(p, m, True, whole, layers * W_READS)[1][i] == expected
    first = activation_memory(zb, GPT3, DEFAULT_PRECISION, Stage.FIRST)
    assert first == activation_memory(base, GPT3, DEFAULT_PRECISION, Stage.FIRST) == p * (layers * LAYER + SBH)
    assert in_flight_micro_batches(zb, Stage.FIRST) == in_flight_micro_batches(base, Stage.FIRST) == p
    last = activation_memory(zb, GPT3, DEFAULT_PRECISION, Stage.LAST)
    assert last == layers * LAYER + _io(Stage.LAST) + (p - 1) * layers * W_READS


def test_what_w_reads_is_split_like_the_linear_layers_it_belongs_to() -> None:
    """Under tensor parallelism (degree t) the column-parallel inputs (QKV, FC1) and the
    row-parallel output gradients (attention projection, FC2) are whole on every rank, 8sbh at
    16 bits, unless sequence parallelism splits them; the other 24sbh are split: 8sbh + 24sbh/t,
    or 32sbh/t with sp."""
    p, m, t = 4, 16, 2
    layers = GPT3.layers // p
    for sequence_parallel, per_layer in ((False, 8 * SBH + 24 * SBH // t), (True, 32 * SBH // t)):
        text = f"tp{t}x" + _zb(p, m, "xsp" if sequence_parallel else "")
        pl = parse(text).placement(GPT3)
        base = parse(text.replace("xzb", "")).placement(GPT3)
        whole = activation_memory(base, GPT3, DEFAULT_PRECISION, Stage.LAST, p - 1)  # 1F1B: one micro-batch
        assert whole is not None
        assert activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.LAST, p - 1) == whole + 3 * layers * per_layer


def test_under_full_recomputation_the_deferred_inputs_outweigh_the_checkpoints() -> None:
    """Full recomputation keeps each layer's input only (2sbh, Korthikanti et al. 2022, Table 2);
    the B pass recomputes the layer and W still reads its 32sbh, so each stage peaks right after
    a backward, before that W: the simulation says where, for every stage and m."""
    for p in (2, 4):
        layers = GPT3.layers // p
        for m in (1, 2, p, 4 * p):
            pl = parse(_zb(p, m, "xrecompute")).placement(GPT3)
            for i in range(p):
                whole = layers * 2 * SBH + _io(Stage.of(i, p))
                peak = _simulate(p, m, True, whole, layers * W_READS)[1][i]
                assert activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.of(i, p), i) == peak, (p, m, i)
            assert (
                activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.FIRST)
                == _simulate(p, m, True, layers * 2 * SBH + _io(Stage.FIRST), layers * W_READS)[1][0]
            )
            assert (
                activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.LAST)
                == _simulate(p, m, True, layers * 2 * SBH + _io(Stage.LAST), layers * W_READS)[1][p - 1]
            )


def test_a_middle_stage_bound_holds_every_middle_stage() -> None:
    for m in (1, 3, 8, 32):
        pl = parse(_zb(8, m)).placement(GPT3)
        bound = activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.MIDDLE)
        assert bound is not None
        for i in range(1, 7):
            value = activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.MIDDLE, i)
            assert value is not None and value <= bound, (m, i)


def test_with_three_stages_the_middle_figure_is_the_middle_stages_own_peak() -> None:
    """With p = 3 there is one middle stage, so the middle-stage figure, the bound that takes each
    count at its largest over the middle stages, is that stage's own peak: after a forward it
    holds min(2, m) whole micro-batches and min(3, m) - min(2, m) deferred ones (the simulation
    runs the schedule and says what it holds)."""
    p, layers = 3, GPT3.layers // 3
    for m in (1, 2, 3, 4, 12):
        pl = parse(_zb(p, m)).placement(GPT3)
        peak = _simulate(p, m, True, layers * LAYER, layers * W_READS)[1][1]
        assert activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.MIDDLE) == peak, m
        assert activation_memory(pl, GPT3, DEFAULT_PRECISION, Stage.MIDDLE, 1) == peak, m


# --- sends, verdict, simulator: 1F1B's ------------------------------------------------------


def test_sends_and_the_step_program_are_1f1bs() -> None:
    """B sends what 1F1B's backward sends (the input gradient), W sends nothing: one activation
    forward and one gradient backward per micro-batch per boundary. The step program, and so
    the verdict, are 1F1B's: splitting the backward reorders the weight-gradient computation,
    it computes the same values."""
    zb, base = parse("pp4xzbxdp2", devices=8), parse("pp4xdp2", devices=8)
    zb_program, base_program = derive_program(zb.placement(GPT3), GPT3), derive_program(base.placement(GPT3), GPT3)
    assert zb_program.ops == base_program.ops
    for stage in (Stage.FIRST, Stage.MIDDLE, Stage.LAST):
        assert communication(zb_program, DEFAULT_PRECISION, stage) == communication(
            base_program, DEFAULT_PRECISION, stage
        )
    verdict = decide(zb, zb_program, GPT3)
    assert verdict.status is Status.PROVED
    assert verdict.status == decide(base, base_program, GPT3).status


def test_the_simulator_runs_it_and_matches_one_device() -> None:
    result = simulate(parse("pp2xdp2xzb"))
    assert result.matches


def test_check_composition_proves_pp4xzbxdp2() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["pp4xzbxdp2", "--devices", "8", "--model", "gpt3-1.3b"])
    assert out.exit_code == 0, out.output
    assert "PROVED" in out.output
    doc = json.loads(runner.invoke(main, ["pp4xzbxdp2", "--devices", "8", "--model", "gpt3-1.3b", "--json"]).stdout)
    assert doc["options"]["schedule"] == "zb-h1"
    assert doc["pipeline"]["bubble_fraction"] == "1/16"  # (4 - 1)/(3 x 16), the default m = 4p
    assert doc["memory"]["most_loaded_rank"]["in_flight_micro_batches"] == "4"


# --- spelling ---------------------------------------------------------------------------------


def test_parse_and_print_round_trip() -> None:
    comp = parse("pp4xzbxdp2")
    assert comp.options.schedule is Schedule.ZERO_BUBBLE_H1
    assert str(comp) == "pp4xdp2xzb" and parse(str(comp)) == comp
    with pytest.raises(CompositionError, match="given twice"):
        parse("pp4xzbxgpipexdp2")


@pytest.mark.parametrize(
    ("target", "why"),
    [
        (Target.TORCHTITAN, "ZB-H1.*two or more stages per rank"),
        (Target.DEEPSPEED, "zero-bubble"),
        (Target.MEGATRON, "zero-bubble.*--enable-zero-bubble --zero-bubble-max-pending-backward"),
    ],
)
def test_frameworks_without_zb_h1_refuse_it_by_name(target: Target, why: str) -> None:
    data = "fsdp" if target is Target.TORCHTITAN else "dp" if target is Target.MEGATRON else "zero1"
    with pytest.raises(ExportError, match=why):
        export(parse(f"{data}2xpp4xzb"), GPT3, target)


def test_the_pytorch_harness_names_what_it_does_not_run() -> None:
    with pytest.raises(CompositionError, match="zb-h1 schedules are not run"):
        engine_for(parse("pp4xzb"))


def test_the_planner_derives_zb_like_any_schedule() -> None:
    """The planner's cost core for a zb family: its bubble is a third of 1F1B's and its
    first-stage activations are 1F1B's, as symbolic expressions evaluated at pp 4, m 16."""
    deriver = Deriver(GPT3, DEFAULT_PRECISION)

    def core(schedule: Schedule) -> tuple[sp.Expr, ...]:
        family = Family(DataParallel.DP, Offload.NONE, Pipeline(schedule), False, Recompute.NONE)
        return deriver.activations(family).expressions

    zb, base = core(Schedule.ZERO_BUBBLE_H1), core(Schedule.ONE_F_ONE_B)
    point = {s: 1 for e in zb + base for s in e.free_symbols}
    point.update({s: 4 for e in zb for s in e.free_symbols if s.name == "d_pp"})
    point.update({s: 16 for e in zb for s in e.free_symbols if s.name == "m"})
    assert zb[2].subs(point) == sp.Rational(3, 48) == base[2].subs(point) / 3
    assert zb[0].subs(point) == base[0].subs(point)
    assert zb[1].subs(point) > base[1].subs(point)  # the last stage holds 3 deferred micro-batches
    assert str(Pipeline(Schedule.ZERO_BUBBLE_H1)) == "zb-h1"
    assert Pipeline(Schedule.ZERO_BUBBLE_H1).modifiers == ("zb",)
