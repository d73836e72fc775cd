// The shared-memory engine (csrc/shm) on its own: W ranks as threads of this
// process over one segment. Every result is compared bitwise with a scalar
// reference written independently of the kernels: the reduction in rank order
// in the accumulation type (fp32 for bf16/fp16), scaled there, rounded once.
// Run plain and under ThreadSanitizer and ASan+UBSan by scripts/cpp_tests.sh.

#include "group.hpp"
#include "shm/Reduce.hpp"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace hsdp::shm {
namespace {

// ------------------------------------------------------------ references

struct BF16 {
  uint16_t bits;
};

float bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The bf16 nearest to f, ties to the even one: chosen between the two bf16
// neighbours of f by their distance in double (no bit tricks, unlike the kernel).
uint16_t floatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t down = static_cast<uint16_t>(u >> 16); // toward zero
  const uint16_t up = static_cast<uint16_t>(down + 1);  // away from zero
  const double dd = std::fabs(static_cast<double>(f) - bf16ToFloat(down));
  const double du = std::fabs(static_cast<double>(f) - bf16ToFloat(up));
  if (dd != du) {
    return dd < du ? down : up;
  }
  return (down & 1) ? up : down;
}

// Element type -> accumulation type and conversions.
template <typename T>
struct Traits {
  using Acc = T;
  static Acc load(T v) {
    return v;
  }
  static T store(Acc a) {
    return a;
  }
};
template <>
struct Traits<BF16> {
  using Acc = float;
  static float load(BF16 v) {
    return bf16ToFloat(v.bits);
  }
  static BF16 store(float a) {
    return BF16{floatToBf16(a)};
  }
};
template <>
struct Traits<_Float16> {
  using Acc = float;
  static float load(_Float16 v) {
    return static_cast<float>(v);
  }
  static _Float16 store(float a) {
    return static_cast<_Float16>(a);
  }
};

template <typename A>
A combine(RedOp op, A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>; // torch's integers wrap around
    switch (op) {
      case RedOp::Sum:
        return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
      case RedOp::Prod:
        return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
      case RedOp::BAnd:
        return a & b;
      case RedOp::BOr:
        return a | b;
      case RedOp::BXor:
        return a ^ b;
      default:
        break;
    }
  } else {
    if (op == RedOp::Sum) {
      return a + b;
    }
    if (op == RedOp::Prod) {
      return a * b;
    }
  }
  return op == RedOp::Min ? std::min(a, b) : std::max(a, b); // inputs have no NaN, no zero
}

template <typename T>
T referenceReduce(const std::vector<T>& values, RedOp op, Scale scale) {
  using A = typename Traits<T>::Acc;
  A acc = Traits<T>::load(values[0]);
  for (size_t r = 1; r < values.size(); ++r) {
    acc = combine<A>(op, acc, Traits<T>::load(values[r]));
  }
  if constexpr (std::is_integral_v<A>) {
    const auto factor = static_cast<int64_t>(scale.value);
    if (scale.kind == Scale::Kind::Multiply) {
      acc = static_cast<A>(static_cast<int64_t>(acc) * factor);
    } else if (scale.kind == Scale::Kind::Divide) {
      acc = static_cast<A>(static_cast<int64_t>(acc) / factor); // truncates toward zero
    }
  } else {
    if (scale.kind == Scale::Kind::Multiply) {
      acc = acc * static_cast<A>(scale.value);
    } else if (scale.kind == Scale::Kind::Divide) {
      acc = acc / static_cast<A>(scale.value);
    }
  }
  return Traits<T>::store(acc);
}

