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
  mkdir -p build
  g++ -O3 -std=c++20 -Icsrc "${src[@]}" -o "$out" -lpthread
fi
exec "$out" "$@"
