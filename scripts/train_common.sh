# Sourced (not run) by the scripts/train_*.sh recipes: their arguments and the optimisation,
# logging and checkpoint flags every model trains with. A recipe sets SIZES (its model sizes,
# the first the default) before sourcing this.
#   SCRIPT DATA_BIN SAVE_DIR [SIZE] [extra fairseq-train flags]
set -euo pipefail
USAGE="usage: $0 DATA_BIN SAVE_DIR [$(IFS='|'; echo "${SIZES[*]}")] [fairseq-train flags]"
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
check_arguments "$USAGE" 2 "$@"
DATA_BIN=$1
SAVE_DIR=$2
SIZE=${3:-${SIZES[0]}}
EXTRA=("${@:4}")
if [[ " ${SIZES[*]} " != *" $SIZE "* ]]; then
  echo "$0: size must be one of ${SIZES[*]}, got $SIZE" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# fairseq_train FLAGS...: the shared flags, then the model's FLAGS, then the user's extra flags
# (fairseq keeps the last value of a repeated flag, so the user's win).
fairseq_train() {
  exec fairseq-train "$DATA_BIN" --user-dir "$REPO/spec_nmt" \
    --source-lang de --target-lang en --share-all-embeddings \
    --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt --warmup-init-lr 1e-7 \
    --clip-norm 1.0 --weight-decay 0.0001 --label-smoothing 0.1 \
    --save-dir "$SAVE_DIR" --save-interval-updates 1000 --keep-interval-updates 1 --no-epoch-checkpoints \
    --validate-interval-updates 1000 --log-interval 50 --log-format simple --seed 1 \
    "$@" "${EXTRA[@]}"
}
