#!/bin/bash
# The whole model recipe as one resumable campaign: verifier to convergence, its final model,
# beam-5 distillation of the training set, then on it the cached drafter, the Spec-Drafter, the
# cached drafter trained on short blocks and the 1-layer cached drafter.
#   [PATIENCE=3] [COMPARISON_EPOCHS=10] scripts/campaign.sh DATA_BIN SPM_MODEL RAW_DIR WORK_DIR \
#     [fairseq-train flags]
# DATA_BIN and SPM_MODEL come from scripts/prepare_data.py RAW_DIR (the data-bin and its spm.model);
# RAW_DIR holds the raw {train,valid,test}.{de,en}: the final BLEU is scored against its
# references, and its size sets the distillation's shards. Each stage writes under WORK_DIR
# (verifier/, distilled/, drafter-cached/, drafter-spec/, drafter-short/,
# drafter-cached-1layer/); training stages append to their train.log. The
# extra flags go to every fairseq-train after the campaign's checkpoint flags
# (--save-interval-updates 500 --keep-interval-updates 5 --max-epoch 30), which they can
# change, and before the stage's own flags, which they cannot (the comparison drafters'
# --max-epoch is COMPARISON_EPOCHS).
# finish_verifier.py averages the last 5 interval checkpoints: keep 5 or more.
# Run it again after any stop: finished stages are skipped and the one in progress resumes from
# its checkpoint_last.pt (repaired first if the stop cut fairseq's copies short:
# repair_checkpoints.py) or, for distillation, its last finished shard. Stopping the campaign
# (Ctrl-C, kill) stops what it runs.
# A training stage is finished when its log shows PATIENCE finished, validated epochs without
# improvement of the validation metric (for a drafter: acceptance gained no more than 0.01)
# (learning_curve.py --epoch-ends --converged, checked as each epoch ends: fairseq's --patience
# also counts the validations of mid-epoch saves, and forgets its count when it resumes), or
# when fairseq-train exits by itself (--max-epoch 30; COMPARISON_EPOCHS for the drafters after
# the first, which are compared with it epoch by epoch). A second campaign on the same WORK_DIR is
# refused while this one, or a training it left running, holds WORK_DIR/.campaign.lock.
set -euo pipefail
USAGE="usage: $0 DATA_BIN SPM_MODEL RAW_DIR WORK_DIR [fairseq-train flags]"
source "$(dirname "${BASH_SOURCE[0]}")/usage.sh"
check_arguments "$USAGE" 4 "$@"
DATA_BIN=$1
SPM_MODEL=$2
RAW_DIR=$3
WORK=$4
EXTRA=("${@:5}")
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
PATIENCE=${PATIENCE:-3}
[[ $PATIENCE =~ ^[0-9]+$ ]] || { echo "$0: PATIENCE must be a number, got $PATIENCE" >&2; exit 2; }
COMPARISON_EPOCHS=${COMPARISON_EPOCHS:-10}
[[ $COMPARISON_EPOCHS =~ ^[1-9][0-9]*$ ]] || {
  echo "$0: COMPARISON_EPOCHS must be a positive number, got $COMPARISON_EPOCHS" >&2; exit 2; }
# One campaign per WORK_DIR. The steps inherit the lock (fairseq-train and its data loader
# workers; not what Python starts with subprocess, which closes it), so a training that outlived
# a campaign killed without its traps (SIGKILL) keeps a second campaign from training beside it.
mkdir -p "$WORK"
exec 9> "$WORK/.campaign.lock"
locked=0
flock -n 9 || locked=$?
if (( locked == 1 )); then
  echo "$0: $WORK is in use by another campaign, or by a step a killed campaign left running" \
       "(the processes that hold $WORK/.campaign.lock): stop it first" >&2
  exit 1
elif (( locked != 0 )); then
  echo "$0: cannot lock $WORK/.campaign.lock (flock exit status $locked)" >&2
  exit "$locked"
fi
DEVICE=()
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || DEVICE=(--cpu)

log() { echo "campaign: $(date '+%F %T') $*"; }

# The running step, in a process group of its own: a stop of the campaign stops it and what it
# started (fairseq-generate under distill.py, data loader workers).
child=""
stop_child() {
  # every background job too: a signal can arrive after a step started but before child is set
  local pid
  for pid in $child $(jobs -p); do kill -- -"$pid" 2> /dev/null || true; done
  wait || true
}
trap stop_child EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

