#include "shm/Engine.hpp"

#include "shm/Detail.hpp"
#include "shm/Reduce.hpp"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <thread>

namespace hsdp::shm {

using namespace detail;

namespace {

std::string describe(const Signature& s) {
  std::string out = std::string(kindName(s.kind)) + "(count=" + std::to_string(s.count);
  if (s.kind == 2 || s.kind == 3) {
    out += std::string(", dtype=") + (s.dtype <= 8 ? dtypeName(static_cast<DType>(s.dtype)) : "?") +
        ", op=" + (s.redop <= 6 ? redOpName(static_cast<RedOp>(s.redop)) : "?");
  }
  if (s.kind == 4) {
    out += ", root=" + std::to_string(s.root);
  }
  if (s.kind == 6) {
    out += ", pieces=" + std::to_string(s.pieces);
  }
  return out + ") as its engine op #" + std::to_string(s.opSeq);
}

// The first line of `path` that starts with `key`, without it; empty if none.
std::string lineOf(const char* path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) == 0) {
      return line.substr(key.size());
    }
  }
  return "";
}

} // namespace

std::string whyCannotReadProcess(int32_t pid, uint64_t address, void* out, size_t bytes) {
  struct iovec local {
    out, bytes
  };
  struct iovec remote {
    reinterpret_cast<void*>(address), bytes
  };
  const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (got == static_cast<ssize_t>(bytes)) {
    return "";
  }
  std::string why = got < 0
      ? std::string("process_vm_readv: ") + std::strerror(errno)
      : "process_vm_readv read " + std::to_string(got) + " of " + std::to_string(bytes) + " bytes";
  // What on this machine refuses it, as the kernel documents: Yama's
  // ptrace_scope (1: only descendants; 2: only CAP_SYS_PTRACE; 3: nobody), a
  // seccomp filter (mode 2), which containers install by default.
  std::string scope = lineOf("/proc/sys/kernel/yama/ptrace_scope", "");
  if (!scope.empty() && scope != "0") {
    why += "; kernel.yama.ptrace_scope is " + scope;
  }
  std::string seccomp = lineOf("/proc/self/status", "Seccomp:");
  seccomp.erase(0, seccomp.find_first_not_of(" \t"));
  if (seccomp == "2") {
    why += "; this process runs under a seccomp filter";
  }
  return why;
}

