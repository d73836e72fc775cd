#include "backend/OpQueue.hpp"

namespace hsdp {

OpQueue::OpQueue() : worker_([state = state_] { loop(state); }) {}

OpQueue::~OpQueue() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stop = true;
  }
  state_->cv.notify_all();
  if (worker_.get_id() == std::this_thread::get_id()) {
    // The last reference went away in a completion callback on the worker
    // itself, which cannot join itself: it drains the queue and exits on
    // its own, keeping the state alive through its shared_ptr.
    worker_.detach();
  } else {
    worker_.join();
  }
}

void OpQueue::submit(std::function<void()> task, std::function<void()> then) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->tasks.push_back({std::move(task), std::move(then)});
  }
  state_->cv.notify_all();
}

bool OpQueue::runInlineIfIdle(const std::function<void()>& task) {
  State& s = *state_;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.busy || !s.tasks.empty()) {
      return false;
    }
    s.busy = true;
  }
  struct Release {
    State& s;
    ~Release() {
      bool workerWaits;
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.busy = false;
        // The worker waits for `busy` only with work queued or a stop
        // pending. Waking it otherwise (every small synchronous call) costs
        // two futex calls and a context switch onto a core a peer rank may
        // be spinning on.
        workerWaits = !s.tasks.empty() || s.stop;
      }
      if (workerWaits) {
        s.cv.notify_all();
      }
    }
  } release{s};
  task();
  return true;
}

void OpQueue::loop(const std::shared_ptr<State>& state) {
  State& s = *state;
  std::unique_lock<std::mutex> lock(s.mutex);
  while (true) {
    s.cv.wait(lock, [&] {
      return (!s.tasks.empty() && !s.busy) || (s.stop && s.tasks.empty() && !s.busy);
    });
    if (s.tasks.empty()) {
      return; // stopped and drained
    }
    auto entry = std::move(s.tasks.front());
    s.tasks.pop_front();
    s.busy = true;
    lock.unlock();
    entry.task(); // tasks catch their own exceptions
    lock.lock();
    s.busy = false; // only this thread waits on cv: nobody to wake
    lock.unlock();
    entry.then(); // may run user callbacks, may even destroy the OpQueue
    lock.lock();
  }
}

} // namespace hsdp
