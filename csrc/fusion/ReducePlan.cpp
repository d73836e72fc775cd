#include "fusion/ReducePlan.hpp"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <cmath>

#include "common/TorchCompat.hpp"

namespace hsdp {

namespace {

bool isBitwiseOp(c10d::ReduceOp::RedOpType op) {
  return op == c10d::ReduceOp::BAND || op == c10d::ReduceOp::BOR || op == c10d::ReduceOp::BXOR;
}

} // namespace

const char* reduceOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

double DeferredScale::value() const {
  return kind_ == Kind::MultiplyTensor ? tensor_.item<double>() : value_;
}

DeferredScale DeferredScale::dividedBy(double divisor) const {
  if (divisor == 1.0) {
    return *this;
  }
  switch (kind_) {
    case Kind::None:
      return divideBy(divisor);
    case Kind::Divide:
      return divideBy(value_ * divisor);
    case Kind::Multiply:
      return multiplyBy(value_ / divisor);
    case Kind::MultiplyTensor:
      return DeferredScale(Kind::MultiplyTensor, 1.0, tensor_ / divisor, /*callersTensor=*/false);
  }
  return *this;
}

bool DeferredScale::fitsPreMulSum(at::ScalarType dtype) const {
  // NCCL reads a tensor factor on the device itself (ncclScalarDevice) when
  // the op runs, in the data's dtype ("PreMulSum factor type must match
  // input data type", ProcessGroupNCCL 2.14.1). The caller's own factor of
  // that dtype goes as it is: no device-to-host sync, capturable; the caller
  // keeps it alive, as with NCCL itself. Any other tensor factor stays a
  // deferred multiply on the device (apply()).
  return kind_ != Kind::MultiplyTensor || (callersTensor_ && tensor_.scalar_type() == dtype);
}

c10d::ReduceOp DeferredScale::asPreMulSum(at::ScalarType dtype) const {
  TORCH_INTERNAL_ASSERT(fitsPreMulSum(dtype));
  switch (kind_) {
    case Kind::Divide:
      return compat::makePreMulSum(1.0 / value_);
    case Kind::Multiply:
      return compat::makePreMulSum(value_);
    case Kind::MultiplyTensor:
      return compat::makePreMulSum(tensor_);
    case Kind::None:
      break;
  }
  return compat::makePreMulSum(1.0);
}

void DeferredScale::apply(const at::Tensor& t) const {
  if (kind_ == Kind::None || t.numel() == 0) {
    return;
  }
  const auto dtype = t.scalar_type();
  if (kind_ == Kind::Divide && !at::isFloatingType(dtype) && !at::isComplexType(dtype)) {
    // The divisor is a group size: integral, so integer division stays exact.
    t.div_(at::Scalar(static_cast<int64_t>(value_)), "trunc");
    return;
  }
  // bf16 and fp16 in place, in one kernel: torch computes a reduced float op
  // in fp32 and rounds once, so this is bitwise the widened form without its
  // fp32 copy of the data (backend_test.cpp: DeferredScale*). The value goes
  // as a wrapped number, as Python's `t.mul_(0.5)` does: a plain scalar
  // tensor would take the data's dtype (the factor rounded to bf16 first).
  const bool reduced = dtype == at::kBFloat16 || dtype == at::kHalf;
  switch (kind_) {
    case Kind::Divide:
      t.div_(at::native::wrapped_scalar_tensor(value_));
      break;
    case Kind::Multiply:
      t.mul_(at::native::wrapped_scalar_tensor(value_));
      break;
    case Kind::MultiplyTensor:
      if (!tensor_.is_cpu() && tensor_.has_storage()) {
        // The factor was made on the caller's stream and this may run on
        // another (an async op's post-step, on a side stream): its block
        // must not be handed out again before this stream has read it.
        c10::impl::VirtualGuardImpl impl(tensor_.device().type());
        impl.recordDataPtrOnStream(tensor_.storage().data_ptr(), impl.getStream(tensor_.device()));
      }
      // On the data's device (planReduce checked it), enqueued, never read by
      // the host; a reduced float's factor stays fp32 (not rounded to bf16).
      t.mul_(tensor_.to(reduced ? at::kFloat : dtype));
      break;
    case Kind::None:
      break;
  }
}

namespace {

// Whether `scale` is a division by `divisor` and nothing else (a factor
// whose reciprocal is exactly `divisor` counts: PREMUL_SUM(1 / n)).
bool dividesByExactly(const DeferredScale& scale, int divisor) {
  switch (scale.kind()) {
    case DeferredScale::Kind::Divide:
      return scale.value() == divisor;
    case DeferredScale::Kind::Multiply:
      return 1.0 / scale.value() == divisor;
    default:
      return false;
  }
}

// The plan for the reduction alone.
ReducePlan planReduceOp(
    const OpContext& ctx,
    const c10d::ReduceOp& op,
    at::ScalarType dtype,
    c10::Device device,
    int groupSize) {
  const auto type = op.op_;
  const bool isFloat = at::isFloatingType(dtype) || at::isComplexType(dtype);
  const bool isBool = dtype == at::kBool;
  if (isBitwiseOp(type)) {
    HSDP_CHECK_VALUE(
        !isFloat,
        ctx,
        "ReduceOp.",
        reduceOpName(type),
        " needs an integer or bool tensor, got ",
        dtype);
    return {op, DeferredScale::none()};
  }
  switch (type) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return {op, DeferredScale::none()};
    case c10d::ReduceOp::AVG:
      HSDP_CHECK_VALUE(!isBool, ctx, "ReduceOp.AVG needs a numeric tensor, got ", dtype);
      return {
          c10d::ReduceOp(c10d::ReduceOp::SUM),
          groupSize == 1 ? DeferredScale::none() : DeferredScale::divideBy(groupSize)};
    case c10d::ReduceOp::PREMUL_SUM: {
      HSDP_CHECK_VALUE(
          isFloat, ctx, "ReduceOp.PREMUL_SUM needs a floating-point tensor, got ", dtype);
      auto* supplement = dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
      HSDP_CHECK_VALUE(
          supplement != nullptr,
          ctx,
          "ReduceOp.PREMUL_SUM carries no factor; build it with "
          "torch.distributed._make_nccl_premul_sum(factor)");
      // Pre-multiplying every input by f and summing equals summing and
      // multiplying once: the sum is linear, so we defer the multiply.
      const auto& factor = supplement->tensor_factor;
      if (!factor.defined()) {
        return {
            c10d::ReduceOp(c10d::ReduceOp::SUM),
            DeferredScale::multiplyBy(supplement->double_factor)};
      }
      // NCCL takes a factor tensor's pointer as device memory of the data's
      // device (ncclScalarDevice): one on another device would be read as
      // garbage there, or fault. Said here, before anything is issued.
      HSDP_CHECK_VALUE(
          factor.device() == device,
          ctx,
          "ReduceOp.PREMUL_SUM's factor tensor is on ",
          factor.device(),
          " but the data is on ",
          device,
          "; make the factor on the data's device");
      return {c10d::ReduceOp(c10d::ReduceOp::SUM), DeferredScale::multiplyBy(factor)};
    }
    default:
      HSDP_CHECK_VALUE(false, ctx, "unsupported reduce op ", static_cast<int>(type));
  }
  return {op, DeferredScale::none()};
}

} // namespace

