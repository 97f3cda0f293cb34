#!/usr/bin/env bash
# The GPU check: the CUDA tests (tests/test_cuda.py), the host synchronisations of decoding
# (benchmarks/benchmark.py syncs), where the static loop's time goes (benchmark.py static-cost),
# the GPU benchmark (benchmark.py ceiling on newstest2014: fp32 at batch 1 and at 8, 32, 128, fp16
# at batch 1; the static loop captured as CUDA graphs beside the dynamic loop, stock fairseq
# greedy and beam 5, and the oracle), the model-size table (benchmark.py sizes), the verifier's greedy translations
# of the training sources for the drafter's next training (distill) and, given its data, the
# bundled drafter trained on, in one run of at most BUDGET_S seconds (560; the device call's
# timeout is 600), writing gpu_check.log, gpu_check.json, tests.xml and headline.json
# (benchmark.py --headline) into $OUT, with distill: distill-greedy.en.xz, with training:
# train_drafter.log, drafter-best.pt and drafter-last.pt (compact fp16, as in a model directory).
#
# 1. Here, once (pip and ../shared/data needed):
#        scripts/gpu_check.sh --prepare [DRAFTER_DATA_BIN]
#    fills gpu-carry/ (git-ignored) with the cp312 manylinux wheels the GPU machine lacks
#    (ve-fairseq, hydra-core, omegaconf, antlr4-python3-runtime, bitarray, sentence-splitter),
#    newstest2014's first 1,000 lines (source and reference) and the training sources to distill
#    (bench-de-en's train and extra-de-en's sentence pairs, xz, with distill.txt naming each
#    file's lines), then prints what would travel against the 64 MiB limit. DRAFTER_DATA_BIN (the
#    bundled verifier's greedy translations, binarized by scripts/drafter_data.py: the drafter's
#    data) carries its train and valid splits xz'd instead of the sources to distill, and the run
#    then trains on them; without it the train step trains on the distill step's translations of
#    this run (scripts/drafter_data.py binarizes them there, with newstest2013's first lines to
#    validate): GPU_STEPS="distill train" is an on-policy training run of its own. FEATURE_DRAFTER=DRAFTER.pt (a feature drafter of the
#    bundled verifier, as export_model.py writes it) adds it, and the run then times it too.
# 2. Here, before any GPU run: the same steps on the CPU at tiny sizes, into the folder OUT:
#        OUT=/tmp/gpu-dry scripts/gpu_check.sh --dry-run
# 3. On the GPU machine (the device tool's run, from the repository root, carry ["gpu-carry"]):
#        scripts/gpu_check.sh
#    It installs the wheels into /tmp/site, prints nvidia-smi and torch's version, then runs
#    the steps of GPU_STEPS, each in its share of what is left of BUDGET_S seconds, so the log
#    and JSON come back even when a step runs out of time.
#
# Sizes (environment): TEST_LINES (lossless tests), TEST_SAMPLES (chi-square tests), TEST_FILTER
# (pytest -k of the CUDA tests; empty: all), SYNC_LINES (lines of the syncs count), BATCH1_LINES
# and BATCHED_LINES (benchmark lines at batch 1 and at the other batch sizes), BENCH_RUNS (the
# benchmark runs, as the runs list in run_bench), BENCH_FLAGS (the systems the benchmark adds to
# its own; default: beam 5, k = 2, 5, 10, top-beta 5:3:1, no phase run), SYNC_SIZES, COST_LINES
# (lines of the static loop's cost), SIZE_LINES and SIZE_BATCHES (the model-size table),
# DISTILL_LINES (0: all), DRAFTER_FLAGS (fairseq-train flags the train step adds, e.g.
# "--lr 1e-4"), TRAIN_S (the seconds the steps before training leave it, exports
# included; it then takes all that is left; 0: their shares decide), TRAIN_KIND (cached: the
# bundled drafter trained on; feature: a feature drafter (EAGLE) trained from scratch, exported
# to feature-drafter-best.pt and timed at batch 1 (on a GPU on the static loop, but for the
# --draft-stop row) in the step's last FEATURE_BENCH_S (120) seconds, into
# bench-feature-trained.json; give it TRAIN_S=430 or more: it trains only what is left after
# 90 s of margin and the benchmark's time, and refuses under 60 s), BUDGET_S. GPU_STEPS lists
# the steps in the order they run (default "tests syncs cost bench sizes distill feature train";
# feature needs the prepared feature drafter, train the prepared drafter data).
# CTranslate2 has no CUDA row: the image has no ctranslate2, and its wheels link CUDA 12's cuBLAS
# (libcublas.so.12), which the CUDA 13 image lacks and which (hundreds of MB) cannot travel.
set -uo pipefail
SELF=$(realpath "$0")  # the train step runs this script again, from the repository root
cd "$(dirname "$0")/.."
CARRY=gpu-carry
MODEL_DIR=data/models/bench-de-en
LIMIT_BYTES=$((64 * 1024 * 1024))
DRAFTER_DATA=$CARRY/drafter-data
FEATURE_CARRIED=$CARRY/feature-drafter.pt
DISTILL_SOURCE=$CARRY/data/distill.de.xz
TEST_SET_LINES=1000
MODE=${1:-gpu}

