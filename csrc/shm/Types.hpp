#pragma once

// Vocabulary of the shared-memory engine. Nothing here includes torch: the
// engine works on raw pointers and is built and reasoned about on its own.

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace hsdp::shm {

enum class DType : uint8_t { F32, F64, BF16, F16, I8, U8, I16, I32, I64 };
enum class RedOp : uint8_t { Sum, Prod, Min, Max, BAnd, BOr, BXor };

size_t dtypeSize(DType dtype);
const char* dtypeName(DType dtype);
const char* redOpName(RedOp op);
bool isFloating(DType dtype);

// A scale applied to a reduction's result in the accumulation precision
// (fp32 for bf16/fp16), before the single rounding to the output dtype.
struct Scale {
  enum class Kind : uint8_t { None, Multiply, Divide } kind = Kind::None;
  double value = 1.0;
};

// A reduction as the engine runs it end to end (the scale fused into the
// kernel).
struct Reduction {
  DType dtype;
  RedOp op;
  Scale scale;
};

// A piece of a piecewise collective, where it lives in this process.
struct Span {
  char* data;
  size_t bytes;
};

// A failure of the group (timeout, dead peer, ranks that called different
// collectives): the group cannot be used again and must be recreated. The
// torch-facing layer turns it into torch.distributed.DistBackendError.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

} // namespace hsdp::shm