ReducePlan planReduce(
    const OpContext& ctx,
    const c10d::ReduceOp& op,
    const at::TensorOptions& data,
    int groupSize,
    double divideBy,
    NativeScale nativeScale) {
  const auto dtype = data.dtype().toScalarType();
  auto plan = planReduceOp(ctx, op, dtype, data.device(), groupSize);
  const bool isFloat = at::isFloatingType(dtype) || at::isComplexType(dtype);
  if (divideBy != 1.0) {
    HSDP_CHECK_VALUE(
        std::isfinite(divideBy) && divideBy > 0 &&
            (isFloat || divideBy == static_cast<double>(static_cast<int64_t>(divideBy))),
        ctx,
        "divide_by must be positive and finite (and a whole number for integer tensors), got ",
        divideBy);
    HSDP_CHECK_VALUE(
        plan.innerOp.op_ == c10d::ReduceOp::SUM,
        ctx,
        "divide_by needs a SUM, AVG or PREMUL_SUM reduction");
    plan.post = plan.post.dividedBy(divideBy);
  }
  // At one rank the reduction is a copy, and the scale stays hsdp's own
  // multiply after it: NCCL 2.28.9's one-rank reduce-scatter drops a
  // PREMUL_SUM factor (measured on an H200; its all-reduce applies it), and
  // a copy scaled once is the same value either way.
  if (nativeScale.enabled && !plan.post.isNone() && groupSize > 1) {
    if (op.op_ == c10d::ReduceOp::AVG && divideBy == 1.0) {
      // ncclAvg on integers sums, then divides with truncation toward zero
      // (NCCL 2.30's ncclDevSumPostDiv, the version torch 2.14.1 ships), as
      // hsdp's own integer AVG does.
      return {op, DeferredScale::none()};
    }
    if (dtype == at::kHalf && plan.post.kind() == DeferredScale::Kind::Divide &&
        plan.post.value() > 2.0) {
      // One fp16 factor of 1/divisor pushes every input down by the whole
      // divisor before the sum: small gradients become subnormal and lose
      // their digits, or vanish. As FSDP2 does for fp16: a power-of-two part
      // of the divisor (about its square root) goes into the reduction, the
      // rest runs after it, widened to fp32 and rounded once.
      double pre = 1.0;
      while (pre * pre * 4.0 <= plan.post.value()) {
        pre *= 2.0;
      }
      return {
          DeferredScale::divideBy(pre).asPreMulSum(dtype),
          DeferredScale::divideBy(plan.post.value() / pre)};
    }
    if (dtype == at::kBFloat16 && !nativeScale.bf16PreMulSum) {
      // This release's ProcessGroupNCCL marshals a bf16 PREMUL_SUM's factor
      // wrongly (zero for powers of two: TorchCompat.hpp). A division by the
      // group size is ncclAvg, whose bf16 factor NCCL rounds itself
      // correctly (hostToDevRedOp: __float2bfloat16(float(1.0 / nRanks)));
      // every other scale is NCCL's SUM and hsdp's multiply after it, in
      // fp32, rounded once: no worse than a correct bf16 factor would be.
      if (dividesByExactly(plan.post, groupSize)) {
        return {c10d::ReduceOp(c10d::ReduceOp::AVG), DeferredScale::none()};
      }
      return plan;
    }
    if (isFloat && plan.post.fitsPreMulSum(dtype)) {
      return {plan.post.asPreMulSum(dtype), DeferredScale::none()};
    }
  }
  return plan;
}

} // namespace hsdp
