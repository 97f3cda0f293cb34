#!/bin/bash
# Train a feature drafter (EAGLE: one layer over the verifier's last decoder states, drafting
# autoregressively) for VERIFIER.pt, normally on that verifier's greedy distillation
# (scripts/distill.py): the verifier stays frozen inside the model.
#   scripts/train_feature_drafter.sh DATA_BIN SAVE_DIR small --verifier-path VERIFIER.pt [flags]
# small: pairs with the small verifier (the layer takes the verifier's sizes), 3 unrolled steps.
SIZES=(small)
source "$(dirname "$0")/train_common.sh"
case "$SIZE" in
  small) MODEL=(--arch feature_drafter --unroll-steps 3 --dropout 0.1 --lr 1e-3
                --warmup-updates 300 --max-tokens 4096 --max-update 100000) ;;
esac
fairseq_train --task translation --criterion feature_drafter_loss "${MODEL[@]}"
