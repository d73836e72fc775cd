#pragma once

// One shared-memory segment per process group, and the layout every member
// maps it with.
//
//   [Header][Control of rank 0 .. W-1][Data: rank 0 slot 0, slot 1, rank 1 ...]
//
// Rank 0 creates the segment under an unguessable name (128 random bits),
// mode 0600, O_EXCL; every member maps it; the last member to map it
// unlinks the name, so nothing is left in /dev/shm whatever happens later
// (exit, exception, kill -9): the memory lives only as long as a mapping.
// Every size read from the header is checked against what this process
// expects before it is used.

#include "shm/Pool.hpp"
#include "shm/Types.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace hsdp::shm {

constexpr uint64_t kMagic = 0x68736470'73686d31ull; // "hsdpshm1"
constexpr uint32_t kLayoutVersion = 6;
constexpr size_t kCacheLine = 64;
constexpr int kSlots = 2; // double buffering: step s uses slot s % 2

// What a rank says about the collective it is running, per slot. Ranks
// compare these before touching each other's data, so ranks that called
// different collectives fail with a clear error instead of reading garbage.
// Each begins a cache line, and what every step compares (all but the tail
// of `pool`) fits in it: a peer's signature costs one line from its core,
// and writing one slot's signature does not take the other's line away.
struct alignas(kCacheLine) Signature {
  uint64_t step;
  uint64_t opSeq;
  uint64_t count;
  uint32_t kind;
  uint32_t dtype;
  uint32_t redop;
  int32_t root;
  // Pieces of a piecewise all-gather (0 otherwise).
  uint64_t pieces;
  // Where this rank's input lives in its own address space, for peers that
  // read it directly (cross-memory attach); not compared.
  uint64_t sourceAddress;
  // This rank's buffer when it is a pool buffer (Pool.hpp): a call whose
  // every rank posts one reads peers' buffers through mappings
  // (Engine::pooledStep); not compared.
  PoolRef pool;
};
static_assert(offsetof(Signature, pool) + sizeof(PoolRef::chunk) <= kCacheLine);

// What a rank is doing, published for its peers' error messages (a timeout
// names what every late rank was last doing). Written only by its rank with
// relaxed stores, read by peers only to describe a failure: a reader may see
// fields of two neighbouring moments, never a torn word.
struct Activity {
  enum State : uint32_t {
    Idle = 0,      // between collectives: `seq` is the last one it finished
    Working,       // copying or reducing in step `step` of `steps`
    WaitingPosted, // waiting for every rank's post of the step
    WaitingReduced,
    WaitingDone,
    Failed,
  };
  std::atomic<uint64_t> seq; // the caller's number for the collective (c10d's sequence number)
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> step; // 1-based, within the collective
  std::atomic<uint32_t> steps;
  std::atomic<uint64_t> count;
  // The caller's name of the op, up to 31 characters, 8 a word.
  std::atomic<uint64_t> name[4];
};

// One rank's published progress. Each counter is written only by its rank
// (single writer) and read by all; each sits on its own cache line so a
// writer does not invalidate its neighbours' lines.
struct alignas(kCacheLine) RankControl {
  // Step s: this rank's data for step s is in its slot s % 2.
  alignas(kCacheLine) std::atomic<uint64_t> posted;
  // Step s: this rank finished its part of an all-reduce's reduction.
  alignas(kCacheLine) std::atomic<uint64_t> reduced;
  // Step s: this rank finished reading every peer's slot for step s.
  alignas(kCacheLine) std::atomic<uint64_t> done;
  alignas(kCacheLine) int32_t pid;
  Signature sig[kSlots];
  alignas(kCacheLine) Activity activity;
};

// In Header::brokenBy: the rank that ended the group left it (ranks are far
// below 2^31, and UINT32_MAX means "the reason is being written").
constexpr uint32_t kBrokenByLeaving = 1u << 31;

struct alignas(4096) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t nranks;
  uint64_t slotBytes;
  uint64_t totalBytes;
  // Futex word: bumped by a counter update that finds `sleepers` above 0
  // (Engine::wake); waiters sleep on it.
  alignas(kCacheLine) std::atomic<uint32_t> wakeSeq;
  std::atomic<uint32_t> sleepers;
  // 0 while healthy; 1 + rank of the first rank that failed, with
  // kBrokenByLeaving set where that rank left the group (its shutdown or
  // destruction, not a failure). Any value but 0 ends every wait.
  alignas(kCacheLine) std::atomic<uint32_t> brokenBy;
  char brokenReason[2048]; // room for "where every rank is" of a large group
};

struct Layout {
  size_t controlOffset;
  size_t dataOffset;
  size_t totalBytes;

  static Layout compute(int nranks, size_t slotBytes);
};

class Segment {
 public:
  // Creates (rank 0) or opens (others) and maps the segment.
  static Segment create(const std::string& name, int nranks, size_t slotBytes);
  static Segment open(const std::string& name, int nranks, size_t slotBytes);
  // Removes the name; existing mappings stay valid.
  static void unlink(const std::string& name);
  // "/hsdp-<32 hex digits from /dev/urandom>"
  static std::string randomName();

  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&&) = delete;
  Segment(const Segment&) = delete;
  ~Segment();

  Header& header() const {
    return *reinterpret_cast<Header*>(base_);
  }
  RankControl& control(int rank) const {
    return reinterpret_cast<RankControl*>(base_ + layout_.controlOffset)[rank];
  }
  char* slot(int rank, int slot) const {
    return base_ + layout_.dataOffset + (static_cast<size_t>(rank) * kSlots + slot) * slotBytes_;
  }
  size_t slotBytes() const {
    return slotBytes_;
  }
  int nranks() const {
    return nranks_;
  }

 private:
  Segment(char* base, Layout layout, int nranks, size_t slotBytes)
      : base_(base), layout_(layout), nranks_(nranks), slotBytes_(slotBytes) {}

  char* base_;
  Layout layout_;
  int nranks_;
  size_t slotBytes_;
};

// Identifies the host and the namespaces that decide whether two processes
// can share a segment and see each other's pids: hostname, boot id, and the
// mount, IPC and PID namespaces. Empty when any of them cannot be read:
// such a rank shares memory with nobody.
std::string hostIdentity();

} // namespace hsdp::shm
