#include "backend/OpQueue.hpp"

namespace hsdp {

OpQueue::OpQueue() : worker_([this] { loop(); }) {}

OpQueue::~OpQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void OpQueue::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  cv_.notify_all();
}

bool OpQueue::runInlineIfIdle(const std::function<void()>& task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (busy_ || !tasks_.empty()) {
      return false;
    }
    busy_ = true;
  }
  struct Release {
    OpQueue* q;
    ~Release() {
      {
        std::lock_guard<std::mutex> lock(q->mutex_);
        q->busy_ = false;
      }
      q->cv_.notify_all();
    }
  } release{this};
  task();
  return true;
}

void OpQueue::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    cv_.wait(lock, [&] { return (!tasks_.empty() && !busy_) || (stop_ && tasks_.empty() && !busy_); });
    if (tasks_.empty()) {
      return; // stop_ and nothing left
    }
    auto task = std::move(tasks_.front());
    tasks_.pop_front();
    busy_ = true;
    lock.unlock();
    task(); // tasks catch their own exceptions
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

} // namespace hsdp
