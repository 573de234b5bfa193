"""The executable reference: a small numpy model trained on one device (docs/semantics.md,
"The executable reference").

The model maps onto the library's tensor groups so that ``derive_program`` and the cost model
read it as a ``Transformer`` (``ReferenceModel.transformer()``): per layer an attention-like block
(``ATTENTION``: a QKV matrix split by columns under TP and an output matrix split by rows, with a
causal linear attention ``z_t = q_t * sum_{t'<=t} k_t' * v_t'`` that mixes positions, so context
parallelism has keys and values to exchange) and an MLP (``MLP``: two matrices, column then row
split), each behind a LayerNorm-like element-wise weight (``NORM``, replicated under TP), a final
norm (``FINAL_NORM``), a word embedding (``EMBEDDING``) and an output head that is the embedding
itself when tied (used on the first and the last pipeline stage) or ``HEAD`` when not. With
``bias`` the linears have biases: QKV's and fc1's split with their columns, the two row-parallel
linears' (``ROW_BIAS``) added after the reduction and replicated under TP (Megatron-LM's
``RowParallelLinear``). With ``experts`` the MLP is a mixture of experts: a ``ROUTER`` and
``EXPERTS`` (each an MLP), top-1 hash routing by token id (``route``), the expert's output gated by
the router's score of it. The loss is the squared error of the logits against integer targets,
``sum((logits - targets)^2) / tokens``: a mean over the global batch, and non-linear, so the
forward's values reach every gradient.

Arithmetic is chosen on purpose (``Arithmetic``): a distributed program sums in a different order
than one device, so only exact arithmetic makes "matches" mean bit for bit.

* ``FIELD`` (the default): integers modulo the prime ``PRIME`` (< 2^26, so products fit in int64).
  This is exact rational arithmetic mapped into a finite field: every rational the reference uses
  (``1/tokens``, ``1/d`` of a mean, the dyadic learning rate and momentum) has an inverse mod the
  prime, sums are associative and exact, and any program that matches as rationals matches here
  bit for bit. Two rationals that differ map to the same residue only by accident (probability
  about degree/PRIME on random data), which is why a mismatch-free run of an invalid program is
  re-run on fresh data before it counts. SGD and SGD with momentum are rational; Adam is not.
* ``FLOAT64``: small integer data, dyadic weights (eighths), dyadic learning rate and momentum.
  Every value is a dyadic rational, but the model is a polynomial of high degree in its weights
  and a distributed program sums in another order, so the last bits can differ: reads are
  compared within ``FLOAT_TOLERANCE`` (relative, 2^-30), many orders of magnitude below the
  smallest violation's effect (a missing or doubled summand changes a gradient by a relative
  amount of order 1/d, at least 1e-3 here). Adam runs only here (its square root is not rational).

``train_single_device`` is the public entry point; the proofs helper uses it to replay a
counterexample concretely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

from formal._model import Norm, Transformer
from formal._vocab import ATTENTION, EMBEDDING, EXPERTS, FINAL_NORM, HEAD, MLP, NORM, ROUTER, ROW_BIAS, Group
from formal.errors import InputError

Array = npt.NDArray[Any]
IndexArray = npt.NDArray[np.intp]

PRIME = 67_108_859  # the largest prime below 2^26: a product of two residues is below 2^52
FLOAT_TOLERANCE = 2.0**-30  # relative, for every FLOAT64 read


class Arithmetic(StrEnum):
    FIELD = "field"  # exact: integers mod PRIME
    FLOAT64 = "float64"  # within FLOAT_TOLERANCE


class OptimizerKind(StrEnum):
    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"


@dataclass(frozen=True)
class Numbers:
    """The arithmetic every reference and simulator computation goes through."""

    kind: Arithmetic

    @property
    def dtype(self) -> type[np.generic]:
        return np.int64 if self.kind is Arithmetic.FIELD else np.float64

    def encode(self, values: npt.ArrayLike) -> Array:
        a = np.asarray(values)
        if self.kind is Arithmetic.FIELD:
            return np.mod(a.astype(np.int64), PRIME)
        return a.astype(np.float64)

    def const(self, value: Fraction | int) -> Array:
        """A scalar: a rational as a residue (numerator x inverse of the denominator) or a float."""
        r = Fraction(value)
        if self.kind is Arithmetic.FIELD:
            return np.asarray(r.numerator % PRIME * pow(r.denominator, -1, PRIME) % PRIME, dtype=np.int64)
        return np.asarray(float(r))

    def zeros(self, shape: int | tuple[int, ...]) -> Array:
        return np.zeros(shape, dtype=self.dtype)

    def fix(self, a: Array) -> Array:
        return np.mod(a, PRIME) if self.kind is Arithmetic.FIELD else a

    def add(self, a: Array, b: Array) -> Array:
        return self.fix(a + b)

    def sub(self, a: Array, b: Array) -> Array:
        return self.fix(a - b)

    def mul(self, a: Array, b: Array) -> Array:
        return self.fix(a * b)

    def scale(self, a: Array, r: Fraction | int) -> Array:
        return self.fix(a * self.const(r))

    def mm(self, a: Array, b: Array) -> Array:
        return self.fix(a @ b)

    def total(self, a: Array, axis: int | tuple[int, ...] | None = None) -> Array:
        return self.fix(np.sum(a, axis=axis))

    def cumsum(self, a: Array, axis: int) -> Array:
        return self.fix(np.cumsum(a, axis=axis))

    def rev_cumsum(self, a: Array, axis: int) -> Array:
        return self.fix(np.flip(np.cumsum(np.flip(a, axis=axis), axis=axis), axis=axis))

    def sum_of(self, arrays: list[Array]) -> Array:
        out = arrays[0]
        for a in arrays[1:]:
            out = out + a
        return self.fix(out)

    def equal(self, expected: Array, got: Array, exact: bool) -> npt.NDArray[np.bool_]:
        if self.kind is Arithmetic.FIELD or exact:
            return np.asarray(expected == got)
        scale = np.maximum(np.abs(expected), 1.0)
        return np.asarray(np.abs(expected - got) <= FLOAT_TOLERANCE * scale)

    def as_text(self, value: Any) -> str:
        if self.kind is Arithmetic.FIELD:
            v = int(value)
            return str(v - PRIME if v > PRIME // 2 else v) + f" (mod {PRIME})"
        return repr(float(value))


# --- the model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One matrix or vector of a group: its flat positions per layer (shape ``(layers, *shape)``)."""

    name: str
    index: npt.NDArray[np.intp]  # positions in the group's flat vector, (L, *shape) or (*shape)
    tp_dim: int | None  # the dimension TP splits (of the per-layer shape), None: replicated


