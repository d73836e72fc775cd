#pragma once

// Sets up a group's shared-memory engine through the group's store.
//
// Every rank publishes its host identity; only when all members share one
// host (and mount, IPC and PID namespaces) does the group use shared memory,
// which every rank decides alike from the same keys. Rank 0 creates the
// segment, the others map it, the last rank to map it unlinks the name, and
// a final round makes every rank agree that all succeeded: if any rank could
// not map it, every rank falls back to the inner CPU backend together.
// Settings that shape the protocol (one-shot and direct-read thresholds)
// are rank 0's on every rank; direct reads are on only if every rank can
// read every other's memory.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "shm/Engine.hpp"

#include <memory>
#include <string>

namespace hsdp {

struct ShmOptions {
  enum class Mode { Auto, Off, Required } mode = Mode::Auto;
  size_t slotBytes = 4 << 20;
  shm::EngineConfig engine;
};

// Returns the engine, or null when the group cannot use shared memory (then
// `whyNot` says why). Mode::Required turns "cannot" into an error.
std::unique_ptr<shm::Engine> connectShm(
    c10d::Store& store,
    int rank,
    int size,
    ShmOptions options,
    std::string* whyNot);

} // namespace hsdp
