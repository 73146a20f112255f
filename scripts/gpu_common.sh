# Sourced by scripts/gpu_check.sh and scripts/gpu_rehearsal.sh (not run on its own): picks the interpreter
# (PYTHON, else .venv/bin/python when it exists, else python) as PY, stops with one line on stderr (exit 2)
# when torch sees no CUDA device, sets the offline hub variables and FIG (FIGURES_DIR, default docs).
# Needs: ROOT (the repository root, already the current folder) and SCRIPT (the caller's name for messages).
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python; fi
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: $SCRIPT: CUDA is not available on this machine (torch.cuda.is_available() is False with $PY)" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
FIG="${FIGURES_DIR:-docs}"
