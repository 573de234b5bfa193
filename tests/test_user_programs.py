"""User step programs (``--strategies FILE`` with ``[[program]]`` ops) judged by z3 and by the simulator.

Each wrong program is one a person could write for their own training loop; each test states, from
single-device training, why it diverges (or not), and checks both directions: the wrong program is
refuted with a readable witness and the simulator diverges; its corrected form is proved and the
simulator matches single-device training bit for bit. The expected verdicts are argued in each
docstring from what single-device training computes: the mean over all samples of the per-sample
gradient (docs/semantics.md, "Gradient integrity", "Gradient buffers").
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from checker._parse import parse
from checker._simulate import reference_model, simulate
from checker._toml import load
from checker.cli import main
from formal._program import Op, derive_program
from formal._smt import decide
from formal._verdict import Status, Verdict, Violation
from formal._vocab import ATTENTION, Axis, OpKind, Phase, State
from formal.errors import InputError, StrategyFileError

pytestmark = pytest.mark.timeout(300)

MEAN_DP = """
[[program]]
op = "all_reduce"
axis = "dp"
reduce = "mean"
"""


def _judge(tmp_path: Path, composition: str, toml: str, *, simulated: bool = True) -> tuple[Verdict, bool | None]:
    """z3's verdict on the file's program over ``composition`` and whether the simulator matches."""
    path = tmp_path / "program.toml"
    path.write_text(toml, encoding="utf-8")
    user = load(path)
    c = parse(composition, user.factories())
    model = reference_model(c).transformer()
    verdict = decide(c, user.program_for(c.placement(model), model), model)
    matches = simulate(c, user).matches if simulated else None
    return verdict, matches


def _fired(verdict: Verdict, prefix: str) -> list[Violation]:
    return [v for v in verdict.violations if v.rule.startswith(prefix)]


def _refuted(verdict: Verdict, prefix: str) -> Violation:
    assert verdict.status is Status.REFUTED, verdict
    found = _fired(verdict, prefix)
    assert found, [v.rule for v in verdict.violations]
    return found[0]


def _proved(verdict: Verdict) -> None:
    assert verdict.status is Status.PROVED, [(v.rule, v.explanation) for v in verdict.violations]


# --------------------------------------------------------------------------- 1: broadcasts and all-gathers of G


def test_broadcast_of_the_unreduced_gradient_is_refuted(tmp_path: Path) -> None:
    """dp2, ``broadcast(G)`` from rank 0 then a mean all-reduce: both devices end with rank 0's local
    gradient g0 (the mean of g0 and g0), where single-device training has (g0 + g1)/2. Broadcasting
    after the reduction copies an already equal value and changes nothing: correct."""
    wrong = '[[program]]\nop = "broadcast"\nstate = "G"\naxis = "dp"\nphase = "grad_sync"\n' + MEAN_DP
    verdict, matches = _judge(tmp_path, "dp2", wrong)
    violation = _refuted(verdict, "reduction_closure[G.")
    assert "broadcast of the unreduced gradient" in violation.explanation
    w = violation.witness
    assert w["devices"]["0"] != w["single_device"]
    assert matches is False
    right = MEAN_DP + '[[program]]\nop = "broadcast"\nstate = "G"\naxis = "dp"\nphase = "grad_sync"\n'
    verdict, matches = _judge(tmp_path, "dp2", right)
    _proved(verdict)
    assert matches is True


def test_all_gather_of_the_unreduced_gradient_is_refuted(tmp_path: Path) -> None:
    """dp2, ``all_gather(G)`` of the unreduced gradient then a mean reduce-scatter: the gather gives
    every device device 0's piece of this element (g0), whose mean over two devices is g0, not
    (g0 + g1)/2. Gathering after a mean all-reduce copies equal values: correct."""
    gather = '[[program]]\nop = "all_gather"\nstate = "G"\naxis = "dp"\nphase = "grad_sync"\n'
    wrong = gather + '[[program]]\nop = "reduce_scatter"\naxis = "dp"\nreduce = "mean"\n'
    verdict, matches = _judge(tmp_path, "dp2", wrong)
    violation = _refuted(verdict, "reduction_closure[G.")
    assert "all_gather of the unreduced gradient" in violation.explanation
    assert matches is False
    verdict, matches = _judge(tmp_path, "dp2", MEAN_DP + gather)
    _proved(verdict)
    assert matches is True


def test_reduce_scatter_then_all_gather_of_the_gradient_is_right(tmp_path: Path) -> None:
    """dp2, a mean reduce-scatter then an all-gather of G: each device reduces its shard to the mean
    over both devices, and the gather gives every device every shard: the single-device gradient
    everywhere. (The simulator once left the gathered positions marked free and zeroed them at the
    end of gradient synchronisation: it diverged on this correct program while z3 proved it.)"""
    program = (
        '[[program]]\nop = "reduce_scatter"\naxis = "dp"\nreduce = "mean"\n'
        '[[program]]\nop = "all_gather"\nstate = "G"\naxis = "dp"\nphase = "grad_sync"\n'
    )
    verdict, matches = _judge(tmp_path, "dp2", program)
    _proved(verdict)
    assert matches is True


def test_an_all_reduce_after_a_reduce_scatter_of_the_gradient_is_refuted(tmp_path: Path) -> None:
    """dp2, replicated G, a mean reduce-scatter then a mean all-reduce. ``reduce_scatter_tensor``
    into the gradient's own shard (ZeRO-2, FSDP) leaves device 0 the mean m = (g0 + g1)/2 on shard
    0 and, outside it, its unreduced g0 or freed memory; device 1 holds g1 on shard 0. The
    all-reduce then gives shard 0 the value (m + g1)/2, not m: both z3 and the simulator refute it.
    Gathering the shards first makes every device hold m everywhere, and the all-reduce of equal
    values changes nothing: proved and matching."""
    scatter = '[[program]]\nop = "reduce_scatter"\naxis = "dp"\nreduce = "mean"\n'
    gather = '[[program]]\nop = "all_gather"\nstate = "G"\naxis = "dp"\nphase = "grad_sync"\n'
    verdict, matches = _judge(tmp_path, "dp2", scatter + MEAN_DP)
    assert verdict.status is Status.REFUTED
    assert _fired(verdict, "alignment[O/G.attention, dp]") or _fired(verdict, "reduction_closure[G.attention")
    assert matches is False
    verdict, matches = _judge(tmp_path, "dp2", scatter + gather + MEAN_DP)
    _proved(verdict)
    assert matches is True


# --------------------------------------------------------------------------- 2: forward-phase gradient ops


@pytest.mark.parametrize(
    "forward_op",
    [
        '[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "sum"\nphase = "forward"\n',
        '[[program]]\nop = "scale"\nscale = "2"\nphase = "forward"\n',
    ],
    ids=["sum-all-reduce", "scale-x2"],
)
def test_forward_gradient_ops_act_on_the_accumulated_buffer(tmp_path: Path, forward_op: str) -> None:
    """A forward-phase op on G acts on ``.grad``. With one micro-batch ``.grad`` is empty in the
    forward (zeroed at the step's start): the op changes nothing and the mean all-reduce gives the
    single-device mean. With two, the second forward finds the first micro-batch's gradient g1 in
    ``.grad``: a sum all-reduce turns it into g1_0 + g1_1 on both devices, a x2 scale into 2 g1,
    and the step's gradient is no longer (g1 + g2) averaged over the devices."""
    program = forward_op + MEAN_DP
    verdict, matches = _judge(tmp_path, "dp2xm2", program)
    violation = _refuted(verdict, "gradient_buffer[G.")
    assert "forward-phase" in violation.explanation and "2 micro-batches" in violation.explanation
    assert violation.witness["micro_batches"] == 2
    assert matches is False
    verdict, matches = _judge(tmp_path, "dp2", program)
    _proved(verdict)
    assert matches is True


# --------------------------------------------------------------------------- 3: fresh or accumulated backward ops


def test_backward_reduction_of_the_accumulated_grad_is_refuted(tmp_path: Path) -> None:
    """dp2xm2, a sum all-reduce of G after each micro-batch's backward, then one 1/2 scale. On the
    fresh gradient (a hook on the gradient tensor, before it is added to ``.grad``) each micro-batch
    is summed once: (g1_0 + g1_1 + g2_0 + g2_1)/2, the single-device mean. On the accumulated
    ``.grad`` (a loop that all-reduces ``p.grad`` after each backward) the second all-reduce sums
    the already summed g1 again: (2 (g1_0 + g1_1) + g2_0 + g2_1)/2. The default for a backward op
    is the fresh gradient (FSDP's post-backward hook)."""
    program = (
        '[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "sum"\nphase = "backward"\n{buffer}'
        '[[program]]\nop = "scale"\nscale = "1/2"\n'
    )
    verdict, matches = _judge(tmp_path, "dp2xm2", program.format(buffer='buffer = "accumulated"\n'))
    violation = _refuted(verdict, "gradient_buffer[G.")
    assert "accumulated .grad" in violation.explanation
    assert matches is False
    for buffer in ('buffer = "fresh"\n', ""):
        verdict, matches = _judge(tmp_path, "dp2xm2", program.format(buffer=buffer))
        _proved(verdict)
        assert matches is True


def test_a_mean_reduction_of_the_accumulated_grad_is_right(tmp_path: Path) -> None:
    """DDP reducing ``.grad`` after every micro-batch (no ``no_sync``) with a mean: after the first
    micro-batch ``.grad`` holds mean(g1) on both devices; the second mean gives
    mean(mean(g1) + g2) = mean(g1) + mean(g2), the single-device gradient: a mean of equal values
    is that value. Valid, although it moves twice the bytes."""
    program = (
        '[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "mean"\nphase = "backward"\nbuffer = "accumulated"\n'
    )
    verdict, matches = _judge(tmp_path, "dp2xm2", program)
    _proved(verdict)
    assert matches is True


def test_a_fresh_buffer_outside_the_backward_is_refused(tmp_path: Path) -> None:
    """After the micro-batch loop only ``.grad`` exists: naming the fresh buffer there is an input
    error, as is a buffer on a parameter op."""
    path = tmp_path / "p.toml"
    path.write_text(MEAN_DP + 'buffer = "fresh"\n', encoding="utf-8")
    with pytest.raises(StrategyFileError, match="fresh"):
        load(path)
    path.write_text('[[program]]\nop = "all_gather"\nstate = "P"\naxis = "dp"\nbuffer = "accumulated"\n')
    with pytest.raises(StrategyFileError, match="gradient ops"):
        load(path)
    assert issubclass(StrategyFileError, InputError)


def test_zero2_reduce_scatter_of_the_accumulated_grad_is_refuted(tmp_path: Path) -> None:
    """ZeRO-2 over dp2 with two micro-batches, a mean reduce-scatter after each backward. On the
    fresh gradient (as FSDP's post-backward hook) each micro-batch's shard is reduced once and
    accumulated: right. On the accumulated ``.grad`` the second reduce-scatter finds, at the
    other device's piece, that device's own unreduced g1 (a reduce-scatter writes only the
    owner's shard), so the owner gets (mean(g1) + g2_0 + g1_1 + g2_1)/2, not mean(g1) + mean(g2).
    (z3 once gave every device the reduced value inside the loop and proved it.)"""
    program = (
        '[[program]]\nop = "reduce_scatter"\naxis = "dp"\nreduce = "mean"\nphase = "backward"\n{buffer}'
        '[[program]]\nop = "all_gather"\nstate = "P"\naxis = "dp"\nphase = "refresh"\n'
    )
    verdict, matches = _judge(tmp_path, "zero22xm2", program.format(buffer='buffer = "accumulated"\n'))
    _refuted(verdict, "gradient_buffer[G.")
    assert matches is False
    verdict, matches = _judge(tmp_path, "zero22xm2", program.format(buffer=""))
    _proved(verdict)
    assert matches is True


def test_accumulated_buffer_ops_run_after_the_fresh_ones(tmp_path: Path) -> None:
    """Within a micro-batch the ops on the fresh gradient run first, then it is added to ``.grad``,
    then the ops on ``.grad``, whatever their order in the file: an all-gather of ``.grad`` listed
    before a mean all-reduce of the fresh gradient gathers the reduced gradient (equal everywhere:
    right), even with one micro-batch. Listed on the fresh buffer it gathers the unreduced one."""
    program = (
        '[[program]]\nop = "all_gather"\nstate = "G"\naxis = "dp"\nphase = "backward"\nbuffer = "{buffer}"\n'
        + MEAN_DP
        + 'phase = "backward"\nbuffer = "fresh"\n'
    )
    verdict, matches = _judge(tmp_path, "dp2", program.format(buffer="accumulated"))
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, "dp2", program.format(buffer="fresh"))
    _refuted(verdict, "reduction_closure[G.")
    assert matches is False


