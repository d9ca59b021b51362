#!/usr/bin/env bash
# Sets up everything the quick start and the tests need, on a fresh machine or incrementally:
# a virtual environment in .venv (override with PULLBACK_VENV), the pinned packages, and the
# compiled extension (CPU kernels always; CUDA kernels too when nvcc is found, as a compile
# check on machines without a GPU). Safe to run again: each step is skipped when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PULLBACK_VENV:-.venv}
PYTHON=${PYTHON:-python3}
REQ=.ci/requirements.txt

if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

want=$(sha256sum "$REQ" | cut -d' ' -f1)
have=$(cat "$VENV/.pullback-req-stamp" 2>/dev/null || true)
if [ "$want" != "$have" ]; then
  echo "[bootstrap] installing pinned packages from $REQ"
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$REQ"
  echo "$want" > "$VENV/.pullback-req-stamp"
fi

if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
if [ -z "${FORCE_CUDA:-}" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ] \
   && "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  export FORCE_CUDA=1
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

if ! "$PY" -m pip show --quiet pullback_ext >/dev/null 2>&1; then
  echo "[bootstrap] building and installing pullback_ext (FORCE_CUDA=${FORCE_CUDA:-0})"
  "$PY" -m pip install --quiet --no-build-isolation --no-deps -e .
else
  echo "[bootstrap] rebuilding the extension in place if sources changed (FORCE_CUDA=${FORCE_CUDA:-0})"
  "$PY" setup.py --quiet build_ext --inplace
fi
