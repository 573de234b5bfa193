#!/bin/bash
# Megatron-LM Mixtral 8x7B on 64 GPUs (after examples/mixtral/train_mixtral_8x7b_distributed.sh):
# TP 1 x PP 4 x EP 8, DP 16 (of which EP 8), distributed optimizer, full recomputation.
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \
    --num-layers 32 \
    --hidden-size 4096 \
    --ffn-hidden-size 14336 \
    --num-attention-heads 32 \
    --group-query-attention \
    --num-query-groups 8 \
    --seq-length 4096 \
    --max-position-embeddings 32768 \
    --normalization RMSNorm \
    --swiglu \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --position-embedding-type rope \
    --num-experts 8 \
    --moe-router-topk 2 \
    --moe-router-load-balancing-type aux_loss \
    --moe-aux-loss-coeff 1e-2 \
    --moe-grouped-gemm \
    --micro-batch-size 1 \
    --global-batch-size 256 \
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 4 \
    --expert-model-parallel-size 8 \
    --use-distributed-optimizer \
    --recompute-granularity full \
    --recompute-method uniform \
    --recompute-num-layers 1 \
    --bf16 \
    --lr 1e-4 \
    --train-iters 500000 \
    --tokenizer-type Llama2Tokenizer \
    --tokenizer-model tokenizer.model \
    --data-path my-mixtral_text_document \
    --split 99990,8,2
