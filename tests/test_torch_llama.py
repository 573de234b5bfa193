"""A Llama-style model under PyTorch's memory tracker (``checker._torch._large.LLAMA``: separate
q/k/v, SwiGLU, RMSNorm, grouped-query attention with 8 K/V heads of 16, no biases, no dropout;
0.51 B parameters under ``FakeTensorMode``, one rank of 8): ``fsdp8``, ``tp8`` and ``tp8xsp``.

Its SwiGLU and RMSNorm save what Megatron-LM's fused kernels save (their inputs), its attention
reads K and V at their own width; the formal model counts what a Llama layer saves from its
structure (``formal._saved``). The measured numbers are PyTorch's; the predicted ones what
``check-composition --engine fsdp2`` prints for this model.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the PyTorch validation needs the torch extra: pip install -e '.[torch]'")

from torch_runs import assert_model_states_and_calls_exact, assert_peak_within_tolerance, compared, run_label

from checker._torch._compare import ACTIVATION_TOLERANCE
from checker._torch._large import LLAMA, LLAMA_RUNS, saved_row
from formal._model import Ffn, Norm
from formal._tensors import parameter_tensors

CFG = LLAMA


def test_the_model_is_llama_style() -> None:
    m = LLAMA.formal()
    assert m.ffn_kind is Ffn.SWIGLU and m.norm is Norm.RMSNORM and not m.bias and not m.dropout
    assert m.kv_heads_ < m.heads
    names = [t.name for t in parameter_tensors(m) if t.layer == 0]
    assert names == [f"layers.0.{n}.weight" for n in ("ln1", "q", "k", "v", "o", "ln2", "gate", "up", "down")]


def test_the_formal_tensors_are_the_modules_parameters() -> None:
    """Registration order and sizes of the built model equal the formal layout's (on a small
    twin: real tensors)."""
    from dataclasses import replace

    from checker._torch._net import Net

    small = replace(LLAMA, layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, vocab=128)
    got = [(n, p.numel()) for n, p in Net(small).named_parameters()]
    want = [(t.name, t.elements) for t in parameter_tensors(small.formal())]
    assert got == want


@pytest.mark.parametrize("run", LLAMA_RUNS, ids=run_label)
def test_model_states_and_collectives_are_exact(run: tuple[str, int]) -> None:
    c, _ = compared(run[0], CFG, run[1])
    assert_model_states_and_calls_exact(c, run)


@pytest.mark.parametrize("run", LLAMA_RUNS, ids=run_label)
def test_peak_the_cli_prints_is_within_3_percent_of_the_tracker_peak(run: tuple[str, int]) -> None:
    c, r = compared(run[0], CFG, run[1])
    assert_peak_within_tolerance(c, r, run)


@pytest.mark.parametrize("run", LLAMA_RUNS, ids=run_label)
def test_saved_activations_are_the_structures_count(run: tuple[str, int]) -> None:
    row = saved_row(*compared(run[0], CFG, run[1]))
    assert abs(row.error) <= ACTIVATION_TOLERANCE, (run, row)
