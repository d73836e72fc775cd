#include "backend/WorkHSDP.hpp"

#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <mutex>

namespace hsdp {

namespace {

c10::TypePtr tensorListType() {
  return c10::ListType::create(c10::TensorType::get());
}

std::vector<c10::Device> devicesOf(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> devices;
  for (const auto& t : tensors) {
    if (t.device().is_cuda() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  return devices;
}

} // namespace

WorkHSDP::WorkHSDP(
    int rank,
    c10d::OpType opType,
    c10::intrusive_ptr<c10::ivalue::Future> future)
    : Work(rank, opType), future_(std::move(future)) {}

bool WorkHSDP::isCompleted() {
  return future_->completed();
}

bool WorkHSDP::isSuccess() const {
  return future_->completed() && !future_->hasError();
}

std::exception_ptr WorkHSDP::exception() const {
  return future_->hasError() ? future_->exception_ptr() : nullptr;
}

std::vector<at::Tensor> WorkHSDP::result() {
  return future_->value().toTensorVector();
}

void WorkHSDP::synchronize() {
  future_->wait();
}

bool WorkHSDP::wait(std::chrono::milliseconds timeout) {
  // Without a timeout the wait is still bounded: the engine or the inner
  // collective enforces the group's deadline and completes the future with
  // an error when it expires.
  if (timeout != kNoTimeout && !future_->completed()) {
    struct Signal {
      std::mutex mutex;
      std::condition_variable cv;
      bool done = false;
    };
    auto signal = std::make_shared<Signal>();
    future_->addCallback([signal](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(signal->mutex);
      signal->done = true;
      signal->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(signal->mutex);
    if (!signal->cv.wait_for(lock, timeout, [&] { return signal->done; })) {
      C10_THROW_ERROR(
          DistBackendError,
          "[rank " + std::to_string(rank_) + "] Work::wait timed out after " +
              std::to_string(timeout.count()) + " ms (" + c10d::opTypeToString(opType_) + ")");
    }
  }
  future_->waitAndThrow();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkHSDP::getFuture() {
  return future_;
}

c10::intrusive_ptr<c10d::Work> WorkHSDP::completed(
    int rank,
    c10d::OpType opType,
    std::vector<at::Tensor> outputs) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(
      tensorListType(), devicesOf(outputs));
  future->markCompleted(c10::IValue(std::move(outputs)));
  return c10::make_intrusive<WorkHSDP>(rank, opType, std::move(future));
}

namespace {

// Some inner Works (Gloo's reduce-scatter among them) implement no future.
// For those the chain waits for them on the calling thread: the result is the
// same, only an async_op caller loses the overlap.
c10::intrusive_ptr<c10::ivalue::Future> futureOrNull(
    const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    return work->getFuture();
  } catch (const c10::Error&) {
    return nullptr;
  }
}

} // namespace

c10::intrusive_ptr<c10d::Work> WorkHSDP::chain(
    int rank,
    c10d::OpType opType,
    const std::vector<c10::intrusive_ptr<c10d::Work>>& inners,
    std::vector<at::Tensor> outputs,
    std::function<void()> then) {
  TORCH_INTERNAL_ASSERT(!inners.empty());
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> parts;
  for (const auto& w : inners) {
    parts.push_back(futureOrNull(w));
    if (!parts.back()) {
      for (const auto& inner : inners) {
        inner->wait();
      }
      then();
      return completed(rank, opType, std::move(outputs));
    }
  }
  c10::intrusive_ptr<c10::ivalue::Future> all;
  if (parts.size() == 1) {
    all = parts.front();
  } else {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
        c10::FutureType::create(tensorListType()));
    for (const auto& part : parts) {
      futures.push_back(part);
    }
    all = c10::collectAll(futures);
  }
  auto child = all->then(
      [outputs = std::move(outputs),
       then = std::move(then),
       parts = std::move(parts)](c10::ivalue::Future& parent) -> c10::IValue {
        if (parent.hasError()) {
          std::rethrow_exception(parent.exception_ptr());
        }
        for (const auto& part : parts) {
          if (part->hasError()) {
            std::rethrow_exception(part->exception_ptr());
          }
        }
        then();
        return c10::IValue(outputs);
      },
      tensorListType());
  return c10::make_intrusive<WorkHSDP>(rank, opType, std::move(child));
}

} // namespace hsdp
