#include "backend/WorkOnStream.hpp"

#include "backend/WorkHSDP.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>
#include <thread>

#include "common/TorchCompat.hpp"

namespace hsdp {

c10::Stream SideStreams::get(c10::Device device) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& s : streams_) {
    if (s.device() == device) {
      return s;
    }
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  return streams_.emplace_back(impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false));
}

namespace {

// The end of a post-step on a device stream: an event recorded after it.
class EventMark final : public PostStepMark {
 public:
  // Right after the post-step was enqueued on `stream` (current).
  explicit EventMark(c10::Stream stream)
      : stream_(stream),
        event_(stream.device_type()),
        captured_(compat::isStreamCapturing(stream)) {
    event_.record(stream);
  }

  // Querying an event recorded during graph capture is an error: a captured
  // op has not run (it runs at each replay), so it is not complete. The
  // query runs in ThreadLocal capture mode, as ProcessGroupNCCL's watchdog
  // queries: in the default, global mode it would invalidate a capture
  // another thread has in progress.
  bool done() const override {
    if (captured_) {
      return false;
    }
    compat::ThreadLocalCaptureMode threadLocal;
    return event_.query();
  }
  bool capturingNow() const override {
    return compat::isCapturing(stream_.device());
  }
  bool captured() const override {
    return captured_;
  }
  void orderCurrentStreamAfter() const override {
    c10::impl::VirtualGuardImpl impl(stream_.device_type());
    event_.block(impl.getStream(stream_.device()));
  }
  std::string where() const override {
    return stream_.device().str();
  }

 private:
  c10::Stream stream_;
  c10::Event event_;
  bool captured_;
};

} // namespace

PostStepRun DeviceStreams::run(
    c10::Device device,
    std::function<void()> step,
    const std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor> keepAlive) {
  c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  const c10::Stream side = streams_.get(device);
  // The post-step reads what the caller enqueued before this call (a
  // staged copy, the op's inputs): the side stream starts after it.
  c10::Event issued(device.type());
  issued.record(current);
  issued.block(side);
  c10::StreamGuard guard(side);
  step();
  // The caching allocator must not hand these blocks to another stream
  // before the side stream is done with them, even if the caller drops
  // every reference first (as it may once it has waited).
  for (const auto& list : {std::cref(outputs), std::cref(keepAlive)}) {
    for (const auto& t : list.get()) {
      if (t.defined() && t.has_storage()) {
        impl.recordDataPtrOnStream(t.storage().data_ptr(), side);
      }
    }
  }
  PostStepRun run{std::make_shared<const EventMark>(side), {}, std::move(keepAlive)};
  run.future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device});
  // markCompleted records the future's events on the current streams: with
  // the side stream current they follow the post-step.
  run.future->markCompleted(c10::IValue(outputs));
  return run;
}

WorkOnStream::WorkOnStream(
    int rank,
    c10d::OpType opType,
    PostStepRun run,
    std::vector<c10::intrusive_ptr<c10d::Work>> inners,
    std::vector<at::Tensor> outputs)
    : Work(rank, opType),
      mark_(std::move(run.mark)),
      inners_(std::move(inners)),
      outputs_(std::move(outputs)),
      keepAlive_(std::move(run.keepAlive)),
      future_(std::move(run.future)) {}

std::exception_ptr WorkOnStream::exception() const {
  for (const auto& w : inners_) {
    if (!mark_->captured()) {
      // Asks the communicator, as WorkNCCL::isCompleted does (which queries
      // an event: not allowed on one recorded during graph capture).
      w->isCompleted();
    }
    if (auto e = w->exception()) {
      return e;
    }
  }
  if (future_->completed() && future_->hasError()) {
    return future_->exception_ptr(); // the post-step failed (on a model's host stream)
  }
  return nullptr;
}

bool WorkOnStream::isCompleted() {
  return exception() != nullptr || mark_->waitIsOver();
}

bool WorkOnStream::isSuccess() const {
  return exception() == nullptr && mark_->waitIsOver();
}

std::vector<at::Tensor> WorkOnStream::result() {
  return outputs_;
}

void WorkOnStream::synchronize() {
  mark_->endWait();
  unregisterInflight(*this);
}

bool WorkOnStream::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& w : inners_) {
    // NCCL's own bound, counted by NCCL from the op's start (abort and its
    // message on expiry), so each inner Work gets the caller's timeout as it
    // is; unbounded, on CUDA a stream wait. The caller's stream, now current,
    // waiting for NCCL's makes the tensors NCCL hands back to the allocator
    // safe. Under graph capture a bounded wait is a stream wait too.
    w->wait(mark_->captured() ? kNoTimeout : timeout);
  }
  if (timeout != kNoTimeout && !mark_->captured()) {
    // A bounded wait is a host wait by definition: poll the post-step.
    // (Under graph capture there is nothing to poll: a stream wait.)
    while (!mark_->waitIsOver()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        C10_THROW_ERROR(
            DistBackendError,
            "[rank " + std::to_string(rank_) + "] " + c10d::opTypeToString(opType_) +
                ": Work::wait timed out after " + std::to_string(timeout.count()) +
                " ms (the step after the collective, on " + mark_->where() + ")");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  synchronize();
  if (auto e = exception()) { // a post-step that failed (on a model's host stream)
    std::rethrow_exception(e);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkOnStream::getFuture() {
  return future_;
}

} // namespace hsdp
