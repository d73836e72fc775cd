#pragma once

// ProcessGroupHSDP: the c10d backend registered as "hsdp".
//
// Contract, as for every c10d backend: all ranks of a group make the same
// collective calls in the same order, with matching sizes and dtypes.
//
// Every call is validated here (errors name the rank, the op and what was
// expected), planned, then routed by the device of its tensors:
//   CPU  tensors -> the shared-memory route (ShmRoute: the engine of
//                   csrc/shm/, and for a group that spans hosts with the same
//                   number of its ranks on each, that engine within hosts
//                   and Gloo between them) for the ops and dtypes it serves;
//                   the inner CPU route (ProcessGroupGloo) for the rest and
//                   for groups it cannot serve,
//   CUDA tensors -> the inner CUDA route (ProcessGroupNCCL), if CUDA exists.
// Inner routes (InnerRoute.hpp) are the one place that knows the inner
// backends' Work contract and orders hsdp's post-steps after them. What hsdp
// adds depends on what the route lacks (csrc/fusion/):
//   * AVG and PREMUL_SUM as SUM plus one deferred scale where the transport
//     has no native form (the engine, Gloo); NCCL gets them unchanged, a
//     divide_by as one PREMUL_SUM factor (ReducePlan),
//   * fused coalesced all-gather / reduce-scatter / bucketed all-reduce:
//     packed into one collective per dtype for Gloo (FlatPack), handed to
//     NCCL's own coalescing unpacked.
// The inner backends are built by the Python creator (torch wheels ship no
// Gloo or NCCL headers) and reached only through c10d::Backend's virtual API.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/CommStats.hpp"
#include "backend/FlightRecorder.hpp"
#include "backend/InnerRoute.hpp"
#include "backend/OpQueue.hpp"
#include "backend/ShmRendezvous.hpp"
#include "common/Config.hpp"
#include "common/Errors.hpp"
#include "fusion/ReducePlan.hpp"
#include "fusion/StagingPool.hpp"

#include <atomic>
#include <mutex>

namespace hsdp {

class ProcessGroupHSDP final : public c10d::Backend {
 public:
  ProcessGroupHSDP(
      c10d::Store& store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      std::unique_ptr<InnerRoute> cpuRoute,
      std::unique_ptr<InnerRoute> cudaRoute,
      const Config& config,
      std::optional<std::string> hostIdentity = std::nullopt);
  ~ProcessGroupHSDP() override;

  ProcessGroupHSDP(const ProcessGroupHSDP&) = delete;
  ProcessGroupHSDP& operator=(const ProcessGroupHSDP&) = delete;

