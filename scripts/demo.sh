#!/usr/bin/env bash
# The main job (README): set up .venv, then run GRAM end to end in the CPU world.
#   bash scripts/demo.sh                   # default world, 3 seeds  -> output/demo/results.md
#   bash scripts/demo.sh --quick           # tiny world, 1 seed      -> output/demo_quick/results.md
#   bash scripts/demo.sh --tables all      # also Table 4, the diagnostics rows, Tables 2, 3, A1, A2, A3
#   bash scripts/demo.sh --world-seed 1    # another world (own cache, own CLIP) -> output/demo_world1/
#   other flags: --holdout-style STYLE --mixed-classes C1 C2 ... --out DIR --seeds N.. --jobs N
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$ROOT/.venv/bin/python" -m gram_world.demo "$@"
