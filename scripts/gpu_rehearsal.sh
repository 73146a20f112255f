#!/usr/bin/env bash
# The user's whole path at real size on one CUDA GPU, timed (gram_tools/rehearsal.py):
#   bash scripts/gpu_rehearsal.sh [output folder, default output/gpu_rehearsal]
# synthetic 224-px web-dataset shards (20k pairs) -> python -m meta cluster (ViT-B/16, random weights, on the GPU)
# -> python -m meta train (CoOp and UNIGRAM, 150 outer steps, bf16) -> python -m meta export -> train.py through
# scripts/base2new.sh (CoOp, GRAM_CoOp, joint, UNIGRAM on a synthetic 224-px dataset in CoOp's DTD layout)
# -> scripts/parse_results.py.  Writes <folder>/rehearsal.json (each stage's wall time, peak GPU memory and
# RSS; the trainers' epoch times and the ratios GRAM_CoOp / CoOp and UNIGRAM / joint) and copies it to
# docs/gpu_rehearsal.json (FIGURES_DIR overrides docs).  Sizes: python -m gram_tools.rehearsal --help.
# Without CUDA it stops at once with one line on stderr (exit 2), like scripts/gpu_check.sh.  PYTHON
# overrides the interpreter (default: .venv/bin/python when it exists, else python); GRAM_TEXT_MODEL a local
# caption-model folder.
# One device call: the rehearsal alone (target <= 8 min); scripts/gpu_check.sh is the other call
# (docs/task_batching.md, "On the device machine").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:-output/gpu_rehearsal}"
SCRIPT=scripts/gpu_rehearsal.sh
# shellcheck source=scripts/gpu_common.sh
source "$ROOT/scripts/gpu_common.sh"
mkdir -p "$FIG" "$(dirname "$OUT")"
# GRAM_TEXT_MODEL: a local caption-model folder (offline machines; scripts/device_install.sh sets it)
TEXT=()
[[ -n "${GRAM_TEXT_MODEL:-}" ]] && TEXT=(--text-model "$GRAM_TEXT_MODEL")
"$PY" -m gram_tools.rehearsal --out "$OUT" "${TEXT[@]}" 2>&1 | tee "$OUT.log"
cp "$OUT/rehearsal.json" "$FIG/gpu_rehearsal.json"
echo "wrote $FIG/gpu_rehearsal.json"
