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
//   * async, CUDA: on a side stream that waited for every inner Work, then an
//     event; the returned Work's wait() makes the caller's stream wait on it;
//   * async, CPU: on the route's completion workers, in issue order (also
//     with no post-step when the inner backend has a fixedCompletionPool).
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

#include "backend/OpQueue.hpp"
#include "backend/WorkOnStream.hpp"
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
  // Gloo does (two by default): hsdp completes them on its own workers
  // instead, so callbacks that wait for collectives they issue cannot
  // exhaust that pool (see OpQueue.hpp).
  bool fixedCompletionPool = false;
  // Its CPU Works follow NCCL's stream contract (InnerRoute.hpp's list, a
  // stream-ordered future included), so CPU tensors take the CUDA branch,
  // on a device whose streams are hsdp's completion workers: the side
  // stream's waits and post-step run there, and the returned Work is a
  // WorkOnStream. Only an injected inner backend declares it (the tests'
  // NCCL-contract double does: everything the CUDA branch decides, which
  // Works order the result, through what, how errors and timeouts surface,
  // then runs on CPU).
  bool hostStreams = false;
  // With nativeScale (last, so that positional initialisers keep their
  // meaning): a bf16 PREMUL_SUM's factor reaches the transport
  // intact. ProcessGroupNCCL's is this torch release's (TorchCompat.hpp).
  bool bf16PreMulSum = HSDP_TORCH_NCCL_BF16_PREMUL_SUM_INTACT;
};

// One post-step that runs `steps` in order (empty when they are).
std::function<void()> inOrder(std::vector<std::function<void()>> steps);

class InnerRoute final : public Route {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;

  InnerRoute(c10::intrusive_ptr<c10d::Backend> backend, InnerCaps caps, int rank);
  InnerRoute(const InnerRoute&) = delete;
  InnerRoute& operator=(const InnerRoute&) = delete;

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
  Completion complete(const Call& call, std::vector<WorkPtr> works, Plan plan);

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
  WorkPtr finish(
      c10d::OpType type,
      bool asyncOp,
      std::vector<WorkPtr> works,
      std::vector<at::Tensor> outputs,
      std::function<void()> post = {},
      std::vector<at::Tensor> keepAlive = {});

  // Call before an op reads or writes its tensors on this route: orders the
  // current stream after the last async post-step still pending. NCCL runs
  // a group's ops in order on one stream, so two async ops on one tensor
  // need no wait() between them (c10d allows it); a post-step runs on a side
  // stream, which the next op's NCCL kernel (ordered after the caller's
  // stream only) would otherwise overtake. Post-steps are rare on CUDA (a
  // staged argument, an integer divide_by), so this is one event query, and
  // one stream wait when one is pending.
  void beforeIssue();

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
  // The inner Works an op's result depends on.
  struct Inner {
    // Ordered through each Work's device-aware future (on CPU: wait()).
    std::vector<WorkPtr> ops;
    // A native coalescing block's end Work: ordered by its synchronize().
    WorkPtr blockEnd;
    // The Works of async ops inside that block: they order after nothing,
    // and are kept for their errors only.
    std::vector<WorkPtr> companions;

    std::vector<WorkPtr> all() const;
  };

  WorkPtr finishInner(
      c10d::OpType type,
      bool asyncOp,
      Inner inner,
      std::vector<at::Tensor> outputs,
      std::function<void()> post,
      std::vector<at::Tensor> keepAlive);
  WorkPtr finishOnThread(
      c10d::OpType type,
      std::vector<WorkPtr> works,
      std::vector<at::Tensor> outputs,
      std::function<void()> post);
  WorkPtr finishOnStream(
      c10d::OpType type,
      c10::Device device,
      Inner inner,
      std::vector<at::Tensor> outputs,
      std::function<void()> post,
      std::vector<at::Tensor> keepAlive);
  // One collective of a plan, on the inner backend.
  WorkPtr run(const Call& call, const Collective& c);
  OpQueue& completions();
  // Remembers `work` as the route's last pending post-step when it has one.
  c10::intrusive_ptr<WorkOnStream> pending(bool hasPost, c10::intrusive_ptr<WorkOnStream> work);

  c10::intrusive_ptr<c10d::Backend> backend_;
  InnerCaps caps_;
  int rank_;

  std::mutex mutex_;
  SideStreams sideStreams_;                          // where async CUDA post-steps run
  std::unique_ptr<OpQueue> completions_;             // CPU async post-steps, made on first use
  std::shared_ptr<const PostStepMark> lastPostStep_; // see beforeIssue()
  // Whether lastPostStep_ is set: every op asks, and on routes that never
  // run post-steps on a stream (Gloo, and the shared-memory ops that pick a
  // route first) the answer needs no lock.
  std::atomic<bool> hasPostStep_{false};
  std::atomic<bool> connected_{false};
  bool coalescing_ = false;
  struct Held {
    std::vector<WorkPtr> works; // of the calls inside the block
    std::vector<at::Tensor> outputs;
    std::vector<std::function<void()>> posts;
    std::vector<at::Tensor> keepAlive;
  } held_;
};

} // namespace hsdp
