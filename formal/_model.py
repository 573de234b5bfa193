"""Model and precision descriptions, and the exact size of every tensor group.

Sizes are exact integers for a concrete model; the same formulas take the model's sympy
symbols (``L h a s b V``, made on first use) for the symbolic proofs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from formal import _num as num
from formal._num import Num
from formal._saved import GPT, LayerShape, SavedTensor, by_group, layer_saved_tensors
from formal._vocab import (
    ATTENTION,
    EMBEDDING,
    EMBEDDING_IO,
    EXPERTS,
    FINAL_NORM,
    HEAD,
    LOGITS,
    MLP,
    NORM,
    OUTPUT_IO,
    POSITION,
    ROUTER,
    ROW_BIAS,
    WEIGHTS,
    Group,
    State,
)
from formal.errors import ModelError

# Symbols of the model (Megatron / Korthikanti notation): ``L h a s b V`` and ``PSI``, a bare
# parameter count (ZeRO notation), made when first asked for (``__getattr__``), so that a
# concrete check does not import sympy.
_SYMBOLS = {"L": "L", "h": "h", "a": "a", "s": "s", "b": "b", "V": "V", "PSI": "Psi"}


def __getattr__(name: str) -> Any:
    """The model's sympy symbols, on first use (PEP 562)."""
    if name in _SYMBOLS:
        import sympy as sp

        symbol = sp.Symbol(_SYMBOLS[name], positive=True, integer=True)
        globals()[name] = symbol
        return symbol
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_PARAMETERS = 10**15  # a quadrillion parameters: beyond this a count is a typo, not a model
MAX_SEQ = 100_000_000  # tokens per sequence: a hundred million is beyond any context window
MAX_MICRO_BATCH = 1_000_000  # sequences per micro-batch per replica


class Ffn(StrEnum):
    GELU = "gelu"  # two matrices h->f->h (GPT, Megatron)
    SWIGLU = "swiglu"  # three matrices (Llama, Mixtral)


