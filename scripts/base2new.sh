#!/usr/bin/env bash
# Base-to-new generalisation (CoCoOp protocol; CoOp scripts/cocoop/base2new_{train,test}.sh):
# train on the base half of the classes with SHOTS shots, then evaluate the last checkpoint on
# the new half.
#
#   bash scripts/base2new.sh METHOD [DATASET|all|a,b,c] [SEEDS...] [--] [KEY VALUE ...]
#
# METHOD is a key of meta/methods.yaml with a trainer (zsclip coop gram_coop vpt gram_vpt unigram joint); seeds
# default to 1 2 3; trailing KEY VALUE pairs are passed to train.py as yacs options.  Output:
#   $OUTPUT/base2new/train_base/<dataset>/shots_<K>/<METHOD>/seed<S>/   (log gives the base accuracy)
#   $OUTPUT/base2new/test_new/<dataset>/shots_<K>/<METHOD>/seed<S>/     (log gives the new accuracy)
# zsclip evaluates both halves without training.  Tables: python scripts/parse_results.py $OUTPUT
# Environment (DATA, OUTPUT, SHOTS, EPOCHS, LOAD_EPOCH, REDO, DRY_RUN, ...): see scripts/methods.sh.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/methods.sh"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2; exit 2; }
gram_setup_env || exit 2
gram_parse_args yes "$@" || usage
cd "$GRAM_REPO" || exit 2
CFG_FILE="$(gram_config_file "$METHOD")" || exit 2
mapfile -t BENCHMARKS < <(gram_dataset_group BENCHMARK_KEYS) && [[ ${#BENCHMARKS[@]} -gt 0 ]] || exit 2
mapfile -t DATASETS < <(gram_expand_datasets "$DATASET_ARG" "${BENCHMARKS[@]}")

for DATASET in "${DATASETS[@]}"; do
    DS_CFG="$(gram_dataset_config "$DATASET")" || { GRAM_FAILED=1; continue; }
    for SEED in "${SEEDS[@]}"; do
        COMMON="$DATASET/shots_$SHOTS/$METHOD/seed$SEED"
        TRAIN_DIR="$OUTPUT/base2new/train_base/$COMMON"
        TEST_DIR="$OUTPUT/base2new/test_new/$COMMON"
        BASE_ARGS=(--root "$DATA" --seed "$SEED" --trainer "$TRAINER"
            --dataset-config-file "$DS_CFG" --config-file "$CFG_FILE")
        if method_is_zero_shot; then
            gram_run eval "$TRAIN_DIR" "${BASE_ARGS[@]}" --output-dir "$TRAIN_DIR" --eval-only \
                DATASET.NUM_SHOTS "$SHOTS" DATASET.SUBSAMPLE_CLASSES base "${OPTS[@]}"
            gram_run eval "$TEST_DIR" "${BASE_ARGS[@]}" --output-dir "$TEST_DIR" --eval-only \
                DATASET.NUM_SHOTS "$SHOTS" DATASET.SUBSAMPLE_CLASSES new "${OPTS[@]}"
            continue
        fi
        EPOCH_OPTS=()
        [[ -n "${EPOCHS:-}" ]] && EPOCH_OPTS=(OPTIM.MAX_EPOCH "$EPOCHS")
        gram_run train "$TRAIN_DIR" "${BASE_ARGS[@]}" --output-dir "$TRAIN_DIR" \
            DATASET.NUM_SHOTS "$SHOTS" DATASET.SUBSAMPLE_CLASSES base "${EPOCH_OPTS[@]}" "${OPTS[@]}" || continue
        LOADEP="$(gram_load_epoch_or_placeholder "$TRAIN_DIR")" || { GRAM_FAILED=1; continue; }
        gram_run eval "$TEST_DIR" "${BASE_ARGS[@]}" --output-dir "$TEST_DIR" \
            --model-dir "$TRAIN_DIR" --load-epoch "$LOADEP" --eval-only \
            DATASET.NUM_SHOTS "$SHOTS" DATASET.SUBSAMPLE_CLASSES new "${OPTS[@]}"
    done
done
exit "$GRAM_FAILED"