Engine::Engine(Segment segment, int rank, EngineConfig config)
    : segment_(std::move(segment)),
      rank_(rank),
      size_(segment_.nranks()),
      config_(std::move(config)),
      clock_(config_.clock ? *config_.clock : Clock::steady()),
      sources_(size_) {
  static_assert(std::size(kKindNames) == static_cast<size_t>(Kind::AllGatherPieces) + 1);
  reinterpret_cast<std::atomic<int32_t>*>(&segment_.control(rank_).pid)
      ->store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

std::string Engine::prefix(const char* op) const {
  const int size = config_.groupRanks.empty() ? size_ : config_.groupSize;
  return "[" + rankName(rank_) + "/" + std::to_string(size) + "] " + op + ": ";
}

std::string Engine::rankName(int q) const {
  const bool mapped = !config_.groupRanks.empty() && q >= 0 && q < size_;
  return "rank " + std::to_string(mapped ? config_.groupRanks[q] : q);
}

Engine::OpState::OpState(Engine& e, const char* opName, const Signature& signature, uint64_t number)
    : engine(e), name(opName), sig(signature), exceptionsAtStart(std::uncaught_exceptions()) {
  Activity& a = engine.segment_.control(engine.rank_).activity;
  if (name != engine.publishedName_) {
    char packed[sizeof a.name] = {};
    std::strncpy(packed, name, sizeof packed - 1);
    for (size_t w = 0; w < std::size(a.name); ++w) {
      uint64_t word;
      std::memcpy(&word, packed + 8 * w, 8);
      a.name[w].store(word, std::memory_order_relaxed);
    }
    engine.publishedName_ = name;
  }
  a.seq.store(number, std::memory_order_relaxed);
  a.count.store(sig.count, std::memory_order_relaxed);
  a.steps.store(steps, std::memory_order_relaxed);
  a.step.store(0, std::memory_order_relaxed);
  a.state.store(Activity::Working, std::memory_order_relaxed);
}

Clock::time_point Engine::OpState::deadlineFrom(Clock::time_point now) {
  if (!deadline) {
    timeout = std::chrono::milliseconds(engine.timeoutMs_.load(std::memory_order_relaxed));
    if (const auto& extension = engine.timeoutExtensionMs_) {
      timeout += std::chrono::milliseconds(
          std::max<int64_t>(0, extension->load(std::memory_order_acquire)));
    }
    deadline = now + timeout;
  }
  return *deadline;
}

Engine::OpState::~OpState() {
  at(std::uncaught_exceptions() > exceptionsAtStart ? Activity::Failed : Activity::Idle);
}

void Engine::OpState::at(Activity::State state) const {
  Activity& a = engine.segment_.control(engine.rank_).activity;
  a.steps.store(steps, std::memory_order_relaxed);
  a.step.store(stepIndex, std::memory_order_relaxed);
  a.state.store(state, std::memory_order_relaxed);
}

std::string Engine::whereEveryRankIs() const {
  std::string out;
  for (int q = 0; q < size_; ++q) {
    const Activity& a = segment_.control(q).activity;
    char name[sizeof a.name + 1] = {};
    for (size_t w = 0; w < std::size(a.name); ++w) {
      const uint64_t word = a.name[w].load(std::memory_order_relaxed);
      std::memcpy(name + 8 * w, &word, 8);
    }
    name[sizeof a.name - 1] = '\0'; // a peer's bytes: never trust a terminator
    makePrintable(name);
    const uint64_t seq = a.seq.load(std::memory_order_relaxed);
    const uint32_t state = a.state.load(std::memory_order_relaxed);
    const std::string op = std::string(name) + " #" + std::to_string(seq);
    const std::string at = " (step " + std::to_string(a.step.load(std::memory_order_relaxed)) +
        " of " + std::to_string(a.steps.load(std::memory_order_relaxed)) + ")";
    out += out.empty() ? "" : "; ";
    out += rankName(q) + (q == rank_ ? " (this rank)" : "");
    switch (state) {
      case Activity::Idle:
        out += seq == 0 ? " has called no collective yet"
                        : " finished " + op + " and has called no collective since";
        break;
      case Activity::Working:
        out += " is still in " + op + at;
        break;
      case Activity::WaitingPosted:
        out += " waits in " + op + at + " for every rank's post";
        break;
      case Activity::WaitingReduced:
        out += " waits in " + op + at + " for every rank's reduced part";
        break;
      case Activity::WaitingDone:
        out += " waits in " + op + at + " for every rank to finish reading";
        break;
      case Activity::Failed:
        out += " failed in " + op + at;
        break;
      default:
        out += " published a state hsdp never writes (" + std::to_string(state) + ")";
    }
  }
  return out;
}

Engine::OpState
Engine::begin(const char* op, Kind kind, size_t count, DType dtype, RedOp redop, int root) {
  if (const std::string broken = brokenBy(); !broken.empty()) {
    failBroken(
        prefix(op) + "the group is unusable after " + broken + "; create a new process group");
  }
  if (segment_.header().magic != kMagic) {
    markBroken(prefix(op) + "the segment header's magic number was overwritten");
    throw CommError(prefix(op) + "the shared-memory segment's header was overwritten" + kCorrupted);
  }
  ++opSeq_;
  const uint64_t seq = callerSeq_ != 0 ? callerSeq_ : opSeq_;
  return OpState(
      *this,
      op,
      Signature{
          0,
          opSeq_,
          count,
          static_cast<uint32_t>(kind),
          static_cast<uint32_t>(dtype),
          static_cast<uint32_t>(redop),
          root,
          0,
          0,
          PoolRef{}},
      seq);
}

std::atomic<uint64_t>& Engine::counter(int q, Counter which) const {
  RankControl& c = segment_.control(q);
  return which == Counter::Posted ? c.posted : which == Counter::Reduced ? c.reduced : c.done;
}

void Engine::publish(Counter which, uint64_t step) {
  counter(rank_, which).store(step, std::memory_order_release);
  wake();
}

void Engine::markBroken(const std::string& reason, bool leaving) {
  Header& h = segment_.header();
  // The first failing rank records why, so every other rank can say it; a
  // failure or abort replaces a rank's leaving (which fails no idle peer),
  // so that it is not hidden. UINT32_MAX marks "being written" until the
  // rank number is published.
  uint32_t expected = h.brokenBy.load(std::memory_order_acquire);
  for (;;) {
    const bool replaceable =
        expected == 0 || (!leaving && expected != UINT32_MAX && (expected & kBrokenByLeaving) != 0);
    if (!replaceable) {
      break;
    }
    if (h.brokenBy.compare_exchange_weak(expected, UINT32_MAX, std::memory_order_acq_rel)) {
      std::snprintf(h.brokenReason, sizeof h.brokenReason, "%s", reason.c_str());
      h.brokenBy.store(
          (static_cast<uint32_t>(rank_) + 1) | (leaving ? kBrokenByLeaving : 0),
          std::memory_order_release);
      break;
    }
  }
  wake();
}

uint32_t Engine::brokenRecord() const {
  const Header& h = segment_.header();
  uint32_t by = h.brokenBy.load(std::memory_order_acquire);
  // The failing rank publishes its number right after writing its reason
  // (markBroken), so a reader in between would lose the reason: wait for
  // it, boundedly, since that rank may have died in between.
  for (const auto until = clock_.now() + std::chrono::milliseconds(200);
       by == UINT32_MAX && clock_.now() < until;) {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    by = h.brokenBy.load(std::memory_order_acquire);
  }
  return by;
}

std::string Engine::brokenBy() const {
  const Header& h = segment_.header();
  uint32_t by = brokenRecord();
  if (by == 0) {
    return "";
  }
  if (by == UINT32_MAX) {
    return "a rank failed (it did not finish writing its reason)";
  }
  const bool left = (by & kBrokenByLeaving) != 0;
  by &= ~kBrokenByLeaving;
  if (by == 0 || by > static_cast<uint32_t>(size_)) {
    return "the segment's failure record names rank " + std::to_string(by - 1) + " of a group of " +
        std::to_string(size_) + kCorrupted;
  }
  char reason[sizeof h.brokenReason];
  std::memcpy(reason, h.brokenReason, sizeof reason);
  reason[sizeof reason - 1] = '\0';
  makePrintable(reason);
  return rankName(static_cast<int>(by - 1)) + (left ? " left (" : " failed (") + reason + ")";
}

void Engine::abort(const std::string& why) {
  // The caller's choice, not a failure of this rank: its peers find the
  // group broken by it (failure(): Remote).
  markBroken(prefix("abort") + why);
}

void Engine::leave(const std::string& why) {
  markBroken(prefix("leave") + why, /*leaving=*/true);
}

void Engine::failBroken(const std::string& what) {
  int none = static_cast<int>(Failure::None);
  failedHere_.compare_exchange_strong(none, static_cast<int>(Failure::Remote));
  throw CommError(what);
}

void Engine::fail(const OpState& op, const std::string& what, Failure kind) {
  int none = static_cast<int>(Failure::None);
  failedHere_.compare_exchange_strong(none, static_cast<int>(kind));
  markBroken(prefix(op.name) + what);
  throw CommError(prefix(op.name) + what);
}

Engine::Failure Engine::failure() const {
  if (const auto here = static_cast<Failure>(failedHere_.load()); here != Failure::None) {
    return here;
  }
  if (segment_.header().brokenBy.load(std::memory_order_acquire) == 0) {
    return Failure::None; // the common case: no wait
  }
  // A leaving rank's record, once written and naming a rank, breaks no idle
  // peer; anything else (a failure, an abort, a corrupted record) does.
  const uint32_t by = brokenRecord();
  const uint32_t who = by & ~kBrokenByLeaving;
  const bool left = by != UINT32_MAX && (by & kBrokenByLeaving) != 0 && who >= 1 &&
      who <= static_cast<uint32_t>(size_);
  return left ? Failure::None : Failure::Remote;
}

bool Engine::checkSignatures(const OpState& op, uint64_t step) {
  const int slot = static_cast<int>(step % kSlots);
  bool pooled = false;
  for (int q = 0; q < size_; ++q) {
    // Copied (a peer may write it again; checks and use see one value),
    // all but the pool reference's tail, which is read only when every
    // rank posted a pool buffer (pooledStep): one cache line.
    const Signature& shared = segment_.control(q).sig[slot];
    Signature s;
    std::memcpy(
        static_cast<void*>(&s), &shared, offsetof(Signature, pool) + sizeof(PoolRef::chunk));
    pooled = pooled || static_cast<bool>(s.pool);
    const Signature& mine = op.sig;
    // Rank q posted `step`, so its slot's signature is for `step` and was
    // written by hsdp: anything else was written by something else.
    if (s.step != step || s.kind < 1 || s.kind > 6 || s.dtype > 8 || s.redop > 6) {
      fail(
          op,
          rankName(q) + "'s signature for step " + std::to_string(step) +
              " is not one hsdp writes (step=" + std::to_string(s.step) +
              ", kind=" + std::to_string(s.kind) + ", dtype=" + std::to_string(s.dtype) +
              ", op=" + std::to_string(s.redop) + ")" + kCorrupted);
    }
    if (s.step != step || s.opSeq != mine.opSeq || s.kind != mine.kind || s.count != mine.count ||
        s.dtype != mine.dtype || s.redop != mine.redop || s.root != mine.root ||
        s.pieces != mine.pieces) {
      Signature expected = mine;
      fail(
          op,
          "ranks called different collectives: " + rankName(q) + " called " + describe(s) +
              ", this rank called " + describe(expected) + ". " + whereEveryRankIs());
    }
  }
  return pooled;
}

void Engine::failedRead(const OpState& op, int q, int32_t pid, const std::string& what) {
  const int err = errno;
  // A peer killed mid-read is a dead peer, and is reported as one.
  if (err == ESRCH || processGone(pid)) {
    fail(op, peerExited(rankName(q), pid) + ". " + whereEveryRankIs());
  }
  fail(
      op,
      "reading " + what + " from " + rankName(q) + " (pid " + std::to_string(pid) +
          ") failed: " + std::strerror(err));
}

void Engine::readPeer(const OpState& op, int q, uint64_t address, void* dst, size_t bytes) {
  const int32_t pid = peerPid(q);
  size_t doneBytes = 0;
  while (doneBytes < bytes) {
    struct iovec local {
      static_cast<char*>(dst) + doneBytes, bytes - doneBytes
    };
    struct iovec remote {
      reinterpret_cast<void*>(address + doneBytes), bytes - doneBytes
    };
    const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n <= 0) {
      failedRead(op, q, pid, std::to_string(bytes) + " bytes");
    }
    doneBytes += static_cast<size_t>(n);
  }
}

