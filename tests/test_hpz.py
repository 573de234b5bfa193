"""ZeRO++ hierarchical partitioning (hpZ): the ``hpz`` modifier, its verdicts, costs and simulation.

Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv 2306.10209), section 3.2: ZeRO-3 keeps one partition of the parameters over all
N data-parallel ranks; hpZ also keeps a secondary partition within each node of k ranks. The
forward all-gathers from the primary partition over all N, the backward from the secondary one
within the node; gradients are reduce-scattered over all N as in ZeRO-3. Cross-node traffic per
step drops from ZeRO-3's 3M (forward gather, backward gather, reduce-scatter) to 2M, for a
secondary partition of M/k per device (M: the model's parameters in their precision).

The composition ``zero3xhpz`` on N devices is ``zero3<k>xhpz-dpr<N/k>``: ZeRO-3 within the node
(dp) and, across nodes (dpr), parameters gathered in the forward and held through the backward.
Expected values below are computed from those formulas, never copied from the tool's output.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
import sympy as sp

from checker._parse import parse
from checker._toml import load
from formal._costs import communication, memory
from formal._model import DEFAULT_PRECISION
from formal._placement import Strategy
from formal._presets import PRESETS
from formal._program import Op, StepProgram, derive_program, group_sizes
from formal._reference import ReferenceModel
from formal._simulator import reference_for, simulate_program
from formal._smt import decide
from formal._strategies import Composition, zero
from formal._verdict import Status
from formal._vocab import Axis, OpKind, Phase, State
from formal.errors import CompositionError

GPT = PRESETS["gpt3-1.3b"]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "broken_hpz_no_backward_gather.toml"
P, G = State.PARAMETERS, State.GRADIENTS


def _psi() -> int:
    return sum(int(v) for v in group_sizes(GPT).values())


# --- the composition language ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "devices", "node", "expected"),
    [
        ("zero3xhpz", 16, 8, "zero38xhpz-dpr2"),
        ("zero3xhpz", 64, 8, "zero38xhpz-dpr8"),
        ("fsdp16xhpz", None, 8, "fsdp8xhpz-dpr2"),
        ("fsdp16xhpz", None, 4, "fsdp4xhpz-dpr4"),
        ("tp2xzero3xhpzxm4", 32, 8, "tp2xzero38xhpz-dpr2xm4"),
    ],
)
def test_hpz_splits_the_zero3_term_into_nodes_and_round_trips(
    text: str, devices: int | None, node: int, expected: str
) -> None:
    c = parse(text, devices=devices, node_size=node)
    assert str(c) == expected
    assert parse(str(c)) == c
    assert c.mesh()[Axis.DP] == node
    assert c.mesh()[Axis.DP] * c.mesh()[Axis.DPR] == (devices or 16) // c.mesh().get(Axis.TP, 1)


@pytest.mark.parametrize(
    ("text", "devices", "node", "message"),
    [
        ("zero3xhpz", 12, 8, "does not divide"),
        ("fsdp16xhpz", None, 3, "does not divide"),
        ("zero2xhpz", 16, 8, "needs a zero3 or fsdp term"),
        ("zero3xhpzxhpz", 16, 8, "given twice"),
        ("zero38xhpz2", None, 8, "takes no degree"),
        ("zero38xdpr2xhpz", None, 8, "already uses the dpr axis"),
    ],
)
def test_hpz_refuses_what_it_cannot_split(text: str, devices: int | None, node: int, message: str) -> None:
    with pytest.raises(CompositionError, match=message):
        parse(text, devices=devices, node_size=node)


def test_after_the_forward_a_device_holds_the_secondary_partition() -> None:
    """Along dp (the node) P is ZeRO-3's S*, regathered in the backward; along dpr (across nodes)
    it is held: sharded within the node, whole across nodes, P/k."""
    pl = parse("zero3xhpz", devices=16).placement(GPT)
    for group in pl.groups(P):
        dp, dpr = pl.entry(P, group, Axis.DP), pl.entry(P, group, Axis.DPR)
        assert (str(dp), str(dpr)) == ("S*", "S*+hold")
        for state in (State.OPTIMIZER, G):
            assert pl.mode(state, group, Axis.DP).is_sharded and pl.mode(state, group, Axis.DPR).is_sharded


# --- verdicts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [16, 64])
def test_zero3_with_hpz_is_proved_on_gpt3(devices: int) -> None:
    c = parse("zero3xhpz", devices=devices)
    verdict = decide(c, derive_program(c.placement(GPT), GPT), GPT, devices=devices)
    assert verdict.status is Status.PROVED, [v.rule for v in verdict.violations]


def test_hpz_without_the_backward_gather_within_the_node_is_refuted_with_a_readable_witness() -> None:
    user = load(EXAMPLE)
    c = parse("zero3xhpz", user.factories(), devices=16)
    verdict = decide(c, user.program_for(c.placement(GPT), GPT), GPT, devices=16)
    assert verdict.status is Status.REFUTED
    rules = {v.rule: v for v in verdict.violations}
    # within the node (dp) the backward reads shards it does not hold; across nodes (dpr) the
    # held copy is read, and that is fine
    assert {f"gather_before_use[P.{g.name}, dp]" for g in c.placement(GPT).groups(P)} == set(rules)
    first = rules["gather_before_use[P.attention, dp]"]
    assert first.witness["phase"] == "backward" and first.witness["degree"] == 8
    assert first.witness["read"] != first.witness["single_device"]


# --- costs against the paper's formulas ----------------------------------------------------------


def _two_level_zero3(k: int, n: int) -> Composition:
    """ZeRO-3 over N = k n devices seen as node x nodes: S* (not held) along both dp and dpr."""
    across = Strategy("zero3-dpr", Axis.DPR, n, zero(3).entries, frozenset())
    return Composition((zero(3).with_degree(k), across))


def _bytes(c: Composition, state: State, phase: Phase, axis: Axis) -> sp.Expr:
    program = derive_program(c.placement(GPT), GPT)
    return sp.Add(
        *(
            t.bytes
            for t in communication(program, DEFAULT_PRECISION)
            if t.state is state and t.phase == phase.value and t.axis is axis
        )
    )


@pytest.mark.parametrize(("devices", "k"), [(16, 8), (64, 8), (32, 4)])
def test_hpz_traffic_per_axis_follows_the_paper(devices: int, k: int) -> None:
    n = devices // k
    psi, b = _psi(), DEFAULT_PRECISION.parameters  # 2 bytes: fp16 parameters and gradients
    assert DEFAULT_PRECISION.wire_bytes_of(G) == b
    ring = {k: Fraction(k - 1, k), n: Fraction(n - 1, n)}
    hpz = parse("zero3xhpz", devices=devices, node_size=k)
    # forward: within the node on the primary shards (Psi/n whole along dp), then across nodes
    assert _bytes(hpz, P, Phase.FORWARD, Axis.DP) == ring[k] * Fraction(psi, n) * b
    assert _bytes(hpz, P, Phase.FORWARD, Axis.DPR) == ring[n] * psi * b
    # backward: within the node only, from the secondary partition (Psi/k, whole across nodes)
    assert _bytes(hpz, P, Phase.BACKWARD, Axis.DP) == ring[k] * psi * b
    assert _bytes(hpz, P, Phase.BACKWARD, Axis.DPR) == 0
    # gradients: reduce-scattered over the whole group, across nodes first
    assert _bytes(hpz, G, Phase.GRAD_SYNC, Axis.DPR) == ring[n] * psi * b
    assert _bytes(hpz, G, Phase.GRAD_SYNC, Axis.DP) == ring[k] * Fraction(psi, n) * b
    # ZeRO-3's forward gather and reduce-scatter are unchanged: (N-1)/N of M each, as flat ZeRO-3
    flat = parse(f"zero3{devices}")
    for state, phase in ((P, Phase.FORWARD), (G, Phase.GRAD_SYNC)):
        whole = _bytes(hpz, state, phase, Axis.DP) + _bytes(hpz, state, phase, Axis.DPR)
        assert whole == _bytes(flat, state, phase, Axis.DP) == Fraction(devices - 1, devices) * psi * b
    # cross-node traffic: 3M for ZeRO-3 on the same two-level mesh, 2M with hpZ (times (n-1)/n)
    two = _two_level_zero3(k, n)
    for c, gathers in ((two, 3), (hpz, 2)):
        across = sum(
            _bytes(c, s, ph, Axis.DPR) for s, ph in ((P, Phase.FORWARD), (P, Phase.BACKWARD), (G, Phase.GRAD_SYNC))
        )
        assert across == gathers * ring[n] * psi * b

    # what hpZ changes is the backward gather alone: the rest of the program is ZeRO-3's
    def others(c: Composition) -> list[Op]:
        return [
            op
            for op in derive_program(c.placement(GPT), GPT).ops
            if op.kind.is_collective and not (op.phase is Phase.BACKWARD and op.state is P)
        ]

    assert others(hpz) == others(two)


def test_hpz_counts_every_collective_once_per_micro_batch() -> None:
    one, four = (parse(f"zero3xhpzx{m}", devices=16) for m in ("m1", "m4"))
    for state, phase, axis in (
        (P, Phase.FORWARD, Axis.DPR),
        (P, Phase.BACKWARD, Axis.DP),
        (G, Phase.GRAD_SYNC, Axis.DPR),
    ):
        assert _bytes(four, state, phase, axis) == 4 * _bytes(one, state, phase, axis)


@pytest.mark.parametrize(("devices", "k"), [(16, 8), (64, 8)])
def test_hpz_memory_is_zero3s_plus_the_secondary_partition(devices: int, k: int) -> None:
    """Model states as ZeRO-3 over N (16 Psi / N, Rajbhandari et al. 2020, Figure 1); through the
    backward a device holds the secondary partition, Psi/k parameters in their precision. The
    model counts that copy as containing the device's own primary shard (as it counts FSDP's
    held copy), so the buffers exceed flat ZeRO-3's by Psi/k - Psi/N parameters; DeepSpeed
    allocates ``ds_secondary_tensor`` beside the primary shard
    (deepspeed/runtime/zero/partition_parameters.py, ``_partition_param_sec``), Psi/N more."""
    psi, b = _psi(), DEFAULT_PRECISION.parameters
    sizes = group_sizes(GPT)
    hpz = memory(parse("zero3xhpz", devices=devices, node_size=k).placement(GPT), GPT, DEFAULT_PRECISION, sizes)
    flat = memory(parse(f"zero3{devices}").placement(GPT), GPT, DEFAULT_PRECISION, sizes)
    assert hpz.model_states == flat.model_states == Fraction(16 * psi, devices)
    assert hpz.parameters.total == Fraction(psi * b, devices)
    assert hpz.buffers is not None and flat.buffers is not None
    secondary = hpz.parameters.total + (hpz.buffers - flat.buffers)
    assert secondary == Fraction(psi * b, k)


# --- the simulator: it reads the placement -------------------------------------------------------


def _small(text: str) -> tuple[Composition, ReferenceModel, StepProgram]:
    c = parse(text, node_size=2)
    model = reference_for(c)
    return c, model, derive_program(c.placement(model.transformer()), model.transformer())


@pytest.mark.parametrize("text", ["zero38xhpz", "fsdp8xhpzxm2", "zero34xhpzxtp2", "zero34xhpzxpp2"])
def test_hpz_trains_like_one_device_and_costs_what_the_model_says(text: str) -> None:
    _, model, program = _small(text)
    result = simulate_program(program, model, steps=1)
    assert result.matches, result.divergence
    assert not result.cost_mismatches


def _without(program: StepProgram, pick: object) -> StepProgram:
    return program.with_ops(op for op in program.ops if not pick(op))  # type: ignore[operator]


def _backward_gather(op: Op) -> bool:
    return op.kind is OpKind.ALL_GATHER and op.phase is Phase.BACKWARD


def _forward_gather_across(op: Op) -> bool:
    return op.kind is OpKind.ALL_GATHER and op.phase is Phase.FORWARD and op.axis is Axis.DPR


def _scatter_across(op: Op) -> bool:
    return op.kind is OpKind.REDUCE_SCATTER and op.axis is Axis.DPR


@pytest.mark.parametrize(
    ("pick", "axis"), [(_backward_gather, Axis.DP), (_forward_gather_across, Axis.DPR), (_scatter_across, Axis.DPR)]
)
def test_z3_and_the_simulator_agree_that_a_missing_collective_breaks_hpz(pick: object, axis: Axis) -> None:
    c, model, program = _small("zero38xhpz")
    broken = _without(program, pick)
    verdict = decide(c, broken, model.transformer())
    assert verdict.status is Status.REFUTED
    assert all(v.axis == axis.value for v in verdict.violations), [v.rule for v in verdict.violations]
    assert not simulate_program(broken, model, steps=1).matches


@pytest.mark.parametrize("text", ["zero32xhpz-dpr2xoffload-params", "fsdp-sgo2xoffload-params"])
def test_held_offloaded_parameters_need_no_second_fetch_for_the_backward(text: str) -> None:
    """After the forward a device keeps what the holding axes gathered, fetched offloaded
    parameters included (docs/semantics.md, "Execution order"): FSDP SGO the whole copy, hpZ its
    secondary partition, whose in-node shards the backward gathers again. So a program whose
    backward does not copy the parameters from the host a second time still trains like one
    device: the simulator says so, and z3 proves it along every axis."""
    c = parse(text)
    model = reference_for(c)
    program = derive_program(c.placement(model.transformer()), model.transformer())
    fetches = [op for op in program.ops if op.kind is OpKind.HOST_TO_DEVICE and op.phase is Phase.BACKWARD]
    assert fetches and all(op.state is State.PARAMETERS for op in fetches)
    once = program.with_ops(op for op in program.ops if op not in fetches)
    assert simulate_program(once, model, steps=1).matches
    verdict = decide(c, once, model.transformer())
    assert verdict.status is Status.PROVED, [v.rule for v in verdict.violations]


def test_the_gathers_may_run_across_nodes_first() -> None:
    """hpz-dpr2xzero34: the forward gathers across nodes first (a hierarchical gather, Psi/k
    across nodes); still the same training, on both sides."""
    c = parse("hpz-dpr2xzero34")
    model = reference_for(c)
    t = model.transformer()
    program = derive_program(c.placement(t), t)
    assert decide(c, program, t).status is Status.PROVED
    result = simulate_program(program, model, steps=1)
    assert result.matches and not result.cost_mismatches


# --- DeepSpeed: zero_optimization.zero_hpz_partition_size -----------------------------------------


def _deepspeed(node: object, stage: int = 3, batch: int | None = 16) -> dict[str, object]:
    doc: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "zero_hpz_partition_size": node},
    }
    if batch is not None:
        doc["train_batch_size"] = batch
    return doc


@pytest.mark.parametrize(
    ("node", "batch", "devices", "dp", "expected"),
    [
        (8, 16, None, 16, "zero38xhpz-dpr2"),  # dp = 16 / (micro 1 x gas 1): two nodes of 8
        (4, 64, None, 64, "zero34xhpz-dpr16"),
        (8, None, 32, 32, "zero38xhpz-dpr4"),  # dp from --devices
        (1, 16, None, 16, "zero316"),  # DeepSpeed's default: no secondary partition
        (0, 16, None, 16, "zero316"),
    ],
)
def test_deepspeed_hpz_partition_size_is_the_node(
    node: int, batch: int | None, devices: int | None, dp: int, expected: str
) -> None:
    from checker._importers import import_deepspeed

    imported = import_deepspeed(_deepspeed(node, batch=batch), devices=devices)
    assert imported.text == expected
    if node > 1:
        assert imported.composition == parse("zero3xhpz", devices=dp, node_size=node)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_deepspeed(8, stage=2), "needs stage 3"),
        (_deepspeed(8, batch=12), "does not divide the data-parallel degree 12"),
        (_deepspeed(-1), "expected a positive integer"),
    ],
)
def test_deepspeed_hpz_that_cannot_be_mapped_is_one_error(config: dict[str, object], message: str) -> None:
    from checker._importers import ConfigError, import_deepspeed

    with pytest.raises(ConfigError, match=message):
        import_deepspeed(config, devices=None)


def test_deepspeed_round_trip_keeps_the_node_size() -> None:
    import json

    from checker._exporters import Target, export
    from checker._importers import import_deepspeed

    c = parse("zero3xhpz", devices=32, node_size=4)
    doc = json.loads(export(c, GPT, Target.DEEPSPEED).text)
    assert doc["zero_optimization"]["zero_hpz_partition_size"] == 4
    assert doc["train_batch_size"] == GPT.micro_batch * 32  # DeepSpeed's dp is the whole group
    assert import_deepspeed(doc, devices=None).composition == c
