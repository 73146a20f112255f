#!/usr/bin/env bash
# Cross-dataset transfer (CoOp scripts/cocoop/xd_{train,test}.sh): train on all 1000 ImageNet
# classes with SHOTS shots (default 16), evaluate on the 10 other benchmarks.
#
#   bash scripts/xd.sh METHOD [SEEDS...] [--] [KEY VALUE ...]
#
# Output: $OUTPUT/xd/train_imagenet/shots_<K>/<METHOD>/seed<S>/ (shared with xdomain.sh) and
#         $OUTPUT/xd/test/<target>/shots_<K>/<METHOD>/seed<S>/.
# SHOTS=4 gives the 4-shot variant (paper Table A2, label ap_t2).  Environment: see scripts/run_methods.py.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/methods.sh"
gram_exec_runner xd "$@"
