"""The per-layer activation bytes against what PyTorch's autograd actually saves (measured).

A decoder layer is run forward once in bf16 with ``torch.autograd.graph.saved_tensors_hooks``
and every tensor autograd keeps for the backward is collected, each storage once. The layer uses
the kernels Megatron-LM trains with where PyTorch's eager ops would save more: a fused RMSNorm
that keeps its input and the per-token reciprocal RMS (Apex ``FusedRMSNorm``, Transformer
Engine), the fused SwiGLU that keeps its input (Megatron-LM ``SwiGLUFunction``,
megatron/core/fusions/fused_bias_swiglu.py), and the fused dropout that keeps a 1-byte mask
(``native_dropout``, what ``F.dropout`` runs on CUDA). Grouped-query attention stacks a group's query
heads along the rows, so K and V are used without being expanded. Parameters and the per-token
statistics (``sb`` elements) are left out, as the model leaves them out. The expected bytes are
these measurements; the model's are ``Transformer.activation_bytes_per_layer``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("torch", reason="the measurement needs the torch extra: pip install -e '.[torch]'")

import torch
import torch.nn.functional as F

from formal._model import Ffn, Norm, Transformer

pytestmark = pytest.mark.torch

S, B, H, A = 16, 2, 32, 4  # tokens, sequences, width, heads (head dim 8)


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm keeping its input and the fp32 reciprocal RMS per token."""

    @staticmethod
    def forward(ctx: Any, x: Any, w: Any) -> Any:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(x, w, rstd)
        return (x.float() * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        x, w, rstd = ctx.saved_tensors
        y = x.float() * rstd
        gy = g.float() * w.float()
        gx = rstd * (gy - y * (gy * y).mean(-1, keepdim=True))
        gw = (g.float() * y).reshape(-1, y.shape[-1]).sum(0)
        return gx.to(x.dtype), gw.to(w.dtype)


class FusedSwiGLU(torch.autograd.Function):
    """silu(gate) * up over the fused first-linear output, keeping that output only."""

    @staticmethod
    def forward(ctx: Any, y: Any) -> Any:
        ctx.save_for_backward(y)
        gate, up = torch.chunk(y, 2, -1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (y,) = ctx.saved_tensors
        gate, up = torch.chunk(y, 2, -1)
        sig = torch.sigmoid(gate)
        return torch.cat((g * sig * (1 + gate * (1 - sig)) * up, g * F.silu(gate)), -1)


def run_layer(m: Transformer) -> int:
    """Bytes autograd saves for one forward of ``m``'s layer (bf16, one storage once)."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    h, a, kv, f, d = m.hidden, m.heads, m.kv_heads_, m.ffn_, m.head_dim
    gated = m.ffn_kind is Ffn.SWIGLU
    params = {
        "n1": torch.ones(h, dtype=dt),
        "n2": torch.ones(h, dtype=dt),
        "b1": torch.zeros(h, dtype=dt),
        "b2": torch.zeros(h, dtype=dt),
        "qkv": torch.randn((a + 2 * kv) * d, h, dtype=dt) * 0.1,
        "proj": torch.randn(h, a * d, dtype=dt) * 0.1,
        "fc1": torch.randn((2 if gated else 1) * f, h, dtype=dt) * 0.1,
        "fc2": torch.randn(h, f, dtype=dt) * 0.1,
    }
    for p in params.values():
        p.requires_grad_(True)
    x = torch.randn(m.seq, m.micro_batch, h, dtype=dt, requires_grad=True)
    s, b = m.seq, m.micro_batch

    def norm(t: Any, w: Any, bias: Any) -> Any:
        if m.norm is Norm.RMSNORM:
            return FusedRMSNorm.apply(t, w)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        return F.layer_norm(t, (h,), w, bias)

    def drop(t: Any) -> Any:
        # The fused kernel CUDA runs (``native_dropout``: a 1-byte boolean mask); eager dropout on
        # the CPU keeps a mask as wide as the activations instead.
        return torch.native_dropout(t, 0.1, True)[0] if m.dropout else t

    saved: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in params.values()}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and t.numel() > s * b:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        n1 = norm(x, params["n1"], params["b1"])
        qkv = F.linear(n1, params["qkv"])
        q, k, v = torch.split(qkv, [a * d, kv * d, kv * d], -1)
        g = a // kv  # query heads per K/V head, stacked along the rows of their group
        q = q.reshape(s, b, kv, g, d).permute(1, 2, 3, 0, 4).reshape(b, kv, g * s, d).contiguous()
        k = k.reshape(s, b, kv, d).permute(1, 2, 0, 3).contiguous()
        v = v.reshape(s, b, kv, d).permute(1, 2, 0, 3).contiguous()
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1 / math.sqrt(d))
        probs = drop(F.softmax(scores, -1))
        ctx = torch.matmul(probs, v).reshape(b, kv, g, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, a * d)
        h1 = x + drop(F.linear(ctx, params["proj"]))
        inner = F.linear(norm(h1, params["n2"], params["b2"]), params["fc1"])
        act = FusedSwiGLU.apply(inner) if gated else F.gelu(inner)  # type: ignore[no-untyped-call]
        out = h1 + drop(F.linear(act, params["fc2"]))
    out.float().sum().backward()  # the saved tensors serve a real backward
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    return sum(saved.values())


def model_of(gated: bool, dropout: bool, kv: int, ffn: int | None) -> Transformer:
    return Transformer(
        "measured",
        layers=1,
        hidden=H,
        heads=A,
        kv_heads=kv,
        vocab=64,
        seq=S,
        micro_batch=B,
        ffn=ffn,
        ffn_kind=Ffn.SWIGLU if gated else Ffn.GELU,
        norm=Norm.RMSNORM if gated else Norm.LAYERNORM,
        bias=not gated,
        dropout=dropout,
    )


@pytest.mark.parametrize(
    ("gated", "dropout", "kv", "ffn"),
    [
        (False, True, A, None),  # GPT: Korthikanti's 34sbh + 5as^2b
        (False, True, A, 40),  # an FFN narrower than 4h
        (True, False, 2, 40),  # Llama: SwiGLU, RMSNorm, GQA, no dropout
        (True, True, 1, 24),  # SwiGLU with dropout, one K/V head
        (False, False, 2, None),
    ],
)
def test_the_model_counts_what_autograd_saves(gated: bool, dropout: bool, kv: int, ffn: int | None) -> None:
    m = model_of(gated, dropout, kv, ffn)
    expected = run_layer(m)
    assert sum(m.activation_bytes_per_layer(2, 1).values()) == expected
