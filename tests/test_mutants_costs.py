"""Costs the mutation catalogue (``benchmarks/mutate.py``) showed no other test pins down.

Each expected number comes from a published formula or a framework's code, computed here from
the model's sizes (the source is cited beside it), never from the tool's own output.
"""

from __future__ import annotations

import sympy as sp

from checker._analysis import analyze
from checker._parse import parse
from formal._costs import activation_memory, buffer_memory, communication, layer_activations, memory, stage_in_flight
from formal._model import PRECISIONS, Transformer
from formal._presets import PRESETS
from formal._program import derive_program, group_sizes
from formal._vocab import EMBEDDING, EXPERTS, LAYER_IO, Axis, OpKind, Stage, State

ZERO = PRECISIONS["zero"]  # fp16 parameters, gradients and activations (2 bytes), fp32 Adam state
SMALL = Transformer("k", layers=8, hidden=64, heads=4, vocab=1000, seq=32)
MOE = Transformer("tiny-moe", layers=8, hidden=512, heads=8, vocab=1024, seq=256, experts=8, top_k=2)


def test_each_pipeline_stage_holds_its_own_warm_up_of_activations() -> None:
    # 1F1B (Narayanan et al. 2021, 2.2): stage i runs p - i forward passes before its first
    # backward, so it keeps min(p - i, m) micro-batches of its L/p layers. A middle stage keeps
    # no input- or output-layer activations (those live on the first and last stage).
    p, m = 4, 8
    pl = parse(f"pp{p}xm{m}").placement(SMALL)
    per_layer = SMALL.activation_bytes_per_layer(ZERO.activations, ZERO.mask_bytes)
    sbh = sp.Integer(SMALL.seq * SMALL.micro_batch * SMALL.hidden)
    one_micro_batch = layer_activations(pl, per_layer, sbh, ZERO) * sp.Rational(SMALL.layers, p)
    for i in (1, 2):
        assert stage_in_flight(pl, i) == min(p - i, m)
        assert activation_memory(pl, SMALL, ZERO, Stage.MIDDLE, index=i) == one_micro_batch * min(p - i, m)


def test_the_last_stage_is_the_most_loaded_when_the_logits_outweigh_the_warm_up() -> None:
    # One micro-batch (m = 1): every stage holds one micro-batch of its 8 layers, so the stages
    # differ only at the ends: Llama-3 8B's untied head (128256 x 4096) weighs what the
    # embedding does, but the last stage also keeps the fp32 logits, 4 s b v bytes = 4.2 GB at
    # 8192 tokens (Korthikanti et al. 2022, 4.3), against the first stage's s b h dropout mask.
    model = PRESETS["llama3-8b"]
    assert isinstance(model, Transformer)
    a = analyze(parse("pp4xm1"), model, ZERO)
    stages = {st: memory(a.placement, model, ZERO, group_sizes(model), st).total for st in (Stage.FIRST, Stage.LAST)}
    assert stages[Stage.LAST] - stages[Stage.FIRST] > 4 * model.seq * model.vocab - 4 * model.seq * model.hidden
    assert a.memory.stage == "last" and a.memory.total == stages[Stage.LAST]


def test_full_recomputation_keeps_each_layers_input_split_by_cp() -> None:
    # Korthikanti et al. 2022, Table 2: full recomputation keeps only each layer's input, 2 s b h
    # bytes at 16 bits; context parallelism gives every rank s / cp of the sequence.
    per_layer = SMALL.activation_bytes_per_layer(ZERO.activations, ZERO.mask_bytes)
    sbh = SMALL.seq * SMALL.micro_batch * SMALL.hidden
    for cp in (1, 2, 4):
        pl = parse(f"cp{cp}xrecompute").placement(SMALL)
        assert layer_activations(pl, per_layer, sp.Integer(sbh), ZERO) == sp.Rational(2 * sbh, cp)


def test_expert_parallelism_does_not_split_a_devices_activations() -> None:
    # ep ranks are data-parallel ranks outside the experts: each runs its own micro-batch, and
    # the all-to-alls only move its tokens to the experts' devices and back (Lepikhin et al.
    # 2020, GShard; DeepSpeed-MoE), so a device keeps what a dp rank keeps.
    for degree in (2, 4):
        assert activation_memory(parse(f"ep{degree}").placement(MOE), MOE, ZERO) == activation_memory(
            parse(f"dp{degree}").placement(MOE), MOE, ZERO
        )


