# Compiles through ccache when it is installed (scripts/setup.sh installs it):
# sourced, from the repository root, by the scripts that build (setup.sh,
# setup_compat.sh, cpp_tests.sh, engine_bench.sh). A clean clone otherwise
# compiles the extension, the other releases' builds and the engine's C++
# tests under three sanitizer settings from nothing, minutes each on 2 cores,
# for sources that rarely changed. CMake (3.17+) reads the launcher from the
# environment when it configures a build tree.
#
# The cache lives outside the clone, beside the other releases' venvs, in
# HSDP_CACHE_DIR (HSDP_VENV_CACHE, default ~/.cache/hsdp-backend), which
# setup_compat.sh takes from here. Paths under the clone are hashed relative
# to it and the build directory is not hashed, so a second clone hits what
# the first one compiled; the compiler, its flags and every included file's
# contents are still part of each entry's key. HSDP_NO_CCACHE=1 compiles
# without it.
HSDP_CACHE_DIR=${HSDP_VENV_CACHE:-$HOME/.cache/hsdp-backend}
if [ "${HSDP_NO_CCACHE:-0}" != 1 ] && command -v ccache > /dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_DIR=${CCACHE_DIR:-$HSDP_CACHE_DIR/ccache}
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  # An extension build is about 40 MB of objects; the C++ tests' three builds less.
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-2G}
fi
