"""The Megatron-LM arguments importer (``megatron/training/arguments.py``): world = tp x pp x cp x
dp, experts carved out of dp (ep | dp); the distributed optimizer, interleaved stages and
recomputation; a launch line's or script's words and its launcher's world size.

``checker._importers`` is the entry (``load_config``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction

from checker._import_common import ConfigError, Framework, Imported, Unmapped, _divide, imported
from checker._import_scalars import megatron_scalars
from checker._import_shell import arguments, script_command
from checker._layout import DataSharding, Layout
from checker._numbers import MAX_BATCH, MAX_DEGREE, MAX_MICRO_BATCH, MAX_SEQ, parse_int
from formal._model import Ffn, Model, Norm, Transformer
from formal._placement import Options, Recompute, Schedule
from formal._presets import DEFAULT_DEVICES, DEFAULT_MODEL, PRESETS
from formal.errors import InputError

# --- Megatron-LM ----------------------------------------------------------------------------

_MEG_VALUE = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--num-layers-per-virtual-pipeline-stage",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--micro-batch-size",
    "--global-batch-size",
    "--seq-length",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--expert-tensor-parallel-size",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--ffn-hidden-size",
    "--num-query-groups",
    "--normalization",
    "--position-embedding-type",
    "--num-experts",
    "--moe-router-topk",
    "--moe-ffn-hidden-size",
    "--kv-channels",
    "--make-vocab-size-divisible-by",
    "--vocab-size",
    "--tokenizer-type",
    "--max-position-embeddings",
    "--clip-grad",
    "--loss-scale",
    "--moe-aux-loss-coeff",
    "--moe-router-load-balancing-type",
)
# Bounds of the Megatron arguments read as numbers that are not degrees (MAX_DEGREE otherwise).
_MEG_BOUNDS = {
    "--micro-batch-size": MAX_MICRO_BATCH,
    "--global-batch-size": MAX_BATCH,
    "--seq-length": MAX_SEQ,
    "--hidden-size": 2**40,
}
_MEG_FLAGS = (
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--recompute-activations",
    "--fp16",
    "--bf16",
    "--group-query-attention",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--use-rotary-position-embeddings",
    "--no-position-embedding",
    "--calculate-per-token-loss",
    "--add-qkv-bias",
    "--qk-layernorm",
)
# Arguments that take several values (``nargs``): how many.
_MEG_MULTI = {"--rampup-batch-size": 3}
# Arguments without effect on placements (hyper-parameters, data, I/O, kernels, overlap): accepted.
_MEG_IGNORED = (
    "--rotary-base",
    "--rotary-percent",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type",
    "--lr",
    "--min-lr",
    "--lr-decay-style",
    "--lr-decay-iters",
    "--lr-warmup-iters",
    "--lr-warmup-fraction",
    "--train-iters",
    "--train-samples",
    "--weight-decay",
    "--adam-beta1",
    "--adam-beta2",
    "--adam-eps",
    "--init-method-std",
    "--attention-dropout",
    "--hidden-dropout",
    "--data-path",
    "--vocab-file",
    "--merge-file",
    "--tokenizer-model",
    "--split",
    "--save",
    "--load",
    "--save-interval",
    "--eval-interval",
    "--eval-iters",
    "--log-interval",
    "--tensorboard-dir",
    "--distributed-backend",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--use-flash-attn",
    "--use-mcore-models",
    "--transformer-impl",
    "--attention-softmax-in-fp32",
    "--accumulate-allreduce-grads-in-fp32",
    "--no-masked-softmax-fusion",
    "--seed",
    "--log-throughput",
    "--wandb-project",
    "--wandb-exp-name",
    "--exit-duration-in-mins",
    "--ckpt-format",
    "--data-cache-path",
    "--no-gradient-accumulation-fusion",
    "--tp-comm-overlap",
    "--num-workers",
    "--dataloader-type",
    "--mock-data",
    "--log-params-norm",
    "--log-num-zeros-in-grad",
    "--timing-log-level",
    "--use-checkpoint-args",
    "--no-load-optim",
    "--no-load-rng",
    "--finetune",
    "--manual-gc",
    "--manual-gc-interval",
    "--no-async-tensor-model-parallel-allreduce",
    "--optimizer",
    "--initial-loss-scale",
    "--min-loss-scale",
    "--loss-scale-window",
    "--hysteresis",
    "--apply-layernorm-1p",
    "--norm-epsilon",
    "--bf16-reduce",
    "--log-timers-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--use-distributed-sampler",
    "--sequence-parallel-comm-overlap",
    "--defer-embedding-wgrad-compute",
    "--cross-entropy-loss-fusion",
    "--use-dist-ckpt",
    "--async-save",
    "--attention-backend",
)
_MEG_VALUED_IGNORED = frozenset(
    a
    for a in _MEG_IGNORED
    if a
    not in {
        "--group-query-attention",
        "--swiglu",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--use-rotary-position-embeddings",
        "--no-position-embedding",
        "--moe-grouped-gemm",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--use-flash-attn",
        "--use-mcore-models",
        "--attention-softmax-in-fp32",
        "--accumulate-allreduce-grads-in-fp32",
        "--no-masked-softmax-fusion",
        "--log-throughput",
        "--no-gradient-accumulation-fusion",
        "--tp-comm-overlap",
        "--mock-data",
        "--log-params-norm",
        "--log-num-zeros-in-grad",
        "--use-checkpoint-args",
        "--no-load-optim",
        "--no-load-rng",
        "--finetune",
        "--manual-gc",
        "--no-async-tensor-model-parallel-allreduce",
        "--apply-layernorm-1p",
        "--log-timers-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--log-memory-to-tensorboard",
        "--use-distributed-sampler",
        "--sequence-parallel-comm-overlap",
        "--defer-embedding-wgrad-compute",
        "--cross-entropy-loss-fusion",
        "--use-dist-ckpt",
        "--async-save",
    }
)
_MEG_REFUSED = {
    "--use-torch-fsdp2": "Megatron with torch FSDP2: check fsdp<N> directly",
    "--use-custom-fsdp": "Megatron-FSDP: check zero2/zero3 compositions directly",
    "--optimizer-cpu-offload": "Megatron's hybrid CPU optimizer offload is not mapped",
    "--virtual-pipeline-model-parallel-size": "write --num-layers-per-virtual-pipeline-stage instead",
}


def megatron_tokens(text: str, where: str = "megatron arguments") -> list[str]:
    """Arguments of a launch line or script (its variables and arrays expanded,
    ``checker._import_shell``): the words after ``*.py``, or from the first ``--``."""
    return arguments(script_command(text, where)[1], where)


def launcher_world_size(text: str, where: str = "megatron launcher") -> int | None:
    """``torchrun --nproc_per_node N --nnodes M ... pretrain_gpt.py``: N x M, when both are numbers."""
    fields = script_command(text, where)[0]
    words = [w if why is None else "" for w, why in fields]  # a substitution not run: not stated
    end = len(words)
    found: dict[str, int] = {}
    for i, w in enumerate(words[:end]):
        name, eq, inline = w.partition("=")
        key = name.replace("-", "_")
        if key in ("__nproc_per_node", "__nnodes"):
            value = inline if eq else (words[i + 1] if i + 1 < end else "")
            if value.isascii() and value.isdigit():  # a shell variable or "gpu" is not a count: not stated
                found[key] = parse_int(value, f"megatron launcher: {name}", high=MAX_DEGREE)
    if "__nproc_per_node" in found:
        world = found["__nproc_per_node"] * found.get("__nnodes", 1)
        if world > MAX_DEGREE:
            raise ConfigError(
                f"megatron launcher: nproc_per_node x nnodes = {world:,} devices is absurd (at most {MAX_DEGREE:,})"
            )
        return world
    return None


def import_megatron(
    args: list[str],
    *,
    devices: int | None,
    model: Model | None = None,
    where: str = "megatron arguments",
    launcher: int | None = None,
) -> Imported:
    """Megatron-LM arguments. World = tp x pp x cp x dp; experts are carved out of dp (ep | dp).

    ``launcher``: the processes the script's launcher starts (nproc_per_node x nnodes); an
    explicit ``devices`` that differs wins, and the difference is noted."""
    values: dict[str, str] = {}
    multi: dict[str, list[str]] = {}
    flags: set[str] = set()
    notes: list[Unmapped] = []
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, inline = word.partition("=")
        if not name.startswith("--"):
            raise ConfigError(f"{where}: unexpected word {word!r} (expected --argument)")
        if name in _MEG_REFUSED:
            raise ConfigError(f"{where}: {name}: {_MEG_REFUSED[name]}")
        if name in _MEG_MULTI:
            count = _MEG_MULTI[name]
            given = args[i + 1 : i + 1 + count]
            if eq or len(given) < count or any(g.startswith("--") for g in given):
                raise ConfigError(f"{where}: {name} needs {count} values")
            multi[name] = given
            i += 1 + count
            continue
        takes_value = name in _MEG_VALUE or name in _MEG_VALUED_IGNORED
        if name not in _MEG_VALUE + _MEG_FLAGS + _MEG_IGNORED:
            near = difflib.get_close_matches(name, _MEG_VALUE + _MEG_FLAGS + _MEG_IGNORED, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"{where}: unknown argument {name}{hint}")
        if takes_value:
            if eq:
                value = inline
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            else:
                raise ConfigError(f"{where}: {name} needs a value")
            if name in values and values[name] != value:
                raise ConfigError(f"{where}: {name} given twice ({values[name]} and {value})")
            values[name] = value
        else:
            flags.add(name)
        i += 1

    def num(name: str, default: int) -> int:
        if name not in values:
            return default
        text = values[name]
        high = _MEG_BOUNDS.get(name, MAX_DEGREE)
        try:
            return parse_int(text, f"{where}: {name}", high=high)
        except InputError as err:
            hint = " (expand shell variables first)" if "$" in text else ""
            raise ConfigError(f"{err}{hint}") from None

    tp, pp = num("--tensor-model-parallel-size", 1), num("--pipeline-model-parallel-size", 1)
    cp, ep = num("--context-parallel-size", 1), num("--expert-model-parallel-size", 1)
    etp = num("--expert-tensor-parallel-size", tp)
    if etp != tp:
        raise ConfigError(
            f"{where}: --expert-tensor-parallel-size {etp} != --tensor-model-parallel-size {tp} is not mapped"
        )
    if "--sequence-parallel" in flags and tp == 1:
        raise ConfigError(f"{where}: --sequence-parallel needs --tensor-model-parallel-size > 1")
    _meg_check_model(values, model, where, num)
    if devices is not None and launcher is not None and devices != launcher:
        notes.append(
            Unmapped("launcher", f"starts nproc_per_node x nnodes = {launcher} processes; --devices {devices} is used")
        )
    elif devices is None:
        devices = launcher
    total = devices if devices is not None else DEFAULT_DEVICES
    if devices is None:
        notes.append(Unmapped("world size", f"not in the arguments: {DEFAULT_DEVICES} devices (give --devices)"))
    what = "--devices" if devices is None or devices != launcher else "the launcher's nproc_per_node x nnodes"
    dp_meg = _divide(total, {"tp": tp, "pp": pp, "cp": cp}, where, what)
    if "--rampup-batch-size" in multi:
        start, step, samples = multi["--rampup-batch-size"]
        notes.append(
            Unmapped(
                f"--rampup-batch-size {start} {step} {samples}",
                "the global batch grows during the first samples; counted at --global-batch-size (the largest)",
            )
        )
    if dp_meg % ep:
        raise ConfigError(
            f"{where}: --expert-model-parallel-size {ep} must divide the data-parallel size "
            f"{dp_meg} (= {total} / (tp({tp}) x pp({pp}) x cp({cp})))"
        )
    micro = num("--micro-batch-size", 1)
    m = 1
    if "--global-batch-size" in values:
        m = _divide(
            num("--global-batch-size", 1), {"micro-batch-size": micro, "dp": dp_meg}, where, "--global-batch-size"
        )
    schedule, chunks = Schedule.ONE_F_ONE_B, 1
    if "--num-layers-per-virtual-pipeline-stage" in values:
        per = num("--num-layers-per-virtual-pipeline-stage", 1)
        layers = _meg_layers(values, model, where)
        if pp == 1 or layers % (pp * per) or layers // (pp * per) < 2:
            raise ConfigError(
                f"{where}: --num-layers-per-virtual-pipeline-stage {per} with {layers} layers on "
                f"--pipeline-model-parallel-size {pp}: need layers = pp x per-stage x chunks, "
                "chunks >= 2"
            )
        schedule, chunks = Schedule.INTERLEAVED, layers // (pp * per)
    recompute = _meg_recompute(values, flags, pp, model, where, notes, num)
    uneven = _meg_uneven(values, pp, chunks, model, where, num)
    options = Options(
        sequence_parallel="--sequence-parallel" in flags,
        recompute=recompute,
        schedule=schedule,
        chunks=chunks,
        micro_batches=m,
        uneven_stages=uneven,
        scalars=megatron_scalars(values, flags, where, notes),
    )
    distopt = "--use-distributed-optimizer" in flags
    if distopt and ep > 1:
        notes.append(
            Unmapped(
                "--use-distributed-optimizer",
                f"with experts, Megatron shards dense optimizer state over the whole data-parallel group "
                f"({dp_meg}); the composition shards it over dp ({dp_meg // ep}) and replicates it along "
                "ep (an upper bound)",
            )
        )
    layout = Layout(
        "distopt" if distopt else "dp",
        DataSharding.OPTIMIZER if distopt else DataSharding.NONE,
        dp_meg // ep,
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        options=options,
    )
    seq = num("--seq-length", 0) or None
    preset, own = (None, None) if model is not None else _meg_model(values, flags, tp, where, notes, num)
    # Megatron Core's distributed optimizer table: bf16 params with fp32 main gradients (18 bytes),
    # fp16 params and gradients (20); neither flag trains in fp32.
    precision = "megatron-fp16" if "--fp16" in flags else "megatron" if "--bf16" in flags else "fp32"
    if {"--fp16", "--bf16"} <= flags:
        raise ConfigError(f"{where}: --fp16 and --bf16 are both given")
    # Whether the run keeps dropout masks. A model the arguments do not describe (--model, or the
    # default) keeps its own setting unless a rate is stated; one they describe takes the defaults.
    dropout = _meg_dropout(values, where, notes)
    stated = any(name in values for name in _MEG_DROPOUT)
    base = own or (PRESETS[preset] if preset else model if stated else None)
    if model is None and preset is None and own is None and stated:
        base = PRESETS[DEFAULT_MODEL]
    if isinstance(base, Transformer) and base.dropout != dropout:
        own = replace(base, dropout=dropout)  # a preset keeps its name (``model``), trained as the arguments say
    out = imported(Framework.MEGATRON, layout, total, micro, seq, precision, preset, notes)
    return out if own is None else replace(out, transformer=own)


# Megatron-LM's defaults (``megatron/training/arguments.py``): --attention-dropout 0.1 on the
# softmax output, --hidden-dropout 0.1 on the residual branches.
_MEG_DROPOUT = ("--attention-dropout", "--hidden-dropout")


def _meg_dropout(values: dict[str, str], where: str, notes: list[Unmapped]) -> bool:
    """Whether the run applies dropout, and so keeps its masks for the backward (Korthikanti et al.
    2022, section 4.1): False only when both rates are zero. The model has one dropout setting for
    the scores and the residuals: with one rate zero and the other not, the masks of both are
    counted (an upper bound, noted)."""
    rates: dict[str, Fraction] = {}
    for name in _MEG_DROPOUT:
        text = values.get(name, "0.1")
        try:
            rate = Fraction(text.strip())
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"{where}: {name} {text}: not a number") from None
        if not 0 <= rate < 1:
            raise ConfigError(f"{where}: {name} {text}: a dropout rate is from 0 to below 1")
        rates[name] = rate
    zero = [name for name, rate in rates.items() if rate == 0]
    if len(zero) == 1:
        notes.append(
            Unmapped(
                f"{zero[0]} 0",
                "the model has one dropout setting: the masks of both attention and hidden dropout are counted",
            )
        )
    return len(zero) < len(rates)


_MEG_SIZE = ("--num-layers", "--hidden-size", "--num-attention-heads")
# Vocabularies of the tokenizers Megatron-LM names (``megatron/training/tokenizer``): GPT-2's
# byte-level BPE has 50,257 tokens (Radford et al. 2019; gpt2 encoder.json), Llama 2's
# SentencePiece model 32,000 (Touvron et al. 2023).
_MEG_TOKENIZERS = {"GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000}


def _meg_vocab(values: dict[str, str], tp: int, num: Callable[[str, int], int]) -> int | None:
    """The padded vocabulary: Megatron-LM's ``_vocab_size_with_padding`` rounds the tokenizer's
    size up to a multiple of ``--make-vocab-size-divisible-by`` (128) x tp. None: not stated."""
    kind = values.get("--tokenizer-type")
    if "--vocab-size" in values:  # the NullTokenizer adds an end-of-document token
        size = num("--vocab-size", 1) + (1 if kind == "NullTokenizer" else 0)
    elif kind in _MEG_TOKENIZERS:
        size = _MEG_TOKENIZERS[kind]
    elif kind is None and "--merge-file" in values:  # a BPE vocabulary and merges: GPT-2's
        size = _MEG_TOKENIZERS["GPT2BPETokenizer"]
    else:
        return None
    multiple = num("--make-vocab-size-divisible-by", 128) * tp
    return -(-size // multiple) * multiple


def _meg_model(
    values: dict[str, str],
    flags: set[str],
    tp: int,
    where: str,
    notes: list[Unmapped],
    num: Callable[[str, int], int],
) -> tuple[str | None, Transformer | None]:
    """The model the arguments describe (``megatron/training/arguments.py`` defaults): a preset's
    name when one has exactly these dimensions, else the ``Transformer`` itself. Without any size
    argument the default model applies (noted); with some but not all, the import is refused."""
    given = [a for a in _MEG_SIZE if a in values]
    if not given:
        notes.append(
            Unmapped("model", f"no {', '.join(_MEG_SIZE)}: the default model {DEFAULT_MODEL} is used (give --model)")
        )
        return None, None
    missing = [a for a in (*_MEG_SIZE, "--seq-length") if a not in values]
    if missing:
        raise ConfigError(
            f"{where}: {' '.join(given)} without {' '.join(missing)}: the model's size is not stated (or give --model)"
        )
    layers, hidden, heads = num("--num-layers", 1), num("--hidden-size", 1), num("--num-attention-heads", 1)
    swiglu = "--swiglu" in flags
    # Megatron-LM: ffn_hidden_size = 4h, or int(4h x 2/3 / 64) x 64 with --swiglu.
    ffn = num("--ffn-hidden-size", (8 * hidden // 3) // 64 * 64 if swiglu else 4 * hidden)
    norm = values.get("--normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise ConfigError(f"{where}: --normalization {norm}: expected LayerNorm or RMSNorm")
    position = values.get("--position-embedding-type", "learned_absolute")
    if position not in ("learned_absolute", "rope", "none", "yarn", "mrope"):
        raise ConfigError(f"{where}: --position-embedding-type {position}: not a Megatron-LM type")
    learned = (
        position == "learned_absolute" and not {"--use-rotary-position-embeddings", "--no-position-embedding"} & flags
    )
    seq = num("--seq-length", 1)
    if learned and num("--max-position-embeddings", seq) != seq:
        notes.append(
            Unmapped(
                f"--max-position-embeddings {values['--max-position-embeddings']}",
                f"the learned position table is counted with --seq-length {seq} rows",
            )
        )
    experts = num("--num-experts", 0) if "--num-experts" in values else 0
    kv_channels = num("--kv-channels", hidden // heads) if "--kv-channels" in values else None
    try:
        built = Transformer(
            f"megatron {layers}x{hidden}",
            layers=layers,
            hidden=hidden,
            heads=heads,
            vocab=1,
            seq=seq,
            kv_heads=num("--num-query-groups", heads) if "--group-query-attention" in flags else None,
            ffn=num("--moe-ffn-hidden-size", ffn) if experts else ffn,
            ffn_kind=Ffn.SWIGLU if swiglu else Ffn.GELU,
            norm=Norm.RMSNORM if norm == "RMSNorm" else Norm.LAYERNORM,
            bias="--disable-bias-linear" not in flags,
            qkv_bias="--add-qkv-bias" in flags,  # biases on Q, K and V only (Qwen2)
            qk_norm="--qk-layernorm" in flags,  # a norm over head_dim on queries and keys (Qwen3)
            learned_positions=learned,
            tied_embeddings="--untie-embeddings-and-output-weights" not in flags,
            experts=experts,
            top_k=num("--moe-router-topk", 2) if experts else 0,
            head_size=kv_channels if kv_channels is not None and kv_channels * heads != hidden else None,
            source=f"Megatron-LM arguments of {where}",
        )
    except InputError as err:
        raise ConfigError(f"{where}: {err}") from None
    vocab = _meg_vocab(values, tp, num)
    same = [  # presets of these dimensions (their own sequence length aside: --seq-length applies)
        name
        for name, p in PRESETS.items()
        if isinstance(p, Transformer)
        and _canonical(replace(p, seq=seq)) == _canonical(replace(built, vocab=vocab or p.vocab))
    ]
    if vocab is None:
        if len(same) != 1:
            raise ConfigError(
                f"{where}: the vocabulary size is not stated (--tokenizer-type "
                f"{values.get('--tokenizer-type', 'not given')}): add --vocab-size or give --model"
            )
        notes.append(
            Unmapped(
                "vocabulary",
                f"not stated by the tokenizer arguments: {same[0]}'s {_vocab_of(same[0]):,} tokens are taken",
            )
        )
        return same[0], None
    if len(same) == 1:
        return same[0], None
    return None, replace(built, vocab=vocab)


def _canonical(t: Transformer) -> Transformer:
    """``t`` with its defaults spelled out, no name, and dropout (set by the rates, not the
    dimensions) left out: equal for equal models."""
    return replace(t, name="", source="", ffn=t.ffn_, kv_heads=t.kv_heads_, head_size=t.head_dim, dropout=True)


def _vocab_of(preset: str) -> int:
    p = PRESETS[preset]
    assert isinstance(p, Transformer)
    return p.vocab


_MEG_FIRST, _MEG_LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"


def _meg_uneven(
    values: dict[str, str], pp: int, chunks: int, model: Model | None, where: str, num: Callable[[str, int], int]
) -> bool:
    """Megatron-LM's uneven pipeline split (``--decoder-first-pipeline-num-layers`` F and
    ``--decoder-last-pipeline-num-layers`` K, ``megatron/core/transformer/transformer_block.py``):
    the first stage holds F layers, the last K, the stages between them (L - F - K) / (pp - 2)
    each. The composition's ``uneven`` stages put at most ceil(L / pp) on the fullest stage, so a
    split is read as ``uneven`` when its fullest stage holds exactly that; any other is refused
    (no composition charges it)."""
    given = [a for a in (_MEG_FIRST, _MEG_LAST) if a in values]
    if not given:
        return False
    shown = " ".join(f"{a} {values[a]}" for a in given)
    if pp == 1:
        raise ConfigError(f"{where}: {shown} needs --pipeline-model-parallel-size > 1")
    if chunks > 1:
        raise ConfigError(f"{where}: {shown} with an interleaved schedule is not mapped")
    layers = _meg_layers(values, model, where, shown)
    first = num(_MEG_FIRST, 0) if _MEG_FIRST in values else None
    last = num(_MEG_LAST, 0) if _MEG_LAST in values else None
    rest = layers - (first or 0) - (last or 0)
    inner = pp - (first is not None) - (last is not None)  # stages that share what is left evenly
    if (inner == 0 and rest != 0) or (inner > 0 and (rest < inner or rest % inner)):
        raise ConfigError(
            f"{where}: {shown}: the other {inner} stages cannot share the remaining {rest} of {layers} layers evenly"
        )
    split = [d for d in (first, last) if d is not None] + ([rest // inner] if inner else [])
    fullest, charged = max(split), -(-layers // pp)
    if min(split) < 1:
        raise ConfigError(f"{where}: {shown}: every pipeline stage needs at least one layer")
    if fullest != charged:
        raise ConfigError(
            f"{where}: {shown}: the fullest stage holds {fullest} of {layers} layers on {pp} stages; "
            f"the composition's uneven stages hold ceil({layers}/{pp}) = {charged} (not mapped)"
        )
    return layers % pp != 0  # a split of layers that divide, with no stage above L / pp, is even


def _meg_layers(
    values: dict[str, str], model: Model | None, where: str, what: str = "--num-layers-per-virtual-pipeline-stage"
) -> int:
    if "--num-layers" in values:
        return parse_int(values["--num-layers"], f"{where}: --num-layers")
    if isinstance(model, Transformer):
        return model.layers
    raise ConfigError(f"{where}: {what} needs --num-layers or --model")


def _meg_check_model(values: dict[str, str], model: Model | None, where: str, num: Callable[[str, int], int]) -> None:
    if not isinstance(model, Transformer):
        return
    for arg, have in (
        ("--num-layers", model.layers),
        ("--hidden-size", model.hidden),
        ("--num-attention-heads", model.heads),
    ):
        if arg in values and num(arg, 0) != have:
            raise ConfigError(f"{where}: {arg} {values[arg]} contradicts --model {model.name} ({have})")


def _meg_recompute(
    values: dict[str, str],
    flags: set[str],
    pp: int,
    model: Model | None,
    where: str,
    notes: list[Unmapped],
    num: Callable[[str, int], int],
) -> Recompute:
    granularity = values.get("--recompute-granularity")
    if "--recompute-activations" in flags:
        if granularity not in (None, "selective"):
            raise ConfigError(
                f"{where}: --recompute-activations (selective) contradicts --recompute-granularity {granularity}"
            )
        granularity = "selective"
    match granularity:
        case None:
            if "--recompute-method" in values:
                raise ConfigError(f"{where}: --recompute-method without --recompute-granularity full")
            return Recompute.NONE
        case "selective":
            return Recompute.SELECTIVE
        case "full":
            method = values.get("--recompute-method")
            count = num("--recompute-num-layers", 1)
            if method not in ("uniform", "block"):
                raise ConfigError(f"{where}: --recompute-granularity full needs --recompute-method uniform or block")
            if method == "uniform" and count > 1:
                notes.append(
                    Unmapped(
                        f"--recompute-num-layers {count}",
                        f"(uniform) one checkpoint per {count} layers, counted as one per layer (an upper bound)",
                    )
                )
            if method == "block":
                per_stage = (model.layers // pp) if isinstance(model, Transformer) else None
                if per_stage is None or count < per_stage:
                    notes.append(
                        Unmapped(
                            f"--recompute-method block --recompute-num-layers {count}",
                            "only some layers recomputed; counted as every layer (a lower bound on activation memory)",
                        )
                    )
            return Recompute.FULL
        case _:
            raise ConfigError(f"{where}: --recompute-granularity {granularity}: expected full or selective")
