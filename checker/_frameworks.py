"""The cross-framework table: each library strategy, its placement, and what frameworks call it.

The placement columns and the model-state formula are derived (``Composition.placement`` and
``formal._costs.memory`` on a symbolic parameter count); the configuration columns are what our
exporters write for the strategy alone, so the table cannot drift from them. Only the names
people search for (``SHARD_GRAD_OP``, "distributed optimizer") are written by hand, each with
its source.
"""

from __future__ import annotations

from dataclasses import dataclass

from checker._exporters import Target, export
from checker._layout import ExportError
from checker._parse import parse
from formal._costs import memory
from formal._model import DEFAULT_PRECISION, Model, ParameterCount
from formal._presets import PRESETS
from formal._strategies import LIBRARY, Composition
from formal._vocab import WEIGHTS, State

# What people call each placement (sources beside each name).
KNOWN_AS: dict[str, dict[str, str]] = {
    "dp": {
        "PyTorch": "DistributedDataParallel (DDP)",
        "DeepSpeed": "ZeRO stage 0",
        "Megatron-LM": "DDP (default)",
        "torchtitan": "data_parallel_replicate_degree",
    },
    "zero1": {
        "DeepSpeed": "ZeRO stage 1 (Rajbhandari et al. 2020: P_os)",
        "Megatron-LM": "--use-distributed-optimizer (ZeRO-1; fp32 grads: 6 + 12/N bytes/param)",
        "PyTorch": "ZeroRedundancyOptimizer",
    },
    "zero2": {
        "DeepSpeed": "ZeRO stage 2 (P_os+g)",
        "PyTorch": "no FSDP equivalent: SHARD_GRAD_OP also shards parameters (see fsdp-sgo)",
    },
    "zero3": {
        "DeepSpeed": "ZeRO stage 3 (P_os+g+p)",
        "PyTorch": "FSDP FULL_SHARD / fully_shard()",
        "torchtitan": 'data_parallel_shard_degree, fsdp_reshard_after_forward = "always"',
    },
    "fsdp": {"PyTorch": "FSDP FULL_SHARD / fully_shard(reshard_after_forward=True)", "DeepSpeed": "ZeRO stage 3"},
    "fsdp-sgo": {
        "PyTorch": "FSDP SHARD_GRAD_OP / fully_shard(reshard_after_forward=False)",
        "torchtitan": 'fsdp_reshard_after_forward = "never" ("default" under PP)',
        "DeepSpeed": "none: NOT ZeRO-2 (parameters rest sharded, held unsharded through backward)",
    },
    "hsdp": {
        "PyTorch": "FSDP HYBRID_SHARD / fully_shard(mesh=2-D): compose hsdp<k>xdpr<n>",
        "torchtitan": "data_parallel_shard_degree x data_parallel_replicate_degree",
    },
    "dpr": {"PyTorch": "the replicate dimension of HYBRID_SHARD", "torchtitan": "data_parallel_replicate_degree"},
    "distopt": {"Megatron-LM": "--use-distributed-optimizer", "DeepSpeed": "ZeRO stage 1 (16-bit grads)"},
    "tp": {
        "Megatron-LM": "--tensor-model-parallel-size",
        "PyTorch": "ColwiseParallel / RowwiseParallel",
        "DeepSpeed": "tensor_parallel.autotp_size (AutoTP)",
    },
    "pp": {
        "Megatron-LM": "--pipeline-model-parallel-size",
        "DeepSpeed": "PipelineModule(num_stages) / pipeline.stages",
        "torchtitan": "pipeline_parallel_degree",
    },
    "cp": {"Megatron-LM": "--context-parallel-size", "torchtitan": "context_parallel_degree"},
    "ep": {
        "Megatron-LM": "--expert-model-parallel-size",
        "torchtitan": "expert_parallel_degree",
        "DeepSpeed": "MoE(ep_size=...) in model code",
    },
}

# Pairs that users confuse, compared placement against placement (docs/semantics.md, "The strategy library").
CONFUSED: tuple[tuple[str, str], ...] = (
    ("fsdp-sgo", "zero2"),
    ("distopt", "zero1"),
    ("fsdp", "zero3"),
    ("hsdp", "fsdp"),
    ("zero2", "zero1"),
)


@dataclass(frozen=True)
class Row:
    name: str
    axis: str
    description: str
    modes: dict[str, str]  # state -> mode along the axis (default group; '/' joins distinct groups)
    model_states: str  # bytes per device in units of Psi, symbolic degree d
    configs: dict[str, str]  # target -> what our exporter writes, or why it cannot
    known_as: dict[str, str]
    same_placement_as: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        return {
            "strategy": self.name,
            "axis": self.axis,
            "description": self.description,
            "modes": self.modes,
            "model_state_bytes": self.model_states,
            "configs": self.configs,
            "known_as": self.known_as,
            "same_placement_as": list(self.same_placement_as),
        }


def _explain_model(name: str) -> Model:
    return PRESETS["mixtral-8x7b"] if name == "ep" else PRESETS["llama2-7b"]


def _composition(name: str, degree: int) -> Composition:
    return parse(f"{name}{degree}")


