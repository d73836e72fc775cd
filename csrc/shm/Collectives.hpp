#pragma once

// The collectives of a group's CPU ranks on raw memory, as the
// shared-memory route runs them: the engine itself when every rank is on
// this host (Engine.hpp), or hsdp's hierarchical algorithms over the engine
// and an inter-host group (backend/routes/Hierarchical.hpp).
//
// Each call names its op (for messages) and blocks until the result is in
// place. `count` is in elements of `dtype`; all-gather and broadcast are
// byte copies.

#include "shm/Types.hpp"

#include <cstddef>
#include <vector>

namespace hsdp::shm {

class Collectives {
 public:
  virtual ~Collectives() = default;

  virtual void allGather(const char* op, const void* input, void* output, size_t bytesPerRank) = 0;
  virtual void reduceScatter(
      const char* op,
      const void* input,
      void* output,
      size_t countPerRank,
      DType dtype,
      RedOp redop,
      Scale scale) = 0;
  virtual void
  allReduce(const char* op, void* data, size_t count, DType dtype, RedOp redop, Scale scale) = 0;
  virtual void broadcast(const char* op, void* data, size_t bytes, int root) = 0;
  virtual void barrier(const char* op) = 0;

  // An all-gather of many pieces that stay where they are: rank q's
  // `inputs[i]` lands in every rank's `outputs[q][i]`. Called only when
  // gathersPieces(inputs.size(), total bytes) says it may be.
  virtual bool gathersPieces(size_t pieces, size_t totalBytes) const = 0;
  virtual void allGatherPieces(
      const char* op,
      const std::vector<Span>& inputs,
      const std::vector<std::vector<Span>>& outputs) = 0;
};

} // namespace hsdp::shm