# --------------------------------------------------------------------------- 6: scales of P and O


@pytest.mark.parametrize("state", ["P", "O"])
def test_a_scale_of_parameters_or_optimizer_state_is_refuted(tmp_path: Path, state: str) -> None:
    """dp2 with a mean all-reduce and a 1/2 scale of P (or O): single-device training never scales
    its parameters or optimizer state, so the update reads P0/2 where one device reads P0. Scaling by
    1/2 and then by 2 restores the value exactly: correct."""
    half = f'[[program]]\nop = "scale"\nstate = "{state}"\nscale = "1/2"\n'
    verdict, matches = _judge(tmp_path, "dp2", MEAN_DP + half)
    violation = _refuted(verdict, f"scaled_state[{state}.")
    assert f"1/2*{state}0[" in violation.witness["read"]
    assert matches is False
    double = f'[[program]]\nop = "scale"\nstate = "{state}"\nscale = "2"\n'
    verdict, matches = _judge(tmp_path, "dp2", MEAN_DP + half + double)
    _proved(verdict)
    assert matches is True


# --------------------------------------------------------------------------- 7: normalisation across axes


SUM_DP_CP = """
[[program]]
op = "all_reduce"
axis = "dp"
reduce = "sum"
[[program]]
op = "all_reduce"
axis = "cp"
reduce = "sum"
[[program]]
op = "scale"
scale = "{scale}"
"""


