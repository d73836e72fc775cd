#pragma once

// The abort hooks a user registers on a group (c10d::Backend's
// registerAbortHook, torch 2.14+), to capture debug information when the
// group fails. They run as ProcessGroupNCCL2 runs its own
// (torch/csrc/distributed/c10d/nccl2/ProcessGroupNCCL.cpp, runAbortHooks and
// its callers): each time one of the group's ops fails (a timeout, a lost
// peer, an inner backend's error), and before the group is aborted; so a hook
// may run more than once per failure, on whichever thread saw it. The hooks
// are copied out under the lock and run outside it (a hook may unregister
// itself); one that throws is reported on stderr and the others still run.
// Unlike ProcessGroupNCCL2, whose map keeps the first hook of an id and drops
// a second without a word, add() tells the caller that an id is in use.
//
// No torch here: FlightRecorder, which runs them, builds without it.

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

namespace hsdp {

class AbortHooks {
 public:
  using Hook = std::function<void()>;

  // False, and nothing changed, when `id` is in use.
  bool add(int64_t id, Hook hook) {
    std::lock_guard<std::mutex> lock(mutex_);
    return hooks_.emplace(id, std::move(hook)).second;
  }

  // An id that is not registered: nothing (as ProcessGroupNCCL2).
  void remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    hooks_.erase(id);
  }

  // `rank` names this process in what a failing hook prints.
  // A hook that aborts its own group runs no hook again (abort() runs them).
  void run(int rank) const noexcept {
    thread_local const AbortHooks* running = nullptr;
    if (running == this) {
      return;
    }
    const AbortHooks* outer = running;
    running = this;
    std::vector<Hook> hooks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& entry : hooks_) {
        hooks.push_back(entry.second);
      }
    }
    for (const auto& hook : hooks) {
      try {
        hook();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[hsdp] rank %d: an abort hook raised: %s\n", rank, e.what());
      } catch (...) {
        std::fprintf(stderr, "[hsdp] rank %d: an abort hook raised a non-std exception\n", rank);
      }
    }
    running = outer;
  }

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, Hook> hooks_; // run in id order
};

} // namespace hsdp
