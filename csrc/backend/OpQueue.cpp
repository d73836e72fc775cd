#include "backend/OpQueue.hpp"

#include <algorithm>
#include <utility>

namespace hsdp {

namespace {

// The completion step this thread is running, if any: a task it submits to
// its own queue is one it may be about to wait for.
struct CurrentStep {
  const void* queue = nullptr;
  bool issued = false; // it submitted to its queue (counted in waitingSteps)
};
thread_local CurrentStep currentStep;

// Every live queue, for the rescuer below. Leaked on purpose: the rescuer
// thread runs until the process ends, past static destruction.
struct Registry {
  std::mutex mutex;
  std::vector<std::weak_ptr<void>> queues;
};
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

} // namespace

OpQueue::OpQueue() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    addWorkerLocked(state_);
  }
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::erase_if(r.queues, [](const std::weak_ptr<void>& q) { return q.expired(); });
  r.queues.push_back(state_);
  static std::once_flag started;
  std::call_once(started, [] { std::thread(rescueLoop).detach(); });
}

void OpQueue::rescueLoop() {
  // Once per kRescueAfter: a queue whose runnable task has not started
  // since the last look while completion steps run may have a step waiting
  // for that task (a callback waiting for a collective issued outside it):
  // let idle workers take it. Costs the hot path nothing: one counter.
  std::vector<std::pair<std::weak_ptr<void>, uint64_t>> seen;
  while (true) {
    std::this_thread::sleep_for(kRescueAfter);
    std::vector<std::shared_ptr<State>> live;
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      for (const auto& q : r.queues) {
        if (auto p = q.lock()) {
          live.push_back(std::static_pointer_cast<State>(p));
        }
      }
    }
    std::vector<std::pair<std::weak_ptr<void>, uint64_t>> next;
    for (const auto& state : live) {
      State& s = *state;
      std::unique_lock<std::mutex> lock(s.mutex);
      const bool stuck = s.runnable() && s.inThen > 0 && s.waitingSteps == 0 && !s.rescue;
      if (stuck) {
        const auto was = std::find_if(
            seen.begin(), seen.end(), [&](const auto& e) { return e.first.lock() == state; });
        if (was != seen.end() && was->second == s.started) {
          s.rescue = true;
          if (s.idle == 0) {
            addWorkerLocked(state);
          }
          lock.unlock();
          s.cv.notify_all();
          continue;
        }
        next.emplace_back(state, s.started);
      }
    }
    seen = std::move(next);
  }
}

OpQueue::~OpQueue() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  s.stop = true;
  s.cv.notify_all();
  const auto self = std::this_thread::get_id();
  const bool onWorker = std::any_of(
      s.workers.begin(), s.workers.end(), [&](const std::thread& t) { return t.get_id() == self; });
  if (onWorker) {
    // The last reference went away in a completion step on a worker, which
    // cannot join itself, nor wait for the others (one may be in a callback
    // that waits for this very one): they drain the queue and exit on their
    // own, keeping the state alive through their shared_ptr.
    for (auto& t : s.workers) {
      t.detach();
    }
    s.workers.clear();
    s.detached = true; // and so is any worker started from now on
    return;
  }
  // A completion step still running may start one more worker (to serve a
  // task its callback waits for): join until none is left.
  while (!s.workers.empty()) {
    std::thread t = std::move(s.workers.back());
    s.workers.pop_back();
    lock.unlock();
    t.join();
    lock.lock();
  }
}

void OpQueue::addWorkerLocked(const std::shared_ptr<State>& state) {
  if (state->workers.size() >= kMaxWorkers && !state->detached) {
    return; // the task waits for a worker to finish its completion step
  }
  ++state->idle; // counted from its start: it looks for work before it sleeps
  std::thread worker([state] { loop(state); });
  if (state->detached) {
    worker.detach();
  } else {
    state->workers.push_back(std::move(worker));
  }
}

size_t OpQueue::workerCount() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->workers.size();
}

