#pragma once

// ProcessGroupHSDP: the c10d backend registered as "hsdp".
//
// Contract, as for every c10d backend: all ranks of a group make the same
// collective calls in the same order, with matching sizes and dtypes.
//
// Every call is validated (errors name the rank, the op and what was
// expected: Checks.hpp), planned for its route (Plan.hpp), and issued on
// that route (routes/Route.hpp), chosen by the device of its tensors:
//   CPU  tensors -> the shared-memory route (ShmRoute: the engine of
//                   csrc/shm/, and for a group that spans hosts with the same
//                   number of its ranks on each, that engine within hosts
//                   and Gloo between them) for the ops and dtypes it serves;
//                   the inner CPU route (ProcessGroupGloo) for the rest and
//                   for groups it cannot serve,
//   CUDA tensors -> the inner CUDA route (ProcessGroupNCCL), if CUDA exists.
// Inner routes (routes/InnerRoute.hpp) are the one place that knows the inner
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
//
// ProcessGroupHSDP.cpp holds the group's life (creation, timeouts, abort
// and shutdown, coalescing blocks); membership/Membership.cpp the calls that
// change its members (split, shrink, reconfigure); Collectives.cpp the ops,
// each as: validate, plan, issue on the route.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/CommStats.hpp"
#include "backend/FlightRecorder.hpp"
#include "backend/Plan.hpp"
#include "backend/TimeoutExtension.hpp"
#include "backend/TracedCall.hpp"
#include "backend/membership/Membership.hpp"
#include "backend/membership/ShmRendezvous.hpp"
#include "backend/routes/InnerRoute.hpp"
#include "common/Config.hpp"
#include "common/Errors.hpp"
#include "fusion/ReducePlan.hpp"
#include "fusion/StagingPool.hpp"
#include "shm/FunctionRef.hpp"

#include <atomic>
#include <mutex>

