#pragma once

// The flight recorder: a ring of one group's last N collectives on this rank
// (sequence number, op, bytes, route, start and end times, outcome), kept
// whatever the route (shared memory, gloo, NCCL), and written to a file
// when the group fails (then the group's abort hooks run: AbortHooks.hpp),
// on SIGUSR1, or on hsdp_backend.dump_trace(). The
// files of all ranks, read together by `python -m hsdp_backend.trace DIR`,
// show the first collective where the ranks diverge.
//
// File: DIR/hsdp-trace.<group>.rank<R>.json, one JSON object, newest dump
// wins. No torch here: the backend feeds it.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "backend/AbortHooks.hpp"
#include "shm/FunctionRef.hpp"

namespace hsdp {

// A marker in a device's stream (a CUDA event) that a dump asks whether the
// device got there. A ring slot keeps its mark and records it again for
// each op it holds: an op on a device costs one record, never an event made
// and destroyed (ProcessGroupNCCL caches its events for the same reason).
class DeviceMark {
 public:
  virtual ~DeviceMark() = default;
  // Asked by a dump only, never polled. May throw (a device error).
  virtual bool reached() = 0;
};

// From hsdp::Config (common/Config.hpp: the defaults).
struct TraceOptions {
  size_t entries = 0; // ring size; 0 turns the recorder off
  std::string dir;
};

class FlightRecorder {
 public:
  FlightRecorder(int rank, int size, TraceOptions options);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  bool enabled() const {
    return !ring_.empty();
  }
  const TraceOptions& options() const {
    return options_;
  }
  // The group's name in file names (c10d's group uid, the same on every rank).
  void setGroup(const std::string& group);
  // This rank's place in the group after a reconfigure gave it new members.
  void setMembership(int rank, int size);
  // `snapshot()` adds a line to every dump (where every rank is, from the
  // shared-memory segment); cleared with detach() before the source goes.
  void setSnapshot(std::function<std::string()> snapshot);
  // Stops dumps from reading the snapshot and takes this recorder off the
  // list that dumpAll() and SIGUSR1 write.
  void detach();

  // `route`: what serves it (Route::recordedAs).
  void started(uint64_t seq, const char* op, uint64_t bytes, const char* route);
  // `error` empty: completed (a view: a completed call builds no string).
  void finished(uint64_t seq, std::string_view error);
  // The op was handed to a device that runs it later (NCCL: a Work's future
  // completes when the op is enqueued): `record(slot's mark)` records the
  // op's end into the slot's mark, first making one where the slot has none
  // or one that cannot serve (another device). The entry stays "started"
  // until a dump finds the mark reached, and is "completed" from that dump
  // on; its end time is when a dump first saw it. Not called where the entry
  // is gone (its slot reused). Runs under the recorder's lock: a record, not
  // a wait.
  void completesAtMark(uint64_t seq, shm::FunctionRef<void(std::unique_ptr<DeviceMark>&)> record);

  // Writes the ring; returns the file's path, or why it could not be written.
  std::string dump(const std::string& reason);
  // Op `seq` of the group failed: dump(), the first time only (the group's
  // first failure is the one that explains the rest), then the abort hooks,
  // once per op. Returns the path of that dump.
  std::string failed(uint64_t seq, const std::string& reason);
  // Whether an op of the group has failed on this rank.
  bool anyFailed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return failureDumped_;
  }
  // A new membership (reconfigure) starts without the old one's failures:
  // its first failure dumps again. The ring keeps what happened.
  void forgetFailures() {
    std::lock_guard<std::mutex> lock(mutex_);
    failureDumped_ = false;
    lastFailed_ = 0;
  }
  AbortHooks& abortHooks() {
    return abortHooks_;
  }
  void runAbortHooks();

  // Dumps every live recorder of this process; returns their paths.
  static std::vector<std::string> dumpAll(const std::string& reason);

 private:
  enum class State { Started, Completed, Failed };
  struct Entry {
    uint64_t seq = 0; // 0: unused
    const char* op = "";
    const char* route = "";
    uint64_t bytes = 0;
    int64_t startUs = 0;
    int64_t endUs = 0;
    State state = State::Started;
    std::string error;
    std::unique_ptr<DeviceMark> mark; // the slot's, kept across its reuses
    bool marked = false;              // this op's end is recorded in `mark`, not yet seen reached
  };
  Entry* find(uint64_t seq); // under mutex_
  // Asks a marked entry's mark once (under mutex_; an event query does not
  // block): completed, failed if the query threw, else left as it is.
  void settle(Entry& e, int64_t now);
  std::string pathLocked() const; // under mutex_

  int rank_; // under mutex_: a reconfigure changes them (setMembership)
  int size_;
  const TraceOptions options_;
  mutable std::mutex mutex_;
  uint64_t dumps_ = 0; // under mutex_: each dump's own partial file
  std::vector<Entry> ring_;
  std::string group_ = "unnamed";
  std::function<std::string()> snapshot_;
  bool failureDumped_ = false;
  uint64_t lastFailed_ = 0; // the op whose failure last ran the hooks
  AbortHooks abortHooks_;
};

} // namespace hsdp
