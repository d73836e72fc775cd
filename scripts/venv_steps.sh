# The steps of setting up a venv with hsdp_backend built into it, shared by
# scripts/setup.sh (the main venv) and scripts/setup_compat.sh (the second
# torch). Sourced, from the repository root. Each step is skipped when its
# result is already in place, so a second run takes seconds.

# ensure_venv VENV
ensure_venv() {
  if [ ! -x "$1/bin/python" ]; then
    echo "[setup] creating $1"
    "${PYTHON:-python3}" -m venv "$1"
  fi
}

# ensure_torch PY REQUIREMENT: e.g. torch==2.14.1 (a local version suffix,
# +cpu, is not compared).
ensure_torch() {
  local version=${2#torch==}
  version=${version%%+*}
  if ! "$1" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
    echo "[setup] installing $2"
    "$1" -m pip install --quiet "$2"
  fi
}

# ensure_modules PY "MODULE,..." PACKAGE...: installs the packages unless
# every module imports.
ensure_modules() {
  local py=$1 modules=$2
  shift 2
  if ! "$py" -c "import $modules" 2>/dev/null; then
    echo "[setup] installing $*"
    "$py" -m pip install --quiet "$@"
  fi
}

# The set-up's own imports of torch must not load hsdp through torch's
# device-backend autoload: a venv whose install is broken (a deleted clone's
# editable install) must still be repairable.
export TORCH_DEVICE_BACKEND_AUTOLOAD=0

# build_package PY STAMP_FILE MODE [PIP_ARGS...]: installs the package into
# PY's venv, again when an input of the build changed since the last install
# or the installed extension does not import. MODE editable: scikit-build-core's
# editable install, for a venv inside the clone (its Python files are the
# clone's src/, so a change to them needs no step; the extension and the tests'
# module are built into the venv). MODE wheel: a copy, for a venv that clones
# share (scripts/setup_compat.sh), which must not point into one of them; its
# Python files are inputs of the build too.
build_package() {
  local py=$1 stamp_file=$2 mode=$3 root=$PWD native python_files=""
  shift 3
  [ "$mode" = wheel ] && python_files=$(find src -type f -name '*.py' | sort | xargs sha256sum)
  # The build's options, the torch built against and (for a copy) the Python files are inputs.
  # tests/cpp/backend_test.cpp: the tests' build (HSDP_BUILD_TESTING) compiles it too.
  native=$( (echo "$mode" "$@" "$root"; echo "$python_files"; "$py" -c 'import torch; print(torch.__version__)'; cat pyproject.toml CMakeLists.txt tests/cpp/backend_test.cpp $(find csrc cmake src -type f \( -name '*.cmake' -o -name '*.cpp' -o -name '*.hpp' -o -name CMakeLists.txt \) | sort)) | sha256sum | cut -d' ' -f1)
  local built=""
  read -r built 2> /dev/null < "$stamp_file" || true
  # Imported from elsewhere than the repository root, so that the installed
  # copy answers (PY may be relative to the root, or absolute).
  local python=$py
  [[ $python == /* ]] || python=$root/$python
  # The tests' build also installs the tests' module beside the package.
  local modules=hsdp_backend._C
  [[ " $* " != *HSDP_BUILD_TESTING=ON* ]] || modules="$modules, hsdp_testing"
  if [ "$built" = "$native" ] && (cd /tmp && "$python" -c "import $modules") 2> /dev/null; then
    return 0
  fi
  local how=()
  [ "$mode" = editable ] && how=(--editable)
  echo "[setup] building hsdp_backend ($mode) against $("$py" -c 'import torch; print("torch", torch.__version__)') (a minute or two on 2 cores)"
  # --no-build-isolation: build against the torch in the venv, never a second one.
  "$py" -m pip install --quiet --no-build-isolation --no-deps "$@" "${how[@]}" . || return 1
  mkdir -p "$(dirname "$stamp_file")"
  echo "$native" > "$stamp_file"
}

# install_plugin PY STAMP_FILE MODE: installs pytest-hsdp (pytest-hsdp/, pure Python) into PY's
# venv, again when its files changed since the last install or it does not import. MODE as for
# build_package: editable for a venv inside the clone (only its pyproject.toml is then an
# input), wheel for a copy.
install_plugin() {
  local py=$1 stamp_file=$2 mode=$3 root=$PWD inputs built=""
  if [ "$mode" = editable ]; then
    inputs=$( (echo "$mode $root"; cat pytest-hsdp/pyproject.toml) | sha256sum | cut -d' ' -f1)
  else
    inputs=$( (echo "$mode"; find pytest-hsdp -type f -not -path '*/__pycache__/*' -not -path '*.egg-info*' | sort | xargs sha256sum) | sha256sum | cut -d' ' -f1)
  fi
  read -r built 2> /dev/null < "$stamp_file" || true
  local python=$py
  [[ $python == /* ]] || python=$root/$python
  if [ "$built" = "$inputs" ] && (cd /tmp && "$python" -c "import pytest_hsdp") 2> /dev/null; then
    return 0
  fi
  # The build backend (pytest-hsdp/pyproject.toml: setuptools >= 71) from the venv where it has
  # one, else in pip's isolated build environment: the venv's own setuptools is left as its torch
  # requires it.
  local how=()
  "$python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 71)" 2> /dev/null &&
    how=(--no-build-isolation)
  [ "$mode" = editable ] && how+=(--editable)
  echo "[setup] installing pytest-hsdp ($mode)"
  "$py" -m pip install --quiet --no-deps "${how[@]}" ./pytest-hsdp || return 1
  mkdir -p "$(dirname "$stamp_file")"
  echo "$inputs" > "$stamp_file"
}