def test_expert_gradients_need_no_reduce_scatter_bucket() -> None:
    # Along ep each rank computes its own experts' gradients; nothing is reduce-scattered there
    # (only the 1/ep scale), so there is no full-size gradient bucket (DeepSpeed ZeRO-2's
    # reduce_bucket_size exists to stage a reduce-scatter).
    pl = parse("ep4").placement(MOE)
    assert pl.mode(State.GRADIENTS, EXPERTS, Axis.EP).is_sharded
    assert buffer_memory(pl, MOE, group_sizes(MOE), ZERO) == 0


def test_the_tied_embedding_gradient_is_summed_between_the_first_and_last_stage() -> None:
    # Megatron-LM all-reduces a tied embedding's gradient in its embedding group, the ranks of
    # the first and the last pipeline stage (parallel_state._EMBEDDING_GROUP): two participants,
    # a ring all-reduce of 2 (2 - 1) / 2 = 1 x the fp16 gradient, on both ends and no middle stage.
    model = PRESETS["gpt3-1.3b"]  # tied embeddings, vocabulary 51200, hidden 2048
    assert isinstance(model, Transformer)
    program = derive_program(parse("pp4").placement(model), model)
    gradient_bytes = model.vocab * model.hidden * 2
    for stage, expected in ((Stage.FIRST, gradient_bytes), (Stage.MIDDLE, 0), (Stage.LAST, gradient_bytes)):
        traffic = [
            t
            for t in communication(program, ZERO, stage)
            if t.state is State.GRADIENTS and t.group == EMBEDDING and t.axis is Axis.PP
        ]
        assert sum(int(t.bytes) for t in traffic) == expected, stage
        assert all(t.participants == 2 for t in traffic)


def test_expert_parallelism_sends_two_all_to_alls_per_layer_each_way() -> None:
    # GShard (Lepikhin et al. 2020) / Megatron-LM's MoEAlltoAllTokenDispatcher: one all-to-all
    # dispatches the tokens to their experts and one combines them back, per MoE layer and
    # micro-batch in the forward, and their transposes in the backward; each carries the
    # micro-batch's s b tokens x top-k copies x hidden.
    for text, layers, m in (("ep4", 8, 1), ("ep4xpp2xm4", 4, 4)):
        program = derive_program(parse(text).placement(MOE), MOE)
        sends = [op for op in program.ops if op.kind is OpKind.ALL_TO_ALL]
        assert len(sends) == 2  # forward and backward
        for op in sends:
            assert op.group == LAYER_IO and op.count == 2 * layers * m, text
            assert op.elements == MOE.seq * MOE.micro_batch * MOE.top_k * MOE.hidden


def test_shard_grad_op_with_offloaded_parameters_holds_the_whole_stage_through_the_backward() -> None:
    # FSDP SHARD_GRAD_OP does not reshard parameters after the forward (PyTorch's ShardingStrategy:
    # "parameters are not resharded after the forward"): from the forward's all-gather to the end
    # of the backward a device holds all Psi parameters unsharded, 2 Psi bytes at 16 bits, on any
    # degree d; between steps it keeps its 2 Psi / d shard. With the parameters offloaded
    # (CPUOffload(offload_params=True)) that shard lives on the host, so the held copy is all
    # buffer: the 2 Psi / d move from the parameters into the buffers and the peak stays 2 Psi.
    # (Regression: the held copy was charged minus the device's shard even when the shard was on
    # the host, so the peak grew with d, 2 Psi (1 - 1/d), and was 0 at d = 1.)
    psi = sum(group_sizes(SMALL).values())
    for d in (1, 2, 4):
        resident = memory(parse(f"fsdp-sgo{d}").placement(SMALL), SMALL, ZERO, group_sizes(SMALL))
        offloaded = memory(parse(f"fsdp-sgo{d}xoffload-params").placement(SMALL), SMALL, ZERO, group_sizes(SMALL))
        assert resident.parameters.total == 2 * psi / d
        assert offloaded.parameters.total == 0
        assert offloaded.buffers is not None and resident.buffers is not None
        assert offloaded.buffers - resident.buffers == 2 * psi / d, d
        assert offloaded.parameters.total + offloaded.buffers == resident.parameters.total + resident.buffers


def test_the_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_of_the_compute() -> None:
    # Narayanan et al. 2021 (PTD-P), section 2.2.1: the bubble time fraction, measured against
    # the ideal (bubble-free) compute time, is (p - 1) / m for GPipe and for 1F1B alike.
    from formal._costs import bubble_fraction

    model = PRESETS["gpt3-1.3b"]
    for p, m in ((4, 8), (8, 16), (2, 1)):
        for schedule in ("xgpipe", ""):
            pl = parse(f"pp{p}xm{m}{schedule}").placement(model)
            assert bubble_fraction(pl) == sp.Rational(p - 1, m), (p, m, schedule)
