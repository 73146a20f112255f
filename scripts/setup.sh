#!/usr/bin/env bash
# Create or update the project's virtual environment at <repo>/.venv.
#
# Idempotent: a stamp file records a hash of the install recipe (this script and
# setup.py); when it matches and the key imports work, the script exits in
# about a second.  Every README command and .ci/run call it first.
#
# What it installs, in order:
#   1. torch==2.14.1 / torchvision==0.29.1 (pinned: unpinned torch pulls a
#      multi-GB CUDA build from the network; these two are served locally here)
#   2. this project in editable mode with its test extra (`pip install -e .[test]`)
#   3. learn2learn 0.2.0, built from its PyPI sdist after regenerating the
#      Cython sources, because the shipped C files do not compile on
#      Python >= 3.11 (learn2learn issue #413).  Nothing of learn2learn is
#      kept in this repository.
#
# With `--with-dassl [SRC]` it then installs Dassl.pytorch into the same venv (Dassl, CoOp-family
# forks and `meta` must share one interpreter).  SRC is a pip URL (default: Dassl's git repository at
# the commit the trainers were checked on), a local checkout (installed editable) or a built wheel.
# Dassl goes in with --no-deps (its install_requires pins linters it never imports: flake8==3.7.9,
# yapf, isort) and --no-build-isolation (its setup.py imports numpy); its runtime needs come from
# this project's `dassl` extra in setup.py.  Without SRC an importable Dassl is left as it is.
#
# Environment: PYTHON (interpreter used to create the venv, default python3),
# GRAM_VENV (venv path, default <repo>/.venv).
set -euo pipefail

DASSL_DEFAULT_SRC="git+https://github.com/KaiyangZhou/Dassl.pytorch@c61a1b570ac6333bd50fb5ae06aea59002fb20bb"
WITH_DASSL=0
DASSL_SRC=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --with-dassl)
      WITH_DASSL=1
      if [[ $# -gt 1 && "$2" != --* ]]; then DASSL_SRC="$2"; shift; fi
      ;;
    -h | --help)
      awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
      exit 0
      ;;
    *)
      echo "error: scripts/setup.sh: unknown argument '$1' (expected: [--with-dassl [SRC]])" >&2
      exit 2
      ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRAM_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.14.1"
TORCHVISION_PIN="torchvision==0.29.1"
L2L_VERSION="0.2.0"

log() { printf '[setup] %s\n' "$*" >&2; }

recipe_hash() {
  cat "$ROOT/scripts/setup.sh" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1
}

imports_ok() {
  "$VENV/bin/python" - <<'PY' >/dev/null 2>&1
import torch, torchvision, open_clip, learn2learn, yacs, safetensors, meta, gram_world, gram_tools  # noqa: F401
assert torch.__version__.startswith("2.14.1"), torch.__version__
PY
}

STAMP="$VENV/.gram-setup-stamp"
WANT="$(recipe_hash)"
BASE_DONE=0
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && imports_ok; then
  log "environment at $VENV is up to date"
  BASE_DONE=1
fi
dassl_ok() { "$VENV/bin/python" -c 'import dassl.engine, dassl.data' >/dev/null 2>&1; }
if [[ $BASE_DONE == 1 ]]; then
  [[ $WITH_DASSL == 0 ]] && exit 0
  if [[ -z "$DASSL_SRC" ]] && dassl_ok; then
    log "Dassl is already installed ($("$VENV/bin/python" -c 'import dassl; print(dassl.__file__)')); pass a SRC to reinstall"
    exit 0
  fi
fi

# pip here warns once per package about local index folders it does not have; drop that noise only,
# and the resolver's complaint that Dassl (installed --no-deps on purpose) lacks its pinned linters.
pip_() {
  "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v -e 'is ignored: it is neither a file nor a directory' \
    -e '^dassl [0-9.]* requires ' -e "^ERROR: pip's dependency resolver does not currently take" >&2)
}
PIP=(pip_)
PY="$VENV/bin/python"
# The constraint keeps a dependency from replacing the pinned torch.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
printf '%s\n%s\n' "$TORCH_PIN" "$TORCHVISION_PIN" >"$CONSTRAINTS"

install_dassl() {
  local src="${DASSL_SRC:-$DASSL_DEFAULT_SRC}"
  log "installing Dassl's runtime needs (setup.py extra 'dassl')"
  "${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$ROOT[test,dassl]"
  local how=(install -q --no-deps --no-build-isolation --force-reinstall)
  if [[ -d "$src" ]]; then
    log "installing Dassl from the local checkout $src (editable)"
    "${PIP[@]}" "${how[@]}" --use-pep517 -e "$src"
  elif [[ "$src" == *.whl ]]; then
    [[ -f "$src" ]] || { log "ERROR: --with-dassl: no such wheel: $src"; exit 2; }
    log "installing Dassl from the wheel $src"
    "${PIP[@]}" "${how[@]}" "$src"
  else
    log "installing Dassl from $src"
    "${PIP[@]}" "${how[@]}" "$src"
  fi
  if ! dassl_ok; then
    log "ERROR: Dassl was installed into $VENV but \`import dassl.engine\` fails; run:"
    log "  $PY -c 'import dassl.engine'"
    exit 1
  fi
  log "Dassl ready: $("$PY" -c 'import dassl; print(dassl.__version__, dassl.__file__)')"
}

if [[ $BASE_DONE == 1 ]]; then
  install_dassl
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment at $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
log "build tools (setuptools, wheel, cython)"
"${PIP[@]}" install -q "setuptools>=68" wheel "cython>=3.0"

if ! "$PY" -c 'import torch, torchvision, sys; sys.exit(0 if torch.__version__.startswith("2.14.1") else 1)' 2>/dev/null; then
  log "installing $TORCH_PIN $TORCHVISION_PIN"
  "${PIP[@]}" install -q "$TORCH_PIN" "$TORCHVISION_PIN"
fi

log "installing the project (editable) and its dependencies"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$ROOT[test]"

if ! "$PY" -c 'import learn2learn' 2>/dev/null; then
  log "building learn2learn $L2L_VERSION from its sdist (regenerating Cython sources for Python >= 3.11)"
  BUILD="$(mktemp -d)"
  "${PIP[@]}" download -q --no-deps --no-binary :all: "learn2learn==$L2L_VERSION" -d "$BUILD"
  tar -xzf "$BUILD/learn2learn-$L2L_VERSION.tar.gz" -C "$BUILD"
  SRC="$BUILD/learn2learn-$L2L_VERSION"
  # The sdist's generated C files include a CPython header removed in 3.11.
  rm -f "$SRC"/learn2learn/data/*.c
  (cd "$SRC" && "$PY" -m cython -3 learn2learn/data/*.pyx)
  "${PIP[@]}" install -q --no-deps --no-build-isolation "$SRC"
  rm -rf "$BUILD"
fi

if ! imports_ok; then
  log "ERROR: the environment at $VENV was built but a key import fails; run:"
  log "  $PY -c 'import torch, open_clip, learn2learn, meta, gram_world, gram_tools'"
  exit 1
fi
echo "$WANT" >"$STAMP"
log "environment ready: $VENV"
if [[ $WITH_DASSL == 1 ]] && { [[ -n "$DASSL_SRC" ]] || ! dassl_ok; }; then
  install_dassl
fi
