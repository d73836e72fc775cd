#pragma once

// The Work that hsdp hands back for a call whose result needs more than the
// inner collective: a deferred scale, an unpack of a fused buffer, or a
// result computed entirely by hsdp. It completes when its future does.
//
// Contract (as c10d documents it): wait() blocks until the result is in place
// and rethrows the failure if there was one; isCompleted() never blocks;
// getFuture() completes with the output tensors. For CUDA the future carries
// the streams, so wait() orders the caller's current stream after the result.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>

namespace hsdp {

class WorkHSDP : public c10d::Work {
 public:
  WorkHSDP(
      int rank,
      c10d::OpType opType,
      c10::intrusive_ptr<c10::ivalue::Future> future);

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
  static c10::intrusive_ptr<c10d::Work> completed(
      int rank,
      c10d::OpType opType,
      std::vector<at::Tensor> outputs);

  // A Work that completes after every one of `inners` does and `then` has
  // run (on whichever thread completes the last of them). A failure of any
  // is stored and rethrown by wait(); `then` does not run after a failure.
  static c10::intrusive_ptr<c10d::Work> chain(
      int rank,
      c10d::OpType opType,
      const std::vector<c10::intrusive_ptr<c10d::Work>>& inners,
      std::vector<at::Tensor> outputs,
      std::function<void()> then);

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace hsdp
