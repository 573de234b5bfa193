"""Pipeline schedules, one object each (docs/semantics.md, "Pipeline schedules").

A schedule decides the order in which pipeline stages run the forward and backward passes of
the micro-batches of one step. It does not change any value the step computes (every
micro-batch's gradient is computed once, from the same activations, and accumulation is a sum),
so it is no part of the verdict; it decides memory (how many micro-batches' activations a stage
holds at its peak, and anything else it keeps), the pipeline bubble, how often a device sends to
its neighbours, and how frameworks and the composition language spell it. Each object below
owns exactly that; costs, the step program, the simulator, the planner, exporters, importers
and the PyTorch harness ask it (``schedule_of``) and never match on a schedule's name.

Conventions: ``p`` is the pipeline degree (stages), ``m`` the micro-batches per step, ``v`` the
model chunks (virtual stages) per device, 1 unless the schedule is chunked. ``p`` and ``m`` may
be sympy symbols (the planner derives its cost core with them symbolic); every formula is exact.
Activation counts are in whole-stage units: one unit is one micro-batch's activations of every
layer the device holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from enum import StrEnum

from formal import _num as num
from formal._num import Num
from formal._vocab import LAYER_IO, LINEAR_INNER, Group, Stage


class Schedule(StrEnum):
    """The pipeline schedules the checker knows; each has one object in ``SCHEDULES``."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE_H1 = "zb-h1"


# Framework names as the exporters pass them to their refusals (``checker._exporters``).
TORCHTITAN, DEEPSPEED, MEGATRON = "torchtitan", "DeepSpeed", "Megatron-LM"


class PipelineSchedule(ABC):
    """What one pipeline schedule means. Subclasses give the formulas; the attributes say how
    the composition language and the frameworks spell it.

    ``term``: the composition-language modifier that selects it (None: one with a count, ``v<N>``,
    which the parser reads itself); ``help_term`` and ``help``: its line in the modifier list.
    ``default``: the schedule a pipeline runs when no modifier names one (never written out).
    ``chunked``: each device holds ``chunks`` model chunks (the ``v<N>`` count); otherwise one.
    ``torchtitan``: the value of torchtitan's ``[parallelism] pipeline_parallel_schedule``
    (``torch.distributed.pipelining.schedules.get_schedule_class`` names); ``pytorch``: the
    single-stage class of ``torch.distributed.pipelining`` that runs it (None: not single-stage);
    ``megatron_flag``: the Megatron-LM argument that selects it, given the layers per virtual
    stage (None: Megatron-LM's default schedule, or one it cannot run); ``refusals``: per framework,
    what its exporter says it cannot express when the framework has no spelling for this schedule.
    ``deferred_activations``: activations the schedule keeps after a micro-batch's backward has
    run on a stage, per transformer layer and micro-batch, as ``(group, elements per sbh)``: the
    elements are split along tp and cp as that activation group is (``peak_activations``, below,
    says how many micro-batches keep them at the peak).
    """

    kind: Schedule
    term: str | None = None
    help_term: str = ""
    help: str = ""
    default: bool = False
    chunked: bool = False
    torchtitan: str | None = None
    pytorch: str | None = None
    megatron_flag: str | None = None
    refusals: tuple[tuple[str, str], ...] = ()
    deferred_activations: tuple[tuple[Group, int], ...] = ()

    def virtual_stages(self, chunks: int) -> int:
        """Model chunks per device: the ``v<N>`` count for a chunked schedule, else 1."""
        return chunks if self.chunked else 1

    def boundary_sends(self, chunks: int) -> int:
        """Times one micro-batch crosses a device boundary in one direction, per phase: once per
        model chunk a device holds (its activation forward, its gradient backward)."""
        return self.virtual_stages(chunks)

    def modifier_terms(self, chunks: int) -> tuple[str, ...]:
        """The composition-language terms that spell this schedule in canonical text."""
        if self.default:
            return ()
        if self.chunked:
            return (f"v{chunks}",)
        assert self.term is not None
        return (self.term,)

    def label(self, chunks: int) -> str:
        """How reports name it: ``1f1b``, ``gpipe``, ``interleaved-v2``."""
        return f"{self.kind.value}-v{chunks}" if self.chunked else self.kind.value

    def refusal(self, framework: str) -> str | None:
        """What ``framework``'s exporter cannot express of this schedule; None when it can."""
        return dict(self.refusals).get(framework)

    def actions(self, p: int, m: int, index: int) -> list[str] | None:
        """The order in which stage ``index`` runs its micro-batches' forwards (``F``) and
        backwards (``B``) in one step; None where it is not modelled."""
        return None

    @abstractmethod
    def in_flight(self, p: Num, m: Num, v: Num, stage: Stage) -> Num:
        """Micro-batches whose activations a device of ``stage`` holds at its peak; for a middle
        stage, an upper bound (the first stage's)."""

    @abstractmethod
    def stage_in_flight(self, p: Num, m: Num, v: Num, index: int) -> Num:
        """Micro-batches whose activations pipeline stage ``index`` (0 .. p-1) holds at its peak."""

    def peak_activations(
        self,
        p: Num,
        m: Num,
        v: Num,
        whole: Num,
        deferred: Num,
        stage: Stage,
        index: int | None = None,
    ) -> Num:
        """Activation bytes a device holds at its peak: on pipeline stage ``index`` (0 .. p-1),
        or, without one, on a device of ``stage`` (a middle stage: an upper bound). ``whole``:
        the bytes one micro-batch holds on the device from its forward until its backward;
        ``deferred``: the bytes it keeps after its backward for deferred work (from
        ``deferred_activations``). A schedule that defers nothing holds ``in_flight`` wholes."""
        live = self.in_flight(p, m, v, stage) if index is None else self.stage_in_flight(p, m, v, index)
        return whole * live

    @abstractmethod
    def bubble_fraction(self, p: Num, m: Num, v: Num) -> Num:
        """Idle time of a stage over its compute time in one step (the pipeline bubble)."""


