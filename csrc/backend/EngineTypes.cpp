#include "backend/EngineTypes.hpp"

#include "shm/Reduce.hpp"

namespace hsdp {

std::optional<shm::DType> shmDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return shm::DType::F32;
    case at::kDouble:
      return shm::DType::F64;
    case at::kBFloat16:
      return shm::DType::BF16;
    case at::kHalf:
      return shm::DType::F16;
    case at::kChar:
      return shm::DType::I8;
    case at::kByte:
      return shm::DType::U8;
    case at::kShort:
      return shm::DType::I16;
    case at::kInt:
      return shm::DType::I32;
    case at::kLong:
      return shm::DType::I64;
    default:
      return std::nullopt;
  }
}

std::optional<shm::RedOp> shmRedOp(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return shm::RedOp::Sum;
    case c10d::ReduceOp::PRODUCT:
      return shm::RedOp::Prod;
    case c10d::ReduceOp::MIN:
      return shm::RedOp::Min;
    case c10d::ReduceOp::MAX:
      return shm::RedOp::Max;
    case c10d::ReduceOp::BAND:
      return shm::RedOp::BAnd;
    case c10d::ReduceOp::BOR:
      return shm::RedOp::BOr;
    case c10d::ReduceOp::BXOR:
      return shm::RedOp::BXor;
    default:
      return std::nullopt;
  }
}

shm::Scale shmScale(const DeferredScale& post) {
  shm::Scale scale;
  switch (post.kind()) {
    case DeferredScale::Kind::None:
      break;
    case DeferredScale::Kind::Divide:
      scale.kind = shm::Scale::Kind::Divide;
      scale.value = post.value();
      break;
    case DeferredScale::Kind::Multiply:
    case DeferredScale::Kind::MultiplyTensor:
      scale.kind = shm::Scale::Kind::Multiply;
      scale.value = post.value();
      break;
  }
  return scale;
}

std::optional<shm::Reduction> shmReduction(const ReducePlan& plan, at::ScalarType dtype) {
  auto d = shmDtype(dtype);
  auto op = shmRedOp(plan.innerOp);
  if (!d || !op || !shm::reduceSupported(*d, *op)) {
    return std::nullopt;
  }
  return shm::Reduction{*d, *op, shmScale(plan.post)};
}

} // namespace hsdp
