#pragma once

// How an override plans a call before it picks a route: its tensors as the
// routes take them (flat, contiguous, staged and copied back), grouped by
// dtype, and the post-step that finishes a call on an inner backend.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "fusion/ReducePlan.hpp"

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

// Tensors grouped by dtype, in order of first appearance; one fused
// collective runs per group.
inline std::vector<std::vector<size_t>> groupByDtype(const std::vector<at::Tensor>& ts) {
  std::vector<std::vector<size_t>> groups;
  std::vector<at::ScalarType> keys;
  for (size_t i = 0; i < ts.size(); ++i) {
    auto it = std::find(keys.begin(), keys.end(), ts[i].scalar_type());
    if (it == keys.end()) {
      keys.push_back(ts[i].scalar_type());
      groups.push_back({i});
    } else {
      groups[it - keys.begin()].push_back(i);
    }
  }
  return groups;
}

// Runs `fn` on `t`, or on a contiguous copy that is copied back into `t`.
// Routing never depends on a tensor's layout (that can differ between
// ranks, which would split them between engines); staging absorbs it.
template <typename F>
void onContiguous(const at::Tensor& t, F&& fn) {
  if (t.is_contiguous()) {
    fn(t);
  } else {
    at::Tensor c = t.contiguous();
    fn(c);
    t.copy_(c);
  }
}

// What the inner backends get for a caller's tensor: they read and write
// raw memory, and Gloo's *_base ops insist on 1-D shapes (a fatal check
// otherwise), so they get a flat contiguous tensor: a view of the caller's
// when it is contiguous, else a staged copy written back afterwards.
struct FlatArg {
  at::Tensor user;
  at::Tensor flat;

  static FlatArg of(const at::Tensor& t) {
    return {t, t.is_contiguous() ? t.view({-1}) : t.contiguous().view({-1})};
  }
  bool staged() const {
    return !flat.is_alias_of(user);
  }
  // For ops without a 1-D rule (all_reduce, broadcast): the caller's own
  // tensor unless staged. An inner Work handed back as it is then completes
  // with the caller's tensor, shape included, as its future's value (DDP
  // hooks such as PowerSGD use that value as the tensor they reduced).
  at::Tensor shaped() const {
    return staged() ? flat : user;
  }
  void copyBack() const {
    if (staged()) {
      user.copy_(flat.view(user.sizes()));
    }
  }
};

// The post-step of an op on an inner route: the deferred scale (none where
// the inner backend scales natively), then the copy back of a staged
// argument. Empty when there is nothing to do.
inline std::function<void()> scaleAndCopyBack(const DeferredScale& post, const FlatArg& arg) {
  if (post.isNone() && !arg.staged()) {
    return {};
  }
  return [post, arg] {
    post.apply(arg.flat);
    arg.copyBack();
  };
}

// What a natively coalescing backend (NCCL) gets for a flat tensor: NCCL has
// no complex types, so complex tensors go as their (real, imaginary) pairs;
// sums, averages and real scale factors act on each component alike.
inline at::Tensor realView(const at::Tensor& flat) {
  return flat.is_complex() ? at::view_as_real(flat).view({-1}) : flat;
}

} // namespace hsdp
