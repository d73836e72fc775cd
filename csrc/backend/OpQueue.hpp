#pragma once

// Runs a group's shared-memory collectives one at a time, in issue order.
//
// Async calls are queued for the group's worker thread. A synchronous call
// finds the queue idle almost always and then runs on the caller's thread:
// no hand-off, which is what keeps a small collective in microseconds. It
// waits its turn otherwise, so the issue order holds either way. Tasks
// report their own failures (through their futures): nothing thrown by a
// task crosses a thread. A task's completion step (completing its future,
// which runs user callbacks) runs after the queue is free again, so a
// callback may itself issue a collective on the same group.

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace hsdp {

class OpQueue {
 public:
  OpQueue();
  ~OpQueue(); // runs what is queued, then joins the worker
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Runs `task` on the worker in issue order, then `then` once the queue
  // accepts work again.
  void submit(std::function<void()> task, std::function<void()> then);

  // Runs `task` on the calling thread if nothing is queued or running and
  // returns true; returns false (without running it) otherwise.
  bool runInlineIfIdle(const std::function<void()>& task);

 private:
  // Shared with the worker thread, so a worker that outlives the queue
  // (see the destructor) still has it.
  struct State {
    struct Entry {
      std::function<void()> task;
      std::function<void()> then;
    };
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<Entry> tasks;
    bool busy = false; // a task runs, on the worker or inline
    bool stop = false;
  };
  static void loop(const std::shared_ptr<State>& state);

  std::shared_ptr<State> state_ = std::make_shared<State>();
  std::thread worker_;
};

} // namespace hsdp
