"""``check --convention megatron``: Megatron-LM's theoretical memory beside ours, each difference
named (``formal._megatron_memory``), on the screen and in ``--json``."""

from __future__ import annotations

from fractions import Fraction

from checker._analysis import Analysis
from formal._costs import memory
from formal._engine_effects import Engine, engine_prediction
from formal._megatron_memory import MegatronMemory, megatron_memory
from formal._model import Transformer
from formal._vocab import Stage
from formal.errors import InputError

CONVENTIONS = ("megatron",)
MB = 2**20  # Megatron's NUM_BYTES_IN_MEGABYTE
SOURCE = "Megatron-LM megatron/training/theoretical_memory_usage.py (report_theoretical_memory)"


def megatron_of(analysis: Analysis) -> MegatronMemory:
    """Megatron's theoretical memory of the analysis' most loaded device (its first pipeline
    stage, as Megatron reports), from the cost model's figures of that stage."""
    model = analysis.model
    if not isinstance(model, Transformer):
        raise InputError("--convention megatron: needs a model with layers (a preset, config.json or --from)")
    pl = analysis.placement
    first = memory(pl, model, analysis.precision, model.group_elements(), Stage.FIRST)
    prediction = engine_prediction(pl, model, analysis.precision, first, Engine.MEGATRON, Stage.FIRST)
    return megatron_memory(pl, model, analysis.precision, first, prediction)


def _exact(value: Fraction) -> int | str:
    """An integer, or the exact fraction as a string (docs/schema.md: ``"3/16"``)."""
    return value.numerator if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def megatron_line(m: MegatronMemory) -> str:
    """``report_theoretical_memory``'s printed line for these figures."""
    w, a = float(m.weights_and_optimizer) / MB, float(m.activations) / MB
    return f"weight and optimizer={w:.2f} MB, activation={a:.2f} MB, total={w + a:.2f} MB"


def convention_json(m: MegatronMemory) -> dict[str, object]:
    return {
        "convention": "megatron",
        "source": SOURCE,
        "formula": "sequence parallel + selective" if m.sequence_parallel_formula else "without sequence parallel",
        "line": megatron_line(m),
        "weights_and_optimizer": _exact(m.weights_and_optimizer),
        "activations": _exact(m.activations),
        "ours": {
            "weights_and_optimizer": _exact(m.ours_weights_and_optimizer),
            "activations": _exact(m.ours_activations),
        },
        "terms": [
            {"name": t.key, "label": t.label, "part": part, "bytes": _exact(t.bytes)}
            for part, terms in (("weights_and_optimizer", m.weight_terms), ("activations", m.activation_terms))
            for t in terms
            if t.bytes
        ],
    }


def _fitted(line: str, width: int = 80) -> list[str]:
    """``line``, cut after its first comma into two when it is wider than ``width``."""
    if len(line) <= width or ", " not in line:
        return [line]
    head, tail = line.split(", ", 1)
    return [head + ",", "    " + tail]


def convention_lines(m: MegatronMemory) -> list[str]:
    """The screen's block, within 80 columns."""
    formula = "with SP + selective" if m.sequence_parallel_formula else "without SP"
    ours_w, ours_a = float(m.ours_weights_and_optimizer) / MB, float(m.ours_activations) / MB
    lines = [f"Megatron-LM's theoretical memory ({formula} formula; MB = 2^20 bytes):"]
    lines += _fitted(f"  {megatron_line(m)}")
    lines += _fitted(f"  ours, first stage: weight and optimizer={ours_w:.2f} MB, activation={ours_a:.2f} MB")
    lines.append("  its conventions (Megatron's bytes minus ours):")
    for t in (*m.weight_terms, *m.activation_terms):
        if t.bytes:
            lines.append(f"    {t.label:<52} {float(t.bytes) / MB:>+14.2f} MB")
    return lines


__all__ = ["CONVENTIONS", "convention_json", "convention_lines", "megatron_line", "megatron_of"]
