#pragma once

// Error vocabulary shared by every layer. Messages always start with the
// caller's identity so a log line from one rank of many says who failed and
// in which collective: "[rank 1/4] all_gather_into_tensor: ...".
//
// Python sees:
//   HSDP_CHECK_VALUE -> hsdp_backend.ArgumentError (a bad argument: size,
//                       rank, op for dtype): a RuntimeError and a ValueError
//   HSDP_CHECK_TYPE  -> hsdp_backend.ArgumentTypeError (dtype mismatch
//                       between tensors): a RuntimeError and a TypeError
//   HSDP_CHECK       -> RuntimeError (unsupported device or state)
// Both argument errors are RuntimeErrors because gloo raises RuntimeError for
// every invalid argument, and ValueError/TypeError because NCCL raises those:
// code written against either backend catches hsdp's (bindings.cpp maps them).
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
    return "[rank " + std::to_string(rank) + "/" + std::to_string(size) + "] " + op + ": ";
  }
};

struct ArgumentError : c10::ValueError {
  using c10::ValueError::ValueError;
};

struct ArgumentTypeError : c10::TypeError {
  using c10::TypeError::TypeError;
};

} // namespace hsdp

#define HSDP_THROW_IF_NOT_(cond, error, ctx, ...)                                                  \
  do {                                                                                             \
    if (C10_UNLIKELY(!(cond))) {                                                                   \
      throw ::hsdp::error(                                                                         \
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},                                   \
          ::c10::str((ctx).prefix(), __VA_ARGS__));                                                \
    }                                                                                              \
  } while (false)

#define HSDP_CHECK_VALUE(cond, ctx, ...) HSDP_THROW_IF_NOT_(cond, ArgumentError, ctx, __VA_ARGS__)
#define HSDP_CHECK_TYPE(cond, ctx, ...)                                                            \
  HSDP_THROW_IF_NOT_(cond, ArgumentTypeError, ctx, __VA_ARGS__)
#define HSDP_CHECK(cond, ctx, ...) TORCH_CHECK(cond, (ctx).prefix(), __VA_ARGS__)
