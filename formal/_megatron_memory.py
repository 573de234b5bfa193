"""Megatron-LM's conventions for its theoretical memory, as named terms on the cost model's figure.

Megatron-LM prints a "theoretical memory footprint" at start-up
(megatron/training/theoretical_memory_usage.py: ``compute_weight_and_optimizer_memory``,
``compute_activation_memory`` under sequence parallelism with selective recomputation and
``compute_activation_memory_without_sp`` otherwise). It counts differently from the placement
model in named ways; ``megatron_memory`` returns the cost model's figure for the most loaded
device (the first pipeline stage) and each convention as a term, so that with every term
applied (``MegatronMemory.weights_and_optimizer`` / ``.activations``) the figure is Megatron's,
and each difference has a name and a size. Which is right where they differ:

* weights: 18 bytes a parameter (6 + 12/d with the distributed optimizer; "2 bytes for model
  parameters used for fprop and bprop, 4 bytes for main parameters, 4 bytes for gradients, 8
  bytes for Adam states", NVIDIA/Megatron-LM issue #654) whatever the recipe, where an fp16 run
  keeps 2-byte gradients (20 bytes, Megatron Core's docs); Megatron counts the matrices and
  norms only (no linear biases, no learned position table), divides the norms by tp (they are
  replicated on every tp rank: Megatron-LM's ``LayerNorm`` is not tensor-parallel), and spreads
  the final norm over the pipeline stages (it lives on the last). The placement model holds what
  the layers register.
* activations: the per-layer formula (``18 + 4f/h`` under sequence parallelism and selective
  recomputation, ``10 + 24/t`` otherwise, for any FFN width, gating, K/V width, dropout and
  recomputation) against the per-op walk of ``formal._saved``; ``8 s b p`` bytes of input ids
  divided by tp under sequence parallelism (every tp rank holds all the token ids its embedding
  looks up: they are not split) and no targets; the input embeddings' dropout mask for a model
  trained without dropout; without sequence parallelism 2-byte logits and one ``s b h`` output
  tensor, and 5% added "for optimizer and miscellaneous temporaries".

Which is right: the cost model, for what a device holds. Biases, a learned position table and
the norms on every tp rank are registered parameters; the token ids are int64 tensors every tp
rank keeps whole; a model without dropout keeps no mask; the attention scores are saved unless
recomputed or fused away. Megatron's figure is a closed-form estimate that leaves them out (its
formula without sequence parallelism assumes fused or flash attention) and pads with 5%; the
terms say by how much, so that its printed line can be reproduced and read against ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from formal._axes import Axis
from formal._costs import Memory, in_flight_micro_batches, io_activations, layer_activations
from formal._engine_deepspeed import zero_stage
from formal._engine_effects import EnginePrediction
from formal._model import Ffn, Norm, Precision, Transformer
from formal._placement import Placement, Recompute
from formal._vocab import (
    ATTENTION,
    EMBEDDING,
    FINAL_NORM,
    LOGITS,
    MLP,
    NORM,
    OUTPUT_IO,
    POSITION,
    ROW_BIAS,
    Group,
    Stage,
)
from formal.errors import ModelError

# compute_activation_memory_without_sp: "buffer for optimizer and miscellaneous temporaries".
WITHOUT_SP_OVERHEAD = Fraction(21, 20)
INPUT_ID_BYTES = 8  # Megatron's ``8 * seq_length * micro_batch_size * pp``: int64 token ids


@dataclass(frozen=True)
class Convention:
    """One way Megatron's formula counts differently: Megatron's bytes minus ours."""

    key: str
    label: str
    bytes: Fraction


@dataclass(frozen=True)
class MegatronMemory:
    """The cost model's figures on the most loaded device and Megatron's conventions on them."""

    ours_weights_and_optimizer: Fraction
    ours_activations: Fraction
    weight_terms: tuple[Convention, ...]
    activation_terms: tuple[Convention, ...]
    sequence_parallel_formula: bool  # which of Megatron's activation functions applies

    @property
    def weights_and_optimizer(self) -> Fraction:
        return self.ours_weights_and_optimizer + sum((t.bytes for t in self.weight_terms), Fraction(0))

    @property
    def activations(self) -> Fraction:
        return self.ours_activations + sum((t.bytes for t in self.activation_terms), Fraction(0))


def _fraction(value: object) -> Fraction:
    import sympy as sp

    exact = sp.nsimplify(value)
    return Fraction(int(exact.p), int(exact.q))


def _group_bytes(placement: Memory) -> dict[Group, Fraction]:
    out: dict[Group, Fraction] = {}
    for state_memory in (placement.parameters, placement.gradients, placement.optimizer):
        for g, v in state_memory.by_group:
            out[g] = out.get(g, Fraction(0)) + _fraction(v)
    return out


def _degree(pl: Placement, test: str) -> int:
    return int(pl.degree_where(lambda kind: bool(getattr(kind, test))))


def megatron_memory(
    pl: Placement,
    model: Transformer,
    precision: Precision,
    placement: Memory,
    prediction: EnginePrediction,
    selective: bool | None = None,
) -> MegatronMemory:
    """Megatron's theoretical memory on the first pipeline stage from the cost model's
    ``placement`` memory of that stage and the engine ``prediction`` (its token-id terms).
    ``selective``: whether Megatron runs with ``--recompute-granularity selective`` (its
    sequence-parallel formula needs it); None: the placement's (``selective`` or ``flash``)."""
    if model.is_moe:
        raise ModelError(f"{model.name}: Megatron's conventions are modelled for dense models only")
    t = _degree(pl, "splits_matrices")
    p = int(pl.pipeline_degree) if pl.pipelined else 1
    by_group = _group_bytes(placement)
    sizes = model.group_elements()
    per_element = by_group[EMBEDDING] / Fraction(sizes[EMBEDDING], t)  # bytes a replicated weight costs

    # --- weights and optimizer ---------------------------------------------------------------
    hd = model.head_dim
    qkv_out = model.heads * hd + 2 * model.kv_heads_ * hd
    column_bias = {
        ATTENTION: (qkv_out if model.bias or model.qkv_bias else 0) * model.layers,
        MLP: ((2 if model.ffn_kind is Ffn.SWIGLU else 1) * model.ffn_ if model.bias else 0) * model.layers,
    }
    biases = by_group.get(ROW_BIAS, Fraction(0)) + sum(
        (by_group.get(g, Fraction(0)) * Fraction(n, sizes[g]) for g, n in column_bias.items() if n), Fraction(0)
    )
    norm_one = 2 * model.hidden if model.norm is Norm.LAYERNORM else model.hidden
    qk_norms = by_group.get(NORM, Fraction(0)) * Fraction(2 * hd if model.qk_norm else 0, 2 * norm_one + 2 * hd)
    layer_norms = by_group.get(NORM, Fraction(0)) - qk_norms
    final_norm = Fraction(sizes.get(FINAL_NORM, 0), p * t) * per_element - by_group.get(FINAL_NORM, Fraction(0))
    weight_terms: tuple[Convention, ...] = (
        Convention("linear_biases", "linear biases not counted", -biases),
        Convention("qk_norms", "query/key norms not counted", -qk_norms),
        Convention("position_table", "learned position table not counted", -by_group.get(POSITION, Fraction(0))),
        Convention("norms_split_by_tp", "norms divided by tp", -layer_norms * (1 - Fraction(1, t))),
        Convention("final_norm_spread", "final norm spread over the stages", final_norm),
    )
    ours_weights = sum(by_group.values(), Fraction(0))
    # 18 bytes a parameter (bf16 weights, fp32 gradients, fp32 master and Adam), 6 + 12/d with the
    # distributed optimizer, whatever the recipe: an fp16 run's 2-byte gradients (Megatron Core's
    # distributed-optimizer docs: 20 bytes, 4 + 16/d) are counted as fp32.
    d = int(pl.degree_where(lambda kind: kind.splits_data))
    megatron_k = 6 + Fraction(12, d) if zero_stage(pl) >= 1 else Fraction(18)
    counted = ours_weights + sum((c.bytes for c in weight_terms), Fraction(0))
    weight_terms += (
        Convention("bytes_per_parameter", f"{megatron_k} bytes a parameter", counted * (megatron_k / per_element - 1)),
    )

    # --- activations --------------------------------------------------------------------------
    if selective is None:
        selective = pl.options.recompute is Recompute.SELECTIVE
    # Megatron turns sequence parallelism off at tp 1; its formula then is the one without.
    sp_formula = _sequence_parallel(pl) is not None and selective
    s, b, h, v = model.seq, model.micro_batch, model.hidden, model.vocab
    sbh = s * b * h
    in_flight = _fraction(in_flight_micro_batches(pl, Stage.FIRST))
    layers_held = Fraction(model.layers, p) * in_flight  # layers' worth the first stage holds
    per_layer = model.activation_bytes_per_layer(precision.activations, precision.mask_bytes)
    ours_layer = _fraction(layer_activations(pl, per_layer, sbh, precision))
    if sp_formula:
        megatron_layer = sbh * (18 + Fraction(4 * model.ffn_, h)) / t
    else:
        megatron_layer = sbh * (10 + Fraction(24, t))
    token_terms = {term.key: Fraction(term.bytes) for term in prediction.terms if term.key.endswith("_ids")}
    input_ids = token_terms.get("input_ids", Fraction(0))
    ours_acts = _fraction(placement.activations or 0) + sum(token_terms.values(), Fraction(0))
    terms = [
        Convention("layer_formula", "Megatron's per-layer formula", (megatron_layer - ours_layer) * layers_held),
        Convention("target_ids", "loss targets not counted", -token_terms.get("target_ids", Fraction(0))),
    ]
    if not model.dropout:  # the input embeddings' 1-byte dropout mask, counted for every model
        mask = sbh * in_flight / (t if sp_formula else 1)
        terms.append(Convention("embedding_dropout", "embedding dropout mask without dropout", mask))
    # 8 s b bytes of ids for each micro-batch in flight, a fraction of one under the interleaved
    # schedule (Megatron's penalty), divided by tp under sequence parallelism.
    megatron_ids = INPUT_ID_BYTES * s * b * in_flight / (t if sp_formula else 1)
    if megatron_ids != input_ids:
        terms.append(Convention("input_ids", "input ids as Megatron counts them", megatron_ids - input_ids))
    if not sp_formula and p == 1:
        io = model.io_activation_bytes(precision.activations, precision.mask_bytes, precision.logits_bytes)
        ours_output = _fraction(io_activations(pl, {g: (n if g in (OUTPUT_IO, LOGITS) else 0) for g, n in io.items()}))
        megatron_output = 2 * (Fraction(s * b * v, t) + sbh)
        terms.append(Convention("output_layer", "2-byte logits, one s b h output", megatron_output - ours_output))
    if not sp_formula:
        before = ours_acts + sum((c.bytes for c in terms), Fraction(0))
        terms.append(Convention("overhead", "5% for temporaries", before * (WITHOUT_SP_OVERHEAD - 1)))
    return MegatronMemory(ours_weights, ours_acts, weight_terms, tuple(terms), sp_formula)


def _sequence_parallel(pl: Placement) -> Axis | None:
    return next((a for a in pl.axes if a.kind.sequence_parallel and pl.degree(a) != 1), None)


__all__ = ["Convention", "MegatronMemory", "megatron_memory"]
