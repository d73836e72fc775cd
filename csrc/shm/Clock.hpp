#pragma once

// The engine's clock. Every deadline of a wait, and its spin and yield
// budgets, are read from it. A group's engine reads the steady clock; a test
// hands one it moves itself, to reach a deadline without waiting for it
// (EngineConfig::clock).

#include <chrono>

namespace hsdp::shm {

class Clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  virtual time_point now() const = 0;
  // std::chrono::steady_clock: the clock of an engine whose config names none.
  static const Clock& steady();
};

} // namespace hsdp::shm
