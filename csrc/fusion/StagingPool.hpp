#pragma once

// Reuses the staging buffers of fused collectives between calls. A fresh
// large CPU allocation is returned to the OS when freed, and the next one
// faults in every 4 KiB page again on first touch: for tens of MiB that
// costs more than the copies the buffer is for. Buffers are handed out as
// typed views of cached byte buffers and given back when the collective is
// complete. Shared (shared_ptr) with the callbacks that give them back, so
// it outlives any in-flight Work. CPU only: other devices allocate afresh.

#include <ATen/core/Tensor.h>

#include <memory>
#include <mutex>
#include <vector>

namespace hsdp {

class StagingPool {
 public:
  // A contiguous 1-D tensor of `numel` elements of `options`' dtype.
  at::Tensor acquire(int64_t numel, const at::TensorOptions& options);
  // Gives back tensors obtained from acquire (others must not be passed).
  void release(const std::vector<at::Tensor>& tensors);

 private:
  static constexpr size_t kMaxCached = 4;
  std::mutex mutex_;
  std::vector<at::Tensor> free_; // uint8 buffers, whole storages
};

// The pool's buffers one call uses, given back once: by release() at the
// end of the call's post-step (the next call reuses them at once), or when
// the lease is destroyed, if the call failed before it got there.
class StagingLease {
 public:
  explicit StagingLease(std::shared_ptr<StagingPool> pool) : pool_(std::move(pool)) {}
  ~StagingLease() {
    release();
  }
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;

  void add(const std::vector<at::Tensor>& buffers) {
    held_.insert(held_.end(), buffers.begin(), buffers.end());
  }
  void release() {
    if (!held_.empty()) {
      pool_->release(held_);
      held_.clear();
    }
  }

 private:
  std::shared_ptr<StagingPool> pool_;
  std::vector<at::Tensor> held_;
};

} // namespace hsdp
