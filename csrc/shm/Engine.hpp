#pragma once

// The shared-memory collective engine of one process group on one host.
//
// Protocol. Every collective is a sequence of steps, numbered group-wide
// from 1 (every rank runs the same steps in the same order, as c10d requires
// of its callers). Each rank owns two data slots and publishes three
// monotonic counters (see RankControl): `posted`, `reduced` and `done`.
// Step s uses slot s % 2 of every rank:
//
//   1. wait until every rank's done >= s - 2: nobody still reads my slot
//      s % 2 from step s - 2, so I may overwrite it (counters only grow:
//      values an earlier wait read still count);
//   2. write my signature and my data into slot s % 2; posted = s;
//   3. wait until every rank's posted >= s; check their signatures;
//   4. read peers' slots (all-reduce: reduce my part in place in my own slot,
//      reduced = s, wait for every reduced >= s, then read their parts);
//   5. done = s.
//
// Two slots let a fast rank fill step s + 1 while slow ranks still read
// step s. A counter is only ever written by its owner (release) and read by
// others (acquire), so the data it guards is visible before the counter is.
//
// The protocol is model-checked in protocol.pml, next to this file (spin,
// scripts/check_protocol.sh): no slot, part or directly read buffer is
// overwritten while a peer may read it, and ranks that call the same steps
// never deadlock. The model also shows rule 1 to be implied by the others
// (a rank posts s + 1 only after its reads of s, and posts s + 2 only after
// seeing every post of s + 1); it stays as a check that never blocks, and
// `done` is what direct reads (the caller's buffer) need.
//
// Everything a peer wrote is untrusted input: a counter above the bound the
// protocol allows (this rank's posted step + 1), a signature for another
// step or of a kind hsdp never writes, a piece table whose sizes differ from
// this rank's, or a failure record naming a rank outside the group fails
// the op on every rank. Sizes and offsets are always this rank's own (peers'
// are compared, never used), and peers' addresses are only read through
// process_vm_readv, which cannot fault this process.
//
// Waiting spins briefly (when every rank has a core), then polls with
// sched_yield for a while (a peer that needs this core gets it at once),
// then sleeps on a futex in the segment (shared, not FUTEX_PRIVATE: the
// waker is another process; the handshake is model-checked in wake.pml).
// Every wait has a deadline (the group's timeout from the op's first wait
// that does not pass at once); while waiting, peers that have not arrived are checked for liveness,
// so a dead peer surfaces in tens of milliseconds and a stuck one at the deadline, as a CommError
// that names the rank and the op. The first rank that fails marks the segment broken and wakes
// everyone, so all ranks fail fast; a broken engine refuses further work.
//
// Tested on its own, ranks as threads, plain and under ThreadSanitizer and
// ASan+UBSan: tests/cpp/engine_test.cpp (bash scripts/cpp_tests.sh).

#include "shm/Clock.hpp"
#include "shm/Collectives.hpp"
#include "shm/FillChoice.hpp"
#include "shm/FunctionRef.hpp"
#include "shm/Segment.hpp"
#include "shm/Types.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace hsdp {
struct Config;
} // namespace hsdp

