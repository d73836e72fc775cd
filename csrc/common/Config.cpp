#include "common/Config.hpp"

#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace hsdp {

namespace {

void expect(bool ok, const char* field, const std::string& what, int64_t got) {
  if (!ok) {
    throw std::invalid_argument(
        std::string(field) + ": expected " + what + ", got " + std::to_string(got));
  }
}

} // namespace

// sysconf's LEVEL3_CACHE_SIZE reports 320 MiB on the 2-core VM whose sysfs
// (and lscpu) says 32 MiB.
size_t Config::lastLevelCacheBytes() {
  size_t largest = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream file(
        "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string text;
    if (!(file >> text) || text.empty()) {
      continue;
    }
    size_t bytes = 0;
    try {
      bytes = std::stoull(text);
    } catch (const std::exception&) {
      continue;
    }
    const char unit = text.back();
    bytes <<= unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
    largest = std::max(largest, bytes);
  }
  return largest;
}

Config::CpuRoute Config::parseCpuRoute(const std::string& name) {
  for (CpuRoute e : {CpuRoute::Auto, CpuRoute::Shm, CpuRoute::Gloo}) {
    if (name == cpuRouteName(e)) {
      return e;
    }
  }
  throw std::invalid_argument("cpu_route: expected one of auto, shm, gloo, got '" + name + "'");
}

const char* Config::cpuRouteName(CpuRoute route) {
  switch (route) {
    case CpuRoute::Auto:
      return "auto";
    case CpuRoute::Shm:
      return "shm";
    case CpuRoute::Gloo:
      return "gloo";
  }
  return "?";
}

std::chrono::nanoseconds Config::spin(int groupSize) const {
  if (spinUs) {
    return std::chrono::microseconds(*spinUs);
  }
  const unsigned cores = std::thread::hardware_concurrency();
  return std::chrono::microseconds(cores == 0 || groupSize <= static_cast<int>(cores) ? 20 : 0);
}

size_t Config::streamStoreBytesFor(int groupSize) const {
  if (streamStoreBytes) {
    return static_cast<size_t>(*streamStoreBytes);
  }
  static const size_t cache = lastLevelCacheBytes();
  const size_t ranks = static_cast<size_t>(std::max(groupSize, 1));
  return cache / (ranks * (ranks + 1));
}

std::chrono::milliseconds Config::engineTimeout(std::chrono::milliseconds groupTimeout) const {
  return timeoutMs ? std::chrono::milliseconds(*timeoutMs) : groupTimeout;
}

void Config::validate() const {
  expect(
      slotBytes >= (64 << 10) && slotBytes % 64 == 0,
      "slot_bytes",
      "an integer >= 65536 and a multiple of 64",
      slotBytes);
  if (spinUs) {
    expect(*spinUs >= 0, "spin_us", "an integer >= 0 (or None: auto)", *spinUs);
  }
  expect(yieldUs >= 0, "yield_us", "an integer >= 0", yieldUs);
  expect(oneShotBytes >= 0, "one_shot_bytes", "an integer >= 0", oneShotBytes);
  if (directReadBytes) {
    expect(
        *directReadBytes >= 0,
        "direct_read_bytes",
        "an integer >= 0 (or None: auto)",
        *directReadBytes);
  }
  expect(
      directAllReduceBytes >= 0,
      "direct_all_reduce_bytes",
      "an integer >= 0",
      directAllReduceBytes);
  if (streamStoreBytes) {
    expect(
        *streamStoreBytes >= 0,
        "stream_store_bytes",
        "an integer >= 0 (or None: auto)",
        *streamStoreBytes);
  }
  expect(streamSlotBytes >= 0, "stream_slot_bytes", "an integer >= 0", streamSlotBytes);
  expect(
      streamSlotTimedBytes >= 0,
      "stream_slot_timed_bytes",
      "an integer >= 0",
      streamSlotTimedBytes);
  expect(poolBytes >= 0, "pool_bytes", "an integer >= 0", poolBytes);
  expect(
      poolChunkBytes >= (1 << 20),
      "pool_chunk_bytes",
      "an integer >= 1048576 (1 MiB)",
      poolChunkBytes);
  if (timeoutMs) {
    expect(*timeoutMs >= 1, "timeout_ms", "an integer >= 1 (or None: the group's)", *timeoutMs);
  }
  expect(
      traceEntries >= 0 && traceEntries <= 1000000,
      "trace_entries",
      "an integer from 0 to 1000000",
      traceEntries);
  if (traceDir.find_first_not_of(" \t\n") == std::string::npos) {
    throw std::invalid_argument("trace_dir: expected a directory path, got '" + traceDir + "'");
  }
  expect(fsdpBucketBytes >= 1, "fsdp_bucket_bytes", "an integer >= 1", fsdpBucketBytes);
}

} // namespace hsdp