  const std::string getBackendName() const override {
    return "hsdp";
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return options_;
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  // c10d names the group after creation; the flight recorder's files carry the name.
  void setGroupUid(const std::string& pgUid) override;
  // startCoalescing/endCoalescing group every op between them, point-to-point
  // included, on every route: batch_isend_irecv then issues its ops as one
  // batch (on NCCL one ncclGroupStart/End, without which a symmetric
  // exchange of large messages deadlocks) and returns one Work.
  bool supportsCoalescing() const override {
    return true;
  }
  // Splitting (what DeviceMesh and dist.split_group do for a group bound to
  // a device): each inner backend is split (NCCL's ncclCommSplit, a new Gloo
  // context) and the child gets its own shared-memory rendezvous.
  bool supportsSplitting() const override;
  // A default group bound to a GPU (init_process_group(device_id=...)):
  // NCCL connects eagerly and splits from the bound device.
// Virtual since torch 2.14; on 2.13 the inner NCCL backend is not told the bound device.
#if HSDP_TORCH_AT_LEAST_2_14
  void setBoundDeviceId(std::optional<at::Device> device) override;
#endif
  void eagerConnectSingleDevice(at::Device device) override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;
  // Counts this group's collectives (hsdp's own: most never reach an inner backend).
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void abort() override;
  void shutdown() override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work>
  broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work>
  allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work>
  reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  // dist.all_gather_coalesced: outputTensorLists[r][i] gets rank r's
  // inputs[i]; any shapes and dtypes, one fused all-gather.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputTensorLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work>
  send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work>
  recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  // hsdp's own API (bound in bindings.cpp).

  // Bucketed all-reduce: tensors grouped by dtype, packed into buckets of at
  // most bucketBytes (<= 0: one bucket per dtype), one collective a bucket;
  // the result is also divided by `divideBy`, in the op's one scaling step.
  c10::intrusive_ptr<c10d::Work> allreduceBucketed(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOp& op,
      int64_t bucketBytes,
      bool asyncOp,
      double divideBy = 1.0);

  // all_reduce / reduce_scatter_tensor whose result is also divided by
  // `divideBy`, fused with the op's own scale into one step (one rounding):
  // the deferred division of a chain of SUM collectives over several groups.
  c10::intrusive_ptr<c10d::Work>
  allreduceDividedBy(at::Tensor& tensor, const c10d::ReduceOp& op, double divideBy, bool asyncOp);
  c10::intrusive_ptr<c10d::Work> reduceScatterDividedBy(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceOp& op,
      double divideBy,
      bool asyncOp);

  CommStats& stats() {
    return stats_;
  }
  FlightRecorder& flightRecorder() {
    return *trace_;
  }
  // "shm" (one host), "hierarchical" (shared memory within hosts, gloo
  // between them), or the inner CPU backend's name ("gloo"; "nccl_contract"
  // in tests): what serves this group's CPU collectives.
  std::string cpuEngine() const {
    return engine_ ? engine_->name() : cpu_->caps().name;
  }
  c10d::Backend& cpuInner() const {
    return cpu_->backend();
  }
  bool shmDirectReads() const {
    return engine_ && engine_->directReads();
  }
  const std::string& shmUnavailableReason() const {
    return shmWhyNot_;
  }

 private:
  OpContext ctx(const char* op) const {
    return OpContext{rank_, size_, op};
  }
  // The CUDA device a barrier orders (as NCCL's would), if any.
  std::optional<at::Device> barrierDevice(const c10d::BarrierOptions& opts) const;
  // The inner route that serves tensors on `t`'s device, ready for an op to
  // issue on it (InnerRoute::beforeIssue: after the route's pending
  // post-step). Called before the op stages or reads its tensors.
  InnerRoute& route(const OpContext& ctx, const at::Tensor& t);
  // allreduceBucketed on a route that coalesces natively.
  c10::intrusive_ptr<c10d::Work> allreduceNative(
      InnerRoute& route,
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOp& op,
      int64_t bucketBytes,
      bool asyncOp,
      double divideBy);
  c10::intrusive_ptr<c10d::Work> allreduceImpl(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts,
      double divideBy);
  c10::intrusive_ptr<c10d::Work> reduceScatterImpl(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts,
      double divideBy);
  // Whether the shared-memory engine serves these CPU tensors.
  bool onShm(std::initializer_list<const at::Tensor*> tensors) const;
  bool onShm(const std::vector<at::Tensor>& tensors) const;
  // Runs `body` (engine calls plus any post-processing) on the engine's
  // queue: inline for a synchronous call when idle, else on the worker.
  c10::intrusive_ptr<c10d::Work> runShm(
      c10d::OpType type,
      bool asyncOp,
      std::vector<at::Tensor> outputs,
      std::function<void()> body);
  // Drains the engine's queue and tells peers this rank is gone.
  void leaveShm(const char* why);
  // Records `work` when called between startCoalescing and endCoalescing
  // (routes that coalesce natively hold their own).
  c10::intrusive_ptr<c10d::Work> track(c10::intrusive_ptr<c10d::Work> work);
  // The flight-recorder entry of one call, from recordCollective to the
  // end of the override: track() (or runShm) takes it over; if the call
  // raises first, the entry is closed as failed and the record dumped.
  class Traced {
   public:
    Traced(ProcessGroupHSDP& group, uint64_t seq);
    Traced(const Traced&) = delete;
    Traced& operator=(const Traced&) = delete;
    ~Traced();

   private:
    ProcessGroupHSDP& group_;
    const uint64_t seq_;
    const int exceptionsAtStart_;
  };
  // comm_stats' counters, the sequence number and the flight recorder's
  // entry, for one collective call; track() then follows the call's Work.
  [[nodiscard]] Traced recordCollective(const OpContext& c, uint64_t collectives, uint64_t bytes);
  // Fails a call made after abort() or shutdown().
  void checkUsable(const OpContext& c) const;
  // The failure of a collective on the shared-memory route, as c10d's
  // DistBackendError; the message names this rank's flight record.
  [[noreturn]] void failShm(const shm::CommError& e, uint64_t seq);

  c10::intrusive_ptr<Options> options_;
  const Config config_;                           // what a split child is built with
  const std::optional<std::string> hostIdentity_; // tests: a pretended host
#if !HSDP_TORCH_AT_LEAST_2_14
  // torch 2.13's ProcessGroup::splitGroup calls split() once per device type
  // the backend serves (cpu and cuda: the same backend), with the same store
  // prefix and ranks; a second rendezvous there races with the first one's
  // (gloo's connectFullMesh reads the other's addresses) and hangs. The
  // second call gets the first one's result. (torch 2.14 splits each backend
  // once.)
  struct LastSplit {
    std::string groupName;
    std::vector<int> ranks;
    c10::weak_intrusive_ptr<c10d::Backend> child;
    bool none = false; // this rank got no child
  };
  std::optional<LastSplit> lastSplit_;
#endif
  std::unique_ptr<InnerRoute> cpu_;
  std::unique_ptr<InnerRoute> cuda_; // null without CUDA
  CommStats stats_;
  std::atomic<uint64_t> sequence_{0};
  // "aborted" or "shut down" once abort() or shutdown() ran: every later
  // call fails with that (checkUsable), on every route.
  std::atomic<const char*> ended_{nullptr};
  // Shared with the callbacks that record completions, which may run after
  // this group is gone.
  std::shared_ptr<FlightRecorder> trace_;
  std::shared_ptr<StagingPool> staging_ = std::make_shared<StagingPool>();
  std::string shmWhyNot_;
  // Declared in this order so the queue (whose tasks use the engine) is
  // drained and joined before the engine is unmapped.
  std::unique_ptr<ShmRoute> engine_;
  std::unique_ptr<OpQueue> queue_;

  std::mutex coalescingMutex_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalescedWorks_;
};

} // namespace hsdp
