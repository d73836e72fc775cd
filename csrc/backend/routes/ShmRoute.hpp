#pragma once

// The CPU route of a group whose members can share memory: runs a planned
// call on the group's collectives, on the engine's queue.
//
//   * Flat: every member on this host; the collectives are the
//     shared-memory engine's own (shm/Engine.hpp).
//   * Hierarchical: the group spans hosts; the collectives are hsdp's
//     across-host algorithms over this host's engine and a Gloo group per
//     column (Hierarchical.hpp).
// Optionally the group's communication buffers come from a pool this host's
// peers map (PoolAllocator.hpp), which the engine then reads in place.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/CommStats.hpp"
#include "backend/FlightRecorder.hpp"
#include "backend/OpQueue.hpp"
#include "backend/routes/Hierarchical.hpp"
#include "backend/routes/PoolAllocator.hpp"
#include "backend/routes/Route.hpp"
#include "fusion/StagingPool.hpp"
#include "shm/Engine.hpp"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace hsdp {

class ShmRoute final : public Route {
 public:
  ShmRoute(
      std::unique_ptr<shm::Engine> local,
      HostLayout layout,
      std::optional<Column> column, // none when flat
      int rank,
      int size,
      CommStats& stats,
      std::shared_ptr<StagingPool> staging);

  const char* name() const override {
    return hierarchical_ ? "hierarchical" : "shm";
  }
  const char* recordedAs() const override {
    return name();
  }
  NativeScale scalesNatively() const override {
    return {}; // the scale is fused into the reduction's kernel: one pass, no extra kernel
  }
  bool coalescesNatively() const override {
    return false;
  }
  // Piecewise all-gather: flat groups only (hierarchical ones pack).
  bool gathersPieces(size_t pieces, size_t totalBytes) const override {
    return collectives().gathersPieces(pieces, totalBytes);
  }
  // CPU tensors, dense, of an engine dtype.
  bool serves(const std::vector<at::Tensor>& tensors) const override;
  // Whether the engine runs `plan` (its op and scale) on `dtype` data; if
  // so, the plan keeps the engine's form of it (ReducePlan::onEngine), the
  // one mapping the call's reduction gets.
  bool takes(ReducePlan& plan, at::ScalarType dtype) const;

  // Runs the plan on the engine's queue: inline for a synchronous call when
  // the queue is idle, else on its worker, in issue order. The call's
  // flight-record entry ends with it; a failure is raised (or fails the
  // Work) as DistBackendError naming this rank's flight record.
  Completion issue(const Call& call, Plan&& plan) override;
  // Where issue() records calls' ends; set once, before the first call.
  void recordInto(std::shared_ptr<FlightRecorder> trace) {
    trace_ = std::move(trace);
  }
  // Drains the queue and tells this host's peers this rank is gone: they
  // fail now instead of at their deadline (a correct program has nothing
  // left to wait for from a rank that finished its collectives).
  void leave(const std::string& why);
  // Fails this host's ranks at once; inter-host peers see this rank's
  // Gloo group fail when the process leaves or at their deadline.
  // How the shared-memory group failed, as this rank sees it.
  shm::Engine::Failure failure() const {
    return local_->failure();
  }
  void abort(const std::string& why) {
    local_->abort(why);
  }
  // The group's ephemeral timeout extension, read by this host's waits as
  // they start (TimeoutExtension.hpp).
  void setTimeoutExtension(std::shared_ptr<const std::atomic<int64_t>> extensionMs) {
    local_->setTimeoutExtension(std::move(extensionMs));
  }
  // The group's timeout changed: the engine's deadlines (`engineTimeout`:
  // HSDP_TIMEOUT_MS where set) and the columns' (`groupTimeout`) from
  // the next op on.
  void setTimeout(std::chrono::milliseconds engineTimeout, std::chrono::milliseconds groupTimeout) {
    local_->setTimeout(engineTimeout);
    if (hierarchical_) {
      hierarchical_->setTimeout(groupTimeout);
    }
  }
  // Where every rank of this host is (the engine's view).
  std::string whereEveryRankIs() const {
    return local_->whereEveryRankIs();
  }
  bool directReads() const {
    return local_->directReads();
  }
  // Why not, where the settings wanted them (the probe's answer); else empty.
  const std::string& whyNoDirectReads() const {
    return local_->whyNoDirectReads();
  }
  // From what size per rank all-gathers and broadcasts of ordinary buffers
  // read peers directly; 0: never.
  size_t directReadBytes() const {
    return local_->directReads() ? local_->directReadBytes() : 0;
  }

  // Communication buffers from a pool of at most `maxBytes`. Only with
  // direct reads (peers may open each other's descriptors); every rank of
  // the host calls it alike.
  void usePool(size_t maxBytes, size_t chunkBytes);
  bool allocates() const {
    return allocator_ != nullptr;
  }
  // A 1-D tensor of `numel` elements of `options`' dtype in the pool, or in
  // ordinary memory (counted) when the pool is at its bound.
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options) {
    return allocator_->tensor(numel, options);
  }
  std::shared_ptr<c10::Allocator> allocator() const {
    return allocator_;
  }
  struct BufferStats {
    shm::PoolStats pool;
    uint64_t fallbacks = 0;   // allocations served by ordinary memory
    uint64_t pooledCalls = 0; // calls that read peers' pool buffers
  };
  BufferStats bufferStats() const;

 private:
  shm::Collectives& collectives() const {
    return hierarchical_ ? static_cast<shm::Collectives&>(*hierarchical_) : *local_;
  }
  // One collective of a plan.
  void run(const char* op, const Collective& c);
  [[noreturn]] void fail(const shm::CommError& e, uint64_t seq);

  std::unique_ptr<shm::Engine> local_;
  std::unique_ptr<Hierarchical> hierarchical_; // null when flat; uses local_
  int rank_;
  int size_;
  std::shared_ptr<FlightRecorder> trace_;
  std::shared_ptr<PoolAllocator> allocator_; // null: no pool
  // Last: drained and joined before the engine its tasks use is gone.
  std::unique_ptr<OpQueue> queue_ = std::make_unique<OpQueue>();
};

} // namespace hsdp