# run_step COMMAND...: run COMMAND as the running step and wait for it; its exit status
run_step() {
  local status=0
  setsid "$@" &
  child=$!
  wait "$child" || status=$?
  child=""
  return "$status"
}

# converged DIR LEARNING_CURVE_FLAGS: whether DIR/train.log meets the stopping rule; an error
# of learning_curve.py (exit 2, e.g. a metric the log lacks) stops the campaign
converged() {
  local dir=$1 status=0 errors
  shift
  [ -f "$dir/train.log" ] || return 1
  errors=$(python "$SCRIPTS/learning_curve.py" "$dir/train.log" --epoch-ends "$@" \
             --converged "$PATIENCE" 2>&1 > /dev/null) || status=$?
  if (( status >= 2 )); then echo "$errors" >&2; exit "$status"; fi
  return "$status"
}

# train NAME [--then STEP] LEARNING_CURVE_FLAGS -- COMMAND...: run COMMAND (logged to
# WORK/NAME/train.log) until the stage has converged, unless it finished before; then STEP (a
# function, which must skip work it finds done) when given: the stage is FINISHED only once STEP
# has succeeded, so a rerun after a failed STEP runs it again. LEARNING_CURVE_FLAGS tell
# learning_curve.py which validation metric decides and which ones FINISHED shows.
train() {
  local dir=$WORK/$1 metric=() status=0 ends=0 now then=""
  shift
  if [ "$1" = "--then" ]; then then=$2; shift 2; fi
  while [ "$1" != "--" ]; do metric+=("$1"); shift; done
  shift
  mkdir -p "$dir"
  if [ -f "$dir/FINISHED" ]; then
    log "$dir: finished before"
    # STEP too, if given: campaigns before --then wrote FINISHED before it ran (STEP skips work
    # it finds done)
    if [ -n "$then" ]; then "$then"; fi
    return
  fi
  # a stop during fairseq's copies to checkpoint_last.pt / checkpoint_best.pt must not end,
  # restart or set back the stage, nor leave the next step a cut file
  python "$SCRIPTS/repair_checkpoints.py" "$dir"
  if ! converged "$dir" "${metric[@]}"; then
    log "$dir: training"
    setsid "$@" >> "$dir/train.log" 2>&1 &
    child=$!
    while kill -0 "$child" 2> /dev/null; do
      sleep 1
      # at an epoch's end, after its checkpoints are saved: stopping then loses nothing
      now=$(grep -c -e '| end of epoch ' -e '| begin training epoch ' "$dir/train.log" || true)
      if (( now != ends )); then
        ends=$now
        if converged "$dir" "${metric[@]}"; then kill -- -"$child" 2> /dev/null || true; fi
      fi
    done
    wait "$child" || status=$?
    child=""
    if (( status != 0 )) && ! converged "$dir" "${metric[@]}"; then
      log "$dir: training failed (exit status $status), see $dir/train.log"
      exit "$status"
    fi
  fi
  if [ -n "$then" ]; then "$then"; fi
  log "$dir: finished"
  python "$SCRIPTS/learning_curve.py" "$dir/train.log" --epoch-ends "${metric[@]}" \
    > "$dir/FINISHED.partial"
  mv "$dir/FINISHED.partial" "$dir/FINISHED"
}

# The verifier stage's last step: average its last 5 interval checkpoints into
# checkpoint_final.pt, the verifier every later step uses, and score it (final.json is written
# last, whole).
finish_verifier() {
  if [ ! -f "$WORK/verifier/final.json" ]; then
    log "averaging the verifier's last 5 checkpoints, scoring on newstest"
    run_step python "$SCRIPTS/finish_verifier.py" "$WORK/verifier" --data-bin "$DATA_BIN" \
      --raw "$RAW_DIR" --spm-model "$SPM_MODEL" --last 5 "${DEVICE[@]}" \
      --json "$WORK/verifier/final.json"
  fi
}

