#pragma once

// A test double for ProcessGroupNCCL, over CPU tensors and an inner Gloo
// group, so that CI proves hsdp's CUDA route logic on machines without a GPU.
// Built into the tests' own module (hsdp_testing: Bindings.cpp), which the
// package never names; the tests hand it to hsdp as a group's inner CPU
// backend (tests/hooks.py).
//
// It behaves as ProcessGroupNCCL (torch 2.14.1) does where hsdp can observe
// it; each point is stated beside the code that models it:
//   * a synchronous call (asyncOp false) returns no Work: the result is in
//     place when the call returns (on CUDA: ordered on the current stream);
//   * an async call returns a Work whose result lands in the caller's
//     tensors when wait() is called, or kLandingDelay after the op finished;
//     its future completes when the data lands (a device-aware future orders
//     its consumers after the data) and never carries a failure. A post-step
//     that does not order itself after the Work reads stale data;
//   * failures reach a Work only through isCompleted() or wait(); a bounded
//     wait() that expires aborts the communicator and throws NCCL's message;
//     getError() is the first failure of any of the group's Works (TIMEOUT
//     for an op past its timeout, else COMM_ERROR), as the watchdog sets it;
//   * between startCoalescing and endCoalescing an async call returns a Work
//     that orders after nothing (complete future, wait() returns at once);
//     nothing lands before endCoalescing's Work is waited for, and that
//     Work's future is complete at once, empty (no event). The tensors of
//     the block's async calls are kept alive by the end Work; those of its
//     synchronous calls by nobody: one freed before the block ran fails the
//     block's Work, as NCCL would read or write freed memory;
//   * startCoalescing inside a block is refused;
//   * point-to-point ops of a pair are ordered, with bounded buffering: an
//     unbatched symmetric exchange over the bound deadlocks (until the
//     group's timeout), a batched one (inside a coalescing block) completes;
//   * a split (a group created with ``split_from``, and a non-member's
//     perform_nocolor_split) is collective over every rank of the parent:
//     a rank that does not join blocks its peers until the timeout;
//   * a shrink (shrink_group) is legacy ProcessGroupNCCL::shrink
//     (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) over NCCLComm::shrink
//     (NCCLUtils.cpp) and ncclCommShrink (libtorch_cuda.so's code of 2.11, 2.12 and 2.14.1, the
//     same messages in 2.15's; built with NCCL_HAS_COMM_SHRINK, NCCL 2.27+;
//     2.13 has only a CPU wheel here): among the ranks that stay, on the
//     communicator that must already exist (none before the first
//     collective or an eager connect: it refuses), renumbered in order; it
//     refuses an empty list, every rank, a rank out of range, and checks
//     nothing else: a rank given twice is counted twice in the child's size
//     (size - list length), and the flags (SHRINK_ABORT) go to NCCL as given;
//   * it has no communicator until its first collective or an eager connect
//     (isInitialized() false: ProcessGroupNCCL::isInitialized, an empty
//     devNCCLCommMap_; Backend::isInitialized from torch 2.15); a
//     point-to-point op makes its pair's, which isInitialized() counts and
//     neither a split nor the memory pool uses; a split's child has one from
//     the start (ncclCommSplit builds it);
//   * AVG and PREMUL_SUM are done inside the reduction: floating-point
//     inputs are pre-multiplied by the factor, integer AVG sums and then
//     divides with truncation; every other op unchanged. AVG's factor is
//     NCCL's own, 1/nRanks correctly rounded to the dtype. A PREMUL_SUM
//     factor is what the modelled release's ProcessGroupNCCL hands NCCL
//     (getNcclReduceOp's `unpackPreMulSum<T, dataType>`, read from each
//     release's libtorch_cuda.so: docs/versions.md): a host factor is
//     T(double_factor), of which NCCL reads the dtype's size in bytes; a
//     tensor factor is read with const_data_ptr<T>() (another dtype raises
//     torch's own error) and then as the data's dtype on the device. T is
//     the data's dtype, but for bf16 before torch 2.14: float, so a bf16
//     host factor arrives as the float's low half (0 for 0.5), a bf16
//     factor tensor raises and an fp32 one is read by its low half too.
// Every reduction it receives is logged, so tests see what hsdp sent.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/OpQueue.hpp"
#include "common/TorchCompat.hpp"

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>

