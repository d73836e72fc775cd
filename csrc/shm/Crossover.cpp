#include "shm/Crossover.hpp"

#include "shm/Engine.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>

namespace hsdp::shm {

namespace {

constexpr size_t kSmallest = 8 << 10;
constexpr size_t kLargest = 512 << 10;
// The output's bound: a host's ranks hold ranks x this between them.
constexpr size_t kOutputBytes = 32 << 20;
// Rounds of both paths, alternating: each path's fastest is kept, so a
// round that lost its core to another process does not decide.
constexpr int kRounds = 5;
// Calls per timing: enough bytes that the clock's cost (tens of ns in a VM)
// does not count.
constexpr size_t kBytesPerTiming = 256 << 10;
constexpr int kMaxCallsPerTiming = 16;

// A cache-line-aligned buffer, as torch allocates tensors (the paths' costs
// depend on the alignment), touched so that no page fault is timed.
struct Buffer {
  explicit Buffer(size_t bytes)
      : data(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64))) {
    if (data == nullptr) {
      throw std::bad_alloc();
    }
    std::memset(data, 0, bytes);
  }
  ~Buffer() {
    std::free(data);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data;
};

} // namespace

size_t directReadCrossover(const std::vector<ReadSample>& samples) {
  if (samples.empty()) { // nothing measured: the constant used before measuring
    return kSmallest;
  }
  size_t from = samples.back().bytes * 4;
  for (auto s = samples.rbegin(); s != samples.rend() && s->direct < s->slots; ++s) {
    from = s->bytes;
  }
  return from;
}

std::vector<size_t> directReadProbeSizes(int ranks, size_t slotBytes) {
  const size_t largest =
      std::min({kLargest, slotBytes, kOutputBytes / static_cast<size_t>(std::max(ranks, 1))});
  std::vector<size_t> sizes;
  for (size_t n = kSmallest; n < largest; n *= 4) {
    sizes.push_back(n);
  }
  sizes.push_back(largest);
  return sizes;
}

std::vector<ReadSample> timeDirectReads(Engine& engine) {
  const size_t before = engine.directReadBytes();
  const size_t ranks = static_cast<size_t>(engine.size());
  const std::vector<size_t> sizes = directReadProbeSizes(engine.size(), engine.slotBytes());
  Buffer out(sizes.back() * ranks);
  std::vector<ReadSample> samples;
  try {
    for (const size_t n : sizes) {
      char* in = out.data + static_cast<size_t>(engine.rank()) * n; // in place, as FSDP2 gathers
      const int calls =
          static_cast<int>(std::clamp<size_t>(kBytesPerTiming / n, 1, kMaxCallsPerTiming));
      auto perCall = [&](size_t threshold) {
        // 1: every size reads directly; 0: none does.
        engine.setDirectReadBytes(threshold);
        const auto start = std::chrono::steady_clock::now();
        for (int c = 0; c < calls; ++c) {
          engine.allGather("direct-read probe", in, out.data, n);
        }
        return (std::chrono::steady_clock::now() - start) / calls;
      };
      ReadSample s{n, std::chrono::nanoseconds::max(), std::chrono::nanoseconds::max()};
      // Untimed: the first calls of a size touch lines no call has yet.
      perCall(1);
      perCall(0);
      for (int r = 0; r < kRounds; ++r) {
        s.direct = std::min(s.direct, perCall(1));
        s.slots = std::min(s.slots, perCall(0));
      }
      samples.push_back(s);
    }
  } catch (...) {
    engine.setDirectReadBytes(before);
    throw;
  }
  engine.setDirectReadBytes(before);
  return samples;
}

size_t agreeDirectReadBytes(
    Engine& engine,
    std::optional<size_t> known,
    FunctionRef<std::vector<ReadSample>()> measure) {
  // {whether rank 0 knows it, rank 0's value}.
  uint64_t word[2] = {known ? 1u : 0u, known.value_or(0)};
  engine.broadcast("direct-read probe", word, sizeof word, 0);
  if (word[0] == 0) {
    std::vector<ReadSample> samples;
    try {
      samples = measure();
    } catch (const std::exception& e) {
      // Its peers would otherwise wait in the measurement's next call until
      // their deadline: this process lives on, so they cannot see it gone.
      engine.abort(std::string("measuring the direct-read threshold failed: ") + e.what());
      throw;
    }
    word[1] = directReadCrossover(samples);
    engine.broadcast("direct-read probe", &word[1], sizeof word[1], 0);
  }
  return static_cast<size_t>(word[1]);
}

} // namespace hsdp::shm
