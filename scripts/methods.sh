#!/usr/bin/env bash
# Method table and shared run helpers of the benchmark scripts (sourced by base2new.sh, xd.sh,
# xdomain.sh).  `bash scripts/methods.sh` prints the table.
#
# A method key names a row of the method table meta/methods.yaml (`python -m meta.methods` prints it):
# its Dassl trainer, its config (configs/trainers/<key>.yaml), whether it starts from a meta-learned
# init and whether it is zero-shot (evaluation only).
#
# Conventions follow CoOp's scripts/cocoop/*.sh (KaiyangZhou/CoOp @ ff61507): `python train.py
# --root --seed --trainer --dataset-config-file --config-file --output-dir [--model-dir
# --load-epoch --eval-only] KEY VALUE...`, one output folder per seed, and an existing result is
# skipped.  Unlike CoOp, every output folder gets `gram_run.txt` holding a SHA-256 of the resolved
# arguments and config contents and the id of the process running it; a folder is skipped only when
# that hash matches and its log is finished.  A run with the same hash whose process is gone without
# a finished log (it crashed or was killed) is moved aside to `<dir>.crashed-<time>` and run again.
# A folder with another hash or no gram_run.txt is refused with a message (REDO=1 moves it aside to
# `<dir>.old-<time>` and runs again).  train.py's stderr is kept in `<dir>/stderr.txt`.
#
# Environment: DATA (dataset root, default $REPO/data), OUTPUT (output root, default
# $REPO/output), SHOTS (default 16), EPOCHS (sets OPTIM.MAX_EPOCH and the epoch loaded for
# evaluation), LOAD_EPOCH (epoch to evaluate; default EPOCHS, else read from the checkpoints),
# PYTHON (default: the project's .venv/bin/python when it exists, else python3), TRAIN_PY (default $REPO/train.py), CONFIGS (default $REPO/configs),
# INIT (meta-learned init file for gram_coop/gram_vpt/unigram: adds TRAINER.GRAM.INIT <abs path>),
# REDO=1 (redo refused jobs), DRY_RUN=1 (print commands only).

GRAM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# gram_dataset_group NAME -> config keys of a dataset group of meta.coop_data (the one dataset list),
# one per line: BENCHMARK_KEYS (base-to-new), CROSS_DATASET_TARGETS (xd.sh), CROSS_DOMAIN_TARGETS (xdomain.sh)
gram_dataset_group() {
    (cd "$GRAM_REPO" && "$PYTHON" -c "import sys; from meta import coop_data; print('\n'.join(getattr(coop_data, sys.argv[1])))" "$1")
}

# gram_method_table ARGS... : `python -m meta.methods ARGS...` (the method table) from the repository root
gram_method_table() { (cd "$GRAM_REPO" && "$PYTHON" -m meta.methods "$@"); }

# method_row KEY -> sets TRAINER, METHOD_INIT, METHOD_ZERO_SHOT from the table (status 1 with its
# one-line message for an unknown key or a method without a Dassl trainer)
method_row() {
    local trainer init zs
    trainer="$(gram_method_table get "$1" trainer)" || return 1
    if [[ -z "$trainer" ]]; then
        echo "method '$1' has no Dassl trainer: expected one of $(gram_method_table keys --dassl)" >&2
        return 1
    fi
    init="$(gram_method_table get "$1" init)" || return 1
    zs="$(gram_method_table get "$1" zero_shot)" || return 1
    TRAINER="$trainer" METHOD_INIT="$init" METHOD_ZERO_SHOT="$zs"
}

# method_is_zero_shot -> status 0 when the current METHOD is evaluated without training
method_is_zero_shot() { [[ "$METHOD_ZERO_SHOT" == true ]]; }

# method_uses_init -> status 0 when the current METHOD starts from a meta-learned init
method_uses_init() { [[ "$METHOD_INIT" == true ]]; }