namespace hsdp::testing {

class NcclContractBackend final : public c10d::Backend {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  // `release`: the torch minor release whose ProcessGroupNCCL it models
  // (default: the one it is built against).
  // `store`: where its shrinks' Gloo groups meet (ncclCommShrink needs
  // none; the Gloo standing for it does); none: it cannot shrink.
  NcclContractBackend(
      c10::intrusive_ptr<c10d::Backend> gloo,
      int rank,
      int size,
      int release = TORCH_VERSION_MINOR,
      c10::intrusive_ptr<c10d::Store> store = nullptr);

  // Whether the modelled release hands NCCL a bf16 PREMUL_SUM factor as a
  // float (unpackPreMulSum<float, ncclBfloat16>: torch 2.11 to 2.13).
  bool bf16FactorAsFloat() const {
    return release_ < 14;
  }

  const std::string getBackendName() const override {
    return "nccl_contract";
  }
  bool supportsCoalescing() const override {
    return true;
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return gloo_->getBackendOptions();
  }
  // As ProcessGroupNCCL: a child communicator per split.
  bool supportsSplitting() const override {
    return gloo_->supportsSplitting();
  }
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>& opts) override {
    auto child = gloo_->split(store, ranks, opts);
    if (!child) {
      return nullptr;
    }
    auto double_ = c10::make_intrusive<NcclContractBackend>(
        child, child->getRank(), child->getSize(), release_, store);
    double_->connected_ = true;
    return double_;
  }
  bool supportsShrinking() const override {
    return true;
  }
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude,
      int shrinkFlags,
      const c10::intrusive_ptr<Options>& optsOverride) override;
  // The flags of the shrink that made this communicator (-1: not a shrink's).
  int shrunkWithFlags() const {
    return shrunkWithFlags_;
  }
  // ProcessGroupNCCL::isInitialized (an override of Backend's from torch 2.15).