def placement_table(name: str, degree: int = 8, model: Model | None = None) -> dict[str, dict[str, str]]:
    """(state.group) -> {axis: mode}: the strategy's placement on a model."""
    return _composition(name, degree).placement(model or _explain_model(name)).table()


def _modes(name: str, degree: int) -> dict[str, str]:
    table = placement_table(name, degree)
    axis = LIBRARY[name]().axis.value
    out: dict[str, str] = {}
    for state in State:
        found = sorted({cells.get(axis, "R") for key, cells in table.items() if key.startswith(f"{state.value}.")})
        out[state.value] = "/".join(found) if found else "-"
    return out


def model_state_formula(name: str) -> str:
    """Model-state bytes per device for a bare count Psi, degree d, mixed-precision Adam (2+2+12)."""
    import sympy as sp  # a symbolic formula: the one use of sympy here

    from formal._model import PSI

    comp = _composition(name, 8)
    pl = comp.placement(ParameterCount(1), symbolic=True)
    mem = memory(pl, ParameterCount(1), DEFAULT_PRECISION, {WEIGHTS: PSI})
    d = sp.Symbol(f"d_{LIBRARY[name]().axis.value}", positive=True, integer=True)
    expr = sp.expand(mem.model_states).subs(d, sp.Symbol("d", positive=True))
    return str(expr)


def _configs(name: str, degree: int) -> dict[str, str]:
    comp = _composition(name, degree)
    model = _explain_model(name)
    out: dict[str, str] = {}
    for target in (Target.DEEPSPEED, Target.TORCHTITAN, Target.MEGATRON):
        try:
            text = export(comp, model, target).text
        except ExportError as err:
            out[target.value] = "cannot: " + str(err).split(": ", 1)[-1].replace(f"{target.value} cannot express ", "")
            continue
        out[target.value] = _summary(target, text)
    return out


def _summary(target: Target, text: str) -> str:
    """The lines of an exported config that carry the strategy (defaults and batch sizes dropped)."""
    import json

    match target:
        case Target.DEEPSPEED:
            doc = json.loads(text)
            parts = [f"zero_optimization.stage={doc['zero_optimization']['stage']}"]
            parts += [
                f"{k}={v}"
                for k, v in (
                    ("pipeline.stages", doc.get("pipeline", {}).get("stages")),
                    ("tensor_parallel.autotp_size", doc.get("tensor_parallel", {}).get("autotp_size")),
                )
                if v
            ]
            return ", ".join(parts)
        case Target.TORCHTITAN:
            keep = (
                "data_parallel_replicate_degree",
                "data_parallel_shard_degree",
                "fsdp_reshard_after_forward",
                "tensor_parallel_degree",
                "pipeline_parallel_degree",
                "context_parallel_degree",
                "expert_parallel_degree",
            )
            lines = [ln for ln in text.splitlines() if ln.split(" = ")[0] in keep and not ln.endswith(" = 1")]
            if "data_parallel_shard_degree = 1" in text:
                lines = [ln for ln in lines if not ln.startswith("fsdp_reshard")]
            return ", ".join(lines)
        case Target.MEGATRON:
            skip = (
                "--num-layers ",
                "--hidden-size",
                "--num-attention-heads",
                "--seq-length",
                "--micro-batch-size",
                "--global-batch-size",
                "--bf16",
            )
            lines = [ln.rstrip(" \\") for ln in text.splitlines()]
            kept = [ln for ln in lines if ln and not ln.startswith(skip) and not ln.endswith(" 1")]
            return ", ".join(kept) if kept else "no flag (DDP is the default)"
        case _:
            raise AssertionError(target)


def same_placement(a: str, b: str, degree: int = 8) -> bool:
    model = _explain_model(a)
    pa, pb = (_composition(n, degree).placement(model) for n in (a, b))
    return bool(LIBRARY[a]().axis is LIBRARY[b]().axis and pa.table() == pb.table())


def placement_difference(a: str, b: str, degree: int = 8) -> dict[str, tuple[str, str]]:
    """(state.group) -> (mode under a, mode under b) where the two differ along their axis."""
    model = _explain_model(a)
    ta = _composition(a, degree).placement(model).table()
    tb = _composition(b, degree).placement(model).table()
    axis = LIBRARY[a]().axis.value
    return {
        k: (ta[k].get(axis, "R"), tb[k].get(axis, "R"))
        for k in ta
        if ta[k].get(axis, "R") != tb.get(k, {}).get(axis, "R")
    }


def explain_row(name: str, degree: int = 8) -> Row:
    strategy = LIBRARY[name]()
    same = tuple(other for other in sorted(LIBRARY) if other != name and same_placement(name, other, degree))
    return Row(
        name=name,
        axis=strategy.axis.value,
        description=strategy.description,
        modes=_modes(name, degree),
        model_states=model_state_formula(name),
        configs=_configs(name, degree),
        known_as=KNOWN_AS.get(name, {}),
        same_placement_as=same,
    )


def all_rows(degree: int = 8) -> list[Row]:
    names = [n for n in LIBRARY if n != "ddp"]  # ddp is an alias of dp
    return [explain_row(n, degree) for n in names]


__all__ = [
    "CONFUSED",
    "KNOWN_AS",
    "Row",
    "all_rows",
    "explain_row",
    "model_state_formula",
    "placement_difference",
    "placement_table",
    "same_placement",
]
