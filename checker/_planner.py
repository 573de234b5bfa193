"""The planner: the best valid composition for a model on a cluster.

How it works (docs/planner.md has the long form):

1. **Families.** A *family* is a composition with its degrees and micro-batch count left open:
   the data-axis strategy (DP, ZeRO-1/2/3, FSDP shard-grad-op, HSDP), offload, pipeline schedule,
   sequence parallelism and recomputation. Every family carries the axes tp, cp, (ep), dp, (dpr)
   and, when it pipelines, pp.
2. **Exact, then vectorized.** For each family the cost core (``Composition.placement(model,
   symbolic=True)``, ``derive_program``, ``memory``, ``communication``) produces exact sympy
   expressions in the degree symbols ``d_tp, d_cp, d_ep, d_dp, d_dpr, d_pp`` and the micro-batch
   count ``m``; they are lambdified once and evaluated with numpy on every mesh of the family.
   The expressions are derived per *component* (model-state memory, model-state traffic,
   activation memory and traffic), each keyed by only the choices it depends on, so one family
   costs no new derivation when its components are known. A degree of 1 is the same expression
   at 1 (ring factors ``(d-1)/d`` vanish, shard factors become 1), except for pp, whose presence
   is structural (stage placement, point-to-point sends). Activation terms are derived at
   micro-batch size 1 and scaled by it (Korthikanti's bytes are linear in ``b``).
3. **Rank** the candidates that pass the composition rules checkable from numbers (section 4.1
   of the semantics: divisibility, prerequisites) and whose most-loaded device fits, by the
   calibrated step time of ``formal._steptime`` (on the hardware given, or the preset assumed
   from the device memory: ``formal._hardware.assumed_hardware``) or by communication. A bare
   parameter count has no layers to time: it is ranked by communication, its step time unknown.
4. **Prove.** Walk the ranking from the top; every shown candidate is recomputed exactly (integer
   costs through ``checker._analysis``, cross-checking the vectorized numbers) and decided by z3
   (``formal._smt.decide``), one call per structurally distinct family first (a family refuted on
   gradient integrity or state consistency is refuted for every degree), then per candidate.
   Nothing is called valid unless z3 proved it; without ``formal._smt`` candidates are shown as
   unproved.

The modules: ``checker._plan_space`` (families, inputs, meshes), ``checker._plan_costs`` (the
vectorized cost expressions and the step-time terms), ``checker._plan_rules`` (the rules checkable
from numbers), ``checker._plan_results`` (candidates, the plan, explanations, popular
alternatives) and ``checker._plan_command`` (the ``plan`` subcommand). This one enumerates,
evaluates, ranks and proves, and re-exports the names the others' users import.
"""

from __future__ import annotations

import importlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from checker._plan_cache import VerdictCache
from checker._plan_costs import Deriver, Vectorized
from checker._plan_results import Alternative, Candidate, Plan, _alternatives, _Table, explain_pair, family_of
from checker._plan_rules import family_rules, mesh_rules
from checker._plan_rules import family_setting as family_setting
from checker._plan_space import (
    _DP,
    _DPR,
    _EP,
    _PP,
    AXES,
    Cluster,
    DataParallel,
    Family,
    Ints,
    Offload,
    Pipeline,
    RankBy,
    Space,
    Workload,
    meshes,
)
from checker._plan_space import DEGREES as DEGREES
from checker._plan_space import MICRO_BATCHES as MICRO_BATCHES
from checker._plan_space import Bools as Bools
from checker._plan_space import divisors as divisors
from checker._plan_space import offloads_for as offloads_for
from formal._costs import STAGES, busiest_stage_traffic, ceil_int, most_loaded, total_bytes
from formal._hardware import Hardware, assumed_hardware
from formal._model import DEFAULT_PRECISION, Model, Precision, Transformer
from formal._program import StepProgram, derive_program, group_sizes
from formal._steptime import (
    Efficiency,
    Runtime,
    StepInputs,
    assemble,
    calibrated,
    evaluate_batch,
    perturbations,
    uncertainty,
)
from formal._strategies import Composition
from formal._verdict import Condition, Status, Verdict
from formal.errors import InputError

Decide = Callable[[Composition, StepProgram, Model], Verdict]


# --- the planner --------------------------------------------------------------------------


