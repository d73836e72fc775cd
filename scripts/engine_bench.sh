#!/usr/bin/env bash
# Builds benchmarks/engine_bench.cpp against the engine's library (CMake
# target hsdp_shm; no torch: seconds, through the compiler cache) and runs it
# with the given arguments; see that file's header.
#   bash scripts/engine_bench.sh all_gather_inplace 65536 2
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/compiler_cache.sh
build=build/engine-bench
mkdir -p build
cmake -S benchmarks -B "$build" > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" --target engine_bench -j "$(nproc)" > "$build.build.log" 2>&1 ||
  { tail -50 "$build.build.log"; exit 1; }
exec "$build/engine_bench" "$@"
