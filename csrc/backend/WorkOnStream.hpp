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
// On host streams (an injected CPU backend, InnerCaps::hostStreams) the
// side stream is a completion worker (WorkHSDP::onQueue): the mark is a
// future done at the first callback of `done`, the worker's future, and
// waiting ends with its `released`, after the callbacks.

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>
#include <optional>
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
  // Right after the post-step was enqueued on `stream` (current).
  explicit PostStepMark(c10::Stream stream);
  // Host streams: completes once the post-step has run (its value, none).
  explicit PostStepMark(c10::intrusive_ptr<c10::ivalue::Future> hostDone);

  // Whether the post-step has run (never blocks; not under graph capture).
  bool done() const;
  // Whether the current stream of this mark's device is being captured into
  // a CUDA graph now (never on host streams).
  bool capturingNow() const;
  // Issued while its stream was capturing a CUDA graph.
  bool captured() const {
    return captured_;
  }
  // Orders the current stream after the post-step (on host streams: waits
  // for it).
  void orderCurrentStreamAfter() const;
  const std::optional<c10::Stream>& stream() const {
    return stream_;
  }

 private:
  std::optional<c10::Stream> stream_; // none on host streams
  std::optional<c10::Event> event_;   // recorded on stream_ after the post-step
  c10::intrusive_ptr<c10::ivalue::Future> hostDone_;
  bool captured_ = false;
};

class WorkOnStream : public c10d::Work {
 public:
  // Call with `stream` current, right after the post-step was enqueued on
  // it. `keepAlive` are buffers the enqueued work still reads or writes.
  WorkOnStream(
      int rank,
      c10d::OpType opType,
      c10::Stream stream,
      std::vector<c10::intrusive_ptr<c10d::Work>> inners,
      std::vector<at::Tensor> outputs,
      std::vector<at::Tensor> keepAlive);
  // Host streams: `done` completes (or fails) once the post-step has run,
  // and `released` after it, once the worker let go of the op's tensors.
  WorkOnStream(
      int rank,
      c10d::OpType opType,
      c10::intrusive_ptr<c10::ivalue::Future> done,
      c10::intrusive_ptr<c10::ivalue::Future> released,
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
  // The post-step ran (host streams: and its worker let go of the op, as
  // waiting ends).
  bool postStepDone() const;

  std::shared_ptr<const PostStepMark> mark_;
  std::vector<c10::intrusive_ptr<c10d::Work>> inners_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keepAlive_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  c10::intrusive_ptr<c10::ivalue::Future> released_; // host streams
};

} // namespace hsdp
