// The pool of communication buffers (csrc/shm/Pool.hpp) and the engine's
// calls on pool buffers: results bitwise those of the ordinary path, the
// pooled path taken only when every rank's input is a pool buffer, and a
// bad reference in the segment failing the call instead of being followed.

#include "group.hpp"
#include "shm/Pool.hpp"

#include <gtest/gtest.h>

#include <dirent.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace hsdp::shm {
namespace {

size_t devShmEntries() {
  size_t n = 0;
  if (DIR* d = opendir("/dev/shm")) {
    while (readdir(d) != nullptr) {
      ++n;
    }
    closedir(d);
  }
  return n;
}

TEST(Pool, ReusesAReleasedBufferOfTheSameSizeAndFindsViews) {
  const size_t before = devShmEntries();
  Pool pool(64 << 20, 4 << 20);
  char* a = static_cast<char*>(pool.allocate(1000));
  char* b = static_cast<char*>(pool.allocate(1000));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % Pool::kAlignment, 0u);
  EXPECT_GE(static_cast<size_t>(std::abs(b - a)), 1000u);
  const PoolRef whole = pool.find(a, 1000);
  const PoolRef view = pool.find(a + 100, 200);
  ASSERT_TRUE(whole);
  ASSERT_TRUE(view);
  EXPECT_EQ(view.chunk, whole.chunk);
  EXPECT_EQ(view.offset, whole.offset + 100);
  int local = 0;
  EXPECT_FALSE(pool.find(&local, sizeof local));
  pool.release(a);
  EXPECT_EQ(pool.allocate(1000), a);
  EXPECT_EQ(pool.stats().chunks, 1u);
  // Chunks are anonymous: nothing appears in /dev/shm.
  EXPECT_EQ(devShmEntries(), before);
}

TEST(Pool, RefusesPastItsBoundButServesFromLargerReleasedBuffers) {
  Pool pool(4 << 20, 2 << 20);        // 4 MiB of chunks at most
  void* big = pool.allocate(3 << 20); // a chunk of 4 MiB, 1 MiB of it left
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(pool.allocate(2 << 20), nullptr);
  EXPECT_EQ(pool.stats().refused, 1u);
  pool.release(big);
  EXPECT_EQ(pool.allocate(3 << 19), big); // 1.5 MiB: neither the rest nor a new chunk
  EXPECT_EQ(pool.stats().chunks, 1u);
  EXPECT_EQ(pool.stats().refused, 1u);
}

TEST(Pool, APeerMapsAChunkAndSeesItsBytes) {
  Pool pool(8 << 20, 2 << 20);
  char* a = static_cast<char*>(pool.allocate(4096));
  std::memset(a, 0x5a, 4096);
  const PoolRef ref = pool.find(a, 4096);
  PeerChunk mapped(static_cast<int32_t>(getpid()), ref);
  EXPECT_EQ(mapped.base()[ref.offset], 0x5a);
  a[1] = 0x11;
  EXPECT_EQ(mapped.base()[ref.offset + 1], 0x11); // the same pages, not a copy
  PoolRef stale = ref;
  stale.inode += 1;
  EXPECT_THROW(PeerChunk(static_cast<int32_t>(getpid()), stale), std::runtime_error);
}

// W pools, one per rank, and the engines told about them.
struct Pools {
  explicit Pools(Group& g) {
    for (int r = 0; r < g.size(); ++r) {
      pools.push_back(std::make_shared<Pool>(256 << 20, 2 << 20));
      g.engine(r).setPool(pools.back());
    }
  }
  // A buffer of `bytes` from rank r's pool (or ordinary memory when !pooled).
  char* buffer(int r, size_t bytes, bool pooled) {
    if (pooled) {
      return static_cast<char*>(pools[r]->allocate(bytes));
    }
    ordinary.emplace_back(bytes + 1);
    return ordinary.back().data();
  }
  std::vector<std::shared_ptr<Pool>> pools;
  std::vector<std::vector<char>> ordinary;
};