def test_one_scale_normalising_two_axes(tmp_path: Path) -> None:
    """Megatron-Core DDP with ``average_in_collective=False``: sum over dp and cp, then one scale by
    1/(dp x cp). Each of the 4 devices' gradient is its local mean over its samples and sequence
    chunk; the single-device gradient is their mean, the sum over both axes divided by 4, wherever
    the 1/4 is applied. A scale of 1/2 leaves the cp factor out: twice the single-device value."""
    verdict, matches = _judge(tmp_path, "dp2xcp2", SUM_DP_CP.format(scale="1/4"))
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, "dp2xcp2", SUM_DP_CP.format(scale="1/2"))
    violation = _refuted(verdict, "normalisation[G.")
    assert violation.axis == "cp"
    w = violation.witness
    assert Fraction(str(w["devices"]["0"])) == 2 * Fraction(str(w["single_device"])) != 0
    assert matches is False


HSDP = """
[[program]]
op = "all_gather"
state = "P"
axis = "dp"
phase = "forward"
[[program]]
op = "all_gather"
state = "P"
axis = "dp"
phase = "backward"
[[program]]
op = "reduce_scatter"
axis = "dp"
reduce = "sum"
[[program]]
op = "all_reduce"
axis = "dpr"
reduce = "sum"
[[program]]
op = "scale"
scale = "{scale}"
"""


