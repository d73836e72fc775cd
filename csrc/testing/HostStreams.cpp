#include "testing/HostStreams.hpp"

#include <ATen/core/ivalue.h>

#include "backend/WorkHSDP.hpp"

namespace hsdp::testing {

namespace {

// The end of a post-step on a host stream. `ended` completes at the first
// callback of the worker's future, so that a callback issuing on the route
// orders itself after the post-step, not after itself; `released` once the
// worker let go of the op, after every callback.
class HostMark final : public PostStepMark {
 public:
  HostMark(
      c10::intrusive_ptr<c10::ivalue::Future> ended,
      c10::intrusive_ptr<c10::ivalue::Future> released)
      : ended_(std::move(ended)), released_(std::move(released)) {}

  bool done() const override {
    return ended_->completed();
  }
  bool capturingNow() const override {
    return false;
  }
  bool captured() const override {
    return false;
  }
  void orderCurrentStreamAfter() const override {
    ended_->wait();
  }
  bool waitIsOver() const override {
    return done() && (released_->completed() || onCompletionThread());
  }
  void endWait() const override {
    if (onCompletionThread()) {
      ended_->wait();
    } else {
      released_->wait(); // after `ended`: one sleep, not two
    }
  }
  std::string where() const override {
    return "host streams";
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> ended_;
  c10::intrusive_ptr<c10::ivalue::Future> released_;
};

} // namespace

PostStepRun HostStreams::run(
    c10::Device,
    std::function<void()> step,
    const std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor> keepAlive) {
  // The carrier of the worker's future and `released`; it never reaches a
  // caller (the WorkOnStream does).
  OpQueue* queue;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!queue_) {
      queue_ = std::make_unique<OpQueue>();
    }
    queue = queue_.get();
  }
  auto done = WorkHSDP::onQueue(
      *queue,
      /*rank=*/-1,
      c10d::OpType::UNKNOWN,
      outputs,
      // The caller's tensors are written before this returns, so there is
      // nothing of the caller's to wait for first. The buffers stay alive
      // until the step ran (what recording them on the side stream does on
      // a device).
      [step = std::move(step), keepAlive = std::move(keepAlive)] { step(); });
  auto ended = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  done->getFuture()->addCallback([ended](c10::ivalue::Future& f) {
    if (f.hasError()) {
      ended->setError(f.exception_ptr());
    } else {
      ended->markCompleted();
    }
  });
  return {
      std::make_shared<const HostMark>(std::move(ended), done->released()), done->getFuture(), {}};
}

} // namespace hsdp::testing