class OneFOneB(PipelineSchedule):
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM", section 2.2): stage i runs p - i warm-up forwards, then
    alternates one forward and one backward, so it holds at most min(p - i, m) micro-batches;
    the last stage holds one. Its bubble is GPipe's, (p - 1)/m of the compute."""

    kind = Schedule.ONE_F_ONE_B
    term = "1f1b"

    def actions(self, p: int, m: int, index: int) -> list[str] | None:
        """``min(p - i, m)`` warm-up forwards, then a backward and a forward in turn, then the
        remaining backwards (``torch.distributed.pipelining.Schedule1F1B``)."""
        warm = min(p - index, m)
        return ["F"] * warm + ["B", "F"] * (m - warm) + ["B"] * warm

    help_term = "1f1b"
    help = "1F1B pipeline schedule (the default)"
    default = True
    torchtitan: str | None = "1F1B"
    pytorch: str | None = "Schedule1F1B"

    def in_flight(self, p: Num, m: Num, v: Num, stage: Stage) -> Num:
        return 1 if stage == Stage.LAST else num.minimum(p, m)

    def stage_in_flight(self, p: Num, m: Num, v: Num, index: int) -> Num:
        return num.minimum(p - index, m)

    def bubble_fraction(self, p: Num, m: Num, v: Num) -> Num:
        return num.ratio(p - 1, m)


class GPipe(PipelineSchedule):
    """GPipe (Huang et al. 2019): every forward, then every backward, so every stage holds all m
    micro-batches; bubble (p - 1)/m (Narayanan et al. 2021, section 2.2)."""

    kind = Schedule.GPIPE
    term = "gpipe"

    def actions(self, p: int, m: int, index: int) -> list[str] | None:
        """Every forward, then every backward."""
        return ["F"] * m + ["B"] * m

    help_term = "gpipe"
    help = "GPipe pipeline schedule (all forwards, then all backwards)"
    torchtitan = "GPipe"
    pytorch = "ScheduleGPipe"
    # DeepSpeed's PipelineEngine runs only its 1F1B TrainSchedule; Megatron-LM has no GPipe.
    refusals = ((DEEPSPEED, "an interleaved or GPipe schedule"), (MEGATRON, "a GPipe schedule"))

    def in_flight(self, p: Num, m: Num, v: Num, stage: Stage) -> Num:
        return m

    def stage_in_flight(self, p: Num, m: Num, v: Num, index: int) -> Num:
        return m

    def bubble_fraction(self, p: Num, m: Num, v: Num) -> Num:
        return num.ratio(p - 1, m)