namespace hsdp {

class ProcessGroupHSDP final : public c10d::Backend {
 public:
  // `awaitReconfigure` (init_process_group(enable_reconfigure=True)): the
  // group has no members until reconfigure() gives it some, and refuses
  // every call until then; its inner Gloo was made the same way.
  ProcessGroupHSDP(
      c10::intrusive_ptr<c10d::Store> store,
      int rank,
      int size,
      std::chrono::milliseconds timeout,
      std::unique_ptr<InnerRoute> cpuRoute,
      std::unique_ptr<InnerRoute> cudaRoute,
      const Config& config,
      std::optional<std::string> hostIdentity = std::nullopt,
      bool awaitReconfigure = false);
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
  // shrink_group: the ranks that stay get a group of their own, with a
  // shared-memory engine of its own. Each inner backend shrinks its own way:
  // NCCL with its shrink (ncclCommShrink among the ranks that stay), Gloo,
  // which has none, by a split without the excluded ranks (it needs only the
  // new group's members). SHRINK_ABORT first aborts this group's engine:
  // every wait in shared memory ends with an error naming the shrink; NCCL
  // ends its own pending ops; one pending in the inner Gloo (across hosts)
  // ends at its timeout, as Gloo has no abort. Not run on a GPU.
  bool supportsShrinking() const override;
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude,
      int shrinkFlags = 0,
      const c10::intrusive_ptr<Options>& optsOverride = nullptr) override;
  // A default group bound to a GPU (init_process_group(device_id=...)):
  // NCCL connects eagerly and splits from the bound device.
  void eagerConnectSingleDevice(at::Device device) override;
  // The virtuals c10d::Backend has from torch 2.14 (TorchCompat.hpp names
  // each: HSDP_TORCH_HAS_...).
#if HSDP_TORCH_AT_LEAST(2, 14)
  // The inner NCCL is told the bound device too (not on 2.13, where this is
  // not virtual).
  void setBoundDeviceId(std::optional<at::Device> device) override;
  // Every op issued from now until the first of them completes waits
  // `timeout` longer, on every route (TimeoutExtension.hpp).
  void addEphemeralTimeout(const std::chrono::milliseconds& timeout) override;
  // Run when one of the group's ops fails and before abort() (AbortHooks.hpp).
  void registerAbortHook(int64_t hookId, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t hookId) override;
#endif
  // The virtuals c10d::Backend has from torch 2.15.
#if HSDP_TORCH_AT_LEAST(2, 15)
  // Whether the group can be split: torch 2.15's split_group asks each rank
  // before it splits. The inner CPU backend's answer; not NCCL's, which
  // counts point-to-point communicators that only some ranks have (those
  // would enter a split the others refused): hsdp's split makes a missing
  // NCCL communicator itself, on every rank alike.
  bool isInitialized() override;
  // Collective time estimation, where the inner CUDA backend (NCCL) has it:
  // the collectives issued between start and end are simulated, not run.
  bool supportsTimeEstimation() const override;
  void startTimeEstimate() override;
  float endTimeEstimate() override;
  bool supportsAbortHooks() const override {
    return true;
  }
#endif
  // Communication buffers (FSDP2's set_allocate_memory_from_process_group_for_comm
  // allocates its all-gather output and reduce-scatter input here), from the
  // route their collectives take: on CPU the shared-memory pool (peers read
  // them with plain loads; shm/Pool.hpp), on CUDA the inner NCCL's memory
  // pool, exactly as on a plain nccl group. c10d hands supportsTensorAlloc
  // only an index (FSDP2 always names a CUDA device's).
  // getMemAllocator names no device: it is NCCL's when the group has CUDA
  // (its one consumer is a torch.cuda.MemPool over a group's allocator),
  // else the pool's; CPU buffers come from allocateTensor, which names one.
  bool supportsTensorAlloc(c10::DeviceIndex index) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override;
  // Counts this group's collectives (hsdp's own: most never reach an inner backend).
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  // The first failure this rank saw on the group, as ProcessGroupNCCL
  // reports its own: TIMEOUT (a shared-memory wait's deadline), REMOTE_ERROR
  // (another rank's failure broke the shared-memory group), COMM_ERROR
  // (another failure of an op of the group on this rank, on any route), or
  // what an inner backend says (NCCL's own; Gloo always says SUCCESS).
  c10d::ErrorType getError() override;
#ifdef C10D_BACKEND_HAS_RECONFIGURE
  // Fault tolerance (torch.distributed._reconfigure): the survivors of a lost
  // rank, or a new set of peers, become the group's members. Served on CPU
  // where the inner backend reconfigures (Gloo): the inner Gloo is
  // reconfigured with the members' handles, then the shared-memory engine
  // is built anew for the new members (a new segment: nothing of the old
  // membership is mapped after it, and a lost rank's late writes land in
  // the old segment, which no member reads). A group that serves CUDA is
  // refused: the ProcessGroupNCCL it wraps has no reconfigure.
  bool supportsReconfigure() const override;
  // "hsdp:1:<length of the group's uid>:<group uid><the inner Gloo's handle>".
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  // Synchronous; the Work it returns is complete. The handles are checked
  // first (this group's, the inner Gloo's shape, each once, this rank's
  // among them): a refused call leaves the group serving its members. The
  // new membership starts as a new group: sequence number 0, getError()
  // SUCCESS. Called, as on gloo, while no other thread issues ops on the
  // group (ProcessGroupGloo::reconfigure swaps its contexts unlocked) and
  // none is pending: shared-memory ones are ended first, but one pending in
  // the inner Gloo fails at its own timeout, into the new membership's
  // getError.
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
#if HSDP_TORCH_HAS_SUSPEND
  // The inner NCCL's: a group without CUDA holds no device memory to
  // release, and refuses naming that.
  void suspend() override;
  void resume() override;
  std::unordered_map<std::string, uint64_t> getMemoryStats() override;
#endif
  // Refused, naming what serves instead: each collective's start and end
  // are in the group's flight recorder (ProcessGroupNCCL deprecates its
  // completion hook in the recorder's favour), one op's end is its Work's.
  void
  registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override;
  void waitForPendingWorks() override;
  void enableCollectivesTiming() override;
  // Runs the abort hooks, then ends every pending wait with an error.
  void abort() override;
  // Drops the abort hooks, then leaves the group.
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
#if HSDP_TORCH_HAS_GATHER_SINGLE
  // A gather into one flat tensor of world size x input on the root (only
  // the root's `output` is read): on shared memory an all-gather whose
  // result only the root keeps, else the inner backend's gather (NCCL's
  // gather_single on CUDA, Gloo's gather into views of `output`).
  c10::intrusive_ptr<c10d::Work> gather_single(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
#endif
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
  // c10d calls it for sparse CUDA tensors only (a sparse CPU tensor's
  // all-reduce reaches allreduce): the inner backend of the tensors' device.
  c10::intrusive_ptr<c10d::Work>
  allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;

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
  // between them), or the inner CPU backend's name (InnerCaps::name: "gloo"
  // unless the creator was handed another): what serves this group's CPU
  // collectives.
  std::string cpuRoute() const {
    return shm_ ? shm_->name() : cpu_->caps().name;
  }
  c10d::Backend& cpuInner() const {
    return cpu_->backend();
  }
  // Null without CUDA.
  c10d::Backend* cudaInner() const {
    return cuda_ ? &cuda_->backend() : nullptr;
  }
  // From what size per rank the shared-memory engine reads peers' ordinary
  // buffers directly (all-gathers, broadcasts); 0: never, or no engine.
  size_t shmDirectReadBytes() const {
    return shm_ ? shm_->directReadBytes() : 0;
  }
  ShmRoute::BufferStats bufferStats() const {
    return shm_ ? shm_->bufferStats() : ShmRoute::BufferStats{};
  }
  const std::string& shmUnavailableReason() const {
    return shmWhyNot_;
  }
  // Why the engine does not read peers' memory where the settings want it
  // (the rendezvous probe's answer); empty if it does, or without an engine.
  std::string shmWhyNoDirectReads() const {
    return shm_ ? shm_->whyNoDirectReads() : "";
  }

 private:
  OpContext ctx(const char* op) const {
    return OpContext{rank_, size_, op};
  }
  // The CUDA device a barrier orders (as NCCL's would), if any.
  std::optional<at::Device> barrierDevice(const c10d::BarrierOptions& opts) const;
  // The device NCCL would make this rank's communicator on when it has none
  // of its own (ProcessGroupNCCL::guessDeviceForRank).
  at::Device guessCudaDevice(const OpContext& c) const;
  // A barrier (or a split) while the ranks have not agreed that the inner
  // NCCL's collective communicator exists: it is made, as NCCL's barrier
  // would, if any rank has a device for it (`device`: this rank's), or on
  // every rank when `required` (a split needs its parent's).
  void agreeOnCuda(Call& call, std::optional<at::Device> device, bool required = false);

  // The steps of every call (Collectives.cpp).
  Call begin(
      const char* op,
      c10d::OpType type,
      bool asyncOp,
      std::chrono::milliseconds timeout = c10d::kUnsetTimeout) const;
  // The inner route that serves tensors on `t`'s device; a CUDA call gets
  // its device. A route that orders on streams is readied for the op
  // (InnerRoute::beforeIssue: after its pending post-step) before the op
  // plans, stages or reads its tensors.
  InnerRoute& inner(Call& call, const at::Tensor& t);
  // Whether the shared-memory route serves these tensors.
  bool shmServes(const std::vector<at::Tensor>& tensors) const;
  // Whether the engine runs each dtype group's reduction (ShmRoute::takes).
  bool shmTakes(const std::vector<at::Tensor>& tensors, std::vector<DtypeGroup>& groups) const;
  // The shared-memory route when it serves the call, else `inner`.
  Route& shmOr(InnerRoute& inner, bool shmServes);
  // A reduction's route, chosen before the reduction is planned for it: the
  // shared-memory route when it serves the tensors (`shmServesTensors`) and
  // the reduction as planned for it, else `inner`, with the reduction (or
  // one per dtype group) planned for the route chosen.
  struct RoutedReduction {
    Route& route;
    ReducePlan reduce;
  };
  RoutedReduction routeReduction(
      const Call& call,
      InnerRoute& inner,
      bool shmServesTensors,
      const c10d::ReduceOp& op,
      const at::TensorOptions& options,
      int contributions,
      double divideBy = 1.0);
  struct RoutedGroups {
    Route& route;
    std::vector<DtypeGroup> groups;
  };
  RoutedGroups routeGroups(
      const Call& call,
      InnerRoute& inner,
      bool shmServesTensors,
      const std::vector<at::Tensor>& tensors,
      const c10d::ReduceOp& op,
      double divideBy);
  // comm_stats' counters, the sequence number and the flight-record entry
  // of one collective call.
  [[nodiscard]] TracedCall
  record(Call& call, uint64_t collectives, uint64_t bytes, const Route& route);
  // A planned call: recorded, issued on `route`, finished.
  c10::intrusive_ptr<c10d::Work> issue(Call& call, Route& route, Plan&& plan, uint64_t bytes);
  // A call no route plans, issued on the inner backend as it is by `op`
  // and finished by `done`'s post-step.
  c10::intrusive_ptr<c10d::Work> forward(
      Call& call,
      InnerRoute& route,
      uint64_t bytes,
      const std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>& op,
      Plan done = {});
  c10::intrusive_ptr<c10d::Work> pointToPoint(
      Call& call,
      std::vector<at::Tensor>& tensors,
      const std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&)>& op);
  // Releases the call's part of the timeout extension once `work` (none:
  // the call) has completed.
  void releaseExtensionAfter(const Call& call, const c10::intrusive_ptr<c10d::Work>& work);
  // Hands the call's entry to its completion; between startCoalescing and
  // endCoalescing also records the Work in the block (routes that coalesce
  // natively hold their own).
  c10::intrusive_ptr<c10d::Work> handOver(TracedCall& traced, Completion done);
  // handOver() for a call without a flight-record entry.
  c10::intrusive_ptr<c10d::Work> untraced(const Call& call, Completion done);

