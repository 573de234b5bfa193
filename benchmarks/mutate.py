"""Mutation testing of the verdict engine and the cost model (run on demand, not in CI).

    python benchmarks/mutate.py --target smt|costs|all [--jobs 1] [--list] [--json] [--only NAME]

Each mutant is one named, semantically meaningful change to the source: a tracked constraint
dropped, a comparison flipped, a phase, axis or offset changed, an off-by-one. It is a
(name, file, exact old snippet, new snippet) quadruple, applied to a scratch copy of the tree
under the system's temporary directory (the checkout is never modified); the target's fast test
subset then runs there (``python -m pytest -x -q -p no:cacheprovider SUBSET``, ``PYTHONPATH``
pointing at the copy, under a timeout). A failing run kills the mutant; a timeout counts as
killed and is reported as such; a passing run is a survivor.

Before anything runs, every snippet is checked to occur exactly once in its file and every
mutated file to compile, so the catalogue cannot silently rot as the code changes. Mutants that
cannot change behaviour are listed with the reason (``equivalent=``) and excluded from the score;
mutants whose meaning no longer exists in the code are kept by name in ``DROPPED`` with the reason.

The subsets are the test files below, fastest and most specific first (``-x`` stops at the first
failure, so a mutant killed early costs seconds; a survivor costs the whole subset).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The fast subsets: verdict tests, then the golden CLI runs last (the slowest file).
SMT_TESTS: tuple[str, ...] = (
    "tests/test_mutants_smt.py",
    "tests/test_smt.py",
    "tests/test_smt_programs.py",
    "tests/test_activation_flow.py",
    "tests/test_uneven_stages.py",
    "tests/test_hpz.py",
    "tests/test_solver_budget.py",
    "tests/test_rules_table.py",  # the planner's reading of the rules table (_ArrayTerms)
    "tests/test_golden_cli.py",
)
# The published-figure and cost-property tests, and the simulator's memory and traffic counts.
COST_TESTS: tuple[str, ...] = (
    "tests/test_mutants_costs.py",
    "tests/test_cost_review.py",
    "tests/test_published.py",
    "tests/test_uneven_stages.py",
    "tests/test_cost_properties.py",
    "tests/test_schedules.py",
    "tests/test_zero_bubble.py",
    "tests/test_hpz.py",
    "tests/test_simulator.py",
)
SUBSETS: dict[str, tuple[str, ...]] = {"smt": SMT_TESTS, "costs": COST_TESTS}
DEFAULT_TIMEOUT_S = 300  # per mutant: several times the subset's own run time

SMT = "formal/_smt.py"
FLOW = "formal/_activation_flow.py"
AXES = "formal/_axes.py"
EXCHANGES = "formal/_exchanges.py"
COSTS = "formal/_costs.py"
PROGRAM = "formal/_program.py"
RULES = "formal/_rules.py"
SOLVER = "formal/_solver.py"
SCHEDULES = "formal/_schedules.py"
PLANNER = "checker/_plan_rules.py"


@dataclass(frozen=True)
class Mutant:
    """One single change: ``old`` (which must occur exactly once in ``file``) becomes ``new``."""

    name: str
    target: str  # "smt" (the verdict engine) or "costs" (the cost derivation)
    file: str
    old: str
    new: str
    equivalent: str = ""  # why this change cannot alter behaviour; excluded from the score


def _m(target: str, name: str, file: str, old: str, new: str, equivalent: str = "") -> Mutant:
    return Mutant(name, target, file, old, new, equivalent)


def _smt(name: str, old: str, new: str, file: str = SMT, equivalent: str = "") -> Mutant:
    return _m("smt", name, file, old, new, equivalent)


def _cost(name: str, old: str, new: str, file: str = COSTS, equivalent: str = "") -> Mutant:
    return _m("costs", name, file, old, new, equivalent)


CATALOGUE: tuple[Mutant, ...] = (
    # ------------------------------------------------------------ composition rules (_rules.py, one table)
    # The table is read by z3 (``_RuleTerms`` in _smt.py) and by the planner (``_ArrayTerms`` in
    # checker/_planner.py): a rule dropped or changed here changes both readers at once.
    _smt(
        "orthogonality allows two strategies on one axis",
        'len(s.strategies_on.get(axis, ("",)))) <= 1,',
        'len(s.strategies_on.get(axis, ("",)))) <= 2,',
        file=RULES,
    ),
    _smt(
        "device count accepts fewer devices than the degrees need",
        '_product(t, tuple(a for a in Axis if a in s.axes)) == t.size("devices", s.devices)',
        '_product(t, tuple(a for a in Axis if a in s.axes)) <= t.size("devices", s.devices)',
        file=RULES,
    ),
    _smt(
        "device-count rule never applies",
        'Rule("device_count", Provenance.CORRECTNESS, None, lambda s: s.devices is not None,',
        'Rule("device_count", Provenance.CORRECTNESS, None, lambda s: False,',
        file=RULES,
    ),
    _smt(
        "hidden-by-tp rule dropped",
        (
            '        _divides("hidden", lambda m: _transformer(m).hidden, (tp,), "tensor'
            ' parallelism splits the hidden dimension"),\n'
        ),
        "",
        file=RULES,
    ),
    _smt(
        "heads-by-tp rule dropped",
        (
            '        _divides("heads", lambda m: _transformer(m).heads, (tp,), "tensor'
            ' parallelism splits attention heads"),\n'
        ),
        "",
        file=RULES,
    ),
    _smt(
        "kv_heads-by-tp rule dropped",
        (
            "        _divides(\n"
            '            "kv_heads",\n'
            "            lambda m: _transformer(m).kv_heads_,\n"
            "            (tp,),\n"
            '            "each tp rank needs whole key/value heads",\n'
            "            when=lambda s: _transformer(s.model).kv_heads_ !="
            " _transformer(s.model).heads,\n"
            "        ),\n"
        ),
        "",
        file=RULES,
    ),
    _smt(
        "kv_heads rule checked only for multi-head attention",
        "when=lambda s: _transformer(s.model).kv_heads_ != _transformer(s.model).heads),",
        "when=lambda s: _transformer(s.model).kv_heads_ == _transformer(s.model).heads),",
        file=RULES,
    ),
    _smt(
        "ffn-by-tp rule dropped",
        (
            '        _divides("ffn", lambda m: _transformer(m).ffn_, (tp,), "tensor'
            ' parallelism splits the FFN dimension"),\n'
        ),
        "",
        file=RULES,
    ),
    _smt(
        "vocab-by-tp rule dropped",
        (
            "        _divides(\n"
            '            "vocab",\n'
            "            lambda m: _transformer(m).vocab,\n"
            "            (tp,),\n"
            '            "the vocabulary-parallel embedding splits the vocabulary'
            ' (Megatron-LM #1754)",\n'
            "        ),\n"
        ),
        "",
        file=RULES,
    ),
    _smt(
        "layers-by-pp ignores interleaved chunks",
        "lambda t, s: layers(t, s) % stages(t, s) == 0, explain,",
        "lambda t, s: layers(t, s) % t.degree(Axis.PP) == 0, explain,",
        file=RULES,
    ),
    _smt(
        "layers-by-pp rule dropped",
        "lambda t, s: layers(t, s) % stages(t, s) == 0, explain,",
        "lambda t, s: True, explain,",
        file=RULES,
    ),
    _smt(
        "uneven stages: the at-least-one-layer rule dropped",
        "lambda t, s: stages(t, s) <= layers(t, s),",
        "lambda t, s: True,",
        file=RULES,
    ),
    _smt(
        "uneven stages: as many stages as layers refused (off by one)",
        "lambda t, s: stages(t, s) <= layers(t, s),",
        "lambda t, s: stages(t, s) < layers(t, s),",
        file=RULES,
    ),
    _smt(
        "uneven stages: interleaved chunks not counted",
        "lambda t, s: stages(t, s) <= layers(t, s),",
        "lambda t, s: t.degree(Axis.PP) <= layers(t, s),",
        file=RULES,
    ),
    _smt(
        "layer rules apply whether or not stages are declared uneven",
        "and pp in s.axes and s.options.uneven_stages == uneven",
        "and pp in s.axes",
        file=RULES,
    ),
    _smt(
        "seq-by-cp rule dropped",
        (
            "    *(\n"
            '        _divides("seq", lambda m: _transformer(m).seq, (cp,), "context'
            ' parallelism splits the sequence")\n'
            "        for cp in _SEQUENCE\n"
            "    ),\n"
        ),
        "",
        file=RULES,
    ),
    _smt(
        "seq-by-tp under sequence parallelism dropped",
        (
            "    _divides(\n"
            '        "seq",\n'
            "        lambda m: _transformer(m).seq,\n"
            "        _SEQUENCE + _SEQUENCE_PARALLEL,\n"
            '        "sequence parallelism splits the sequence across tp",\n'
            "        when=lambda s: s.options.sequence_parallel and any(a in s.axes for a in"
            " _SEQUENCE_PARALLEL),\n"
            "    ),\n"
        ),
        "",
        file=RULES,
    ),
    _smt(
        "seq-by-tp under sequence parallelism ignores cp",
        "_SEQUENCE + _SEQUENCE_PARALLEL,",
        "_SEQUENCE_PARALLEL,",
        file=RULES,
    ),
    _smt(
        "seq-by-tp applies without sequence parallelism",
        "when=lambda s: s.options.sequence_parallel and any(a in s.axes for a in _SEQUENCE_PARALLEL),",
        "when=lambda s: any(a in s.axes for a in _SEQUENCE_PARALLEL),",
        file=RULES,
    ),
    _smt(
        "experts-by-ep rule dropped",
        (
            "    *(\n"
            "        _divides(\n"
            '            "experts",\n'
            "            lambda m: _transformer(m).experts,\n"
            "            (ep,),\n"
            '            "expert parallelism places whole experts",\n'
            "            when=lambda s: _is_moe(s.model),\n"
            "        )\n"
            "        for ep in _EXPERTS\n"
            "    ),\n"
        ),
        "",
        file=RULES,
    ),
    _smt(
        "sp_needs_tp always holds",
        'lambda t, s: t.implies(t.flag("sequence_parallel", True), t.present(tp)),',
        "lambda t, s: True,",
        file=RULES,
    ),
    _smt(
        "ep_needs_moe always holds",
        'lambda t, s: t.implies(t.present(ep), t.flag("moe", _is_moe(s.model))),',
        "lambda t, s: True,",
        file=RULES,
    ),
    _smt(
        "cp_needs_attention always holds",
        'lambda t, s: t.implies(t.present(cp), t.flag("attention", isinstance(s.model, Transformer))),',
        "lambda t, s: True,",
        file=RULES,
    ),
    _smt(
        "interleaved_needs_pp always holds",
        'lambda t, s: t.implies(t.size("interleaved_chunks", s.chunks) > 1, t.present(pp)),',
        "lambda t, s: True,",
        file=RULES,
    ),
    _smt(
        "divisibility rules are framework notes, not refutations",
        'return Rule(f"divides[{size_name}, {named.value}]", Provenance.CORRECTNESS, named,',
        'return Rule(f"divides[{size_name}, {named.value}]", Provenance.FRAMEWORK, named,',
        file=RULES,
    ),
    _smt(
        "sp_needs_tp is a framework note, not a refutation",
        'Rule("sp_needs_tp", Provenance.CORRECTNESS,',
        'Rule("sp_needs_tp", Provenance.FRAMEWORK,',
        file=RULES,
    ),
    _smt(
        "Megatron's interleaved m % pp rule refutes",
        'Rule("megatron_interleaved_m_multiple_of_pp", Provenance.FRAMEWORK,',
        'Rule("megatron_interleaved_m_multiple_of_pp", Provenance.CORRECTNESS,',
        file=RULES,
    ),
    _smt(
        "Megatron's interleaved m % pp rule applies to every pipeline schedule",
        "lambda s: s.chunks > 1 and pp in s.axes,",
        "lambda s: pp in s.axes,",
        file=RULES,
    ),
    _smt(
        "framework notes name the rules that hold",
        "if not rule.holds(Concrete(mesh, setting), setting):",
        "if rule.holds(Concrete(mesh, setting), setting):",
        file=RULES,
    ),
    _smt(
        "rules of either provenance applied as one",
        "if (provenance is None or r.provenance is provenance) and r.applies(setting))",
        "if r.applies(setting))",
        file=RULES,
    ),
    _smt(
        "z3 takes a degree-1 axis as absent (the planner's reading of present)",
        'return self.flag(f"has_{axis.value}", axis in self._mesh)',
        'return self.flag(f"has_{axis.value}", self._mesh.get(axis, 1) > 1)',
    ),
    _smt(
        "the planner takes every axis as present",
        "    def present(self, axis: Axis) -> Bools:\n        return self.degree(axis) > 1",
        "    def present(self, axis: Axis) -> Bools:\n        return self.degree(axis) >= 1",
        file=PLANNER,
    ),
    _smt(
        "the planner's implication is a conjunction",
        "return cast(Bools, np.logical_or(np.logical_not(a), b))",
        "return cast(Bools, np.logical_and(a, b))",
        file=PLANNER,
    ),
    _smt(
        "only the first unsat core's rules are reported",
        "        status = Status.REFUTED\n    if violations",
        "        status = Status.REFUTED\n        break\n    if violations",
    ),
    _smt(
        "a composition query cut short reported as proved",
        '        if answer.result == "unknown":\n            status, reason = Status.UNKNOWN, answer.reason\n',
        '        if answer.result == "unknown":\n            status, reason = Status.PROVED, answer.reason\n',
    ),
    # ------------------------------------------------------------ gradient integrity (_smt.py)
    _smt(
        "only 2 explicit devices modelled in integrity (the rest folded)",
        "MAX_EXPLICIT_DEVICES = 8",
        "MAX_EXPLICIT_DEVICES = 2",
    ),
    _smt(
        "a sharded gradient is judged on every device, not its holder",
        "owners = range(1) if sharded else range(k)",
        "owners = range(k)",
    ),
    _smt("only device 0's gradient is judged", "owners = range(1) if sharded else range(k)", "owners = range(1)"),
    _smt(
        "partial origin: the reference is the sum along data axes too",
        "reference = total_c / degree if axis.splits_data else total_c\n"
        "            init = [values[i] == z3.ToReal(contributions[i])",
        "reference = total_c\n            init = [values[i] == z3.ToReal(contributions[i])",
    ),
    _smt(
        "summed origin: the reference is the sum along data axes too",
        "reference = total_c / degree if axis.splits_data else total_c\n            init = [v == total_c",
        "reference = total_c\n            init = [v == total_c",
    ),
    _smt(
        "summed origin: the folded devices hold one copy, not one per device",
        "[rest_v == rest * total_c]",
        "[rest_v == total_c]",
    ),
    _smt(
        "complete sharded gradient: the other devices hold the same element",
        "init = [values[0] == reference] + [values[i] == others[i - 1] for i in range(1, k)]",
        "init = [v == reference for v in values]",
    ),
    _smt(
        "complete replicated gradient: the folded devices hold one copy",
        "[rest_v == rest * reference]",
        "[rest_v == reference]",
    ),
    _smt(
        "a device-to-host copy in the backward phase holds the gradient",
        "incomplete = op.phase in (Phase.FORWARD, Phase.BACKWARD)",
        "incomplete = op.phase is Phase.FORWARD",
    ),
    _smt(
        "a sharded gradient is not freed outside its shard (integrity)",
        "z3.And(kept[0] == values[0], *[v == 0 for v in kept[1:]], kept_rest == 0)",
        "z3.And(*[a == b for a, b in zip(kept, values)], kept_rest == rest_v)",
    ),
    _smt(
        "a sharded gradient is freed only in the refresh phase",
        "if sharded and not trimmed and op.phase in (Phase.OPTIMIZER, Phase.REFRESH):",
        "if sharded and not trimmed and op.phase is Phase.REFRESH:",
    ),
    _smt(
        "reductions after the gradient was freed are not recorded as late",
        "if trimmed and op.kind.is_reduction:",
        "if False:",
    ),
    _smt(
        "a mean divides by the modelled devices, not the degree",
        "combined = combined / degree",
        "combined = combined / k",
    ),
    _smt(
        "a reduction's folded devices get one copy of the result",
        "[new_rest == rest * combined]",
        "[new_rest == combined]",
    ),
    _smt("a scale skips the folded devices", "[new_rest == rest_v * factor]", "[new_rest == rest_v]"),
    _smt(
        "a mean reduction is taken as a sum",
        "if op.reduce is Reduce.MEAN:\n                    combined",
        "if False:\n                    combined",
    ),
    _smt(
        "the host optimizer reads the device gradient",
        "read = host if case.host and host is not None else values",
        "read = values",
    ),
    _smt(
        "the optimizer reads the host gradient only when G itself is offloaded",
        "return Mode.OFFLOADED in (index.local.get((G, group)), index.local.get((O, group)))",
        "return index.local.get((G, group)) is Mode.OFFLOADED",
        equivalent="axis-free modes come only from the composition's modifiers, and the one that offloads the "
        "optimizer state offloads its gradients with it (ZeRO-Offload; formal/_strategies.py "
        "_apply_offload), so O offloaded implies G offloaded in every placement",
    ),
    _smt(
        "an axis-free scale charged to every axis",
        "(op.axis is axis or (op.axis is None and axis is home))",
        "(op.axis is axis or op.axis is None)",
    ),
    _smt(
        "an axis-free scale charged to the first axis, data or not",
        "return next((a for a in axes if a.splits_data), axes[0])",
        "return axes[0]",
    ),
    _smt(
        "gradient ops of the forward phase counted",
        "        if op.phase is Phase.FORWARD:\n            continue\n        if op.kind.is_reduction",
        "        if op.kind.is_reduction",
    ),
    _smt(
        "gradient ops after the optimizer step counted",
        "if op.kind is OpKind.OPTIMIZER_STEP:\n            break",
        "if op.kind is OpKind.OPTIMIZER_STEP:\n            continue",
    ),
    _smt(
        "the tied embedding uses the full pp degree", "degree = min(degree, 2)  # a tied", "degree = degree  # a tied"
    ),
    _smt(
        "backward gradient ops not moved after the backward",
        "return rank[op.phase], int(op.phase is Phase.BACKWARD and op.state is G), i",
        "return rank[op.phase], 0, i",
    ),
    _smt(
        "per-micro-batch gradient ops not run before the per-step ones",
        "return rank[op.phase], int(not per_micro_batch(op)), i",
        "return rank[op.phase], 0, i",
    ),
    _smt(
        "a missing reduction is named normalisation",
        'if origin is Origin.PARTIAL and not reductions:\n        return ("reduction_closure"',
        'if origin is Origin.PARTIAL and not reductions:\n        return ("normalisation"',
    ),
    _smt("a duplicated reduction is not recognised", "if len(reductions) > 1:", "if len(reductions) > 2:"),
    # ------------------------------------------------------------ state consistency (_smt.py)
    _smt(
        "2 modelled devices instead of 4 in consistency", "MAX_CONSISTENCY_DEVICES = 4", "MAX_CONSISTENCY_DEVICES = 2"
    ),
    _smt(
        "a reduction of differing holdings is accepted",
        "if state is G and first is not None and all(h == first for h in held):",
        "if state is G and first is not None:",
        equivalent="verdict-equivalent: devices that hold a gradient chunk always hold the same term (every op "
        "writes one value per chunk to all its holders), so the check fails only when some device "
        "lacks the chunk; holdings are rotations of device 0's, so unless device 0 holds every chunk "
        "(and then so does every device) some device reads a chunk device 0 lacks and gets junk in "
        "both versions: the same read fails, under the same rule, at the same step and op; only "
        "which device the witness names can change",
    ),
    _smt(
        "the optimizer's parameter read is unchecked",
        'self.check(P, "alignment_op", (p_value,), self.ref[P][k], **ctx)',
        "pass",
    ),
    _smt(
        "the optimizer's gradient read is unchecked",
        'self.check(G, "alignment_og", (g_value,), gradient[k], **ctx)',
        "pass",
    ),
    _smt(
        "the optimizer's state read is unchecked",
        'self.check(O, "agreement", (o_value,), self.ref[O][k], **ctx)',
        "pass",
    ),
    _smt(
        "a broadcast skips device 1",
        "for i in range(1, self.d):\n                            self.hold[(False, i, op.state)] = dict(",
        "for i in range(2, self.d):\n                            self.hold[(False, i, op.state)] = dict(",
    ),
    _smt(
        "a program without an optimizer step leaves single-device training unchanged",
        "if not updated:\n                self.update_reference(gradient)",
        "if False:\n                self.update_reference(gradient)",
    ),
    _smt(
        "every optimizer step updates single-device training", "update_reference=not updated)", "update_reference=True)"
    ),
    _smt(
        "no coverage check at step boundaries",
        "for st in (P, O):\n                for k in range(self.d):\n                    holders",
        "for st in ():\n                for k in range(self.d):\n                    holders",
    ),
    _smt(
        "coverage checked for parameters only",
        "for st in (P, O):\n                for k in range(self.d):\n                    holders",
        "for st in (P,):\n                for k in range(self.d):\n                    holders",
    ),
    _smt(
        "parameters not freed when the forward or backward ends",
        "if phase in (Phase.FORWARD, Phase.BACKWARD) and op.phase is not phase:\n"
        "                    self.free_parameters",
        "if False:\n                    self.free_parameters",
    ),
    _smt(
        "parameters held through the backward are never freed",
        "if not after_backward and self.case.held_here:",
        "if self.case.held_here:",
    ),
    _smt(
        "hpZ: parameters held along one axis are held whole along every axis",
        "if not after_backward and self.case.held_here:",
        "if not after_backward and self.case.held:",
    ),
    _smt(
        "hpZ: a parameter held along some axis counts as held along this one (case)",
        "        index.entry(P, group, axis).keep_gathered)",
        "        any(index.entry(P, group, a).keep_gathered for a in index.placement.axes))",
    ),
    _smt(
        "hpZ: a parameter counts as held only along the axis that holds it (case)",
        "        any(index.entry(P, group, a).keep_gathered for a in index.placement.axes),\n",
        "        index.entry(P, group, axis).keep_gathered,\n",
    ),
    _smt(
        "a fetched offloaded parameter is never held through the backward",
        "if self.local[P] is Mode.OFFLOADED and (after_backward or not self.case.held):",
        "if self.local[P] is Mode.OFFLOADED:",
    ),
    _smt(
        "gradients kept across steps",
        "self.hold[key] = {}  # gradients live for one step",
        "continue  # gradients live for one step",
    ),
    _smt(
        "a sharded gradient is not freed outside its shard (consistency)",
        "if not self.entry[G].mode.is_sharded:\n            return",
        "if True:\n            return",
    ),
    _smt(
        "an all-gather ignores its offset",
        "self.contribute((False, (k + o) % self.d, op.state), k)",
        "self.contribute((False, k, op.state), k)",
    ),
    _smt(
        "a reduce-scatter ignores its offset",
        "mine = {i: (i - o) % self.d for i in range(self.d)}",
        "mine = {i: i for i in range(self.d)}",
    ),
    _smt(
        "a replicated parameter's sharded computation reads only its shard",
        "return full or self.entry[P].mode in (Mode.REPLICATED, Mode.OFFLOADED)",
        "return full",
    ),
    _smt(
        "an offloaded parameter's read is not a fetch",
        'if self.local[P] is Mode.OFFLOADED:\n            return "fetch_before_use"',
        'if False:\n            return "fetch_before_use"',
    ),
    _smt(
        "ZeRO-Offload's master parameters are not on the host",
        "if self.on_host(O) and not self.on_host(P):",
        "if False:",
    ),
    _smt(
        "a host-to-device copy copies nothing",
        "self.hold[(False, i, op.state)].update(self.hold[(True, i, op.state)])",
        "pass",
    ),
    _smt(
        "a device-to-host copy copies nothing",
        "self.hold[(True, i, op.state)].update(self.hold[(False, i, op.state)])",
        "pass",
    ),
    _smt(
        "the optimizer step ignores its own offset",
        "partition = Entry(entry.mode, op.offset) if entry.mode.is_sharded else entry",
        "partition = entry",
    ),
    _smt("only one step modelled", "for step in (0, 1):", "for step in (0,):"),
    _smt(
        "knock-on failures reported as root causes",
        "previous = [earlier_ok[t], *[z3.Not(lit) for lit, c in checks if _time(c) == t]]",
        "previous = []",
    ),
    _smt(
        "axis-free ops left out of consistency",
        "if op.state in (P, O, G) and op.axis in (None, axis)),",
        "if op.state in (P, O, G) and op.axis is axis),",
    ),
    # ------------------------------------------------------------ remembering answers (_smt.py)
    _smt(
        "unknown answers remembered across timeouts",
        "if answer[0].status is not Status.UNKNOWN and _MEMO_LIMIT > 0:",
        "if _MEMO_LIMIT > 0:",
    ),
    _smt(
        "answers remembered regardless of the per-query resource limit",
        "key = (case, budget.query_rlimit if budget is not None else 0)",
        "key = (case, 0)",
    ),
    _smt(
        "a remembered answer is not charged to the run",
        "        if budget is not None:\n            budget.charge(hit[1])",
        "        if False:\n            budget.charge(hit[1])",
    ),
    _smt(
        "a remembered answer's cost is not recorded",
        "units = budget.used - spent if budget is not None else 0",
        "units = 0",
    ),
    _smt(
        "a remembered answer is used past the run's budget",
        "if hit is not None and (budget is None or hit[1] <= budget.left):",
        "if hit is not None:",
    ),
    _smt(
        "at most one answer remembered",
        "_MEMO_LIMIT = 50_000",
        "_MEMO_LIMIT = 1",
        equivalent="the cache's size: a forgotten answer is recomputed from the same case, and a remembered one "
        "is charged what it cost when it was decided, so the run spends the same units either way",
    ),
    # ------------------------------------------------------------ the solver and the run's budget (_solver.py)
    _smt(
        "z3's default tactic solver",
        "self.solver = z3.SimpleSolver()",
        "self.solver = z3.Solver()",
        file=SOLVER,
        equivalent="the same satisfiability question to the same decision procedure, with a tactic preamble: "
        "unsat cores and models are read by name and value, not by order, so every decided "
        "obligation gets the same answer; what changes is the speed and the z3 resource units a "
        "query spends, the budget's currency, whose price per query nothing specifies (with either "
        "solver a run spends the same units every time, so a budget that cuts the run still gives "
        "the same verdict on every run; only where a small --rlimit cuts may move)",
    ),
    _smt(
        "a query cut short reported as proved",
        '    if answer.result == "unknown":\n        return Status.UNKNOWN\n',
        '    if answer.result == "unknown":\n        return Status.PROVED\n',
    ),
    _smt(
        "a spent run budget still asks z3 (with no limit)", "if budget.left <= 0:", "if budget.left < 0:", file=SOLVER
    ),
    _smt(
        "the run's budget ignored: every query gets the per-query limit",
        "timeout_ms, rlimit = budget.timeout_ms, min(budget.query_rlimit, budget.left)",
        "timeout_ms, rlimit = budget.timeout_ms, budget.query_rlimit",
        file=SOLVER,
    ),
    _smt(
        "the per-query limit ignored: a query may spend what the run has left",
        "timeout_ms, rlimit = budget.timeout_ms, min(budget.query_rlimit, budget.left)",
        "timeout_ms, rlimit = budget.timeout_ms, budget.left",
        file=SOLVER,
    ),
    _smt("a query's work is not charged to the run", "budget.charge(units)", "budget.charge(0)", file=SOLVER),
    _smt(
        "no resource limit given to z3",
        'tracked.solver.set("rlimit", rlimit)',
        'tracked.solver.set("rlimit", 0)',
        file=SOLVER,
    ),
    _smt(
        "the run's wall-clock deadline ignored",
        "if time.monotonic() - budget.started > budget.run_timeout_s:",
        "if False:",
        file=SOLVER,
    ),
    _smt(
        "a resource-limit cut reported as a wall-clock cut", "if rlimit and units >= rlimit:", "if False:", file=SOLVER
    ),
    # ------------------------------------------------------------ activation exchange (_activation_flow.py)
    _smt(
        "an activation mean is not divided",
        "scale = z3.RealVal(1) / d if op.reduce is Reduce.MEAN else z3.RealVal(1)",
        "scale = z3.RealVal(1)",
        file=FLOW,
    ),
    _smt(
        "an activation reduce-scatter leaves the whole sum on every device",
        "[[z3.Sum(*(value[j][c] for j in range(d))) * scale if c == i else junk() for c in range(d)]",
        "[[z3.Sum(*(value[j][c] for j in range(d))) * scale for c in range(d)]",
        file=FLOW,
    ),
    _smt(
        "an activation all-gather copies device 0's chunks",
        "return [[value[c][c] for c in range(d)] for _ in range(d)]",
        "return [[value[0][c] for c in range(d)] for _ in range(d)]",
        file=FLOW,
    ),
    _smt(
        "an all-to-all is the identity",
        "return [[value[c][i] for c in range(d)] for i in range(d)]",
        "return [[value[i][c] for c in range(d)] for i in range(d)]",
        file=FLOW,
    ),
    _smt(
        "a missing pipeline send is accepted",
        "value = [[start[i][c] if ops else junk() for c in range(d)] for i in range(d)]",
        "value = [[start[i][c] for c in range(d)] for i in range(d)]",
        file=FLOW,
    ),
    _smt(
        "an activation site reads the ops of either phase",
        "and op.axis is site.axis and op.phase is site.phase]",
        "and op.axis is site.axis]",
        file=FLOW,
    ),
    _smt(
        "no cp re-gather required under full recomputation",
        "for axis, e in exchanges(program.placement, model, required=True)",
        "for axis, e in exchanges(program.placement, model, required=True) if not e.recompute",
        file=FLOW,
    ),
    _smt(
        "no ep all-to-all required",
        "for axis, e in exchanges(program.placement, model, required=True)",
        "for axis, e in exchanges(program.placement, model, required=True) if e.kind is not OpKind.ALL_TO_ALL",
        file=FLOW,
    ),
    _smt(
        "sequence parallelism's shard sites replaced by an all-reduce site",
        "if exchange.sequence is not None and sequence_split(pl, exchange.group, axis) != exchange.sequence:",
        (
            "if exchange.sequence is not None and (sequence_split(pl, exchange.group, axis)"
            " and not required) != exchange.sequence:"
        ),
        file=EXCHANGES,
    ),
    _smt(
        "the vocabulary-parallel embedding's output needs no sum",
        "return pl.computes_sharded(axis, EMBEDDING)",
        "return not required and pl.computes_sharded(axis, EMBEDDING)",
        file=EXCHANGES,
    ),
    _smt(
        "the vocabulary-parallel head's input gradient needs no sum",
        "return pl.computes_sharded(axis, head_group(pl))",
        "return not required and pl.computes_sharded(axis, head_group(pl))",
        file=EXCHANGES,
    ),
    _smt(
        "the embedding output gradient's shards need no gather under SP",
        "for axis, e in exchanges(program.placement, model, required=True)",
        (
            "for axis, e in exchanges(program.placement, model, required=True) if not"
            ' (e.group.name == "embedding_io" and e.kind is OpKind.ALL_GATHER)'
        ),
        file=FLOW,
    ),
    _smt("activation exchange modelled on 2 devices", "MAX_DEVICES = 4", "MAX_DEVICES = 2", file=FLOW),
    _smt(
        "an activation-exchange query cut short reported as proved",
        "return Obligation(name, Condition.GRADIENT_INTEGRITY, Status.UNKNOWN, answer.reason, answer.seconds), []",
        "return Obligation(name, Condition.GRADIENT_INTEGRITY, Status.PROVED, answer.reason, answer.seconds), []",
        file=FLOW,
    ),
    # ------------------------------------------------------------ pipeline schedules (_schedules.py)
    _cost(
        "1F1B in-flight micro-batches off by one (first stage)",
        "return sp.Integer(1) if stage == Stage.LAST else sp.Min(p, m)",
        "return sp.Integer(1) if stage == Stage.LAST else sp.Min(p - 1, m)",
        file=SCHEDULES,
    ),
    _cost(
        "1F1B in-flight micro-batches off by one (stage i)",
        "        return sp.Min(p - index, m)\n",
        "        return sp.Min(p - index + 1, m)\n",
        file=SCHEDULES,
    ),
    _cost(
        "1F1B last stage holds two micro-batches",
        "return sp.Integer(1) if stage == Stage.LAST else sp.Min(p, m)",
        "return sp.Min(2, m) if stage == Stage.LAST else sp.Min(p, m)",
        file=SCHEDULES,
    ),
    _cost(
        "1F1B bubble counts p, not p - 1, stages of warm-up",
        "        return (p - 1) / m\n\n\nclass GPipe",
        "        return p / m\n\n\nclass GPipe",
        file=SCHEDULES,
    ),
    _cost(
        "GPipe holds p micro-batches",
        "    def in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:\n        return m\n",
        "    def in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, stage: Stage) -> sp.Expr:\n        return p\n",
        file=SCHEDULES,
    ),
    _cost(
        "GPipe stage i holds 1F1B's warm-up",
        "    def stage_in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:\n        return m\n",
        "    def stage_in_flight(self, p: sp.Expr, m: sp.Expr, v: sp.Expr, index: int) -> sp.Expr:\n"
        "        return sp.Min(p - index, m)\n",
        file=SCHEDULES,
    ),
    _cost(
        "GPipe bubble over the step, not over the compute",
        "        return (p - 1) / m\n\n\nclass Interleaved",
        "        return (p - 1) / (m + p - 1)\n\n\nclass Interleaved",
        file=SCHEDULES,
    ),
    _cost(
        "interleaved first stage: the extra warm-up ignores v",
        "return sp.Min(p, m) * (1 + (p - 1) / (p * v))",
        "return sp.Min(p, m) * (1 + (p - 1) / p)",
        file=SCHEDULES,
    ),
    _cost(
        "interleaved last stage off by one",
        "return sp.Min(m * v, (v - 1) * p + 1) / v",
        "return sp.Min(m * v, (v - 1) * p) / v",
        file=SCHEDULES,
    ),
    _cost(
        "interleaved stage i warm-up off by one",
        "2 * (p - index - 1) + (v - 1) * p + 1",
        "2 * (p - index) + (v - 1) * p + 1",
        file=SCHEDULES,
    ),
    _cost(
        "a stage index's own in-flight count replaced by the first stage's",
        "live = self.in_flight(p, m, v, stage) if index is None else self.stage_in_flight(p, m, v, index)",
        "live = self.in_flight(p, m, v, stage)",
        file=SCHEDULES,
    ),
    _cost("interleaved bubble ignores v", "return (p - 1) / (v * m)", "return (p - 1) / m", file=SCHEDULES),
    _cost(
        "a chunked schedule crosses each boundary once per micro-batch",
        "        return self.virtual_stages(chunks)\n\n    def modifier_terms",
        "        return 1\n\n    def modifier_terms",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 bubble without the drain of fewer micro-batches than stages",
        "return (p - 1 + sp.Max(0, p - m)) / (3 * m)",
        "return (p - 1) / (3 * m)",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 bubble is 1F1B's", "return (p - 1 + sp.Max(0, p - m)) / (3 * m)", "return (p - 1) / m", file=SCHEDULES
    ),
    _cost(
        "ZB-H1 bubble a half, not a third, of 1F1B's",
        "return (p - 1 + sp.Max(0, p - m)) / (3 * m)",
        "return (p - 1 + sp.Max(0, p - m)) / (2 * m)",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 in flight off by one (min(p - 1, m) whose W has not run)",
        "        n = sp.Min(p, m)\n",
        "        n = sp.Min(p - 1, m)\n",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 stage i defers i micro-batches, not i + 1",
        "whole_f, deferred_b = sp.Min(p - index, m), sp.Min(index + 1, m)",
        "whole_f, deferred_b = sp.Min(p - index, m), sp.Min(index, m)",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 stage i holds every in-flight micro-batch whole after a forward",
        "after_f = whole_f * whole + (n - whole_f) * deferred",
        "after_f = n * whole",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 first stage keeps a deferred micro-batch after its backward",
        "after_f, after_b = n * whole, (n - 1) * whole + deferred",
        "after_f, after_b = n * whole, (n - 1) * whole + 2 * deferred",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 last stage holds no deferred micro-batch after a forward",
        "after_f, after_b = whole + (n - 1) * deferred, n * deferred",
        "after_f, after_b = whole, n * deferred",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 middle-stage bound takes the second stage's deferred count",
        "most, least = sp.Min(p - 1, m), sp.Min(2, m)",
        "most, least = sp.Min(p - 1, m), sp.Min(1, m)",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 peak only after a forward",
        "        return sp.Max(after_f, after_b)\n",
        "        return after_f\n",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 defers the linear layers' inner activations as whole as their inputs",
        "deferred_activations = ((LAYER_IO, 4), (LINEAR_INNER, 12))",
        "deferred_activations = ((LAYER_IO, 16),)",
        file=SCHEDULES,
    ),
    _cost(
        "ZB-H1 defers nothing (1F1B's memory)",
        "deferred_activations = ((LAYER_IO, 4), (LINEAR_INNER, 12))",
        "deferred_activations = ()",
        file=SCHEDULES,
    ),
    _cost(
        "deferred activations shrunk by recomputation",
        "total += per_sbh * sbh * precision.activations * _tensor_factor(pl, group)",
        "total += per_sbh * sbh * precision.activations * _tensor_factor(pl, group) * "
        "(0 if pl.local_mode(State.ACTIVATIONS, group) is Mode.MATERIALIZED else 1)",
    ),
    # ------------------------------------------------------------ memory (_costs.py, _program.py)
    _cost(
        "most-loaded device always the first stage",
        "return max(candidates, key=lambda m: exact(m.total))",
        "return candidates[0]",
    ),
    _cost(
        "full-recompute checkpoint not split by cp",
        "total += precision.activations * sbh * _cp_factor(pl)",
        "total += precision.activations * sbh",
    ),
    _cost(
        "an ep factor applied to activations",
        "if axis.kind.is_pipeline or axis.kind.splits_batch:\n            continue  # b is one",
        (
            "if axis.kind.is_pipeline or (axis.kind.splits_batch and not"
            " axis.kind.places_experts):\n"
            "            continue  # b is one"
        ),
        file=COSTS,
    ),
    _cost(
        "recomputed activation groups still counted",
        "if pl.local_mode(State.ACTIVATIONS, g) is Mode.MATERIALIZED:\n            continue",
        "if False:\n            continue",
    ),
    _cost(
        "input-layer activations kept on the last stage",
        "if group in FIRST_STAGE_ACTIVATIONS:\n        return stage == Stage.FIRST",
        "if group in FIRST_STAGE_ACTIVATIONS:\n        return stage == Stage.LAST",
    ),
    _cost(
        "offloaded or recomputed state counted on the device",
        "if pl.local_mode(state, group) in (Mode.OFFLOADED, Mode.MATERIALIZED):\n        return sp.Integer(0)\n"
        "    return _axes_factor",
        "if False:\n        return sp.Integer(0)\n    return _axes_factor",
    ),
    _cost(
        "host memory not counted",
        "total += sizes[g] * precision.bytes_of(state) * _axes_factor(pl, state, g, stage)",
        "total += 0",
    ),
    _cost("a shard-grad-op buffer holds the whole stage, own shard included", "held += copy - own", "held += copy"),
    _cost(
        "a held copy of offloaded parameters charged minus the shard the host holds",
        "own = (sp.Integer(0) if pl.local_mode(state, g) is Mode.OFFLOADED",
        "own = (sp.Integer(0) if False",
    ),
    _cost(
        "hpZ: the held copy is whole along every gathered axis",
        "copy = shard_elements(pl, state, g, sizes[g], held_axes, stage) * nbytes",
        "copy = shard_elements(pl, state, g, sizes[g], axes, stage) * nbytes",
    ),
    _cost(
        "hpZ: no gather buffer along the axes that do not hold",
        "if len(held_axes) == len(axes):\n                    continue",
        "if True:\n                    continue",
    ),
    _cost(
        "the gather buffer holds every layer of the stage",
        "piece = full / pl.stage_layers(layer_count) if g in LAYER_GROUPS else full",
        "piece = full",
    ),
    _cost(
        "a gradient bucket for groups computed sharded",
        "return entry.mode is Mode.SHARDED and axis.splits_data and not pl.computes_sharded(axis, group)",
        "return entry.mode is Mode.SHARDED and axis.splits_data",
    ),
    _cost(
        "uneven stages charged the even share of layers",
        "return 1 / p if layer_share is None else layer_share",
        "return 1 / p",
        file=PROGRAM,
    ),
    _cost(
        "the tied embedding held on the first stage only",
        "return sp.Integer(1) if stage in (Stage.FIRST, Stage.LAST) or p == 1 else sp.Integer(0)",
        "return sp.Integer(1) if stage == Stage.FIRST or p == 1 else sp.Integer(0)",
        file=PROGRAM,
    ),
    # ------------------------------------------------------------ communication (_costs.py, _program.py)
    _cost(
        "tied-embedding traffic only on the first stage",
        "return sp.Integer(int(stage in (Stage.FIRST, Stage.LAST)))",
        "return sp.Integer(int(stage == Stage.FIRST))",
    ),
    _cost(
        "a middle stage sends one way only",
        "return sp.Rational(2 * sends - ends, sends)",
        "return sp.Rational(2 * sends - max(ends, 1), sends)",
    ),
    _cost("the end stages send both ways", "ends = int(stage == Stage.FIRST) + int(stage == Stage.LAST)", "ends = 0"),
    _cost(
        "the busiest stage is always the first",
        "return max(per_stage, key=lambda item: exact(total_bytes(item[1])))",
        "return per_stage[0]",
    ),
    _cost("a ring all-reduce moves (n-1)/n", "return 2 * (n - 1) / n", "return (n - 1) / n"),
    _cost(
        "a ring reduce-scatter or all-gather moves the whole tensor",
        "return (n - 1) / n\n        case OpKind.SEND_RECV",
        "return sp.Integer(1)\n        case OpKind.SEND_RECV",
    ),
    _cost(
        "ZeRO paper units count an all-reduce once",
        "return sp.Integer(2) if kind is OpKind.ALL_REDUCE else sp.Integer(1)",
        "return sp.Integer(1)",
    ),
    _cost(
        "the tied embedding's all-reduce spans the whole pp group",
        "participants = sp.Integer(2) if axis.kind.is_pipeline and d != 1 else None",
        "participants = None",
        file=PROGRAM,
    ),
    _cost(
        "full recomputation does not replay tp collectives",
        "return 2 * count if exchange.replayed and again else count",
        "return count",
        file=PROGRAM,
    ),
    _cost(
        "cp keys and values not re-gathered under full recomputation",
        "if exchange.recompute and pl.options.recompute is not Recompute.FULL:",
        "if exchange.recompute and (not required or pl.options.recompute is not Recompute.FULL):",
        file=EXCHANGES,
    ),
    _cost(
        "an ep all-to-all once per layer, not each way",
        "split=Split.LAYER, width=Width.ROUTED, per_layer=2,",
        "split=Split.LAYER, width=Width.ROUTED, per_layer=1,",
        file=AXES,
    ),
    _cost(
        "pipeline sends ignore interleaved chunks",
        "return self.m * sp.Integer(options.pipeline_schedule.boundary_sends(options.chunks))",
        "return self.m",
        file=PROGRAM,
    ),
    _cost(
        "sequence-parallel collectives once per layer, not per block",
        "split=Split.LAYER, sequence=sequence, per_layer=2, replayed=True",
        "split=Split.LAYER, sequence=sequence, per_layer=1 if sequence else 2, replayed=True",
        file=AXES,
    ),
    _cost(
        "per-micro-batch gradient reduction counted once per step",
        "count = m if per_micro_batch else sp.Integer(1)",
        "count = sp.Integer(1)",
        file=PROGRAM,
    ),
    # ------------------------------------------------------------ hpZ: collectives along several axes (_program.py)
    _cost(
        "hpZ: a gather along several axes sized by its own axis alone",
        "shard_elements(pl, P, g, size, whole | {axis})",
        "shard_elements(pl, P, g, size, axis)",
        file=PROGRAM,
    ),
    _cost(
        "hpZ: the backward gather ignores the held copy",
        "whole = {a for a in pl.axes if phase is Phase.BACKWARD and pl.entry(P, g, a).keep_gathered}",
        "whole = {a for a in pl.axes if False}",
        file=PROGRAM,
    ),
    _cost(
        "hpZ: the backward gathers again along the holding axis",
        "if entry.mode is Mode.SHARDED_GATHER and not (phase is Phase.BACKWARD and entry.keep_gathered):",
        "if entry.mode is Mode.SHARDED_GATHER:",
        file=PROGRAM,
    ),
    _cost(
        "hpZ: reduce-scatters along several axes each sized by their own axis",
        "        if len(later) > 1:\n",
        "        if False:\n",
        file=PROGRAM,
    ),
    _cost("hpZ: reduce-scatters along several axes run in mesh order", "    scatter.reverse()\n", "", file=PROGRAM),
)


# Mutants whose meaning no longer exists in the code: kept by name with the reason, so that a
# score can be compared across the change that removed it. Listed by --list and in the JSON,
# never run or scored.
DROPPED: tuple[tuple[str, str], ...] = (
    (
        "answers remembered regardless of the timeout",
        "remembered answers are no longer keyed by the wall-clock timeout: since the run's budget moved to "
        "formal/_solver.py the key is the per-query resource limit (formal/_smt.py _memo), mutated by "
        "'answers remembered regardless of the per-query resource limit'",
    ),
)

# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Outcome:
    name: str
    target: str
    file: str
    status: str  # "killed", "timeout" (counted as killed), "survived", "equivalent"
    seconds: float
    killed_by: str  # the first failing test, or the error, when killed

    @property
    def killed(self) -> bool:
        return self.status in ("killed", "timeout")


def _pattern(snippet: str) -> re.Pattern[str]:
    """``snippet`` as a pattern that tolerates reformatting: any run of white space (a line
    break and indentation included) may differ, a line may break after an opening bracket
    or a comma, and a trailing comma may have been added before a closing bracket."""
    parts = [re.escape(chunk) for chunk in snippet.split()]
    body = r"\s+".join(parts)
    body = re.sub(r"(\\[(\[{]|,)", r"\1\\s*", body)  # after ( [ { or , a break may appear
    body = re.sub(r"(\\[)\]}])", r",?\\s*\1", body)  # before ) ] } a trailing comma may appear
    return re.compile(body)


def located(m: Mutant, root: Path = ROOT) -> Mutant:
    """``m`` with its snippet found where the code now lives. A module split in several keeps
    its name as a prefix (``formal/_smt.py`` -> ``formal/_smt_rules.py``...), and ``ruff format``
    may have re-wrapped the lines: the snippet is looked up exactly first, then in the modules of
    the same family, then tolerant of white space; a unique match replaces ``old``."""
    path = root / m.file
    if path.is_file() and path.read_text().count(m.old) == 1:
        return m
    stem = Path(m.file).stem.lstrip("_").split("_")[0]
    family = sorted((root / Path(m.file).parent).glob(f"_{stem}*.py"))
    exact = [f for f in family if f.read_text().count(m.old) == 1]
    if len(exact) == 1:
        return replace(m, file=str(exact[0].relative_to(root)))
    pattern = _pattern(m.old)
    found = [(f, hit) for f in family for hit in pattern.finditer(f.read_text())]
    if len(found) == 1:
        f, hit = found[0]
        return replace(m, file=str(f.relative_to(root)), old=hit.group(0))
    return m


def catalogue_problems(mutants: Iterable[Mutant], root: Path = ROOT) -> list[str]:
    """Every mutant whose snippet does not occur exactly once, or whose mutated file does not
    compile; and duplicated names. Empty when the catalogue is sound."""
    problems: list[str] = []
    seen: set[str] = {name for name, _ in DROPPED}
    for m in mutants:
        if m.name in seen:
            problems.append(f"{m.name}: name used twice (or also listed as dropped)")
        seen.add(m.name)
        if m.target not in SUBSETS:
            problems.append(f"{m.name}: unknown target {m.target!r}")
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.name}: {m.file} does not exist")
            continue
        text = path.read_text()
        count = text.count(m.old)
        if count != 1:
            problems.append(f"{m.name}: the snippet occurs {count} times in {m.file}, not once: {m.old!r}")
            continue
        if m.old == m.new:
            problems.append(f"{m.name}: the new snippet is the old one")
            continue
        try:
            compile(text.replace(m.old, m.new), str(path), "exec")
        except SyntaxError as err:
            problems.append(f"{m.name}: the mutated {m.file} does not compile: {err}")
    return problems


def _tree_files(root: Path) -> list[str]:
    """The files a scratch copy needs: tracked and untracked-but-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [name for name in listed.split("\0") if name and (root / name).is_file()]


