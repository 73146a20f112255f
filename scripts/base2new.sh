#!/usr/bin/env bash
# Base-to-new generalisation (CoCoOp protocol; CoOp scripts/cocoop/base2new_{train,test}.sh):
# train on the base half of the classes with SHOTS shots, then evaluate the last checkpoint on
# the new half.
#
#   bash scripts/base2new.sh METHOD [DATASET|all|a,b,c] [SEEDS...] [--] [KEY VALUE ...]
#
# METHOD is a key of meta/method/methods.yaml with a trainer (`bash scripts/methods.sh` lists them: zsclip coop gram_coop
# gram_coop_init_only vpt ...; the *_init_only keys start from θ* with raw gradients, README's advice); seeds
# default to 1 2 3; trailing KEY VALUE pairs are passed to train.py as yacs options.  Output:
#   $OUTPUT/base2new/train_base/<dataset>/shots_<K>/<METHOD>/seed<S>/   (log gives the base accuracy)
#   $OUTPUT/base2new/test_new/<dataset>/shots_<K>/<METHOD>/seed<S>/     (log gives the new accuracy)
# zsclip evaluates both halves without training.  Tables: python scripts/parse_results.py $OUTPUT
# The GRAM rows read INIT=<gram_init.safetensors> (python -m meta export writes it; a placeholder for wiring checks:
# python -m gram_tools.smoke --write-init FILE --method METHOD --model ViT-B-16); it is checked before any run.
# Environment (DATA, OUTPUT, SHOTS, EPOCHS, LOAD_EPOCH, REDO, DRY_RUN, ...): see scripts/run_methods.py.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/methods.sh"
gram_exec_runner base2new "$@"
