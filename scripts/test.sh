#!/usr/bin/env bash
# The project's test command (README, CI): set up .venv, then run pytest on one thread.
# Usage: bash scripts/test.sh [--fast] [pytest options]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# --fast: the developer tier, without tests marked slow or statistical (pytest.ini); CI runs everything
args=()
for a in "$@"; do
  if [[ "$a" == "--fast" ]]; then args+=(-m "not slow and not statistical"); else args+=("$a"); fi
done
exec "$ROOT/.venv/bin/python" -m pytest -q "${args[@]}" tests