void Engine::readPeerPieces(
    const OpState& op,
    int q,
    const uint64_t* remote,
    const std::vector<Span>& local) {
  const int32_t pid = peerPid(q);
  for (size_t i = 0; i < local.size(); ++i) {
    if (remote[2 * i + 1] != local[i].bytes) {
      fail(
          op,
          rankName(q) + "'s piece " + std::to_string(i) + " has " +
              std::to_string(remote[2 * i + 1]) + " bytes; this rank expects " +
              std::to_string(local[i].bytes));
    }
  }
  // Batches of up to IOV_MAX pieces; a short read resumes mid-piece.
  constexpr size_t kMaxIov = 1024;
  size_t piece = 0, offset = 0;
  std::vector<struct iovec> l, r;
  while (piece < local.size()) {
    l.clear();
    r.clear();
    for (size_t i = piece; i < local.size() && l.size() < kMaxIov; ++i) {
      const size_t skip = i == piece ? offset : 0;
      if (local[i].bytes > skip) {
        l.push_back({local[i].data + skip, local[i].bytes - skip});
        r.push_back({reinterpret_cast<void*>(remote[2 * i] + skip), local[i].bytes - skip});
      }
    }
    if (l.empty()) {
      break;
    }
    ssize_t n = process_vm_readv(pid, l.data(), l.size(), r.data(), r.size(), 0);
    if (n <= 0) {
      failedRead(op, q, pid, "pieces");
    }
    // Advance past what was read.
    size_t left = static_cast<size_t>(n);
    while (left > 0 && piece < local.size()) {
      const size_t rest = local[piece].bytes - offset;
      if (left >= rest) {
        left -= rest;
        ++piece;
        offset = 0;
      } else {
        offset += left;
        left = 0;
      }
    }
    while (piece < local.size() && local[piece].bytes == 0) {
      ++piece;
    }
  }
}

