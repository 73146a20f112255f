#!/usr/bin/env bash
# Shared by base2new.sh, xd.sh and xdomain.sh: pick the interpreter, then hand over to the Python
# runner scripts/run_methods.py (argument parsing, run hashing, skip / refuse / REDO, the method
# table meta/method/methods.yaml and the dataset lists of meta.data.coop_data live there; its docstring lists
# the environment variables).  `bash scripts/methods.sh` prints the method table.

GRAM_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# gram_setup_env -> PYTHON: as given, else the interpreter scripts/setup.sh built (torch, meta, Dassl)
# when it exists, else python3 (not PATH's python, which may lack torch)
gram_setup_env() {
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$GRAM_REPO/.venv/bin/python" ]]; then PYTHON="$GRAM_REPO/.venv/bin/python"; else PYTHON=python3; fi
    fi
    export PYTHON
}

# gram_exec_runner PROTOCOL ARGS... : replace this shell by the runner (same process id, so a run
# folder's "pid" line names a live benchmark script while it runs)
gram_exec_runner() {
    gram_setup_env
    exec "$PYTHON" "$GRAM_REPO/scripts/run_methods.py" "$@"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    gram_setup_env
    cd "$GRAM_REPO" && exec "$PYTHON" -m meta.method.methods
fi
