#!/bin/bash
# Train the Spec-Drafter with --task spec_translation, normally on distilled data (scripts/distill.py).
#   scripts/train_drafter.sh DATA_BIN SAVE_DIR [small|base] [extra fairseq-train flags]
# Add --init-from-verifier VERIFIER.pt to start from the verifier's encoder and embeddings
# (the encoder shapes must match: small pairs with the small verifier, base with base).
# small: spec_drafter_small (6 encoder / 2 decoder layers, d=256), k=10, 3 cuts per sentence.
# base:  spec_drafter_base (12 / 2, d=512), k=25, fp16, as SpecDec on WMT14.
set -euo pipefail
DATA_BIN=${1:?usage: $0 DATA_BIN SAVE_DIR [small|base] [fairseq-train flags]}
SAVE_DIR=${2:?usage: $0 DATA_BIN SAVE_DIR [small|base] [fairseq-train flags]}
SIZE=${3:-small}
shift $(( $# >= 3 ? 3 : $# ))
HERE=$(cd "$(dirname "$0")/.." && pwd)
case "$SIZE" in
  small) MODEL=(--arch spec_drafter_small --block-size 10 --cuts-per-sentence 3 --dropout 0.1
                --lr 1e-3 --warmup-updates 300 --max-tokens 4096 --max-update 100000) ;;
  base)  MODEL=(--arch spec_drafter_base --block-size 25 --cuts-per-sentence 3 --dropout 0.1 --lr 5e-4
                --warmup-updates 4000 --max-tokens 4096 --update-freq 4 --max-update 300000 --fp16) ;;
  *) echo "$0: size must be small or base, got $SIZE" >&2; exit 2 ;;
esac
exec fairseq-train "$DATA_BIN" --user-dir "$HERE/spec_nmt" \
  --task spec_translation --source-lang de --target-lang en --share-all-embeddings "${MODEL[@]}" \
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt --warmup-init-lr 1e-7 \
  --clip-norm 1.0 --weight-decay 0.0001 \
  --criterion spec_drafter_loss --label-smoothing 0.1 \
  --save-dir "$SAVE_DIR" --save-interval-updates 1000 --keep-interval-updates 1 --no-epoch-checkpoints \
  --validate-interval-updates 1000 --log-interval 50 --log-format simple --seed 1 "$@"
