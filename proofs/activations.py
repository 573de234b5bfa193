"""Activation-exchange obligations (proofs/activations.md).

Sufficiency: for each axis that splits a layer's computation (tp, tp with sequence
parallelism, cp, ep, pp) at degrees 2, 3 and 4, z3 proves that the derived step program's
activation collectives leave every device with the single-device value at every exchange the
placement needs (``formal._activation_flow.decide_site``).

Necessity: for each such exchange, the program without its collective is refuted by z3, the
counterexample is replayed in exact rational arithmetic (the site's values, independently of
z3), and, where the numpy simulator models the axis (tp, cp, pp), the whole training step is run
on simulated devices and differs from single-device training.
"""

from __future__ import annotations

import functools
from fractions import Fraction

from formal._activation_flow import Site, decide_site, required_sites
from formal._model import Transformer
from formal._placement import Options, Recompute
from formal._program import StepProgram, derive_program
from formal._reference import ReferenceModel
from formal._simulator import reference_for, simulate_program
from formal._strategies import LIBRARY, Composition
from formal._verdict import Status
from formal._vocab import State
from proofs._obligation import Obligation, Outcome

SHAPE = Transformer("shape", layers=24, hidden=48, heads=12, vocab=48, seq=24, ffn=96)
MOE_SHAPE = Transformer("moe", layers=24, hidden=48, heads=12, vocab=48, seq=24, ffn=96, experts=12, top_k=2)
TIMEOUT_MS = 60_000

# (name, strategies, options): one per way of splitting a layer's computation.
SPLITS: dict[str, tuple[tuple[str, ...], Options]] = {
    "tp": (("tp",), Options()),
    "tp_sp": (("tp",), Options(sequence_parallel=True)),
    "cp": (("cp",), Options()),
    "cp_full_recompute": (("cp",), Options(recompute=Recompute.FULL)),
    "ep": (("ep", "dp"), Options()),
    "pp": (("pp",), Options(micro_batches=4)),
}


def _composition(split: str, degree: int) -> Composition:
    names, options = SPLITS[split]
    return Composition(tuple(LIBRARY[n]().with_degree(degree if i == 0 else 2) for i, n in enumerate(names)), options)


def _program(comp: Composition) -> tuple[Transformer, StepProgram]:
    model = MOE_SHAPE if any(s.axis.kind.places_experts for s in comp.strategies) else SHAPE
    return model, derive_program(comp.placement(model), model)


def sufficiency(split: str, degree: int) -> Outcome:
    comp = _composition(split, degree)
    model, program = _program(comp)
    sites = required_sites(program, model)
    if not sites:
        return Outcome(Status.REFUTED, f"{comp}: no exchange required; the obligation would be vacuous")
    lines = []
    for site in sites:
        ob, _ = decide_site(program, site, TIMEOUT_MS)
        if ob.status is not Status.PROVED:
            return Outcome(ob.status, f"{site.rule}: {ob.status.label}", ob.reason_unknown)
        lines.append(site.rule)
    return Outcome(Status.PROVED, f"{comp}: {len(sites)} exchanges proved: {', '.join(lines)}")


def _without(program: StepProgram, site: Site) -> StepProgram:
    return program.with_ops(
        op
        for op in program.ops
        if not (
            op.state is State.ACTIVATIONS
            and op.kind is site.kind
            and op.group == site.group
            and op.axis is site.axis
            and op.phase is site.phase
        )
    )


def _replay(site: Site, witness: dict[str, object], program: StepProgram) -> bool:
    """The site's values in exact rationals from the witness's starting values: True when the
    device it names ends without the single-device value (independent of z3's evaluation)."""
    start = witness["start"]
    assert isinstance(start, dict)
    d = int(str(witness["degree"]))

    def val(x: object) -> Fraction:
        return Fraction(str(x))

    x = [[val(start[f"{i}.{c}"]) for c in range(d)] for i in range(d)]
    i, c = int(str(witness["device"])), int(str(witness["chunk"]))
    ops = [
        op
        for op in program.ops
        if op.state is State.ACTIVATIONS
        and op.kind is site.kind
        and op.group == site.group
        and op.axis is site.axis
        and op.phase is site.phase
    ]
    assert not ops, "the mutated program still has the site's collective"
    freed = object()  # what a device holds where nothing was written: not a value at all
    match site.need:
        case "sum" | "shard-sum":  # device i kept its partial contribution, not the sum
            return x[i][c] != sum(x[j][c] for j in range(d))
        case "gather":  # device i never received chunk c of device c
            held: object = x[c][c] if c == i else freed
            return held is freed
        case "all-to-all":  # device i kept the tokens it holds for c, not those c holds for it
            return x[i][c] != x[c][i]
        case "send":  # nothing was sent: the receiver reads a buffer no one wrote
            return True
        case _:
            raise AssertionError(site.need)


def necessity(split: str, rule: str) -> Outcome:
    comp = _composition(split, 2)
    model, program = _program(comp)
    site = next(s for s in required_sites(program, model) if s.rule == rule)
    broken = _without(program, site)
    ob, found = decide_site(broken, site, TIMEOUT_MS)
    if ob.status is not Status.REFUTED or not found:
        return Outcome(Status.REFUTED, f"{rule}: without its {site.kind.value}, z3 says {ob.status.label}")
    witness = found[0].witness
    if not _replay(site, witness, broken):
        return Outcome(Status.REFUTED, f"{rule}: the exact replay of z3's counterexample does not differ")
    detail = (
        f"{rule}: without its {site.kind.value}, device {witness['device']} holds "
        f"{witness['device_value']} where one device has {witness['single_device']} (replayed exactly)"
    )
    if not site.axis.kind.places_experts:  # the numpy simulator has no experts
        reference = reference_for(comp, ReferenceModel())
        transformer = reference.transformer()
        sim_program = _without(derive_program(comp.placement(transformer), transformer), site)
        result = simulate_program(sim_program, reference, steps=1)
        if result.matches:
            return Outcome(Status.REFUTED, f"{rule}: the simulated training step still matches one device")
        detail += f"; the simulated step diverges: {result.divergence}"
    return Outcome(Status.PROVED, detail)


def _site_rules(split: str) -> list[str]:
    model, program = _program(_composition(split, 2))
    return [s.rule for s in required_sites(program, model)]


def obligations() -> list[Obligation]:
    out = [
        Obligation(
            f"activations.sufficient[{split}, d={d}]",
            f"the derived program completes every activation the {split} placement splits, at degree {d}",
            "z3",
            functools.partial(sufficiency, split, d),
        )
        for split in SPLITS
        for d in (2, 3, 4)
    ]
    for split in SPLITS:
        for rule in _site_rules(split):
            out.append(
                Obligation(
                    f"activations.needed[{split}: {rule.removeprefix('activation_exchange')}]",
                    f"{rule} is necessary: without it some device computes another value than one device",
                    "z3+numpy-check",
                    functools.partial(necessity, split, rule),
                )
            )
    return out


__all__ = ["SPLITS", "necessity", "obligations", "sufficiency"]
