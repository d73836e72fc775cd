#pragma once

// Every setting of hsdp, as one object: src/hsdp_backend/config.py resolves
// the HSDP_* environment variables into it (bound as hsdp_backend._C.Config)
// and hands it to each new process group. The defaults below are the only
// copy of them: config.py's table and docs/configuration.md show these.
//
// Setting a field through `set` (what the Python binding does) checks it and
// throws std::invalid_argument naming the field and what it expects; a
// Config built in C++ is checked by validate().

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace hsdp {

struct Config {
  enum class CpuRoute { Auto, Shm, Gloo };

  // What serves CPU collectives: Auto (the shared-memory engine when the
  // group's ranks can share it, else the inner CPU backend, gloo), Shm (the
  // engine or an error), Gloo (always the inner CPU backend).
  CpuRoute cpuRoute = CpuRoute::Auto;
  // Bytes a rank moves through shared memory per pipelined step.
  int64_t slotBytes = 4 << 20;
  // How long a wait spins before sleeping; unset: auto (see spin()).
  std::optional<int64_t> spinUs;
  // How long a wait then polls with sched_yield before sleeping.
  int64_t yieldUs = 1000;
  int64_t oneShotBytes = 32 << 10;
  // All-gathers and broadcasts from this many bytes per rank read peers'
  // buffers directly (Engine.hpp: EngineConfig::directReadBytes, and
  // pooledReadBytes for pool buffers); unset: auto, pool buffers from
  // kPooledReadBytes, ordinary ones from the size each group measures
  // (shm/Crossover.hpp).
  std::optional<int64_t> directReadBytes;
  static constexpr int64_t kPooledReadBytes = 8 << 10;
  // Where the direct path overtakes the slots on cache-line-aligned buffers,
  // as torch allocates them (on buffers 16 bytes into a line it overtakes
  // them sooner: an earlier 256 KiB was measured so), docs/results/
  // cpu-performance-2026-11.md, "The engine's constants".
  int64_t directAllReduceBytes = 1152 << 10;
  // Reduce-scatters whose output per rank is at least this many bytes write
  // it around the cache (shm::Store::Streaming); unset: auto (see
  // streamStoreBytesFor()); 0: never.
  std::optional<int64_t> streamStoreBytes;
  // Slot fills of a step of at least streamSlotBytes write around the cache
  // up to streamSlotTimedBytes, and from there as each rank's timings of
  // its own fills say (shm::EngineConfig::streamSlotBytes, shm/FillChoice.hpp);
  // streamSlotBytes 0: never; streamSlotTimedBytes 0: always.
  int64_t streamSlotBytes = 16 << 10;
  int64_t streamSlotTimedBytes = 256 << 10;
  // Communication buffers handed out by allocateTensor (shm/Pool.hpp): at
  // most poolBytes per rank and group, in chunks of at least
  // poolChunkBytes; 0 turns the pool off.
  int64_t poolBytes = int64_t{4} << 30;
  int64_t poolChunkBytes = 64 << 20;
  // Deadline of every shared-memory wait; unset: the group's timeout.
  std::optional<int64_t> timeoutMs;
  int64_t traceEntries = 64;
  std::string traceDir = "/tmp/hsdp-trace";
  // Whether the ProcessGroupNCCL hsdp wraps hands NCCL a bf16 PREMUL_SUM's
  // factor intact (common/TorchCompat.hpp); unset: auto, decided per process
  // by src/hsdp_backend/_torch_compat.py (the release, else a probe).
  std::optional<bool> ncclBf16PremulSum;
  // Read by the Python side (the FSDP2 shim, the launcher, tests).
  bool fsdpShim = true;
  int64_t fsdpBucketBytes = 4 << 20;
  bool runBackendMap = false;
  bool runVerbose = false;

  static CpuRoute parseCpuRoute(const std::string& name);
  static const char* cpuRouteName(CpuRoute route);

  // From what size per rank collectives on pool buffers read peers' through
  // mappings: the setting, else kPooledReadBytes.
  size_t pooledReadBytes() const {
    return static_cast<size_t>(directReadBytes.value_or(kPooledReadBytes));
  }
  // Spinning only helps when every rank has a core to spin on.
  std::chrono::nanoseconds spin(int groupSize) const;
  // Non-temporal stores only pay once the call's data cannot stay in the
  // last-level cache anyway: each of the host's ranks reads its chunk of
  // every rank's input and writes its output, groupSize x (groupSize + 1)
  // outputs' worth. Auto: that cache / (groupSize x (groupSize + 1)); 0 when
  // the cache's size is unknown.
  size_t streamStoreBytesFor(int groupSize) const;
  // The largest cache cpu0 shares, from sysfs (what a VM's guest really
  // shares; sysconf can report the whole host's); 0 if unknown.
  static size_t lastLevelCacheBytes();
  std::chrono::milliseconds engineTimeout(std::chrono::milliseconds groupTimeout) const;

  // Throws std::invalid_argument naming the first field out of range.
  void validate() const;
};

} // namespace hsdp