def test_hsdp_normalised_once_over_shard_and_replicate_axes(tmp_path: Path) -> None:
    """HSDP over 2 x 2 devices summing along the shard and the replicate axes, then one scale: the
    single-device gradient is the mean over the 4 replicas' samples, so 1/4 is right and 1/2 (the
    shard axis' degree only) doubles it."""
    verdict, matches = _judge(tmp_path, "fsdp2xdpr2", HSDP.format(scale="1/4"))
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, "fsdp2xdpr2", HSDP.format(scale="1/2"))
    _refuted(verdict, "normalisation[G.")
    assert matches is False


DENSE_GROUPS = ("attention", "row_bias", "norm", "final_norm", "embedding", "router")


def test_expert_data_parallel_normalised_over_dp_and_ep(tmp_path: Path) -> None:
    """MoE over a 2 x 2 (dp, ep) mesh, Megatron-LM's layout: the dense gradients are summed over dp
    and ep (every device sees its own tokens), the experts' over dp only (ep places different
    experts), then one scale by 1/(dp x ep) = 1/4. A device's expert gradient sums its ep group's
    tokens over their local batch (the all-to-all brings them), so the dp sum times 1/4 is the
    single-device mean too. 1/2 doubles every dense gradient."""
    program = (
        '[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "sum"\n'
        + "".join(f'[[program]]\nop = "all_reduce"\naxis = "ep"\nreduce = "sum"\ngroup = "{g}"\n' for g in DENSE_GROUPS)
        + '[[program]]\nop = "scale"\nscale = "{scale}"\n'
    )
    verdict, matches = _judge(tmp_path, "dp2xep2", program.format(scale="1/4"))
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, "dp2xep2", program.format(scale="1/2"))
    violation = _refuted(verdict, "normalisation[G.attention")
    assert violation.axis == "ep"
    assert matches is False


