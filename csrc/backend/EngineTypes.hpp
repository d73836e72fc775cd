#pragma once

// torch's types as the shared-memory engine knows them: dtypes, reduce ops
// and the deferred scale; nullopt where the engine has no kernel (the call
// then takes an inner backend).

#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <optional>

#include "fusion/ReducePlan.hpp"
#include "shm/Types.hpp"

namespace hsdp {

std::optional<shm::DType> shmDtype(at::ScalarType t);

std::optional<shm::RedOp> shmRedOp(const c10d::ReduceOp& op);

shm::Scale shmScale(const DeferredScale& post);

std::optional<shm::Reduction> shmReduction(const ReducePlan& plan, at::ScalarType dtype);

} // namespace hsdp