# The stages, in a function called on the last line with exit: bash reads the whole file before
# it starts them, so a campaign that runs for days does not read a later edit of it half-way.
main() {
  local epochs=(--save-interval-updates 500 --keep-interval-updates 5
                --validate-interval-updates 0 --max-epoch 30 "${DEVICE[@]}" "${EXTRA[@]}")

  # validation BLEU: greedy, with the decoding settings' length limits
  local bleu_args
  bleu_args=$(python -c 'import json; from spec_nmt.settings import DEFAULTS
print(json.dumps({"beam": 1, "max_len_a": DEFAULTS.max_len_a, "max_len_b": DEFAULTS.max_len_b}))')
  train verifier --then finish_verifier -- \
    "$SCRIPTS/train_verifier.sh" "$DATA_BIN" "$WORK/verifier" small "${epochs[@]}" \
    --eval-bleu --eval-bleu-args "$bleu_args" --eval-bleu-remove-bpe sentencepiece

  local verifier=$WORK/verifier/checkpoint_final.pt

  # Beam 5, distill.py's default, as SpecDec and Kim & Rush distil: the project's next
  # distillation is beam 5 (greedy, --beam 1, is the exact target of the lossless rule and a
  # fifth of the cost; the bundled drafter was trained on greedy targets, see its model card).
  # A shard per 10,000 training pairs: a stopped run goes on from its last finished shard.
  if [ ! -f "$WORK/distilled/DONE" ]; then
    local pairs shards
    pairs=$(wc -l < "$RAW_DIR/train.de")
    shards=$(( (pairs + 9999) / 10000 ))
    log "distilling the training set in $shards shard(s)"
    run_step python "$SCRIPTS/distill.py" "$DATA_BIN" "$verifier" "$WORK/distilled" --beam 5 \
      --num-shards "$shards" "${DEVICE[@]}"
    touch "$WORK/distilled/DONE"
  fi

  # acceptance on the first 1,000 validation sentences: a validation decodes them once per
  # rule (lossless, the reference top-beta/tau), a third of what the whole newstest2013 would cost
  local top_beta=()
  read -ra top_beta < <(python -c 'from spec_nmt.settings import REFERENCE_TOP_BETA as s
print("--beta", s.beta, "--tau", s.tau)') || true
  (( ${#top_beta[@]} == 4 )) || { log "cannot read the reference top-beta/tau setting"; exit 1; }
  local acceptance=(--init-from-verifier "$verifier" --eval-acceptance-verifier "$verifier"
                    --eval-acceptance-sentences 1000
                    "${top_beta[@]}" --best-checkpoint-metric accepted_lossless
                    --maximize-best-checkpoint-metric --required-batch-size-multiple 1)
  local kind size layers
  # a drafter has stopped learning when its acceptance gains 0.01 tokens per iteration or less
  # in 3 epochs: a metric creeping by thousandths would otherwise run to --max-epoch. The cached
  # drafter comes first and trains to convergence: it is the bundle's unless another wins. The
  # others are comparisons, trained COMPARISON_EPOCHS epochs at most and compared with its curve
  # epoch by epoch: the Spec-Drafter (the issue's baseline; it drafts at 1.4-2.4x the cached
  # drafter's cost and trains 1.5x slower), the cached drafter trained on blocks of 5 masks with
  # 8 cuts per sentence (as many masks per sentence, twice the first positions: the first
  # bundled cached drafter earned 0.98 of its 1.04 accepted drafts in its first 3; docs/lab-notes.md;
  # validated at its own k = 5, which costs the cached drafter 0.013 drafts against k = 10), the
  # 1-layer cached drafter (cheaper drafts).
  local own
  for kind in cached spec short cached-1layer; do
    # each drafter's decoder depth comes last: an extra --decoder-layers (the verifier's) cannot
    # change it
    own=()
    [ "$kind" = cached ] || own=(--max-epoch "$COMPARISON_EPOCHS")
    case $kind in
      cached) size=cached_small layers=2 ;;
      spec) size=small layers=2 ;;
      short) size=cached_small layers=2 own+=(--block-size 5 --cuts-per-sentence 8) ;;
      cached-1layer) size=cached_small layers=1 ;;
    esac
    train "drafter-$kind" --metrics loss,acc,accepted_lossless,accepted_top_beta \
      --best-metric accepted_lossless --maximize --min-delta 0.01 -- \
      "$SCRIPTS/train_drafter.sh" "$WORK/distilled" "$WORK/drafter-$kind" "$size" \
      "${epochs[@]}" "${acceptance[@]}" --decoder-layers "$layers" "${own[@]}"
  done
  log "done: export the pair with scripts/export_model.py OUT_DIR --verifier $verifier" \
      "--drafter $WORK/drafter-cached/checkpoint_best.pt --data-bin $WORK/distilled" \
      "--spm-model $SPM_MODEL"
}

main; exit
