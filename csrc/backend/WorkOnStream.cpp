#include "backend/WorkOnStream.hpp"

#include "backend/WorkHSDP.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <thread>

namespace hsdp {

WorkOnStream::WorkOnStream(
    int rank,
    c10d::OpType opType,
    c10::Stream stream,
    std::vector<c10::intrusive_ptr<c10d::Work>> inners,
    std::vector<at::Tensor> outputs,
    std::vector<at::Tensor> keepAlive)
    : Work(rank, opType),
      stream_(stream),
      done_(stream.device_type()),
      inners_(std::move(inners)),
      outputs_(std::move(outputs)),
      keepAlive_(std::move(keepAlive)) {
  c10::impl::VirtualGuardImpl impl(stream_.device_type());
  captured_ = impl.isStreamCapturing(stream_);
  // The caching allocator must not hand these blocks to another stream
  // before the side stream is done with them, even if the caller drops
  // every reference first (as it may once it has waited).
  for (const auto* list : {&outputs_, &keepAlive_}) {
    for (const auto& t : *list) {
      if (t.defined() && t.has_storage()) {
        impl.recordDataPtrOnStream(t.storage().data_ptr(), stream_);
      }
    }
  }
  done_.record(stream_);
  std::vector<c10::Device> devices{stream_.device()};
  future_ = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), devices);
  // markCompleted records the future's events on the current streams: with
  // the side stream current they follow the post-step.
  c10::StreamGuard guard(stream_);
  future_->markCompleted(c10::IValue(outputs_));
}

std::exception_ptr WorkOnStream::exception() const {
  for (const auto& w : inners_) {
    if (auto e = w->exception()) {
      return e;
    }
  }
  return nullptr;
}

// Querying an event recorded during graph capture is an error: a captured
// op has not run (it runs at each replay), so it is not complete.
bool WorkOnStream::isCompleted() {
  return exception() != nullptr || (!captured_ && done_.query());
}

bool WorkOnStream::isSuccess() const {
  return exception() == nullptr && !captured_ && done_.query();
}

std::vector<at::Tensor> WorkOnStream::result() {
  return outputs_;
}

void WorkOnStream::synchronize() {
  c10::impl::VirtualGuardImpl impl(stream_.device_type());
  done_.block(impl.getStream(stream_.device()));
  unregisterInflight(*this);
}

bool WorkOnStream::wait(std::chrono::milliseconds timeout) {
  if (timeout != kNoTimeout && !captured_) {
    // A bounded wait is a host wait by definition: poll the device. (Under
    // graph capture there is nothing to poll: the wait is a stream wait.)
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!isCompleted()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        C10_THROW_ERROR(
            DistBackendError,
            "[rank " + std::to_string(rank_) + "] Work::wait timed out after " +
                std::to_string(timeout.count()) + " ms (" + c10d::opTypeToString(opType_) + " on " +
                stream_.device().str() + ")");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  if (auto e = exception()) {
    std::rethrow_exception(e);
  }
  synchronize();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkOnStream::getFuture() {
  return future_;
}

} // namespace hsdp
