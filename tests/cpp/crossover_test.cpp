// The direct-read crossover (shm/Crossover.hpp): the rule that picks it
// from timings, the agreement that makes every rank use rank 0's, and the
// measurement itself on a real group.

#include "common/Config.hpp"
#include "group.hpp"
#include "shm/Crossover.hpp"

#include <atomic>
#include <cstring>

namespace hsdp::shm {
namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

// Samples at 8, 32, 128 and 512 KiB (what timeDirectReads measures) where
// direct reads take `direct[i]` us and the slots `slots[i]`.
std::vector<ReadSample> samples(std::vector<int> direct, std::vector<int> slots) {
  const size_t sizes[] = {8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB};
  std::vector<ReadSample> out;
  for (size_t i = 0; i < direct.size(); ++i) {
    out.push_back(
        {sizes[i], std::chrono::microseconds(direct[i]), std::chrono::microseconds(slots[i])});
  }
  return out;
}

TEST(DirectReadCrossover, TheSmallestSizeFromWhichDirectReadsWinEverywhereAbove) {
  // Direct faster everywhere (the Intel VM): from the smallest size.
  EXPECT_EQ(directReadCrossover(samples({5, 6, 9, 30}, {9, 10, 15, 45})), 8 * KiB);
  // The slots faster up to 32 KiB: from 128 KiB.
  EXPECT_EQ(directReadCrossover(samples({9, 20, 10, 30}, {5, 10, 15, 45})), 128 * KiB);
  // A win below a loss does not count: every larger size must win too.
  EXPECT_EQ(directReadCrossover(samples({4, 20, 10, 30}, {5, 10, 15, 45})), 128 * KiB);
  // The slots faster at the largest size (the AMD VM): from 4 times it,
  // above the sizes where a repeated call's warm cache decides.
  EXPECT_EQ(directReadCrossover(samples({9, 20, 40, 90}, {5, 10, 20, 60})), 2 * MiB);
  EXPECT_EQ(directReadCrossover(samples({5, 6, 9, 50}, {9, 10, 15, 45})), 2 * MiB);
  // A tie keeps the slots (direct reads must be faster to be chosen).
  EXPECT_EQ(directReadCrossover(samples({5, 6, 9, 45}, {9, 10, 15, 45})), 2 * MiB);
  EXPECT_EQ(directReadCrossover(samples({5, 6}, {9, 10})), 8 * KiB);
  EXPECT_EQ(directReadCrossover(samples({9, 9}, {5, 5})), 128 * KiB);
  // Nothing measured: the constant used before groups measured it.
  EXPECT_EQ(directReadCrossover({}), 8 * KiB);
}

// Every rank adopts rank 0's answer, whatever its own clock says: ranks
// that chose by their own timings could disagree on the path of a call.
TEST(AgreeDirectReadBytes, EveryRankAdoptsRankZerosMeasurement) {
  Group g(3, testConfig(), /*directReads=*/true);
  std::atomic<int> measured{0};
  std::vector<size_t> agreed(3);
  expectNoErrors(g.run([&](Engine& e) {
    // Rank 0 sees direct reads win from 32 KiB, rank 1 nowhere, rank 2 from 8 KiB.
    const std::vector<ReadSample> mine = e.rank() == 0 ? samples({12, 9, 9}, {10, 10, 10})
        : e.rank() == 1                                ? samples({12, 12, 12}, {10, 10, 10})
                                                       : samples({9, 9, 9}, {10, 10, 10});
    agreed[e.rank()] = agreeDirectReadBytes(e, std::nullopt, [&] {
      ++measured;
      return mine;
    });
  }));
  EXPECT_EQ(measured.load(), 3) << "the measurement is a collective: every rank runs it";
  EXPECT_EQ(agreed, (std::vector<size_t>{32 * KiB, 32 * KiB, 32 * KiB}));
}

// A rank whose measurement fails aborts the engine, so the peers waiting in
// the measurement's collectives fail at once, not at their deadline (the
// failing process lives on: nothing else tells them).
TEST(AgreeDirectReadBytes, ARankWhoseMeasurementFailsFailsEveryRankAtOnce) {
  Group g(3, testConfig(std::chrono::seconds(60)), /*directReads=*/true);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = g.run([&](Engine& e) {
    agreeDirectReadBytes(e, std::nullopt, [&]() -> std::vector<ReadSample> {
      if (e.rank() == 1) {
        throw std::runtime_error("no clock here");
      }
      return timeDirectReads(e); // waits for rank 1 in its all-gathers
    });
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
      << "not the 60 s deadline";
  EXPECT_NE(errors[1].find("no clock here"), std::string::npos) << errors[1];
  for (const int r : {0, 2}) {
    EXPECT_NE(
        errors[r].find("measuring the direct-read threshold failed: no clock here"),
        std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// Factors of 4 from 8 KiB, the last bounded by 512 KiB, the slot, and 32
// MiB of output across the ranks.
TEST(DirectReadProbeSizes, BoundedByTheSlotAndTheOutput) {
  using Sizes = std::vector<size_t>;
  EXPECT_EQ(directReadProbeSizes(2, 4 * MiB), (Sizes{8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB}));
  EXPECT_EQ(directReadProbeSizes(64, 4 * MiB), (Sizes{8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB}));
  EXPECT_EQ(directReadProbeSizes(2, 100 * KiB), (Sizes{8 * KiB, 32 * KiB, 100 * KiB}));
  EXPECT_EQ(directReadProbeSizes(128, 4 * MiB), (Sizes{8 * KiB, 32 * KiB, 128 * KiB, 256 * KiB}));
  EXPECT_EQ(directReadProbeSizes(1024, 4 * MiB), (Sizes{8 * KiB, 32 * KiB}));
  EXPECT_EQ(directReadProbeSizes(4096, 4 * MiB), (Sizes{8 * KiB}));
}

// What rank 0 already knows (an earlier group of its process measured it)
// is adopted without measuring; what other ranks know does not count.
TEST(AgreeDirectReadBytes, RankZerosKnownValueSkipsTheMeasurement) {
  for (const bool rankZeroKnows : {true, false}) {
    Group g(2, testConfig(), /*directReads=*/true);
    std::atomic<int> measured{0};
    std::vector<size_t> agreed(2);
    expectNoErrors(g.run([&](Engine& e) {
      const std::optional<size_t> known = e.rank() == 0
          ? (rankZeroKnows ? std::optional<size_t>(0) : std::nullopt)
          : std::optional<size_t>(128 * KiB);
      agreed[e.rank()] = agreeDirectReadBytes(e, known, [&] {
        ++measured;
        return samples({9, 9}, {10, 10}); // direct from 8 KiB
      });
    }));
    EXPECT_EQ(measured.load(), rankZeroKnows ? 0 : 2) << rankZeroKnows;
    const size_t expected = rankZeroKnows ? 0 : 8 * KiB;
    EXPECT_EQ(agreed, (std::vector<size_t>{expected, expected})) << rankZeroKnows;
  }
}

// The measurement on a real group: both paths timed at every size up to
// the slot (smaller here than the 512 KiB it stops at), the threshold restored, and the group's
// collectives correct at the threshold rank 0's timings choose.
TEST(TimeDirectReads, TimesBothPathsUpToTheSlotAndLeavesTheEngineAsItWas) {
  const size_t slot = 256 * KiB;
  EngineConfig config = testConfig();
  config.directReadBytes = 12345;
  Group g(2, config, /*directReads=*/true, slot);
  std::vector<std::vector<ReadSample>> timings(2);
  std::vector<size_t> after(2), agreed(2);
  expectNoErrors(g.run([&](Engine& e) {
    timings[e.rank()] = timeDirectReads(e);
    after[e.rank()] = e.directReadBytes();
    agreed[e.rank()] = agreeDirectReadBytes(e, std::nullopt, [&] { return timeDirectReads(e); });
    e.setDirectReadBytes(agreed[e.rank()]);
    for (const size_t n : {size_t{4 * KiB}, size_t{8 * KiB}, size_t{40 * KiB}, slot, 3 * slot}) {
      std::vector<char> out(2 * n);
      for (size_t i = 0; i < n; ++i) {
        out[e.rank() * n + i] = static_cast<char>(i * 7 + e.rank() + 1);
      }
      e.allGather("all_gather", out.data() + e.rank() * n, out.data(), n);
      for (int q = 0; q < 2; ++q) {
        for (size_t i = 0; i < n; i += 997) {
          if (out[q * n + i] != static_cast<char>(i * 7 + q + 1)) {
            throw std::runtime_error(
                "all_gather of " + std::to_string(n) + " bytes: wrong byte from rank " +
                std::to_string(q));
          }
        }
      }
    }
  }));
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(timings[r].size(), 4u) << "rank " << r; // 8, 32, 128, 256 KiB
    const size_t sizes[] = {8 * KiB, 32 * KiB, 128 * KiB, slot};
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_EQ(timings[r][i].bytes, sizes[i]);
      EXPECT_GT(timings[r][i].direct.count(), 0);
      EXPECT_GT(timings[r][i].slots.count(), 0);
    }
    EXPECT_EQ(after[r], 12345u) << "rank " << r;
  }
  EXPECT_EQ(agreed[0], agreed[1]);
  EXPECT_TRUE(
      agreed[0] == 8 * KiB || agreed[0] == 32 * KiB || agreed[0] == 128 * KiB ||
      agreed[0] == slot || agreed[0] == 4 * slot)
      << agreed[0];
}

// Unset, the setting measures ordinary buffers' threshold and keeps the
// pool's fixed; set, one value serves both and nothing is measured.
TEST(DirectReadSetting, AutoMeasuresSetServesBothPaths) {
  hsdp::Config c;
  EngineConfig e = engineConfigFor(c, 2, std::chrono::seconds(60));
  EXPECT_TRUE(e.measureDirectReadBytes);
  EXPECT_EQ(e.pooledReadBytes, static_cast<size_t>(hsdp::Config::kPooledReadBytes));
  for (const int64_t set : {int64_t{0}, int64_t{4096}}) {
    c.directReadBytes = set;
    e = engineConfigFor(c, 2, std::chrono::seconds(60));
    EXPECT_FALSE(e.measureDirectReadBytes);
    EXPECT_EQ(e.directReadBytes, static_cast<size_t>(set));
    EXPECT_EQ(e.pooledReadBytes, static_cast<size_t>(set));
  }
}

} // namespace
} // namespace hsdp::shm
