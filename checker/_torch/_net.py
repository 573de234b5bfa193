"""The small transformer the engines run, and the formal ``Transformer`` that describes it.

A GPT-style decoder block as Megatron lays it out: one fused QKV projection whose output rows
are ordered (head, q/k/v, head_dim), so that a contiguous split of its rows along ``tp`` gives
every rank whole heads with their own queries, keys and values (column parallel); an output
projection and the second MLP matrix row parallel; LayerNorms, row-parallel biases replicated;
a word embedding and an untied output layer (vocabulary parallel under ``tp``). No learned
positions: under sequence parallelism they would need a sequence slice per rank, and the
formal model has ``learned_positions=False`` for exactly this model.

``exact=True`` swaps the inexact operations for exact ones (affine norms, ReLU, uniform
attention with a dyadic weight, a linear loss normalised by a power of two): with small
integer data and weights every float32 product and sum is then exact, so a correct distributed
run matches single-device training bit for bit (docs/semantics.md, "The executable reference").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from formal._model import Ffn, Transformer
from formal._model import Norm as NormKind


@dataclass(frozen=True)
class NetConfig:
    """Dimensions of the small model. ``batch``: samples per data-parallel replica per micro-batch."""

    layers: int = 8
    hidden: int = 64
    heads: int = 8
    vocab: int = 256
    seq: int = 32
    batch: int = 2
    dropout: float = 0.1  # Korthikanti's activation count includes the two dropout masks per layer
    exact: bool = False
    # Llama-style blocks (``LlamaBlock``): separate q/k/v, SwiGLU of width ``ffn``, RMSNorm,
    # ``kv_heads`` heads for K and V (grouped-query attention), no biases, no dropout.
    llama: bool = False
    kv_heads: int | None = None
    ffn: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def formal(self) -> Transformer:
        """The formal description of this model (parameter groups and activation sizes)."""
        if self.llama:
            return Transformer(
                "torch-small-llama",
                layers=self.layers,
                hidden=self.hidden,
                heads=self.heads,
                vocab=self.vocab,
                seq=self.seq,
                micro_batch=self.batch,
                kv_heads=self.kv_heads,
                ffn=self.ffn,
                ffn_kind=Ffn.SWIGLU,
                norm=NormKind.RMSNORM,
                bias=False,
                learned_positions=False,
                tied_embeddings=False,
                dropout=False,
                source="checker._torch._net: the Llama-style model the PyTorch engines run",
            )
        return Transformer(
            "torch-small",
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            vocab=self.vocab,
            seq=self.seq,
            micro_batch=self.batch,
            learned_positions=False,
            tied_embeddings=False,
            source="checker._torch._net: the model the PyTorch engines run",
        )


class Norm(nn.Module):
    """LayerNorm, or in exact mode its affine part only (same parameters: weight and bias)."""

    def __init__(self, hidden: int, exact: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.exact = exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return x * self.weight + self.bias
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias)


class Block(nn.Module):
    """One decoder block. ``recompute`` (set by the engine harness from the composition):
    ``"full"`` checkpoints the whole block (``torch.utils.checkpoint``, non-reentrant: only its
    input is kept, the forward runs again in backward); ``"selective"`` checkpoints the attention
    core alone, ``QK^T``, softmax, dropout and the product with V (Korthikanti et al. 2022,
    section 5: the part whose saved tensors grow with ``s^2``), keeping Q, K and V."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.cfg = cfg
        self.recompute = "none"
        self.ln1 = Norm(h, cfg.exact)
        self.qkv = nn.Linear(h, 3 * h)  # rows ordered (head, q/k/v, head_dim), as Megatron
        self.proj = nn.Linear(h, h)
        self.ln2 = Norm(h, cfg.exact)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.cfg.dropout, self.training) if self.cfg.dropout else x

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv(x)
        b, s, width = qkv.shape  # width = 3 * local heads * head_dim (local under tp)
        heads = width // (3 * cfg.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, cfg.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        if self.recompute == "selective":
            from torch.utils.checkpoint import checkpoint

            core = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            core = self.core(q, k, v)
        out = core.transpose(1, 2).reshape(b, s, heads * cfg.head_dim)
        return self._dropout(self.proj(out))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core: scores, softmax, dropout, the product with V."""
        b, heads, s, _ = q.shape
        if self.cfg.exact:
            # Uniform attention, 1/s with s a power of two: exact, and of degree one, so values
            # keep few significant bits over several steps (q and k get zero gradients).
            probs = torch.full((b, heads, s, s), 1.0 / s, dtype=v.dtype)
        else:
            probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.cfg.head_dim), dim=-1)
        probs = self._dropout(probs)
        return probs @ v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.fc1(x)
        inner = F.relu(inner) if self.cfg.exact else F.gelu(inner)
        return self._dropout(self.fc2(inner))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            from torch.utils.checkpoint import checkpoint

            out: torch.Tensor = checkpoint(self.body, x, use_reentrant=False)
            return out
        return self.body(x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm as a fused kernel computes it (Megatron-LM's, Transformer Engine's): it saves its
    input and the per-token reciprocal root mean square, nothing of ``sbh`` size besides the
    input (eager ``F.rms_norm`` also keeps the normalised input)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, w, rstd)
        return x * rstd * w

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w, rstd = ctx.saved_tensors  # type: ignore[attr-defined]
        n = x * rstd
        gw = (g * n).sum(dim=tuple(range(g.dim() - 1)))
        gn = g * w
        gx = rstd * (gn - n * (gn * n).mean(-1, keepdim=True))
        return gx, gw


class _SwiGLUFn(torch.autograd.Function):
    """``silu(gate) * up`` as Megatron-LM's fused ``SwiGLUFunction`` (megatron/core/fusions/
    fused_bias_swiglu.py): it saves its two inputs and recomputes the SiLU in backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors  # type: ignore[attr-defined]
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return g * up * sig * (1 + gate * (1 - sig)), g * silu


