"""``check --convention megatron|deepspeed``: the memory as another tool reports it, from the cost
model's figures, on the screen and in ``--json``. ``megatron``: Megatron-LM's theoretical memory
beside ours, each difference named (``formal._megatron_memory``). ``deepspeed``: ours in the form
of DeepSpeed's estimators (``estimate_zero{2,3}_model_states_mem_needs``): per GPU, and per node
of CPU memory with and without ``zero.Init`` times its ``additional_buffer_factor`` 1.5, in GiB
(``formal._engine_deepspeed.deepspeed_host_memory``)."""

from __future__ import annotations

from fractions import Fraction

from checker._analysis import Analysis
from formal._costs import ceil_int, memory
from formal._engine_deepspeed import deepspeed_host_memory, zero_stage
from formal._engine_effects import Engine, engine_prediction
from formal._megatron_memory import MegatronMemory, megatron_memory
from formal._model import Transformer
from formal._vocab import Stage
from formal.errors import InputError

CONVENTIONS = ("megatron", "deepspeed")
BUFFER_FACTOR = Fraction(3, 2)  # DeepSpeed's estimators' additional_buffer_factor (CPU figures)
GIB = 2**30  # DeepSpeed's estimators print bytes / 2**30 as "GB"
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


def deepspeed_json(analysis: Analysis, node_size: int) -> dict[str, object]:
    """Ours as DeepSpeed's estimators print it: per GPU (the device's model states and buffers)
    and per CPU (a node's host peak, ``min(node_size, devices)`` processes, times 1.5), with and
    without ``zero.Init`` under ZeRO-3, without it under ZeRO-1/2 (it partitions ZeRO-3 only)."""
    pl = analysis.placement
    stage = zero_stage(pl)
    if stage == 0:
        raise InputError("--convention deepspeed: needs a ZeRO stage (zero1, zero2, zero3 or fsdp)")
    mem = analysis.memory
    devices = 1
    for _, degree in pl.mesh:
        devices *= int(degree)
    per_node = min(node_size, devices)
    gpu = ceil_int(mem.model_states) + (0 if mem.buffers is None else ceil_int(mem.buffers))
    rows = []
    for zero_init in (True, False) if stage == 3 else (False,):
        host = deepspeed_host_memory(pl, analysis.model, mem, zero_init)
        cpu = host.per_node(per_node) * BUFFER_FACTOR
        rows.append(
            {
                "zero_init": zero_init,
                "per_cpu": _exact(Fraction(cpu)),
                "per_gpu": gpu,
                "line": f" {float(cpu) / GIB:7.2f}GB | {gpu / GIB:6.2f}GB | zero_init={int(zero_init)}",
                "host_initialisation": host.initialisation,
                "host_steady": host.steady,
            }
        )
    return {
        "convention": "deepspeed",
        "source": "DeepSpeed deepspeed/runtime/zero/stage3.py, stage_1_and_2.py: estimate_zero*_model_states_mem_needs",
        "zero_stage": stage,
        "devices_per_node": per_node,
        "buffers_known": mem.buffers is not None,
        "rows": rows,
    }


def deepspeed_lines(doc: dict[str, object]) -> list[str]:
    rows = doc["rows"]
    assert isinstance(rows, list)
    lines = [
        f"Ours as DeepSpeed's ZeRO-{doc['zero_stage']} estimator prints it ({doc['devices_per_node']} a node,"
        " CPU x 1.5, GiB):",
        "  per CPU  |  per GPU |   Options",
    ]
    lines += [str(r["line"]) for r in rows]
    if not doc["buffers_known"]:
        lines.append("  (per GPU without the gather and bucket buffers: give --largest-layer)")
    return lines


def conventions_json(found: MegatronMemory | dict[str, object]) -> dict[str, object]:
    """The ``conventions`` object of ``--json`` for either convention."""
    return convention_json(found) if isinstance(found, MegatronMemory) else found


def conventions_lines(found: MegatronMemory | dict[str, object]) -> list[str]:
    """The screen's block for either convention."""
    return convention_lines(found) if isinstance(found, MegatronMemory) else deepspeed_lines(found)


__all__ = [
    "CONVENTIONS",
    "convention_json",
    "convention_lines",
    "conventions_json",
    "conventions_lines",
    "deepspeed_json",
    "deepspeed_lines",
    "megatron_line",
    "megatron_of",
]
