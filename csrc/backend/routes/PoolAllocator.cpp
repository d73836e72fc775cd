#include "backend/routes/PoolAllocator.hpp"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

namespace hsdp {

namespace {

struct Owner {
  std::shared_ptr<shm::Pool> pool;
  void* buffer;
};

void release(void* context) {
  auto* owner = static_cast<Owner*>(context);
  owner->pool->release(owner->buffer);
  delete owner;
}

} // namespace

c10::DataPtr PoolAllocator::allocate(size_t bytes) {
  if (void* p = pool_->allocate(bytes)) {
    return {p, new Owner{pool_, p}, &release, c10::Device(c10::kCPU)};
  }
  fallbacks_.fetch_add(1, std::memory_order_relaxed);
  return c10::GetCPUAllocator()->allocate(bytes);
}

at::Tensor PoolAllocator::tensor(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, allocate(bytes), nullptr, false);
  return at::empty({0}, options).set_(std::move(storage), 0, {numel}, {1});
}

} // namespace hsdp
