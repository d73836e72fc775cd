#pragma once

// The tests' model of a CUDA side stream on host threads, for an inner CPU
// backend that keeps NCCL's stream contract (the NCCL-contract double): with
// it, CPU tensors take the CUDA route's completion (routes/PostSteps.hpp,
// StreamOrdered: which inner Works order a post-step and through what, the
// WorkOnStream's waits, errors and timeouts, later ops ordered after a
// pending post-step), so all of it runs in CI without a GPU.
//
// A side stream is a completion worker queue (OpQueue, through
// WorkHSDP::onQueue): `run` hands the post-step to it and returns at once,
// as enqueuing on a stream does; the worker runs it (its ordering waits
// are host waits there) and completes the future with the outputs. What is
// modelled differs from a device stream where a host thread must:
//   * the mark is done once the post-step has run, the Work's waiting ends
//     after the future's callbacks too, as a WorkHSDP's does (on a
//     completion thread, with the future: WorkHSDP.hpp's rule);
//   * a post-step that throws fails the future (a device stream would fail
//     the kernel), which the WorkOnStream reports as the op's failure.
// Its workers and their completion-thread rule (WorkHSDP.hpp) are this
// module's own copy: a callback on them that waits for a Work the package
// completes on its own workers (none on the double's route, which has no
// shared-memory engine) would be waited for as from a caller's thread.

#include "backend/OpQueue.hpp"
#include "backend/WorkOnStream.hpp"

#include <memory>
#include <mutex>

namespace hsdp::testing {

class HostStreams final : public PostStepStreams {
 public:
  bool serves(c10::Device device) const override {
    return device.is_cpu();
  }
  PostStepRun
  run(c10::Device device,
      std::function<void()> step,
      const std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor> keepAlive) override;
  std::shared_ptr<PostStepStreams> another() const override {
    return std::make_shared<HostStreams>();
  }

 private:
  std::mutex mutex_;
  std::unique_ptr<OpQueue> queue_; // made on first use, as a route's workers are
};

} // namespace hsdp::testing
