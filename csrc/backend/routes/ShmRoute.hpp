#pragma once

// The CPU route of a group whose members can share memory: the collectives
// the backend's overrides call, and how they run.
//
//   * Flat: every member on this host; one shared-memory engine.
//   * Hierarchical: the group spans H hosts holding L of its ranks each.
//     Each host's ranks share an engine (the intra-host phase), and the
//     ranks with the same local index l, one per host, form an inter-host
//     Gloo group (the inter-host phase): L Gloo groups move the cross-host
//     traffic at once, each carrying its 1/L of it.
//
// Hierarchical algorithms (n: one rank's bytes or elements; W = H * L):
//   all-gather      inter: my piece to my column's other ranks, theirs
//                   into place (pairwise send / recv); intra: my column's
//                   pieces to my host's ranks.
//   reduce-scatter  intra: reduce-scatter of the column-ordered input (my
//                   column's H partial sums); inter: partial sum h to host
//                   h's rank of my column (pairwise), then one reduction of
//                   the H partial sums of my chunk, in host order. Gloo's
//                   own reduce-scatter is an all-reduce of the whole input:
//                   twice the bytes.
//   all-reduce      large and divisible by L: intra reduce-scatter, inter
//                   all-reduce of my 1/L, intra all-gather; else intra
//                   all-reduce, then every column all-reduces the whole
//                   tensor (identical inputs, identical results).
//   broadcast       inter: the root's column; intra: from the root's column.
//   barrier         intra, then inter: no rank leaves before every rank of
//                   every host arrived.
// Reductions run as SUM (or the op) in both phases and the deferred scale
// (AVG, PREMUL_SUM, divide_by) is applied once, to the final values, where
// every rank holding them applies it alike: results are bitwise identical on
// all ranks. A failure of either phase marks this host's engine broken (its
// other ranks fail at once, naming it) and raises shm::CommError naming the
// op, which the backend turns into DistBackendError.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/CommStats.hpp"
#include "backend/FlightRecorder.hpp"
#include "backend/OpQueue.hpp"
#include "backend/routes/Route.hpp"
#include "fusion/StagingPool.hpp"
#include "shm/Engine.hpp"

#include <memory>
#include <string>
#include <vector>

namespace hsdp {

// Where a group's ranks are: hosts in the order their first rank appears,
// each host's ranks in group-rank order.
struct HostLayout {
  int hosts = 1;
  int perHost = 1;
  int host = 0;           // this rank's host
  int local = 0;          // this rank's index on its host
  std::vector<int> ranks; // ranks[h * perHost + l]: the group rank of host h's l-th rank

  int rankOf(int h, int l) const {
    return ranks[static_cast<size_t>(h) * perHost + l];
  }
  // The group ranks of host h, and of column l (one per host).
  std::vector<int> hostRanks(int h) const;
  std::vector<int> columnRanks(int l) const;
};

class ShmRoute final : public Route {
 public:
  ShmRoute(
      std::unique_ptr<shm::Engine> local,
      HostLayout layout,
      c10::intrusive_ptr<c10d::Backend> column, // null when flat
      int rank,
      int size,
      CommStats& stats,
      std::shared_ptr<StagingPool> staging);

  bool hierarchical() const {
    return column_ != nullptr;
  }
  const char* name() const override {
    return hierarchical() ? "hierarchical" : "shm";
  }
  bool scalesNatively() const override {
    return false; // the scale is fused into the reduction's kernel: one pass, no extra kernel
  }
  bool coalescesNatively() const override {
    return false;
  }
  // Whether the engine serves these tensors (CPU, dense, an engine dtype),
  // and a reduction planned for `dtype` (an engine op and scale).
  static bool serves(const std::vector<at::Tensor>& tensors);
  static bool serves(const ReducePlan& plan, at::ScalarType dtype);

  // Runs the plan on the engine's queue: inline for a synchronous call when
  // the queue is idle, else on its worker, in issue order. The call's
  // flight-record entry ends with it; a failure is raised (or fails the
  // Work) as DistBackendError naming this rank's flight record.
  Completion issue(const Call& call, Plan plan) override;
  // Where issue() records calls' ends; set once, before the first call.
  void recordInto(std::shared_ptr<FlightRecorder> trace) {
    trace_ = std::move(trace);
  }
  // Drains the queue and tells this host's peers this rank is gone: they
  // fail now instead of at their deadline (a correct program has nothing
  // left to wait for from a rank that finished its collectives).
  void leave(const std::string& why);
  const HostLayout& layout() const {
    return layout_;
  }
  bool directReads() const {
    return local_->directReads();
  }

