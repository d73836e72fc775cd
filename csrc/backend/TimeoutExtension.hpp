#pragma once

// c10d's ephemeral timeout extension (Backend::addEphemeralTimeout, which
// torch.compile's caches use so that ranks still compiling do not time out
// the ones a cache hit let through), with the meaning ProcessGroupNCCL gives
// it (assignTimeoutToWork and its watchdog's reset): every op issued while an
// extension is active waits that much longer than its timeout, and the
// extension expires when the first op issued after it was added completes
// (that op owns it). Ops issued before keep their timeout. No torch here.

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>

namespace hsdp {

class TimeoutExtension {
 public:
  using Ms = std::chrono::milliseconds;

  // The caller has checked that `extension` is not negative.
  void add(Ms extension) {
    std::lock_guard<std::mutex> lock(mutex_);
    active_->fetch_add(extension.count(), std::memory_order_acq_rel);
  }
  // Whether any extension is active (one atomic load: the common case).
  bool any() const {
    return active_->load(std::memory_order_acquire) > 0;
  }

  struct Issued {
    Ms active{0}; // what the op waits longer
    Ms owned{0};  // what it releases when it completes
  };
  // For an op being issued now.
  Issued issue() {
    std::lock_guard<std::mutex> lock(mutex_);
    const Ms active(active_->load(std::memory_order_relaxed));
    const Issued issued{active, active - inflight_};
    inflight_ = active;
    return issued;
  }
  // The op that owned `owned` has completed.
  void release(Ms owned) {
    if (owned.count() <= 0) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    active_->fetch_sub(owned.count(), std::memory_order_acq_rel);
    inflight_ -= owned;
  }
  // The active extension in milliseconds, for waits that read it when they
  // start (the shared-memory engine's deadlines); lives as long as a reader.
  std::shared_ptr<const std::atomic<int64_t>> activeMs() const {
    return active_;
  }

 private:
  std::mutex mutex_;
  Ms inflight_{0}; // the part of active_ already handed to an op
  std::shared_ptr<std::atomic<int64_t>> active_ = std::make_shared<std::atomic<int64_t>>(0);
};

} // namespace hsdp
