"""Composition obligations (proofs/composition.md; docs/semantics.md, "Composition rules").

* ``composition.sound[<c1>x<c2>]``: every program on a two-axis mesh whose features along each
  axis satisfy that axis's conditions preserves the invariant (z3, features as variables). The
  conditions are per axis and per rule, so this is the soundness of every rule at once:
  composing strategies that each satisfy the conditions on distinct axes preserves them.
* ``composition.needed[<rule>]``: dropping the rule admits a program z3 refutes (uninterpreted
  model and optimizer): a derived library program mutated to break only that rule.
* ``composition.wellformedness[...]``: rules 6a/6b (SP needs tp, EP needs MoE) and rule 7 (cost
  is not validity) are not correctness rules: the programs they reject are proved correct.
"""

from __future__ import annotations

import functools
import itertools

from formal._placement import Options
from formal._program import StepProgram, derive_program
from formal._strategies import LIBRARY, Composition
from formal._verdict import Status
from formal._vocab import EMBEDDING, MLP, Group, State
from proofs._machine import AxisClass, Mesh, MeshAxis, Program, constant_features, mesh_name, sufficiency_query
from proofs._obligation import Obligation, Outcome, combine
from proofs._solver import Answer, prove
from proofs._translate import translate
from proofs.necessity import VIOLATIONS
from proofs.sufficiency import DENSE, derived, instance, step_obligation

# Pairs of axis classes that no composition produces: one cp axis, one ep axis, and no group is
# both a sequence-parallel partial sum on tp and a tied weight on pp.
IMPOSSIBLE = frozenset(
    {(AxisClass.SEQUENCE, AxisClass.SEQUENCE), (AxisClass.EXPERT, AxisClass.EXPERT), (AxisClass.PART, AxisClass.PART)}
)


def two_axis_meshes() -> list[Mesh]:
    return [
        (MeshAxis(a, 2), MeshAxis(b, 2))
        for a, b in itertools.combinations_with_replacement(AxisClass, 2)
        if (a, b) not in IMPOSSIBLE
    ]


def refuted(mesh: Mesh, program: Program) -> Outcome:
    """The rule is needed: z3 finds a model, data and optimizer on which the program is wrong."""
    hyps, goal = sufficiency_query(mesh, constant_features(program), drop=frozenset())
    # The program breaks a rule, so its conditions are false: check the step without them.
    hyps = {k: v for k, v in hyps.items() if k == "invariant_before_step" or k.startswith("domain")}
    result = prove(hyps, goal)
    match result.answer:
        case Answer.SAT:
            return Outcome(Status.PROVED, f"{mesh_name(mesh)}: z3 refutes the program")
        case Answer.UNSAT:
            return Outcome(Status.REFUTED, f"{mesh_name(mesh)}: the program is correct; the rule is not needed")
        case _:
            return Outcome(Status.UNKNOWN, reason_unknown=result.reason_unknown)


NEEDED: dict[str, tuple[str, tuple[str, ...]]] = {
    "orthogonality": ("rule 1 (sizes divide the degrees)", ("indivisible_shards",)),
    "reduction_closure": (
        "rule 2 (reduce along every split axis, along no other, normalised once)",
        (
            "missing_reduction",
            "duplicated_reduction",
            "reduction_on_complete_axis",
            "double_averaging",
            "expert_not_normalised",
        ),
    ),
    "gather_before_use": (
        "rule 3 (a sharded state used whole is gathered or fetched first)",
        ("sharded_read_without_gather", "offloaded_not_fetched"),
    ),
    "alignment": ("rule 4 (P, O and G shards use one partition)", ("misaligned_shards",)),
    "refresh": ("rule 5 (replicas updated from sharded optimizer state are all-gathered)", ("stale_replica_read",)),
    "prerequisite_cp_exchange": (
        "rule 6c (context parallelism needs attention that exchanges K/V)",
        ("missing_kv_exchange",),
    ),
}


def needed_obligation(keys: tuple[str, ...]) -> Outcome:
    by_key = {v.key: v for v in VIOLATIONS}
    return combine([refuted(*by_key[k].build()) for k in keys], f"{len(keys)} programs breaking only this rule refuted")


def wellformed_obligation(spec: tuple[tuple[str, int], ...], options: Options) -> Outcome:
    """Every parameter group of ``spec`` on the dense model: the derived program is correct."""
    comp = Composition(tuple(LIBRARY[n]().with_degree(d) for n, d in spec), options)
    pl = comp.placement(DENSE)
    prog = derive_program(pl, DENSE)
    outcomes = [instance(*_key(prog, g)) for g in pl.groups(State.PARAMETERS)]
    return combine(outcomes, f"{len(outcomes)} groups proved correct")


def _key(prog: StepProgram, group: Group) -> tuple[Mesh, Program]:
    t = translate(prog, group)
    return t.mesh, t.program


def obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for mesh in two_axis_meshes():
        out.append(
            Obligation(
                f"composition.sound[{mesh_name(mesh)}]",
                f"every program on a {mesh_name(mesh)} mesh satisfying each axis's conditions (rules 2-6 per axis) "
                "preserves the invariant: composition on distinct axes is sound",
                "z3",
                functools.partial(step_obligation, mesh),
            )
        )
    for key, (rule, violations) in NEEDED.items():
        out.append(
            Obligation(
                f"composition.needed[{key}]",
                f"{rule} is needed: dropping it admits a program z3 refutes",
                "z3",
                functools.partial(needed_obligation, violations),
            )
        )
    out.append(
        Obligation(
            "composition.wellformedness[sp_without_tp]",
            "rule 6a (sequence parallelism needs tp) is well-formedness, not correctness: SP on a dp-only "
            "composition derives a program proved correct",
            "z3",
            functools.partial(wellformed_obligation, (("dp", 2),), Options(sequence_parallel=True)),
        )
    )
    out.append(
        Obligation(
            "composition.wellformedness[ep_on_dense]",
            "rule 6b (expert parallelism needs an MoE model) is well-formedness: ep on a dense model acts as a "
            "data axis and its program is proved correct",
            "z3",
            functools.partial(wellformed_obligation, (("ep", 2),), Options()),
        )
    )
    out.append(
        Obligation(
            "composition.cost_not_validity[zero2_zero3_with_pp]",
            "rule 7: ZeRO-2/3 under a pipeline with 4 micro-batches (per-micro-batch reduce-scatters) is correct",
            "z3",
            functools.partial(_cost_rule),
        )
    )
    return out


def _cost_rule() -> Outcome:
    outcomes = []
    for name in ("zero2", "zero3"):
        _pl, prog = derived(((name, 2), ("pp", 2)), Options(micro_batches=4))
        for g in (MLP, EMBEDDING):
            t = translate(prog, g)
            outcomes.append(instance(t.mesh, t.program))
    return combine(outcomes, f"{len(outcomes)} (strategy, group) programs proved correct")
