#pragma once

// How a c10d reduction is carried out on a transport that only needs to know
// SUM/PRODUCT/MIN/MAX/BAND/BOR/BXOR.
//
// On transports without them (the shared-memory engine, Gloo) AVG and
// PREMUL_SUM run as SUM followed by one scaling step on the result (a
// "deferred scale"). This
//  * works on transports that lack the op (Gloo has no PREMUL_SUM, and some
//    torch versions turned its reduce-scatter AVG into SUM),
//  * rounds low-precision results once (the scale is applied in fp32), and
//  * lets a caller chain SUM collectives on several groups and scale once.
// A transport that scales inside the reduction (NCCL: `NativeScale`) gets
// AVG unchanged (integers too: ncclAvg truncates, as hsdp does) and every
// other floating-point scale (PREMUL_SUM, AVG or SUM with a `divideBy`) as
// one PREMUL_SUM factor: no extra kernel. Integer AVG with a `divideBy`
// stays SUM plus one truncating divide; so does a bf16 scale where the
// transport's PREMUL_SUM loses a bf16 factor (a division by the group size
// alone is then its AVG).

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>

#include "common/Errors.hpp"
#include "shm/Types.hpp"

namespace hsdp {

class DeferredScale {
 public:
  static DeferredScale none() {
    return DeferredScale(Kind::None, 1.0, {});
  }
  static DeferredScale divideBy(double divisor) {
    return DeferredScale(Kind::Divide, divisor, {});
  }
  static DeferredScale multiplyBy(double factor) {
    return DeferredScale(Kind::Multiply, factor, {});
  }
  static DeferredScale multiplyBy(at::Tensor factor) {
    return DeferredScale(Kind::MultiplyTensor, 1.0, std::move(factor));
  }

  enum class Kind { None, Divide, Multiply, MultiplyTensor };

  bool isNone() const {
    return kind_ == Kind::None;
  }
  Kind kind() const {
    return kind_;
  }
  // The divisor or factor (a tensor factor is read as a double).
  double value() const;

  // This scale followed by a division by `divisor`, as one step: callers
  // that chain SUM collectives over several groups divide once, at the end.
  DeferredScale dividedBy(double divisor) const;

  // Whether the transport's PREMUL_SUM can apply this scale to `dtype`
  // data with nothing made here: a number, or the caller's own factor
  // tensor of that dtype. A tensor factor of another dtype, or divided here,
  // is a new tensor that would be freed before NCCL's stream reads it.
  bool fitsPreMulSum(at::ScalarType dtype) const;
  // The PREMUL_SUM reduction that applies this scale (fitsPreMulSum).
  c10d::ReduceOp asPreMulSum(at::ScalarType dtype) const;

  // Scales `t` in place. bf16/fp16 are widened to fp32, scaled and rounded
  // once; integers divide with truncation toward zero (C semantics, as NCCL).
  // A tensor factor is read where it lives, on t's device: never by the host.
  void apply(const at::Tensor& t) const;

 private:
  DeferredScale(Kind kind, double value, at::Tensor tensor, bool callersTensor = true)
      : kind_(kind), value_(value), tensor_(std::move(tensor)), callersTensor_(callersTensor) {}

  Kind kind_;
  double value_;
  at::Tensor tensor_;
  bool callersTensor_; // tensor_ is the caller's factor, not a copy made here
};

// "SUM", "AVG", ...: the name torch.distributed.ReduceOp gives `op`.
const char* reduceOpName(c10d::ReduceOp::RedOpType op);

// What a transport does of AVG and PREMUL_SUM inside its reduction.
struct NativeScale {
  // AVG and PREMUL_SUM run inside the reduction (NCCL's ncclAvg and
  // ncclRedOpCreatePreMulSum); false: hsdp scales (the engine fuses it).
  bool enabled = false;
  // A bf16 PREMUL_SUM's factor arrives as the caller gave it: false where
  // torch's ProcessGroupNCCL marshals it wrongly (common/TorchCompat.hpp).
  bool bf16PreMulSum = true;
};

struct ReducePlan {
  c10d::ReduceOp innerOp; // what the transport runs
  DeferredScale post;     // what we do to the result afterwards
  // The same reduction in the shared-memory engine's types, mapped once
  // when the call is routed there (ShmRoute::takes); empty on other routes.
  std::optional<shm::Reduction> onEngine = std::nullopt;
};

// Checks that `op` makes sense for data of `data`'s dtype on its device
// (ValueError otherwise, naming the rank and op) and returns the plan.
// `groupSize` is the AVG divisor; `divideBy` a further divisor folded into
// the same scaling step.
ReducePlan planReduce(
    const OpContext& ctx,
    const c10d::ReduceOp& op,
    const at::TensorOptions& data,
    int groupSize,
    double divideBy = 1.0,
    NativeScale nativeScale = {});

} // namespace hsdp