// Rank r's i-th input: deterministic, nonzero, no NaN; small for products.
template <typename T>
T input(int rank, size_t i, RedOp op) {
  // splitmix64 of (rank, i, op): cheap and well mixed.
  uint64_t bits = rank * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull + static_cast<int>(op);
  bits = (bits ^ (bits >> 30)) * 0xbf58476d1ce4e5b9ull;
  bits = (bits ^ (bits >> 27)) * 0x94d049bb133111ebull;
  bits ^= bits >> 31;
  if constexpr (std::is_integral_v<T>) {
    if (op == RedOp::Prod) {
      return static_cast<T>(1 + bits % 3);
    }
    return static_cast<T>(bits);
  } else {
    const double magnitude = 0.25 + static_cast<double>(bits % 1000003) / 1000003.0 * 7.75;
    const double v = (bits >> 40) & 1 ? -magnitude : magnitude;
    if constexpr (std::is_same_v<T, BF16>) {
      return BF16{floatToBf16(static_cast<float>(v))};
    } else {
      return static_cast<T>(v);
    }
  }
}

template <typename T>
bool sameBits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <typename T>
constexpr DType dtypeOf() {
  if constexpr (std::is_same_v<T, float>)
    return DType::F32;
  else if constexpr (std::is_same_v<T, double>)
    return DType::F64;
  else if constexpr (std::is_same_v<T, BF16>)
    return DType::BF16;
  else if constexpr (std::is_same_v<T, _Float16>)
    return DType::F16;
  else if constexpr (std::is_same_v<T, int8_t>)
    return DType::I8;
  else if constexpr (std::is_same_v<T, uint8_t>)
    return DType::U8;
  else if constexpr (std::is_same_v<T, int16_t>)
    return DType::I16;
  else if constexpr (std::is_same_v<T, int32_t>)
    return DType::I32;
  else
    return DType::I64;
}

std::vector<RedOp> opsFor(DType d) {
  std::vector<RedOp> ops{RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max};
  if (!isFloating(d)) {
    ops.insert(ops.end(), {RedOp::BAnd, RedOp::BOr, RedOp::BXor});
  }
  return ops;
}

std::vector<Scale> scalesFor(DType d, RedOp op, int size) {
  std::vector<Scale> scales{Scale{}};
  if (op == RedOp::Sum) {
    scales.push_back(Scale{Scale::Kind::Divide, static_cast<double>(size)}); // AVG
    if (isFloating(d)) {
      scales.push_back(Scale{Scale::Kind::Multiply, 0.37}); // PREMUL_SUM
    }
  }
  return scales;
}

// Element counts: empty, one, odd; then exactly a reduce-scatter step's piece,
// exactly one slot, several slots.
std::vector<size_t> smallCounts() {
  return {0, 1, 7};
}
std::vector<size_t> largeCounts(size_t elementSize, int size) {
  const size_t slot = kSlotBytes / elementSize;
  return {slot / size, slot, 2 * slot + slot / 2 + 3};
}
std::vector<size_t> countsFor(size_t elementSize, int size) {
  auto counts = smallCounts();
  for (size_t n : largeCounts(elementSize, size)) {
    counts.push_back(n);
  }
  return counts;
}

// ----------------------------------------------------------- reductions

// reduceScatter and allReduce on dtype T: every op and scale on small counts;
// with `large`, SUM (and its scales) on counts of one and several slots (the
// data paths do not depend on the op; the kernels are covered by the small ones).
template <typename T, bool large>
std::string checkReductions(Engine& e) {
  const int W = e.size(), me = e.rank();
  const DType d = dtypeOf<T>();
  for (RedOp op : large ? std::vector<RedOp>{RedOp::Sum} : opsFor(d)) {
    for (const Scale& scale : scalesFor(d, op, W)) {
      for (size_t n : large ? largeCounts(sizeof(T), W) : smallCounts()) {
        auto expected = [&](size_t i) {
          std::vector<T> column;
          for (int r = 0; r < W; ++r) {
            column.push_back(input<T>(r, i, op));
          }
          return referenceReduce(column, op, scale);
        };
        const std::string what = std::string(dtypeName(d)) + " " + redOpName(op) + " scale " +
            std::to_string(static_cast<int>(scale.kind)) + " count " + std::to_string(n);
        // reduce-scatter: rank r's input holds W chunks of n; chunk q goes to q.
        std::vector<T> in(W * n), out(n);
        for (size_t i = 0; i < W * n; ++i) {
          in[i] = input<T>(me, i, op);
        }
        e.reduceScatter("reduce_scatter", in.data(), out.data(), n, d, op, scale);
        for (size_t i = 0; i < n; ++i) {
          if (!sameBits(out[i], expected(me * n + i))) {
            return "reduce_scatter " + what + ": element " + std::to_string(i) + " differs";
          }
        }
        // all-reduce in place (one-shot below oneShotBytes, two rounds above).
        std::vector<T> data(W * n);
        for (size_t i = 0; i < data.size(); ++i) {
          data[i] = input<T>(me, i, op);
        }
        e.allReduce("all_reduce", data.data(), data.size(), d, op, scale);
        for (size_t i = 0; i < data.size(); ++i) {
          if (!sameBits(data[i], expected(i))) {
            return "all_reduce " + what + ": element " + std::to_string(i) + " differs";
          }
        }
      }
    }
  }
  return "";
}

