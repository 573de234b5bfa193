"""Cost obligations (proofs/costs.md): sympy proves, for all degrees, that the costs
``formal/_costs.py`` derives from symbolic placements equal the published closed forms.

Nothing here re-types a cost formula: memory comes from ``formal._costs.memory`` on
``Composition.placement(model, symbolic=True)`` (degrees are the symbols ``d_dp``, ``d_tp``),
communication from ``formal._costs.communication`` on ``derive_program``, activations from
``formal._costs.layer_activations`` on the activation placement. Only the right-hand sides (the
papers' expressions) are typed, with their source.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import sympy as sp

from formal._costs import communication, io_activations, layer_activations, memory, model_state_paper_units
from formal._model import (
    DEFAULT_PRECISION,
    PSI,
    ParameterCount,
    a,
    b,
    h,
    io_activation_bytes,
    layer_activation_bytes,
    s,
)
from formal._placement import Options, Placement, Recompute
from formal._program import derive_program
from formal._strategies import LIBRARY, Composition
from formal._verdict import Status
from formal._vocab import WEIGHTS, Stage
from proofs._obligation import Obligation, Outcome

COUNT = ParameterCount(10**9)  # its group is WEIGHTS; the size is the symbol Psi below
N = sp.Symbol("d_dp", positive=True, integer=True)  # the name Composition.placement(symbolic=True) gives
T = sp.Symbol("d_tp", positive=True, integer=True)
SBH = s * b * h


def _placement(*names: str, options: Options | None = None) -> Placement:
    comp = Composition(tuple(LIBRARY[n]().with_degree(2) for n in names), options or Options())
    return comp.placement(COUNT, symbolic=True)


def model_state_memory(name: str) -> sp.Expr:
    """Bytes per device of P, G and O under ``name`` for Psi parameters, ZeRO's precision."""
    pl = _placement(name)
    return memory(pl, COUNT, DEFAULT_PRECISION, {WEIGHTS: PSI}).model_states


def paper_traffic(name: str) -> sp.Expr:
    """Model-state elements moved per step in the ZeRO paper's units."""
    pl = _placement(name)
    return model_state_paper_units(communication(derive_program(pl, COUNT, {WEIGHTS: PSI}), DEFAULT_PRECISION))


def _equal(derived: sp.Expr, closed: sp.Expr, what: str) -> Outcome:
    if sp.simplify(derived - closed) == 0:
        return Outcome(Status.PROVED, f"{what}: derived {sp.factor(derived)} = {closed}")
    return Outcome(Status.REFUTED, f"{what}: derived {sp.factor(derived)} != {closed}")


# Rajbhandari et al., ZeRO (SC'20), section 5 / Figure 1: model-state bytes per device, K = 12.
ZERO_MEMORY: dict[str, sp.Expr] = {
    "dp": 16 * PSI,
    "zero1": 4 * PSI + 12 * PSI / N,
    "zero2": 2 * PSI + 14 * PSI / N,
    "zero3": 16 * PSI / N,
    "fsdp": 16 * PSI / N,
}


def memory_obligation(name: str) -> Outcome:
    return _equal(model_state_memory(name), ZERO_MEMORY[name], f"{name} model states")


def ratio_memory() -> Outcome:
    ratio = sp.simplify(model_state_memory("dp") / model_state_memory("zero3"))
    return _equal(ratio, N, "memory(dp) / memory(zero3)")


def ratio_traffic() -> Outcome:
    ratio = sp.simplify(paper_traffic("zero3") / paper_traffic("dp"))
    return _equal(ratio, sp.Rational(3, 2), "traffic(zero3) / traffic(dp) in Psi units")


