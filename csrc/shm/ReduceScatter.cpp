// Reduce-scatter: every rank reduces its own chunk of every rank's input, in
// rank order (the numerics contract, Reduce.hpp), through the slots or from
// peers' pool buffers.

#include "shm/Detail.hpp"
#include "shm/Engine.hpp"
#include "shm/Reduce.hpp"

#include <algorithm>
#include <vector>

namespace hsdp::shm {

using namespace detail;

void Engine::reduceScatter(
    const char* name,
    const void* input,
    void* output,
    size_t n,
    DType dtype,
    RedOp redop,
    Scale scale) {
  auto op = begin(name, Kind::ReduceScatter, n, dtype, redop, -1);
  const size_t es = dtypeSize(dtype);
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  const size_t inputBytes = static_cast<size_t>(size_) * n * es;
  // An output past the cache is written around it (see streamStoreBytes).
  const Store store = storeFor(n * es, config_.streamStoreBytes);
  if (const PoolRef mine = pooled(in, inputBytes, n * es)) {
    // Every rank's chunk of mine is read straight from my input: one pass,
    // in rank order as below, so the result is bitwise the same.
    if (pooledStep(op, mine, in, inputBytes, [&](const std::vector<const char*>& inputs, uint64_t) {
          std::vector<const void*>& srcs = sources_;
          for (int r = 0; r < size_; ++r) {
            srcs[r] = inputs[r] + rank_ * n * es;
          }
          reduce(out, srcs.data(), size_, n, dtype, redop, scale, store);
        })) {
      return;
    }
  }
  // A step carries `piece` elements of every rank's chunk.
  const size_t piece = std::max<size_t>(1, slotBytes() / (static_cast<size_t>(size_) * es));
  const size_t steps = std::max<size_t>(1, ceilDiv(n, piece));
  op.steps = static_cast<uint32_t>(steps);
  std::vector<const void*>& srcs = sources_;
  for (size_t k = 0; k < steps; ++k) {
    const size_t off = k * piece;
    const size_t len = std::min(piece, n - off);
    const size_t stepBytes = static_cast<size_t>(size_ - 1) * len * es;
    uint64_t s = step_ + 1;
    // Only peers read my slot, and they read their own chunks: my chunk
    // stays in my input, which I reduce from directly.
    const int slot = post(op, s, [&](char* dst) {
      for (int q = 0; q < size_; ++q) {
        if (q != rank_) {
          fillSlot(dst + q * len * es, in + (q * n + off) * es, len * es, stepBytes);
        }
      }
    });
    for (int r = 0; r < size_; ++r) {
      srcs[r] =
          r == rank_ ? in + (rank_ * n + off) * es : segment_.slot(r, slot) + rank_ * len * es;
    }
    reduce(out + off * es, srcs.data(), size_, len, dtype, redop, scale, store);
    publish(Counter::Done, s);
    step_ = s;
  }
}

} // namespace hsdp::shm