void Engine::directStep(
    OpState& op,
    const void* source,
    FunctionRef<void(int, uint64_t)> readFrom) {
  uint64_t s = step_ + 1;
  op.sig.sourceAddress = reinterpret_cast<uint64_t>(source);
  const int slot = post(op, s, nullptr);
  for (int i = 1; i < size_; ++i) {
    const int q = (rank_ + i) % size_;
    readFrom(q, segment_.control(q).sig[slot].sourceAddress);
  }
  publish(Counter::Done, s);
  // Peers read my buffer in place: it must stay untouched until they are
  // done, so the call returns only then.
  waitAll(op, Counter::Done, s);
  step_ = s;
}

int Engine::post(OpState& op, uint64_t& step, FunctionRef<void(char*)> fill) {
  const int slot = static_cast<int>(step % kSlots);
  ++op.stepIndex;
  op.at(Activity::Working);
  // Slot `slot` was last used by step - 2: reuse it once everyone is done.
  // Counters only grow, so what the last wait saw still holds: ranks that
  // run in step are usually one call ahead of it, and every other call
  // then reads no peer's `done` line.
  if (step > kSlots && doneByAll_ < step - kSlots) {
    waitAll(op, Counter::Done, step - kSlots);
    doneByAll_ = UINT64_MAX;
    for (int q = 0; q < size_; ++q) {
      doneByAll_ = std::min(doneByAll_, loadCounter(op, Counter::Done, q));
    }
  }
  if (fill) {
    fill(segment_.slot(rank_, slot));
  }
  Signature sig = op.sig;
  sig.step = step;
  segment_.control(rank_).sig[slot] = sig;
  posted_ = step;
  publish(Counter::Posted, step);
  waitAll(op, Counter::Posted, step);
  const bool anyPooled = checkSignatures(op, step);
  if (pids_.empty()) {
    // Every rank published its pid before its first post: from here on the
    // pids are this rank's own copy, which nothing in the segment can change.
    std::vector<int32_t> pids;
    for (int q = 0; q < size_; ++q) {
      pids.push_back(peerPid(q));
    }
    pids_ = std::move(pids);
  }
  if (op.stepIndex == 1 && !op.sig.pool && anyPooled) {
    // A peer posted its pool buffer alone (pooledStep) and will find mine
    // ordinary: every rank closes this step, which nobody reads, and takes
    // the ordinary path from the next one.
    publish(Counter::Done, step);
    step_ = step;
    ++step;
    op.stepIndex = 0;
    return post(op, step, fill);
  }
  return slot;
}