def test_an_all_reduce_of_the_experts_along_ep_is_refuted(tmp_path: Path) -> None:
    """Summing every group's gradient over ep, the experts included: device 0's expert tensor holds
    expert 0, device 1's expert 1, and ``all_reduce`` adds them element by element, so each device's
    expert ends as the sum of two different experts' gradients, not its own. (The simulator once
    summed by global parameter index, as if each device held every expert, and matched single-device
    training while z3 refuted: the simulator was wrong.)"""
    program = SUM_DP_CP.replace('axis = "cp"', 'axis = "ep"').format(scale="1/4")
    verdict, matches = _judge(tmp_path, "dp2xep2", program)
    _refuted(verdict, "reduction_closure[G.experts, ep]")
    assert not _fired(verdict, "normalisation[G.attention")
    assert matches is False


def test_a_reduce_scatter_of_the_experts_along_ep_is_refuted(tmp_path: Path) -> None:
    """The dense gradients as Megatron-LM reduces them, the experts' reduce-scattered over ep:
    ``reduce_scatter_tensor`` sums device 0's expert-0 tensor with device 1's expert-1 tensor element
    by element and leaves each half of that sum, so no device holds its own expert's gradient.
    (The simulator once reduced by global parameter index and matched while z3 refuted: the
    simulator was wrong.)"""
    program = (
        '[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "sum"\n'
        + "".join(f'[[program]]\nop = "all_reduce"\naxis = "ep"\nreduce = "sum"\ngroup = "{g}"\n' for g in DENSE_GROUPS)
        + '[[program]]\nop = "reduce_scatter"\naxis = "ep"\nreduce = "sum"\ngroup = "experts"\n'
        + '[[program]]\nop = "scale"\nscale = "1/4"\n'
    )
    verdict, matches = _judge(tmp_path, "dp2xep2", program)
    _refuted(verdict, "reduction_closure[G.experts, ep]")
    assert matches is False


def _per_micro_batch_dp_then_cp(reduce: str, scale: str) -> str:
    return (
        f'[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "{reduce}"\nphase = "backward"\n'
        'buffer = "accumulated"\n'
        '[[program]]\nop = "all_reduce"\naxis = "cp"\nreduce = "sum"\n'
        f'[[program]]\nop = "scale"\nscale = "{scale}"\n'
    )


def test_a_per_micro_batch_mean_of_grad_with_a_later_cp_normaliser(tmp_path: Path) -> None:
    """dp2 x cp2 with three micro-batches: ``.grad`` mean all-reduced over dp after each backward
    (what the earlier micro-batches left is already equal over dp, so only the new gradient is
    averaged), then summed over cp once and scaled by 1/2: the mean over dp and over cp, the
    single-device gradient. (z3 once named the per-micro-batch mean a ``gradient_buffer`` defect
    on dp, which kept the cross-axis normaliser from being read off, and refuted this right
    program; the simulator was right.) Scaled by 1/4 the cp sum is halved twice: a normaliser
    defect; a sum all-reduce of ``.grad`` sums the earlier micro-batches again: a buffer defect."""
    verdict, matches = _judge(tmp_path, "dp2xcp2xm3", _per_micro_batch_dp_then_cp("mean", "1/2"))
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, "dp2xcp2xm3", _per_micro_batch_dp_then_cp("mean", "1/4"))
    _refuted(verdict, "normalisation[G.attention")
    assert not _fired(verdict, "gradient_buffer[")
    assert matches is False
    verdict, matches = _judge(tmp_path, "dp2xcp2xm3", _per_micro_batch_dp_then_cp("sum", "1/4"))
    _refuted(verdict, "gradient_buffer[G.attention, dp]")
    assert matches is False


OFFLOADED = '[[program]]\nop = "host_to_device"\nstate = "P"\nphase = "refresh"\n'
BACKWARD_MEAN = '[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "mean"\nphase = "backward"\n'


