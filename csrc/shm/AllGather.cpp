// All-gather: through the slots, by direct reads of peers' memory, or from
// peers' pool buffers; and the all-gather of many pieces that stay in place.
// The steps they are made of are the protocol's (Engine.hpp, Engine.cpp).

#include "shm/Detail.hpp"
#include "shm/Engine.hpp"

#include <vector>

namespace hsdp::shm {

using namespace detail;

void Engine::allGather(const char* name, const void* input, void* output, size_t n) {
  auto op = begin(name, Kind::AllGather, n, DType::U8, RedOp::Sum, -1);
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  // FSDP2 gathers in place: the input is this rank's slice of the output.
  const bool inPlace = in == out + static_cast<size_t>(rank_) * n;
  if (const PoolRef mine = pooled(in, n, n)) {
    if (!inPlace) {
      copyBytes(out + static_cast<size_t>(rank_) * n, in, n);
    }
    if (pooledStep(op, mine, in, n, [&](const std::vector<const char*>& inputs, uint64_t) {
          for (int i = 1; i < size_; ++i) {
            const int q = (rank_ + i) % size_;
            copyBytes(out + static_cast<size_t>(q) * n, inputs[q], n);
          }
        })) {
      return;
    }
  }
  if (readsDirectly(n, directReadBytes_)) {
    if (!inPlace) {
      copyBytes(out + static_cast<size_t>(rank_) * n, in, n);
    }
    directStep(op, in, [&](int q, uint64_t address) {
      readPeer(op, q, address, out + static_cast<size_t>(q) * n, n);
    });
    return;
  }
  pipelineBytes(
      op,
      n,
      [&](char* dst, size_t off, size_t len) { fillSlot(dst, in + off, len, len); },
      [&](int slot, size_t off, size_t len) {
        if (!inPlace) {
          copyBytes(out + static_cast<size_t>(rank_) * n + off, in + off, len);
        }
        // Start with the next rank so ranks do not all read rank 0 first.
        for (int i = 1; i < size_; ++i) {
          const int q = (rank_ + i) % size_;
          copyBytes(out + static_cast<size_t>(q) * n + off, segment_.slot(q, slot), len);
        }
      });
}

void Engine::allGatherPieces(
    const char* name,
    const std::vector<Span>& inputs,
    const std::vector<std::vector<Span>>& outputs) {
  size_t total = 0;
  for (const auto& in : inputs) {
    total += in.bytes;
  }
  // Checked before begin(): a throw after it would leave this rank's op
  // sequence one ahead of its peers'.
  if (!gathersPieces(inputs.size(), total)) {
    throw std::logic_error(prefix(name) + "allGatherPieces called where gathersPieces is false");
  }
  auto op = begin(name, Kind::AllGatherPieces, total, DType::U8, RedOp::Sum, -1);
  op.sig.pieces = inputs.size();
  uint64_t s = step_ + 1;
  // My slot lists where my pieces are; peers read them from there.
  const int slot = post(op, s, [&](char* dst) {
    auto* table = reinterpret_cast<uint64_t*>(dst);
    for (size_t i = 0; i < inputs.size(); ++i) {
      table[2 * i] = reinterpret_cast<uint64_t>(inputs[i].data);
      table[2 * i + 1] = inputs[i].bytes;
    }
  });
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Span& mine = outputs[rank_][i];
    if (mine.data != inputs[i].data && inputs[i].bytes > 0) {
      copyBytes(mine.data, inputs[i].data, inputs[i].bytes);
    }
  }
  for (int k = 1; k < size_; ++k) {
    const int q = (rank_ + k) % size_;
    readPeerPieces(op, q, reinterpret_cast<const uint64_t*>(segment_.slot(q, slot)), outputs[q]);
  }
  publish(Counter::Done, s);
  // Peers read my pieces in place: return only when they are done.
  waitAll(op, Counter::Done, s);
  step_ = s;
}

} // namespace hsdp::shm
