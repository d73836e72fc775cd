#!/usr/bin/env bash
# Sets up the compatibility venv: .venv-torch2.13 with the oldest supported
# torch (the local 2.13.0 CPU wheel; pip's find-links names its folder) and
# the build and test tools, and hsdp_backend built against that torch in its
# own build tree (build/torch2.13: never the main venv's build/{wheel_tag}).
# tests/test_torch_versions.py runs it, then a subset of the suite in that
# venv. Idempotent and quick on a second run, like scripts/setup.sh.
#
#   COMPAT_TORCH   the torch requirement (default torch==2.13.0+cpu)
#   COMPAT_VENV    the venv's folder   (default .venv-torch2.13)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

PYTHON=${PYTHON:-python3}
TORCH_REQ=${COMPAT_TORCH:-torch==2.13.0+cpu}
TORCH_VERSION=${TORCH_REQ#torch==}
TORCH_VERSION=${TORCH_VERSION%%+*}
VENV=${COMPAT_VENV:-.venv-torch$(echo "$TORCH_VERSION" | cut -d. -f1,2)}
BUILD_DIR=build/$(basename "$VENV" | sed 's/^\.venv-//')
PY=$VENV/bin/python

if [ ! -x "$PY" ]; then
  echo "[setup-compat] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[setup-compat] installing $TORCH_REQ"
  "$PY" -m pip install --quiet "$TORCH_REQ"
fi

# The tools the subset needs (scripts/setup.sh's list less the benchmark's
# plotting and the formatter).
if ! "$PY" -c "import scikit_build_core, ninja, pytest, pytest_timeout, numpy, expecttest" 2>/dev/null; then
  echo "[setup-compat] installing build and test tools"
  "$PY" -m pip install --quiet "scikit-build-core>=0.10" ninja pytest pytest-timeout numpy expecttest
fi

# Rebuild when any input of the build changed since the last install.
stamp_file=$BUILD_DIR/.setup-stamp
stamp=$(cat pyproject.toml CMakeLists.txt $(find csrc src -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.py' -o -name CMakeLists.txt \) | sort) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp" ] || ! (cd /tmp && "$ROOT/$PY" -c "import hsdp_backend._C") 2>/dev/null; then
  echo "[setup-compat] building hsdp_backend against torch $TORCH_VERSION in $BUILD_DIR"
  # --no-build-isolation: build against the torch in $VENV, never a second one.
  "$PY" -m pip install --quiet --no-build-isolation --no-deps -C "build-dir=$BUILD_DIR" .
  mkdir -p "$BUILD_DIR"
  echo "$stamp" > "$stamp_file"
fi
echo "[setup-compat] ready: $VENV, $("$PY" -c 'import torch; print("torch", torch.__version__)')"