#if HSDP_TORCH_HAS_IS_INITIALIZED
  bool isInitialized() override {
#else
  bool isInitialized() {
#endif
    // Any communicator in devNCCLCommMap_, a point-to-point pair's included
    // (ProcessGroupNCCL::isInitialized, 2.15): not what a split or the
    // memory pool needs, which is the group's own (connected_).
    return connected_ || pairConnected_;
  }
  void eagerConnectSingleDevice(at::Device device) override {
    connected_ = true;
  }
  void setTimeout(std::chrono::milliseconds timeout) override {
    gloo_->setTimeout(timeout);
  }
  uint64_t getSequenceNumberForGroup() override {
    return gloo_->getSequenceNumberForGroup();
  }
  void abort() override {
    gloo_->abort();
  }
  void shutdown() override {
    gloo_->shutdown();
  }
  void startCoalescing() override;
  WorkPtr endCoalescing() override;

  WorkPtr broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  WorkPtr allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  WorkPtr allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts)
      override;
  WorkPtr allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  WorkPtr gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  WorkPtr scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  WorkPtr reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override;
  WorkPtr send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;

  // ncclCommSplit's color for a rank that takes no part in the new group.
  static constexpr int64_t kNoColor = -1;
  // This rank's part in a split of this communicator. ProcessGroupNCCL
  // (torch 2.14.1) splits in two places: a group created with
  // Options::split_from and split_color (what torch's NCCL creator sets
  // from _process_group_color) splits the parent's communicator when it
  // connects, and ProcessGroupNCCL::performNocolorSplit (what new_group
  // calls on each non-member) splits it with NCCL_SPLIT_NOCOLOR. Both reach
  // ncclCommSplit (NCCL 2.30.7, the one torch 2.14.1 ships), a collective
  // over every rank of the parent: each rank blocks until all have called
  // it, and the ranks that gave one color form one new communicator. Here:
  // an all-gather of the colors on the parent, then a check that `color`
  // was given by exactly `newSize` ranks. Test: a split a parent rank never
  // joins fails (test_nccl_contract_splits).
  void joinSplit(int64_t color, int newSize);

  // Communication buffers, as ProcessGroupNCCL (torch 2.14.1) hands them
  // out (FSDP2's set_allocate_memory_from_process_group_for_comm):
  //   * supportsTensorAlloc(index): whether that device can serve them
  //     (NCCL: c10d::cuda::deviceSupportsMulticast(index)); here the
  //     double's device, CPU (index -1), standing for a multicast GPU;
  //   * allocateTensor refuses options that name no device
  //     (TORCH_CHECK_VALUE "Tensor options must include device") or a device
  //     of another kind (a ValueError, "NCCL tensor allocator expects cuda
  //     type but got ...", read from libtorch_cuda.so of 2.11, 2.12, 2.14.1
  //     and 2.15; the wording "expects a CUDA device" is nccl2's; here CPU
  //     stands for CUDA), else allocates from the
  //     communicator's own memory pool (a MemPool over ncclMemAlloc):
  //     counted here, so a test sees that a request reached it; before the
  //     communicator exists it raises NCCL's "NCCL communicator has not been
  //     initialized before mem pool creation ...";
  //   * getMemAllocator returns that pool's allocator.
  // Not modelled: NCCL's check that the device is the one it is bound to
  // (the double serves one device).
  bool supportsTensorAlloc(c10::DeviceIndex index) override {
    return index == -1;
  }
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  int64_t allocations() const {
    return allocations_.load();
  }

  // The next op's Work fails with `message` (the op still runs, so the
  // ranks stay in step).
  // The first failure any of its Works met (DeferredWork, NcclContractBackend.cpp).
  c10d::ErrorType getError() override {
    return static_cast<c10d::ErrorType>(commError_->load());
  }
  void failNext(const std::string& message);
  // "op:REDUCTION" for every reduction received, in order ("all_reduce:AVG").
  std::vector<std::string> receivedReductions();

 private:
  // Issues `issue` on Gloo with private copies of `outputs` (what it
  // returns is Gloo's Works) and hands back what NCCL would.
  // `inputs`: what the op reads besides `outputs` (its lifetime is checked
  // inside a coalescing block).
  WorkPtr
  run(c10d::OpType type,
      bool asyncOp,
      std::vector<at::Tensor> outputs,
      const std::function<std::vector<WorkPtr>(std::vector<at::Tensor>&)>& issue,
      const std::vector<at::Tensor>& inputs = {});
  // The reduction Gloo runs for `op`, pre-multiplying `t` (a private copy
  // of the input) for AVG and PREMUL_SUM.
  c10d::ReduceOp sumFor(const char* what, const c10d::ReduceOp& op, const at::Tensor& t);
  // Lands an async Work's data on its own (`land`), kLandingDelay after it
  // was issued.
  void landLater(std::function<void()> land);
  // What a Work runs when a bounded wait expires: NCCL aborts the
  // communicator.
  std::function<void()> abortComm();

  // Whether `t`'s send must wait for its receive (see send()).
  bool pairedWithReceive(const at::Tensor& t);

  // What NCCL buffers of a send before the receive runs: of the order of
  // NCCL_BUFFSIZE (4 MiB by default); smaller here to keep tests light.
  static constexpr size_t kP2PBufferBytes = 256 * 1024;
  // The tag offset of a receive's "posted" announcement.
  static constexpr int kReceivePostedTag = 1 << 28;

  // Long against the microseconds a post-step takes to start, short against
  // a test: code that reads before waiting sees stale data every time.
  static constexpr std::chrono::milliseconds kLandingDelay{50};

  c10::intrusive_ptr<c10d::Backend> gloo_;
  const int release_;
  const c10::intrusive_ptr<c10d::Store> store_;
  int shrinks_ = 0;
  int shrunkWithFlags_ = -1;
  std::mutex mutex_;
  std::atomic<bool> connected_{false};     // the group's communicator exists
  std::atomic<bool> pairConnected_{false}; // a point-to-point pair's does
  bool coalescing_ = false;
  std::vector<WorkPtr> held_; // calls made while coalescing
  bool heldAsync_ = false;
  std::vector<at::Tensor> stashed_; // the block's async calls' tensors
  std::shared_ptr<std::atomic<int>> commError_ =
      std::make_shared<std::atomic<int>>(static_cast<int>(c10d::ErrorType::SUCCESS));
  std::string failNext_;
  std::vector<std::string> received_;
  std::atomic<int64_t> allocations_{0};
  OpQueue lander_; // declared last: drained (every Work landed) first
};

} // namespace hsdp::testing
