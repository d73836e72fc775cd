#pragma once

// The Work of a call whose result hsdp completes on a thread of its own: the
// shared-memory engine's queue, or an inner route's completion thread (CPU
// post-steps, see InnerRoute.hpp). Its future completes when the result is
// in place; waiting for the Work ends after the future's callbacks too (see
// onQueue).
//
// Contract (as c10d documents it): wait() blocks until the result is in place
// and rethrows the failure if there was one; isCompleted() never blocks;
// getFuture() completes with the output tensors. For CUDA the future carries
// the streams, so wait() orders the caller's current stream after the result.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/OpQueue.hpp"

#include <functional>
#include <mutex>

namespace hsdp {

// Under allow_inflight_collective_as_graph_input (torch.compile's eager
// path) c10d registers the Work a call returns with its tensors; a Work that
// was waited for must take itself off that registry, as WorkNCCL and Gloo's
// do.
void unregisterInflight(c10d::Work& work);

// A queue-completed Work's wait ends with its `released` future (see
// WorkHSDP::onQueue), after the callbacks of its future. Whether this thread
// is one of hsdp's completion threads, in a queued task or a completion step
// (where futures' callbacks run): a wait there ends with the future, as a
// Work that waited for the callbacks might wait for this very thread (a
// callback waiting for its own Work, or for one whose callback waits for
// it; a task joining the parts of a block whose callbacks wait for it).
// This rule, with OpQueue's workers and rescuer, is model-checked in
// csrc/backend/wait.pml (scripts/check_protocol.sh).
bool onCompletionThread();

class WorkHSDP : public c10d::Work {
 public:
  WorkHSDP(int rank, c10d::OpType opType, c10::intrusive_ptr<c10::ivalue::Future> future);

  // A Work complete at creation, on CPU tensors: its future is made on the
  // first getFuture() (most callers only wait; making and completing a
  // future costs an allocation, a type, a lock, the outputs' storages and a
  // wake-up).
  WorkHSDP(int rank, c10d::OpType opType, std::vector<at::Tensor> outputs);
  WorkHSDP(const WorkHSDP&) = delete;
  WorkHSDP& operator=(const WorkHSDP&) = delete;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // A Work that is already complete with `outputs`.
  static c10::intrusive_ptr<c10d::Work>
  completed(int rank, c10d::OpType opType, std::vector<at::Tensor> outputs);

  // What a synchronous call returns once its result is in place (or
  // ordered on the caller's stream): no Work, as NCCL's synchronous calls
  // (torch.distributed's functions take None for done). Under
  // allow_inflight_collective_as_graph_input (torch.compile's eager path)
  // a complete Work instead: c10d registers what a call returns with its
  // tensors, and wait_tensor() calls wait() on every entry, a null one too.
  static c10::intrusive_ptr<c10d::Work> ofSynchronousCall(int rank, c10d::OpType opType);

  // A Work that completes with `outputs` once `task` has run on `queue`
  // (or fails with what it threw). The future completes after the queue is
  // free again, so its callbacks may issue collectives on the same group.
  // Waiting ends once the future's callbacks ran (as Gloo's Work, which
  // finishes after its future; on a completion thread it ends with the
  // future) and the queue holds nothing of the call's, so a caller that
  // waited and then drops its tensors frees them (as with NCCL, whose
  // watchdog's copy of a Work leaves out the outputs).
  static c10::intrusive_ptr<WorkHSDP> onQueue(
      OpQueue& queue,
      int rank,
      c10d::OpType opType,
      std::vector<at::Tensor> outputs,
      std::function<void()> task);

  // An onQueue Work's end of waiting: completes (no value, never an error)
  // after the future, once the queue let go of the call.
  const c10::intrusive_ptr<c10::ivalue::Future>& released() const {
    return released_;
  }

 private:
  const bool completeAtCreation_ = false;
  // c10d registers a Work in its in-flight registry (after the backend
  // returns it) only under allow_inflight_collective_as_graph_input; a
  // Work made while that was off has nothing to take off it.
  const bool mayBeInflight_ = true;
  std::once_flag made_; // complete at creation: future_ made (by getFuture)
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  // onQueue: completed after future_, once the queue dropped the call's
  // tensors (what wait() waits for); none otherwise.
  c10::intrusive_ptr<c10::ivalue::Future> released_;
  std::vector<at::Tensor> outputs_; // complete at creation: the result
  // Not complete at creation: whether waiting would return now; wait so.
  bool waitIsOver() const;
  void waitForTheEnd() const;
  // What waiting ends with: off c10d's in-flight registry, if it may be on it.
  void leaveInflightRegistry() {
    if (mayBeInflight_) {
      unregisterInflight(*this);
    }
  }
};

} // namespace hsdp