std::string checkEveryDtype(Engine& e) {
  for (const auto& check :
       {checkReductions<float, false>,
        checkReductions<double, false>,
        checkReductions<BF16, false>,
        checkReductions<_Float16, false>,
        checkReductions<int8_t, false>,
        checkReductions<uint8_t, false>,
        checkReductions<int16_t, false>,
        checkReductions<int32_t, false>,
        checkReductions<int64_t, false>,
        checkReductions<float, true>,
        checkReductions<BF16, true>,
        checkReductions<_Float16, true>,
        checkReductions<int64_t, true>}) {
    if (auto why = check(e); !why.empty()) {
      return why;
    }
  }
  return "";
}

class EngineWorlds : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(EngineWorlds, ReductionsMatchTheScalarReferenceBitwise) {
  const auto [size, direct] = GetParam();
  Group g(size, testConfig(), direct);
  std::vector<std::string> why(size);
  expectNoErrors(g.run([&](Engine& e) { why[e.rank()] = checkEveryDtype(e); }));
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(why[r], "") << "rank " << r;
  }
}

// ------------------------------------------------------------ data movement

// The rendezvous' probe: reading this process's own memory works and says
// nothing; a pid that is gone says why, with the system call's error.
TEST(DirectReadProbe, SaysWhyAReadFails) {
  const uint64_t value = 0x1234;
  uint64_t got = 0;
  EXPECT_EQ(
      whyCannotReadProcess(getpid(), reinterpret_cast<uint64_t>(&value), &got, sizeof got), "");
  EXPECT_EQ(got, value);
  const pid_t child = fork();
  if (child == 0) {
    _exit(0);
  }
  ASSERT_GT(child, 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const std::string why =
      whyCannotReadProcess(child, reinterpret_cast<uint64_t>(&value), &got, sizeof got);
  EXPECT_TRUE(contains(why, "process_vm_readv: No such process")) << why;
}

// How a rank picks the store for large fills (FillChoice.hpp), driven with
// made-up timings: cached first, then streaming, then whichever is faster by
// the margin, the other every kProbeEvery fills; a change of timings (the
// peers now on cores that share a cache) turns the choice back.
TEST(FillChoice, StreamsOnlyWhileCachedFillsAreSeveralTimesSlower) {
  FillChoice choice;
  EXPECT_FALSE(choice.streamNext());
  choice.record(false, 10000, 1000); // cached: 10 ns a byte, lines from far away
  EXPECT_TRUE(choice.streamNext());
  choice.record(true, 1000, 1000); // streaming: 1 ns a byte
  EXPECT_TRUE(choice.prefersStreaming());
  int streamed = 0, probes = 0;
  for (uint32_t i = 0; i < 4 * FillChoice::kProbeEvery; ++i) {
    const bool streaming = choice.streamNext();
    streamed += streaming;
    probes += !streaming;
    choice.record(streaming, streaming ? 1000 : 10000, 1000);
  }
  EXPECT_EQ(probes, 4) << "one cached fill every kProbeEvery";
  EXPECT_EQ(streamed, static_cast<int>(4 * FillChoice::kProbeEvery) - 4);
  // The peers moved: cached fills now cost 1.5 ns a byte. The next probe sees
  // it, and from then on the fills are cached but for the probes.
  int cachedAfter = 0;
  for (uint32_t i = 0; i < 4 * FillChoice::kProbeEvery; ++i) {
    const bool streaming = choice.streamNext();
    if (!streaming) {
      choice.record(false, 1500, 1000);
      ++cachedAfter;
    } else {
      choice.record(true, 1000, 1000);
    }
  }
  EXPECT_FALSE(choice.prefersStreaming());
  EXPECT_GE(cachedAfter, static_cast<int>(3 * FillChoice::kProbeEvery) - 3);
  // Exactly at the margin it stays cached: streaming must win by more.
  FillChoice even;
  even.record(false, FillChoice::kSlower * 1000, 1000);
  even.record(true, 1000, 1000);
  EXPECT_FALSE(even.prefersStreaming());
}

// A slot's streaming fill: every length around the 64-byte lines and the
// 128 bytes below which it copies through the cache, from and to every
// alignment in a line, leaving the bytes around the destination alone.
TEST(SlotCopy, StreamingCopiesEveryByteAndNoOther) {
  std::vector<uint8_t> src(600), dst(800);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<uint8_t>(i * 7 + 3);
  }
  for (const Store store : {Store::Cached, Store::Streaming}) {
    for (size_t from = 0; from < 64; from += 7) {
      for (size_t to = 0; to < 64; to += 5) {
        for (size_t n : {0, 1, 63, 64, 65, 127, 128, 129, 191, 255, 256, 300, 511}) {
          std::fill(dst.begin(), dst.end(), 0xEE);
          // Aligned to a line first, so `to` is the offset into one.
          auto* base =
              reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(dst.data()) + 63) / 64 * 64);
          copy(base + to, src.data() + from, n, store);
          for (size_t i = 0; i < dst.size(); ++i) {
            const auto* at = dst.data() + i;
            const bool inside = at >= base + to && at < base + to + n;
            const uint8_t want = inside ? src[from + (at - base - to)] : 0xEE;
            ASSERT_EQ(dst[i], want) << "n " << n << " from +" << from << " to +" << to
                                    << (store == Store::Streaming ? " streaming" : " cached");
          }
        }
      }
    }
  }
}

