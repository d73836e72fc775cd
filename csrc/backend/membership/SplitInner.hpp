#pragma once

// Splitting an inner c10d backend (Gloo's, NCCL's) for a child group, with
// options of the child's own: what differs between torch releases here
// (2.13 cannot copy a backend's options) stays in this file.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace hsdp {

// inner.split(store, ranks, options) with a copy of inner's own options (of
// their concrete type) given `timeout` and, when not null, the group's name
// and description: split implementations fill in what they are given, and the
// parent's options must stay as they are. Torch 2.13 cannot copy them (no
// Options::clone()): a gloo inner gets base options there, from which Gloo's
// split builds the child options of its own; any other is lent the parent's
// object, as torch 2.13's own ProcessGroup::splitGroup does, its base fields
// restored after.
c10::intrusive_ptr<c10d::Backend> splitWithOwnOptions(
    c10d::Backend& inner,
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    std::chrono::milliseconds timeout,
    const std::string* groupName = nullptr,
    const std::string* groupDesc = nullptr);

} // namespace hsdp
