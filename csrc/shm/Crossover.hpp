#pragma once

// From what size a rank reads its peers' ordinary buffers directly
// (process_vm_readv, one copy) rather than through the slots (two copies),
// measured on the machine the group runs on.
//
// Neither path wins everywhere, and where they cross depends on the CPU and
// the hypervisor: the system call pins and copies page by page, while the
// slots' second copy reads lines the writer's core just wrote, from the
// cache the cores share. Measured through the engine, in-place all-gathers
// on 2 ranks, direct reads won from a few KiB on an Intel Xeon VM and lost up
// to 1 MiB on an AMD EPYC VM (docs/results/cpu-performance-2026-11.md, "The engine's constants").
// So a group measures it when it is created, instead of trusting a constant measured elsewhere.

#include "shm/FunctionRef.hpp"

#include <chrono>
#include <cstddef>
#include <optional>
#include <vector>

namespace hsdp::shm {

class Engine;

// One message size per rank, and each path's time per call at it (of its
// fastest round).
struct ReadSample {
  size_t bytes = 0;
  std::chrono::nanoseconds direct{0};
  std::chrono::nanoseconds slots{0};
};

// The smallest size measured from which direct reads are faster at every
// larger size measured; when the slots win at the largest, 4 times that
// size. `samples` in ascending size.
//
// Why not further: the measurement repeats one call, so its data stays in
// the cache, where the slots' extra copy is cheap; a call a program makes
// meets data its compute evicted. Up to 512 KiB per rank both paths' data
// fit the caches either way and the measurement holds; from 2 MiB it
// overstates the slots, which through torch were level with direct reads or
// slower (docs/results/cpu-performance-2026-11.md, "The engine's constants"). So above the sizes
// measured, direct reads win, as they did everywhere on the Intel VM.
size_t directReadCrossover(const std::vector<ReadSample>& samples);

// The sizes per rank timeDirectReads measures: from 8 KiB by factors of 4,
// and last the largest, 512 KiB, or less when the slot is smaller or when
// the output (the size times the ranks) would pass 32 MiB.
std::vector<size_t> directReadProbeSizes(int ranks, size_t slotBytes);

// Times in-place all-gathers of ordinary (non-pool) buffers through both
// paths, alternately, at directReadProbeSizes: this rank's time per call of
// each path, in its fastest round. A collective: every rank of `engine`'s group calls it
// alike, with direct reads enabled. The engine's threshold is restored
// before it returns. Broadcasts take the threshold too: the same two ways
// of reading one peer's buffer, of which an all-gather reads every peer's.
std::vector<ReadSample> timeDirectReads(Engine& engine);

// The direct-read threshold every rank of the group adopts: rank 0's
// `known` if it has one (the crossover an earlier group of this process
// measured), else the crossover of rank 0's `measure()`, which then runs on
// every rank (it must be a collective, as timeDirectReads is). A
// collective; rank 0 alone decides, so ranks whose clocks disagree still
// agree on the threshold, as every rank of a call must. A rank whose
// `measure()` throws aborts the engine first, so its peers fail at once.
size_t agreeDirectReadBytes(
    Engine& engine,
    std::optional<size_t> known,
    FunctionRef<std::vector<ReadSample>()> measure);

} // namespace hsdp::shm