std::vector<float> values(int rank, size_t n) {
  std::mt19937 gen(1234 + rank);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = d(gen);
  }
  return v;
}

// Every rank runs each call twice, on ordinary memory and with its input in
// its pool when `pooled(rank)`, and compares the results bitwise.
void checkPooledCalls(
    int size,
    const std::function<bool(int)>& pooled,
    bool expectPooledPath,
    EngineConfig config = testConfig()) {
  Group g(size, config, /*directReads=*/true);
  Pools pools(g);
  std::mutex mutex; // Pools' vectors are shared by the rank threads
  auto buffer = [&](int r, size_t bytes, bool inPool) {
    std::lock_guard<std::mutex> lock(mutex);
    return pools.buffer(r, bytes, inPool);
  };
  expectNoErrors(g.run([&](Engine& e) {
    const int W = e.size(), me = e.rank();
    const bool mine = pooled(me);
    // Floats a rank: below the direct-read threshold (testConfig: 512 bytes)
    // the pooled path is not tried.
    for (size_t n : {size_t{1}, size_t{37}, size_t{1000}, size_t{5000}}) {
      // reduce-scatter, float, AVG as SUM and one division
      const auto in = values(me, W * n);
      const size_t inBytes = W * n * sizeof(float);
      char* inPool = buffer(me, inBytes, mine);
      std::memcpy(inPool, in.data(), inBytes);
      std::vector<float> ref(n), got(n);
      const Scale avg{Scale::Kind::Divide, static_cast<double>(W)};
      e.reduceScatter("rs_ordinary", in.data(), ref.data(), n, DType::F32, RedOp::Sum, avg);
      e.reduceScatter("rs_pooled", inPool, got.data(), n, DType::F32, RedOp::Sum, avg);
      if (std::memcmp(ref.data(), got.data(), n * sizeof(float)) != 0) {
        throw std::runtime_error("reduce_scatter of " + std::to_string(n) + " differs");
      }
      // all-gather, out of place and in place
      const size_t bytes = n * sizeof(float);
      std::vector<char> expect(W * bytes);
      const auto mineValues = values(me, n);
      e.allGather("ag_ordinary", mineValues.data(), expect.data(), bytes);
      char* src = buffer(me, bytes, mine);
      std::memcpy(src, mineValues.data(), bytes);
      std::vector<char> out(W * bytes);
      e.allGather("ag_pooled", src, out.data(), bytes);
      char* flat = buffer(me, W * bytes, mine);
      std::memcpy(flat + me * bytes, mineValues.data(), bytes);
      e.allGather("ag_pooled_in_place", flat + me * bytes, flat, bytes);
      if (out != expect || std::memcmp(flat, expect.data(), W * bytes) != 0) {
        throw std::runtime_error("all_gather of " + std::to_string(bytes) + " bytes differs");
      }
      // all-reduce in place, AVG (n elements: one-shot and two-round sizes)
      std::vector<float> ordinary = values(me, n);
      auto* data = reinterpret_cast<float*>(buffer(me, bytes, mine));
      std::memcpy(data, ordinary.data(), bytes);
      e.allReduce("ar_ordinary", ordinary.data(), n, DType::F32, RedOp::Sum, avg);
      e.allReduce("ar_pooled", data, n, DType::F32, RedOp::Sum, avg);
      if (std::memcmp(data, ordinary.data(), bytes) != 0) {
        throw std::runtime_error("all_reduce of " + std::to_string(n) + " differs");
      }
      // broadcast from every root
      for (int root = 0; root < W; ++root) {
        char* b = buffer(me, bytes, mine);
        const auto rootValues = values(root, n);
        std::memset(b, 0, bytes);
        if (me == root) {
          std::memcpy(b, rootValues.data(), bytes);
        }
        e.broadcast("broadcast_pooled", b, bytes, root);
        if (std::memcmp(b, rootValues.data(), bytes) != 0) {
          throw std::runtime_error("broadcast from " + std::to_string(root) + " differs");
        }
      }
    }
  }));
  for (int r = 0; r < size; ++r) {
    // Per size from the direct-read threshold on (1000 and 5000 floats),
    // 3 all-gathers and reduce-scatters, 1 all-reduce and W broadcasts
    // pooled on every rank, or none at all.
    const uint64_t pooledPerSize = 4 + static_cast<uint64_t>(size);
    EXPECT_EQ(g.engine(r).pooledCalls(), expectPooledPath ? 2 * pooledPerSize : 0u) << "rank " << r;
  }
}

