#!/bin/bash
# A launch script written for this project's tests in the layout of Megatron-LM's
# examples/gpt3 launcher: bash arrays of arguments, variables, positional paths, an arithmetic
# expansion, and one launcher line that splices the arrays. The model is GPT-3 175B as Brown et
# al. 2020 (Table 2.1) give it: 96 layers, d_model 12288, 96 heads, 2048-token context; the
# layout (tp 8, pp 16, global batch 1536, fp16) is Narayanan et al. 2021's (Table 1).

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
NUM_NODES=1          # one node here: 8 processes (the layout wants 128 devices)
MASTER_ADDR=localhost
MASTER_PORT=6000
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CKPT_DIR=$1          # where checkpoints go
LOG_DIR=$2           # tensorboard logs
VOCAB=$3             # gpt2-vocab.json
MERGES=$4            # gpt2-merges.txt
CORPUS=$5            # data prefix

LAUNCH=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto   # flash, fused, unfused or local
)

TRAIN=(
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-iters 500000
    --weight-decay 0.1
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
)

PARALLEL=(
	--tensor-model-parallel-size 8
	--pipeline-model-parallel-size 16
)

DATA=(
    --data-path $CORPUS
    --vocab-file $VOCAB
    --merge-file $MERGES
    --split 949,50,1
)

LOGGING=(
    --log-interval 100
    --save $CKPT_DIR
    --load $CKPT_DIR
    --tensorboard-dir $LOG_DIR
)

torchrun ${LAUNCH[@]} pretrain_gpt.py \
    ${MODEL[@]} \
    ${TRAIN[@]} \
    ${PARALLEL[@]} \
    ${DATA[@]} \
    ${LOGGING[@]}
