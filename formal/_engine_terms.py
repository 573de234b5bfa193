"""What an engine effect is (``Term``), which effects an engine has (``EngineEffects``), and
where FSDP-style sharding cuts a state (``data_axes``): shared by the engine predictor
(``formal._engine_effects``), its activation terms (``formal._engine_activations``) and
DeepSpeed's terms (``formal._engine_deepspeed``), which build on them."""

from __future__ import annotations

from dataclasses import dataclass

from formal._placement import Placement
from formal._vocab import Axis, Group, State

MiB = 2**20


@dataclass(frozen=True)
class Term:
    """One engine effect on one device: its name, what it holds, bytes, and when.

    ``moment``: ``persistent`` (held through the step: counted at every moment), ``forward``,
    ``loss``, ``backward`` or ``second_block`` (held at that moment only, ``MOMENTS``; the second
    block's backward also holds the ``backward`` terms). ``state``: which row of
    the memory table it adds to (``gradients``, ``optimizer``, ``activations``, ``buffers``)."""

    key: str
    label: str
    bytes: int
    moment: str
    state: str


@dataclass(frozen=True)
class EngineEffects:
    """What an engine does beyond the placement, one field per effect (PyTorch 2.13's defaults;
    ``effects_for`` switches off what an engine does not do). Sources are cited per field."""

    # FSDP2 (torch/distributed/fsdp/_fully_shard/_fully_shard.py): ``reshard_after_forward=None``
    # on the root module means False, so the root's parameters (embedding, final norm, head) stay
    # unsharded from forward through backward; the unsharded parameters are allocated apart from
    # the sharded ones (``FSDPParam.alloc_all_gather_outputs``), so the whole root is held.
    fsdp_root_unsharded: bool = True
    # FSDP2 prefetches the next module's all-gather while one computes (implicit forward and
    # backward prefetching of one module, ``FSDPParamGroup``): two blocks unsharded at once.
    fsdp_prefetched_blocks: int = 1
    # FSDP2 reduce-scatters a module's gradients after its backward: the block's unsharded
    # gradient is held until then; the root's own gradients (the head's and final norm's,
    # computed first) wait for the root's reduce-scatter at the end of backward.
    fsdp_unsharded_gradients: bool = True
    # DDP without ``gradient_as_bucket_view`` (torch/nn/parallel/distributed.py): the reducer
    # keeps its own flat buckets, a second full copy of every gradient it all-reduces. Buckets fill
    # in reverse registration order, the first closing at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``),
    # the others at ``bucket_cap_mb`` = 25 MiB; one all-reduce per bucket.
    ddp_bucket_copy: bool = True
    # ``ZeroRedundancyOptimizer`` (ZeRO-1 under DDP, torch/distributed/optim/
    # zero_redundancy_optimizer.py ``_partition_parameters``): whole tensors, largest first, each
    # to the rank with the fewest elements so far; a rank's optimizer state is its tensors', not
    # an even 1/n. After the step each tensor is broadcast from its owner (one call per tensor).
    zero_redundancy_whole_tensors: bool = True
    ddp_first_bucket_bytes: int = 1 * MiB
    ddp_bucket_bytes: int = 25 * MiB
    # DTensor's embedding backward on a row-sharded (vocabulary-parallel) table returns a
    # Replicate gradient: every tp rank holds the full-vocabulary embedding gradient.
    tp_embedding_full_gradient: bool = True
    # DTensor ``RowwiseParallel`` adds its (replicated) bias to the partial sum before the
    # reduction, so under sequence parallelism the bias gradient is complete (Megatron-LM adds it
    # after the reduce-scatter, where the gradient is partial and is all-reduced).
    tp_row_bias_before_reduction: bool = True
    # ``loss_parallel`` keeps the vocabulary shard of the logits themselves for its backward,
    # beside the log-probabilities (torch/distributed/tensor/parallel/loss.py).
    tp_loss_keeps_logits: bool = True
    # DTensor ``ColwiseParallel(input_layouts=Shard(1))`` saves the all-gathered input of the
    # QKV and FC1 matmuls (and of the head) for backward; Megatron-LM (Korthikanti et al. 2022,
    # sections 4.2.2 and 4.3) keeps only the sequence shard and gathers it again in backward.
    sp_saves_gathered_inputs: bool = True
    # Cross-entropy's backward (``aten::_log_softmax_backward_data``, ``nll_loss_backward``): the
    # gradient of the log-probabilities, the probabilities and the logits' gradient, fp32 tensors
    # the size of the logits, held while the loss's backward runs.
    loss_backward_temporaries: int = 3
    # ``torch.distributed.pipelining`` (``_PipelineStageBase.fwd_cache``): a stage keeps each
    # forward's output until that micro-batch's backward, beside what autograd saves; and it
    # preallocates one receive buffer per micro-batch (``_make_recv_buffers`` for every chunk),
    # idle while its micro-batch is not in flight.
    pipeline_keeps_outputs: bool = True
    pipeline_receive_buffers: bool = True
    # The embedding's backward reads the token ids (``aten::embedding_backward`` takes the
    # indices) and the loss's the targets (``nll_loss`` saves ``target``): int64, 8 bytes a token,
    # kept per micro-batch in flight by every engine (Megatron-LM's embedding and
    # vocabulary-parallel cross-entropy save them too).
    token_id_bytes: int = 8
    # ``torch.utils.checkpoint`` (non-reentrant, torch/utils/checkpoint.py): the first tensor the
    # backward unpacks from a checkpointed region runs its forward again and keeps every tensor it
    # saves (``_CheckpointFrame.recomputed``) until the region's backward has unpacked each: one
    # layer's recomputed activations (the whole layer under full recomputation, the attention core
    # under selective) are held during its backward, beyond the checkpoints the placement counts.
    recompute_working_set: bool = True
    # FSDP2 keeps the last reduce-scatter's input alive until the next module's post-backward
    # (``reduce_scatter_max_input_buffers`` = 1, ``FSDPCommContext.reduce_scatter_states`` in
    # torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): during the second block's
    # backward the first block's unsharded gradient is still held.
    fsdp_reduce_scatter_held: bool = True
    # ``torch.distributed.pipelining`` with FSDP2 (``_PipelineStageBase.backward_maybe_with_nosync``
    # in torch/distributed/pipelining/stage.py): every micro-batch's backward runs with
    # ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, so the
    # stage's gradients accumulate unsharded and are reduce-scattered once, after the last
    # micro-batch (``perform_reduce_grad``): the stage's whole gradients are held through the
    # step's micro-batches, where FSDP2 alone holds one block's.
    pipeline_fsdp_deferred_reduction: bool = True
    # Softmax's backward (``aten::_softmax_backward_data``) reads the attention probabilities'
    # gradient and writes the scores' gradient: two ``a s^2 b`` tensors at the activation width,
    # alive together during a block's backward (none where the attention is one fused kernel).
    attention_backward_temporaries: int = 2
    # DTensor's ``ColwiseParallel`` converts its module's input on its own (``_prepare_input_fn``):
    # without sequence parallelism each column-parallel module all-reduces its input's gradient
    # in backward, so a Llama layout's separate q, k, v and gate, up make three and two calls
    # where a fused QKV and FC1 make one each (calls only).
    tp_input_collective_per_module: bool = True


# Every effect off: the placement's own figure.
def data_axes(pl: Placement, state: State, group: Group) -> list[Axis]:
    """Data axes along which ``group``'s ``state`` is sharded (FSDP's shard dimension)."""
    return [a for a in pl.axes if a.splits_data and pl.mode(state, group, a).is_sharded]


__all__ = ["EngineEffects", "MiB", "Term", "data_axes"]
