#!/usr/bin/env bash
# Cross-domain generalisation: train on all ImageNet classes with SHOTS shots (default 16),
# evaluate on ImageNetV2, ImageNet-Sketch, ImageNet-A and ImageNet-R.
#
#   bash scripts/xdomain.sh METHOD [SEEDS...] [--] [KEY VALUE ...]
#
# Output: $OUTPUT/xd/train_imagenet/shots_<K>/<METHOD>/seed<S>/ (shared with xd.sh) and
#         $OUTPUT/xdomain/test/<target>/shots_<K>/<METHOD>/seed<S>/.
# SHOTS=4 gives the 4-shot variant (paper Table A1, label ap_t1).  Environment: see scripts/methods.sh.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/methods.sh"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2; exit 2; }
gram_setup_env || exit 2
gram_parse_args no "$@" || usage
cd "$GRAM_REPO" || exit 2
CFG_FILE="$(gram_config_file "$METHOD")" || exit 2
mapfile -t TARGETS < <(gram_dataset_group CROSS_DOMAIN_TARGETS) && [[ ${#TARGETS[@]} -gt 0 ]] || exit 2
gram_imagenet_transfer xdomain/test "${TARGETS[@]}"
exit "$GRAM_FAILED"
