#!/usr/bin/env bash
# Builds and runs the shared-memory engine's C++ tests (tests/cpp): ranks as
# threads over one segment, no torch. Modes: plain, tsan (ThreadSanitizer),
# asan (AddressSanitizer + UndefinedBehaviorSanitizer). Exits non-zero on any
# test failure or sanitizer report. Needs cmake, g++ and Debian's googletest
# sources (scripts/setup.sh installs them).
#
#   bash scripts/cpp_tests.sh [plain|tsan|asan] [gtest arguments...]
#
# Without gtest arguments the build's tests run through ctest (verbose: a
# sanitizer's report is in the output); with them, the binary runs alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=${1:-plain}
shift || true
case "$mode" in
  plain) sanitize="" ;;
  tsan) sanitize=thread ;;
  asan) sanitize=address ;;
  *) echo "usage: $0 [plain|tsan|asan] [gtest arguments...]" >&2; exit 2 ;;
esac

source scripts/compiler_cache.sh
build=build/cpp-$mode
mkdir -p build
cmake -S tests/cpp -B "$build" -DHSDP_SANITIZE="$sanitize" > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target engine_tests -j "$(nproc)" > "$build.build.log" 2>&1 ||
  { tail -50 "$build.build.log"; exit 1; }

# Any report fails the run: the first one stops the binary with a non-zero
# exit. No suppressions are used.
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1"
export ASAN_OPTIONS="halt_on_error=1 detect_leaks=1 detect_stack_use_after_return=1"
export UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1"
if [ "$#" -eq 0 ]; then
  echo "[cpp_tests] $mode: ctest --test-dir $build"
  exec ctest --test-dir "$build" --verbose
fi
echo "[cpp_tests] $mode: $build/engine_tests $*"
"$build/engine_tests" "$@"