class Interleaved(PipelineSchedule):
    """Interleaved 1F1B with v model chunks per device (Narayanan et al. 2021, section 2.2).

    First stage: min(p, m) x (1 + (p - 1)/(p v)) (Korthikanti et al. 2022, section 4.2.3). Per
    stage: Megatron-LM's ``forward_backward_pipelining_with_interleaving`` warms up
    2 (p - i - 1) + (v - 1) p chunk-micro-batches on rank i, so rank i holds
    min(m v, 2 (p - i - 1) + (v - 1) p + 1) chunks of 1/v of its layers; the last stage
    min(m v, (v - 1) p + 1) / v (for rank 0 the same count gives Korthikanti's formula). Bubble
    (p - 1)/(v m). Each micro-batch crosses every device boundary once per chunk.
    """

    kind = Schedule.INTERLEAVED
    help_term = "v<N>"
    help = "interleaved pipeline schedule with N model chunks per device"
    chunked = True
    torchtitan = "Interleaved1F1B"
    megatron_flag = "--num-layers-per-virtual-pipeline-stage"
    refusals = ((DEEPSPEED, "an interleaved or GPipe schedule"),)

    def in_flight(self, p: Num, m: Num, v: Num, stage: Stage) -> Num:
        if stage == Stage.LAST:
            return num.ratio(num.minimum(m * v, (v - 1) * p + 1), v)
        return num.canonical(num.minimum(p, m) * (1 + num.ratio(p - 1, p * v)))

    def stage_in_flight(self, p: Num, m: Num, v: Num, index: int) -> Num:
        return num.ratio(num.minimum(m * v, 2 * (p - index - 1) + (v - 1) * p + 1), v)

    def bubble_fraction(self, p: Num, m: Num, v: Num) -> Num:
        return num.ratio(p - 1, v * m)


class ZeroBubbleH1(OneFOneB):
    """ZB-H1 (Qi, Wan, Huang and Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024,
    arXiv 2401.10241, section 2.1). Each backward is split into B, the gradient of the stage's
    input, which the previous stage waits for, and W, the gradient of its weights, which nothing
    waits for. F and B run in 1F1B's order (so the sends are 1F1B's: B sends what 1F1B's backward
    sends, W sends nothing); stage i runs each W i micro-batches after its B, so every stage has
    min(p, m) micro-batches whose forward has run and whose W has not (the paper: "all workers
    maintain the same number of in-flight microbatches").

    Bubble. With T_F = T_B = T_W, the paper's assumption for its handcrafted schedules, section 2
    gives ZB-H1's bubble as (p - 1)(T_F + T_B - T_W) against 1F1B's (p - 1)(T_F + T_B + T_W): a
    third, (p - 1)/(3m) of the compute m (T_F + T_B + T_W). That needs m >= p: the W passes that
    fill the drain are the earlier micro-batches'. With fewer, the same rule leaves
    (p - 1)(T_F + T_B) - (m - 1) T_W, so in all (p - 1 + max(0, p - m)) / (3m) (an event
    simulation of the schedule checks both, tests/test_zero_bubble.py).

    Memory. B frees what only it reads; W reads the inputs of the layer's linear layers and the
    gradients of their outputs, kept until it runs. The authors' runtime charges them 32sbh bytes
    per layer beside Korthikanti's 34sbh + 5as^2b of a whole micro-batch
    (megatron/core/pipeline_parallel/zerobubble/runtime.py in sail-sg/zero-bubble-pipeline-
    parallelism: ``f_mem_approx = 34 * hidden_size + 5 * num_attention_heads * seq_length``,
    ``w_mem_approx = - 32 * hidden_size``). Element by element at 16 bits: the inputs of QKV,
    the attention output projection, FC1 and FC2 (sbh, sbh, sbh, 4sbh) and the gradients of their
    outputs (3sbh, sbh, 4sbh, sbh), 16sbh elements. Under tensor parallelism the column-parallel
    layers' inputs (QKV, FC1) and the row-parallel layers' output gradients (attention
    projection, FC2) are whole on every rank, 4sbh placed like ``layer_io`` (sequence-split
    under sequence parallelism); the other 12sbh are split, like ``linear_inner``. The input
    and output layers' weight gradients are taken with their B (the paper's Table 1 counts
    transformer layers only).

    Stage i peaks right after a forward, holding min(p - i, m) whole micro-batches (1F1B's count)
    and min(p, m) - min(p - i, m) deferred ones, or right after a backward, before its W, holding
    min(p, m) - min(i + 1, m) whole and min(i + 1, m) deferred: the larger. Stage 0 runs each W
    right after its B, so while a deferred micro-batch keeps less than a whole one (the paper's
    M_W < M_B, Table 1) it peaks at 1F1B's min(p, m) wholes and is the most loaded, as the paper
    says; full recomputation keeps less of a whole micro-batch than W reads, and then the
    after-backward peak counts.
    """

    kind = Schedule.ZERO_BUBBLE_H1
    term = "zb"
    help_term = "zb"
    help = "ZB-H1 zero-bubble pipeline schedule: backward split into input and weight gradients (Qi et al. 2024)"
    default = False
    torchtitan = None  # see refusals
    pytorch = None  # PyTorch's ZB1P, ScheduleInterleavedZeroBubble, is a multi-stage schedule
    refusals = (
        # torchtitan/distributed/pipeline_parallel.py: a multi-stage schedule needs two or more
        # stages per rank, and ScheduleZBVZeroBubble exactly two in a V; ZB-H1 runs one per rank.
        (
            TORCHTITAN,
            "ZB-H1 (its zero-bubble schedules, InterleavedZeroBubble and ZBVZeroBubble, run two or "
            "more stages per rank)",
        ),
        (DEEPSPEED, "a zero-bubble schedule (its pipeline engine runs 1F1B)"),
        # The authors' fork: "--zero-bubble-max-pending-backward ... 1 x number of pipelines will
        # get a schedule like ZB1P" (README of sail-sg/zero-bubble-pipeline-parallelism).
        (
            MEGATRON,
            "a zero-bubble schedule (the authors' fork, sail-sg/zero-bubble-pipeline-parallelism, runs "
            "ZB-H1 with --enable-zero-bubble --zero-bubble-max-pending-backward <pp>)",
        ),
    )
    deferred_activations = ((LAYER_IO, 4), (LINEAR_INNER, 12))

    def peak_activations(
        self,
        p: Num,
        m: Num,
        v: Num,
        whole: Num,
        deferred: Num,
        stage: Stage,
        index: int | None = None,
    ) -> Num:
        n = num.minimum(p, m)
        if index is not None:  # whole after a forward, deferred after a backward (docstring)
            whole_f, deferred_b = num.minimum(p - index, m), num.minimum(index + 1, m)
            after_f = whole_f * whole + (n - whole_f) * deferred
            after_b = (n - deferred_b) * whole + deferred_b * deferred
        elif stage == Stage.FIRST:  # index 0
            after_f, after_b = n * whole, (n - 1) * whole + deferred
        elif stage == Stage.LAST:  # index p - 1
            after_f, after_b = whole + (n - 1) * deferred, n * deferred
        else:  # every middle stage, 1 .. p - 2: each count at its largest
            most, least = num.minimum(p - 1, m), num.minimum(2, m)
            after_f, after_b = most * whole + (n - least) * deferred, (n - least) * whole + most * deferred
        return num.maximum(after_f, after_b)

    def bubble_fraction(self, p: Num, m: Num, v: Num) -> Num:
        return num.ratio(p - 1 + num.maximum(0, p - m), 3 * m)