void OpQueue::submit(std::function<void()> task, std::function<void()> then) {
  // Held to the end: once the lock is released, the task may run and its
  // completion step drop the queue's last reference, and the worker then
  // frees the state as it exits, while this thread still has to notify.
  const std::shared_ptr<State> state = state_;
  State& s = *state;
  enum { kNobody, kOne, kAll } wake = kNobody;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.tasks.push_back({std::move(task), std::move(then)});
    if (currentStep.queue == &s) {
      // A completion step of this queue issued it and may wait for it: from
      // now until that step ends, idle workers take whatever is queued.
      if (!currentStep.issued) {
        currentStep.issued = true;
        ++s.waitingSteps;
      }
      if (s.idle == 0) {
        addWorkerLocked(state);
      }
      wake = kAll;
    } else if (!s.busy && s.inThen == 0) {
      // With a task running, or a completion step whose worker takes the
      // next task when it ends, nobody needs waking: that is every call of
      // a stream of async calls, and it saves each a wake-up and a hand-off.
      wake = kOne;
    }
  }
  // Woken after the unlock, so the worker does not wake into a held mutex.
  if (wake == kOne) {
    s.cv.notify_one();
  } else if (wake == kAll) {
    s.cv.notify_all();
  }
}

bool OpQueue::enterIfIdle() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.busy || !s.tasks.empty()) {
    return false;
  }
  s.busy = true;
  return true;
}

void OpQueue::leaveInline() {
  State& s = *state_;
  std::shared_ptr<State> keep; // as in submit: the notify outlives the lock
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.busy = false;
    // A worker waits for `busy` only with work queued or a stop pending.
    // Waking one otherwise (every small synchronous call) costs two futex
    // calls and a context switch onto a core a peer rank may be spinning on,
    // and the hot path then takes no reference either.
    if (s.runnable() || s.stop) {
      keep = state_;
    }
  }
  if (keep) {
    keep->cv.notify_all();
  }
}

void OpQueue::loop(const std::shared_ptr<State>& state) {
  State& s = *state;
  std::unique_lock<std::mutex> lock(s.mutex);
  bool hot = false; // this worker just ended a completion step
  while (true) {
    // The worker whose completion step just ended takes the next task (no
    // hand-off: a stream of async calls runs on one thread); an idle one
    // takes it when no completion step runs, or when one that issued work
    // to this queue may be waiting for it.
    if (s.runnable() && (hot || s.inThen == 0 || s.waitingSteps > 0 || s.rescue)) {
      auto entry = std::move(s.tasks.front());
      s.tasks.pop_front();
      if (s.tasks.empty()) {
        s.rescue = false;
      }
      ++s.started;
      s.busy = true;
      --s.idle;
      lock.unlock();
      entry.task(); // tasks catch their own exceptions
      // Its captures (the caller's tensors, staged copies) go before the
      // completion step wakes anyone: a caller that waited and dropped its
      // tensors must find them freed.
      entry.task = nullptr;
      lock.lock();
      s.busy = false;
      const bool handOver = s.runnable() && (s.waitingSteps > 0 || s.rescue);
      if (handOver && s.idle == 0) {
        addWorkerLocked(state);
      }
      ++s.inThen;
      lock.unlock();
      if (handOver) {
        // A waiting completion step's task may be next: not behind this
        // worker's completion step, which may wait for it too.
        s.cv.notify_one();
      }
      const CurrentStep outer = std::exchange(currentStep, CurrentStep{&s, false});
      entry.then(); // may run user callbacks, may even destroy the OpQueue
      const bool issued = currentStep.issued;
      currentStep = outer;
      lock.lock();
      --s.inThen;
      if (issued) {
        --s.waitingSteps;
      }
      ++s.idle;
      hot = true;
      continue;
    }
    hot = false;
    if (s.stop && s.tasks.empty() && !s.busy && s.inThen == 0) {
      --s.idle;
      s.cv.notify_all(); // the other workers see the stop too
      return;            // stopped and drained
    }
    s.cv.wait(lock);
  }
}

} // namespace hsdp
