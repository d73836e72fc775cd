#pragma once

// Runs a group's shared-memory collectives one at a time, in issue order.
//
// Async calls are queued for the group's worker thread. A synchronous call
// finds the queue idle almost always and then runs on the caller's thread:
// no hand-off, which is what keeps a small collective in microseconds. It
// waits its turn otherwise, so the issue order holds either way. Tasks
// report their own failures (through their futures): nothing thrown by a
// task crosses a thread.

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace hsdp {

class OpQueue {
 public:
  OpQueue();
  ~OpQueue(); // runs what is queued, then joins the worker
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  void submit(std::function<void()> task);

  // Runs `task` on the calling thread if nothing is queued or running and
  // returns true; returns false (without running it) otherwise.
  bool runInlineIfIdle(const std::function<void()>& task);

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false; // a task runs, on the worker or inline
  bool stop_ = false;
  std::thread worker_;
};

} // namespace hsdp
