#pragma once

// Element-wise reduction kernels of the shared-memory engine, and its copy
// into a slot.
//
//   dst[i] = scale(src[0][i] op src[1][i] op ... op src[n-1][i])
//
// Sources are combined in index order 0..n-1 (the callers pass them in rank
// order), so every rank that reduces the same data gets the same bits.
// bf16/fp16 are widened to fp32, combined and scaled there, and rounded once
// (round-to-nearest-even, as torch rounds). `dst` may alias one source:
// every element is fully read before it is written. Each dtype's kernel is
// compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time
// (GCC function multi-versioning).

#include "shm/Types.hpp"

namespace hsdp::shm {

// How the result is written. Streaming: with non-temporal stores, around the
// cache (SUM of floating types; the rest writes through it), for an output too large to stay
// in the cache until it is used: each line is written without first being
// read, and the sources' lines are not evicted for it. The stores are fenced
// before reduce returns.
enum class Store : uint8_t { Cached, Streaming };

// Streaming from `streamFromBytes` of output on (EngineConfig::streamStoreBytes); 0: never.
inline Store storeFor(size_t outputBytes, size_t streamFromBytes) {
  return streamFromBytes > 0 && outputBytes >= streamFromBytes ? Store::Streaming : Store::Cached;
}

void reduce(
    void* dst,
    const void* const* srcs,
    int nsrcs,
    size_t count,
    DType dtype,
    RedOp op,
    Scale scale,
    Store store = Store::Cached);

// dst[0, n) = src[0, n). Streaming: the 64-byte lines of dst with
// non-temporal stores (fenced before it returns), the rest through the
// cache. For a slot's fill: its lines were last read by the peers, so a
// cached store first takes each line back from their caches, which costs a
// round trip between cores per line where the cores share no cache
// (docs/shm-engine.md, "Writing a slot").
void copy(void* dst, const void* src, size_t n, Store store);

// Whether the kernels implement `op` on `dtype` (bitwise ops: integers only).
bool reduceSupported(DType dtype, RedOp op);

} // namespace hsdp::shm