def load_decide() -> tuple[Decide | None, str]:
    """``formal._smt.decide`` when it exists; otherwise None and why."""
    try:
        module = importlib.import_module("formal._smt")
    except ImportError as err:
        return None, f"no z3 verdicts: formal._smt not importable ({err})"
    decide = getattr(module, "decide", None)
    if decide is None:
        return None, "no z3 verdicts: formal._smt has no decide()"
    return cast(Decide, decide), "z3 (formal._smt.decide)"


_DERIVERS: dict[tuple[Model, Precision, bool], Deriver] = {}


def deriver_for(model: Model, precision: Precision, uneven_stages: bool = False) -> Deriver:
    key = (model.with_micro_batch(1), precision, uneven_stages)
    if key not in _DERIVERS:
        _DERIVERS[key] = Deriver(model, precision, uneven_stages)
    return _DERIVERS[key]


def plan(
    model: Model,
    cluster: Cluster,
    workload: Workload = Workload(),  # noqa: B008 (frozen, as is Space)
    precision: Precision = DEFAULT_PRECISION,
    space: Space = Space(),  # noqa: B008 (frozen)
    top: int = 5,
    rank_by: RankBy = RankBy.TIME,
    decide: Decide | str | None = "auto",
    max_decisions: int = 60,
    hardware: Hardware | None = None,
    runtime: Runtime = Runtime(),  # noqa: B008 (frozen)
    efficiency: Efficiency | None = None,
    workers: int = 1,
    worker_timeout: float = 600.0,
    cache: VerdictCache | None = None,
    hardware_assumed: bool = False,
) -> Plan:
    """Enumerate, evaluate, rank and prove (see the module docstring). The step time is the
    calibrated model's (``formal._steptime``, constants ``efficiency`` or the shipped ones) on
    ``hardware``, or without it on the preset assumed from the cluster's device memory
    (``assumed_hardware``, with the cluster's node size; ``Plan.hardware_assumed``), and every
    candidate is also timed with each constant moved by its fitted uncertainty
    (``Plan.sensitivity``). ``hardware_assumed``: the ``hardware`` given is itself such an
    assumption (the CLI's, with its options applied), and the plan says so. A bare parameter
    count has no step time (NaN): it is ranked by communication."""
    clock = {"start": time.perf_counter()}
    if top < 1:
        raise InputError(f"--top {top}: must be at least 1")
    if hardware is not None and not isinstance(model, Transformer):
        raise InputError("--hardware: the calibrated step time needs a model with layers (give --model)")
    assumed = (hardware is None or hardware_assumed) and isinstance(model, Transformer)
    if isinstance(model, Transformer):
        if hardware is None:
            hardware = replace(assumed_hardware(cluster.device_memory), node_size=cluster.node_size)
        timed: _Timing | None = _Timing.of(hardware, runtime, efficiency, cluster)
    else:
        timed = None
        rank_by = RankBy.COMMUNICATION  # nothing to time: no layers, no FLOPs
    n = cluster.devices
    global_batch = workload.global_batch if workload.global_batch is not None else n
    if global_batch < 1:
        raise InputError(f"--global-batch {global_batch}: must be at least 1")
    for bsz in workload.micro_batch_sizes:
        if bsz < 1:
            raise InputError(f"micro-batch size {bsz}: must be at least 1")
    pins = {AXES.index(a): d for a, d in space.pins}
    for axis, d in space.pins:
        if d < 1 or n % d:
            raise InputError(f"--fix {axis.value}={d}: must divide --devices {n}")
    deriver = deriver_for(model, precision, workload.uneven_stages)
    families = space.families(model)

    all_meshes = meshes(n, len(AXES), pins)
    deg = np.repeat(all_meshes, len(workload.micro_batch_sizes), axis=0)
    b = np.tile(np.array(workload.micro_batch_sizes, dtype=np.int64), all_meshes.shape[0])
    base_ok = np.ones(deg.shape[0], dtype=bool)
    for mask in mesh_rules(model, global_batch, workload.uneven_stages, deg, b).values():
        base_ok &= mask
    deg, b = deg[base_ok], b[base_ok]
    replicas = deg[:, _DP] * deg[:, _DPR] * deg[:, _EP] * b
    m = global_batch // replicas
    enumerated = len(families) * all_meshes.shape[0] * len(workload.micro_batch_sizes)
    clock["enumerate"] = time.perf_counter()

    job = _Job(model, precision, workload.uneven_stages, timed, deg, b, m)
    blocks, step_inputs = _evaluate_all(job, list(enumerate(families)), workers, worker_timeout)
    table = _concat(blocks)
    if timed is not None and step_inputs:
        timed.fill(table, StepInputs.concat(step_inputs), cluster.usable_memory)
    clock["evaluate"] = time.perf_counter()

    # The ZeRO paper's capacity tables are exact at the boundary (16 Psi / N = 32 GB): allow
    # float rounding here, and confirm every shown candidate with exact integers.
    fits = table.memory <= cluster.usable_memory * (1 + 1e-12)  # peak + reserve <= device memory
    fit_rows = np.flatnonzero(fits)
    comm = table.traffic.sum(axis=1)
    if timed is None:  # no time to weigh links by: every byte a device moves, host transfers too
        comm = comm + table.host
    if rank_by is RankBy.TIME:
        keys = (table.memory[fit_rows], comm[fit_rows], table.step_s[fit_rows])
    else:
        keys = (table.memory[fit_rows], table.step_s[fit_rows], comm[fit_rows])
    order = fit_rows[np.lexsort(keys)]
    clock["rank"] = time.perf_counter()

    decide_fn, solver = load_decide() if decide == "auto" else (cast(Decide | None, decide), "given decide()")
    if decide_fn is None and decide != "auto":
        solver = "no z3 verdicts: decide disabled"
    result = Plan(
        model,
        cluster,
        workload,
        global_batch,
        precision,
        rank_by,
        families,
        table,
        fits,
        order.astype(np.int64),
        enumerated,
        [],
        [],
        {},
        0,
        solver,
        {},
        deriver.derivations,
        hardware,
        timed.moves if timed is not None else (),
        hardware_assumed=assumed,
    )
    _prove_top(result, deriver, decide_fn, top, max_decisions, cache)
    clock["prove"] = time.perf_counter()
    result.alternatives = _alternatives(result)
    clock["explain"] = time.perf_counter()
    stamps = list(clock.items())
    result.seconds = {name: round(t - prev, 4) for (_, prev), (name, t) in itertools.pairwise(stamps)}
    result.seconds["total"] = round(stamps[-1][1] - stamps[0][1], 4)
    result.derivations = deriver.derivations
    return result


