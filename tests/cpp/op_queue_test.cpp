// OpQueue (csrc/backend/OpQueue.hpp), torch-free: tasks run one at a time in
// issue order, and a completion step that waits for a task queued after its
// own is served by another worker at any depth of nesting (what a future
// callback that waits for a collective it issued needs). Every wait here has
// a deadline, so a regression fails instead of hanging.

#include "backend/OpQueue.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hsdp {
namespace {

constexpr auto kDeadline = std::chrono::seconds(20);

// A one-shot flag with a deadline on its wait.
class Flag {
 public:
  void set() {
    std::lock_guard<std::mutex> lock(mutex_);
    set_ = true;
    cv_.notify_all();
  }
  bool waitFor(std::chrono::seconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return set_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool set_ = false;
};

TEST(OpQueue, CompletionStepWaitsForALaterTask) {
  OpQueue q;
  Flag outer, inner;
  q.submit(
      [] {},
      [&] {
        q.submit([] {}, [&] { inner.set(); });
        ASSERT_TRUE(inner.waitFor(kDeadline)) << "a completion step's wait starved the queue";
        outer.set();
      });
  ASSERT_TRUE(outer.waitFor(kDeadline));
}

TEST(OpQueue, CompletionStepsWaitNestedEightDeep) {
  constexpr int kDepth = 8;
  OpQueue q;
  std::vector<std::shared_ptr<Flag>> flags;
  for (int k = 0; k < kDepth; ++k) {
    flags.push_back(std::make_shared<Flag>());
  }
  std::atomic<bool> starved{false};
  // Level k's completion step submits level k + 1 and waits for its
  // completion step to finish: every level blocks a worker.
  std::function<void(int)> level = [&](int k) {
    q.submit(
        [] {},
        [&, k] {
          if (k + 1 < kDepth) {
            level(k + 1);
            if (!flags[k + 1]->waitFor(kDeadline)) {
              starved = true;
            }
          }
          flags[k]->set();
        });
  };
  level(0);
  ASSERT_TRUE(flags[0]->waitFor(kDeadline)) << "nested completion steps deadlocked";
  EXPECT_FALSE(starved);
  // One worker per blocked level, one free: no more.
  EXPECT_LE(q.workerCount(), static_cast<size_t>(kDepth + 1));
}

TEST(OpQueue, CompletionStepWaitsForATaskSubmittedElsewhere) {
  // A callback waiting for a collective the main thread issued after the
  // callback's step began: served once it has waited kRescueAfter or so.
  OpQueue q;
  Flag inStep, later, outer;
  q.submit(
      [] {},
      [&] {
        inStep.set();
        if (later.waitFor(kDeadline)) {
          outer.set();
        }
      });
  ASSERT_TRUE(inStep.waitFor(kDeadline));
  const auto start = std::chrono::steady_clock::now();
  q.submit([] {}, [&] { later.set(); });
  ASSERT_TRUE(outer.waitFor(kDeadline)) << "a step waiting for another's task starved the queue";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST(OpQueue, TasksRunOneAtATimeInIssueOrder) {
  OpQueue q;
  std::atomic<int> running{0};
  std::atomic<bool> overlapped{false};
  std::mutex orderMutex;
  std::vector<int> order;
  constexpr int kTasks = 2000;
  auto task = [&](int i) {
    return [&, i] {
      if (running.fetch_add(1) != 0) {
        overlapped = true;
      }
      {
        std::lock_guard<std::mutex> lock(orderMutex);
        order.push_back(i);
      }
      running.fetch_sub(1);
    };
  };
  Flag last;
  for (int i = 0; i < kTasks; ++i) {
    if (i % 7 == 0 && q.runInlineIfIdle(task(i))) {
      continue;
    }
    // Completion steps that take a while, so later tasks overlap them.
    q.submit(task(i), [i, &last] {
      if (i % 13 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (i == kTasks - 1) {
        last.set();
      }
    });
  }
  ASSERT_TRUE(last.waitFor(kDeadline));
  EXPECT_FALSE(overlapped) << "two tasks ran at once";
  std::lock_guard<std::mutex> lock(orderMutex);
  ASSERT_EQ(order.size(), static_cast<size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_EQ(order[i], i) << "tasks ran out of issue order";
  }
  // Workers are made only while every one is in a completion step (here
  // some sleep), never past the bound.
  EXPECT_LE(q.workerCount(), OpQueue::kMaxWorkers);
}

TEST(OpQueue, PlainStreamNeedsTwoWorkersAtMost) {
  OpQueue q;
  for (int i = 0; i < 2000; ++i) {
    Flag done;
    q.submit([] {}, [&done] { done.set(); });
    ASSERT_TRUE(done.waitFor(kDeadline));
  }
  EXPECT_LE(q.workerCount(), 2u);
}

TEST(OpQueue, DestructorRunsWhatIsQueued) {
  std::atomic<int> ran{0}, completed{0};
  {
    OpQueue q;
    for (int i = 0; i < 100; ++i) {
      q.submit([&] { ran.fetch_add(1); }, [&] { completed.fetch_add(1); });
    }
  }
  EXPECT_EQ(ran.load(), 100);
  EXPECT_EQ(completed.load(), 100);
}

TEST(OpQueue, LastReferenceDroppedInACompletionStep) {
  // Many times over: the worker, just started, may find the task, run it,
  // drop the queue and exit while submit() is still waking it (a race only
  // a ThreadSanitizer build sees, and only when the threads meet there).
  for (int i = 0; i < 500; ++i) {
    auto q = std::make_shared<OpQueue>();
    Flag done;
    std::weak_ptr<OpQueue> weak = q;
    OpQueue* raw = q.get();
    raw->submit(
        [] {},
        [q = std::move(q), &done]() mutable {
          q.reset(); // destroys the queue on its own worker
          done.set();
        });
    ASSERT_TRUE(done.waitFor(kDeadline));
    EXPECT_TRUE(weak.expired());
  }
}

} // namespace
} // namespace hsdp
