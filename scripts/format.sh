#!/usr/bin/env bash
# Formats the tree (C++: clang-format with .clang-format; Python: ruff with
# pyproject.toml's settings), or with --check reports drift and exits 1.
# scripts/setup.sh installs both tools; scripts/test.sh's lint stage runs --check.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUFF=${RUFF:-.venv/bin/ruff}
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
# Tracked files and new ones not yet added (but not ignored ones: build trees).
cpp=$(git ls-files --cached --others --exclude-standard 'csrc/*.cpp' 'csrc/*.hpp' 'tests/cpp/*.cpp' 'tests/cpp/*.hpp')
if [ "${1:-}" = "--check" ]; then
  status=0
  "$CLANG_FORMAT" --dry-run --Werror $cpp || status=1
  "$RUFF" format --check --quiet . || status=1
  "$RUFF" check --quiet . || status=1
  [ $status = 0 ] || echo "format drift: run scripts/format.sh" >&2
  exit $status
fi
"$CLANG_FORMAT" -i $cpp
"$RUFF" check --quiet --fix .
"$RUFF" format --quiet .