class RMSNorm(nn.Module):
    """RMSNorm (Zhang and Sennrich 2019, as Llama): a weight, no bias; the fused kernel's saves."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _RMSNormFn.apply(x, self.weight)  # type: ignore[no-untyped-call]
        return out


class LlamaBlock(nn.Module):
    """A Llama decoder layer (Hugging Face ``LlamaDecoderLayer``'s layout without rotary
    positions, which save nothing the count depends on): RMSNorm, separate q, k, v projections
    (k and v of ``kv_heads`` heads, shared by groups of query heads), the output projection,
    RMSNorm, SwiGLU (``down(silu(gate(x)) * up(x))``); no biases, no dropout. ``recompute`` as
    ``Block``'s."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        kv = (cfg.kv_heads or cfg.heads) * hd
        f = cfg.ffn or 4 * h
        self.cfg = cfg
        self.recompute = "none"
        self.ln1 = RMSNorm(h)
        self.q = nn.Linear(h, cfg.heads * hd, bias=False)
        self.k = nn.Linear(h, kv, bias=False)
        self.v = nn.Linear(h, kv, bias=False)
        self.o = nn.Linear(cfg.heads * hd, h, bias=False)
        self.ln2 = RMSNorm(h)
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q(x).view(b, s, -1, hd).transpose(1, 2)  # local heads under tp
        k = self.k(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.v(x).view(b, s, -1, hd).transpose(1, 2)
        if self.recompute == "selective":
            from torch.utils.checkpoint import checkpoint

            core = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            core = self.core(q, k, v)
        out: torch.Tensor = self.o(core.transpose(1, 2).reshape(b, s, -1))
        return out

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scores, softmax and the product with V; each K/V head serves ``heads / kv_heads``
        query heads, whose queries are stacked along the sequence so that K and V are read at
        their own width (a grouped kernel's saves; ``repeat_kv`` would save them widened)."""
        b, heads, s, hd = q.shape
        kv = k.shape[1]
        q = q.reshape(b, kv, heads // kv * s, hd)  # query heads (kv, group) in order, as repeat_kv
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(hd), dim=-1)
        return (probs @ v).reshape(b, heads, s, hd)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        inner: torch.Tensor = _SwiGLUFn.apply(self.gate(x), self.up(x))  # type: ignore[no-untyped-call]
        out: torch.Tensor = self.down(inner)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            from torch.utils.checkpoint import checkpoint

            out: torch.Tensor = checkpoint(self.body, x, use_reentrant=False)
            return out
        return self.body(x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    """Embedding, ``layers`` blocks, final norm, untied head. Pipeline stages drop the parts
    that live on other stages (``embed``/``norm``/``head`` set to None)."""

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.llama and cfg.exact:
            raise ValueError("the exact model is GPT-style only")
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.hidden)
        block = LlamaBlock if cfg.llama else Block
        self.layers = nn.ModuleDict({str(i): block(cfg) for i in range(cfg.layers)})
        self.norm: nn.Module | None = RMSNorm(cfg.hidden) if cfg.llama else Norm(cfg.hidden, cfg.exact)
        self.head: nn.Linear | None = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
            if self.cfg.dropout and not self.cfg.llama:  # Megatron's embedding dropout (Korthikanti 4.3)
                x = F.dropout(x, self.cfg.dropout, self.training)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        return x


def loss_fn(cfg: NetConfig, logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cross-entropy, or in exact mode a linear loss with integer weights (targets). ``scale``
    turns a per-replica mean into a share of the global mean (a power of two in exact mode)."""
    if cfg.exact:
        return (logits * targets).sum() * scale  # linear: its gradient is the integer targets
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)) * scale


def init_exact_(net: nn.Module, seed: int, density: float = 0.25) -> None:
    """Sparse integer weights in {-1, 0, 1} (exact mode): about ``density`` of them nonzero,
    so values keep few significant bits and every float32 product and sum stays exact."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            values = torch.randint(-1, 2, p.shape, generator=gen).to(p.dtype)
            keep = (torch.rand(p.shape, generator=gen) < density).to(p.dtype)
            p.copy_(values * keep)


def batch(cfg: NetConfig, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets: class ids, or in exact mode integer logits targets."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab, (samples, cfg.seq), generator=gen)
    if cfg.exact:
        return ids, torch.randint(-1, 2, (samples, cfg.seq, cfg.vocab), generator=gen).float()
    return ids, torch.randint(0, cfg.vocab, (samples, cfg.seq), generator=gen)
