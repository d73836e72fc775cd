#!/usr/bin/env bash
# Builds benchmarks/engine_bench.cpp against the engine's sources (no torch:
# seconds) and runs it with the given arguments; see that file's header.
#   bash scripts/engine_bench.sh all_gather_inplace 65536 2
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/engine_bench
src=(benchmarks/engine_bench.cpp csrc/common/Config.cpp csrc/shm/Engine.cpp csrc/shm/Wait.cpp csrc/shm/Pool.cpp
  csrc/shm/AllReduce.cpp csrc/shm/Segment.cpp
  csrc/shm/Reduce.cpp)
if [[ ! -x $out ]] || [[ -n $(find "${src[@]}" csrc/shm csrc/common -newer "$out" -print -quit) ]]; then
  # One object a source, through the compiler cache: a clean clone compiles
  # only what changed since the cache last saw it.
  source scripts/compiler_cache.sh
  mkdir -p "$out.objects"
  objects=() pids=()
  for s in "${src[@]}"; do
    o=$out.objects/$(basename "${s%.cpp}").o
    objects+=("$o")
    ${CMAKE_CXX_COMPILER_LAUNCHER:-} g++ -O3 -std=c++20 -Icsrc -c "$s" -o "$o" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do
    wait "$p" # a failed compile stops the script (set -e)
  done
  g++ "${objects[@]}" -o "$out" -lpthread
fi
exec "$out" "$@"