PoolRef Engine::pooled(const void* p, size_t bytes, size_t perRank) const {
  return pool_ && readsDirectly(perRank, config_.pooledReadBytes) ? pool_->find(p, bytes)
                                                                  : PoolRef{};
}

const char* Engine::peerBuffer(const OpState& op, int q, const PoolRef& ref, size_t bytes) {
  if (ref.chunk > Pool::kMaxChunks || ref.offset > ref.chunkBytes ||
      bytes > ref.chunkBytes - ref.offset) {
    fail(
        op,
        rankName(q) + "'s pool buffer (chunk " + std::to_string(ref.chunk) + ", offset " +
            std::to_string(ref.offset) + " of " + std::to_string(ref.chunkBytes) +
            " bytes) cannot hold the " + std::to_string(bytes) + " bytes this call moves" +
            kCorrupted);
  }
  // A real buffer starts on an element (a tensor's data does), so the
  // reduction may load whole elements from it.
  const size_t element = dtypeSize(static_cast<DType>(op.sig.dtype));
  if (ref.offset % element != 0) {
    fail(
        op,
        rankName(q) + "'s pool buffer starts at offset " + std::to_string(ref.offset) +
            " of its chunk, not on a " + std::to_string(element) + "-byte element" + kCorrupted);
  }
  if (peerChunks_.empty()) {
    peerChunks_.resize(size_);
  }
  auto& chunks = peerChunks_[q];
  if (chunks.size() < ref.chunk) {
    chunks.resize(ref.chunk);
  }
  PeerChunk& c = chunks[ref.chunk - 1];
  if (c.base() == nullptr) {
    try {
      c = PeerChunk(peerPid(q), ref);
    } catch (const std::runtime_error& e) {
      if (processGone(peerPid(q))) {
        fail(op, peerExited(rankName(q), peerPid(q)) + ". " + whereEveryRankIs());
      }
      fail(op, "mapping " + rankName(q) + "'s pool buffer failed: " + e.what());
    }
  } else if (c.inode() != ref.inode || c.bytes() != ref.chunkBytes) {
    // Chunks never change while their pool lives, and a peer's pool lives
    // as long as its engine.
    fail(
        op,
        rankName(q) + "'s pool chunk " + std::to_string(ref.chunk) +
            " is not the one it published before" + kCorrupted);
  }
  return c.base() + ref.offset;
}