uint8_t byteOf(int rank, size_t i) {
  return static_cast<uint8_t>(rank * 37 + i * 11 + 1);
}

TEST_P(EngineWorlds, AllGatherBroadcastAndBarrierMoveEveryByte) {
  const auto [size, direct] = GetParam();
  Group g(size, testConfig(), direct);
  expectNoErrors(g.run([&](Engine& e) {
    const int W = e.size(), me = e.rank();
    for (size_t n : countsFor(1, W)) {
      std::vector<uint8_t> in(n), out(W * n, 0);
      for (size_t i = 0; i < n; ++i) {
        in[i] = byteOf(me, i);
      }
      e.allGather("all_gather", in.data(), out.data(), n);
      for (int q = 0; q < W; ++q) {
        for (size_t i = 0; i < n; ++i) {
          if (out[q * n + i] != byteOf(q, i)) {
            throw std::runtime_error(
                "all_gather of " + std::to_string(n) + " bytes: byte " + std::to_string(i) +
                " from rank " + std::to_string(q));
          }
        }
      }
      // In place, as FSDP2 gathers: the input is this rank's slice of the output.
      std::vector<uint8_t> flat(W * n, 0);
      std::copy(in.begin(), in.end(), flat.begin() + me * n);
      e.allGather("all_gather_in_place", flat.data() + me * n, flat.data(), n);
      if (flat != out) {
        throw std::runtime_error("in-place all_gather of " + std::to_string(n) + " bytes differs");
      }
      for (int root = 0; root < W; ++root) {
        std::vector<uint8_t> buf(n);
        for (size_t i = 0; i < n; ++i) {
          buf[i] = me == root ? byteOf(root, i) : 0;
        }
        e.broadcast("broadcast", buf.data(), n, root);
        for (size_t i = 0; i < n; ++i) {
          if (buf[i] != byteOf(root, i)) {
            throw std::runtime_error(
                "broadcast of " + std::to_string(n) + " bytes from " + std::to_string(root) +
                ": byte " + std::to_string(i));
          }
        }
      }
      e.barrier("barrier");
    }
  }));
}

