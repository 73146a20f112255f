#!/usr/bin/env bash
# The main job (README): set up .venv, then run GRAM end to end in the CPU world.
#   bash scripts/demo.sh           # default world, 3 seeds  -> output/demo/results.md
#   bash scripts/demo.sh --quick   # tiny world, 1 seed      -> output/demo_quick/results.md
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$ROOT/.venv/bin/python" -m meta.demo "$@"