  // Communication buffers (allocateTensor): a pool of at most `maxBytes` in
  // memory this host's peers map (shm/Pool.hpp), so that collectives whose
  // every rank passes one read peers' buffers with plain loads. Only with
  // direct reads (peers may open each other's descriptors); every rank of
  // the host calls it alike.
  void usePool(size_t maxBytes, size_t chunkBytes);
  bool allocates() const {
    return allocator_ != nullptr;
  }
  // A 1-D tensor of `numel` elements of `options`' dtype in the pool, or in
  // ordinary memory (counted) when the pool is at its bound.
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options);
  std::shared_ptr<c10::Allocator> allocator() const;
  struct BufferStats {
    shm::PoolStats pool;
    uint64_t fallbacks = 0;   // allocations served by ordinary memory
    uint64_t pooledCalls = 0; // calls that read peers' pool buffers
  };
  BufferStats bufferStats() const;

  // The engine's calls, for the whole group (see shm::Engine).
  void allGather(const char* op, const void* input, void* output, size_t bytesPerRank);
  void reduceScatter(
      const char* op,
      const void* input,
      void* output,
      size_t countPerRank,
      shm::DType dtype,
      shm::RedOp redop,
      shm::Scale scale);
  void allReduce(
      const char* op,
      void* data,
      size_t count,
      shm::DType dtype,
      shm::RedOp redop,
      shm::Scale scale);
  void broadcast(const char* op, void* data, size_t bytes, int root);
  void barrier(const char* op);
  // Piecewise all-gather: flat groups only (hierarchical ones pack).
  bool gathersPieces(size_t pieces, size_t totalBytes) const override {
    return !hierarchical() && local_->gathersPieces(pieces, totalBytes);
  }
  void allGatherPieces(
      const char* op,
      const std::vector<shm::Span>& inputs,
      const std::vector<std::vector<shm::Span>>& outputs) {
    local_->allGatherPieces(op, inputs, outputs);
  }

  void setCallerSeq(uint64_t seq) {
    local_->setCallerSeq(seq);
  }
  // Where every rank of this host is (the engine's view).
  std::string whereEveryRankIs() const {
    return local_->whereEveryRankIs();
  }
  // Fails this host's ranks at once; inter-host peers see this rank's
  // Gloo group fail when the process leaves or at their deadline.
  void abort(const std::string& why) {
    local_->abort(why);
  }

  // All-reduces of at least this many bytes (and divisible by L) send only
  // their 1/L across hosts.
  static constexpr size_t kSlicedAllReduceBytes = 64 << 10;
  // Reduce-scatters of at least this many input bytes reduce each host's
  // block separately (no reordering copy) when the group's ranks are in
  // host order.
  static constexpr size_t kBlockwiseBytes = 1 << 20;

 private:
  // Runs an inter-host phase: issue on the column group, wait. A failure
  // breaks this host's engine and raises shm::CommError naming `op`.
  template <typename Issue>
  void acrossHosts(const char* op, uint64_t bytes, Issue&& issue, bool count = true);
  class Transfers; // pairwise sends and receives on my column
  // All-reduce over my column (one rank per host) of data that is
  // identical on my host's ranks.
  void allReduceColumn(
      const char* op,
      void* data,
      size_t count,
      shm::DType dtype,
      shm::RedOp redop,
      shm::Scale scale);
  class FailsTheRoute;
  void checkUsable(const char* op) const;
  // One collective of a plan, on the engine.
  void run(const char* op, const Collective& c);
  [[noreturn]] void fail(const shm::CommError& e, uint64_t seq);
  void withinHost(uint64_t bytes);
  at::Tensor stage(size_t bytes);
  std::string prefix(const char* op) const;

  std::unique_ptr<shm::Engine> local_;
  HostLayout layout_;
  c10::intrusive_ptr<c10d::Backend> column_;
  int rank_;
  int size_;
  CommStats& stats_;
  std::shared_ptr<StagingPool> staging_;
  uint64_t exchanges_ = 0;
  std::string failure_; // the first inter-host failure: the route refuses work after it
  bool hostMajor_;      // rankOf(h, l) == h * perHost + l
  std::shared_ptr<FlightRecorder> trace_;
  class PoolAllocator;
  std::shared_ptr<PoolAllocator> allocator_; // null: no pool
  // Last: drained and joined before the engine its tasks use is gone.
  std::unique_ptr<OpQueue> queue_ = std::make_unique<OpQueue>();
};

} // namespace hsdp