namespace hsdp::shm {

// The backend fills it from hsdp::Config (common/Config.hpp: the settings
// and their defaults); the engine's tests set every field themselves.
// How an all-reduce moves its data (AllReduce.cpp): in one round through
// the slots (small messages), in two rounds through the slots, or in two
// rounds where peers read each rank's reduced part from its own buffer.
enum class AllReduceAlgorithm { OneShot, Slots, Direct };

struct EngineConfig;
// The algorithm for a message of `bytes` per rank: a pure function of the
// size and the group's settings (rank 0's on every rank), so every rank of a
// call picks the same one. `directReads`: peers may read each other's memory.
AllReduceAlgorithm
selectAllReduce(size_t bytes, size_t slotBytes, const EngineConfig& config, bool directReads);

struct EngineConfig {
  std::chrono::milliseconds timeout{0};
  // How long a wait spins before it sleeps on the futex.
  std::chrono::nanoseconds spin{0};
  // How long it then keeps polling with sched_yield in between, before the
  // futex: when ranks share cores (more ranks than cores, or other processes
  // on them), the peer it waits for may need this core, and a yield hands it
  // over without a futex wake-up's latency.
  std::chrono::nanoseconds yield{0};
  // All-reduces up to this many bytes read every peer's whole buffer in one
  // round (one synchronisation instead of two).
  size_t oneShotBytes = 0;
  // All-gathers and broadcasts of at least this many bytes per rank read
  // peers' buffers directly with process_vm_readv (one copy instead of two:
  // no staging through the slots), when every rank may read every other's
  // memory (checked at rendezvous). 0 disables it.
  size_t directReadBytes = 0;
  // Whether the rendezvous replaces directReadBytes with the size from
  // which direct reads are faster on this machine (Crossover.hpp): the
  // system call's cost against a copy through the shared cache differs by
  // CPU and hypervisor, from a few KiB to never.
  bool measureDirectReadBytes = false;
  // Collectives of at least this many bytes per rank whose buffers are pool
  // buffers on every rank read them through mappings (plain loads, no
  // system call; see setPool). 0 disables it.
  size_t pooledReadBytes = 0;
  // The same for all-reduces (their gather half). Separate because the
  // crossover differs: an all-gather gains from a few KiB, an all-reduce,
  // whose reduce half still goes through the slots, from hundreds.
  size_t directAllReduceBytes = 0;
  // Reduce-scatters whose output per rank is at least this many bytes write
  // it with non-temporal stores (Store::Streaming). 0 disables. A rank's own
  // choice: it changes how its output is written, not the protocol.
  size_t streamStoreBytes = 0;
  // Slot fills of at least streamSlotBytes (all a rank writes into its slot
  // for one step) and under streamSlotTimedBytes are written with
  // non-temporal stores (shm::copy); from streamSlotTimedBytes on (0: never)
  // as FillChoice.hpp decides from this rank's timings. A cached store first
  // takes each line of the slot back from the peers that read it last step:
  // cheap where their cores share a cache with this one, a round trip
  // through the machine per line where they do not. Streaming needs no line
  // back but sends the data through memory, which past a few hundred KiB
  // costs more than a shared cache. streamSlotBytes 0: never. A rank's own
  // choice, as streamStoreBytes: the bytes written are the same.
  size_t streamSlotBytes = 0;
  size_t streamSlotTimedBytes = 0;
  // What the engine's waits read time from (Clock.hpp); none: the steady clock.
  std::shared_ptr<const Clock> clock;
  // Whether any op may read directly (then rendezvous probes for it).
  bool wantsDirectReads() const {
    return directReadBytes > 0 || directAllReduceBytes > 0 || pooledReadBytes > 0;
  }
  // How messages name the ranks: engine rank q is rank groupRanks[q] of a
  // group of groupSize (a host's part of a group that spans hosts). Empty:
  // the engine's ranks are the group's.
  std::vector<int> groupRanks;
  int groupSize = 0;
};

// The settings of a group of `groupSize` ranks whose c10d timeout is
// `groupTimeout`, from hsdp's configuration table (common/Config.hpp): the
// one mapping from that table to them (EngineConfig.cpp).
EngineConfig
engineConfigFor(const Config& config, int groupSize, std::chrono::milliseconds groupTimeout);

// Whether this process may read `pid`'s memory: reads `bytes` at `address`.
// Empty if it may, else why not: the system call's error and what on this
// machine may cause it (Yama's ptrace_scope, a seccomp filter).
std::string whyCannotReadProcess(int32_t pid, uint64_t address, void* out, size_t bytes);

class Engine final : public Collectives {
 public:
  Engine(Segment segment, int rank, EngineConfig config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const {
    return rank_;
  }
  int size() const {
    return size_;
  }
  // Max bytes a rank moves through shared memory per step.
  size_t slotBytes() const {
    return segment_.slotBytes();
  }

  // The group's collectives (Collectives.hpp).
  void allGather(const char* op, const void* input, void* output, size_t bytesPerRank) override;
  void reduceScatter(
      const char* op,
      const void* input,
      void* output,
      size_t countPerRank,
      DType dtype,
      RedOp redop,
      Scale scale) override;
  void allReduce(const char* op, void* data, size_t count, DType dtype, RedOp redop, Scale scale)
      override;
  void broadcast(const char* op, void* data, size_t bytes, int root) override;
  void barrier(const char* op) override;

  // An all-gather of many pieces that stay where they are: rank q's
  // `inputs[i]` lands in every rank's `outputs[q][i]`, read by peers
  // directly from q's memory: no packing, no staging, one copy. Piece sizes
  // must match across ranks (checked). Only with direct reads, and only for
  // as many pieces as a slot can list: see gathersPieces.
  void allGatherPieces(
      const char* op,
      const std::vector<Span>& inputs,
      const std::vector<std::vector<Span>>& outputs) override;
  bool gathersPieces(size_t pieces, size_t totalBytes) const override {
    return readsDirectly(totalBytes, directReadBytes_) &&
        pieces * 2 * sizeof(uint64_t) <= slotBytes();
  }

  // Enables direct reads (see EngineConfig::directReadBytes); every rank of
  // the group must call it alike, after a successful rendezvous probe.
  void enableDirectReads() {
    directReads_ = config_.wantsDirectReads();
  }
  // Why direct reads are off where the settings want them: the group's
  // probe's answer (whyCannotReadProcess on some rank). Set with the probe,
  // before the engine serves other threads.
  void refuseDirectReads(std::string why) {
    whyNoDirectReads_ = std::move(why);
  }
  const std::string& whyNoDirectReads() const {
    return whyNoDirectReads_;
  }
  bool directReads() const {
    return directReads_;
  }
  // The all-gather and broadcast threshold (EngineConfig::directReadBytes).
  // Every rank of the group sets it alike, between collectives, and before
  // the engine serves other threads (gathersPieces reads it on the caller's).
  size_t directReadBytes() const {
    return directReadBytes_;
  }
  void setDirectReadBytes(size_t bytes) {
    directReadBytes_ = bytes;
  }

  // The pool this rank's communication buffers come from (Pool.hpp). With
  // direct reads enabled, a collective of at least pooledReadBytes per rank
  // whose buffer (all-gather and reduce-scatter: the input; all-reduce and
  // broadcast: the data) is a pool buffer on every rank reads peers' buffers
  // through mappings of their chunks: plain loads, one pass, no staging. When only some ranks' are
  // pool buffers, every rank takes the ordinary path (one extra empty
  // step). Results are bitwise those of the ordinary path.
  void setPool(std::shared_ptr<const Pool> pool) {
    pool_ = std::move(pool);
  }
  // Calls that read peers' pool buffers through mappings.
  uint64_t pooledCalls() const {
    return pooledCalls_.load(std::memory_order_relaxed);
  }

  // Numbers the collectives that follow, until set again, for messages (a
  // c10d sequence number: a fused call's buckets are one c10d collective): a
  // timeout then says "rank 1 is still in all_reduce #812". At 0 the
  // engine's own count numbers them.
  void setCallerSeq(uint64_t seq) {
    callerSeq_ = seq;
  }
  // Where every rank of the group is, from what each published in the
  // segment: "rank 0 (this rank) waits in all_gather #13 (step 1 of 1) for
  // every rank's post; rank 1 finished all_reduce #12 and has called no
  // collective since".
  std::string whereEveryRankIs() const;

  // The deadline of each op whose first wait starts from now on (the
  // group's timeout changed: c10d's _set_pg_timeout). Any thread.
  void setTimeout(std::chrono::milliseconds timeout) {
    timeoutMs_.store(timeout.count(), std::memory_order_relaxed);
  }

  // Milliseconds every op whose first wait starts while it is positive
  // waits beyond the group's timeout (c10d's ephemeral timeout extension,
  // kept by the backend; null: none).
  void setTimeoutExtension(std::shared_ptr<const std::atomic<int64_t>> extensionMs) {
    timeoutExtensionMs_ = std::move(extensionMs);
  }

  // Marks the group broken (if it is not already) and wakes every waiter:
  // peers blocked on this rank fail at once, naming `why`, instead of at
  // their deadline.
  void abort(const std::string& why);
  // The same for a rank that leaves the group (shutdown, destruction): a
  // peer's pending or later op fails as after an abort, but a peer with
  // none reports no failure (as a peer's ncclCommDestroy breaks no comm).
  void leave(const std::string& why);

  // How the group failed, as this rank sees it: not at all; by one of this
  // rank's waits reaching its deadline; by another failure of this rank's
  // (a dead or mismatched peer it found); or broken by another rank (its
  // failure or abort; its leaving only where an op of this rank's failed on
  // it). This rank's own abort() is not a failure of its own.
  enum class Failure { None, Timeout, Local, Remote };
  Failure failure() const;

 private:
  // Named in messages by detail::kKindNames (same values).
  enum class Kind : uint32_t {
    AllGather = 1,
    ReduceScatter,
    AllReduce,
    Broadcast,
    Barrier,
    AllGatherPieces
  };
  enum class Counter { Posted, Reduced, Done };
  // Whether a message of `bytes` per rank is read directly, for an op whose
  // threshold is `threshold` (0: never).
  bool readsDirectly(size_t bytes, size_t threshold) const {
    return directReads_ && threshold > 0 && bytes >= threshold;
  }
  static const char* counterName(Counter which) {
    return which == Counter::Posted ? "posted" : which == Counter::Reduced ? "reduced" : "done";
  }

  // One collective in flight on this rank. Its lifetime is the call's: it
  // publishes the call in the segment (Activity) on creation, and on
  // destruction marks this rank idle, or failed if an exception is leaving.
  struct OpState {
    // `seq`: the caller's number for it (setCallerSeq), else this engine's.
    OpState(Engine& engine, const char* name, const Signature& sig, uint64_t seq);
    OpState(const OpState&) = delete;
    OpState& operator=(const OpState&) = delete;
    ~OpState();
    // Publishes that this rank is at step `stepIndex` (of `steps`) in `state`.
    void at(Activity::State state) const;

    // The op's deadline, set by its first wait that does not pass at once
    // (most small ops never need one, and a clock read in a VM is a
    // noticeable part of a small op):
    // the group's timeout, and any extension active then, count from there.
    Clock::time_point deadlineFrom(Clock::time_point now);
    // What deadlineFrom gave the op to wait.
    std::chrono::milliseconds timeout{0};

    Engine& engine;
    const char* name;
    Signature sig;
    std::optional<Clock::time_point> deadline;
    uint32_t steps = 1;
    uint32_t stepIndex = 0;
    int exceptionsAtStart;
  };

  OpState begin(const char* op, Kind kind, size_t count, DType dtype, RedOp redop, int root);
  // Steps 1-3 of the protocol; returns the slot index to use. A rank's
  // first post of a call that meets a peer's pool step (pooledStep) while
  // its own buffer is ordinary closes that step and posts again at the next
  // one: `step` is then one more than it was.
  int post(OpState& op, uint64_t& step, FunctionRef<void(char*)> fill);
  // My pool buffer holding [p, p + bytes), if the call may read pool
  // buffers: direct reads on and `perRank` bytes a rank at least the
  // direct-read threshold (below it the pooled step's final wait for every
  // peer costs more than the slots' copy; docs/results/cpu-performance-2026-11.md, "The engine's
  // constants"). A pure function of the call and rank 0's settings on every rank, so ranks whose
  // buffers are pool buffers agree on trying.
  PoolRef pooled(const void* p, size_t bytes, size_t perRank) const;
  // Posts my pool buffer `mine` alone as the call's first step. When every
  // rank posted one, calls `use(buffers, step)` (buffers[q]: rank q's
  // buffer, `bytes` long, mapped; mine is `own`), waits until every peer is
  // done reading mine and returns true. Else closes the step and returns
  // false: the caller takes its ordinary path, as every rank does.
  bool pooledStep(
      OpState& op,
      const PoolRef& mine,
      const char* own,
      size_t bytes,
      FunctionRef<void(const std::vector<const char*>&, uint64_t)> use);
  // Rank q's pool buffer `ref`, `bytes` long, in this process (maps its
  // chunk on first use); fails the op on a reference hsdp never writes.
  const char* peerBuffer(const OpState& op, int q, const PoolRef& ref, size_t bytes);
  std::atomic<uint64_t>& counter(int q, Counter which) const;
  void publish(Counter which, uint64_t step);
  // Rank q's counter, checked against what the protocol allows (fails the op
  // on a value no rank could have written).
  uint64_t loadCounter(const OpState& op, Counter which, int q);
  // Rank q's pid: as published in the segment until this rank's first step
  // completes, from this rank's own copy after that.
  int32_t peerPid(int q) const;
  // Returns once every rank's `which` counter reached `target`; fails the op
  // at its deadline, when the group breaks, or when a peer short of the
  // target is gone (Wait.cpp).
  void waitAll(OpState& op, Counter which, uint64_t target);
  // waitAll's phases after its spin: yields while that may hand the core to
  // a peer (whether `ready()` came true), then sleeps on the futex until
  // `ready()`, the deadline, a broken group or a lost peer.
  bool yieldUntilReady(FunctionRef<bool()> ready);
  void sleepUntilReady(
      OpState& op,
      Counter which,
      uint64_t target,
      FunctionRef<bool()> ready,
      const int& laggard);
  // Fails the op when a rank short of `target` has exited.
  void failIfAPeerIsGone(const OpState& op, Counter which, uint64_t target);
  // Fails the op unless every rank's signature for `step` matches mine;
  // returns whether any rank posted a pool buffer (pooledStep).
  bool checkSignatures(const OpState& op, uint64_t step);
  [[noreturn]] void fail(const OpState& op, const std::string& what, Failure kind = Failure::Local);
  // Records the first failure of the group (later ones keep the first).
  void markBroken(const std::string& reason, bool leaving = false);
  // Fails an op of this rank that the group's being broken ends (Remote).
  [[noreturn]] void failBroken(const std::string& what);
  // "rank r failed: reason" once the group is broken, else empty.
  std::string brokenBy() const;
  // Header::brokenBy once written (waits, boundedly, past "being written").
  uint32_t brokenRecord() const;
  std::string prefix(const char* op) const;
  // "rank R": engine rank q as the group numbers it (EngineConfig::groupRanks).
  std::string rankName(int q) const;
  // Fails the op after a direct read of rank q (`pid`) failed: as a dead peer
  // when q is gone, else with errno's reason.
  [[noreturn]] void failedRead(const OpState& op, int q, int32_t pid, const std::string& what);
  // Copies `bytes` at `address` in rank q's memory to `dst`.
  void readPeer(const OpState& op, int q, uint64_t address, void* dst, size_t bytes);
  // Copies rank q's pieces `remote` (address, bytes pairs) into `local`.
  void
  readPeerPieces(const OpState& op, int q, const uint64_t* remote, const std::vector<Span>& local);
  // Publishes `source`'s address, waits for every peer's, and calls
  // `readFrom(q, q's address)` for each peer; returns only after every peer
  // finished reading mine.
  void directStep(OpState& op, const void* source, FunctionRef<void(int, uint64_t)> readFrom);
  // Moves an n-byte message through the slots, a slot-sized piece a step:
  // `fill(mySlot, offset, length)` writes this rank's piece, then
  // `drain(slot, offset, length)` reads the peers' slots of that step.
  void pipelineBytes(
      OpState& op,
      size_t n,
      FunctionRef<void(char*, size_t, size_t)> fill,
      FunctionRef<void(int, size_t, size_t)> drain);
  void wake();
  // Copies a step's data into this rank's slot (streamSlotBytes says how);
  // `stepBytes`: all this rank writes into it for the step.
  void fillSlot(char* dst, const void* src, size_t bytes, size_t stepBytes);
  // The all-reduce's algorithms (selectAllReduce picks one).
  void allReduceOneShot(OpState& op, char* buf, size_t n, DType dtype, RedOp redop, Scale scale);
  void allReduceSlots(OpState& op, char* buf, size_t n, DType dtype, RedOp redop, Scale scale);
  void allReduceDirect(OpState& op, char* buf, size_t n, DType dtype, RedOp redop, Scale scale);
  // Every rank's buffer in its pool (pooledStep): rank q reduces part q of
  // every rank's buffer into its own, `reduced`, then copies the other
  // parts from their owners. False: the call takes an ordinary algorithm.
  bool allReducePooled(
      OpState& op,
      const PoolRef& mine,
      char* buf,
      size_t n,
      DType dtype,
      RedOp redop,
      Scale scale);

  Segment segment_;
  const int rank_;
  const int size_;
  const EngineConfig config_;
  const Clock& clock_; // config_.clock's, else the steady clock
  std::atomic<int64_t> timeoutMs_{config_.timeout.count()}; // config_'s until setTimeout
  std::shared_ptr<const std::atomic<int64_t>> timeoutExtensionMs_;
  // This rank's own failure (Failure), the first one: failure() reads it.
  std::atomic<int> failedHere_{static_cast<int>(Failure::None)};
  uint64_t step_ = 0;      // last step this rank finished
  uint64_t posted_ = 0;    // last step this rank posted
  uint64_t doneByAll_ = 0; // every rank's `done` was at least this when last read
  // The op name this rank's Activity holds (an op-name literal): the next
  // op of the same name does not write it again.
  const char* publishedName_ = nullptr;
  uint64_t opSeq_ = 0;
  uint64_t callerSeq_ = 0;
  bool directReads_ = false;
  std::string whyNoDirectReads_;
  // config_.directReadBytes until the group agrees on its own (Crossover.hpp);
  // declared after config_, which it is initialised from.
  size_t directReadBytes_ = config_.directReadBytes;
  std::vector<int32_t> pids_;
  std::shared_ptr<const Pool> pool_;
  std::vector<std::vector<PeerChunk>> peerChunks_; // [rank][chunk - 1]
  std::atomic<uint64_t> pooledCalls_{0};           // read by other threads (stats)
  // A reduction's sources, one per rank: reused, so a call allocates nothing.
  std::vector<const void*> sources_;
  // A yield that lasts this long gave the core to a process outside the
  // group (or to a peer's long stretch of work); yielding then pauses for
  // kYieldPauseWaits waits.
  static constexpr auto kForeignSlice = std::chrono::microseconds(500);
  static constexpr uint64_t kYieldPauseWaits = 1024;
  uint64_t yieldPause_ = 0;
  FillChoice largeFills_; // fills of streamSlotTimedBytes and more
};

} // namespace hsdp::shm
