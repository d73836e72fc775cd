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
// On host streams (the NCCL-contract double, InnerCaps::hostStreams) the
// side stream is a completion worker and `done`, its future, stands for the
// event.

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <optional>

namespace hsdp {

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
  // Host streams: `done` completes (or fails) once the post-step has run.
  WorkOnStream(
      int rank,
      c10d::OpType opType,
      c10::intrusive_ptr<c10::ivalue::Future> done,
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

  // Whether the post-step has run (never blocks; not under graph capture).
  bool postStepDone() const;
  // Whether the current stream of this Work's device is being captured into
  // a CUDA graph now (never on host streams).
  bool capturingNow() const;
  // Issued while its stream was capturing a CUDA graph.
  bool captured() const {
    return captured_;
  }
  // Orders the current stream after the post-step (on host streams: waits
  // for it), as synchronize() does, leaving the Work in flight.
  void orderCurrentStreamAfter();

 private:
  std::optional<c10::Stream> stream_; // none on host streams
  std::optional<c10::Event> done_;
  bool captured_ = false; // issued while `stream_` was capturing a CUDA graph
  std::vector<c10::intrusive_ptr<c10d::Work>> inners_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keepAlive_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace hsdp
