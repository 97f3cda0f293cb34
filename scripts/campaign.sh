#!/bin/bash
# The whole model recipe as one resumable campaign: verifier to convergence, its final model,
# greedy distillation of the training set, then the cached drafter and the Spec-Drafter on it.
#   scripts/campaign.sh DATA_BIN SPM_MODEL RAW_DIR WORK_DIR [fairseq-train flags for every stage]
# DATA_BIN and SPM_MODEL come from scripts/prepare_data.py RAW_DIR (the data-bin and its spm.model);
# RAW_DIR holds the raw {train,valid,test}.{de,en}: the final BLEU is scored against its
# references, and its size sets the distillation's shards. Each stage writes under
# WORK_DIR (verifier/, distilled/, drafter-cached/, drafter-spec/) and appends to its train.log.
# Run it again after any stop: finished stages are skipped and the one in progress resumes from
# its checkpoint_last.pt (or, for distillation, its last finished shard).
# A training stage is finished when its log shows PATIENCE (default 3) finished epochs without
# improvement of the validation metric (learning_curve.py --epoch-ends --converged, checked every
# minute: fairseq's --patience also counts the validations of mid-epoch saves, and forgets its
# count when it resumes) or when fairseq-train exits by itself (--max-epoch 30).
set -euo pipefail
USAGE="usage: $0 DATA_BIN SPM_MODEL RAW_DIR WORK_DIR [fairseq-train flags]"
DATA_BIN=${1:?$USAGE}
SPM_MODEL=${2:?$USAGE}
RAW_DIR=${3:?$USAGE}
WORK=${4:?$USAGE}
EXTRA=("${@:5}")
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
PATIENCE=${PATIENCE:-3}
DEVICE=()
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || DEVICE=(--cpu)

log() { echo "campaign: $(date '+%F %T') $*"; }

# converged DIR LEARNING_CURVE_FLAGS: the stopping rule on DIR/train.log
converged() {
  local dir=$1; shift
  python "$SCRIPTS/learning_curve.py" "$dir/train.log" --epoch-ends "$@" \
    --converged "$PATIENCE" > /dev/null 2>&1
}

# train NAME LEARNING_CURVE_FLAGS -- COMMAND...: run COMMAND (logged to WORK/NAME/train.log)
# until the stage has converged, unless it finished before; LEARNING_CURVE_FLAGS tell
# learning_curve.py which validation metric decides and which ones FINISHED shows.
train() {
  local dir=$WORK/$1 metric=() pid; shift
  while [ "$1" != "--" ]; do metric+=("$1"); shift; done; shift
  mkdir -p "$dir"
  if [ -f "$dir/FINISHED" ]; then log "$dir: finished before"; return; fi
  if ! converged "$dir" "${metric[@]}"; then
    log "$dir: training"
    "$@" >> "$dir/train.log" 2>&1 &
    pid=$!
    local seconds=0
    while kill -0 "$pid" 2> /dev/null; do
      sleep 1
      # "end of epoch" is logged after the epoch's checkpoints are saved: stopping loses nothing
      if (( ++seconds % 60 == 0 )) && converged "$dir" "${metric[@]}"; then kill "$pid"; fi
    done
    wait "$pid" || converged "$dir" "${metric[@]}"  # a failure stops the campaign
  fi
  log "$dir: finished"
  python "$SCRIPTS/learning_curve.py" "$dir/train.log" --epoch-ends "${metric[@]}" \
    > "$dir/FINISHED"
}

# The stages, in a function called on the last line with exit: bash reads the whole file before
# it starts them, so a campaign that runs for days does not read a later edit of it half-way.
main() {
  EPOCHS=(--save-interval-updates 500 --keep-interval-updates 5 --validate-interval-updates 0
          --max-epoch 30 "${DEVICE[@]}" "${EXTRA[@]}")

  train verifier -- "$SCRIPTS/train_verifier.sh" "$DATA_BIN" "$WORK/verifier" small "${EPOCHS[@]}" \
    --eval-bleu --eval-bleu-args '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}' \
    --eval-bleu-remove-bpe sentencepiece

  VERIFIER=$WORK/verifier/checkpoint_final.pt
  if [ ! -f "$VERIFIER" ]; then
    log "averaging the verifier's last 5 checkpoints, scoring on newstest"
    python "$SCRIPTS/finish_verifier.py" "$WORK/verifier" --data-bin "$DATA_BIN" --raw "$RAW_DIR" \
      --spm-model "$SPM_MODEL" --last 5 "${DEVICE[@]}" --json "$WORK/verifier/final.json"
  fi

  # greedy: the exact target of lossless decoding. A shard per 10,000 training pairs (about 5
  # minutes on 2 CPU cores): a stopped run goes on from its last finished shard.
  if [ ! -f "$WORK/distilled/train.de-en.de.bin" ]; then
    SHARDS=$(( ($(wc -l < "$RAW_DIR/train.de") + 9999) / 10000 ))
    log "distilling the training set in $SHARDS shard(s)"
    python "$SCRIPTS/distill.py" "$DATA_BIN" "$VERIFIER" "$WORK/distilled" --beam 1 \
      --num-shards "$SHARDS" "${DEVICE[@]}"
  fi

  ACCEPTANCE=(--init-from-verifier "$VERIFIER" --eval-acceptance-verifier "$VERIFIER"
              --beta 3 --tau 1 --best-checkpoint-metric accepted_lossless
              --maximize-best-checkpoint-metric --required-batch-size-multiple 1)
  for kind in cached spec; do
    size=$([ $kind = cached ] && echo cached_small || echo small)
    train "drafter-$kind" --metrics loss,acc,accepted_lossless,accepted_top_beta \
      --best-metric accepted_lossless --maximize -- \
      "$SCRIPTS/train_drafter.sh" "$WORK/distilled" "$WORK/drafter-$kind" "$size" "${EPOCHS[@]}" \
      "${ACCEPTANCE[@]}"
  done
  log "done: export the pair with scripts/export_model.py (see README)"
}

main; exit
