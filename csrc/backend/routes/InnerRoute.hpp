#pragma once

// The route to an inner c10d backend (ProcessGroupGloo, ProcessGroupNCCL, or
// an inner CPU backend injected in Gloo's place): the one place that knows how an inner
// backend's Work behaves and how hsdp's post-step is ordered after it.
//
// The contract, as ProcessGroupNCCL defines it since torch 2.8 (Gloo is the
// special case whose Works are host-complete when their futures are):
//   * a synchronous call may return no Work: the op is complete (CPU) or
//     ordered on the caller's current stream (CUDA);
//   * an async Work's result is in place only after wait(); on CUDA wait()
//     makes the current stream wait for NCCL's stream (the host does not
//     block) and the Work's future completes before the data is written;
//   * failures surface through wait().
// So a post-step (a deferred scale, an unpack, the copy back of a staged
// argument) runs only after wait() on every inner Work, and where it runs
// decides what the returned Work means:
//   * synchronous: on the calling thread and the current stream, at once;
//   * async, stream-ordered Works (NCCL's): on a side stream that waited for
//     every inner Work, then an event; the returned Work's wait() makes the
//     caller's stream wait on it;
//   * async, host-complete Works (Gloo's): on the route's completion
//     workers, in issue order (also with no post-step when the inner
//     backend has a fixedCompletionPool).
// The route's PostSteps is one of the two, chosen when it is built
// (routes/PostSteps.hpp).
// Between startCoalescing and endCoalescing on a backend that coalesces
// natively (NCCL launches nothing before endCoalescing) post-steps are held
// back and run after endCoalescing's Work (at once, on the caller's stream,
// when the block's last call was synchronous: NCCL then returns none, the
// block having run on that stream). The Works NCCL returns for async
// ops inside the block order after nothing (their futures are complete at
// enqueue, before ncclGroupEnd launches the block), and the end Work's
// future is complete and empty, so carries no event: the block's result is
// ordered by the end Work's synchronize() alone (orderAfter).

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/routes/PostSteps.hpp"
#include "backend/routes/Route.hpp"
#include "common/TorchCompat.hpp"

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hsdp {

// What an inner backend does natively.
// The Python creator builds the group's inner backends and hands them over
// with these: Gloo's and NCCL's are fixed; an inner CPU backend injected in
// their place (hsdp_backend._registration.hooks) brings its own.
struct InnerCaps {
  std::string name; // "gloo", "nccl", or an injected backend's
  // Runs AVG and PREMUL_SUM inside the reduction (NCCL's ncclAvg and
  // ncclRedOpCreatePreMulSum): hsdp passes them through, no extra kernel.
  bool nativeScale = false;
  // Groups the ops between startCoalescing and endCoalescing, and the
  // *_coalesced calls, into one launch: hsdp forwards them without packing.
  bool nativeCoalescing = false;
  // Completes async Works' futures on a fixed pool of its own threads, as
  // Gloo does (HostWorkers, routes/PostSteps.hpp).
  bool fixedCompletionPool = false;
  // With nativeScale (after the flags, so that positional initialisers keep
  // their meaning): a bf16 PREMUL_SUM's factor reaches the transport
  // intact. ProcessGroupNCCL's is this torch release's (TorchCompat.hpp).
  bool bf16PreMulSum = HSDP_TORCH_NCCL_BF16_PREMUL_SUM_INTACT;
  // Its async Works follow NCCL's stream contract (the list above, a
  // stream-ordered future included): post-steps run on these side streams
  // (StreamOrdered; a route takes its own, another()). None: its Works are
  // host-complete (HostWorkers). The inner NCCL's are the device's own; an
  // injected inner CPU backend may bring a model of its own (the tests'
  // NCCL-contract double brings host threads as streams, so that everything
  // the CUDA route decides runs on CPU).
  std::shared_ptr<PostStepStreams> streams;
};

// One post-step that runs `steps` in order (empty when they are).
std::function<void()> inOrder(std::vector<std::function<void()>> steps);

class InnerRoute final : public Route {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  InnerRoute(c10::intrusive_ptr<c10d::Backend> backend, InnerCaps caps, int rank);
  InnerRoute(const InnerRoute&) = delete;
  InnerRoute& operator=(const InnerRoute&) = delete;
  // This rank's new place after the inner backend was reconfigured (no call in flight).
  void setRank(int rank) {
    rank_ = rank;
  }

  const char* name() const override {
    return caps_.name.c_str();
  }
  NativeScale scalesNatively() const override {
    return {caps_.nativeScale, caps_.bf16PreMulSum};
  }
  bool coalescesNatively() const override {
    return caps_.nativeCoalescing;
  }
  // Stages in, issues each collective on the inner backend (a list as its
  // *_coalesced form), and finishes with the deferred scales, then the
  // plan's post-step.
  Completion issue(const Call& call, Plan&& plan) override;
  // The completion of an op the override issued on backend() itself (the
  // forms no route plans: gather, scatter, all-to-all, point-to-point, list
  // and sparse forms), finished by `plan`'s post-step.
  Completion finish(const Call& call, std::vector<WorkPtr> works, Plan plan);

  c10d::Backend& backend() const {
    return *backend_;
  }
  const InnerCaps& caps() const {
    return caps_;
  }

  // The Work to hand back for an op issued on the inner backend as `works`
  // (null entries: complete, or ordered on the current stream) whose result
  // also needs `post` (empty: nothing). `outputs` become the future's value;
  // `keepAlive` are buffers `post` or the inner op still use. Returns null
  // for a synchronous call whose inner op returned none and needs no post.
  WorkPtr workFor(
      c10d::OpType type,
      bool asyncOp,
      std::vector<WorkPtr> works,
      std::vector<at::Tensor> outputs,
      std::function<void()> post = {},
      std::vector<at::Tensor> keepAlive = {});

  // Whether async post-steps run on side streams, which a later op on the
  // route must order after (NCCL's; the NCCL-contract double's on CPU).
  // Post-steps of host-complete Works leave nothing to order after.
  bool ordersOnStreams() const {
    return streamOrdered_ != nullptr;
  }
  // Call before an op reads or writes its tensors on this route, its
  // planning included (staged and packed copies): see
  // StreamOrdered::beforeIssue.
  void beforeIssue() {
    if (streamOrdered_ != nullptr) {
      streamOrdered_->beforeIssue();
    }
  }

  // Whether the inner backend has made its communicator. NCCL makes it at
  // the first collective (or an eager connect, or a split), not at creation.
  // Tracked here: Backend::isInitialized() exists only from torch 2.15, and
  // it also counts point-to-point communicators, which only some ranks make
  // (hsdp's barrier asks, and every rank must answer alike).
  bool connected() const {
    return connected_.load(std::memory_order_acquire);
  }
  void markConnected() {
    connected_.store(true, std::memory_order_release);
  }

  // Native coalescing only (caps().nativeCoalescing).
  void startCoalescing();
  // The Work of everything issued since startCoalescing, post-steps
  // included; null when nothing was.
  WorkPtr endCoalescing();

 private:
  using Inner = InnerWorks;

  WorkPtr workForInner(
      c10d::OpType type,
      bool asyncOp,
      Inner inner,
      std::vector<at::Tensor> outputs,
      std::function<void()> post,
      std::vector<at::Tensor> keepAlive);
  // One collective of a plan, on the inner backend.
  WorkPtr run(const Call& call, const Collective& c);

  c10::intrusive_ptr<c10d::Backend> backend_;
  InnerCaps caps_;
  int rank_;

  std::unique_ptr<PostSteps> postSteps_;   // chosen by caps_.streams
  StreamOrdered* streamOrdered_ = nullptr; // postSteps_, where it orders on streams
  std::mutex mutex_;                       // the coalescing block's state
  std::atomic<bool> connected_{false};
  std::atomic<bool> coalescing_{false}; // written under mutex_
  struct Held {
    std::vector<WorkPtr> works; // of the calls inside the block
    std::vector<at::Tensor> outputs;
    std::vector<std::function<void()>> posts;
    std::vector<at::Tensor> keepAlive;
  } held_;
};

} // namespace hsdp