prepare() {
    local python=${PYTHON:-python3} data=${BENCH_DATA:-../shared/data/bench-de-en}
    local extra=${EXTRA_DATA:-../shared/data/extra-de-en} file
    local drafter_bin=${1:-}
    mkdir -p "$CARRY/wheels" "$CARRY/data"
    rm -f "$CARRY"/wheels/*.whl
    local platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    # --no-deps: each missing package named; the GPU machine has the rest (torch, numpy, regex,
    # sacrebleu, scikit-learn, pyyaml, ...); fairseq never imports cffi, which it lists
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp $platforms -d "$CARRY/wheels" \
        ve-fairseq==0.12.3 hydra-core==1.3.8 omegaconf==2.3.1 bitarray==3.12.3 \
        sentence-splitter==1.4 || return 1
    # antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 and hydra 1.3 pin) is published as
    # source only: build its pure-Python wheel here
    "$python" -m pip wheel -q --no-deps -w "$CARRY/wheels" antlr4-python3-runtime==4.9.3 || return 1
    # newstest2014's first lines: no step reads more than a few hundred; newstest2013's, the
    # drafter's validation when the train step trains on the distill step's translations
    for side in de en; do
        head -n "$TEST_SET_LINES" "$data/test.$side" >"$CARRY/data/test.$side" || return 1
        head -n "$TEST_SET_LINES" "$data/valid.$side" >"$CARRY/data/valid.$side" || return 1
    done
    rm -rf "$DRAFTER_DATA" "$FEATURE_CARRIED" "$DISTILL_SOURCE" "$CARRY/data/distill.txt"
    if [[ -n ${FEATURE_DRAFTER:-} ]]; then
        install -m 644 "$FEATURE_DRAFTER" "$FEATURE_CARRIED" || return 1
    fi
    if [[ -n $drafter_bin ]]; then
        # what fairseq-train reads: the dictionaries, train and valid (not test), each file xz'd
        # (a third of its size: the 144k on-policy pairs travel in 6 MB, not 17); with the data
        # here the distill step has nothing to make, so its sources stay behind
        mkdir -p "$DRAFTER_DATA"
        for file in "$drafter_bin"/dict.*.txt "$drafter_bin"/train.* "$drafter_bin"/valid.*; do
            xz -T2 -6 <"$file" >"$DRAFTER_DATA/$(basename "$file").xz" || return 1
        done
        travel_size
        return
    fi
    # the sources the verifier translates for the drafter's on-policy data: the benchmark's
    # training set and the extra pairs (not the Ding dictionary's word list)
    : >"$CARRY/data/distill.txt"
    for file in "$data/train.de" "$extra"/*.de; do
        [[ $file == *ding-dict* ]] && continue
        echo "$(wc -l <"$file") $(basename "$(dirname "$file")")/$(basename "$file")" \
            >>"$CARRY/data/distill.txt"
        cat "$file"
    done | xz -T2 -6 >"$DISTILL_SOURCE" || return 1
    travel_size
}

train_drafter() {
    # The bundled drafter trained on as the drafts issue's candidate was (on-policy, w = 1; the
    # model card's last drafter step), epoch after epoch until --stop-time-hours, each epoch
    # validated by its acceptance; then the best and the last exported as compact fp16 files.
    # TRAIN_KIND=feature trains a feature drafter instead (train_feature), on the same data.
    local seconds=$1 device=$2 save=$WORK/drafter start=$WORK/drafter-start.pt
    local verifier=$MODEL_DIR/verifier.pt which stop_hours flags=(--eval-acceptance-sentences 500)
    local -a TRAIN_FLAGS
    read -r -a TRAIN_FLAGS <<<"${DRAFTER_FLAGS:-}"  # e.g. "--lr 1e-4", last: they win
    if [[ -d $DRAFTER_DATA ]]; then  # the carried data, unpacked
        mkdir -p "$WORK/drafter-data"
        for file in "$DRAFTER_DATA"/*.xz; do
            xz -dc "$file" >"$WORK/drafter-data/$(basename "$file" .xz)" || return 1
        done
        DRAFTER_DATA=$WORK/drafter-data
    else  # the distill step's translations, binarized here
        DRAFTER_DATA=$WORK/drafter-data
        "$PY" scripts/drafter_data.py "$MODEL_DIR" "$WORK/distill.de" "$WORK/distill.en" \
            "$CARRY/data/valid" "$DRAFTER_DATA" >"$WORK/drafter-data.log" 2>&1 ||
            { tail -3 "$WORK/drafter-data.log"; return 1; }
        echo "train_drafter: $(grep -c . "$WORK/distill.en") on-policy pairs from the distill step"
    fi
    # train_common.sh calls fairseq-train, which pip's --target install may leave off the PATH
    mkdir -p "$WORK/bin"
    printf '#!/bin/sh\nexec "%s" -c "from fairseq_cli.train import cli_main; cli_main()" "$@"\n' \
        "$(command -v "$PY")" >"$WORK/bin/fairseq-train"
    chmod +x "$WORK/bin/fairseq-train"
    if [[ ${TRAIN_KIND:-cached} == feature ]]; then
        train_feature "$seconds" "$device"
        return
    fi
    # the dry run: three updates, then the epoch's validation (its loss over all of valid)
    [[ $device == cpu ]] && flags=(--cpu --max-update 3 --eval-acceptance-sentences 8)
    "$PY" scripts/unpack_drafter.py "$MODEL_DIR" "$start" || return 1
    stop_hours=$(stop_hours "$start" "$((seconds - TRAIN_MARGIN_S))") || return 1
    PATH=$WORK/bin:$PATH scripts/train_drafter.sh "$DRAFTER_DATA" "$save" cached_small \
        "${flags[@]}" --init-from-verifier "$verifier" --finetune-from-model "$start" \
        --on-policy-weight 1 --lr 3e-4 --warmup-updates 100 --seed 2 --max-epoch 100 \
        --stop-time-hours "$stop_hours" --validate-interval-updates 0 --save-interval-updates 0 \
        --eval-acceptance-verifier "$verifier" --best-checkpoint-metric accepted_lossless \
        --maximize-best-checkpoint-metric --required-batch-size-multiple 1 "${TRAIN_FLAGS[@]}" \
        >"$OUT/train_drafter.log" 2>&1
    echo "train_drafter: fairseq-train exited $?," \
        "$(grep -c "valid on 'valid'" "$OUT/train_drafter.log") validations"
    for which in best last; do
        if [[ ! -f $save/checkpoint_$which.pt ]]; then
            echo "train_drafter: no checkpoint_$which.pt"
            return 1
        fi
        "$PY" scripts/export_model.py "$WORK/export-$which" --verifier "$verifier" \
            --drafter "$save/checkpoint_$which.pt" --data-bin "$DRAFTER_DATA" \
            --spm-model "$MODEL_DIR/spm.model" || return 1
        cp "$WORK/export-$which/drafter.pt" "$OUT/drafter-$which.pt" || return 1
    done
}

stop_hours() {  # stop_hours CHECKPOINT SECONDS: fairseq's --stop-time-hours for SECONDS more (its
    # clock goes on from the checkpoint's training time; no checkpoint: from 0)
    "$PY" -c 'import os, sys, torch
previous = 0
if os.path.isfile(sys.argv[1]):
    state = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
    previous = (state.get("extra_state") or {}).get("previous_training_time", 0)
print((previous + max(int(sys.argv[2]), 1)) / 3600)' "$1" "$2"
}

train_feature() {
    # A feature drafter (EAGLE) of the bundled verifier on the drafter data (the verifier's own
    # greedy translations, which is what it learns to predict), from scratch (a checkpoint to
    # resume from would hold the verifier: too large to come back); validated by its loss; the
    # best exported compact, then timed at batch 1 on the static loop (the defaults' on CUDA).
    local seconds=$1 device=$2 save=$WORK/feature verifier=$MODEL_DIR/verifier.pt flags=()
    local bench_s=${FEATURE_BENCH_S:-120} training
    local -a TRAIN_FLAGS
    read -r -a TRAIN_FLAGS <<<"${DRAFTER_FLAGS:-}"
    [[ $device == cpu ]] && flags=(--cpu --max-update 3) && bench_s=${FEATURE_BENCH_S:-60}
    ((bench_s < 30)) && bench_s=30
    training=$((seconds - TRAIN_MARGIN_S - bench_s))
    if [[ $device != cpu ]] && ((training < 60)); then  # an untrained drafter measures nothing
        echo "train_feature: ${training} s to train; give the train step more (TRAIN_S=430)"
        return 1
    fi
    PATH=$WORK/bin:$PATH scripts/train_feature_drafter.sh "$DRAFTER_DATA" "$save" small \
        "${flags[@]}" --verifier-path "$verifier" --max-epoch 100 \
        --stop-time-hours "$(stop_hours "" "$training")" \
        --validate-interval-updates 0 --save-interval-updates 0 \
        --required-batch-size-multiple 1 "${TRAIN_FLAGS[@]}" >"$OUT/train_drafter.log" 2>&1
    echo "train_feature: fairseq-train exited $?," \
        "$(grep -c "valid on 'valid'" "$OUT/train_drafter.log") validations"
    [[ -f $save/checkpoint_best.pt ]] || { echo "train_feature: no checkpoint_best.pt"; return 1; }
    "$PY" scripts/export_model.py "$WORK/export-feature" --verifier "$verifier" \
        --drafter "$save/checkpoint_best.pt" --data-bin "$DRAFTER_DATA" \
        --spm-model "$MODEL_DIR/spm.model" || return 1
    cp "$WORK/export-feature/drafter.pt" "$OUT/feature-drafter-best.pt" || return 1
    # acceptance and speed at batch 1 against the captured greedy of the same run, k = 3, 5 and
    # 10 with --draft-stop 0.6 (the dynamic loop); a timeout here is the benchmark's, not the
    # step's: the drafter is trained and exported by then
    timeout "$((bench_s - 10))" "$PY" benchmarks/benchmark.py ceiling "$MODEL_DIR" \
        --drafter-path "$OUT/feature-drafter-best.pt" --src "$CARRY/data/test.de" \
        --device "$device" --warmup-lines 2 --lossless-blocks 3,5 --draft-stops 10:0.6 \
        --lines "$FEATURE_BENCH_LINES" --batch-sizes 1 --no-phases \
        --json "$OUT/bench-feature-trained.json" ||
        echo "train_feature: the benchmark stopped early (status $?); the drafter came back"
    return 0
}

travel_size() {
    # what the device tool sends: tracked files, untracked files git does not ignore, the carry
    local tracked untracked carried total
    tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    untracked=$(git ls-files -z -o --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
    carried=$(du -sb "$CARRY" | cut -f1)
    total=$((tracked + ${untracked:-0} + carried))
    awk -v t="$tracked" -v u="${untracked:-0}" -v c="$carried" -v l="$LIMIT_BYTES" -v n="$CARRY" \
        'BEGIN { m = 1048576; printf "travel: tracked %.1f MiB + untracked %.1f MiB + %s %.1f MiB = %.1f MiB of %d MiB\n", t / m, u / m, n, c / m, (t + u + c) / m, l / m }'
    if ((total > LIMIT_BYTES)); then
        echo "travel: over the limit by $(((total - LIMIT_BYTES) / 1024)) KiB" >&2
        return 1
    fi
}

case $MODE in
--prepare)
    prepare "${2:-}"
    exit
    ;;
--train-drafter)  # the train step, run by this script under its time limit (WORK, OUT, PY,
    # TRAIN_MARGIN_S set)
    train_drafter "$2" "$3"
    exit
    ;;
--dry-run)
    : "${OUT:?--dry-run writes into the folder OUT: OUT=/tmp/gpu-dry $0 --dry-run}"
    PY=${PYTHON:-/work/main/.venv/bin/python}
    DEVICE=cpu
    # tiny: the same steps, minutes on two shared cores (fp16 runs slowly on a CPU)
    TEST_LINES=${TEST_LINES:-4} TEST_SAMPLES=${TEST_SAMPLES:-5000} SYNC_LINES=${SYNC_LINES:-4}
    SYNC_SIZES=1,2
    BATCH1_LINES=${BATCH1_LINES:-2} BATCHED_LINES=${BATCHED_LINES:-4}
    BATCHED_SIZES=2,4 WARMUP_LINES=1 BUDGET_S=${BUDGET_S:-2400} TRAIN_S=${TRAIN_S:-600}
    SIZE_LINES=${SIZE_LINES:-2} SIZE_BATCHES=1,2 SIZE_LENGTH=8 DISTILL_LINES=${DISTILL_LINES:-20}
    COST_LINES=${COST_LINES:-3} FEATURE_BENCH_LINES=${FEATURE_BENCH_LINES:-2}
    TEST_FILTER=${TEST_FILTER-lossless or captured or replay or static or sync}
    ;;
gpu)
    : "${OUT:?the device tool sets OUT}"
    PY=python3
    DEVICE=cuda
    # sized from the first H200 runs' step times (BENCHMARKS.md, "On a GPU"): every step has
    # its time, but the benchmark runs, fp16 the slowest, want more than one run leaves them;
    # a second run takes those that ran out (BENCH_RUNS)
    # the static loop's run: the sampling, tree and cache tests passed on the H200 before and
    # their code is unchanged, so the default filter keeps the lossless and static-loop tests
    TEST_LINES=${TEST_LINES:-32} TEST_SAMPLES=${TEST_SAMPLES:-20000} SYNC_LINES=${SYNC_LINES:-16}
    TEST_FILTER=${TEST_FILTER-lossless or captured or replay or static or sync}
    SYNC_SIZES=${SYNC_SIZES:-1,32}
    BATCH1_LINES=${BATCH1_LINES:-100} BATCHED_LINES=${BATCHED_LINES:-128}
    BATCHED_SIZES=8,32,128 WARMUP_LINES=5 BUDGET_S=${BUDGET_S:-560} TRAIN_S=${TRAIN_S:-180}
    SIZE_LINES=${SIZE_LINES:-16} SIZE_BATCHES=1,8,32 SIZE_LENGTH=32 DISTILL_LINES=${DISTILL_LINES:-0}
    COST_LINES=${COST_LINES:-32} FEATURE_BENCH_LINES=${FEATURE_BENCH_LINES:-50}
    ;;
*)
    echo "usage: $0 [--prepare [DRAFTER_DATA_BIN] | --dry-run]" >&2
    exit 2
    ;;
esac

mkdir -p "$OUT"
# what a train step left here in an earlier run would pass for this run's
rm -f "$OUT/train_drafter.log" "$OUT/drafter-best.pt" "$OUT/drafter-last.pt" \
    "$OUT/headline.json" "$OUT/distill-greedy.en.xz" "$OUT/feature-drafter-best.pt" \
    "$OUT/bench-feature-trained.json"
exec > >(tee "$OUT/gpu_check.log") 2>&1
WORK=$(mktemp -d)
STEPS=()  # "name status seconds" per step, for the JSON

echo "gpu_check $MODE: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [[ $MODE == gpu ]]; then
    # the carried wheels, --no-deps: two versions of a package would stop the whole install
    "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/wheels/*.whl || { echo "gpu_check: installing $CARRY/wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    # the same wheels checked against the GPU machine's Python (cp312) without installing them
    "$PY" -m pip install -q --dry-run --no-index --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --target "$WORK/site" \
        "$CARRY"/wheels/*.whl || { echo "gpu_check: $CARRY/wheels do not install on cp312"; exit 1; }
    echo "wheels: $(ls "$CARRY"/wheels | tr '\n' ' ')"
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi || echo "nvidia-smi: none here"
"$PY" -c 'import torch, fairseq; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "available", torch.cuda.is_available(), "fairseq", fairseq.__version__)' ||
    { echo "gpu_check: torch or fairseq does not import"; exit 1; }

GPU_STEPS=${GPU_STEPS:-tests syncs cost bench sizes distill feature train}
if [[ ! -f $FEATURE_CARRIED ]]; then
    [[ " $GPU_STEPS " == *" feature "* ]] &&
        echo "gpu_check: no feature step: $FEATURE_CARRIED is missing (FEATURE_DRAFTER=... --prepare)"
    GPU_STEPS=${GPU_STEPS//feature/}
fi
if [[ ! -f $DISTILL_SOURCE ]]; then
    [[ " $GPU_STEPS " == *" distill "* && ! -d $DRAFTER_DATA ]] &&
        echo "gpu_check: no distill step: $DISTILL_SOURCE is missing (--prepare)"
    GPU_STEPS=${GPU_STEPS//distill/}
fi
if [[ ! -d $DRAFTER_DATA && " $GPU_STEPS " != *" distill "* ]]; then
    [[ " $GPU_STEPS " == *" train "* ]] &&
        echo "gpu_check: no train step: $DRAFTER_DATA is missing (--prepare DRAFTER_DATA_BIN)" \
            "and no distill step translates the training sources"
    GPU_STEPS=${GPU_STEPS//train/}
fi
# seconds kept for the train step while the steps before it run
KEEP_S=0
[[ " $GPU_STEPS " == *" train "* ]] && KEEP_S=$TRAIN_S
# fairseq stops training this long before the train step's limit, then validates, saves, exports
TRAIN_MARGIN_S=$([[ $MODE == gpu ]] && echo 90 || echo 0)

# each step's weight: about the seconds it takes on an H200 (runs 4 and 5); a step gets its
# weight's share of the seconds left, against the weights of the steps after it (LATER_WEIGHT)
declare -A WEIGHT=([tests]=90 [syncs]=25 [cost]=40 [bench]=240 [sizes]=70
                   [distill]=60 [feature]=60 [train]=200)
((KEEP_S > 0)) && WEIGHT[train]=0  # its seconds are kept: the shares are of the others'
step() {  # step NAME WEIGHT CAP COMMAND...: WEIGHT / (WEIGHT + LATER_WEIGHT) of the seconds left,
    # and at most CAP if > 0
    local name=$1 weight=$2 cap=$3 left limit start status
    shift 3
    left=$((BUDGET_S - SECONDS - KEEP_S))
    limit=$((left * weight / (weight + LATER_WEIGHT)))
    ((cap > 0 && cap < limit)) && limit=$cap
    echo "=== $name (at most ${limit} s of ${left} s left) ==="
    if ((limit < 10)); then
        STEPS+=("$name skipped 0")
        echo "=== $name: skipped, no time left ==="
        return
    fi
    start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    status=$?
    ((status == 124 || status == 137)) && status=timeout
    STEPS+=("$name $status $((SECONDS - start))")
    echo "=== $name: $status after $((SECONDS - start)) s ==="
}

run_tests() {
    step tests "${WEIGHT[tests]}" 0 env SPEC_NMT_TEST_DEVICE=$DEVICE SPEC_NMT_TEST_SOURCE=$CARRY/data/test.de \
        SPEC_NMT_TEST_LINES=$TEST_LINES SPEC_NMT_TEST_SAMPLES=$TEST_SAMPLES "$PY" -m pytest -q \
        -p no:cacheprovider -p no:xdist -rfE --durations=10 --junitxml="$OUT/tests.xml" \
        ${TEST_FILTER:+-k "$TEST_FILTER"} tests/test_cuda.py
}

run_syncs() {
    # where the loop makes the host wait for the GPU, counted before anything is timed
    step syncs "${WEIGHT[syncs]}" 60 "$PY" benchmarks/benchmark.py syncs "$MODEL_DIR" --src "$CARRY/data/test.de" \
        --lines "$SYNC_LINES" --batch-sizes "$SYNC_SIZES" --device "$DEVICE" --warmup-lines 1 \
        --json "$WORK/syncs.json"
}

run_bench() {
    # newstest2014, every system at every batch size in each precision: the static loop (our
    # captured greedy, the defaults, the oracle, k = 2, 5, 10, the relaxed 5:3:1) beside the
    # dynamic loop and stock fairseq greedy and beam 5; the fp32 batch-1 run writes headline.json
    local extra
    read -r -a extra <<<"${BENCH_FLAGS---beam5 --lossless-blocks 2,5,10 --top-beta 5:3:1 --no-phases}"
    local bench=(benchmarks/benchmark.py ceiling "$MODEL_DIR" --src "$CARRY/data/test.de"
                 --ref "$CARRY/data/test.en" --device "$DEVICE" --warmup-lines "$WARMUP_LINES"
                 "${extra[@]}")
    local runs=("fp32 1 $BATCH1_LINES" "fp32 $BATCHED_SIZES $BATCHED_LINES"
                "fp16 1 $(((BATCH1_LINES + 2) / 3))")
    local index precision sizes lines name headline later=$LATER_WEIGHT
    # BENCH_RUNS="PRECISION SIZES LINES;...": these runs instead, in this order
    [[ -n ${BENCH_RUNS:-} ]] && IFS=';' read -r -a runs <<<"$BENCH_RUNS"
    for index in "${!runs[@]}"; do
        read -r precision sizes lines <<<"${runs[$index]}"
        name="bench-$precision-batch-${sizes//,/-}"
        headline=()
        [[ $precision == fp32 && $sizes == 1 ]] && headline=(--headline "$OUT/headline.json")
        # the bench weight split evenly between its runs; the runs after this one wait too
        LATER_WEIGHT=$((later + (${#runs[@]} - index - 1) * ${WEIGHT[bench]} / ${#runs[@]})) \
            step "$name" $((${WEIGHT[bench]} / ${#runs[@]})) 0 "$PY" "${bench[@]}" \
            --lines "$lines" --batch-sizes "$sizes" $([[ $precision == fp16 ]] && echo --fp16) \
            "${headline[@]}" --json "$WORK/$name.json"
    done
}

run_cost() {
    # where the static loop's time goes at batch 1: iterations timed alone, per-sentence work,
    # the device's work of eager iterations by operation (no drafts, the oracle, k = 3, 5, 10)
    step cost "${WEIGHT[cost]}" 0 "$PY" benchmarks/benchmark.py static-cost "$MODEL_DIR" \
        --src "$CARRY/data/test.de" --lines "$COST_LINES" --device "$DEVICE" --blocks 3,5,10 \
        --warmup-lines 2 --json "$WORK/static-cost.json"
}

run_sizes() {
    # speed by verifier size (bundled, random transformer-base and -big), accepted drafts and
    # batch size
    step sizes "${WEIGHT[sizes]}" 0 "$PY" benchmarks/benchmark.py sizes "$MODEL_DIR" --src "$CARRY/data/test.de" \
        --device "$DEVICE" --lines "$SIZE_LINES" --batch-sizes "$SIZE_BATCHES" \
        --output-length "$SIZE_LENGTH" --warmup-lines 1 --json "$WORK/sizes.json"
}

run_distill() {
    # the verifier's greedy translation of every training source (the static loop at batch 128,
    # in input order), for the drafter's on-policy training; what a timeout leaves is kept
    xz -dc "$DISTILL_SOURCE" >"$WORK/distill.de" || return
    ((DISTILL_LINES > 0)) && { head -n "$DISTILL_LINES" "$WORK/distill.de" >"$WORK/head.de";
                               mv "$WORK/head.de" "$WORK/distill.de"; }
    step distill "${WEIGHT[distill]}" 0 bash -c 'exec "$@" >"$0"' "$WORK/distill.en" \
        "$PY" -c 'from spec_nmt.cli import main; main()' "$MODEL_DIR" --input "$WORK/distill.de" \
        --batch-size 128 --buffer-size 4096 --no-split-sentences --block-size 0 --quiet
    echo "distill: $(wc -l <"$WORK/distill.en" 2>/dev/null || echo 0) of $(wc -l <"$WORK/distill.de") lines"
    xz -T0 -6 <"$WORK/distill.en" >"$OUT/distill-greedy.en.xz" 2>/dev/null
}

run_feature() {
    # the feature drafter (one drafter call per draft) against the bundled drafter's rows of
    # the bench step, fp32, at batch 1 and 8; before bench, whose last run takes what is left
    step bench-feature "${WEIGHT[feature]}" 90 "$PY" benchmarks/benchmark.py ceiling "$MODEL_DIR" \
        --drafter-path "$FEATURE_CARRIED" --src "$CARRY/data/test.de" --ref "$CARRY/data/test.en" \
        --device "$DEVICE" --warmup-lines "$WARMUP_LINES" --lossless-blocks 5 \
        --draft-stops 10:0.6 --top-beta 8:3:1 --lines "$BATCH1_LINES" --batch-sizes 1,8 \
        --json "$WORK/bench-feature.json"
}

run_train() {
    local seconds=$((BUDGET_S - SECONDS))  # all that is left: TRAIN_S was only kept for it
    KEEP_S=0
    if ((seconds < TRAIN_MARGIN_S + 60)); then  # fairseq stops TRAIN_MARGIN_S before the limit
        echo "=== train: skipped, ${seconds} s left (GPU_STEPS=\"distill train\" trains longer) ==="
        STEPS+=("train skipped 0")
        return
    fi
    export WORK OUT PY TRAIN_MARGIN_S FEATURE_BENCH_LINES
    # the last step, with all that is left (its weight only shares out the steps before it)
    step train 1 "$seconds" "$SELF" --train-drafter "$seconds" "$DEVICE"
}

read -r -a ORDER <<<"$GPU_STEPS"
for index in "${!ORDER[@]}"; do
    name=${ORDER[$index]}
    LATER_WEIGHT=0  # the steps after this one, whose time a step leaves them
    for later_step in "${ORDER[@]:index+1}"; do
        LATER_WEIGHT=$((LATER_WEIGHT + ${WEIGHT[$later_step]:-0}))
    done
    case $name in
    tests | syncs | cost | bench | sizes | distill | feature | train) "run_$name" ;;
    *) echo "gpu_check: unknown step $name in GPU_STEPS (tests, syncs, cost, bench, sizes, distill, feature, train)" ;;
    esac
done

# one JSON: the steps' outcomes, the tests' counts and failures, every benchmark row
printf '%s\n' "${STEPS[@]}" >"$WORK/steps.txt"
"$PY" - "$WORK" "$OUT" "$MODE" <<'EOF'
import json, subprocess, sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

work, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True) if mode == "gpu" else None
summary = {"mode": mode, "gpu": smi.stdout.strip() if smi else None, "steps": [], "tests": None,
           "syncs": None, "benchmarks": {}, "training": None}
for line in filter(None, (work / "steps.txt").read_text().splitlines()):  # none: no step ran
    name, status, seconds = line.split()
    summary["steps"].append({"step": name, "status": status, "seconds": int(seconds)})
if (out / "tests.xml").exists():
    suite = ElementTree.parse(out / "tests.xml").getroot().find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary["tests"] = dict(counts, failed=failed, seconds=float(suite.get("time", 0)))
if (work / "syncs.json").exists():
    summary["syncs"] = json.loads((work / "syncs.json").read_text())
for path in sorted([*work.glob("bench-*.json"), *out.glob("bench-feature-trained.json")]):
    summary["benchmarks"][path.stem] = json.loads(path.read_text())
if (work / "sizes.json").exists():
    summary["sizes"] = json.loads((work / "sizes.json").read_text())
if (work / "static-cost.json").exists():
    summary["static_cost"] = json.loads((work / "static-cost.json").read_text())
if (out / "train_drafter.log").exists():
    sys.path.insert(0, "scripts")
    from learning_curve import validations  # the model cards' reader of fairseq-train logs

    summary["training"] = [
        dict(epoch=epoch, num_updates=update,
             **{key: float(fields[key]) for key in ("loss", "accepted_lossless") if key in fields})
        for update, (epoch, fields) in validations([out / "train_drafter.log"])[0].items()
    ]  # fmt: skip
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")

print("=== summary ===")
for step in summary["steps"]:
    print(f"{step['step']}: {step['status']} ({step['seconds']} s)")
if summary["tests"]:
    tests = summary["tests"]
    passed = tests["tests"] - tests["failures"] - tests["errors"] - tests["skipped"]
    print(f"tests: {passed} passed, {tests['failures']} failed, {tests['errors']} errors, "
          f"{tests['skipped']} skipped; failed: {tests['failed'] or 'none'}")
if summary["syncs"]:
    print(f"host syncs ({summary['syncs']['lines']} lines, counted: {summary['syncs']['counted']}):")
    for row in summary["syncs"]["rows"]:
        print(f"  batch {row['batch_size']:>3}  {row['system']:<40} {row['syncs_per_verifier_call']:>7}"
              f" per verifier call  {row['syncs_per_output_token']:>6} per token")
for row in summary["training"] or []:
    print("drafter training: " + ", ".join(f"{key} {value:g}" for key, value in row.items()))
for row in (summary.get("static_cost") or {}).get("rows", []):
    print(f"static cost: {row['system']:<18} {row['tokens_per_iteration']:>6} tokens/iteration"
          f"  {row['ms_per_iteration']:>7} ms/iteration  {row['ms_per_sentence_outside']:>7}"
          f" ms/sentence outside  eager device {row['eager_device_ms_per_iteration']} ms/iteration")
for row in (summary.get("sizes") or {}).get("rows", []):
    print(f"sizes: {row['size']:<8} batch {row['batch_size']:>3}  {row['system']:<42}"
          f" {row['ms_per_output_token']:>8} ms/token  x{row['speedup_vs_greedy']}"
          f"  = greedy {row['identical_to_greedy']}")
for name, result in summary["benchmarks"].items():
    print(f"{name} ({result['lines']} lines, {result['environment'].get('gpu', 'cpu')}):")
    for row in result["rows"]:
        print(f"  batch {row['batch_size']:>3}  {row['system']:<40} {row['ms_per_output_token']:>8} ms/token"
              f"  x{row['speedup_vs_greedy']:<5} BLEU {row.get('bleu', '-'):<6}"
              f" = greedy {row['identical_to_greedy']}/{result['lines']}")
EOF
echo "gpu_check: done in $SECONDS s; $OUT holds $(ls "$OUT" | tr '\n' ' ')"
rm -rf "$WORK"