TEST(PooledCalls, EveryRankPooledReadsPeersThroughMappingsWithTheSameResult) {
  for (int size : {2, 3, 4}) {
    checkPooledCalls(
        size, [](int) { return true; }, true);
  }
}

// Pool buffers have their own threshold: a machine where process_vm_readv
// never pays (directReadBytes 0) still reads pool buffers through mappings,
// and pooledReadBytes 0 turns only those off.
TEST(PooledCalls, PoolBuffersHaveTheirOwnThreshold) {
  EngineConfig noProcessReads = testConfig();
  noProcessReads.directReadBytes = 0;
  checkPooledCalls(
      2, [](int) { return true; }, true, noProcessReads);
  EngineConfig noPooledReads = testConfig();
  noPooledReads.pooledReadBytes = 0;
  checkPooledCalls(
      2, [](int) { return true; }, false, noPooledReads);
}

TEST(PooledCalls, SomeRanksPooledTakeTheOrdinaryPathWithTheSameResult) {
  checkPooledCalls(
      2, [](int r) { return r == 0; }, false);
  checkPooledCalls(
      3, [](int r) { return r != 1; }, false);
  checkPooledCalls(
      4, [](int r) { return r == 3; }, false);
}

TEST(PooledCalls, WithoutDirectReadsNoRankReadsPeersMemory) {
  Group g(2, testConfig(), /*directReads=*/false);
  Pools pools(g);
  expectNoErrors(g.run([&](Engine& e) {
    const size_t n = 4096;
    char* in = static_cast<char*>(pools.pools[e.rank()]->allocate(n));
    std::memset(in, e.rank() + 1, n);
    std::vector<char> out(2 * n);
    e.allGather("all_gather", in, out.data(), n);
    if (out[0] != 1 || out[n] != 2) {
      throw std::runtime_error("wrong bytes");
    }
  }));
  EXPECT_EQ(g.engine(0).pooledCalls(), 0u);
}

TEST(PooledCalls, AReferenceOutsideItsChunkFailsEveryRank) {
  Group g(2, testConfig(std::chrono::seconds(10)), /*directReads=*/true);
  Pools pools(g);
  const size_t n = 4096;
  std::vector<char*> in(2);
  for (int r = 0; r < 2; ++r) {
    in[r] = static_cast<char*>(pools.pools[r]->allocate(n));
  }
  // Rank 0 posts first; its published reference is then made to point past
  // its chunk, as a stray writer could.
  const auto errors = g.runFrom(
      0,
      [&](Engine& e) {
        std::vector<char> out(2 * n);
        e.allGather("all_gather", in[e.rank()], out.data(), n);
      },
      [&](uint64_t step) {
        auto& sig = g.view().control(0).sig[step % kSlots];
        sig.pool.offset = sig.pool.chunkBytes - 16;
      });
  EXPECT_TRUE(contains(errors[1], "rank 0's pool buffer")) << errors[1];
  EXPECT_TRUE(contains(errors[1], "overwritten")) << errors[1];
  EXPECT_TRUE(contains(errors[0], "threw")) << errors[0];
}

} // namespace
} // namespace hsdp::shm