def _activations(*names: str, sequence_parallel: bool = False, recompute: Recompute = Recompute.NONE) -> sp.Expr:
    """Per-layer activation bytes of one micro-batch through the placement, s, b, h, a symbolic."""
    from formal._model import Transformer  # the activation groups exist for transformers only

    options = Options(sequence_parallel=sequence_parallel, recompute=recompute)
    comp = Composition(tuple(LIBRARY[n]().with_degree(2) for n in names), options)
    pl = comp.placement(Transformer("shape-only", layers=2, hidden=8, heads=2, vocab=16, seq=8), symbolic=True)
    per_layer = layer_activation_bytes(s, b, h, a, DEFAULT_PRECISION.activations, DEFAULT_PRECISION.mask_bytes)
    return layer_activations(pl, per_layer, SBH, DEFAULT_PRECISION)


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# equations (1)-(6) and Table 2: bytes of activations per layer.
KORTHIKANTI: dict[str, tuple[Callable[[], sp.Expr], sp.Expr]] = {
    "no_parallelism": (lambda: _activations(), SBH * (34 + 5 * a * s / h)),
    "tensor_parallel": (lambda: _activations("tp"), SBH * (10 + 24 / T + 5 * a * s / (h * T))),
    "tensor_sequence_parallel": (
        lambda: _activations("tp", sequence_parallel=True),
        SBH * (34 / T + 5 * a * s / (h * T)),
    ),
    "selective_recompute_tp": (lambda: _activations("tp", recompute=Recompute.SELECTIVE), SBH * (10 + 24 / T)),
    "selective_recompute_tp_sp": (
        lambda: _activations("tp", sequence_parallel=True, recompute=Recompute.SELECTIVE),
        34 * SBH / T,
    ),
    "full_recompute": (lambda: _activations(recompute=Recompute.FULL), 2 * SBH),
}


def activation_obligation(key: str) -> Outcome:
    derive, closed = KORTHIKANTI[key]
    return _equal(derive(), closed, key)


V = sp.Symbol("V", positive=True, integer=True)


def _io_activations(*names: str, sequence_parallel: bool = False, stage: Stage = Stage.FIRST) -> sp.Expr:
    """Input/output-layer activation bytes of one micro-batch through the placement, symbolic."""
    from formal._model import Transformer

    options = Options(sequence_parallel=sequence_parallel)
    comp = Composition(tuple(LIBRARY[n]().with_degree(2) for n in names), options)
    pl = comp.placement(Transformer("shape-only", layers=2, hidden=8, heads=2, vocab=16, seq=8), symbolic=True)
    io = io_activation_bytes(
        s, b, h, V, DEFAULT_PRECISION.activations, DEFAULT_PRECISION.mask_bytes, DEFAULT_PRECISION.logits_bytes
    )
    return io_activations(pl, io, stage)


# Korthikanti et al. 2022, section 4.3: with sequence and tensor parallelism, the input
# embeddings' dropout keeps sbh/t per micro-batch, and the output layer (p = 1) 4sbh/t (1 + v/h).
KORTHIKANTI_IO: dict[str, tuple[Callable[[], sp.Expr], sp.Expr]] = {
    "tensor_sequence_parallel": (
        lambda: _io_activations("tp", sequence_parallel=True),
        SBH / T + 4 * SBH / T * (1 + V / h),
    ),
    "pipeline_first_stage": (lambda: _io_activations("tp", "pp", sequence_parallel=True), SBH / T),
    "pipeline_last_stage": (
        lambda: _io_activations("tp", "pp", sequence_parallel=True, stage=Stage.LAST),
        4 * SBH / T * (1 + V / h),
    ),
}


def io_activation_obligation(key: str) -> Outcome:
    derive, closed = KORTHIKANTI_IO[key]
    return _equal(derive(), closed, f"io {key}")


def obligations() -> list[Obligation]:
    out = [
        Obligation(
            f"costs.memory[{name}]",
            f"for all N and Psi, the model-state memory derived from {name}'s placement equals "
            f"{ZERO_MEMORY[name]} (ZeRO, K=12)",
            "sympy",
            functools.partial(memory_obligation, name),
        )
        for name in ZERO_MEMORY
    ]
    out.append(
        Obligation(
            "costs.zero3_over_dp.memory",
            "for all N, DP holds N times ZeRO-3's model-state memory",
            "sympy",
            ratio_memory,
        )
    )
    out.append(
        Obligation(
            "costs.zero3_over_dp.communication",
            "ZeRO-3 moves 3/2 of DP's model-state traffic (ZeRO paper units, (d-1)/d dropped)",
            "sympy",
            ratio_traffic,
        )
    )
    for key, (_, closed) in KORTHIKANTI.items():
        out.append(
            Obligation(
                f"costs.activations[{key}]",
                f"for all s, b, h, a, t, the per-layer activation bytes derived from the activation "
                f"placement equal {closed} (Korthikanti et al. 2022)",
                "sympy",
                functools.partial(activation_obligation, key),
            )
        )
    for key, (_, closed) in KORTHIKANTI_IO.items():
        out.append(
            Obligation(
                f"costs.io_activations[{key}]",
                f"for all s, b, h, V, t, the input/output-layer activation bytes of one micro-batch "
                f"derived from the placement equal {closed} (Korthikanti et al. 2022, section 4.3)",
                "sympy",
                functools.partial(io_activation_obligation, key),
            )
        )
    return out