@dataclass(frozen=True)
class _Job:
    """What evaluating a family needs, sent to a worker process (spawn: pickled)."""

    model: Model
    precision: Precision
    uneven: bool
    timed: _Timing | None
    deg: Ints
    b: Ints
    m: Ints


def _evaluate_families(
    job: _Job, families: list[tuple[int, Family]]
) -> tuple[list[tuple[int, _Table]], list[tuple[int, StepInputs]]]:
    """The cost table (and step-time inputs) of each family's rule-passing rows."""
    deriver = deriver_for(job.model, job.precision, job.uneven)
    blocks: list[tuple[int, _Table]] = []
    inputs: list[tuple[int, StepInputs]] = []
    for fi, family in families:
        ok = np.ones(job.deg.shape[0], dtype=bool)
        for mask in family_rules(family, job.model, job.uneven, job.deg, job.m).values():
            ok &= mask
        rows = np.flatnonzero(ok)
        if rows.size == 0:
            continue
        deg, b, m = job.deg[rows], job.b[rows], job.m[rows]
        blocks.append((fi, _evaluate(deriver, family, fi, deg, b, m)))
        if job.timed is not None:
            inputs.append((fi, job.timed.inputs(deriver, family, deg, b, m)))
    return blocks, inputs


def _evaluate_all(
    job: _Job, families: list[tuple[int, Family]], workers: int, timeout: float
) -> tuple[list[_Table], list[StepInputs]]:
    """``_evaluate_families`` in this process, or over ``workers`` spawned processes (families
    dealt round-robin; the blocks put back in family order, so the result does not depend on
    the pool). A worker past ``timeout`` seconds is an error, not a hang."""
    if workers <= 1 or len(families) < 2:
        blocks, inputs = _evaluate_families(job, families)
    else:
        import concurrent.futures
        import multiprocessing

        shares = [families[i::workers] for i in range(workers)]
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold threads
        pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context)
        try:
            futures = [pool.submit(_evaluate_families, job, share) for share in shares if share]
            blocks, inputs = [], []
            for future in futures:
                try:
                    part_blocks, part_inputs = future.result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    why = f"--workers: a worker took more than {timeout:g} s; rerun with --workers 1"
                    raise InputError(why) from None
                blocks += part_blocks
                inputs += part_inputs
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        blocks.sort(key=lambda item: item[0])
        inputs.sort(key=lambda item: item[0])
    return [t for _, t in blocks], [x for _, x in inputs]


