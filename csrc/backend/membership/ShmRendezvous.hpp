#pragma once

// Sets up a group's shared-memory engine through the group's store.
//
// Every rank publishes its host identity (hostname, boot id, mount, IPC and
// PID namespaces), and every rank decides alike from the same keys:
//   * one host: the group shares one segment (flat);
//   * several hosts holding the same number of its ranks: each host's ranks
//     share a segment and the inner CPU backend is split into one
//     inter-host group per local index (hierarchical, routes/Hierarchical.hpp);
//   * otherwise (hosts holding different numbers, an identity that cannot be
//     read): no shared memory, the inner CPU backend serves the group.
// Each host's first rank creates its segment, the others map it, the last
// to map it unlinks the name, and a final round makes every rank of the
// group agree that all succeeded: if any rank could not map its host's
// segment, every rank falls back to the inner CPU backend together.
// Settings that shape the protocol (one-shot and direct-read thresholds)
// are rank 0's on every rank; direct reads are on only if every rank can
// read every other's memory. Unless the user set it, the size from which
// ordinary buffers are read directly is measured then, on each host, by
// its ranks together (shm/Crossover.hpp), once per process, number of
// ranks per host and slot size; the host's first rank decides.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/routes/ShmRoute.hpp"

#include <chrono>
#include <memory>
#include <optional>
#include <string>

namespace hsdp {

// What connectShm needs of hsdp::Config, resolved for one group
// (ProcessGroupHSDP.cpp builds it).
struct ShmOptions {
  enum class Mode { Auto, Off, Required } mode = Mode::Off;
  size_t slotBytes = 0;
  shm::EngineConfig engine;
  // Tests only: this rank's host identity, instead of reading it ("": as if
  // it could not be read).
  std::optional<std::string> hostIdentity;
};

// Returns the route, or null when the group cannot use shared memory (then
// `whyNot` says why). Mode::Required turns "cannot" into an error, and so
// does a group that spans hosts.
std::unique_ptr<ShmRoute> connectShm(
    c10d::Store& store,
    int rank,
    int size,
    ShmOptions options,
    c10d::Backend& cpuInner,
    std::chrono::milliseconds timeout,
    CommStats& stats,
    std::shared_ptr<StagingPool> staging,
    std::string* whyNot);

} // namespace hsdp
