// selectAllReduce, the all-reduce's choice of algorithm, as a table: the
// sizes on each side of every threshold, and the settings that switch a
// path off; and the reduce-scatter's choice of stores.

#include "common/Config.hpp"
#include "shm/Engine.hpp"

#include <gtest/gtest.h>

#include <fstream>

namespace {

using hsdp::shm::AllReduceAlgorithm;

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

struct Row {
  size_t bytes;
  size_t slotBytes;
  size_t oneShotBytes;
  size_t directBytes;
  bool directReads;
  AllReduceAlgorithm expected;
};

TEST(AllReduceSelection, EachSideOfEveryThreshold) {
  const AllReduceAlgorithm one = AllReduceAlgorithm::OneShot, slots = AllReduceAlgorithm::Slots,
                           direct = AllReduceAlgorithm::Direct;
  const size_t d = 1152 * KiB; // the default direct threshold
  const Row rows[] = {
      {0, 4 * MiB, 32 * KiB, d, true, one},
      {32 * KiB, 4 * MiB, 32 * KiB, d, true, one},
      {32 * KiB + 1, 4 * MiB, 32 * KiB, d, true, slots},
      {d - 1, 4 * MiB, 32 * KiB, d, true, slots},
      {d, 4 * MiB, 32 * KiB, d, true, direct},
      {64 * MiB, 4 * MiB, 32 * KiB, d, true, direct},
      {d, 4 * MiB, 32 * KiB, d, false, slots},       // peers' memory not readable
      {64 * MiB, 4 * MiB, 32 * KiB, 0, true, slots}, // direct reads switched off
      {64 * KiB, 64 * KiB, MiB, d, true, one},       // one shot: the whole message in a slot
      {64 * KiB + 1, 64 * KiB, MiB, d, true, slots},
      {32 * KiB, 4 * MiB, 0, d, true, slots}, // one shot switched off
      {0, 4 * MiB, 0, d, true, one},          // nothing to move
  };
  for (const Row& r : rows) {
    hsdp::shm::EngineConfig config;
    config.oneShotBytes = r.oneShotBytes;
    config.directAllReduceBytes = r.directBytes;
    EXPECT_EQ(hsdp::shm::selectAllReduce(r.bytes, r.slotBytes, config, r.directReads), r.expected)
        << r.bytes << " bytes, slot " << r.slotBytes << ", one shot " << r.oneShotBytes
        << ", direct " << r.directBytes << (r.directReads ? "" : ", no direct reads");
  }
}

// Reduce-scatters write around the cache from Config's threshold: the
// setting when given (0: never), else the last-level cache over the bytes
// a call touches per output byte on the host.
TEST(StreamStoreSelection, SettingOrTheCacheOverTheCallsFootprint) {
  hsdp::Config c;
  const size_t cache = hsdp::Config::lastLevelCacheBytes();
  if (std::ifstream("/sys/devices/system/cpu/cpu0/cache/index0/size")) {
    EXPECT_GE(cache, size_t{32} * KiB); // at least an L1's worth where sysfs has caches
  }
  for (int ranks : {1, 2, 3, 8}) {
    const size_t w = static_cast<size_t>(ranks);
    EXPECT_EQ(c.streamStoreBytesFor(ranks), cache / (w * (w + 1))) << ranks << " ranks";
    EXPECT_EQ(
        hsdp::shm::engineConfigFor(c, ranks, std::chrono::seconds(1)).streamStoreBytes,
        cache / (w * (w + 1)));
  }
  c.streamStoreBytes = 12345;
  EXPECT_EQ(hsdp::shm::engineConfigFor(c, 2, std::chrono::seconds(1)).streamStoreBytes, 12345u);
  c.streamStoreBytes = 0;
  EXPECT_EQ(hsdp::shm::engineConfigFor(c, 8, std::chrono::seconds(1)).streamStoreBytes, 0u);
}

} // namespace
