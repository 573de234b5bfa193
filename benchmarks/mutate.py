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
cannot change behaviour are listed with the reason (``equivalent=``) and excluded from the score.

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
    "tests/test_golden_cli.py",
)
# The published-figure and cost-property tests, and the simulator's memory and traffic counts.
COST_TESTS: tuple[str, ...] = (
    "tests/test_mutants_costs.py",
    "tests/test_cost_review.py",
    "tests/test_published.py",
    "tests/test_uneven_stages.py",
    "tests/test_cost_properties.py",
    "tests/test_simulator.py",
)
SUBSETS: dict[str, tuple[str, ...]] = {"smt": SMT_TESTS, "costs": COST_TESTS}
DEFAULT_TIMEOUT_S = 300  # per mutant: several times the subset's own run time

SMT = "formal/_smt.py"
FLOW = "formal/_activation_flow.py"
COSTS = "formal/_costs.py"
PROGRAM = "formal/_program.py"


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
    # ------------------------------------------------------------ composition rules (_smt.py)
    _smt(
        "orthogonality allows two strategies on one axis",
        'f"orthogonality[{axis.value}]", count <= 1,',
        'f"orthogonality[{axis.value}]", count <= 2,',
    ),
    _smt(
        "device count accepts fewer devices than the degrees need",
        "z3.Product(*degree.values()) == total if degree",
        "z3.Product(*degree.values()) <= total if degree",
    ),
    _smt(
        "hidden-by-tp rule dropped",
        'divides("hidden", model.hidden, (Axis.TP,),',
        'divides("hidden", model.hidden, (),',
    ),
    _smt("heads-by-tp rule dropped", 'divides("heads", model.heads, (Axis.TP,),', 'divides("heads", model.heads, (),'),
    _smt(
        "kv_heads-by-tp rule dropped",
        'divides("kv_heads", model.kv_heads_, (Axis.TP,),',
        'divides("kv_heads", model.kv_heads_, (),',
    ),
    _smt(
        "kv_heads rule checked only for multi-head attention",
        "if model.kv_heads_ != model.heads:",
        "if model.kv_heads_ == model.heads:",
    ),
    _smt("ffn-by-tp rule dropped", 'divides("ffn", model.ffn_, (Axis.TP,),', 'divides("ffn", model.ffn_, (),'),
    _smt("vocab-by-tp rule dropped", 'divides("vocab", model.vocab, (Axis.TP,),', 'divides("vocab", model.vocab, (),'),
    _smt(
        "layers-by-pp ignores interleaved chunks",
        "var % (degree[Axis.PP] * chunks) == 0,",
        "var % degree[Axis.PP] == 0,",
    ),
    _smt(
        "layers-by-pp rule dropped",
        '"divides[layers, pp]", var % (degree[Axis.PP] * chunks) == 0,',
        '"divides[layers, pp]", z3.BoolVal(True),',
    ),
    _smt("uneven stages: the at-least-one-layer rule dropped", "degree[Axis.PP] * chunks <= var,", "z3.BoolVal(True),"),
    _smt(
        "uneven stages: as many stages as layers refused (off by one)",
        "degree[Axis.PP] * chunks <= var,",
        "degree[Axis.PP] * chunks < var,",
    ),
    _smt(
        "uneven stages: interleaved chunks not counted", "degree[Axis.PP] * chunks <= var,", "degree[Axis.PP] <= var,"
    ),
    _smt(
        "seq-by-cp rule dropped",
        'divides("seq", model.seq, (Axis.CP,), "context',
        'divides("seq", model.seq, (), "context',
    ),
    _smt(
        "seq-by-tp under sequence parallelism dropped",
        'divides("seq", model.seq, (Axis.CP, Axis.TP),',
        'divides("seq", model.seq, (),',
    ),
    _smt(
        "seq-by-tp under sequence parallelism ignores cp",
        'divides("seq", model.seq, (Axis.CP, Axis.TP),',
        'divides("seq", model.seq, (Axis.TP,),',
    ),
    _smt(
        "experts-by-ep rule dropped",
        'divides("experts", model.experts, (Axis.EP,),',
        'divides("experts", model.experts, (),',
    ),
    _smt("sp_needs_tp always holds", "z3.Implies(sp_on, has[Axis.TP])", "z3.BoolVal(True)"),
    _smt("ep_needs_moe always holds", "z3.Implies(has[Axis.EP], moe)", "z3.BoolVal(True)"),
    _smt("cp_needs_attention always holds", "z3.Implies(has[Axis.CP], attention)", "z3.BoolVal(True)"),
    _smt("interleaved_needs_pp always holds", "z3.Implies(chunks_var > 1, has[Axis.PP])", "z3.BoolVal(True)"),
    _smt(
        "only the first unsat core's rules are reported",
        "        status = Status.REFUTED\n    if violations",
        "        status = Status.REFUTED\n        break\n    if violations",
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
        "if self.case.held and not after_backward:",
        "if self.case.held:",
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
        "answers remembered regardless of the timeout",
        "key = (case, timeout_ms)",
        "key = (case, 0)",
        equivalent="only proved and refuted answers are remembered, and z3's answer to a formula does not depend "
        "on the time it was allowed (the timeout decides only whether an answer comes back)",
    ),
    _smt(
        "at most one answer remembered",
        "_MEMO_LIMIT = 50_000",
        "_MEMO_LIMIT = 1",
        equivalent="the cache's size: a forgotten answer is recomputed from the same case",
    ),
    _smt(
        "z3's default tactic solver",
        "self.solver = z3.SimpleSolver()",
        "self.solver = z3.Solver()",
        equivalent="the same satisfiability question to the same decision procedure, with a tactic preamble "
        "(speed only; unsat cores and models are read by name and value, not by order)",
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
        "if pl.options.recompute is Recompute.FULL:\n            out.append(Site(Axis.CP",
        "if False:\n            out.append(Site(Axis.CP",
        file=FLOW,
    ),
    _smt("no ep all-to-all required", "if split(Axis.EP) and any(", "if False and any(", file=FLOW),
    _smt(
        "sequence parallelism's shard sites replaced by an all-reduce site",
        "if sequence:\n                out.append(Site(Axis.TP, ph, LAYER_IO, OpKind.REDUCE_SCATTER",
        "if False:\n                out.append(Site(Axis.TP, ph, LAYER_IO, OpKind.REDUCE_SCATTER",
        file=FLOW,
    ),
    _smt(
        "the vocabulary-parallel embedding's output needs no sum",
        "if pl.computes_sharded(Axis.TP, EMBEDDING):",
        "if False:",
        file=FLOW,
    ),
    _smt(
        "the vocabulary-parallel head's input gradient needs no sum",
        "if pl.computes_sharded(Axis.TP, head):",
        "if False:",
        file=FLOW,
    ),
    _smt(
        "the embedding output gradient's shards need no gather under SP",
        "        if seq:\n            out.append(Site(Axis.TP, Phase.BACKWARD, EMBEDDING_IO",
        "        if False:\n            out.append(Site(Axis.TP, Phase.BACKWARD, EMBEDDING_IO",
        file=FLOW,
    ),
    _smt("activation exchange modelled on 2 devices", "MAX_DEVICES = 4", "MAX_DEVICES = 2", file=FLOW),
    # ------------------------------------------------------------ in-flight micro-batches (_costs.py)
    _cost(
        "1F1B in-flight micro-batches off by one (first stage)",
        "return sp.Integer(1) if last else sp.Min(p, m)",
        "return sp.Integer(1) if last else sp.Min(p - 1, m)",
    ),
    _cost(
        "1F1B in-flight micro-batches off by one (stage i)",
        "return sp.Min(p - index, m)",
        "return sp.Min(p - index + 1, m)",
    ),
    _cost(
        "1F1B last stage holds two micro-batches",
        "return sp.Integer(1) if last else sp.Min(p, m)",
        "return sp.Min(2, m) if last else sp.Min(p, m)",
    ),
    _cost(
        "GPipe holds p micro-batches",
        "case Schedule.GPIPE:\n            return m\n        case Schedule.ONE_F_ONE_B:\n"
        "            return sp.Integer(1)",
        "case Schedule.GPIPE:\n            return p\n        case Schedule.ONE_F_ONE_B:\n"
        "            return sp.Integer(1)",
    ),
    _cost(
        "interleaved first stage: the extra warm-up ignores v",
        "return sp.Min(p, m) * (1 + (p - 1) / (p * v))",
        "return sp.Min(p, m) * (1 + (p - 1) / p)",
    ),
    _cost(
        "interleaved last stage off by one",
        "return sp.Min(m * v, (v - 1) * p + 1) / v",
        "return sp.Min(m * v, (v - 1) * p) / v",
    ),
    _cost(
        "interleaved stage i warm-up off by one",
        "2 * (p - index - 1) + (v - 1) * p + 1",
        "2 * (p - index) + (v - 1) * p + 1",
    ),
    _cost(
        "a stage index's own in-flight count replaced by the first stage's",
        "live = in_flight_micro_batches(pl, stage) if index is None else stage_in_flight(pl, index)",
        "live = in_flight_micro_batches(pl, stage)",
    ),
    _cost("interleaved bubble ignores v", "return (p - 1) / (sp.Integer(pl.options.chunks) * m)", "return (p - 1) / m"),
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
        "if axis in (Axis.PP, Axis.DP, Axis.DPR, Axis.EP):\n            continue  # b is one",
        "if axis in (Axis.PP, Axis.DP, Axis.DPR):\n            continue  # b is one",
    ),
    _cost(
        "recomputed activation groups still counted",
        "if pl.local_mode(State.ACTIVATIONS, g) is Mode.MATERIALIZED:\n            continue",
        "if False:\n            continue",
    ),
    _cost(
        "input-layer activations kept on the last stage",
        'if group in FIRST_STAGE_ACTIVATIONS:\n        return stage == "first"',
        'if group in FIRST_STAGE_ACTIVATIONS:\n        return stage == "last"',
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
    _cost(
        "a shard-grad-op buffer holds the whole stage, own shard included", "held += full * (1 - 1 / d)", "held += full"
    ),
    _cost(
        "the gather buffer holds every layer of the stage",
        "piece = full / pl.stage_layers(layer_count) if g in LAYER_GROUPS else full",
        "piece = full",
    ),
    _cost(
        "a gradient bucket for groups computed sharded",
        "return (entry.mode is Mode.SHARDED and axis.splits_data\n"
        "                    and not pl.computes_sharded(axis, group))",
        "return (entry.mode is Mode.SHARDED and axis.splits_data)",
    ),
    _cost(
        "uneven stages charged the even share of layers",
        "return 1 / p if layer_share is None else layer_share",
        "return 1 / p",
        file=PROGRAM,
    ),
    _cost(
        "the tied embedding held on the first stage only",
        'return sp.Integer(1) if stage in ("first", "last") or p == 1 else sp.Integer(0)\n    if entry.mode in',
        'return sp.Integer(1) if stage == "first" or p == 1 else sp.Integer(0)\n    if entry.mode in',
        file=PROGRAM,
    ),
    # ------------------------------------------------------------ communication (_costs.py, _program.py)
    _cost(
        "tied-embedding traffic only on the first stage",
        'return sp.Integer(int(stage in ("first", "last")))',
        'return sp.Integer(int(stage == "first"))',
    ),
    _cost(
        "a middle stage sends one way only",
        "return sp.Rational(2 * chunks - ends, chunks)",
        "return sp.Rational(2 * chunks - max(ends, 1), chunks)",
    ),
    _cost("the end stages send both ways", 'ends = int(stage == "first") + int(stage == "last")', "ends = 0"),
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
        "participants = sp.Integer(2) if axis is Axis.PP and d != 1 else None",
        "participants = None",
        file=PROGRAM,
    ),
    _cost(
        "full recomputation does not replay tp collectives",
        "per_layer = 2 * per_layer  # full recomputation",
        "per_layer = per_layer  # full recomputation",
        file=PROGRAM,
    ),
    _cost(
        "cp keys and values not re-gathered under full recomputation",
        "return [gather, scatter] if self.pl.options.recompute is Recompute.FULL else [scatter]",
        "return [scatter]",
        file=PROGRAM,
    ),
    _cost(
        "an ep all-to-all once per layer, not each way",
        "tokens, 2 * self._layers_per_stage() * self.m,",
        "tokens, self._layers_per_stage() * self.m,",
        file=PROGRAM,
    ),
    _cost("pipeline sends ignore interleaved chunks", "bsh, self.m * chunks,", "bsh, self.m,", file=PROGRAM),
    _cost(
        "sequence-parallel collectives once per layer, not per block",
        "bsh, 2 * per_layer),\n                    Op(OpKind.REDUCE_SCATTER",
        "bsh, per_layer),\n                    Op(OpKind.REDUCE_SCATTER",
        file=PROGRAM,
    ),
    _cost(
        "per-micro-batch gradient reduction counted once per step",
        "count = m if per_micro_batch else sp.Integer(1)",
        "count = sp.Integer(1)",
        file=PROGRAM,
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
    seen: set[str] = set()
    for m in mutants:
        if m.name in seen:
            problems.append(f"{m.name}: name used twice")
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
