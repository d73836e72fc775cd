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
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace hsdp {

class AbortHooks {
 public:
  using Hook = std::function<void()>;

  // False, and nothing changed, when `id` is in use. A hook is never copied
  // or destroyed under the lock: a Python callable's copy and destruction
  // take the GIL, which must not be waited for while holding it (a refused
  // hook goes with `held`, declared before the lock, so destroyed after).
  bool add(int64_t id, Hook hook) {
    auto held = std::make_shared<const Hook>(std::move(hook));
    std::lock_guard<std::mutex> lock(mutex_);
    return hooks_.try_emplace(id, std::move(held)).second;
  }

  // An id that is not registered: nothing (as ProcessGroupNCCL2).
  void remove(int64_t id) {
    std::shared_ptr<const Hook> gone;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = hooks_.find(id);
    if (it != hooks_.end()) {
      gone = std::move(it->second);
      hooks_.erase(it);
    }
  } // `gone` after the lock (declared first, destroyed last)

  // Every hook dropped (the group is shut down: a hook that holds its group
  // would otherwise keep it alive).
  void clear() {
    std::map<int64_t, std::shared_ptr<const Hook>> gone;
    std::lock_guard<std::mutex> lock(mutex_);
    gone.swap(hooks_);
  }

  // `who` names this rank and group in what a failing hook prints. A hook
  // that fails or aborts a group whose hooks this thread is running (its
  // own, or one whose hooks led here) runs no hook again.
  void run(const std::string& who) const noexcept {
    thread_local std::vector<const AbortHooks*> running;
    for (const AbortHooks* r : running) {
      if (r == this) {
        return;
      }
    }
    running.push_back(this);
    std::vector<std::pair<int64_t, std::shared_ptr<const Hook>>> hooks;
    {
      // Copies of pointers only: copying a Python callable takes the GIL.
      std::lock_guard<std::mutex> lock(mutex_);
      hooks.assign(hooks_.begin(), hooks_.end());
    }
    for (const auto& [id, hook] : hooks) {
      try {
        (*hook)();
      } catch (const std::exception& e) {
        std::fprintf(
            stderr,
            "[hsdp] %s: abort hook %lld raised: %s\n",
            who.c_str(),
            (long long)id,
            e.what());
      } catch (...) {
        std::fprintf(
            stderr,
            "[hsdp] %s: abort hook %lld raised a non-std exception\n",
            who.c_str(),
            (long long)id);
      }
    }
    running.pop_back();
  }

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<const Hook>> hooks_; // run in id order
};

} // namespace hsdp
