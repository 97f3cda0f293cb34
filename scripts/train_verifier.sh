#!/bin/bash
# Train the verifier: stock fairseq Transformer, stock --task translation.
#   scripts/train_verifier.sh DATA_BIN SAVE_DIR [small|base] [extra fairseq-train flags]
# small: 6 encoder / 4 decoder layers, d=256 (what trains on a few CPU cores),
#        pre-norm: on bench-de-en (newstest2013) it reached validation loss 7.09 and greedy BLEU 4.1
#        at update 1306, where the earlier post-norm recipe (lr 1e-3, 500 warm-up updates: the
#        shared warm start) had 7.73, and 7.10 / BLEU 1.2 only at 4500.
# base:  transformer base (Vaswani et al., 2017) on WMT14 de-en, fp16, 8x4096 tokens x update-freq 4.
SIZES=(small base)
source "$(dirname "$0")/train_common.sh"
case "$SIZE" in
  small) MODEL=(--arch transformer --encoder-layers 6 --decoder-layers 4
                --encoder-embed-dim 256 --decoder-embed-dim 256
                --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024
                --encoder-attention-heads 4 --decoder-attention-heads 4
                --encoder-normalize-before --decoder-normalize-before
                --dropout 0.1 --attention-dropout 0.0 --activation-dropout 0.0
                --lr 1.5e-3 --warmup-updates 1000 --max-tokens 4096 --max-update 100000) ;;
  base)  MODEL=(--arch transformer_wmt_en_de --dropout 0.1 --lr 7e-4 --warmup-updates 4000
                --max-tokens 4096 --update-freq 4 --max-update 300000 --fp16) ;;
esac
# finish_verifier.py averages the last 5 interval checkpoints (--last 5): keep that many
fairseq_train --task translation --criterion label_smoothed_cross_entropy \
  --keep-interval-updates 5 "${MODEL[@]}"
