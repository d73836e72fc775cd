#pragma once

// The collectives of a group that spans H hosts holding L of its ranks
// each: each host's ranks share an engine (the intra-host phase), and the
// ranks with the same local index l, one per host, form an inter-host Gloo
// group, their column (the inter-host phase): L Gloo groups move the
// cross-host traffic at once, each carrying its 1/L of it.
//
// Algorithms (n: one rank's bytes or elements; W = H * L):
//   all-gather      inter: my piece to my column's other ranks, theirs
//                   into place (pairwise send / recv); intra: my column's
//                   pieces to my host's ranks.
//   reduce-scatter  intra: reduce-scatter of the column-ordered input (my
//                   column's H partial sums); inter: partial sum h to host
//                   h's rank of my column (pairwise), then one reduction of
//                   the H partial sums of my chunk, in host order. Gloo's
//                   own reduce-scatter is an all-reduce of the whole input:
//                   twice the bytes.
//   all-reduce      large and divisible by L: intra reduce-scatter, inter
//                   all-reduce of my 1/L, intra all-gather; else intra
//                   all-reduce, then every column all-reduces the whole
//                   tensor (identical inputs, identical results).
//   broadcast       inter: the root's column; intra: from the root's column.
//   barrier         intra, then inter: no rank leaves before every rank of
//                   every host arrived.
// Reductions run as SUM (or the op) in both phases and the deferred scale
// (AVG, PREMUL_SUM, divide_by) is applied once, to the final values, where
// every rank holding them applies it alike: results are bitwise identical on
// all ranks. A failure of either phase marks this host's engine broken (its
// other ranks fail at once, naming it) and raises shm::CommError naming the
// op; every later call is refused, since a rank that stopped halfway
// through a collective no longer agrees with its column on what comes next.

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/CommStats.hpp"
#include "fusion/StagingPool.hpp"
#include "shm/Engine.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace hsdp {

// Where a group's ranks are: hosts in the order their first rank appears,
// each host's ranks in group-rank order.
struct HostLayout {
  int hosts = 1;
  int perHost = 1;
  int host = 0;           // this rank's host
  int local = 0;          // this rank's index on its host
  std::vector<int> ranks; // ranks[h * perHost + l]: the group rank of host h's l-th rank

  int rankOf(int h, int l) const {
    return ranks[static_cast<size_t>(h) * perHost + l];
  }
  // The group ranks of host h, and of column l (one per host).
  std::vector<int> hostRanks(int h) const;
  std::vector<int> columnRanks(int l) const;
};

// This rank's column: the inter-host group, and the group's timeout, which
// bounds each wait for its sends and receives. Gloo's collectives read the
// group's timeout when issued, but a pairwise receive without a deadline
// waits as long as the transport's, fixed when the group connected: torch
// before 2.14 connects a split at its default (30 minutes; setTimeout does
// not reach the transport).
struct Column {
  c10::intrusive_ptr<c10d::Backend> group;
  std::chrono::milliseconds timeout;
};

class Hierarchical final : public shm::Collectives {
 public:
  // `local` (this host's engine) outlives this object.
  Hierarchical(
      shm::Engine& local,
      HostLayout layout,
      Column column,
      int rank,
      int size,
      CommStats& stats,
      std::shared_ptr<StagingPool> staging);

  void allGather(const char* op, const void* input, void* output, size_t bytesPerRank) override;
  void reduceScatter(
      const char* op,
      const void* input,
      void* output,
      size_t countPerRank,
      shm::DType dtype,
      shm::RedOp redop,
      shm::Scale scale) override;
  void allReduce(
      const char* op,
      void* data,
      size_t count,
      shm::DType dtype,
      shm::RedOp redop,
      shm::Scale scale) override;
  void broadcast(const char* op, void* data, size_t bytes, int root) override;
  void barrier(const char* op) override;
  // Pieces are packed across hosts: never gathered in place.
  bool gathersPieces(size_t pieces, size_t totalBytes) const override {
    return false;
  }
  void allGatherPieces(
      const char* op,
      const std::vector<shm::Span>& inputs,
      const std::vector<std::vector<shm::Span>>& outputs) override;

  const HostLayout& layout() const {
    return layout_;
  }

  // All-reduces of at least this many bytes (and divisible by L) send only
  // their 1/L across hosts.
  static constexpr size_t kSlicedAllReduceBytes = 64 << 10;
  // Reduce-scatters of at least this many input bytes reduce each host's
  // block separately (no reordering copy) when the group's ranks are in
  // host order.
  static constexpr size_t kBlockwiseBytes = 1 << 20;

  // The group's timeout changed (c10d's _set_pg_timeout): the column's
  // collectives and waits take it from their next op. Any thread.
  void setTimeout(std::chrono::milliseconds timeout);

 private:
  std::chrono::milliseconds columnTimeout() const {
    return std::chrono::milliseconds(columnTimeoutMs_.load(std::memory_order_relaxed));
  }

  class Phase;     // every algorithm's preamble
  class Transfers; // pairwise sends and receives on my column
  // Runs an inter-host phase: issue on the column group, wait (at most
  // `limit` each; Gloo bounds its collectives by the group's timeout
  // itself). A failure breaks this host's engine and raises shm::CommError
  // naming `op`.
  template <typename Issue>
  void acrossHosts(
      const char* op,
      uint64_t bytes,
      Issue&& issue,
      bool count = true,
      std::chrono::milliseconds limit = ::kNoTimeout); // Work.hpp: wait for completion
  // All-reduce over my column (one rank per host) of data that is
  // identical on my host's ranks.
  void allReduceColumn(
      const char* op,
      void* data,
      size_t count,
      shm::DType dtype,
      shm::RedOp redop,
      shm::Scale scale);
  void withinHost(uint64_t bytes);
  std::string prefix(const char* op) const;

  shm::Engine& local_;
  HostLayout layout_;
  Column column_;
  std::atomic<int64_t> columnTimeoutMs_{column_.timeout.count()}; // column_'s until setTimeout
  int rank_;
  int size_;
  CommStats& stats_;
  std::shared_ptr<StagingPool> staging_;
  uint64_t exchanges_ = 0;
  std::string failure_; // the first failure: every later call is refused
  bool hostMajor_;      // rankOf(h, l) == h * perHost + l
};

} // namespace hsdp
