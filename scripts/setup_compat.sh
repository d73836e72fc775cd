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
source scripts/venv_steps.sh

TORCH_REQ=${COMPAT_TORCH:-torch==2.13.0+cpu}
TORCH_VERSION=${TORCH_REQ#torch==}
TORCH_VERSION=${TORCH_VERSION%%+*}
VENV=${COMPAT_VENV:-.venv-torch$(echo "$TORCH_VERSION" | cut -d. -f1,2)}
BUILD_DIR=build/$(basename "$VENV" | sed 's/^\.venv-//')
PY=$VENV/bin/python

ensure_venv "$VENV"
ensure_torch "$PY" "$TORCH_REQ"
# scripts/setup.sh's tools less the benchmark's plotting and the formatter.
ensure_modules "$PY" scikit_build_core,ninja,pytest,pytest_timeout,numpy,expecttest \
  "scikit-build-core>=0.10" ninja pytest pytest-timeout numpy expecttest
# Its own build tree: never the main venv's build/{wheel_tag}.
build_package "$PY" "$BUILD_DIR/.setup-stamp" -C "build-dir=$BUILD_DIR" -C cmake.define.HSDP_BUILD_TESTING=ON
echo "[setup-compat] ready: $VENV, $("$PY" -c 'import torch; print("torch", torch.__version__)')"