bool Engine::pooledStep(
    OpState& op,
    const PoolRef& mine,
    const char* own,
    size_t bytes,
    FunctionRef<void(const std::vector<const char*>&, uint64_t)> use) {
  uint64_t s = step_ + 1;
  op.sig.pool = mine;
  const int slot = post(op, s, nullptr);
  op.sig.pool = {};
  std::vector<const char*> buffers(size_, nullptr);
  bool all = true;
  for (int q = 0; q < size_ && all; ++q) {
    const PoolRef ref = segment_.control(q).sig[slot].pool;
    all = static_cast<bool>(ref);
    if (all) {
      buffers[q] = q == rank_ ? own : peerBuffer(op, q, ref, bytes);
    }
  }
  if (all) {
    use(buffers, s);
    pooledCalls_.fetch_add(1, std::memory_order_relaxed);
  }
  publish(Counter::Done, s);
  if (all) {
    // Peers read my buffer in place: it must stay untouched until they are
    // done, so the call returns only then.
    waitAll(op, Counter::Done, s);
  }
  step_ = s;
  return all;
}

void Engine::fillSlot(char* dst, const void* src, size_t bytes, size_t stepBytes) {
  if (config_.streamSlotBytes == 0 || stepBytes < config_.streamSlotBytes) {
    return copy(dst, src, bytes, Store::Cached);
  }
  if (config_.streamSlotTimedBytes == 0 || stepBytes < config_.streamSlotTimedBytes) {
    return copy(dst, src, bytes, Store::Streaming);
  }
  // The steady clock, not the engine's (a test's clock moves deadlines, not
  // this): two reads against a fill of hundreds of KiB, tens of µs.
  const bool streaming = largeFills_.streamNext();
  const auto start = std::chrono::steady_clock::now();
  copy(dst, src, bytes, streaming ? Store::Streaming : Store::Cached);
  const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
  largeFills_.record(streaming, took.count(), static_cast<double>(bytes));
}

void Engine::pipelineBytes(
    OpState& op,
    size_t n,
    FunctionRef<void(char*, size_t, size_t)> fill,
    FunctionRef<void(int, size_t, size_t)> drain) {
  const size_t piece = slotBytes();
  const size_t steps = std::max<size_t>(1, ceilDiv(n, piece)); // >= 1: an empty call still syncs
  op.steps = static_cast<uint32_t>(steps);
  for (size_t k = 0; k < steps; ++k) {
    const size_t off = k * piece;
    const size_t len = std::min(piece, n - off);
    uint64_t s = step_ + 1;
    const int slot = post(op, s, [&](char* dst) { fill(dst, off, len); });
    drain(slot, off, len);
    publish(Counter::Done, s);
    step_ = s;
  }
}

void Engine::barrier(const char* name) {
  auto op = begin(name, Kind::Barrier, 0, DType::U8, RedOp::Sum, -1);
  uint64_t s = step_ + 1;
  post(op, s, nullptr);
  publish(Counter::Done, s);
  step_ = s;
}

} // namespace hsdp::shm
