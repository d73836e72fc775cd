#pragma once

// How an inner route's async ops complete once they need a Work of hsdp's
// own (a post-step to run after the inner Works, or several Works to join):
// where the post-step runs, what Work the caller gets, and how the route's
// later ops are ordered after a post-step still pending. One per route,
// chosen when the route is built, by what its inner backend's Works are
// (InnerRoute.hpp states both contracts):
//   * HostWorkers: host-complete Works (Gloo, or any CPU backend whose wait()
//     returns with the data in place): the post-step runs on the route's
//     completion workers (OpQueue) after every inner Work's wait() returned,
//     and the Work is a WorkHSDP;
//   * StreamOrdered: NCCL's stream-ordered Works: the post-step runs on a
//     side stream (PostStepStreams: the device's own on CUDA) that waited for
//     every inner Work's result, and the Work is a WorkOnStream, which later
//     ops on the route also wait for.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/OpQueue.hpp"
#include "backend/WorkOnStream.hpp"

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace hsdp {

// The inner Works an op's result depends on.
struct InnerWorks {
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  // Ordered through each Work's device-aware future (on CPU: wait()).
  std::vector<WorkPtr> ops;
  // A native coalescing block's end Work: ordered by its synchronize().
  WorkPtr blockEnd;
  // The Works of async ops inside that block: they order after nothing,
  // and are kept for their errors only.
  std::vector<WorkPtr> companions;

  std::vector<WorkPtr> all() const;
};

class PostSteps {
 public:
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  virtual ~PostSteps() = default;

  // Whether an async op that needs nothing after its one inner Work may hand
  // that Work back as its own.
  virtual bool handsBackInnerWork(c10d::OpType type) const = 0;
  // The Work of an async op whose result is `inner`'s, then `post` (empty:
  // nothing). `outputs` become the future's value; `keepAlive` are buffers
  // `post` or the inner ops still use.
  virtual WorkPtr workAfter(
      int rank,
      c10d::OpType type,
      InnerWorks inner,
      std::vector<at::Tensor> outputs,
      std::function<void()> post,
      std::vector<at::Tensor> keepAlive) = 0;
};

class HostWorkers final : public PostSteps {
 public:
  // `fixedCompletionPool`: the inner backend completes its futures on a
  // fixed pool of its own threads, as Gloo does (two by default): hsdp
  // completes them on its own workers instead, so that callbacks that wait
  // for collectives they issue cannot exhaust that pool (see OpQueue.hpp).
  // Point-to-point Works stay the inner backend's own (see workAfter()).
  explicit HostWorkers(bool fixedCompletionPool) : fixedCompletionPool_(fixedCompletionPool) {}

  bool handsBackInnerWork(c10d::OpType type) const override;
  WorkPtr workAfter(
      int rank,
      c10d::OpType type,
      InnerWorks inner,
      std::vector<at::Tensor> outputs,
      std::function<void()> post,
      std::vector<at::Tensor> keepAlive) override;

 private:
  const bool fixedCompletionPool_;
  std::mutex mutex_;
  std::unique_ptr<OpQueue> queue_; // made on first use
};

class StreamOrdered final : public PostSteps {
 public:
  explicit StreamOrdered(std::shared_ptr<PostStepStreams> streams);

  bool handsBackInnerWork(c10d::OpType) const override {
    return true;
  }
  WorkPtr workAfter(
      int rank,
      c10d::OpType type,
      InnerWorks inner,
      std::vector<at::Tensor> outputs,
      std::function<void()> post,
      std::vector<at::Tensor> keepAlive) override;
  // Orders the current stream after the last async post-step still pending.
  // NCCL runs a group's ops in order on one stream, so two async ops on one
  // tensor need no wait() between them (c10d allows it); a post-step runs
  // on a side stream, which the next op's NCCL kernel (ordered after the
  // caller's stream only) would otherwise overtake. Post-steps are rare on
  // CUDA (a staged argument, an integer divide_by), so this is one event
  // query, and one stream wait when one is pending.
  void beforeIssue();

 private:
  const std::shared_ptr<PostStepStreams> streams_;
  // An op without tensors (nothing on a device to order after) completes on
  // the host.
  HostWorkers host_{/*fixedCompletionPool=*/false};
  std::mutex mutex_;
  std::shared_ptr<const PostStepMark> lastPostStep_;
  // Whether lastPostStep_ is set: every op asks, and most run no post-step
  // on a stream, so the answer needs no lock.
  std::atomic<bool> hasPostStep_{false};
};

} // namespace hsdp
