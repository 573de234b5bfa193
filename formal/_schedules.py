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

import sympy as sp

from formal._vocab import Group, Stage


class Schedule(StrEnum):
    """The pipeline schedules the checker knows; each has one object in ``SCHEDULES``."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"


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
    elements are split along tp and cp as that activation group is (``deferred``, below, counts
    the micro-batches).
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

    @abstractmethod
    def in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:
        """Micro-batches whose activations a device of ``stage`` holds at its peak; for a middle
        stage, an upper bound (the first stage's)."""

    @abstractmethod
    def stage_in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:
        """Micro-batches whose activations pipeline stage ``index`` (0 .. p-1) holds at its peak."""

    def deferred(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:
        """Micro-batches whose ``deferred_activations`` a device of ``stage`` holds at the peak of
        ``in_flight`` (for a middle stage, an upper bound). None but a schedule that defers work."""
        return sp.Integer(0)

    def stage_deferred(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:
        """``deferred`` for pipeline stage ``index`` (0 .. p-1)."""
        return sp.Integer(0)

    @abstractmethod
    def bubble_fraction(self, p: sp.Expr, m: sp.Expr, v: sp.Expr) -> sp.Expr:
        """Idle time of a stage over its compute time in one step (the pipeline bubble)."""


class OneFOneB(PipelineSchedule):
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM", section 2.2): stage i runs p - i warm-up forwards, then
    alternates one forward and one backward, so it holds at most min(p - i, m) micro-batches;
    the last stage holds one. Its bubble is GPipe's, (p - 1)/m of the compute."""

    kind = Schedule.ONE_F_ONE_B
    term = "1f1b"
    help_term = "1f1b"
    help = "1F1B pipeline schedule (the default)"
    default = True
    torchtitan = "1F1B"
    pytorch = "Schedule1F1B"

    def in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:
        return sp.Integer(1) if stage == Stage.LAST else sp.Min(p, m)

    def stage_in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:
        return sp.Min(p - index, m)

    def bubble_fraction(self, p: sp.Expr, m: sp.Expr, v: sp.Expr) -> sp.Expr:
        return (p - 1) / m


class GPipe(PipelineSchedule):
    """GPipe (Huang et al. 2019): every forward, then every backward, so every stage holds all m
    micro-batches; bubble (p - 1)/m (Narayanan et al. 2021, section 2.2)."""

    kind = Schedule.GPIPE
    term = "gpipe"
    help_term = "gpipe"
    help = "GPipe pipeline schedule (all forwards, then all backwards)"
    torchtitan = "GPipe"
    pytorch = "ScheduleGPipe"
    # DeepSpeed's PipelineEngine runs only its 1F1B TrainSchedule; Megatron-LM has no GPipe.
    refusals = ((DEEPSPEED, "an interleaved or GPipe schedule"), (MEGATRON, "a GPipe schedule"))

    def in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:
        return m

    def stage_in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:
        return m

    def bubble_fraction(self, p: sp.Expr, m: sp.Expr, v: sp.Expr) -> sp.Expr:
        return (p - 1) / m


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

    def in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:
        if stage == Stage.LAST:
            return sp.Min(m * v, (v - 1) * p + 1) / v
        return sp.Min(p, m) * (1 + (p - 1) / (p * v))

    def stage_in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:
        return sp.Min(m * v, 2 * (p - index - 1) + (v - 1) * p + 1) / v

    def bubble_fraction(self, p: sp.Expr, m: sp.Expr, v: sp.Expr) -> sp.Expr:
        return (p - 1) / (v * m)


# In the order the composition language lists their modifiers.
SCHEDULES: dict[Schedule, PipelineSchedule] = {s.kind: s for s in (Interleaved(), GPipe(), OneFOneB())}
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
    return next((s.kind for s in SCHEDULES.values() if s.torchtitan and s.torchtitan.lower() == name.lower()),
                None)


def torchtitan_names() -> tuple[str, ...]:
    """torchtitan's names of the schedules mapped, sorted."""
    return tuple(sorted(s.torchtitan for s in SCHEDULES.values() if s.torchtitan))


__all__ = [
    "DEFAULT_SCHEDULE", "DEEPSPEED", "MEGATRON", "SCHEDULES", "TORCHTITAN", "PipelineSchedule", "Schedule",
    "for_term", "for_torchtitan", "modifier_help", "schedule_of", "schedules", "torchtitan_names",
]
