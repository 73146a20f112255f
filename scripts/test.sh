#!/usr/bin/env bash
# The project's test command (README, CI): set up .venv, then run pytest on one thread.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$ROOT/.venv/bin/python" -m pytest -q "$@" tests