def _host_copy(buffer: str) -> str:
    return f'[[program]]\nop = "device_to_host"\nstate = "G"\nphase = "backward"\nbuffer = "{buffer}"\n'


@pytest.mark.parametrize("m", [2, 3])
def test_a_host_copy_of_grad_inside_the_loop_copies_what_is_accumulated(tmp_path: Path, m: int) -> None:
    """ZeRO-Offload-like dp2 with m micro-batches: each fresh gradient is mean all-reduced, added
    to ``.grad``, and ``.grad`` is copied to the host after every backward. ``p.grad.copy_``
    copies what is accumulated so far, so the last copy holds the sum of the m reduced
    micro-batch gradients: the single-device gradient (z3 once took a copy inside the loop for an
    empty one and refuted this program; the simulator was right). Copying the fresh buffer instead
    keeps only the last micro-batch's gradient, 1/m of the sum: wrong on both sides."""
    composition = f"dp2xoffloadxm{m}"
    verdict, matches = _judge(tmp_path, composition, BACKWARD_MEAN + _host_copy("accumulated") + OFFLOADED)
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, composition, BACKWARD_MEAN + _host_copy("fresh") + OFFLOADED)
    violation = _refuted(verdict, "transfer_after_reduction[G.attention")
    assert "last micro-batch" in violation.explanation
    assert matches is False


def test_a_host_copy_of_the_fresh_gradient_with_one_micro_batch_is_the_gradient(tmp_path: Path) -> None:
    """With one micro-batch the fresh gradient, reduced before the copy, is the whole step's
    gradient: the copy is right (the simulator once copied ``.grad`` before the accumulation, an
    empty buffer, and diverged while z3 proved it). Copied before the reduction it is the local
    gradient: wrong on both sides."""
    verdict, matches = _judge(tmp_path, "dp2xoffload", BACKWARD_MEAN + _host_copy("fresh") + OFFLOADED)
    _proved(verdict)
    assert matches is True
    verdict, matches = _judge(tmp_path, "dp2xoffload", _host_copy("fresh") + BACKWARD_MEAN + OFFLOADED)
    _refuted(verdict, "transfer_after_reduction[G.attention")
    assert matches is False


# --------------------------------------------------------------------------- properties


@st.composite
def reductions_per_micro_batch(draw: st.DrawFn) -> tuple[int, int, str, str]:
    """(dp degree, micro-batches, reduce, buffer) of a backward all-reduce run with each micro-batch."""
    return (
        draw(st.sampled_from([2, 3])),
        draw(st.sampled_from([1, 2, 3])),
        draw(st.sampled_from(["sum", "mean"])),
        draw(st.sampled_from(["fresh", "accumulated"])),
    )


@pytest.mark.parametrize("examples", [pytest.param(6, id="default"), pytest.param(24, marks=pytest.mark.slow)])
def test_backward_reductions_follow_their_buffer(tmp_path: Path, examples: int) -> None:
    """A backward all-reduce over d devices with each of m micro-batches, then a scale by 1/d after a
    sum (1 after a mean). On the fresh gradient each micro-batch is reduced once: right. On the
    accumulated ``.grad`` (a_j = R(a_{j-1} + g_j)) a sum gives a_m = sum_j d^(m-j) S(g_j), right
    iff m = 1; a mean gives a_m = sum_j M(g_j), always right. Single-device training has
    sum_j S(g_j)/d. z3 and the simulator must both give that verdict."""

    @settings(max_examples=examples, database=None)
    @given(reductions_per_micro_batch())
    def check(case: tuple[int, int, str, str]) -> None:
        d, m, reduce, buffer = case
        program = (
            f'[[program]]\nop = "all_reduce"\naxis = "dp"\nreduce = "{reduce}"\nphase = "backward"\n'
            f'buffer = "{buffer}"\n[[program]]\nop = "scale"\nscale = "{"1/d" if reduce == "sum" else "1"}"\n'
            'axis = "dp"\n'
        )
        expected = buffer == "fresh" or reduce == "mean" or m == 1
        verdict, matches = _judge(tmp_path, f"dp{d}xm{m}", program)
        assert (verdict.status is Status.PROVED) is expected, [v.rule for v in verdict.violations]
        assert matches is expected

    check()


