#!/usr/bin/env bash
# On the device machine (bare, offline, Python 3.12 with torch): install what scripts/device_wheels.sh put in
# <folder> (default .whl) into /tmp/site and write the fp32 caption model to /tmp/minilm.  Source it, so that
# PYTHONPATH and GRAM_TEXT_MODEL reach the caller:
#   source scripts/device_install.sh [.whl]
WHL="${1:-.whl}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHL"/*.whl || return 1
export PYTHONPATH="/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
python3 - "$WHL/minilm" /tmp/minilm <<'PY' || return 1
import sys
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(sys.argv[1], device="cpu")
model.float()
model.save(sys.argv[2], safe_serialization=True)
PY
export GRAM_TEXT_MODEL=/tmp/minilm HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