// Pieces are read directly from peers' memory: a direct-reads path only.
class EnginePieces : public ::testing::TestWithParam<int> {};

TEST_P(EnginePieces, AllGatherPiecesLandWhereTheyGo) {
  Group g(GetParam(), testConfig(), /*directReads=*/true);
  expectNoErrors(g.run([&](Engine& e) {
    const int W = e.size(), me = e.rank();
    const std::vector<size_t> sizes{0, 1, 300, 17, 1000, 0, 64};
    std::vector<std::vector<uint8_t>> mine(sizes.size());
    std::vector<Span> inputs;
    for (size_t i = 0; i < sizes.size(); ++i) {
      mine[i].resize(sizes[i]);
      for (size_t j = 0; j < sizes[i]; ++j) {
        mine[i][j] = byteOf(me, i * 1000 + j);
      }
      inputs.push_back({reinterpret_cast<char*>(mine[i].data()), sizes[i]});
    }
    std::vector<std::vector<std::vector<uint8_t>>> landed(
        W, std::vector<std::vector<uint8_t>>(sizes.size()));
    std::vector<std::vector<Span>> outputs(W);
    for (int q = 0; q < W; ++q) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        landed[q][i].assign(sizes[i], 0);
        outputs[q].push_back({reinterpret_cast<char*>(landed[q][i].data()), sizes[i]});
      }
    }
    size_t total = 0;
    for (size_t s : sizes) {
      total += s;
    }
    if (!e.gathersPieces(sizes.size(), total)) {
      throw std::runtime_error("gathersPieces refused a case it should serve");
    }
    e.allGatherPieces("all_gather_coalesced", inputs, outputs);
    for (int q = 0; q < W; ++q) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        for (size_t j = 0; j < sizes[i]; ++j) {
          if (landed[q][i][j] != byteOf(q, i * 1000 + j)) {
            throw std::runtime_error(
                "piece " + std::to_string(i) + " of rank " + std::to_string(q));
          }
        }
      }
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Worlds, EnginePieces, ::testing::Range(1, 9), [](const auto& info) {
  return "W" + std::to_string(info.param);
});

INSTANTIATE_TEST_SUITE_P(
    Worlds,
    EngineWorlds,
    ::testing::Combine(::testing::Range(1, 9), ::testing::Bool()),
    [](const auto& info) {
      return "W" + std::to_string(std::get<0>(info.param)) +
          (std::get<1>(info.param) ? "_direct" : "_slots");
    });

// ---------------------------------------------------------------- failures

TEST(EngineFailures, RanksThatCallDifferentCollectivesAllFailAndTheGroupStaysBroken) {
  Group g(3, testConfig(), false);
  const auto errors = g.run([](Engine& e) {
    float x[4] = {1, 2, 3, 4};
    if (e.rank() == 1) {
      e.allGather("all_gather", x, x, 4); // the others all-reduce
    } else {
      e.allReduce("all_reduce", x, 4, DType::F32, RedOp::Sum, Scale{});
    }
  });
  bool named = false;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(errors[r], "[rank " + std::to_string(r) + "/3]")) << errors[r];
    named = named || contains(errors[r], "ranks called different collectives");
  }
  EXPECT_TRUE(named) << errors[0];
  // A broken group refuses work at once, naming the first failure.
  const auto after = g.run([](Engine& e) { e.barrier("barrier"); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(after[r], "the group is unusable after rank")) << after[r];
  }
}

TEST(EngineFailures, ARankThatNeverArrivesIsNamedAtTheDeadline) {
  Group g(3, testConfig(std::chrono::milliseconds(300)), false);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = g.run([](Engine& e) {
    if (e.rank() != 2) {
      e.barrier("barrier");
    }
  });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(errors[2], "");
  for (int r : {0, 1}) {
    EXPECT_TRUE(contains(errors[r], "rank 2")) << errors[r];
    EXPECT_TRUE(contains(errors[r], "Timed out after 300 ms")) << errors[r];
  }
  EXPECT_LT(took, std::chrono::seconds(10));
}