@dataclass(frozen=True)
class ReferenceModel:
    """A small model whose parameters are exactly the groups of ``transformer()``.

    ``micro_batch`` is per data-parallel replica (Megatron's b), as in ``Transformer``.
    """

    layers: int = 2
    hidden: int = 8
    heads: int = 4
    ffn: int = 16
    vocab: int = 16
    seq: int = 8
    micro_batch: int = 1
    tied: bool = True
    bias: bool = True  # linear biases: QKV and fc1 split with their columns, ``row_bias`` replicated
    experts: int = 0  # 0: a dense MLP; otherwise a router and this many experts per layer (top-1)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InputError(f"reference model {name}={value!r}: must be a positive integer")
        if not isinstance(self.experts, int) or self.experts < 0 or self.experts == 1:
            raise InputError(f"reference model experts={self.experts!r}: 0 (dense) or at least 2")

    def transformer(self) -> Transformer:
        """The same model as the cost model and ``derive_program`` read it."""
        return Transformer(
            "reference",
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            vocab=self.vocab,
            seq=self.seq,
            micro_batch=self.micro_batch,
            ffn=self.ffn,
            norm=Norm.RMSNORM,
            bias=self.bias,
            learned_positions=False,
            tied_embeddings=self.tied,
            final_norm=True,
            experts=self.experts,
            top_k=1 if self.experts else 0,
            source="formal._reference: the executable reference model",
        )

    def groups(self) -> tuple[Group, ...]:
        return tuple(_sizes(self))

    def size(self, group: Group) -> int:
        return _sizes(self)[group]

    def tensors(self, group: Group) -> tuple[Tensor, ...]:
        """The group's tensors and how TP splits them (Megatron column/row/vocabulary parallel)."""
        return _tensors(self, group)

    def _tensors(self, group: Group) -> tuple[Tensor, ...]:
        L_, h, f, V, E = self.layers, self.hidden, self.ffn, self.vocab, self.experts
        b = 1 if self.bias else 0
        if group is ATTENTION:
            idx = np.arange(L_ * (4 * h * h + b * 3 * h)).reshape(L_, 4 * h * h + b * 3 * h)
            out = (
                Tensor("qkv", idx[:, : 3 * h * h].reshape(L_, h, 3, h), 2),  # columns by head
                Tensor("out", idx[:, 3 * h * h : 4 * h * h].reshape(L_, h, h), 0),  # rows
            )
            return out + ((Tensor("qkv_bias", idx[:, 4 * h * h :].reshape(L_, 3, h), 1),) if b else ())
        if group is MLP and not E:
            idx = np.arange(L_ * (2 * h * f + b * f)).reshape(L_, 2 * h * f + b * f)
            out = (
                Tensor("fc1", idx[:, : h * f].reshape(L_, h, f), 1),
                Tensor("fc2", idx[:, h * f : 2 * h * f].reshape(L_, f, h), 0),
            )
            return out + ((Tensor("fc1_bias", idx[:, 2 * h * f :], 0),) if b else ())
        if group is ROW_BIAS and b:  # added after the row-parallel reduction: replicated under TP
            biases = np.arange(L_ * 2 * h).reshape(L_, 2, h)
            return (Tensor("out_bias", biases[:, 0], None), Tensor("fc2_bias", biases[:, 1], None))
        if group is ROUTER and E:
            return (Tensor("router", np.arange(L_ * h * E).reshape(L_, h, E), None),)
        if group is EXPERTS and E:
            # Expert-major flat order (expert, layer, element): a flat shard along ep is whole experts.
            one = 2 * h * f + b * f
            per = np.arange(E * L_ * one).reshape(E, L_, one).transpose(1, 0, 2)
            out = (
                Tensor("expert_fc1", per[..., : h * f].reshape(L_, E, h, f), 2),
                Tensor("expert_fc2", per[..., h * f : 2 * h * f].reshape(L_, E, f, h), 1),
            )
            return out + ((Tensor("expert_fc1_bias", per[..., 2 * h * f :], 1),) if b else ())
        if group is NORM:
            norms = np.arange(L_ * 2 * h).reshape(L_, 2, h)
            return (Tensor("norm1", norms[:, 0], None), Tensor("norm2", norms[:, 1], None))
        if group is FINAL_NORM:
            return (Tensor("final_norm", np.arange(h), None),)
        if group in (EMBEDDING, HEAD):
            return (Tensor(group.name, np.arange(V * h).reshape(V, h), 0),)  # vocabulary rows
        raise InputError(f"reference model has no group {group}")

    def is_layered(self, group: Group) -> bool:
        return group in (ATTENTION, MLP, NORM, ROW_BIAS, ROUTER, EXPERTS)

    def locate(self, group: Group, position: int) -> str:
        """A flat position as a person reads it: ``layer 1 qkv[3, 0, 5]``."""
        for t in self.tensors(group):
            hit = np.argwhere(t.index == position)
            if len(hit):
                coords = [int(c) for c in hit[0]]
                if self.is_layered(group):
                    return f"layer {coords[0]} {t.name}{coords[1:]}"
                return f"{t.name}{coords}"
        return f"{group.name}[{position}]"