  c10::intrusive_ptr<c10d::Work> allreduceImpl(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts,
      double divideBy);
  c10::intrusive_ptr<c10d::Work> reduceScatterImpl(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts,
      double divideBy);
  // Fails a call made after abort() or shutdown(), or while the group awaits
  // its members (reconfigure).
  void checkUsable(const OpContext& c) const;
  using StorePtr = c10::intrusive_ptr<c10d::Store>;
  // A child group of `ranks` (split, shrink): `innerChild` makes each inner
  // backend's child from the route and a store prefixed for it.
  c10::intrusive_ptr<c10d::Backend> childOf(
      const StorePtr& store,
      const std::vector<int>& ranks,
      std::chrono::milliseconds timeout,
      shm::FunctionRef<c10::intrusive_ptr<c10d::Backend>(InnerRoute&, const StorePtr&)> innerChild);
  // Builds the shared-memory route for the current members, through `store`.
  void attachShm(c10d::Store& store);
  // Ends the shared-memory route of the current members, if any.
  void detachShm(const char* why);

  c10::intrusive_ptr<Options> options_;
  std::unique_ptr<InnerRoute> cpu_;
  std::unique_ptr<InnerRoute> cuda_; // null without CUDA
  // The device of this group's last CUDA op (-1: none yet): a barrier's
  // device when the call names none (barrierDevice).
  std::atomic<c10::DeviceIndex> lastCudaDevice_{-1};
  // Every rank's inner NCCL has its communicator, as a barrier's agreement
  // found (set alike on every rank: agreeOnCuda).
  bool cudaAgreed_ = false;
  CommStats stats_;
  std::atomic<uint64_t> sequence_{0};
  // "aborted" or "shut down" once abort() or shutdown() ran: every later
  // call fails with that (checkUsable), on every route.
  std::atomic<const char*> ended_{nullptr};
  // Shared with the callbacks that record completions, which may run after
  // this group is gone.
  std::shared_ptr<FlightRecorder> trace_;
  // Where async CUDA entries' "done" events are recorded (TracedCall).
  std::shared_ptr<SideStreams> recorderStreams_ = std::make_shared<SideStreams>();
  std::shared_ptr<StagingPool> staging_ = std::make_shared<StagingPool>();
  // Shared with the completions that release an extension, which may run
  // after this group is gone, and read by the engine's waits.
  std::shared_ptr<TimeoutExtension> timeoutExtension_ = std::make_shared<TimeoutExtension>();
  std::string shmWhyNot_;
  std::unique_ptr<ShmRoute> shm_; // null: no shared memory for this group
  Membership membership_;
  // getError's first answer other than SUCCESS, kept as the watchdog keeps
  // ProcessGroupNCCL's first failure.
  std::atomic<int> firstError_{static_cast<int>(c10d::ErrorType::SUCCESS)};

  std::mutex coalescingMutex_;
  std::atomic<bool> coalescing_{false}; // written under coalescingMutex_
  std::vector<c10::intrusive_ptr<c10d::Work>> coalescedWorks_;
};

} // namespace hsdp