// A clock the test moves: the steady clock plus an offset.
class MovableClock final : public Clock {
 public:
  time_point now() const override {
    return std::chrono::steady_clock::now() + std::chrono::nanoseconds(offset_.load());
  }
  void advance(std::chrono::nanoseconds by) {
    offset_ += by.count();
  }

 private:
  std::atomic<int64_t> offset_{0};
};

// Every deadline is read from the engine's clock (EngineConfig::clock): a
// clock moved past the deadline ends the wait at once, though the group's
// timeout is an hour of real time.
TEST(EngineClock, ADeadlineIsReadFromTheEnginesClock) {
  auto clock = std::make_shared<MovableClock>();
  EngineConfig config = testConfig(std::chrono::hours(1));
  config.clock = clock;
  Group g(2, config, false);
  const auto start = std::chrono::steady_clock::now();
  std::atomic<bool> done{false};
  std::thread mover([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    clock->advance(std::chrono::hours(2));
    // A wait that did not read this clock would last the hour: end it.
    for (int i = 0; i < 200 && !done; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!done) {
      g.engine(1).abort("the wait did not read the engine's clock");
    }
  });
  const auto errors = g.run([](Engine& e) {
    if (e.rank() == 0) {
      e.barrier("barrier"); // rank 1 never arrives
    }
  });
  done = true;
  mover.join();
  EXPECT_TRUE(contains(errors[0], "Timed out after 3600000 ms waiting for rank 1")) << errors[0];
  EXPECT_EQ(errors[1], "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// What getError() reports (ProcessGroupNCCL's meaning): the rank whose wait
// reached its deadline says TIMEOUT; a rank that only found the group broken
// says another rank broke it; one that found a mismatch says its own failure.
TEST(EngineFailures, EachRankSaysHowTheGroupFailed) {
  Group g(3, testConfig(std::chrono::milliseconds(300)), false);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(g.engine(r).failure(), Engine::Failure::None);
  }
  g.run([](Engine& e) {
    if (e.rank() != 2) {
      e.barrier("barrier");
    }
  });
  int timedOut = 0;
  for (int r : {0, 1}) {
    const auto f = g.engine(r).failure();
    EXPECT_TRUE(f == Engine::Failure::Timeout || f == Engine::Failure::Remote) << r;
    timedOut += f == Engine::Failure::Timeout;
  }
  EXPECT_GE(timedOut, 1); // the first to reach its deadline; the other may be woken by it
  EXPECT_EQ(g.engine(2).failure(), Engine::Failure::Remote);

  Group mismatch(2, testConfig(), false);
  mismatch.run([](Engine& e) {
    float x[4] = {1, 2, 3, 4};
    if (e.rank() == 0) {
      e.barrier("barrier");
    } else {
      e.allReduce("all_reduce", x, 4, DType::F32, RedOp::Sum, Scale{});
    }
  });
  int found = 0;
  for (int r : {0, 1}) {
    const auto f = mismatch.engine(r).failure();
    EXPECT_TRUE(f == Engine::Failure::Local || f == Engine::Failure::Remote) << r;
    found += f == Engine::Failure::Local;
  }
  EXPECT_GE(found, 1); // a rank that found the mismatch; the other may have too
}

TEST(EngineFailures, ATimeoutSaysWhereEveryRankIs) {
  // Rank 2 returns to its caller after collective #811 and never calls #812.
  Group g(3, testConfig(std::chrono::milliseconds(300)), false);
  const auto errors = g.run([](Engine& e) {
    float x[4] = {1, 2, 3, 4};
    e.setCallerSeq(811);
    e.allReduce("all_reduce", x, 4, DType::F32, RedOp::Sum, Scale{});
    if (e.rank() != 2) {
      float all[12];
      e.setCallerSeq(812);
      e.allGather("all_gather_into_tensor", x, all, sizeof x);
    }
  });
  EXPECT_EQ(errors[2], "");
  // The first of ranks 0 and 1 to time out says it; the other may quote it
  // (the group is broken by then): either way both messages carry it whole.
  int said = 0;
  for (int r : {0, 1}) {
    EXPECT_TRUE(contains(errors[r], "Timed out after 300 ms waiting for rank 2")) << errors[r];
    EXPECT_TRUE(
        contains(errors[r], "rank 2 finished all_reduce #811 and has called no collective since"))
        << errors[r];
    said += contains(
        errors[r],
        " (this rank) waits in all_gather_into_tensor #812 (step 1 of 1) "
        "for every rank's post");
  }
  EXPECT_GE(said, 1) << errors[0] << "\n" << errors[1];
}

TEST(EngineFailures, AFailureRecordBeingWrittenIsWaitedFor) {
  // markBroken claims the record (UINT32_MAX), writes the reason, then
  // publishes its rank: a rank that looks in between must still name the
  // reason (found by a CI run: "its reason is being written").
  Group g(2, testConfig(), false);
  Header& h = g.view().header();
  h.brokenBy.store(UINT32_MAX);
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    std::snprintf(h.brokenReason, sizeof h.brokenReason, "%s", "written late");
    h.brokenBy.store(2, std::memory_order_release); // rank 1
  });
  const auto errors = g.run([](Engine& e) { e.barrier("barrier"); });
  writer.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(errors[r], "rank 1 failed (written late)")) << errors[r];
  }
}

