#!/usr/bin/env bash
# The accelerator check, one command on a machine with a CUDA GPU:
#   bash scripts/gpu_check.sh [output folder, default output/gpu_check]
# 1. the gpu-marked tests (autocast meta-gradients vs fp32, the fp16 GradScaler step, CHC features under
#    autocast, the Dassl trainers' PREC fp16 / amp paths);
# 2. python -m gram_tools.bench --device cuda in fp32 and under bf16 autocast (whole outer steps of CoOp, VPT
#    and UNIGRAM at the default meta-training task size, peak GPU memory, CHC images per second);
# 3. the figures file the planner reads: docs/gpu_figures.json (fp32) and docs/gpu_figures_bf16.json
#    (python -m gram_tools.plan reads it for a config with META.AUTOCAST bf16); FIGURES_DIR overrides docs.
#    The bf16 run also writes the sequential vs task-batched table (1 / 4 / 16 tasks), each step's achieved
#    TFLOP/s against a bf16 matmul measured in the same run, and CHC images/s by batch size.
# 4. python -m gram_tools.profile_gpu --bf16-weights: JPEG decoding and CHC's image stage end to end (decode
#    included) at CC3M's typical size, the stacked VPT/UNIGRAM steps under the profiler with and without
#    META.SUPPORT_ATTENTION_LOWP and with bf16 weights, their matmul fractions and 16- over 4-task times;
#    <out>/profile.json, copied to $FIG/gpu_profile.json (PROFILE=0 leaves it out).
# 5. with REHEARSAL=1, then scripts/gpu_rehearsal.sh (the user's whole path at real size, ~8 min): on the device
#    machine, whose calls stop at 10 min, run it as a second call instead (docs/task_batching.md).
# Without CUDA it stops at once with one line on stderr (exit 2).  PYTHON overrides the interpreter
# (default: .venv/bin/python when it exists, else python).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-output/gpu_check}"
SCRIPT=scripts/gpu_check.sh
# shellcheck source=scripts/gpu_common.sh
source "$ROOT/scripts/gpu_common.sh"
mkdir -p "$OUT" "$FIG"
"$PY" -m pytest -q -rs -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log"
for mode in none bf16; do
  # the 1/4/16-task table and the CHC batch sweep once, under bf16 (the rehearsal's precision)
  extra=(--scaling-tasks "" --chc-batches "")
  [[ "$mode" == bf16 ]] && extra=()
  "$PY" -m gram_tools.bench --device cuda --autocast "$mode" "${extra[@]}" 2>&1 | tee "$OUT/bench_cuda_$mode.log"
  tail -n 1 "$OUT/bench_cuda_$mode.log" > "$OUT/bench_cuda_$mode.json"
  "$PY" -c "import json, sys; json.load(open(sys.argv[1]))" "$OUT/bench_cuda_$mode.json" \
    || { echo "error: scripts/gpu_check.sh: the bench's last line is not JSON ($OUT/bench_cuda_$mode.log)" >&2; exit 1; }
done
cp "$OUT/bench_cuda_none.json" "$FIG/gpu_figures.json"
cp "$OUT/bench_cuda_bf16.json" "$FIG/gpu_figures_bf16.json"
if [[ "${PROFILE:-1}" == 1 ]]; then
  "$PY" -m gram_tools.profile_gpu --bf16-weights --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log"
  cp "$OUT/profile.json" "$FIG/gpu_profile.json"
  echo "wrote $FIG/gpu_profile.json"
fi
echo "wrote $FIG/gpu_figures.json (fp32) and $FIG/gpu_figures_bf16.json (bf16); plan with:"
echo "  $PY -m gram_tools.plan --config-file configs/meta/train_unigram.yaml --gpus 1"
if [[ "${REHEARSAL:-0}" == 1 ]]; then
  PYTHON="$PY" FIGURES_DIR="$FIG" bash scripts/gpu_rehearsal.sh "$OUT/rehearsal"
fi