def _evaluate(deriver: Deriver, family: Family, fi: int, deg: Ints, b: Ints, m: Ints) -> _Table:
    """Memory and traffic of the family's rows; the seconds are NaN until ``_Timing.fill``."""
    cols = np.column_stack([deg.astype(np.float64), m.astype(np.float64)])
    first_s, last_s, host = deriver.states(family)(cols)
    straffic = np.column_stack(deriver.state_traffic(family)(cols))
    act = deriver.activations(family)(cols)
    bf = b.astype(np.float64)
    first = first_s + bf * act[0]
    last = last_s + bf * act[1]
    n = deg.shape[0]
    # Per pipeline stage (first, middle, last), per axis; the device that sends the most counts
    # (a middle stage exists beyond two stages; the first wins a tie, as in busiest_stage_traffic).
    per_stage = (straffic + bf[:, None] * np.column_stack(act[3:])).reshape(n, len(STAGES), len(AXES))
    totals = per_stage.sum(axis=2)
    totals[:, 1] = np.where(deg[:, _PP] > 2, totals[:, 1], -np.inf)
    traffic = per_stage[np.arange(n), np.argmax(totals, axis=1), :]
    untimed = np.full(n, np.nan)
    return _Table(
        family=np.full(n, fi, dtype=np.int64),
        degrees=deg,
        b=b,
        m=m,
        memory=np.maximum(first, last),
        last_heavier=last > first,
        traffic=traffic,
        host=np.asarray(host),
        compute_s=untimed,
        bubble_s=untimed,
        communication_s=untimed,
        host_s=untimed,
        step_moved=np.zeros((n, 0)),
    )


def _concat(blocks: list[_Table]) -> _Table:
    if not blocks:
        z = np.zeros(0)
        zi = np.zeros(0, dtype=np.int64)
        return _Table(
            zi,
            np.zeros((0, len(AXES)), dtype=np.int64),
            zi,
            zi,
            z,
            np.zeros(0, dtype=bool),
            np.zeros((0, len(AXES))),
            z,
            z,
            z,
            z,
            z,
            np.zeros((0, 0)),
        )
    return _Table(
        *(
            np.concatenate([getattr(bl, f) for bl in blocks])
            for f in (
                "family",
                "degrees",
                "b",
                "m",
                "memory",
                "last_heavier",
                "traffic",
                "host",
                "compute_s",
                "bubble_s",
                "communication_s",
                "host_s",
                "step_moved",
            )
        )
    )


class _Timing:
    """The calibrated step time of a plan (``formal._steptime``): the hardware, the runtime
    settings, the constants and the constants moved by their uncertainty."""

    def __init__(self, hardware: Hardware, runtime: Runtime, eff: Efficiency, cluster: Cluster) -> None:
        self.hardware = hardware
        self.runtime = runtime
        self.eff = eff
        self.overrides = dict(cluster.bandwidths)
        self.moves = perturbations(eff, uncertainty())

    @classmethod
    def of(cls, hardware: Hardware, runtime: Runtime, eff: Efficiency | None, cluster: Cluster) -> _Timing:
        return cls(hardware, runtime, eff if eff is not None else calibrated(), cluster)

    def inputs(self, deriver: Deriver, family: Family, deg: Ints, b: Ints, m: Ints) -> StepInputs:
        """The step-time inputs of the family's rows, from its terms (derived once per family
        component and evaluated on every row)."""
        cols = np.column_stack([deg.astype(np.float64), m.astype(np.float64)])
        compute_terms, compute_fn = deriver.step_compute(family, self.runtime)
        state_terms, state_fn = deriver.step_state(family, self.runtime)
        return assemble(
            compute_terms.bind(compute_fn(cols)),
            state_terms.bind(state_fn(cols)),
            [(axis, deg[:, i].astype(np.float64)) for i, axis in enumerate(AXES)],
            b.astype(np.float64),
            cast(Transformer, deriver.model),
            self.hardware,
            self.runtime,
            self.overrides,
        )

    def fill(self, table: _Table, inputs: StepInputs, usable_memory: int) -> None:
        """The calibrated model's seconds in ``table`` (compute, exposed collectives, bubble,
        optimizer and host), and the step under each moved constant of the rows that fit (the
        others are never ranked: +inf)."""
        times = evaluate_batch(inputs, self.eff)
        table.compute_s = times.compute_seconds
        table.bubble_s = times.bubble_seconds
        table.communication_s = times.exposed.sum(axis=1)
        table.host_s = times.optimizer_seconds + times.host_seconds
        fit = np.flatnonzero(table.memory <= usable_memory * (1 + 1e-12))  # as plan() decides a fit
        fitting = inputs.take(fit)
        table.step_moved = np.full((len(table), len(self.moves)), np.inf)
        for j, (_, _, eff) in enumerate(self.moves):
            table.step_moved[fit, j] = evaluate_batch(fitting, eff).step_seconds


