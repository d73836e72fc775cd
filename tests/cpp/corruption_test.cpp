// The engine reading a segment that something other than hsdp wrote to.
// Everything a peer publishes (counters, signatures, piece tables, the
// failure record, the header) is untrusted input: a stray writer overwrites
// what one rank published, after that rank published it and before the
// others read it, and every rank must fail with a clear error, within its
// deadline, without reading or writing outside its own buffers (the asan
// build checks that part). Targeted cases first, then a seeded random
// mutator (HSDP_FUZZ_TRIALS trials, default 120; HSDP_FUZZ_SEED to replay).

#include "group.hpp"
#include "shm/Pool.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>

namespace hsdp::shm {
namespace {

using std::chrono::milliseconds;

constexpr milliseconds kDeadline{300};

// An all-gather of `pieces` read directly from each rank's memory.
void gatherPieces(Engine& e, size_t pieces = 3) {
  std::vector<std::vector<char>> mine(pieces, std::vector<char>(400, static_cast<char>(e.rank())));
  std::vector<Span> inputs;
  for (auto& m : mine) {
    inputs.push_back({m.data(), m.size()});
  }
  std::vector<std::vector<std::vector<char>>> out(
      e.size(), std::vector<std::vector<char>>(pieces, std::vector<char>(400)));
  std::vector<std::vector<Span>> outputs(e.size());
  for (int q = 0; q < e.size(); ++q) {
    for (auto& o : out[q]) {
      outputs[q].push_back({o.data(), o.size()});
    }
  }
  e.allGatherPieces("all_gather_coalesced", inputs, outputs);
}

// An all-gather or reduce-scatter whose inputs are pool buffers on every
// rank (each rank's engine gets a pool of its own on first use here).
void pooled(Engine& e, bool reduceScatter) {
  auto pool = std::make_shared<Pool>(8 << 20, 2 << 20);
  e.setPool(pool);
  const size_t n = 256;
  auto* in = static_cast<float*>(pool->allocate(n * e.size() * sizeof(float)));
  std::fill(in, in + n * e.size(), 1.0f);
  std::vector<float> out(n * e.size());
  if (reduceScatter) {
    e.reduceScatter("reduce_scatter", in, out.data(), n, DType::F32, RedOp::Sum, Scale{});
  } else {
    e.allGather("all_gather", in, out.data(), n * sizeof(float));
  }
}

void allReduceOnce(Engine& e) {
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  e.allReduce("all_reduce", x, 8, DType::F32, RedOp::Sum, Scale{});
}

// (A corrupted `reduced` is left to the mutator below: its owner overwrites
// it in the same step, so whether a peer reads the bad value first is a race.)
struct Case {
  const char* name;
  bool directReads;
  std::function<void(Engine&)> op;
  // Overwrites what rank 1 published for `step`.
  std::function<void(Segment&, uint64_t step)> corrupt;
  // What at least one rank's error says.
  const char* says;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

uint64_t* pieceTable(Segment& s, uint64_t step) {
  return reinterpret_cast<uint64_t*>(s.slot(1, static_cast<int>(step % kSlots)));
}

Signature& signature(Segment& s, uint64_t step) {
  return s.control(1).sig[step % kSlots];
}

std::vector<Case> cases() {
  return {
      {"PostedCounterAhead",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t step) { s.control(1).posted.store(step + 5); },
       "posted counter reads"},
      {"DoneCounterAhead",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t step) { s.control(1).done.store(step + 3); },
       "done counter reads"},
      {"SignatureCount",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t step) { signature(s, step).count = 1ull << 60; },
       "rank 1 called all_reduce(count=1152921504606846976"},
      {"SignatureKind",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t step) { signature(s, step).kind = 77; },
       "kind=77"},
      {"SignatureDtype",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t step) { signature(s, step).dtype = 200; },
       "dtype=200"},
      {"SignatureStep",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t step) { signature(s, step).step = step + 2; },
       "is not one hsdp writes"},
      {"PieceTableSize",
       true,
       [](Engine& e) { gatherPieces(e); },
       [](Segment& s, uint64_t step) { pieceTable(s, step)[1] = UINT64_MAX; },
       "rank 1's piece 0 has 18446744073709551615 bytes"},
      {"PieceTableAddress",
       true,
       [](Engine& e) { gatherPieces(e); },
       [](Segment& s, uint64_t step) { pieceTable(s, step)[2] = 8; },
       "Bad address"},
      {"SourceAddress",
       true,
       [](Engine& e) {
         std::vector<char> mine(1000, 'a'), all(1000 * e.size());
         e.allGather("all_gather", mine.data(), all.data(), mine.size());
       },
       [](Segment& s, uint64_t step) { signature(s, step).sourceAddress = 1ull << 63; },
       "Bad address"},
      {"PoolChunkReplaced",
       true,
       [](Engine& e) { pooled(e, /*reduceScatter=*/true); },
       [](Segment& s, uint64_t step) { signature(s, step).pool.inode += 1; },
       "is not the pool chunk its owner published"},
      {"PoolChunkIndexOutOfRange",
       true,
       [](Engine& e) { pooled(e, /*reduceScatter=*/false); },
       [](Segment& s, uint64_t step) { signature(s, step).pool.chunk = UINT32_MAX; },
       "rank 1's pool buffer (chunk 4294967295"},
      {"PoolOffsetMisaligned",
       true,
       [](Engine& e) { pooled(e, /*reduceScatter=*/true); },
       [](Segment& s, uint64_t step) { signature(s, step).pool.offset += 1; },
       "of its chunk, not on a 4-byte element"},
      {"FailureRecordOutOfRange",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t) {
         // An unterminated reason as well: it must not be read past its end.
         std::memset(s.header().brokenReason, 'x', sizeof s.header().brokenReason);
         s.header().brokenBy.store(1000);
       },
       "the segment's failure record names rank 999 of a group of 3"},
      {"HeaderMagic",
       false,
       allReduceOnce,
       [](Segment& s, uint64_t) { s.header().magic = 0; },
       "header was overwritten"},
  };
}