TEST(EngineFailures, AbortFromAnotherThreadWakesEveryWaiter) {
  Group g(3, testConfig(), false);
  const auto start = std::chrono::steady_clock::now();
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    g.engine(2).abort("aborted by the test");
  });
  const auto errors = g.run([](Engine& e) {
    if (e.rank() != 2) {
      std::vector<float> big(10000, 1.0f); // several steps
      e.allReduce("all_reduce", big.data(), big.size(), DType::F32, RedOp::Sum, Scale{});
    }
  });
  aborter.join();
  for (int r : {0, 1}) {
    EXPECT_TRUE(contains(errors[r], "aborted by the test")) << errors[r];
  }
  EXPECT_LT(
      std::chrono::steady_clock::now() - start, std::chrono::seconds(10)); // not the 60 s deadline
  const auto after = g.run([](Engine& e) { e.barrier("barrier"); });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(contains(after[r], "unusable")) << after[r];
  }
}

// A rank that leaves (shutdown, destruction) is not a failure of its peers:
// one with no op pending reports none, and one whose later op the leaving
// ends reports it (Remote), naming the rank that left. An abort is a
// failure of every peer's.
TEST(EngineFailures, ARankThatLeavesFailsOnlyThePeersOpsItEnds) {
  Group left(3, testConfig(), false);
  left.engine(2).leave("left the process group");
  for (int r : {0, 1}) {
    EXPECT_EQ(left.engine(r).failure(), Engine::Failure::None) << r;
  }
  const auto errors = left.run([](Engine& e) {
    if (e.rank() == 0) {
      e.barrier("barrier");
    }
  });
  EXPECT_TRUE(contains(errors[0], "rank 2 left ([rank 2/3] leave: left the process group)"))
      << errors[0];
  EXPECT_EQ(left.engine(0).failure(), Engine::Failure::Remote);
  EXPECT_EQ(left.engine(1).failure(), Engine::Failure::None);

  Group aborted(2, testConfig(), false);
  aborted.engine(1).abort("aborted by the test");
  EXPECT_EQ(aborted.engine(0).failure(), Engine::Failure::Remote);

  // A failure after a leave is not hidden by it: the abort's record replaces the leave's.
  Group both(3, testConfig(), false);
  both.engine(2).leave("left the process group");
  both.engine(1).abort("aborted after the leave");
  EXPECT_EQ(both.engine(0).failure(), Engine::Failure::Remote);
  const auto after = both.run([](Engine& e) {
    if (e.rank() == 0) {
      e.barrier("barrier");
    }
  });
  EXPECT_TRUE(contains(after[0], "rank 1 failed ([rank 1/3] abort: aborted after the leave)"))
      << after[0];
}

} // namespace
} // namespace hsdp::shm
