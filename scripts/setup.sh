#!/usr/bin/env bash
# Sets up a fresh clone: .venv with torch 2.14.1 and the test tools, and
# hsdp_backend built against that torch. Idempotent and quick on a second
# run: each step is skipped when its result is already in place, and the
# extension is rebuilt only when its sources changed (build/ keeps the
# CMake tree for incremental builds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.14.1
VENV=.venv
PY=$VENV/bin/python

if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION"
  "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
fi

# expecttest: torch's own test utilities (the DistributedTest conformance run) import it.
# ruff (pinned: its formatting is checked by tests/test_format.py).
RUFF_VERSION=0.17.6
if ! "$PY" -c "import scikit_build_core, ninja, pytest, pytest_timeout, numpy, matplotlib, expecttest" 2>/dev/null ||
   [ "$("$VENV/bin/ruff" --version 2>/dev/null)" != "ruff $RUFF_VERSION" ]; then
  echo "[setup] installing build, test and format tools"
  "$PY" -m pip install --quiet "scikit-build-core>=0.10" ninja pytest pytest-timeout numpy matplotlib expecttest \
    "ruff==$RUFF_VERSION"
fi

# googletest's sources (Debian): the engine's C++ tests (scripts/cpp_tests.sh)
# build them with their own sanitizer flags. spin (Debian): the model checker
# of the engine's protocol (scripts/check_protocol.sh). iproute2: simulated
# hosts (tools/simhosts.py, tests/test_hosts.py). clang-format: the C++ half
# of scripts/format.sh.
if [ ! -f /usr/src/googletest/CMakeLists.txt ] || ! command -v spin > /dev/null || ! command -v ip > /dev/null ||
   ! command -v clang-format > /dev/null; then
  echo "[setup] installing googletest, spin, iproute2 and clang-format (Debian)"
  pkgs="googletest spin iproute2 clang-format"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs > /dev/null 2>&1 ||
         { apt-get update -q > /dev/null 2>&1 &&
           DEBIAN_FRONTEND=noninteractive apt-get install -y -q $pkgs > /dev/null 2>&1; }; }; then
    echo "[setup] WARNING: could not install $pkgs; tests/test_cpp_engine.py, tests/test_protocol_model.py," \
         "tests/test_hosts.py and tests/test_format.py will fail" >&2
  fi
fi

# Rebuild when any input of the build changed since the last install.
stamp_file=build/.setup-stamp
stamp=$(cat pyproject.toml CMakeLists.txt $(find csrc src -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.py' -o -name CMakeLists.txt \) | sort) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp" ] || ! (cd /tmp && "$ROOT/$PY" -c "import hsdp_backend._C") 2>/dev/null; then
  echo "[setup] building hsdp_backend (C++ extension; about a minute on 2 cores)"
  # --no-build-isolation: build against the torch in $VENV, never a second one.
  "$PY" -m pip install --quiet --no-build-isolation --no-deps .
  mkdir -p build
  echo "$stamp" > "$stamp_file"
fi
echo "[setup] ready: $("$PY" -c 'import torch; print("torch", torch.__version__)')"
