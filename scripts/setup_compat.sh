#!/usr/bin/env bash
# Sets up a venv with another supported torch and hsdp_backend built against
# it: scripts/test.sh's compat stages run the release's tests there, once per
# release in the table below. The main venv (scripts/setup.sh) has 2.14.
#
#   bash scripts/setup_compat.sh 2.15     # prints the venv's python last
#
# The venvs live outside the clone (HSDP_VENV_CACHE, default
# ~/.cache/hsdp-backend): a CUDA build of torch with its libraries is 5 GB
# and a minute or two to install, so a second run (or a second clone) reuses
# it. The package is a copy (not an editable install: the venv outlives the
# clone), rebuilt in the clone's build/torch<version> when its sources or the
# clone differ from those the venv's copy was built from (scripts/venv_steps.sh);
# two clones must not run their compat stages at the same time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/venv_steps.sh
source scripts/compiler_cache.sh

# The release of each minor version that is tested (docs/versions.md). 2.13
# is the local CPU wheel (a CPU build of torch); the others come from PyPI as
# CUDA builds, past this machine's pip cap (PIP_CONFIG_FILE=/dev/null below).
declare -A TORCH_REQS=(
  [2.11]=torch==2.11.0
  [2.12]=torch==2.12.1
  [2.13]=torch==2.13.0+cpu
  [2.15]=torch==2.15.0
)
MINOR=${1:?usage: setup_compat.sh MINOR (one of: ${!TORCH_REQS[*]})}
TORCH_REQ=${TORCH_REQS[$MINOR]:?"no tested release for torch $MINOR (known: ${!TORCH_REQS[*]})"}
CACHE=$HSDP_CACHE_DIR
VENV=$CACHE/venv-torch$MINOR
PY=$VENV/bin/python

# A machine-wide pip configuration may cap torch below the releases here
# (exact pins from PyPI), so it is not read; its find-links, where the local
# 2.13 wheel lies, are kept.
config_links=$(python3 -m pip config get global.find-links 2> /dev/null || true)
export PIP_FIND_LINKS="${PIP_FIND_LINKS:-$config_links}"
export PIP_CONFIG_FILE=/dev/null
mkdir -p "$CACHE"
ensure_venv "$VENV"
ensure_torch "$PY" "$TORCH_REQ"
# scripts/setup.sh's tools less pytest-xdist and the formatter.
ensure_modules "$PY" scikit_build_core,ninja,pytest,pytest_timeout,numpy,expecttest \
  "scikit-build-core>=0.10" ninja pytest pytest-timeout numpy expecttest
# Its own build tree (never the main venv's build/{wheel_tag}); the stamp in
# the venv, which is what the build went into. A clone without this
# release's C++ tests (scripts/test.sh runs them) builds, whatever the stamp.
[ -x "build/torch$MINOR/backend_tests" ] || rm -f "$VENV/.hsdp-build-stamp"
build_package "$PY" "$VENV/.hsdp-build-stamp" wheel -C "build-dir=build/torch$MINOR" \
  -C cmake.define.HSDP_BUILD_TESTING=ON >&2
# After the package, whose earlier versions carried the plugin.
install_plugin "$PY" "$VENV/.hsdp-plugin-stamp" wheel >&2
echo "[setup-compat] ready: $("$PY" -c 'import torch; print("torch", torch.__version__)')" >&2
echo "$PY"
