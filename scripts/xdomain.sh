#!/usr/bin/env bash
# Cross-domain generalisation: train on all ImageNet classes with SHOTS shots (default 16),
# evaluate on ImageNetV2, ImageNet-Sketch, ImageNet-A and ImageNet-R.
#
#   bash scripts/xdomain.sh METHOD [SEEDS...] [--] [KEY VALUE ...]
#
# Output: $OUTPUT/xd/train_imagenet/shots_<K>/<METHOD>/seed<S>/ (shared with xd.sh) and
#         $OUTPUT/xdomain/test/<target>/shots_<K>/<METHOD>/seed<S>/.
# SHOTS=4 gives the 4-shot variant (paper Table A1, label ap_t1).  Environment: see scripts/run_methods.py.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/methods.sh"
gram_exec_runner xdomain "$@"
