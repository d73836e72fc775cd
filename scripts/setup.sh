#!/usr/bin/env bash
# Sets up a fresh clone: .venv with torch 2.14.1 and the test tools, and
# hsdp_backend installed from this clone's sources as scikit-build-core's
# editable install, built against that torch, with pytest-hsdp's (pytest-hsdp/,
# pure Python) beside it. Idempotent and quick on a second run: each step is
# skipped when its result is already in place, and the extension is rebuilt
# only when its native sources changed (build/ keeps the CMake tree for
# incremental builds; Python changes need no step).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/venv_steps.sh
VENV=.venv
PY=$VENV/bin/python
ensure_venv "$VENV"
ensure_torch "$PY" torch==2.14.1
# expecttest: torch's own test utilities (the DistributedTest conformance run) import it.
ensure_modules "$PY" scikit_build_core,ninja,pytest,pytest_timeout,xdist,numpy,expecttest \
  "scikit-build-core>=0.10" ninja pytest pytest-timeout pytest-xdist numpy expecttest
# ruff, pinned: scripts/test.sh's lint stage checks the formatting with it.
RUFF_VERSION=0.17.6
if [ "$("$VENV/bin/ruff" --version 2>/dev/null)" != "ruff $RUFF_VERSION" ]; then
  echo "[setup] installing ruff==$RUFF_VERSION"
  "$PY" -m pip install --quiet "ruff==$RUFF_VERSION"
fi

# googletest's sources (Debian): the engine's C++ tests (scripts/cpp_tests.sh)
# build them with their own sanitizer flags. spin (Debian): the model checker
# of the engine's protocol (scripts/check_protocol.sh). iproute2: simulated
# hosts (tools/simhosts.py, tests/system/test_hosts.py). clang-format: the C++ half
# of scripts/format.sh. ccache: every build's compiler cache (scripts/compiler_cache.sh).
if [ ! -f /usr/src/googletest/CMakeLists.txt ] || ! command -v spin > /dev/null || ! command -v ip > /dev/null ||
   ! command -v clang-format > /dev/null || ! command -v ccache > /dev/null; then
  echo "[setup] installing googletest, spin, iproute2, clang-format and ccache (Debian)"
  pkgs="googletest spin iproute2 clang-format ccache"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs > /dev/null 2>&1 ||
         { apt-get update -q > /dev/null 2>&1 &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs > /dev/null 2>&1; }; }; then
    echo "[setup] WARNING: could not install $pkgs; scripts/test.sh's lint and cpp stages and" \
         "tests/system/test_hosts.py will fail" >&2
  fi
fi

source scripts/compiler_cache.sh
# The tests' build: with the tests' module beside the package (hsdp_testing:
# the NCCL-contract double, the engine's kernel for the benchmarks).
build_package "$PY" build/.setup-stamp editable -C cmake.define.HSDP_BUILD_TESTING=ON
# The tests' plugin, its own distribution (hsdp_backend depends on it); after the package, whose
# earlier versions carried it.
install_plugin "$PY" build/.setup-plugin-stamp editable
echo "[setup] ready: $("$PY" -c 'import torch; print("torch", torch.__version__)')"
