#!/usr/bin/env bash
# One call on a lent device machine (bare, offline, Python 3.12 with torch; calls stop at 10 minutes):
#   bash scripts/device_run.sh OUT [rehearsal|check|profile|tests ...]   (default: tests profile)
# Installs what scripts/device_wheels.sh put in .whl (carry .whl), then runs the named parts in order, each under
# its own time cap, writing into OUT (the device tool's $OUT):
#   rehearsal  scripts/gpu_rehearsal.sh (the user's whole path; OUT/rehearsal.json, OUT/rehearsal.log,
#              OUT/rehearsal_logs.tgz with every stage's log; a call of its own)                 cap REHEARSAL_S=540
#   check      scripts/gpu_check.sh's tests and benches, not its profile (OUT/fig/gpu_figures*.json) cap CHECK_S=420
#   profile    python -m gram_tools.profile_gpu (OUT/profile.json, rewritten after each part: JPEG/CHC rates, step
#              profiles without and with META.SUPPORT_ATTENTION_LOWP, with it and META.CLOSED_FORM_LAYER_NORM,
#              with bf16 weights; matmul shares, 16 vs 4 tasks)                                  cap PROFILE_S=240
#   tests      the gpu-marked tests (OUT/pytest_gpu.txt)                                         cap TESTS_S=120
# and OUT/machine.txt (GPU, driver, CPU model, torch).  Figures land in OUT/fig (FIGURES_DIR).
# Two calls give every figure: call 1 "tests profile" (every step and CHC figure), call 2
# "rehearsal"; "check" (the bench's fp32/bf16 tables for the planner) when a third call fits.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${1:?usage: scripts/device_run.sh OUT [parts]}"
shift
PARTS=("$@")
[[ ${#PARTS[@]} -gt 0 ]] || PARTS=(tests profile)
mkdir -p "$OUT/fig"
export PYTHONUNBUFFERED=1 PYTHON=python3 FIGURES_DIR="$OUT/fig"
start=$SECONDS
# shellcheck source=scripts/device_install.sh
source scripts/device_install.sh .whl || { echo "error: scripts/device_run.sh: installing .whl failed" >&2; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  lscpu | grep -m1 'Model name'
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
echo "install: $((SECONDS - start)) s"
for part in "${PARTS[@]}"; do
  t0=$SECONDS
  case "$part" in
    rehearsal)
      timeout "${REHEARSAL_S:-540}" bash scripts/gpu_rehearsal.sh /tmp/gram_rehearsal >"$OUT/rehearsal.log" 2>&1
      echo "rehearsal exit $?"
      tail -n 25 "$OUT/rehearsal.log"
      cp /tmp/gram_rehearsal/rehearsal.json "$OUT/" 2>/dev/null
      tar -czf "$OUT/rehearsal_logs.tgz" -C /tmp/gram_rehearsal logs 2>/dev/null
      ;;
    check)
      PROFILE=0 timeout "${CHECK_S:-420}" bash scripts/gpu_check.sh /tmp/gram_check >"$OUT/check.log" 2>&1
      echo "check exit $?"
      tail -n 5 "$OUT/check.log"
      ;;
    profile)
      timeout "${PROFILE_S:-240}" python3 -m gram_tools.profile_gpu --decode-images 256 --bf16-weights --out "$OUT/profile.json" \
        >"$OUT/profile.log" 2>&1
      echo "profile exit $?"
      tail -c 1500 "$OUT/profile.log"
      echo
      ;;
    tests)
      timeout "${TESTS_S:-120}" python3 -m pytest -q -rs -m gpu tests -p no:cacheprovider >"$OUT/pytest_gpu.txt" 2>&1
      echo "tests exit $?"
      tail -n 8 "$OUT/pytest_gpu.txt"
      ;;
    *) echo "error: scripts/device_run.sh: unknown part '$part' (rehearsal|check|profile|tests)" >&2 ;;
  esac
  echo "$part: $((SECONDS - t0)) s"
done
