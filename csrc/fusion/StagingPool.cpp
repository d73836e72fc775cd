#include "fusion/StagingPool.hpp"

#include <ATen/ATen.h>

namespace hsdp {

at::Tensor StagingPool::acquire(int64_t numel, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) {
    // CUDA's caching allocator already reuses memory, and it knows the
    // streams a buffer is used on; a pool here would hand out a buffer the
    // GPU may still be reading.
    return at::empty({numel}, options);
  }
  const int64_t bytes =
      numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  at::Tensor buffer;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->device() == options.device() && it->numel() >= bytes &&
          (best == free_.end() || it->numel() < best->numel())) {
        best = it;
      }
    }
    if (best != free_.end()) {
      buffer = std::move(*best);
      free_.erase(best);
    }
  }
  if (!buffer.defined()) {
    buffer = at::empty({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  }
  return buffer.narrow(0, 0, bytes).view(options.dtype().toScalarType());
}

void StagingPool::release(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& t : tensors) {
    if (!t.device().is_cpu()) {
      continue; // never pooled (see acquire)
    }
    const auto& storage = t.storage();
    at::Tensor whole = at::empty({0}, t.options().dtype(at::kByte));
    whole.set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
    free_.push_back(std::move(whole));
  }
  // Keep the largest few: they serve any smaller request too.
  if (free_.size() > kMaxCached) {
    std::sort(free_.begin(), free_.end(), [](const at::Tensor& a, const at::Tensor& b) {
      return a.numel() > b.numel();
    });
    free_.resize(kMaxCached);
  }
}

} // namespace hsdp
