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

# build_package PY STAMP_FILE [PIP_ARGS...]: installs the package into PY's
# venv as scikit-build-core's editable install (its Python files are this
# clone's src/, so a change to them needs no step; the extension and the
# tests' module are built into the venv), again when an input of the build
# changed since the last install, the venv's install is another clone's, or
# the installed extension does not import.
build_package() {
  local py=$1 stamp_file=$2 root=$PWD native
  shift 2
  # The build's options, the clone and the torch built against are part of its inputs.
  # tests/cpp/backend_test.cpp: the tests' build (HSDP_BUILD_TESTING) compiles it too.
  native=$( (echo "$@" "$root"; "$py" -c 'import torch; print(torch.__version__)'; cat pyproject.toml CMakeLists.txt tests/cpp/backend_test.cpp $(find csrc cmake src -type f \( -name '*.cmake' -o -name '*.cpp' -o -name '*.hpp' -o -name CMakeLists.txt \) | sort)) | sha256sum | cut -d' ' -f1)
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
  echo "[setup] building hsdp_backend against $("$py" -c 'import torch; print("torch", torch.__version__)') (a minute or two on 2 cores)"
  # --no-build-isolation: build against the torch in the venv, never a second one.
  "$py" -m pip install --quiet --no-build-isolation --no-deps "$@" --editable . || return 1
  mkdir -p "$(dirname "$stamp_file")"
  echo "$native" > "$stamp_file"
}