@st.composite
def normalisers(draw: st.DrawFn) -> tuple[list[tuple[Fraction, str | None, str]], bool, int]:
    """Scales over a dp2xcp2 mesh after sum reductions along both axes: factors, each on dp, cp or
    no axis, in the backward (on each micro-batch's fresh gradient), grad_sync or optimizer phase;
    whether their product is 1/4; and the micro-batches (1 or 2)."""
    factors = draw(st.lists(st.sampled_from([Fraction(1, 2), Fraction(1, 4), Fraction(2), Fraction(3)]), max_size=3))
    right = draw(st.booleans())
    product = Fraction(1)
    for f in factors:
        product *= f
    last = Fraction(1, 4) / product if right else Fraction(1, 8) / product
    placed = [
        (f, draw(st.sampled_from(["dp", "cp", None])), draw(st.sampled_from(["backward", "grad_sync", "optimizer"])))
        for f in [*factors, last]
    ]
    return placed, right, draw(st.sampled_from([1, 2]))


@pytest.mark.parametrize("examples", [pytest.param(5, id="default"), pytest.param(30, marks=pytest.mark.slow)])
def test_normalisation_is_the_product_of_every_scale(tmp_path: Path, examples: int) -> None:
    """Each of the 4 devices of dp2xcp2 holds the mean over its own samples and sequence chunk; the
    single-device gradient is the sum of the 4 divided by 4. Sum reductions along dp and cp then
    scales: every op is linear, so the gradient is right iff the scales multiply to 1/4, whatever
    axis and phase each is on, a backward scale applying to each micro-batch's fresh gradient and so
    to their sum (a wrong product here is 1/8: half the single-device value)."""

    @settings(max_examples=examples, database=None)
    @given(normalisers())
    def check(case: tuple[list[tuple[Fraction, str | None, str]], bool, int]) -> None:
        placed, right, m = case
        program = SUM_DP_CP.split('[[program]]\nop = "scale"')[0]
        for factor, axis, phase in placed:
            where = f'axis = "{axis}"\n' if axis is not None else ""
            program += f'[[program]]\nop = "scale"\nscale = "{factor}"\nphase = "{phase}"\n{where}'
        verdict, matches = _judge(tmp_path, f"dp2xcp2xm{m}", program)
        assert (verdict.status is Status.PROVED) is right, [v.rule for v in verdict.violations]
        assert matches is right

    check()


# --------------------------------------------------------------------------- refusals


def test_an_unmodelled_gradient_op_is_refused_not_ignored() -> None:
    """A send/recv or all-to-all of the gradient (which no strategy file can write, but a program
    built in code can) has no meaning the encoding gives it: the verdict refuses it by name."""
    c = parse("dp2")
    model = reference_model(c).transformer()
    derived = derive_program(c.placement(model), model)
    for kind in (OpKind.SEND_RECV, OpKind.ALL_TO_ALL):
        for state in (State.GRADIENTS, State.PARAMETERS):
            extra = Op(kind, state, ATTENTION, Axis.DP, Phase.GRAD_SYNC)
            with pytest.raises(InputError, match=kind.value):
                decide(c, derived.with_ops([*derived.ops, extra]), model)


def test_too_many_micro_batches_on_the_accumulated_buffer_are_refused(tmp_path: Path) -> None:
    """The loop is modelled micro-batch by micro-batch only when an op acts on ``.grad`` inside it;
    past 16 such micro-batches the encoding refuses (an input error), it does not approximate."""
    program = '[[program]]\nop = "scale"\nscale = "2"\nphase = "forward"\n' + MEAN_DP
    with pytest.raises(InputError, match="micro-batches"):
        _judge(tmp_path, "dp2xm32", program, simulated=False)
    verdict, _ = _judge(tmp_path, "dp2xm32", MEAN_DP, simulated=False)
    _proved(verdict)


def test_the_cli_refuses_a_fresh_buffer_after_the_backward_in_one_line(tmp_path: Path) -> None:
    """Exit 2 with one line naming the op: a fresh gradient does not exist in grad_sync."""
    path = tmp_path / "p.toml"
    path.write_text(MEAN_DP + 'buffer = "fresh"\n', encoding="utf-8")
    result = CliRunner().invoke(main, ["dp2", "--strategies", str(path)])
    assert result.exit_code == 2
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "program[1]" in lines[0] and "fresh" in lines[0], lines