@functools.cache
def _sizes(model: ReferenceModel) -> dict[Group, int]:
    return model.transformer().group_elements()


@functools.cache
def _tensors(model: ReferenceModel, group: Group) -> tuple[Tensor, ...]:
    return model._tensors(group)


Params = dict[Group, Array]


FLOAT_WEIGHT_SCALE = Fraction(1, 8)  # dyadic: keeps float64 values far from overflow


def initial_parameters(model: ReferenceModel, numbers: Numbers, seed: int) -> Params:
    """Small integer weights in [-2, 2] (norms in [1, 2], never zero); in float64 times 1/8.

    The model is a polynomial of degree about 4 x layers in its weights, so integer weights
    would overflow float64 after a step; dyadic eighths keep the values moderate.
    """
    rng = np.random.default_rng(seed)
    out: Params = {}
    for g in model.groups():
        low = 1 if g in (NORM, FINAL_NORM) else -2
        ints = rng.integers(low, 3, size=model.size(g))
        out[g] = numbers.encode(ints) if numbers.kind is Arithmetic.FIELD else ints * float(FLOAT_WEIGHT_SCALE)
    return out


@dataclass(frozen=True)
class Batch:
    """One step's global batch: token ids ``(B, s)`` and integer loss weights ``(B, s, V)``."""

    tokens: npt.NDArray[np.int64]
    targets: Array


