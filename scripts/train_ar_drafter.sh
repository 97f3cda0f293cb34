#!/bin/bash
# Train an autoregressive drafter: an ordinary fairseq Transformer (--task translation) with one
# decoder layer, normally on distilled data (scripts/distill.py). Decode with it by passing its
# checkpoint as --drafter-path; drafting then runs token by token on its own KV cache.
#   scripts/train_ar_drafter.sh DATA_BIN SAVE_DIR [small|base] [extra fairseq-train flags]
# small: 6 encoder / 1 decoder layers, d=256 (pairs with the small verifier's dictionary).
# base:  transformer_wmt_en_de encoder (6 layers, d=512) with 1 decoder layer, fp16.
SIZES=(small base)
source "$(dirname "$0")/train_common.sh"
case "$SIZE" in
  small) MODEL=(--arch transformer --encoder-layers 6 --decoder-layers 1 --encoder-embed-dim 256
                --decoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024
                --encoder-attention-heads 4 --decoder-attention-heads 4 --dropout 0.1
                --lr 1e-3 --warmup-updates 500 --max-tokens 4096 --max-update 100000) ;;
  base)  MODEL=(--arch transformer_wmt_en_de --decoder-layers 1 --dropout 0.1 --lr 7e-4
                --warmup-updates 4000 --max-tokens 4096 --update-freq 4 --max-update 300000 --fp16) ;;
esac
fairseq_train --task translation --criterion label_smoothed_cross_entropy "${MODEL[@]}"
