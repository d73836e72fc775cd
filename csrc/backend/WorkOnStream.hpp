#pragma once

// The Work of an async op on a device with streams (CUDA), whose post-step
// was enqueued on a side stream after every inner Work (see InnerRoute.hpp).
//
// GPU-aware, as WorkNCCL is: isCompleted() is true only once the device has
// run the post-step (an event recorded after it); wait() makes the caller's
// current stream wait for that event and does not block the host;
// getFuture() carries the event through the future's own device events.
//
// Failures and bounded waits behave as the inner WorkNCCL's do, because they
// are its: NCCL's watchdog finds a failure on a copy of each Work, and a
// Work learns of it only when its isCompleted() or wait() asks the
// communicator (WorkNCCL::checkAndSetException), so exception() and
// isCompleted() ask every inner Work's isCompleted() first. wait(timeout)
// waits on the inner Works with the timeout, which on NCCL blocks the host
// and, on expiry, aborts the communicator and throws NCCL's "... ran for N
// milliseconds before timing out"; then the post-step gets what is left of
// the timeout.
//
// Where the side stream is and how its end is waited for is the stream
// model's (PostStepStreams): the device's own streams and events on CUDA
// (DeviceStreams). The tests model a side stream on host threads
// (csrc/testing/HostStreams.hpp), so that the rest of the CUDA route runs on
// CPU tensors over the NCCL-contract double.

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hsdp {

// A side stream per device, taken from c10's stream pool once, at first use,
// as ProcessGroupNCCL takes one stream per communicator. A stream drawn per
// op would hand, in turn, every pool stream (a user's torch.cuda.Stream()
// among them) a wait on some unrelated collective, and its allocator
// records of the op's tensors.
class SideStreams {
 public:
  c10::Stream get(c10::Device device);

 private:
  std::mutex mutex_;
  std::vector<c10::Stream> streams_;
};

// The end of an async op's post-step, as later ops on the route wait for
// it, holding none of the op's tensors: the route keeps the last one until
// the device has run it, and a Work kept for that would keep the caller's
// tensors and hsdp's staged copies allocated until the group's next call,
// however long after (the caller may have dropped them long before).
class PostStepMark {
 public:
  virtual ~PostStepMark() = default;

  // Whether the post-step has run (never blocks; false under graph capture).
  virtual bool done() const = 0;
  // Whether the current stream of this mark's device is being captured into
  // a CUDA graph now.
  virtual bool capturingNow() const = 0;
  // Issued while its stream was capturing a CUDA graph.
  virtual bool captured() const = 0;
  // Orders the current stream after the post-step.
  virtual void orderCurrentStreamAfter() const = 0;
  // The op's own Work: whether its waiting is over, and waiting for that.
  // As done() and orderCurrentStreamAfter() unless a model says otherwise.
  virtual bool waitIsOver() const {
    return done();
  }
  virtual void endWait() const {
    orderCurrentStreamAfter();
  }
  // The side stream, as errors name it.
  virtual std::string where() const = 0;
};

// A post-step handed to a side stream: its end, the future the op's Work
// hands out (complete with the outputs once the post-step has run), and the
// buffers the Work holds for as long as it lives.
struct PostStepRun {
  std::shared_ptr<const PostStepMark> mark;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::vector<at::Tensor> keepAlive;
};

// Side streams, one per device, for a route whose inner Works follow NCCL's
// stream contract (routes/PostSteps.hpp). One per route.
class PostStepStreams {
 public:
  virtual ~PostStepStreams() = default;

  // Whether post-steps on `device`'s tensors run here.
  virtual bool serves(c10::Device device) const = 0;
  // Runs `step` on `device`'s side stream after what the caller's current
  // stream has enqueued so far, without blocking the caller. `outputs` are
  // the future's value; `keepAlive` are buffers `step` or the inner ops
  // still read or write after the call returns: the streams keep them alive
  // until then (or hand them to the Work).
  virtual PostStepRun
  run(c10::Device device,
      std::function<void()> step,
      const std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor> keepAlive) = 0;
  // Streams of the same kind for another route (a split's child): a group's
  // post-steps wait for no other group's.
  virtual std::shared_ptr<PostStepStreams> another() const = 0;
};

// A device's own streams and events (CUDA): `step` is enqueued on the side
// stream at once, behind an event of the caller's stream, and an event after
// it is the mark; the buffers are recorded on the side stream for the
// caching allocator and held by the Work.
class DeviceStreams final : public PostStepStreams {
 public:
  bool serves(c10::Device device) const override {
    return !device.is_cpu();
  }
  PostStepRun
  run(c10::Device device,
      std::function<void()> step,
      const std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor> keepAlive) override;
  std::shared_ptr<PostStepStreams> another() const override {
    return std::make_shared<DeviceStreams>();
  }

 private:
  SideStreams streams_;
};

class WorkOnStream : public c10d::Work {
 public:
  WorkOnStream(
      int rank,
      c10d::OpType opType,
      PostStepRun run,
      std::vector<c10::intrusive_ptr<c10d::Work>> inners,
      std::vector<at::Tensor> outputs);

  WorkOnStream(const WorkOnStream&) = delete;
  WorkOnStream& operator=(const WorkOnStream&) = delete;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // What later ops wait for (InnerRoute::beforeIssue).
  const std::shared_ptr<const PostStepMark>& mark() const {
    return mark_;
  }

 private:
  std::shared_ptr<const PostStepMark> mark_;
  std::vector<c10::intrusive_ptr<c10d::Work>> inners_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keepAlive_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace hsdp