def make_data(model: ReferenceModel, sequences: int, steps: int, numbers: Numbers, seed: int) -> tuple[Batch, ...]:
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, model.vocab, size=(sequences, model.seq)).astype(np.int64)
        targets = numbers.encode(rng.integers(-2, 3, size=(sequences, model.seq, model.vocab)))
        out.append(Batch(tokens, targets))
    return tuple(out)


def _w(model: ReferenceModel, p: Params, group: Group, which: int, layer: int | None = None) -> Array:
    t = model.tensors(group)[which]
    index = t.index if layer is None else t.index[layer]
    return p[group][index]


def _head_group(model: ReferenceModel) -> Group:
    return EMBEDDING if model.tied else HEAD


def route(model: ReferenceModel, tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The expert of each position: top-1 hash routing by the input token id (Roller et al. 2021,
    "Hash Layers For Large Sparse Models"), ``token mod experts``: exact and reproducible in any
    arithmetic. The router's score of that expert gates its output, so the router is trained."""
    return np.mod(tokens, model.experts)


def _bias(model: ReferenceModel, p: Params, group: Group, which: int, layer: int) -> Array | None:
    return _w(model, p, group, which, layer) if model.bias else None


def _plus(n: Numbers, a: Array, bias: Array | None) -> Array:
    return a if bias is None else n.add(a, bias)


def loss_and_gradients(model: ReferenceModel, p: Params, batch: Batch, numbers: Numbers) -> tuple[Array, Params]:
    """Forward and backward of the whole model on one device: the loss and every gradient.

    Loss = the squared error of the logits against the targets, summed over the vocabulary and
    averaged over the tokens: ``sum((logits - targets)^2) / tokens``.
    """
    n = numbers
    h = model.hidden
    tokens = batch.tokens
    route_of = route(model, tokens) if model.experts else None
    x = _w(model, p, EMBEDDING, 0)[tokens]  # (B, s, h)
    saved = []
    for layer in range(model.layers):
        n1 = _w(model, p, NORM, 0, layer)
        n2 = _w(model, p, NORM, 1, layer)
        qkv_w = _w(model, p, ATTENTION, 0, layer)  # (h, 3, h)
        qkv_b = _bias(model, p, ATTENTION, 2, layer)  # (3, h)
        out_w = _w(model, p, ATTENTION, 1, layer)
        u = n.mul(x, n1)
        q, k, v = (_plus(n, n.mm(u, qkv_w[:, j]), None if qkv_b is None else qkv_b[j]) for j in range(3))
        c = n.cumsum(n.mul(k, v), axis=1)
        z = n.mul(q, c)
        x_mid = _plus(n, n.add(x, n.mm(z, out_w)), _bias(model, p, ROW_BIAS, 0, layer))
        w = n.mul(x_mid, n2)
        ffn, ffn_saved = _ffn_forward(model, p, layer, w, route_of, n)
        x_out = _plus(n, n.add(x_mid, ffn), _bias(model, p, ROW_BIAS, 1, layer))
        saved.append((x, u, q, k, v, c, z, x_mid, w, ffn_saved))
        x = x_out
    nf = _w(model, p, FINAL_NORM, 0)
    head = _w(model, p, _head_group(model), 0)  # (V, h)
    xf = n.mul(x, nf)
    logits = n.mm(xf, head.T)
    tokens_total = tokens.size
    error = n.sub(logits, batch.targets)
    loss = n.scale(n.total(n.mul(error, error)), Fraction(1, tokens_total))
    grads: Params = {g: n.zeros(model.size(g)) for g in model.groups()}

    def put(group: Group, which: int, layer: int | None, value: Array) -> None:
        t = model.tensors(group)[which]
        index = t.index if layer is None else t.index[layer]
        grads[group][index] = n.add(grads[group][index], value)

    dlogits = n.scale(error, Fraction(2, tokens_total))
    put(_head_group(model), 0, None, n.mm(dlogits.reshape(-1, model.vocab).T, xf.reshape(-1, h)))
    dxf = n.mm(dlogits, head)
    put(FINAL_NORM, 0, None, n.total(n.mul(dxf, x), axis=(0, 1)))
    dx = n.mul(dxf, nf)
    for layer in reversed(range(model.layers)):
        x_in, u, q, k, v, c, z, x_mid, w, ffn_saved = saved[layer]
        n1 = _w(model, p, NORM, 0, layer)
        n2 = _w(model, p, NORM, 1, layer)
        qkv_w = _w(model, p, ATTENTION, 0, layer)
        out_w = _w(model, p, ATTENTION, 1, layer)
        if model.bias:
            put(ROW_BIAS, 1, layer, n.total(dx, axis=(0, 1)))
        dw = _ffn_backward(model, p, layer, w, dx, ffn_saved, route_of, n, put)
        put(NORM, 1, layer, n.total(n.mul(dw, x_mid), axis=(0, 1)))
        dx = n.add(dx, n.mul(dw, n2))
        if model.bias:
            put(ROW_BIAS, 0, layer, n.total(dx, axis=(0, 1)))
        put(ATTENTION, 1, layer, n.mm(z.reshape(-1, h).T, dx.reshape(-1, h)))
        dz = n.mm(dx, out_w.T)
        dq = n.mul(dz, c)
        dkv = n.rev_cumsum(n.mul(dz, q), axis=1)
        dk = n.mul(dkv, v)
        dv = n.mul(dkv, k)
        u2 = u.reshape(-1, h)
        dqkv = np.stack([n.mm(u2.T, d.reshape(-1, h)) for d in (dq, dk, dv)], axis=1)
        put(ATTENTION, 0, layer, dqkv)
        if model.bias:
            put(ATTENTION, 2, layer, np.stack([n.total(d, axis=(0, 1)) for d in (dq, dk, dv)]))
        du = n.add(n.add(n.mm(dq, qkv_w[:, 0].T), n.mm(dk, qkv_w[:, 1].T)), n.mm(dv, qkv_w[:, 2].T))
        put(NORM, 0, layer, n.total(n.mul(du, x_in), axis=(0, 1)))
        dx = n.add(dx, n.mul(du, n1))
    d_emb = n.zeros((model.vocab, h))
    np.add.at(d_emb, tokens.reshape(-1), dx.reshape(-1, h))
    put(EMBEDDING, 0, None, n.fix(d_emb))
    return loss, grads


def _ffn_forward(
    model: ReferenceModel, p: Params, layer: int, w: Array, route_of: npt.NDArray[np.int64] | None, n: Numbers
) -> tuple[Array, tuple[Array, ...]]:
    """The MLP (``fc2(fc1 w + b1)``), or the MoE block: each position's expert, gated by the router's
    score of it (``gate * fc2_e(fc1_e w + b1_e)``). Returns the output and what the backward reads."""
    if route_of is None:
        y = _plus(n, n.mm(w, _w(model, p, MLP, 0, layer)), _bias(model, p, MLP, 2, layer))
        return n.mm(y, _w(model, p, MLP, 1, layer)), (y,)
    scores = n.mm(w, _w(model, p, ROUTER, 0, layer))  # (B, s, E)
    gate = np.take_along_axis(scores, route_of[..., None], axis=2)[..., 0]
    expert_out = n.zeros(w.shape)
    ys = []
    for e in range(model.experts):
        at = route_of == e
        y = n.mm(w[at], _w(model, p, EXPERTS, 0, layer)[e])
        if model.bias:
            y = n.add(y, _w(model, p, EXPERTS, 2, layer)[e])
        expert_out[at] = n.mm(y, _w(model, p, EXPERTS, 1, layer)[e])
        ys.append(y)
    return n.mul(expert_out, gate[..., None]), (gate, expert_out, *ys)


def _ffn_backward(
    model: ReferenceModel,
    p: Params,
    layer: int,
    w: Array,
    dout: Array,
    saved: tuple[Array, ...],
    route_of: npt.NDArray[np.int64] | None,
    n: Numbers,
    put: Callable[[Group, int, int | None, Array], None],
) -> Array:
    """The input gradient of ``_ffn_forward``; the parameter gradients go to ``put``."""
    h = model.hidden
    if route_of is None:
        (y,) = saved
        fc1, fc2 = _w(model, p, MLP, 0, layer), _w(model, p, MLP, 1, layer)
        put(MLP, 1, layer, n.mm(y.reshape(-1, model.ffn).T, dout.reshape(-1, h)))
        dy = n.mm(dout, fc2.T)
        put(MLP, 0, layer, n.mm(w.reshape(-1, h).T, dy.reshape(-1, model.ffn)))
        if model.bias:
            put(MLP, 2, layer, n.total(dy, axis=(0, 1)))
        return n.mm(dy, fc1.T)
    gate, expert_out = saved[0], saved[1]
    ys = saved[2:]
    router = _w(model, p, ROUTER, 0, layer)
    dgate = n.total(n.mul(dout, expert_out), axis=2)  # (B, s)
    dscores = n.zeros((*w.shape[:2], model.experts))
    np.put_along_axis(dscores, route_of[..., None], dgate[..., None], axis=2)
    put(ROUTER, 0, layer, n.mm(w.reshape(-1, h).T, dscores.reshape(-1, model.experts)))
    dw = n.mm(dscores, router.T)
    dexp = n.mul(dout, gate[..., None])
    f = model.ffn
    g1, g2, gb = n.zeros((model.experts, h, f)), n.zeros((model.experts, f, h)), n.zeros((model.experts, f))
    for e in range(model.experts):
        at = route_of == e
        fc1, fc2 = _w(model, p, EXPERTS, 0, layer)[e], _w(model, p, EXPERTS, 1, layer)[e]
        d_e = dexp[at]
        g2[e] = n.mm(ys[e].T, d_e)
        dy = n.mm(d_e, fc2.T)
        g1[e] = n.mm(w[at].T, dy)
        gb[e] = n.total(dy, axis=0)
        dw[at] = n.add(dw[at], n.mm(dy, fc1.T))
    put(EXPERTS, 0, layer, g1)
    put(EXPERTS, 1, layer, g2)
    if model.bias:
        put(EXPERTS, 2, layer, gb)
    return dw


# --- optimizers ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer:
    """An element-wise optimizer. ``slots``: optimizer-state values per parameter element.

    SGD: ``p -= lr g``. Momentum (PyTorch): ``buf = mu buf + g; p -= lr buf``. Adam (Kingma and
    Ba 2015, with bias correction): float64 only.
    """

    kind: OptimizerKind = OptimizerKind.MOMENTUM
    lr: Fraction = Fraction(1, 64)  # dyadic: exact in float64
    momentum: Fraction = Fraction(1, 2)
    betas: tuple[float, float] = (0.5, 0.75)
    eps: float = 2.0**-20

    @property
    def slots(self) -> int:
        match self.kind:
            case OptimizerKind.SGD:
                return 0
            case OptimizerKind.MOMENTUM:
                return 1
            case OptimizerKind.ADAM:
                return 2
            case _:
                raise AssertionError(self.kind)

    def check(self, numbers: Numbers) -> None:
        if self.kind is OptimizerKind.ADAM and numbers.kind is Arithmetic.FIELD:
            raise InputError("adam: its square root is not rational; use --arithmetic float64")

    def step(self, p: Array, g: Array, o: Array, step: int, numbers: Numbers) -> tuple[Array, Array]:
        """One update of the elements given: ``o`` has shape ``(slots, n)``; returns (p, o)."""
        n = numbers
        match self.kind:
            case OptimizerKind.SGD:
                return n.sub(p, n.scale(g, self.lr)), o
            case OptimizerKind.MOMENTUM:
                buf = n.add(n.scale(o[0], self.momentum), g)
                return n.sub(p, n.scale(buf, self.lr)), buf[None, :]
            case OptimizerKind.ADAM:
                b1, b2 = self.betas
                m = b1 * o[0] + (1 - b1) * g
                v = b2 * o[1] + (1 - b2) * g * g
                m_hat = m / (1 - b1**step)
                v_hat = v / (1 - b2**step)
                return p - float(self.lr) * m_hat / (np.sqrt(v_hat) + self.eps), np.stack([m, v])
            case _:
                raise AssertionError(self.kind)


@dataclass(frozen=True)
class StepRecord:
    """What single-device training reads in one step: P and O before the update, and G."""

    parameters: Params
    gradients: Params
    optimizer: dict[Group, Array]  # (slots, n) per group
    loss: Array


def train_single_device(
    model: ReferenceModel,
    data: tuple[Batch, ...],
    optimizer: Optimizer,
    numbers: Numbers | None = None,
    seed: int = 0,
    parameters: Mapping[Group, Array] | None = None,
) -> tuple[StepRecord, ...]:
    """Train ``model`` on one device, one step per batch; the record of every step's reads.

    >>> m = ReferenceModel(); nums = Numbers(Arithmetic.FIELD)
    >>> records = train_single_device(m, make_data(m, 2, 2, nums, 0), Optimizer(), nums)
    >>> len(records)
    2
    """
    numbers = numbers or Numbers(Arithmetic.FIELD)
    optimizer.check(numbers)
    p = dict(parameters) if parameters is not None else initial_parameters(model, numbers, seed)
    o = {g: numbers.zeros((optimizer.slots, model.size(g))) for g in model.groups()}
    out = []
    for k, batch in enumerate(data, start=1):
        loss, grads = loss_and_gradients(model, p, batch, numbers)
        out.append(StepRecord(dict(p), grads, dict(o), loss))
        new_p: Params = {}
        for g in model.groups():
            new_p[g], o[g] = optimizer.step(p[g], grads[g], o[g], k, numbers)
        p = new_p
    return tuple(out)


__all__ = [
    "FLOAT_TOLERANCE",
    "FLOAT_WEIGHT_SCALE",
    "PRIME",
    "Arithmetic",
    "Batch",
    "Numbers",
    "Optimizer",
    "OptimizerKind",
    "ReferenceModel",
    "StepRecord",
    "Tensor",
    "initial_parameters",
    "loss_and_gradients",
    "make_data",
    "route",
    "train_single_device",
]
