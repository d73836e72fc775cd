#include "backend/WorkOnStream.hpp"

#include "backend/WorkHSDP.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

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

PostStepMark::PostStepMark(c10::Stream stream)
    : stream_(stream),
      event_(std::in_place, stream.device_type()),
      captured_(compat::isStreamCapturing(stream)) {
  event_->record(stream);
}

PostStepMark::PostStepMark(c10::intrusive_ptr<c10::ivalue::Future> hostDone)
    : hostDone_(std::move(hostDone)) {}

// Querying an event recorded during graph capture is an error: a captured
// op has not run (it runs at each replay), so it is not complete.
bool PostStepMark::done() const {
  return stream_ ? !captured_ && event_->query() : hostDone_->completed();
}

bool PostStepMark::capturingNow() const {
  return stream_ && compat::isCapturing(stream_->device());
}

void PostStepMark::orderCurrentStreamAfter() const {
  if (stream_) {
    c10::impl::VirtualGuardImpl impl(stream_->device_type());
    event_->block(impl.getStream(stream_->device()));
  } else {
    hostDone_->wait();
  }
}

WorkOnStream::WorkOnStream(
    int rank,
    c10d::OpType opType,
    c10::Stream stream,
    std::vector<c10::intrusive_ptr<c10d::Work>> inners,
    std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> keepAlive)
    : Work(rank, opType),
      inners_(std::move(inners)),
      outputs_(std::move(outputs)),
      keepAlive_(std::move(keepAlive)) {
  c10::impl::VirtualGuardImpl impl(stream.device_type());
  // The caching allocator must not hand these blocks to another stream
  // before the side stream is done with them, even if the caller drops
  // every reference first (as it may once it has waited).
  for (const auto* list : {&outputs_, &keepAlive_}) {
    for (const auto& t : *list) {
      if (t.defined() && t.has_storage()) {
        impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
      }
    }
  }
  mark_ = std::make_shared<const PostStepMark>(stream);
  std::vector<c10::Device> devices{stream.device()};
  future_ = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  // markCompleted records the future's events on the current streams: with
  // the side stream current they follow the post-step.
  c10::StreamGuard guard(stream);
  future_->markCompleted(c10::IValue(outputs_));
}

WorkOnStream::WorkOnStream(
    int rank,
    c10d::OpType opType,
    c10::intrusive_ptr<c10::ivalue::Future> done,
    c10::intrusive_ptr<c10::ivalue::Future> released,
    std::vector<c10::intrusive_ptr<c10d::Work>> inners,
    std::vector<at::Tensor> outputs)
    : Work(rank, opType),
      inners_(std::move(inners)),
      outputs_(std::move(outputs)),
      future_(std::move(done)),
      released_(std::move(released)) {
  // A future of its own for the mark, which the route keeps: `done`'s value
  // holds the outputs. Completed by `done`'s first callback, so that a
  // callback issuing on the route orders itself after the post-step, not
  // after itself.
  auto ended = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  future_->addCallback([ended](c10::ivalue::Future& f) {
    if (f.hasError()) {
      ended->setError(f.exception_ptr());
    } else {
      ended->markCompleted();
    }
  });
  mark_ = std::make_shared<const PostStepMark>(std::move(ended));
}

bool WorkOnStream::postStepDone() const {
  return mark_->done() && (!released_ || released_->completed() || onCompletionThread());
}

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
  if (!mark_->stream() && future_->completed() && future_->hasError()) {
    return future_->exception_ptr(); // the post-step failed
  }
  return nullptr;
}

bool WorkOnStream::isCompleted() {
  return exception() != nullptr || postStepDone();
}

bool WorkOnStream::isSuccess() const {
  return exception() == nullptr && postStepDone();
}

std::vector<at::Tensor> WorkOnStream::result() {
  return outputs_;
}

void WorkOnStream::synchronize() {
  if (released_ && !onCompletionThread()) {
    released_->wait(); // after the mark's future: one sleep, not two
  } else {
    mark_->orderCurrentStreamAfter();
  }
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
    while (!postStepDone()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        C10_THROW_ERROR(
            DistBackendError,
            "[rank " + std::to_string(rank_) + "] Work::wait timed out after " +
                std::to_string(timeout.count()) + " ms (" + c10d::opTypeToString(opType_) +
                ", the step after the collective, on " +
                (mark_->stream() ? mark_->stream()->device().str() : std::string("host streams")) +
                ")");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  synchronize();
  if (auto e = exception()) { // a post-step that failed (host streams)
    std::rethrow_exception(e);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkOnStream::getFuture() {
  return future_;
}

} // namespace hsdp
