#pragma once

// Per-group communication counters, keyed by the c10d op name the user called
// ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", ...).
// `collectives` counts what actually went over the wire (inner collectives or
// synchronisation rounds), so a fused call over N tensors shows calls=1,
// collectives=1 while N separate calls show calls=N, collectives=N.

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

namespace hsdp {

struct OpCounters {
  uint64_t calls = 0;
  uint64_t collectives = 0;
  // Bytes this rank contributed as input (for all-gather: its own shard).
  uint64_t bytes = 0;
};

class CommStats {
 public:
  // `op` is one of the backend's op-name literals: a call of the same op as
  // the last one finds its counters by the pointer, without reading the name
  // (this runs on every call; map nodes never move).
  void record(const char* op, uint64_t collectives, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (op != lastOp_) {
      auto it = counters_.find(std::string_view(op));
      if (it == counters_.end()) {
        it = counters_.emplace(std::string(op), OpCounters{}).first;
      }
      lastOp_ = op;
      last_ = &it->second;
    }
    auto& c = *last_;
    c.calls += 1;
    c.collectives += collectives;
    c.bytes += bytes;
  }

  std::map<std::string, OpCounters> snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {counters_.begin(), counters_.end()};
  }

  void reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.clear();
    lastOp_ = nullptr;
    last_ = nullptr;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::string, OpCounters, std::less<>> counters_;
  const char* lastOp_ = nullptr;
  OpCounters* last_ = nullptr; // counters_[lastOp_]
};

} // namespace hsdp
