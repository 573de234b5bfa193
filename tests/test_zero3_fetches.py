"""ZeRO-3's replayed fetches (formal/_engine_zero3.py): properties any replay has, and the hand
counts of its simplest settings. DeepSpeed itself is the reference in tests/test_deepspeed.py
(``test_zero3_prefetch_is_replayed_call_for_call``: calls and gathered peak equal on gloo)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies_costs import transformers

from formal._engine_zero3 import Zero3Settings, module_trace, zero3_fetches
from formal._model import Transformer
from formal._tensors import parameter_tensors
from formal.errors import ModelError

NEVER = 0  # a persistence threshold that keeps no parameter whole


@st.composite
def zero3_settings(draw: st.DrawFn) -> Zero3Settings:
    return Zero3Settings(
        param_persistence_threshold=draw(st.sampled_from([0, 64, 100_000])),
        model_persistence_threshold=draw(st.sampled_from([0, 10_000, 2**63 - 1])),
        max_reuse_distance=draw(st.sampled_from([0, 1, 5_000, 10**9])),
        prefetch_bucket_elements=draw(st.sampled_from([0, 1, 300, 20_000, 10**9])),
        max_live_parameters=draw(st.sampled_from([0, 1_000, 10**9])),
    )


def laid_out(model: Transformer) -> bool:
    try:
        parameter_tensors(model)
    except ModelError:
        return False
    return True


@settings(max_examples=150, deadline=None)
@given(transformers(), zero3_settings())
def test_every_module_finds_its_parameters_and_each_is_gathered_at_most_once_a_use(
    model: Transformer, s: Zero3Settings
) -> None:
    assume(laid_out(model))
    f = zero3_fetches(model, s)
    gathered = Counter(p for g in f.gathers for p in g)
    uses = Counter(p for m in f.trace for p in m.params)  # 2, or 4 for a tied embedding
    total = sum(f.sizes)
    for p in range(len(f.sizes)):
        if p in f.persistent:
            assert gathered[p] == 0  # never partitioned for compute
        else:
            assert 1 <= gathered[p] <= uses[p]  # for its first use, at most once more for each later one
    assert all(0 <= n <= total - f.persistent_elements for n in f.live)
    assert all(a <= b for a, b in zip(f.after, f.live, strict=True))  # a release only frees
    assert f.after[-1] == 0  # the embedding's backward is every parameter's last use
    # each module's own (non-persistent) parameters are gathered when it runs
    for module, live in zip(f.trace, f.live, strict=True):
        assert live >= sum(f.sizes[p] for p in set(module.params) - f.persistent)


@settings(max_examples=60, deadline=None)
@given(transformers())
def test_released_after_use_gathers_each_module_at_each_use(model: Transformer) -> None:
    # No persistence, no reuse, no prefetch: every module with parameters is gathered at each of
    # its two uses, and holds only its own parameters while it runs.
    assume(laid_out(model))
    f = zero3_fetches(model, Zero3Settings(NEVER, NEVER, 0, 0, 10**9))
    uses = [m for m in f.trace if m.params]
    assert [tuple(m.params) for m in uses] == list(f.gathers)
    for module, live in zip(f.trace, f.live, strict=True):
        assert live == sum(f.sizes[p] for p in module.params)
    assert f.peak == max(sum(f.sizes[p] for p in m.params) for m in uses)


@settings(max_examples=60, deadline=None)
@given(transformers())
def test_a_reuse_distance_past_the_trace_gathers_once_and_holds_everything(model: Transformer) -> None:
    assume(laid_out(model))
    f = zero3_fetches(model, Zero3Settings(NEVER, NEVER, 10**18, 0, 10**9))
    assert sorted(p for g in f.gathers for p in g) == list(range(len(f.sizes)))
    assert f.peak == sum(f.sizes)


@settings(max_examples=60, deadline=None)
@given(transformers())
def test_a_bucket_past_the_model_prefetches_everything_at_the_root(model: Transformer) -> None:
    # The root's hook (first in the trace, no parameters) pops the whole queue: one gather.
    assume(laid_out(model))
    f = zero3_fetches(model, Zero3Settings(NEVER, NEVER, 0, 10**18, 10**18))
    assert len(f.gathers) == 1 and sorted(f.gathers[0]) == list(range(len(f.sizes)))
    assert f.live[0] == f.peak == sum(f.sizes)


def test_the_trace_is_the_module_tree_deepspeed_records() -> None:
    """The 2-layer GPT layout's trace, as DeepSpeed 0.19.8 recorded the 8-layer validation
    model's (``__submodule_order``, docs/torch-validation.md): root, embedding, each block before
    its modules, final norm, head; backward the root, then the same reversed."""
    model = Transformer("k", layers=2, hidden=8, heads=2, vocab=16, seq=4, tied_embeddings=False)
    _, trace = module_trace(model)
    block = ["ln1", "qkv", "proj", "ln2", "fc1", "fc2"]
    forward = ["", "embed", "pos"] + [n for i in range(2) for n in [f"layers.{i}", *(f"layers.{i}.{b}" for b in block)]]
    forward += ["norm", "head"]
    backward = ["", "head", "norm"]
    backward += [n for i in (1, 0) for n in [f"layers.{i}", *(f"layers.{i}.{b}" for b in block[::-1])]]
    backward += ["pos", "embed"]
    assert [m.name for m in trace] == forward + backward
    assert [m.forward for m in trace] == [True] * len(forward) + [False] * len(backward)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_reads_the_embeddings_parameter(tied: bool) -> None:
    model = Transformer("k", layers=1, hidden=8, heads=2, vocab=16, seq=4, tied_embeddings=tied)
    _, trace = module_trace(model)
    heads = [m for m in trace if m.name == "head"]
    embed = next(m for m in trace if m.name == "embed")
    assert len(heads) == 2 and all((m.params == embed.params) is tied for m in heads)