gram_setup_env() {
    DATA="${DATA:-$GRAM_REPO/data}"
    OUTPUT="${OUTPUT:-$GRAM_REPO/output}"
    SHOTS="${SHOTS:-16}"
    if [[ -z "${PYTHON:-}" ]]; then # the interpreter scripts/setup.sh built (torch, meta, Dassl), not PATH's
        if [[ -x "$GRAM_REPO/.venv/bin/python" ]]; then PYTHON="$GRAM_REPO/.venv/bin/python"; else PYTHON=python3; fi
    fi
    TRAIN_PY="${TRAIN_PY:-$GRAM_REPO/train.py}"
    CONFIGS="${CONFIGS:-$GRAM_REPO/configs}"
    GRAM_FAILED=0
    if [[ -n "${EPOCHS:-}" && ! "$EPOCHS" =~ ^[0-9]+$ ]]; then
        echo "EPOCHS must be a positive integer, got '$EPOCHS'" >&2
        return 1
    fi
}

# gram_parse_args METHOD [DATASETS] [SEEDS...] [--] [KEY VALUE...]
# Sets METHOD, TRAINER, DATASET_ARG, SEEDS (array, default 1 2 3), OPTS (array).
gram_parse_args() {
    local want_dataset="$1"
    shift
    if [[ $# -lt 1 ]]; then
        return 2
    fi
    METHOD="$1"
    shift
    method_row "$METHOD" || return 1
    DATASET_ARG=""
    if [[ "$want_dataset" == yes && $# -gt 0 && "$1" != "--" && ! "$1" =~ ^[0-9]+$ && ! "$1" =~ ^[A-Z_]+\. ]]; then
        DATASET_ARG="$1"
        shift
    fi
    SEEDS=()
    while [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; do
        SEEDS+=("$1")
        shift
    done
    [[ ${#SEEDS[@]} -eq 0 ]] && SEEDS=(1 2 3)
    [[ $# -gt 0 && "$1" == "--" ]] && shift
    OPTS=("$@")
    if (( ${#OPTS[@]} % 2 != 0 )); then
        echo "extra options must be yacs KEY VALUE pairs, got an odd count: ${OPTS[*]}" >&2
        return 1
    fi
    if [[ -n "${INIT:-}" ]]; then # the init file's content enters the run hash (gram_run_hash hashes file args)
        if ! method_uses_init; then
            echo "Warning: INIT is ignored for method '$METHOD' (GRAM off)" >&2
        elif [[ ! -f "$INIT" ]]; then
            echo "INIT file not found: $INIT" >&2
            return 1
        else
            OPTS+=(TRAINER.GRAM.INIT "$(cd "$(dirname "$INIT")" && pwd)/$(basename "$INIT")")
        fi
    fi
}

gram_config_file() { # KEY -> path of configs/trainers/<key>.yaml, checked
    local f="$CONFIGS/trainers/$1.yaml"
    if [[ ! -f "$f" ]]; then
        echo "missing trainer config $f (method '$1')" >&2
        return 1
    fi
    echo "$f"
}

gram_dataset_config() { # NAME -> path of configs/datasets/<name>.yaml, checked
    local f="$CONFIGS/datasets/$1.yaml"
    if [[ ! -f "$f" ]]; then
        echo "unknown dataset '$1': missing $f" >&2
        return 1
    fi
    echo "$f"
}

# gram_run_hash MODE ARGS... -> SHA-256 over the arguments that define a result: everything but
# --root/--output-dir values, plus the contents of the config files and the hash of --model-dir's run.
gram_run_hash() {
    local mode="$1"
    shift
    {
        echo "mode $mode"
        local skip="" a
        for a in "$@"; do
            if [[ -n "$skip" ]]; then
                skip=""
                continue
            fi
            case "$a" in
                --root | --output-dir)
                    skip=1
                    continue
                    ;;
            esac
            echo "arg $a"
            if [[ -f "$a" ]]; then
                echo "file-sha256 $(sha256sum "$a" | cut -d' ' -f1)"
            elif [[ -f "$a/gram_run.txt" ]]; then
                echo "model-run $(sed -n 's/^hash //p' "$a/gram_run.txt")"
            fi
        done
    } | sha256sum | cut -d' ' -f1
}

# gram_log_finished DIR MODE -> status 0 when DIR/log.txt shows the end of the run
# (train: Dassl's "Finish training" then "=> result"; eval: "=> result").
gram_log_finished() {
    local log="$1/log.txt"
    [[ -f "$log" ]] || return 1
    if [[ "$2" == train ]]; then
        awk '/Finish training/{f=1} f && /=> result/{r=1} END{exit !r}' "$log"
    else
        grep -q "=> result" "$log"
    fi
}

# gram_load_epoch MODEL_DIR -> epoch to evaluate: LOAD_EPOCH, EPOCHS, else the last checkpoint.
gram_load_epoch() {
    if [[ -n "${LOAD_EPOCH:-}" ]]; then
        echo "$LOAD_EPOCH"
        return 0
    fi
    if [[ -n "${EPOCHS:-}" ]]; then
        echo "$EPOCHS"
        return 0
    fi
    local f ep best=""
    for f in "$1"/*/checkpoint; do # Dassl's save_checkpoint: "<dir>/<name>/checkpoint" holds "model.pth.tar-<E>"
        [[ -f "$f" ]] || continue
        ep="$(sed -n 's/.*model\.pth\.tar-\([0-9][0-9]*\).*/\1/p' "$f" | head -n1)"
        [[ -n "$ep" && ( -z "$best" || "$ep" -gt "$best" ) ]] && best="$ep"
    done
    if [[ -z "$best" ]]; then
        for f in "$1"/*/model.pth.tar-*; do
            [[ -f "$f" ]] || continue
            ep="${f##*-}"
            [[ "$ep" =~ ^[0-9]+$ && ( -z "$best" || "$ep" -gt "$best" ) ]] && best="$ep"
        done
    fi
    if [[ -z "$best" ]]; then
        echo "no checkpoint found under $1 and neither LOAD_EPOCH nor EPOCHS is set" >&2
        return 1
    fi
    echo "$best"
}

# gram_load_epoch_or_placeholder MODEL_DIR -> gram_load_epoch, or a placeholder under DRY_RUN=1
# (nothing was trained, so there is no checkpoint to read).
gram_load_epoch_or_placeholder() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        echo "${LOAD_EPOCH:-${EPOCHS:-LAST}}"
    else
        gram_load_epoch "$1"
    fi
}

# gram_imagenet_transfer SUBDIR TARGET... : train METHOD on all ImageNet classes with SHOTS shots
# (shared by xd.sh and xdomain.sh: $OUTPUT/xd/train_imagenet/shots_<K>/<METHOD>/seed<S>/), then
# evaluate it on every TARGET into $OUTPUT/SUBDIR/<target>/shots_<K>/<METHOD>/seed<S>/.
# Protocol: CoOp scripts/cocoop/xd_{train,test}.sh (targets use all their classes, no shots).
gram_imagenet_transfer() {
    local subdir="$1"
    shift
    local src_cfg target seed train_dir test_dir loadep
    src_cfg="$(gram_dataset_config imagenet)" || return 1
    for seed in "${SEEDS[@]}"; do
        train_dir="$OUTPUT/xd/train_imagenet/shots_$SHOTS/$METHOD/seed$seed"
        local base_args=(--root "$DATA" --seed "$seed" --trainer "$TRAINER" --config-file "$CFG_FILE")
        local model_args=()
        if method_is_zero_shot; then
            gram_run eval "$train_dir" "${base_args[@]}" --dataset-config-file "$src_cfg" \
                --output-dir "$train_dir" --eval-only "${OPTS[@]}"
        else
            local epoch_opts=()
            [[ -n "${EPOCHS:-}" ]] && epoch_opts=(OPTIM.MAX_EPOCH "$EPOCHS")
            gram_run train "$train_dir" "${base_args[@]}" --dataset-config-file "$src_cfg" \
                --output-dir "$train_dir" DATASET.NUM_SHOTS "$SHOTS" "${epoch_opts[@]}" "${OPTS[@]}" || continue
            loadep="$(gram_load_epoch_or_placeholder "$train_dir")" || { GRAM_FAILED=1; continue; }
            model_args=(--model-dir "$train_dir" --load-epoch "$loadep")
        fi
        for target in "$@"; do
            local ds_cfg
            ds_cfg="$(gram_dataset_config "$target")" || { GRAM_FAILED=1; continue; }
            test_dir="$OUTPUT/$subdir/$target/shots_$SHOTS/$METHOD/seed$seed"
            gram_run eval "$test_dir" "${base_args[@]}" --dataset-config-file "$ds_cfg" \
                --output-dir "$test_dir" "${model_args[@]}" --eval-only "${OPTS[@]}"
        done
    done
}

# gram_pid_alive PID -> status 0 when PID is a live benchmark script (the one that wrote gram_run.txt)
gram_pid_alive() {
    [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null && ps -o args= -p "$1" 2>/dev/null | grep -q 'scripts/'
}

# gram_run MODE DIR ARGS... : run `$PYTHON $TRAIN_PY ARGS...` into DIR unless an identical finished
# run is there.  MODE is train or eval.  Returns 0 when the result is (now) present.
gram_run() {
    local mode="$1" dir="$2"
    shift 2
    local hash why=""
    hash="$(gram_run_hash "$mode" "$@")"
    if [[ -e "$dir" ]]; then
        local old=""
        [[ -f "$dir/gram_run.txt" ]] && old="$(sed -n 's/^hash //p' "$dir/gram_run.txt")"
        local oldpid=""
        [[ -f "$dir/gram_run.txt" ]] && oldpid="$(sed -n 's/^pid //p' "$dir/gram_run.txt")"
        if [[ -n "$old" && "$old" == "$hash" ]] && ! gram_log_finished "$dir" "$mode" && ! gram_pid_alive "$oldpid"; then
            local crashed
            crashed="$dir.crashed-$(date +%Y%m%d-%H%M%S)"
            echo "Rerunning $dir: its earlier run did not finish and its process is gone (moved to $crashed)"
            [[ "${DRY_RUN:-0}" == 1 ]] || mv "$dir" "$crashed"
        elif [[ -z "$old" ]]; then
            why="it has no gram_run.txt, so its configuration is unknown"
        elif [[ "$old" != "$hash" ]]; then
            why="it was run with different arguments or configs (hash ${old:0:12} != ${hash:0:12}; see $dir/gram_run.txt)"
        elif ! gram_log_finished "$dir" "$mode"; then
            why="it is still running (process $oldpid)"
        else
            echo "The results exist at $dir (same configuration, so skip this job)"
            return 0
        fi
    fi
    if [[ -n "$why" ]]; then
        if [[ "${REDO:-0}" != 1 ]]; then
            echo "Refusing to reuse $dir: $why. Rerun with REDO=1 to move it aside and redo the job." >&2
            GRAM_FAILED=1
            return 1
        fi
        local aside
        aside="$dir.old-$(date +%Y%m%d-%H%M%S)"
        echo "REDO=1: moving $dir to $aside ($why)"
        [[ "${DRY_RUN:-0}" == 1 ]] || mv "$dir" "$aside"
    fi
    echo "+ $PYTHON $TRAIN_PY $*"
    [[ "${DRY_RUN:-0}" == 1 ]] && return 0
    mkdir -p "$dir"
    {
        echo "hash $hash"
        echo "mode $mode"
        echo "pid $BASHPID"
        echo "python $PYTHON"
        echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        printf 'arg %s\n' "$@"
    } > "$dir/gram_run.txt"
    if ! (cd "$GRAM_REPO" && "$PYTHON" "$TRAIN_PY" "$@" 2> >(tee "$dir/stderr.txt" >&2)); then
        local see="$dir/stderr.txt"
        [[ -s "$dir/log.txt" ]] && see="$dir/log.txt and $see"
        echo "FAILED ($mode): $dir (see $see)" >&2
        GRAM_FAILED=1
        return 1
    fi
}

# gram_expand_datasets ARG DEFAULT... -> dataset names: ARG ("all", empty, or comma-separated)
gram_expand_datasets() {
    local arg="$1"
    shift
    if [[ -z "$arg" || "$arg" == all ]]; then
        printf '%s\n' "$@"
    else
        tr ',' '\n' <<< "$arg"
    fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    gram_setup_env && gram_method_table
fi
