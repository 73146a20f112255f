#!/usr/bin/env bash
# The project's test command (README, CI): set up .venv, check format and lint (ruff, ruff.toml), then run
# pytest with one OpenMP thread per process and GRAM_TEST_WORKERS pytest-xdist workers (default 2; 0 = no xdist).
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
# house style first: a formatting or lint error stops the run in seconds (ruff format .; ruff check --fix . mend most)
"$ROOT/.venv/bin/ruff" format --check --quiet . || { echo "error: ruff format: files above need 'ruff format .'" >&2; exit 1; }
"$ROOT/.venv/bin/ruff" check --quiet . || { echo "error: ruff check: lint errors above" >&2; exit 1; }
workers="${GRAM_TEST_WORKERS:-2}"
xdist=()
[[ "$workers" != 0 ]] && xdist=(-n "$workers")
# --durations: the slowest tests in every CI log, so the suite's time can be kept in view
exec "$ROOT/.venv/bin/python" -m pytest -q --durations=15 "${xdist[@]}" "${args[@]}" tests
