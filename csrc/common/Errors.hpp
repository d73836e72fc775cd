#pragma once

// Error vocabulary shared by every layer. Messages always start with the
// caller's identity so a log line from one rank of many says who failed and
// in which collective: "[rank 1/4] all_gather_into_tensor: ...".
//
// Python sees:
//   HSDP_CHECK_VALUE -> ValueError  (a bad argument: size, rank, op for dtype)
//   HSDP_CHECK_TYPE  -> TypeError   (dtype mismatch between tensors)
//   HSDP_CHECK       -> RuntimeError (unsupported device or state)
// Communication failures (timeouts, dead peers) are raised as
// c10::DistBackendError by the engines, never through these macros.

#include <c10/util/Exception.h>

#include <string>

namespace hsdp {

struct OpContext {
  int rank;
  int size;
  const char* op;

  std::string prefix() const {
    return "[rank " + std::to_string(rank) + "/" + std::to_string(size) +
        "] " + op + ": ";
  }
};

} // namespace hsdp

#define HSDP_CHECK_VALUE(cond, ctx, ...) \
  TORCH_CHECK_VALUE(cond, (ctx).prefix(), __VA_ARGS__)
#define HSDP_CHECK_TYPE(cond, ctx, ...) \
  TORCH_CHECK_TYPE(cond, (ctx).prefix(), __VA_ARGS__)
#define HSDP_CHECK(cond, ctx, ...) TORCH_CHECK(cond, (ctx).prefix(), __VA_ARGS__)
