#pragma once

// What a group keeps between the calls that change its members (split,
// shrink, reconfigure: membership/Membership.cpp) and builds the routes of
// a membership from.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/Config.hpp"
#include "common/TorchCompat.hpp"

#include <atomic>
#include <optional>
#include <string>
#include <vector>

namespace hsdp {

struct Membership {
  Membership(
      const Config& config,
      std::optional<std::string> hostIdentity,
      c10::intrusive_ptr<c10d::Store> store,
      bool awaitingMembers)
      : config(config),
        hostIdentity(std::move(hostIdentity)),
        store(std::move(store)),
        awaitingMembers(awaitingMembers) {}

  const Config config;                           // what a child group is built with
  const std::optional<std::string> hostIdentity; // tests: a pretended host
  // The group's store: a shrink's and a reconfigure's rendezvous run on it.
  const c10::intrusive_ptr<c10d::Store> store;
  // Set while the group has no members: created to await a reconfigure, or
  // after one failed. Every call is refused then (checkUsable).
  std::atomic<bool> awaitingMembers;
  // How many shrinks this rank made of this group: the ranks that stay count
  // alike, and each shrink's rendezvous keys carry the count.
  int shrinks = 0;
  // The uuids of this group's reconfigurations, each used once (c10d's rule).
  std::vector<int64_t> reconfigureUuids;
#if !HSDP_TORCH_SPLITS_ONCE_PER_BACKEND
  // torch 2.13's ProcessGroup::splitGroup calls split() once per device type
  // the backend serves (cpu and cuda: the same backend), with the same store
  // prefix and ranks; a second rendezvous there races with the first one's
  // (gloo's connectFullMesh reads the other's addresses) and hangs. The
  // second call gets the first one's result. (torch 2.14 splits each backend
  // once.)
  struct LastSplit {
    std::string groupName;
    std::vector<int> ranks;
    c10::weak_intrusive_ptr<c10d::Backend> child;
    bool none = false; // this rank got no child
  };
  std::optional<LastSplit> lastSplit;
#endif
};

} // namespace hsdp