def exact_costs(candidate: Candidate, model: Model, precision: Precision) -> tuple[int, int, str, StepProgram]:
    """Exact integer memory of the most-loaded device and bytes per step, from the core."""
    comp = candidate.composition()
    sized = model.with_micro_batch(candidate.micro_batch)
    pl = comp.placement(sized)
    program = derive_program(pl, sized)
    mem = most_loaded(pl, sized, precision, group_sizes(sized))
    traffic = busiest_stage_traffic(program, precision)[1]
    return ceil_int(mem.total), ceil_int(total_bytes(traffic)), mem.stage, program


_STRUCTURAL = (Condition.GRADIENT_INTEGRITY, Condition.STATE_CONSISTENCY)


def _prove_top(
    result: Plan,
    deriver: Deriver,
    decide: Decide | None,
    top: int,
    max_decisions: int,
    cache: VerdictCache | None = None,
) -> None:
    """Walk the ranking: confirm costs exactly, then let z3 decide, until ``top`` are shown."""
    refuted_families: set[int] = set()
    for row in result.order:
        if len(result.top) >= top or result.decided >= max_decisions:
            break
        cand = result.candidate(int(row))
        fi = int(result.table.family[row])
        if fi in refuted_families:
            continue
        mem, comm, _, program = exact_costs(cand, result.model, result.precision)
        peak = result.peak(int(row))  # what check-composition prints for this composition
        if peak.total > result.cluster.usable_memory:
            continue  # over the capacity exactly, with its engine's own buffers
        cand = replace(
            cand,
            exact_memory=peak.total,
            placement_memory=mem,
            engine=peak.engine.value,
            exact_communication=comm,
            stage=peak.stage,
        )
        if decide is None:
            result.top.append(
                replace(cand, rank=len(result.top) + 1, status=None, verdict_note="unproved: " + result.solver)
            )
            continue
        family_key = VerdictCache.family_key(cand.family, result.model)
        candidate_key = f"{cand.text} b{cand.micro_batch}"
        verdict = cache.get(family_key, candidate_key) if cache is not None else None
        if verdict is None:
            verdict = decide(cand.composition(), program, result.model.with_micro_batch(cand.micro_batch))
            result.decided += 1
            if cache is not None:
                cache.put(family_key, candidate_key, verdict)
        else:
            result.cache_hits += 1
        if verdict.status is Status.PROVED:
            result.top.append(
                replace(
                    cand,
                    rank=len(result.top) + 1,
                    status=Status.PROVED,
                    verdict_note="proved",
                    notes=cand.framework_notes(result.model),
                )
            )
            continue
        rules = ", ".join(v.rule for v in verdict.violations) or ", ".join(
            f"{o.name}: {o.reason_unknown}" for o in verdict.obligations if o.status is Status.UNKNOWN
        )
        if verdict.status is Status.REFUTED and any(v.condition in _STRUCTURAL for v in verdict.violations):
            refuted_families.add(fi)
            result.refuted[str(cand.family)] = f"refuted on {cand.text}: {rules}"
        else:
            result.refuted[cand.text] = f"{verdict.status.label}: {rules}"


__all__ = [
    "AXES",
    "Alternative",
    "Candidate",
    "Cluster",
    "DataParallel",
    "Deriver",
    "Family",
    "Offload",
    "Pipeline",
    "Plan",
    "RankBy",
    "Space",
    "VerdictCache",
    "Vectorized",
    "Workload",
    "exact_costs",
    "explain_pair",
    "family_of",
    "load_decide",
    "meshes",
    "plan",
]
