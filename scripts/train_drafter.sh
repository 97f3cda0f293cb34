#!/bin/bash
# Train a drafter with --task spec_translation, normally on distilled data (scripts/distill.py).
#   scripts/train_drafter.sh DATA_BIN SAVE_DIR [small|base|cached_small|cached_base] [extra flags]
# --init-from-verifier VERIFIER.pt starts from the verifier (the encoder shapes must match: small
# pairs with the small verifier, base with base); the cached drafters require it.
# small: spec_drafter_small (6 encoder / 2 decoder layers, d=256), k=10, 3 cuts per sentence.
# base:  spec_drafter_base (12 / 2, d=512), k=25, fp16, as SpecDec on WMT14.
# cached_small/cached_base: the cached drafter (the verifier's encoder, frozen; a 2-layer decoder
# with a causal prefix started from the verifier's first two; --decoder-layers 1 for one), k=10 / 25,
# 4 cuts per sentence.
SIZES=(small base cached_small cached_base)
source "$(dirname "$0")/train_common.sh"
case "$SIZE" in
  small) MODEL=(--arch spec_drafter_small --block-size 10 --cuts-per-sentence 3 --dropout 0.1
                --lr 1e-3 --warmup-updates 300 --max-tokens 4096 --max-update 100000) ;;
  base)  MODEL=(--arch spec_drafter_base --block-size 25 --cuts-per-sentence 3 --dropout 0.1 --lr 5e-4
                --warmup-updates 4000 --max-tokens 4096 --update-freq 4 --max-update 300000 --fp16) ;;
  cached_small) MODEL=(--arch cached_drafter_small --block-size 10 --cuts-per-sentence 4 --dropout 0.1
                       --lr 1e-3 --warmup-updates 300 --max-tokens 4096 --max-update 100000) ;;
  cached_base)  MODEL=(--arch cached_drafter_base --block-size 25 --cuts-per-sentence 4 --dropout 0.1
                       --lr 5e-4 --warmup-updates 4000 --max-tokens 4096 --update-freq 4
                       --max-update 300000 --fp16) ;;
esac
fairseq_train --task spec_translation --criterion spec_drafter_loss "${MODEL[@]}"
