#include "backend/WorkHSDP.hpp"

#include <ATen/ThreadLocalState.h>

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

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

// Tasks and completion steps of onQueue Works this thread is running.
thread_local int queueStepsRunning = 0;

// Marks this thread as running one of them while in scope.
struct InQueueStep {
  InQueueStep() {
    ++queueStepsRunning;
  }
  ~InQueueStep() {
    --queueStepsRunning;
  }
  InQueueStep(const InQueueStep&) = delete;
  InQueueStep& operator=(const InQueueStep&) = delete;
};

} // namespace

bool onCompletionThread() {
  return queueStepsRunning > 0;
}

void unregisterInflight(c10d::Work& work) {
  if (c10d::allow_inflight_collective_as_graph_input()) {
    c10d::unregister_work(c10::intrusive_ptr<c10d::Work>::unsafe_reclaim_from_nonowning(&work));
  }
}

WorkHSDP::WorkHSDP(int rank, c10d::OpType opType, c10::intrusive_ptr<c10::ivalue::Future> future)
    : Work(rank, opType), future_(std::move(future)) {}

WorkHSDP::WorkHSDP(int rank, c10d::OpType opType, std::vector<at::Tensor> outputs)
    : Work(rank, opType),
      completeAtCreation_(true),
      mayBeInflight_(c10d::allow_inflight_collective_as_graph_input()),
      outputs_(std::move(outputs)) {}

bool WorkHSDP::isCompleted() {
  return completeAtCreation_ || waitIsOver();
}

bool WorkHSDP::isSuccess() const {
  return completeAtCreation_ || (waitIsOver() && !future_->hasError());
}

bool WorkHSDP::waitIsOver() const {
  return future_->completed() && (!released_ || released_->completed() || onCompletionThread());
}

void WorkHSDP::waitForTheEnd() const {
  // One sleep, not two: `released` completes after the future.
  if (released_ && !onCompletionThread()) {
    released_->wait();
  } else {
    future_->wait();
  }
}

std::exception_ptr WorkHSDP::exception() const {
  // Failed once waiting is over, as Gloo sets the error when it finishes.
  return !completeAtCreation_ && waitIsOver() && future_->hasError() ? future_->exception_ptr()
                                                                     : nullptr;
}

std::vector<at::Tensor> WorkHSDP::result() {
  return completeAtCreation_ ? outputs_ : future_->value().toTensorVector();
}

void WorkHSDP::synchronize() {
  if (!completeAtCreation_) {
    waitForTheEnd();
  }
  leaveInflightRegistry();
}

bool WorkHSDP::wait(std::chrono::milliseconds timeout) {
  if (completeAtCreation_) {
    leaveInflightRegistry();
    return true;
  }
  // Without a timeout the wait is still bounded: the engine or the inner
  // collective enforces the group's deadline and completes the future with
  // an error when it expires.
  if (timeout != kNoTimeout && !waitIsOver()) {
    struct Signal {
      std::mutex mutex;
      std::condition_variable cv;
      bool done = false;
    };
    auto signal = std::make_shared<Signal>();
    auto& last = released_ && !onCompletionThread() ? *released_ : *future_;
    last.addCallback([signal](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(signal->mutex);
      signal->done = true;
      signal->cv.notify_all();
    });
    std::unique_lock<std::mutex> lock(signal->mutex);
    if (!signal->cv.wait_for(lock, timeout, [&] { return signal->done; })) {
      C10_THROW_ERROR(
          DistBackendError,
          "[rank " + std::to_string(rank_) + "] " + c10d::opTypeToString(opType_) +
              ": Work::wait timed out after " + std::to_string(timeout.count()) + " ms");
    }
  }
  waitForTheEnd();
  future_->waitAndThrow();
  leaveInflightRegistry();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkHSDP::getFuture() {
  if (completeAtCreation_) {
    std::call_once(made_, [this] {
      future_ = c10::make_intrusive<c10::ivalue::Future>(tensorListType());
      future_->markCompleted(c10::IValue(outputs_));
    });
  }
  return future_;
}

c10::intrusive_ptr<c10d::Work>
WorkHSDP::completed(int rank, c10d::OpType opType, std::vector<at::Tensor> outputs) {
  if (std::all_of(outputs.begin(), outputs.end(), [](const auto& t) { return t.is_cpu(); })) {
    return c10::make_intrusive<WorkHSDP>(rank, opType, std::move(outputs));
  }
  auto future = c10::make_intrusive<c10::ivalue::Future>(tensorListType(), devicesOf(outputs));
  future->markCompleted(c10::IValue(std::move(outputs)));
  return c10::make_intrusive<WorkHSDP>(rank, opType, std::move(future));
}

c10::intrusive_ptr<c10d::Work> WorkHSDP::ofSynchronousCall(int rank, c10d::OpType opType) {
  if (!c10d::allow_inflight_collective_as_graph_input()) {
    return {};
  }
  return completed(rank, opType, {});
}

c10::intrusive_ptr<WorkHSDP> WorkHSDP::onQueue(
    OpQueue& queue,
    int rank,
    c10d::OpType opType,
    std::vector<at::Tensor> outputs,
    std::function<void()> task) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(tensorListType());
  auto released = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  auto error = std::make_shared<std::exception_ptr>();
  queue.submit(
      // The caller's thread-local state (inference mode, grad mode, ...)
      // goes with the task, as gloo's worker threads take it: the task
      // writes the caller's tensors, which may be inference tensors.
      [task = std::move(task), error, tls = at::ThreadLocalState()]() {
        at::ThreadLocalStateGuard guard(tls);
        const InQueueStep on;
        try {
          task();
        } catch (...) {
          *error = std::current_exception();
        }
      },
      [future, released, error, outputs = std::move(outputs)]() mutable {
        {
          // The future (its value holds the outputs) is the last of the
          // call's that this thread holds: let go of it, then end the waits.
          auto f = std::move(future);
          auto outs = std::move(outputs);
          const InQueueStep on;
          if (*error) {
            f->setError(*error);
          } else {
            f->markCompleted(c10::IValue(std::move(outs)));
          }
        }
        released->markCompleted();
      });
  auto work = c10::make_intrusive<WorkHSDP>(rank, opType, std::move(future));
  work->released_ = std::move(released);
  return work;
}

} // namespace hsdp
