#!/usr/bin/env bash
# Sets up everything the quick start and the tests need, on a fresh machine or incrementally:
# a virtual environment in .venv (override with PULLBACK_VENV), the pinned packages, and the
# compiled extension (CPU kernels always; CUDA kernels too where a GPU is visible and nvcc is
# found, or with PULLBACK_CUDA_COMPILE_CHECK=1, CI's compile check on machines without a GPU:
# FORCE_CUDA=1 when nvcc is found and torch has CUDA). Each step runs only when its inputs
# changed: the packages when .ci/requirements.txt did, the editable install when pyproject.toml
# did, the extension when its sources, setup.py, torch or the build flags did. Quiet: one line
# per step it runs, the compiler's output in build/bootstrap.log (shown on failure, or live with
# PULLBACK_VERBOSE=1).
#   bash .ci/bootstrap.sh           set up what is out of date
#   bash .ci/bootstrap.sh --check   exit 0 when everything is up to date, 1 otherwise; changes nothing
#   bash .ci/bootstrap.sh --flags   print the extension's build flags (FORCE_CUDA, TORCH_CUDA_ARCH_LIST); changes nothing
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PULLBACK_VENV:-.venv}
PYTHON=${PYTHON:-python3}
REQ=.ci/requirements.txt
LOG=build/bootstrap.log
EXT_STAMP=build/extension.stamp
check_only=0
flags_only=0
[ "${1:-}" = "--check" ] && check_only=1
[ "${1:-}" = "--flags" ] && check_only=1 && flags_only=1
stale=()

say() { echo "[bootstrap] $*"; }
quietly() {  # run "$@" with its output in $LOG (or live when PULLBACK_VERBOSE=1)
  mkdir -p build
  if [ "${PULLBACK_VERBOSE:-0}" = 1 ]; then "$@"; return; fi
  if ! "$@" >"$LOG" 2>&1; then
    tail -n 60 "$LOG" >&2
    say "failed: $* (whole log: $LOG)" >&2
    return 1
  fi
}

if [ ! -x "$VENV/bin/python" ]; then
  [ $check_only = 1 ] && { echo "stale: no virtual environment $VENV"; exit 1; }
  say "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ "$want" != "$(cat "$VENV/.pullback-req-stamp" 2>/dev/null || true)" ]; then
  if [ $check_only = 1 ]; then stale+=("packages ($REQ changed)"); else
    say "installing pinned packages from $REQ"
    quietly "$PY" -m pip install --quiet --disable-pip-version-check -r "$REQ"
    echo "$want" > "$VENV/.pullback-req-stamp"
  fi
fi

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
gpu_visible() { "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
# The CUDA kernels take minutes to compile: built where a GPU can run them, or where a compile check
# is asked for (PULLBACK_CUDA_COMPILE_CHECK=1, .ci/run); never by default on a machine without a GPU.
if [ -z "${FORCE_CUDA:-}" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] \
   && "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
  if gpu_visible; then
    export FORCE_CUDA=1
  elif [ "${PULLBACK_CUDA_COMPILE_CHECK:-0}" = 1 ]; then
    export FORCE_CUDA=1
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # a compile check: one architecture is enough
  fi
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ $flags_only = 1 ]; then echo "FORCE_CUDA=${FORCE_CUDA:-0} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}"; exit 0; fi

# Everything the compiled extension depends on, as one hash.
ext_inputs() {
  find csrc -type f | LC_ALL=C sort | xargs sha256sum
  sha256sum setup.py
  "$PY" -c "import torch; print(torch.__version__, torch.version.cuda)" 2>/dev/null || echo "no torch"
  echo "FORCE_CUDA=${FORCE_CUDA:-0} ARCHS=${TORCH_CUDA_ARCH_LIST:-} CUDA_HOME=${CUDA_HOME:-}"
}
ext_want=$(ext_inputs | sha256sum | cut -d' ' -f1)
if [ "$ext_want" != "$(cat "$EXT_STAMP" 2>/dev/null || true)" ] || ! ls pullback_ext/_C*.so >/dev/null 2>&1; then
  if [ $check_only = 1 ]; then stale+=("extension (sources, torch or build flags changed)"); else
    say "building the extension (FORCE_CUDA=${FORCE_CUDA:-0}; a few minutes, more with CUDA)"
    quietly "$PY" setup.py build_ext --inplace
    echo "$ext_want" > "$EXT_STAMP"
  fi
fi

# pyproject.toml names the console scripts the editable install writes: reinstall when it changes.
pkg_want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if ! "$PY" -m pip show --quiet pullback_ext >/dev/null 2>&1 || [ "$pkg_want" != "$(cat "$VENV/.pullback-pkg-stamp" 2>/dev/null || true)" ]; then
  if [ $check_only = 1 ]; then stale+=("package not installed in $VENV, or pyproject.toml changed"); else
    say "installing pullback_ext in editable mode"
    # The extension was built in place above; the editable install only links the sources.
    quietly env PULLBACK_SKIP_EXTENSION=1 "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
    echo "$pkg_want" > "$VENV/.pullback-pkg-stamp"
  fi
fi

if [ $check_only = 1 ]; then
  if [ ${#stale[@]} -gt 0 ]; then printf 'stale: %s\n' "${stale[@]}"; exit 1; fi
  echo "up to date"
fi
