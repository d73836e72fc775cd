#pragma once

// How an override plans a call for its route: its tensors as routes take
// them (flat, contiguous, staged and copied back), grouped by dtype, packed
// where the route does not coalesce natively, and the post-step that
// finishes the call, written once per form.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/routes/Route.hpp"
#include "fusion/ReducePlan.hpp"
#include "fusion/StagingPool.hpp"

namespace hsdp {

inline uint64_t bytesOf(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

inline uint64_t bytesOf(const std::vector<at::Tensor>& ts) {
  uint64_t total = 0;
  for (const auto& t : ts) {
    total += bytesOf(t);
  }
  return total;
}

// The tensors of one dtype in a call's list (in order of first
// appearance), and their reduction: one fused collective runs per group.
struct DtypeGroup {
  std::vector<size_t> members;
  ReducePlan reduce;
};

// `tensors` grouped by dtype, each group's reduction planned with
// planReduce (which raises for an op the dtype has no form of).
std::vector<DtypeGroup> groupByDtype(
    const OpContext& ctx,
    const std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int groupSize,
    double divideBy,
    NativeScale nativeScale);

// The one-tensor forms: all_reduce, broadcast and reduce (`kind`) of `t`
// in place; the caller's tensor when contiguous, else a staged copy.
Plan planInPlace(Kind kind, const at::Tensor& t, ReducePlan reduce, int root = 0);
// all_gather_into_tensor (`output` contiguous).
Plan planAllGather(const at::Tensor& input, const at::Tensor& output);
// all_gather into one tensor per rank.
Plan planAllGatherToList(const at::Tensor& input, const std::vector<at::Tensor>& outputs);
// reduce_scatter_tensor (`input` contiguous).
Plan planReduceScatter(const at::Tensor& input, const at::Tensor& output, ReducePlan reduce);
// reduce_scatter from one equal-sized tensor per rank.
Plan planReduceScatterFromList(
    const std::vector<at::Tensor>& inputs,
    const at::Tensor& output,
    ReducePlan reduce);

// The fused forms. On a route that coalesces natively: the callers' tensors
// as lists, one launch. Otherwise packed into staging from `pool` (one
// collective per dtype group, or per bucket), unpacked by the post-step;
// an all-gather the route gathers piecewise stays unpacked.
Plan planAllGatherCoalesced(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const Route& route,
    int rank,
    int size,
    const std::shared_ptr<StagingPool>& pool);
Plan planReduceScatterCoalesced(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const std::vector<DtypeGroup>& groups,
    const Route& route,
    int size,
    const std::shared_ptr<StagingPool>& pool);
// Each group in buckets of at most `bucketBytes` (<= 0: one bucket).
Plan planAllReduceBuckets(
    const std::vector<at::Tensor>& tensors,
    const std::vector<DtypeGroup>& groups,
    int64_t bucketBytes,
    const Route& route,
    const std::shared_ptr<StagingPool>& pool);

} // namespace hsdp