# In the order the composition language lists their modifiers.
SCHEDULES: dict[Schedule, PipelineSchedule] = {s.kind: s for s in (Interleaved(), GPipe(), OneFOneB(), ZeroBubbleH1())}
DEFAULT_SCHEDULE: Schedule = next(k for k, s in SCHEDULES.items() if s.default)


def schedule_of(kind: Schedule) -> PipelineSchedule:
    """The object of a schedule."""
    return SCHEDULES[kind]


def schedules() -> Iterator[PipelineSchedule]:
    """Every schedule, in the order the composition language lists their modifiers."""
    return iter(SCHEDULES.values())


def for_term(term: str) -> Schedule | None:
    """The schedule a composition-language modifier selects (``gpipe``), or None."""
    return next((s.kind for s in SCHEDULES.values() if s.term == term), None)


def modifier_help() -> dict[str, str]:
    """The schedules' lines of the composition language's modifier list."""
    return {s.help_term: s.help for s in SCHEDULES.values()}


def for_torchtitan(name: str) -> Schedule | None:
    """The schedule torchtitan's ``pipeline_parallel_schedule = name`` runs (case-insensitive)."""
    return next((s.kind for s in SCHEDULES.values() if s.torchtitan and s.torchtitan.lower() == name.lower()), None)


def torchtitan_names() -> tuple[str, ...]:
    """torchtitan's names of the schedules mapped, sorted."""
    return tuple(sorted(s.torchtitan for s in SCHEDULES.values() if s.torchtitan))


__all__ = [
    "DEFAULT_SCHEDULE",
    "DEEPSPEED",
    "MEGATRON",
    "SCHEDULES",
    "TORCHTITAN",
    "PipelineSchedule",
    "Schedule",
    "for_term",
    "for_torchtitan",
    "modifier_help",
    "schedule_of",
    "schedules",
    "torchtitan_names",
]