def make_scratch(root: Path, parent: Path) -> Path:
    """A copy of the working tree (never the checkout itself) to mutate."""
    scratch = Path(tempfile.mkdtemp(prefix="mutate-", dir=parent))
    for name in _tree_files(root):
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    return scratch


def _env(scratch: Path) -> dict[str, str]:
    # No bytecode: a restored file and a mutated one of the same size and second must not share
    # a stale .pyc.
    return {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}


def check_scratch_imports(scratch: Path) -> None:
    """The scratch copy's modules, not an installed or editable checkout, are what tests import."""
    out = subprocess.run(
        [sys.executable, "-c", "import formal, checker; print(formal.__file__, checker.__file__)"],
        cwd=scratch,
        env=_env(scratch),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for path in out.split():
        if not Path(path).resolve().is_relative_to(scratch.resolve()):
            raise SystemExit(f"mutate: the scratch copy imports {path}, not its own modules")


_FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)


def run_subset(scratch: Path, tests: Sequence[str], timeout_s: float) -> tuple[str, float, str]:
    """("passed" | "failed" | "timeout", seconds, the first failing test or the error)."""
    start = time.perf_counter()
    present = [t for t in tests if (scratch / t).is_file()]  # a subset file not written yet is skipped
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *present]
    try:
        done = subprocess.run(
            command, cwd=scratch, env=_env(scratch), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, f"no result within {timeout_s:.0f} s"
    seconds = time.perf_counter() - start
    if done.returncode == 0:
        return "passed", seconds, ""
    found = _FAILED.search(done.stdout)
    if found:
        return "failed", seconds, found.group(1)
    tail = (done.stdout + done.stderr).strip().splitlines()
    return "failed", seconds, f"exit {done.returncode}: {tail[-1] if tail else ''}"


class _Scratches:
    """One scratch copy per worker thread, each mutated by one mutant at a time."""

    def __init__(self, copies: list[Path]) -> None:
        self.free = list(copies)
        self.lock = threading.Lock()

    def take(self) -> Path:
        with self.lock:
            return self.free.pop()

    def give(self, scratch: Path) -> None:
        with self.lock:
            self.free.append(scratch)


def run_mutant(m: Mutant, scratches: _Scratches, timeout_s: float) -> Outcome:
    if m.equivalent:
        return Outcome(m.name, m.target, m.file, "equivalent", 0.0, "")
    scratch = scratches.take()
    path = scratch / m.file
    original = path.read_text()
    try:
        path.write_text(original.replace(m.old, m.new, 1))
        result, seconds, detail = run_subset(scratch, SUBSETS[m.target], timeout_s)
    finally:
        path.write_text(original)
        scratches.give(scratch)
    status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[result]
    return Outcome(m.name, m.target, m.file, status, seconds, detail)


def score(outcomes: Sequence[Outcome], target: str) -> dict[str, Any]:
    mine = [o for o in outcomes if o.target == target]
    judged = [o for o in mine if o.status != "equivalent"]
    killed = sum(o.killed for o in judged)
    return {
        "mutants": len(mine),
        "equivalent": len(mine) - len(judged),
        "judged": len(judged),
        "killed": killed,
        "timeouts": sum(o.status == "timeout" for o in judged),
        "score": round(killed / len(judged), 4) if judged else None,
        "survivors": [o.name for o in judged if not o.killed],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("smt", "costs", "all"), default="all")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (one scratch copy each)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only mutants whose name contains NAME (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutant")
    args = parser.parse_args(argv)
    targets = ("smt", "costs") if args.target == "all" else (args.target,)
    catalogue = tuple(located(m) for m in CATALOGUE)
    chosen = [m for m in catalogue if m.target in targets and (not args.only or any(s in m.name for s in args.only))]
    problems = catalogue_problems(catalogue)
    if problems:
        print("mutate: the catalogue no longer matches the code:", *problems, sep="\n  ", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            note = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
            print(f"{m.target:5}  {m.file:28}  {m.name}{note}")
        for name, why in DROPPED:
            print(f"{'-':5}  {'(dropped)':28}  {name}  [dropped: {why}]")
        return 0
    log = sys.stderr if args.json else sys.stdout
    parent = Path(tempfile.gettempdir())
    copies = [make_scratch(ROOT, parent) for _ in range(max(1, args.jobs))]
    try:
        check_scratch_imports(copies[0])
        for target in targets:  # the unmutated tree must pass, or nothing is measured
            result, seconds, detail = run_subset(copies[0], SUBSETS[target], args.timeout * 2)
            print(f"baseline {target}: {result} in {seconds:.0f} s {detail}", file=log, flush=True)
            if result != "passed":
                return 2
        scratches = _Scratches(copies)
        outcomes: list[Outcome] = []

        def one(m: Mutant) -> Outcome:
            o = run_mutant(m, scratches, args.timeout)
            extra = f" ({o.killed_by})" if o.killed_by else ""
            print(f"{o.status:10} {o.seconds:6.1f} s  [{o.target}] {o.name}{extra}", file=log, flush=True)
            return o

        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            outcomes = list(pool.map(one, chosen))
    finally:
        for scratch in copies:
            shutil.rmtree(scratch, ignore_errors=True)
    scores = {target: score(outcomes, target) for target in targets}
    if args.json:
        print(
            json.dumps(
                {
                    "tests": {t: list(SUBSETS[t]) for t in targets},
                    "scores": scores,
                    "mutants": [asdict(o) for o in outcomes],
                    "equivalent": {m.name: m.equivalent for m in chosen if m.equivalent},
                    "dropped": dict(DROPPED),
                },
                indent=2,
            )
        )
    else:
        for target, s in scores.items():
            print(
                f"\n{target}: {s['killed']} of {s['judged']} killed ({s['timeouts']} by timeout), "
                f"{s['equivalent']} equivalent excluded; score {s['score']}"
            )
            for name in s["survivors"]:
                print(f"  survived: {name}")
            for m in chosen:
                if m.target == target and m.equivalent:
                    print(f"  equivalent: {m.name}: {m.equivalent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