class Corruption : public ::testing::TestWithParam<Case> {};

TEST_P(Corruption, EveryRankFailsNamingIt) {
  const Case& c = GetParam();
  Group g(3, testConfig(kDeadline), c.directReads);
  // Two steps first: the corrupted step (3) is the first whose post must
  // read every peer's `done` (of step 1) before it writes its slot, so the
  // peers read rank 1's counters before rank 1 can store its own again. A
  // later step may find the peers' cache of `done` (Engine::post) still
  // good and read no counter until rank 1 has overwritten the corruption.
  expectNoErrors(g.run([](Engine& e) {
    for (int i = 0; i < 2; ++i) {
      e.barrier("barrier");
    }
  }));
  const auto start = std::chrono::steady_clock::now();
  const auto errors = g.runFrom(1, c.op, [&](uint64_t step) { c.corrupt(g.view(), step); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  bool said = false;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(errors[r], "threw: [rank " + std::to_string(r) + "/3]")) << errors[r];
    said = said || contains(errors[r], c.says);
  }
  EXPECT_TRUE(said) << "no rank said '" << c.says << "': " << errors[0] << "\n" << errors[2];
  // The group stays broken: the next call fails at once on every rank.
  for (const auto& e : g.run([](Engine& e) { e.barrier("barrier"); })) {
    EXPECT_TRUE(contains(e, "threw: ")) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Segment, Corruption, ::testing::ValuesIn(cases()), [](const auto& info) {
  return std::string(info.param.name);
});

TEST(CorruptionIgnored, APidOverwrittenAfterTheFirstStepIsNotUsed) {
  // Each rank keeps its own copy of the peers' pids from its first step on:
  // a pid overwritten later (here with init's) cannot redirect direct reads.
  Group g(2, testConfig(kDeadline), /*directReads=*/true);
  expectNoErrors(g.run([](Engine& e) { e.barrier("barrier"); }));
  reinterpret_cast<std::atomic<int32_t>*>(&g.view().control(1).pid)->store(1);
  expectNoErrors(g.run([](Engine& e) {
    std::vector<char> mine(1000, static_cast<char>('a' + e.rank())), all(2000);
    e.allGather("all_gather", mine.data(), all.data(), mine.size());
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i] != static_cast<char>('a' + i / 1000)) {
        throw std::runtime_error("byte " + std::to_string(i));
      }
    }
  }));
}

