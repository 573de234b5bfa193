"""One composition rules table: z3 (check) and the planner read the same rules, so they cannot
give two answers for one composition."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from checker._parse import parse
from checker._plan_rules import family_rules
from checker._planner import AXES, Cluster, DataParallel, Family, Offload, Pipeline, Workload, plan
from formal._model import Transformer
from formal._placement import Recompute, Schedule
from formal._presets import PRESETS
from formal._program import derive_program
from formal._rules import RULES, Provenance
from formal._smt import decide
from formal._verdict import Condition, Status
from formal._vocab import Axis

LLAMA = PRESETS["llama2-7b"]


def test_megatrons_interleaved_micro_batch_rule_is_a_note_in_check_and_in_plan() -> None:
    """m = 6 on pp = 4 with v = 2: any m trains the same model; Megatron-LM's interleaved
    schedule alone wants m % pp == 0. Both readers say so, and neither rejects it."""
    comp = parse("pp4xv2xm6xdp2", devices=8)
    verdict = decide(comp, derive_program(comp.placement(LLAMA), LLAMA), LLAMA, devices=8)
    assert verdict.status is Status.PROVED
    notes = [n for n in verdict.notes if n.startswith("framework rule")]
    assert notes == [
        "framework rule megatron_interleaved_m_multiple_of_pp: Megatron-LM's interleaved schedule "
        "needs the micro-batch count to be a multiple of pp (m 6, pp 4); other engines run it as is"
    ]
    # global batch 12 on dp2 with micro-batch size 1: m = 6
    result = plan(
        LLAMA,
        Cluster(devices=8, device_memory=10**15),
        Workload(global_batch=12, micro_batch_sizes=(1,)),
        top=1,
        decide=None,
    )
    located = result.locate(comp)
    assert located is not None, "the planner keeps the candidate"
    assert list(located[1].framework_notes(LLAMA)) == notes


def test_a_multiple_of_pp_has_no_note() -> None:
    comp = parse("pp4xv2xm8xdp2", devices=8)
    verdict = decide(comp, derive_program(comp.placement(LLAMA), LLAMA), LLAMA, devices=8)
    assert not [n for n in verdict.notes if n.startswith("framework rule")]


def test_megatrons_micro_batch_rule_concerns_its_interleaved_schedule_alone() -> None:
    """Megatron-LM raises its m % pp error in forward_backward_pipelining_with_interleaving only;
    forward_backward_pipelining_without_interleaving (1F1B) runs any m, and the other schedules
    are not Megatron's interleaved one: pp4 with m6 gets no framework note under them."""
    for text in ("pp4xm6xdp2", "pp4xgpipexm6xdp2", "pp4xzbxm6xdp2"):
        comp = parse(text, devices=8)
        verdict = decide(comp, derive_program(comp.placement(LLAMA), LLAMA), LLAMA, devices=8)
        assert verdict.status is Status.PROVED, text
        assert not [n for n in verdict.notes if n.startswith("framework rule")], text


def test_every_rule_has_a_provenance_and_a_unique_name() -> None:
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))  # divides[seq, cp] alone, divides[seq, tp] (cp*tp) under SP
    assert {r.provenance for r in RULES} == set(Provenance)


# A dense and a mixture-of-experts model with small sizes, so that the divisibility rules bite
# at small degrees: 6 heads (tp 4 breaks it), 12 layers (pp 8 breaks it), seq 24 (cp*tp 16 breaks it).
SMALL = Transformer(name="small", layers=12, hidden=96, heads=6, vocab=960, seq=24, kv_heads=3, ffn=384)
MOE = Transformer(name="small-moe", layers=12, hidden=96, heads=6, vocab=960, seq=24, experts=6, top_k=2, ffn=192)


@st.composite
def planner_candidates(draw: st.DrawFn) -> tuple[Transformer, Family, tuple[int, ...], int, bool]:
    model = draw(st.sampled_from([SMALL, MOE]))
    pipeline = draw(st.sampled_from([None, Pipeline(Schedule.ONE_F_ONE_B), Pipeline(Schedule.INTERLEAVED, 2)]))
    family = Family(
        draw(st.sampled_from(list(DataParallel))),
        Offload.NONE,
        pipeline,
        draw(st.booleans()),
        draw(st.sampled_from(list(Recompute))),
    )
    degrees = tuple(draw(st.sampled_from([1, 2, 3, 4, 8])) for _ in AXES)
    return model, family, degrees, draw(st.integers(1, 12)), draw(st.booleans())


@settings(max_examples=600, deadline=None)
@given(planner_candidates())
def test_the_planner_filters_exactly_what_z3_refutes(
    drawn: tuple[Transformer, Family, tuple[int, ...], int, bool],
) -> None:
    model, family, degrees, m, uneven = drawn
    deg = np.array([degrees], dtype=np.int64)
    rules = family_rules(family, model, uneven, deg, np.array([m], dtype=np.int64))
    canonical = (
        "no_pipeline_means_pp1",
        "pipeline_needs_pp",
        "hsdp_needs_both_axes",
        "dpr_only_with_hsdp",
        "sharding_needs_dp",
    )
    if not all(bool(mask[0]) for name, mask in rules.items() if name in canonical):
        return  # not this family's candidate (another family's text): nothing to compare
    planner_ok = all(bool(mask[0]) for name, mask in rules.items() if name not in canonical)
    layers_split = dict(zip(AXES, degrees, strict=True))[Axis.PP] * (family.pipeline.chunks if family.pipeline else 1)
    text = family.text(degrees, m, uneven and model.layers % layers_split != 0)
    comp = parse(text)
    if comp.options.sequence_parallel != family.sequence_parallel:
        return  # the text leaves sp out at tp 1: the candidate of the family without sp
    verdict = decide(comp, derive_program(comp.placement(model), model), model)
    z3_ok = verdict.condition_status(Condition.COMPOSITION) is Status.PROVED
    assert planner_ok == z3_ok, (text, {n: bool(v[0]) for n, v in rules.items()}, [v.rule for v in verdict.violations])
