// Broadcast from a root: through the slots, by a direct read of the root's
// memory, or from its pool buffer.

#include "shm/Detail.hpp"
#include "shm/Engine.hpp"

#include <vector>

namespace hsdp::shm {

using namespace detail;

void Engine::broadcast(const char* name, void* data, size_t n, int root) {
  auto op = begin(name, Kind::Broadcast, n, DType::U8, RedOp::Sum, root);
  auto* buf = static_cast<char*>(data);
  if (const PoolRef mine = pooled(buf, n, n)) {
    if (pooledStep(op, mine, buf, n, [&](const std::vector<const char*>& buffers, uint64_t) {
          if (rank_ != root) {
            copyBytes(buf, buffers[root], n);
          }
        })) {
      return;
    }
  }
  if (readsDirectly(n, directReadBytes_)) {
    directStep(op, buf, [&](int q, uint64_t address) {
      if (q == root) {
        readPeer(op, q, address, buf, n);
      }
    });
    return;
  }
  pipelineBytes(
      op,
      n,
      [&](char* dst, size_t off, size_t len) {
        if (rank_ == root) {
          fillSlot(dst, buf + off, len, len);
        }
      },
      [&](int slot, size_t off, size_t len) {
        if (rank_ != root) {
          copyBytes(buf + off, segment_.slot(root, slot), len);
        }
      });
}

} // namespace hsdp::shm
