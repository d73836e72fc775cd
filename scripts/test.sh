#!/usr/bin/env bash
# The test suite in stages, cheapest first, each named in the output with its
# time; it stops at the first stage that fails (what CI runs, after
# scripts/setup.sh):
#
#   bash scripts/test.sh          format, unit, quick, then the rest
#   bash scripts/test.sh quick    format, unit and quick: a change in progress
#
# Together the stages run every test of `pytest tests` once. PYTEST names the
# pytest to use (default: the venv of scripts/setup.sh).
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
  echo "== stage $name: pytest $*"
  start=$(date +%s)
  "$PYTEST" -q "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "== stage $name FAILED (pytest exit $rc) after $(($(date +%s) - start)) s; later stages not run"
    exit "$rc"
  fi
  echo "== stage $name passed in $(($(date +%s) - start)) s"
}

FORMAT=tests/tooling/test_format.py
stage format "$FORMAT"
stage unit tests/unit
stage quick tests -m quick --ignore=tests/unit --ignore="$FORMAT"
[ "$last" = quick ] && exit 0
stage rest tests -m "not quick" --ignore=tests/unit --ignore="$FORMAT"
