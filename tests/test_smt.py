"""z3 verdicts of library compositions: every valid composition is proved; rules are named."""

from __future__ import annotations

import time

import pytest
import z3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import compositions, models

from checker._parse import parse
from formal._model import ParameterCount, Transformer
from formal._presets import PRESETS
from formal._program import derive_program
from formal._smt import decide
from formal._solver import Solver, solve
from formal._strategies import LIBRARY, Composition
from formal._verdict import Condition, Status, Verdict

GPT = PRESETS["gpt3-1.3b"]  # tied embeddings, LayerNorm with biases, learned positions
MOE = Transformer("tiny-moe", layers=8, hidden=512, heads=8, vocab=1024, seq=256, experts=8, top_k=2)


def verdict_of(text: str, model: Transformer | ParameterCount = GPT, devices: int | None = None) -> Verdict:
    composition = parse(text, devices=devices or 64)
    program = derive_program(composition.placement(model), model)
    return decide(composition, program, model, devices=devices)


def rules(verdict: Verdict) -> set[str]:
    return {v.rule for v in verdict.violations}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_every_library_strategy_is_proved(name: str) -> None:
    model = MOE if name == "ep" else GPT
    verdict = verdict_of(f"{name}4", model)
    assert verdict.status is Status.PROVED, [v.rule for v in verdict.violations]
    assert all(o.status is Status.PROVED for o in verdict.obligations)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_divisible_composition_over_distinct_axes_is_proved(data: st.DataObject) -> None:
    model = data.draw(models())
    composition: Composition = data.draw(compositions(model))
    program = derive_program(composition.placement(model), model)
    verdict = decide(composition, program, model, devices=composition.devices)
    assert verdict.status is Status.PROVED, (str(composition), [(v.rule, v.explanation) for v in verdict.violations])


def test_obligations_cover_every_group_and_axis() -> None:
    verdict = verdict_of("tp2xzero34xpp2")
    composition = parse("tp2xzero34xpp2")
    groups = composition.placement(GPT).groups(next(iter(composition.placement(GPT).keys()))[0])
    names = {o.name for o in verdict.obligations}
    for g in groups:
        for axis in ("tp", "dp", "pp"):
            assert f"gradient_integrity[G.{g.name}, {axis}]" in names
            assert f"state_consistency[{g.name}, {axis}]" in names
    assert "composition_rules" in names


@pytest.mark.parametrize(
    ("text", "model", "expected"),
    [
        ("tp3", PRESETS["llama2-7b"], {"divides[heads, tp]", "divides[hidden, tp]", "divides[vocab, tp]"}),
        ("dp2xzero12", GPT, {"orthogonality[dp]"}),
        ("dp8xsp", GPT, {"sp_needs_tp"}),
        ("ep4", GPT, {"ep_needs_moe"}),
        ("cp2", ParameterCount(10**9), {"cp_needs_attention"}),
        ("dp4xv2", GPT, {"interleaved_needs_pp"}),
        ("pp5", GPT, {"divides[layers, pp]"}),
        ("pp4xv4", GPT, {"divides[layers, pp]"}),
        ("ep3", MOE, {"divides[experts, ep]"}),
        ("cp3", GPT, {"divides[seq, cp]"}),
    ],
)
def test_composition_rules_are_named(text: str, model: Transformer | ParameterCount, expected: set[str]) -> None:
    verdict = verdict_of(text, model)
    assert verdict.status is Status.REFUTED
    assert verdict.condition_status(Condition.COMPOSITION) is Status.REFUTED
    assert expected <= rules(verdict)
    for v in verdict.violations:
        if v.rule in expected:
            assert v.condition is Condition.COMPOSITION
            assert v.rule in v.witness["core"]  # the unsat core names the rule


def test_device_count_prints_the_arithmetic() -> None:
    verdict = verdict_of("tp2xdp8xpp4", devices=32)
    (violation,) = [v for v in verdict.violations if v.rule == "device_count"]
    assert violation.witness["product"] == 64 and violation.witness["devices"] == 32
    assert "tp(2) * dp(8) * pp(4) = 64 != devices(32)" in violation.explanation
    assert verdict_of("tp2xdp8xpp4", devices=64).status is Status.PROVED


def test_zero3_under_pipeline_is_valid_with_a_cost_note() -> None:
    verdict = verdict_of("zero34xpp2xm8")
    assert verdict.status is Status.PROVED
    assert any("#1629" in n and "#4164" in n and "8x" in n for n in verdict.notes)
    assert not any("DeepSpeed" in n for n in verdict_of("zero14xpp2xm8").notes)


def test_degrees_beyond_eight_are_decided() -> None:
    # 8 devices are explicit, the rest folded (integrity) or offsets relabelled (consistency).
    assert verdict_of("zero364").status is Status.PROVED
    assert verdict_of("fsdp32xtp4xpp2").status is Status.PROVED


def test_unknown_is_kept_with_its_reason() -> None:
    solver = Solver(timeout_ms=1)
    x, y, z = z3.Ints("x y z")
    # Fermat's last theorem for n = 5: far beyond 1 ms of nonlinear integer arithmetic.
    solver.track("fermat", z3.And(x > 0, y > 0, z > 0, x**5 + y**5 == z**5))
    answer = solve(solver, solver.literals)
    assert answer.result == "unknown"
    assert answer.reason


def test_unknown_is_never_reported_proved(z3_gives_up: None) -> None:
    verdict = verdict_of("tp2xzero34")
    assert verdict.status is Status.UNKNOWN
    assert all(o.status is Status.UNKNOWN and o.reason_unknown == "timeout" for o in verdict.obligations)
    assert verdict.as_json()["unknown"]


def test_verdicts_are_fast_enough_for_differential_testing() -> None:
    composition = parse("tp2xzero38xpp4")
    model = PRESETS["llama2-7b"]
    program = derive_program(composition.placement(model), model)
    decide(composition, program, model)
    start = time.perf_counter()
    decide(composition, program, model)
    assert time.perf_counter() - start < 5.0  # generous: shared CI cores; typically ~0.1-0.3 s


def test_public_api_is_pinned() -> None:
    import formal._smt as smt

    assert smt.__all__ == [
        "DEFAULT_QUERY_RLIMIT",
        "DEFAULT_RUN_RLIMIT",
        "DEFAULT_RUN_TIMEOUT_S",
        "DEFAULT_TIMEOUT_MS",
        "MAX_CONSISTENCY_DEVICES",
        "MAX_EXPLICIT_DEVICES",
        "clear_cache",
        "decide",
    ]


def test_composition_violations_name_their_axis() -> None:
    axes = {v.rule: v.axis for v in verdict_of("dp8xspxv2xpp1", GPT).violations}
    assert axes["sp_needs_tp"] == "tp"
    assert {v.rule: v.axis for v in verdict_of("pp5", GPT).violations}["divides[layers, pp]"] == "pp"
