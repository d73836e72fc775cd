#!/usr/bin/env bash
# The test suite in named stages, cheapest first, each a plain command, timed
# in the output; it stops at the first stage that fails (what CI runs, after
# scripts/setup.sh):
#
#   bash scripts/test.sh          every stage
#   bash scripts/test.sh quick    lint, unit and quick: a change in progress
#
# lint      clang-format and ruff, no drift (scripts/format.sh --check)
# unit      pytest tests/unit: one process, no ranks
# quick     pytest -m quick: tests/integration at two ranks, in a shuffled order
# cpp       the C++ tests through ctest: the engine's plain, under TSan and
#           under ASan+UBSan (scripts/cpp_tests.sh), the backend's (the
#           tests' build of scripts/setup.sh), and the spin models
# integration, system, tooling
#           pytest: the rest of each tier (tests/integration: every route,
#           FSDP2, faults; tests/system: simulated hosts, PyTorch's
#           DistributedTest, soaks; tests/tooling: the benchmarks and tools)
# compat    one stage per other supported torch: its venv
#           (scripts/setup_compat.sh) runs that release's build of the
#           backend's C++ tests and `pytest -m every_torch`
#
# Together the stages run every test once. PYTEST names the pytest to use
# (default: the venv of scripts/setup.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTEST=${PYTEST:-.venv/bin/pytest}
last=${1:-all}
case "$last" in
  all | quick) ;;
  *)
    echo "usage: bash scripts/test.sh [quick]" >&2
    exit 2
    ;;
esac

stage() {
  local name=$1 start rc
  shift
  echo "== stage $name: $*"
  start=$(date +%s)
  "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "== stage $name FAILED (exit $rc) after $(($(date +%s) - start)) s; later stages not run"
    exit "$rc"
  fi
  echo "== stage $name passed in $(($(date +%s) - start)) s"
}

# A googletest binary's run: its exit status, and no sanitizer report.
gtest() {
  local log
  log=$(mktemp)
  "$@" > "$log" 2>&1
  local rc=$?
  tail -n 3 "$log"
  if [ "$rc" -eq 0 ] && grep -qE "WARNING: ThreadSanitizer|ERROR: (Address|Leak)Sanitizer|runtime error:" "$log"; then
    grep -m 5 -E "WARNING: ThreadSanitizer|ERROR: (Address|Leak)Sanitizer|runtime error:" "$log"
    rc=1
  fi
  [ "$rc" -eq 0 ] || tail -n 80 "$log"
  rm -f "$log"
  return "$rc"
}

cpp() {
  local mode binary
  for mode in plain tsan asan; do
    echo "-- engine's C++ tests, $mode"
    gtest bash scripts/cpp_tests.sh "$mode" || return 1
  done
  binary=$(ls build/cp3*/backend_tests 2> /dev/null | head -n 1)
  [ -n "$binary" ] || { echo "build/*/backend_tests missing: run scripts/setup.sh"; return 1; }
  echo "-- backend's C++ tests ($binary)"
  gtest ctest --test-dir "$(dirname "$binary")" --verbose || return 1
  echo "-- spin models"
  bash scripts/check_protocol.sh
}

# One other torch release: its venv, its build's C++ backend tests, then
# what meets the differences between releases (the tests marked
# every_torch; HSDP_TEST_EVERY_TORCH_FULL=1: the quick tier too). At least
# MIN_PASSED tests must pass, so that the subset cannot shrink unnoticed.
# The tables of torch's test harness's outcomes are checked against that harness (its spawning
# per test, minutes a release) with HSDP_TEST_TORCH_HARNESS=1, which the flag sets here.
if [ "${HSDP_TEST_EVERY_TORCH_FULL:-0}" = 1 ]; then
  MARKS="quick or every_torch" MIN_PASSED=330 TORCH_HARNESS=1
else
  MARKS="every_torch" MIN_PASSED=85 TORCH_HARNESS=${HSDP_TEST_TORCH_HARNESS:-0}
fi
compat() {
  local release=$1 log python summary passed rc
  log=$(mktemp)
  bash scripts/setup_compat.sh "$release" > "$log" 2>&1 || {
    tail -n 60 "$log"
    rm -f "$log"
    return 1
  }
  python=$(tail -n 1 "$log")
  "$python" -c "import sys, torch; sys.exit(not torch.__version__.startswith('$release.'))" || {
    echo "$python is not torch $release"
    return 1
  }
  # Without googletest's sources the build has no C++ tests, and ctest finds none and passes.
  [ -x "build/torch$release/backend_tests" ] || {
    echo "build/torch$release/backend_tests missing (googletest's sources: scripts/setup.sh)"
    return 1
  }
  gtest ctest --test-dir "build/torch$release" --verbose || return 1
  HSDP_TEST_TORCH_HARNESS=$TORCH_HARNESS "$python" -m pytest -q -p no:cacheprovider -m "$MARKS" tests \
    > "$log" 2>&1
  rc=$?
  summary=$(tail -n 1 "$log")
  [ "$rc" -eq 0 ] || tail -n 120 "$log"
  rm -f "$log"
  echo "torch $release: $summary"
  [ "$rc" -eq 0 ] || return "$rc"
  passed=$(grep -oE "[0-9]+ passed" <<< "$summary" | grep -oE "[0-9]+")
  if [ "${passed:-0}" -lt "$MIN_PASSED" ]; then
    echo "torch $release: fewer than $MIN_PASSED passed (-m '$MARKS')"
    return 1
  fi
}

stage lint bash scripts/format.sh --check
stage unit "$PYTEST" -q tests/unit
# In an order of its own each run (tests/conftest.py: --shuffle): the suite must pass in any
# order; the seed is printed, and --shuffle SEED repeats the order.
seed=$((RANDOM * 32768 + RANDOM))
echo "== the quick stage's order: --shuffle $seed"
stage quick "$PYTEST" -q tests -m quick --ignore=tests/unit --shuffle "$seed"
[ "$last" = quick ] && exit 0
stage cpp cpp
for tier in integration system tooling; do
  stage "$tier" "$PYTEST" -q "tests/$tier" -m "not quick"
done
# Every supported minor release but the main venv's (scripts/setup_compat.sh's table).
for release in 2.11 2.12 2.13 2.15; do
  stage "compat $release" compat "$release"
done