// ------------------------------------------------------------ random mutator

uint64_t envOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

// One of the engine's collectives on small, fixed inputs.
void runOp(Engine& e, int which) {
  std::vector<float> data(which == 1 ? 3000 : 16, 1.0f);
  std::vector<char> bytes(1000, 'b'), all(1000 * e.size());
  switch (which) {
    case 0:
    case 1: // one-shot, then two rounds
      e.allReduce("all_reduce", data.data(), data.size(), DType::F32, RedOp::Sum, Scale{});
      break;
    case 2: {
      std::vector<float> in(16 * e.size(), 1.0f);
      e.reduceScatter(
          "reduce_scatter", in.data(), data.data(), 16, DType::F32, RedOp::Max, Scale{});
      break;
    }
    case 3:
      e.allGather("all_gather", bytes.data(), all.data(), bytes.size());
      break;
    case 4:
      e.broadcast("broadcast", bytes.data(), bytes.size(), e.size() - 1);
      break;
    case 5:
      e.barrier("barrier");
      break;
    case 7:
      pooled(e, /*reduceScatter=*/false);
      break;
    case 8:
      pooled(e, /*reduceScatter=*/true);
      break;
    default:
      if (e.directReads()) {
        gatherPieces(e, 2);
      } else {
        e.barrier("barrier");
      }
  }
}

// Overwrites one published word of rank `victim` with a value drawn from
// those a stray writer or a bit flip would leave.
std::string mutate(Segment& s, int victim, uint64_t step, std::mt19937_64& rng) {
  RankControl& c = s.control(victim);
  Signature& sig = c.sig[(step + rng() % 2) % kSlots]; // this step's slot, or the previous one
  auto value = [&](uint64_t orig) -> uint64_t {
    switch (rng() % 8) {
      case 0:
        return 0;
      case 1:
        return orig - 1;
      case 2:
        return orig + 1;
      case 3:
        return orig + 2 + rng() % 100;
      case 4:
        return UINT64_MAX;
      case 5:
        return orig ^ (1ull << (rng() % 64));
      case 6:
        return rng();
      default:
        return orig;
    }
  };
  // Addresses are replaced only with ones that map nothing here: ranks are
  // threads of one process, so a near miss would read this process's own
  // memory, which a peer's address in another process never could.
  auto address = [&]() -> uint64_t {
    const uint64_t unmapped[] = {0, 8, UINT64_MAX, (1ull << 63) | rng()};
    return unmapped[rng() % 4];
  };
  // A forged counter one ahead is within the protocol's bound, so nothing
  // can reject it, and it lets a peer read a slot its owner is still
  // writing: a data race by construction, which ThreadSanitizer rightly
  // reports. Its build draws two ahead (rejected) instead; the plain and
  // asan builds draw both.
  auto counter = [&](uint64_t orig) {
    uint64_t v = value(orig);
#if defined(__SANITIZE_THREAD__)
    if (v == orig + 1) {
      v = orig + 2;
    }
#endif
    return v;
  };
  switch (rng() % 14) {
    case 0:
      c.posted.store(counter(c.posted.load()));
      return "posted";
    case 1:
      c.reduced.store(counter(c.reduced.load()));
      return "reduced";
    case 2:
      c.done.store(counter(c.done.load()));
      return "done";
    case 3:
      sig.step = value(sig.step);
      return "signature step";
    case 4:
      sig.opSeq = value(sig.opSeq);
      return "signature opSeq";
    case 5:
      sig.count = value(sig.count);
      return "signature count";
    case 6:
      sig.kind = static_cast<uint32_t>(value(sig.kind));
      return "signature kind";
    case 7:
      sig.dtype = static_cast<uint32_t>(value(sig.dtype));
      return "signature dtype";
    case 8:
      sig.pieces = value(sig.pieces);
      return "signature pieces";
    case 9:
      sig.sourceAddress = address();
      return "signature sourceAddress";
    case 10: {
      auto* table = reinterpret_cast<uint64_t*>(s.slot(victim, static_cast<int>(step % kSlots)));
      const size_t word = rng() % 4;
      table[word] = word % 2 == 0 ? address() : value(table[word]);
      return "piece table word " + std::to_string(word);
    }
    case 11: {
      // A pool reference names a descriptor in its owner's process: here
      // ranks are threads of one process, so only values no chunk has are
      // drawn for fd and inode (the size and offset checks bound the rest).
      const uint64_t bad[] = {0, 1, UINT32_MAX, 1ull << 40};
      switch (rng() % 5) {
        case 0:
          sig.pool.chunk = static_cast<uint32_t>(value(sig.pool.chunk));
          return "pool chunk";
        case 1:
          sig.pool.fd = static_cast<int32_t>(bad[rng() % 4]) | 1 << 30;
          return "pool fd";
        case 2:
          sig.pool.inode = bad[rng() % 4];
          return "pool inode";
        case 3:
          sig.pool.chunkBytes = value(sig.pool.chunkBytes);
          return "pool chunk bytes";
        default:
          sig.pool.offset = value(sig.pool.offset);
          return "pool offset";
      }
    }
    case 12:
      sig.pool = PoolRef{};
      return "pool reference cleared";
    default:
      s.header().brokenBy.store(static_cast<uint32_t>(value(0)));
      return "failure record";
  }
}

