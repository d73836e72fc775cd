#pragma once

// Runs a group's collectives one at a time, in issue order, and completes
// them off the caller's thread.
//
// Async calls are queued for the queue's workers. A synchronous call finds
// the queue idle almost always and then runs on the caller's thread: no
// hand-off, which is what keeps a small collective in microseconds. It waits
// its turn otherwise, so the issue order holds either way. Tasks report their
// own failures (through their futures): nothing thrown by a task crosses a
// thread.
//
// A task's completion step (`then`: completing its future, which runs user
// callbacks) runs on the worker that ran the task, after the queue is free
// again. That worker then takes the next task itself: a stream of async
// calls runs on one thread, with no hand-off and no wake-up. A callback may
// also issue a collective on the same group and wait for it (torch's PowerSGD
// and ZeRO DDP hooks do): from the moment a completion step submits a task
// to its own queue until it ends, idle workers (made when none is) take
// whatever is queued, so the callback's collective runs while it waits, at
// any depth of nesting. This is what Gloo provides with its pool of worker
// threads (ProcessGroupGloo completes a Work's future on the worker that ran
// it, and another worker serves the next queued op), without Gloo's fixed
// pool size: callbacks nested deeper than Gloo's pool deadlock there.
//
// A completion step that waits for a task it did not submit (a collective
// the main thread issued after the callback's op) is served too, later: a
// task that has not started for kRescueAfter while completion steps run is
// then taken by an idle worker (one process-wide thread looks at every
// queue that often; the hot path only counts started tasks).
//
// Completion steps of different tasks may run at once, as Gloo's do, so a
// program whose callbacks issue collectives must not let two of them, or a
// callback and another thread, issue on the same group at the same time:
// each rank would issue them in its own order.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hsdp {

class OpQueue {
 public:
  OpQueue();
  ~OpQueue(); // runs what is queued, then joins the workers
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Runs `task` on a worker in issue order, then `then` on that worker once
  // the queue accepts work again. `task` is destroyed before `then` runs.
  void submit(std::function<void()> task, std::function<void()> then);

  // Runs `task` on the calling thread if nothing is queued or running and
  // returns true; returns false (without running it) otherwise. A template:
  // a synchronous call's task runs as it is, never wrapped in a
  // std::function (which allocates for a capture as large as a plan).
  template <typename Task>
  bool runInlineIfIdle(Task&& task) {
    if (!enterIfIdle()) {
      return false;
    }
    struct Leave {
      OpQueue& queue;
      ~Leave() {
        queue.leaveInline();
      }
    } leave{*this};
    task();
    return true;
  }

  // How long a runnable task may wait, unstarted, behind running completion
  // steps before idle workers take it (one of them may wait for it).
  static constexpr std::chrono::milliseconds kRescueAfter{20};
  // At most this many workers: callbacks nested deeper than this (or this
  // many slow completion steps at once) make later tasks wait for a worker.
  static constexpr size_t kMaxWorkers = 64;

  // Worker threads made so far (tests: nesting makes more, a plain stream
  // of calls at most two).
  size_t workerCount() const;

 private:
  // Shared with the workers, so a worker that outlives the queue (see the
  // destructor) still has it.
  struct State {
    struct Entry {
      std::function<void()> task;
      std::function<void()> then;
    };
    mutable std::mutex mutex;
    std::condition_variable cv;
    std::deque<Entry> tasks;
    bool busy = false; // a task runs, on a worker or inline
    bool stop = false;
    int idle = 0;         // workers waiting for a task (neither in a task nor a `then`)
    int inThen = 0;       // workers in a completion step
    int waitingSteps = 0; // completion steps that submitted to this queue
    bool rescue = false;  // the rescuer found the queue stuck: idle workers take tasks
    uint64_t started = 0; // tasks started by workers (the rescuer's progress mark)
    std::vector<std::thread> workers;
    bool detached = false; // destroyed on a worker: nobody joins the workers

    bool runnable() const {
      return !tasks.empty() && !busy;
    }
  };
  // runInlineIfIdle's two halves: marks the queue busy if it is idle (and
  // says whether it did), then idle again, waking a worker if work waits.
  bool enterIfIdle();
  void leaveInline();
  // Starts one more worker; `state.mutex` held.
  static void addWorkerLocked(const std::shared_ptr<State>& state);
  static void loop(const std::shared_ptr<State>& state);
  static void rescueLoop();

  std::shared_ptr<State> state_ = std::make_shared<State>();
};

} // namespace hsdp
