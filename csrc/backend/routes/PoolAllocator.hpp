#pragma once

// A group's communication buffers (allocateTensor, getMemAllocator) as a
// c10::Allocator over the shared-memory pool (shm/Pool.hpp): memory this
// host's peers map, so that a collective whose every rank passes one reads
// peers' buffers with plain loads. Each buffer's deleter holds the pool, so
// a tensor keeps its memory valid after its group is gone. When the pool is
// at its bound, ordinary memory serves (and is counted).

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include "shm/Pool.hpp"

#include <atomic>
#include <cstdint>
#include <memory>

namespace hsdp {

class PoolAllocator final : public c10::Allocator {
 public:
  explicit PoolAllocator(std::shared_ptr<shm::Pool> pool) : pool_(std::move(pool)) {}

  c10::DataPtr allocate(size_t bytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // A 1-D tensor of `numel` elements of `options`' dtype, neither resizable
  // nor carrying this allocator: a resize must not outlive the allocator or
  // move the tensor out of the pool unnoticed.
  at::Tensor tensor(int64_t numel, const at::TensorOptions& options);

  // Allocations that ordinary memory served.
  uint64_t fallbacks() const {
    return fallbacks_.load(std::memory_order_relaxed);
  }
  const shm::Pool& pool() const {
    return *pool_;
  }

 private:
  std::shared_ptr<shm::Pool> pool_;
  std::atomic<uint64_t> fallbacks_{0};
};

} // namespace hsdp