TEST(CorruptionFuzz, EveryRankReturnsOrEveryRankFailsClearly) {
  const uint64_t seed = envOr("HSDP_FUZZ_SEED", std::random_device{}());
  const uint64_t trials = envOr("HSDP_FUZZ_TRIALS", 120);
  std::mt19937_64 rng(seed);
  std::printf(
      "[fuzz] seed %llu, %llu trials (HSDP_FUZZ_SEED replays)\n",
      static_cast<unsigned long long>(seed),
      static_cast<unsigned long long>(trials));
  int failedTrials = 0;
  for (uint64_t t = 0; t < trials; ++t) {
    const int W = 2 + static_cast<int>(rng() % 3);
    const bool direct = rng() % 2 == 0;
    const int victim = static_cast<int>(rng() % W);
    const int which = static_cast<int>(rng() % 9);
    const int warmup = static_cast<int>(rng() % 4);
    Group g(W, testConfig(milliseconds(200)), direct);
    expectNoErrors(g.run([&](Engine& e) {
      for (int i = 0; i < warmup; ++i) {
        e.barrier("barrier");
      }
    }));
    std::string what;
    const auto start = std::chrono::steady_clock::now();
    // The op, then a barrier: a rank that finished the op before a peer
    // failed learns of the failure at the barrier.
    const auto errors = g.runFrom(
        victim,
        [&](Engine& e) {
          runOp(e, which);
          e.barrier("barrier");
        },
        [&](uint64_t step) { what = mutate(g.view(), victim, step, rng); });
    const auto took = std::chrono::steady_clock::now() - start;
    const std::string trial = "trial " + std::to_string(t) + " (W=" + std::to_string(W) + ", op " +
        std::to_string(which) + (direct ? ", direct" : ", slots") + ", rank " +
        std::to_string(victim) + "'s " + what + ")";
    EXPECT_LT(took, std::chrono::seconds(5)) << trial;
    int threw = 0;
    for (int r = 0; r < W; ++r) {
      if (!errors[r].empty()) {
        ++threw;
        EXPECT_TRUE(contains(errors[r], "threw: [rank " + std::to_string(r) + "/"))
            << trial << ": " << errors[r];
      }
    }
    // A rank can finish its last call before a peer detects a forgery that
    // the protocol's bound admits (+1); the group is then broken for it too:
    // its next call fails at once.
    if (threw > 0 && threw < W) {
      for (const auto& after : g.run([](Engine& e) { e.barrier("barrier"); })) {
        EXPECT_TRUE(contains(after, "unusable")) << trial << ": " << after;
      }
    }
    failedTrials += threw > 0;
  }
  std::printf(
      "[fuzz] %d of %llu trials failed on every rank, the others completed on every rank\n",
      failedTrials,
      static_cast<unsigned long long>(trials));
}

} // namespace
} // namespace hsdp::shm