class Norm(StrEnum):
    LAYERNORM = "layernorm"  # weight and bias: 2h
    RMSNORM = "rmsnorm"  # weight only: h


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer. ``micro_batch`` is per data-parallel replica (Megatron's b)."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int = 1
    kv_heads: int | None = None  # None: multi-head attention (kv_heads == heads)
    ffn: int | None = None  # None: 4 * hidden
    ffn_kind: Ffn = Ffn.GELU
    norm: Norm = Norm.LAYERNORM
    bias: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = True
    final_norm: bool = True
    experts: int = 0  # 0: dense; otherwise experts per MoE layer (every layer)
    top_k: int = 0
    source: str = ""
    # Rows of a learned position table (GPT-2/3's ``n_positions``); None: ``seq``. A table is
    # a parameter of its own size: training at another sequence length does not resize it.
    positions: int | None = None
    # Decoupled attention width (Hugging Face ``head_dim``, Megatron ``--kv-channels``): None is
    # hidden / heads. Only the parameter counts use it; activations keep Korthikanti's formulas.
    head_size: int | None = None
    qkv_bias: bool = False  # biases on the query, key and value projections only (Qwen2)
    qk_norm: bool = False  # an RMSNorm over head_dim on queries and keys in every layer (Qwen3)
    dropout: bool = True  # dropout on scores and residuals (GPT, Megatron); Llama trains without

    def __post_init__(self) -> None:
        for fname in ("layers", "hidden", "heads", "vocab", "seq", "micro_batch"):
            value = getattr(self, fname)
            if not isinstance(value, int) or value <= 0:
                raise ModelError(f"{fname}={value!r}: must be a positive integer")
        if self.seq > MAX_SEQ:
            raise ModelError(f"seq={self.seq}: absurd (at most {MAX_SEQ:,} tokens)")
        if self.micro_batch > MAX_MICRO_BATCH:
            raise ModelError(f"micro_batch={self.micro_batch}: absurd (at most {MAX_MICRO_BATCH:,} sequences)")
        if self.hidden % self.heads:
            raise ModelError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        kv = self.kv_heads_
        if kv <= 0 or self.heads % kv:
            raise ModelError(f"kv_heads={kv}: must divide heads={self.heads}")
        if self.head_size is not None and (not isinstance(self.head_size, int) or self.head_size <= 0):
            raise ModelError(f"head_size={self.head_size!r}: must be a positive integer")
        if not isinstance(self.dropout, bool):
            raise ModelError(f"dropout={self.dropout!r}: must be true or false")
        if self.experts < 0 or (self.experts and not 0 < self.top_k <= self.experts):
            raise ModelError(f"experts={self.experts}, top_k={self.top_k}: need 0 < top_k <= experts")
        if self.parameter_count() > MAX_PARAMETERS:
            count = self.parameter_count()
            shown = f"{count:.3e}" if count < 10**300 else "over 1e300"  # float() of a larger int overflows
            raise ModelError(f"{self.name}: {shown} parameters is absurd (at most {MAX_PARAMETERS:.0e})")

    @property
    def kv_heads_(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads if self.head_size is None else self.head_size

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (``positions``, else the sequence length)."""
        return self.seq if self.positions is None else self.positions

    def group_elements(self) -> dict[Group, int]:
        """Parameter elements of every group, summed over all layers (exact integers)."""
        hid, f, hd = self.hidden, self.ffn_, self.head_dim
        qkv_out = self.heads * hd + 2 * self.kv_heads_ * hd
        attention = hid * qkv_out + self.heads * hd * hid + (qkv_out if self.bias or self.qkv_bias else 0)
        if self.ffn_kind is Ffn.GELU:
            mlp_one = 2 * hid * f + (f if self.bias else 0)
        else:
            mlp_one = 3 * hid * f + (2 * f if self.bias else 0)
        norm_one = 2 * hid if self.norm is Norm.LAYERNORM else hid
        out: dict[Group, int] = {
            ATTENTION: self.layers * attention,
            ROW_BIAS: self.layers * (2 * hid if self.bias else 0),
            NORM: self.layers * (2 * norm_one + (2 * hd if self.qk_norm else 0)),
            FINAL_NORM: norm_one if self.final_norm else 0,
            EMBEDDING: self.vocab * hid,
            POSITION: self.position_rows * hid if self.learned_positions else 0,
            HEAD: 0 if self.tied_embeddings else self.vocab * hid,
        }
        if self.is_moe:
            out[EXPERTS] = self.layers * self.experts * mlp_one
            out[ROUTER] = self.layers * hid * self.experts
        else:
            out[MLP] = self.layers * mlp_one
        return {g: n for g, n in out.items() if n}

    def parameter_count(self) -> int:
        return sum(self.group_elements().values())

    def activation_bytes_per_layer(self, element_bytes: int = 2, mask_bytes: int = 1) -> dict[Group, Num]:
        """Activation bytes of one layer for one micro-batch, by group, before any parallelism:
        the tensors its ops save (``formal._saved.layer_saved_tensors``) for this model's FFN
        width and kind, K/V heads and dropout. For GPT (``f = 4h``, dropout,
        multi-head) Korthikanti et al. 2022, section 4.1: ``10sbh``
        (replicated by TP), ``24sbh`` and ``5as^2b`` (split by TP) at 2-byte activations and
        1-byte masks; ``b`` here is the micro-batch of one replica. A mask stays 1 byte when
        activations widen to fp32, unless the engine keeps it as a float tensor."""
        return by_group(self.saved_tensors(element_bytes, mask_bytes))

    def saved_tensors(self, element_bytes: int = 2, mask_bytes: int = 1) -> tuple[SavedTensor, ...]:
        """The tensors one layer keeps for one micro-batch, op by op (``formal._saved``)."""
        return layer_saved_tensors(
            self.seq,
            self.micro_batch,
            self.hidden,
            self.heads,
            element_bytes,
            mask_bytes,
            self.layer_shape,
        )

    @property
    def largest_module(self) -> int:
        """The most parameters one module holds itself (DeepSpeed's ``largest_layer_params``,
        ``model.parameters(recurse=False)`` over ``model.modules()``): the word embedding, the
        output head, one projection (weight and bias; Hugging Face's separate gate and up
        projections of a gated MLP, a fused QKV of ``(a + 2k) d`` outputs) or one norm. A
        mixture of experts is counted as one expert's projection (its experts are modules)."""
        hid, f, hd = self.hidden, self.ffn_, self.head_dim
        qkv_out = self.heads * hd + 2 * self.kv_heads_ * hd
        bias = self.bias or self.qkv_bias
        candidates = [
            self.vocab * hid,
            hid * qkv_out + (qkv_out if bias else 0),
            self.heads * hd * hid + (hid if self.bias else 0),
            hid * f + (f if self.bias else 0),
            f * hid + (hid if self.bias else 0),
            2 * hid if self.norm is Norm.LAYERNORM else hid,
        ]
        if self.learned_positions:
            candidates.append(self.position_rows * hid)
        if self.is_moe:
            candidates.append(hid * self.experts)
        return max(candidates)

    @property
    def layer_shape(self) -> LayerShape:
        return LayerShape(
            ffn=self.ffn_,
            kv_heads=self.kv_heads_,
            gated=self.ffn_kind is Ffn.SWIGLU,
            dropout=self.dropout,
        )

    def io_activation_bytes(
        self, element_bytes: int = 2, mask_bytes: int = 1, logits_bytes: int = 4
    ) -> dict[Group, Num]:
        """Activation bytes of the input and output layers for one micro-batch, before any
        parallelism: ``io_activation_bytes`` for this model's sizes."""
        return io_activation_bytes(
            self.seq,
            self.micro_batch,
            self.hidden,
            self.vocab,
            element_bytes,
            mask_bytes,
            logits_bytes,
            dropout=self.dropout,
        )

    def with_micro_batch(self, micro_batch: int) -> Transformer:
        return replace(self, micro_batch=micro_batch)


def layer_activation_bytes(
    seq: Num,
    micro_batch: Num,
    hidden: Num,
    heads: Num,
    element_bytes: int = 2,
    mask_bytes: int = 1,
    shape: LayerShape = GPT,
) -> dict[Group, Num]:
    """``Transformer.activation_bytes_per_layer`` for any sizes, symbols included (the proofs
    derive Korthikanti's expressions with ``s, b, h, a`` symbolic); GPT's layer by default."""
    return by_group(layer_saved_tensors(seq, micro_batch, hidden, heads, element_bytes, mask_bytes, shape))


def io_activation_bytes(
    seq: Num,
    micro_batch: Num,
    hidden: Num,
    vocab: Num,
    element_bytes: int = 2,
    mask_bytes: int = 1,
    logits_bytes: int = 4,
    *,
    dropout: bool = True,
) -> dict[Group, Num]:
    """The input and output layers' activations (Korthikanti et al. 2022, section 4.3).

    Input: the dropout on the input embeddings keeps a mask, ``sbh`` 1-byte elements
    (position and word embeddings themselves keep nothing large). Output: the final LayerNorm
    and the output projection each keep their input, ``2sbh`` bytes each at 16 bits, and the
    cross-entropy keeps the logits in 32-bit floats, ``4sbv`` bytes. With sequence and tensor
    parallelism and one micro-batch in flight the paper sums them as
    ``sbh/t + 4sbh/t (1 + v/h)``; the placement decides the split here. Without dropout
    (Llama) the input embeddings keep no mask.
    """
    sbh = seq * micro_batch * hidden
    return {
        EMBEDDING_IO: mask_bytes * sbh if dropout else 0,
        OUTPUT_IO: 2 * element_bytes * sbh,
        LOGITS: logits_bytes * seq * micro_batch * vocab,
    }


@dataclass(frozen=True)
class ParameterCount:
    """A model given only by its parameter count: activations are unknown, not zero."""

    parameters: int
    name: str = ""
    micro_batch: int = 1
    # The most parameters one gather unit holds (DeepSpeed's ``largest_layer_params``: the
    # largest count one module holds itself, ``model.parameters(recurse=False)``, found by
    # ``estimate_zero3_model_states_mem_needs_all_live``). None: unknown, and so are the buffers
    # of a mode that gathers or reduces one unit at a time (ZeRO-3's gather, ZeRO-2's bucket).
    largest_layer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.parameters, int) or self.parameters <= 0:
            raise ModelError(f"--params {self.parameters!r}: must be a positive integer")
        if self.parameters > MAX_PARAMETERS:
            shown = f"{self.parameters:.3e}" if self.parameters < 10**300 else "over 1e300"
            raise ModelError(f"--params {shown}: absurd (over {MAX_PARAMETERS:.0e})")
        if not isinstance(self.micro_batch, int) or not 0 < self.micro_batch <= MAX_MICRO_BATCH:
            raise ModelError(f"micro_batch={self.micro_batch!r}: must be from 1 to {MAX_MICRO_BATCH:,}")
        big = self.largest_layer
        if big is not None and (not isinstance(big, int) or isinstance(big, bool) or not 0 < big <= self.parameters):
            raise ModelError(
                f"--largest-layer {big!r}: must be a whole count from 1 to the model's {self.parameters:,} parameters"
            )

    @property
    def is_moe(self) -> bool:
        return False

    @property
    def tied_embeddings(self) -> bool:
        return False

    def group_elements(self) -> dict[Group, int]:
        return {WEIGHTS: self.parameters}

    def parameter_count(self) -> int:
        return self.parameters

    def with_micro_batch(self, micro_batch: int) -> ParameterCount:
        return replace(self, micro_batch=micro_batch)


Model = Transformer | ParameterCount


def megatron_parameter_count(layers: int, hidden: int, vocab: int, seq: int) -> Num:
    """Narayanan et al. 2021 (PTD-P), section 5.1: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh))."""
    l_, h_ = layers, hidden
    return num.canonical(12 * l_ * h_**2 * (1 + num.ratio(13, 12 * h_) + num.ratio(vocab + seq, 12 * l_ * h_)))


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each state (a recipe is data, not code).

    ``gradients`` counts every gradient copy a recipe keeps (DeepSpeed keeps fp16 and fp32).
    """

    name: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int = 2  # 16-bit activations (Korthikanti's formulas assume this)
    gradient_wire: int = 2  # bytes per gradient element sent by reductions
    mask_bytes: int = 1  # bytes per dropout-mask element (Korthikanti: 1-byte masks)
    logits_bytes: int = 4  # bytes per logit the loss keeps (Korthikanti 4.3: fp32 cross-entropy)
    source: str = ""
    description: str = ""
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def wire_bytes_of(self, state: State) -> int:
        """Bytes per element a collective moves for a state (gradients may travel narrower)."""
        return self.gradient_wire if state is State.GRADIENTS else self.bytes_of(state)

    def op_wire_bytes(self, state: State, group: Group) -> int:
        """Bytes per element a collective on ``group``'s ``state`` moves: ``wire_bytes_of``, but
        an exchange of the logits carries the loss's statistics in the logits' type (fp32 in
        Megatron-LM's ``vocab_parallel_cross_entropy`` and torch's ``loss_parallel``)."""
        if state is State.ACTIVATIONS and group is LOGITS:
            return self.logits_bytes
        return self.wire_bytes_of(state)

    def bytes_of(self, state: State) -> int:
        match state:
            case State.PARAMETERS:
                return self.parameters
            case State.GRADIENTS:
                return self.gradients
            case State.OPTIMIZER:
                return self.optimizer
            case State.ACTIVATIONS:
                return self.activations
            case _:
                raise AssertionError(state)

    @property
    def model_state_bytes(self) -> int:
        return self.parameters + self.gradients + self.optimizer


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(
            "zero",
            2,
            2,
            12,
            source="Rajbhandari et al., ZeRO (SC'20), section 3.1: K=12",
            description="mixed fp16/fp32 Adam: fp16 params and grads, fp32 master+m+v",
        ),
        # DeepSpeed ZeRO-3 keeps fp16 parameters, one fp32 gradient partition
        # (grad_partitions_flat_buffer, gradient_accumulation_dtype) and fp32 master+Adam:
        # 18 bytes, sharded; the fp16 gradients exist only in reduction buckets and travel in
        # fp16. Source: deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs
        # (gpu_mem = 4 * largest_layer_params + 18 * total_params / total_gpus).
        Precision(
            "deepspeed",
            2,
            4,
            12,
            gradient_wire=2,
            source="DeepSpeed stage3.py estimate_zero3_model_states_mem_needs: 18 bytes = 2 + 4 + 12",
            description="fp16 params, fp32 gradient partition (fp16 on the wire), fp32 master+Adam",
        ),
        Precision(
            "megatron",
            2,
            4,
            12,
            gradient_wire=4,
            source="Megatron Core docs, Distributed Optimizer: bf16 params, fp32 grads: 18, 6 + 12/d",
            description="bf16 params, fp32 main grads, fp32 master+Adam",
        ),
        # The fp32 main gradient lives with the optimizer's partition (4 + 12 = 16 sharded bytes).
        Precision(
            "megatron-fp16",
            2,
            2,
            16,
            source="Megatron Core docs, Distributed Optimizer: fp16 params, fp16 grads: 20, 4 + 16/d",
            description="fp16 params and grads; fp32 main grads, master and Adam with the optimizer",
        ),
        Precision("fp32", 4, 4, 8, gradient_wire=4, description="pure fp32 Adam: params, grads, m, v"),
        Precision(
            "fp32-adam",
            4,
            4,
            8,
            activations=4,
            gradient_wire=4,
            source="torch.optim.Adam on fp32 parameters: exp_avg and exp_avg_sq, 4 bytes each",
            description="pure fp32 Adam with fp32 activations (the PyTorch validation runs)",
        ),
        Precision("sgd-momentum", 4, 4, 4, gradient_wire=4, description="fp32 SGD with momentum"),
        Precision(
            "fp32-sgd", 4, 4, 0, activations=4, gradient_wire=4, description="fp32 plain SGD (no optimizer state)"
        ),
    )
}
DEFAULT_PRECISION = PRECISIONS["zero"]
