// The engine's one wait (Engine::waitAll) and what it stands on: spin,
// yield, a process-shared futex, the deadline on the engine's clock and the
// liveness of peers. Every wait of every collective goes through waitAll.

#include "shm/Detail.hpp"
#include "shm/Engine.hpp"

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <string>

namespace hsdp::shm {

using namespace detail;

namespace {

void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE_FLAG: the waker is another process mapping the same
  // page. (std::atomic::wait uses private futexes and would never wake.)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Spins until `ready()` or `until`; whether it became ready. A peer a few
// microseconds behind is cheaper to wait for than a futex round trip. The
// counters are checked after every pause: polling a line the peer has not
// written is a hit in this core's cache, and checking only every few dozen
// pauses made a rank notice its peer's post late by most of a small
// all-reduce's handshake (docs/results/cpu-performance-2026-11.md, "The
// engine's constants"). A template, not a FunctionRef: this loop is the
// hot one, and `ready` inlines into it.
template <typename Ready>
bool spinUntil(const Clock& clock, Clock::time_point until, Ready& ready) {
  for (uint32_t i = 1;; ++i) {
    _mm_pause();
    if (ready()) {
      return true;
    }
    if (i % 64 == 0 && clock.now() >= until) {
      return false;
    }
  }
}

class SteadyClock final : public Clock {
 public:
  time_point now() const override {
    return std::chrono::steady_clock::now();
  }
};

} // namespace

const Clock& Clock::steady() {
  static const SteadyClock clock;
  return clock;
}

bool detail::processGone(int32_t pid) {
  if (pid <= 0) {
    return false; // not yet published: the peer is still starting
  }
  if (kill(pid, 0) != 0 && errno == ESRCH) {
    return true;
  }
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  const auto close = content.rfind(')');
  if (close == std::string::npos || close + 2 >= content.size()) {
    return false;
  }
  const char state = content[close + 2];
  return state == 'Z' || state == 'X';
}

std::string detail::peerExited(const std::string& rank, int32_t pid) {
  return rank + " (pid " + std::to_string(pid) + ") exited before finishing this collective";
}

// The sleep/wake handshake is model-checked in wake.pml, next to this file:
// the publisher's counter store, a fence, its read of `sleepers`; the
// sleeper's announcement, a fence, its last check. With nobody asleep (every
// call where ranks meet while spinning), a publish writes no line that
// another rank writes: the futex word is bumped only for a sleeper.
void Engine::wake() {
  Header& h = segment_.header();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (h.sleepers.load(std::memory_order_relaxed) > 0) {
    h.wakeSeq.fetch_add(1, std::memory_order_seq_cst);
    futexWakeAll(&h.wakeSeq);
  }
}

int32_t Engine::peerPid(int q) const {
  if (!pids_.empty()) {
    return pids_[q];
  }
  return reinterpret_cast<const std::atomic<int32_t>*>(&segment_.control(q).pid)
      ->load(std::memory_order_acquire);
}

uint64_t Engine::loadCounter(const OpState& op, Counter which, int q) {
  const uint64_t v = counter(q, which).load(std::memory_order_acquire);
  // A peer posts step t only after every rank, this one included, posted
  // t - 1, and its other counters never pass its own posted: no counter can
  // exceed this rank's posted step + 1. Anything larger was not written by
  // hsdp, and would let this rank read a slot before its data is there.
  if (v > posted_ + 1) {
    fail(
        op,
        rankName(q) + "'s " + counterName(which) + " counter reads " + std::to_string(v) +
            ", but no rank can be past step " + std::to_string(posted_ + 1) +
            " while this rank has posted step " + std::to_string(posted_) + kCorrupted);
  }
  return v;
}

// A wait in three phases, each cheaper than the next when the peer is
// close: spin, yield, sleep on the futex. Only the last has a deadline to
// meet (the others end by their own budgets, well within it).
void Engine::waitAll(OpState& op, Counter which, uint64_t target) {
  // The first rank found short of the target: the one a timeout names.
  int laggard = 0;
  auto ready = [&]() {
    for (int i = 0; i < size_; ++i) {
      if (loadCounter(op, which, laggard) < target) {
        return false;
      }
      laggard = (laggard + 1) % size_;
    }
    return true;
  };
  if (ready()) {
    return;
  }
  // Not ready at once: published for peers' messages until the wait ends
  // (a wait that passes at once publishes nothing).
  op.at(
      which == Counter::Posted        ? Activity::WaitingPosted
          : which == Counter::Reduced ? Activity::WaitingReduced
                                      : Activity::WaitingDone);
  struct Working {
    const OpState& op;
    ~Working() {
      op.at(Activity::Working);
    }
  } working{op};
  const auto start = clock_.now();
  op.deadlineFrom(start);
  if (config_.spin.count() > 0 && spinUntil(clock_, start + config_.spin, ready)) {
    return;
  }
  if (yieldUntilReady(ready)) {
    return;
  }
  sleepUntilReady(op, which, target, ready, laggard);
}

bool Engine::yieldUntilReady(FunctionRef<bool()> ready) {
  if (yieldPause_ > 0) {
    --yieldPause_;
    return false;
  }
  if (config_.yield.count() == 0) {
    return false;
  }
  // When ranks share cores (more ranks than cores, or other processes on
  // them), the rank this one waits for may be waiting for this core: a
  // yield hands it over at once, where a futex sleep costs a wake-up, an
  // order of magnitude more on a small call (docs/results/cpu-performance-2026-11.md, "The
  // engine's constants"). But a process outside the group that wants the core keeps it for a
  // whole time slice (milliseconds) after a yield; a yield that took that long says such a
  // process is here, and yielding pauses for a while.
  const Header& h = segment_.header();
  for (const auto until = clock_.now() + config_.yield;;) {
    const auto before = clock_.now();
    sched_yield();
    const auto after = clock_.now();
    if (ready()) {
      return true;
    }
    if (after - before > kForeignSlice) {
      yieldPause_ = kYieldPauseWaits;
      return false;
    }
    if (after >= until || h.brokenBy.load(std::memory_order_acquire) != 0) {
      return false; // the sleep reports a broken group
    }
  }
}

void Engine::sleepUntilReady(
    OpState& op,
    Counter which,
    uint64_t target,
    FunctionRef<bool()> ready,
    const int& laggard) {
  Header& h = segment_.header();
  // A failure of this rank's own op has already thrown; anything else that
  // broke the group (a peer's failure, or this rank's abort from another
  // thread) ends this wait too.
  auto checkBroken = [&]() {
    if (h.brokenBy.load(std::memory_order_acquire) != 0) {
      failBroken(prefix(op.name) + "this collective cannot complete: " + brokenBy());
    }
  };
  // Announces this rank as a sleeper for as long as it exists, so that an
  // exception thrown while announced does not leave the count raised.
  struct Sleeping {
    std::atomic<uint32_t>& sleepers;
    explicit Sleeping(std::atomic<uint32_t>& s) : sleepers(s) {
      sleepers.fetch_add(1, std::memory_order_seq_cst);
    }
    ~Sleeping() {
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  };
  // A sleep lasts at most a slice: then the peers' liveness is checked.
  constexpr auto kSlice = std::chrono::milliseconds(50);
  while (true) {
    {
      Sleeping sleeping(h.sleepers);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      const uint32_t seq = h.wakeSeq.load(std::memory_order_seq_cst);
      // Re-check after announcing ourselves (wake.pml): a publisher that
      // stored its counter before our announcement is visible now; one that
      // stores it later sees us and bumps the futex word, so the wait below
      // returns at once or is woken.
      if (ready()) {
        return;
      }
      checkBroken(); // markBroken wakes only announced sleepers too
      const auto now = clock_.now();
      const auto deadline = op.deadlineFrom(now);
      if (now >= deadline) {
        // "Timed out", as gloo words it: code that matches gloo's timeout
        // message (PyTorch's own tests do) matches this one.
        fail(
            op,
            "Timed out after " + std::to_string(op.timeout.count()) + " ms waiting for " +
                rankName(laggard) + " (it has not reached step " + std::to_string(target) +
                " of the group; is it stuck, or did it call a different collective?). " +
                whereEveryRankIs(),
            Failure::Timeout);
      }
      futexWait(&h.wakeSeq, seq, std::min<std::chrono::nanoseconds>(kSlice, deadline - now));
    }
    if (ready()) {
      return;
    }
    checkBroken();
    failIfAPeerIsGone(op, which, target);
  }
}

void Engine::failIfAPeerIsGone(const OpState& op, Counter which, uint64_t target) {
  for (int q = 0; q < size_; ++q) {
    if (loadCounter(op, which, q) < target) {
      const int32_t pid = peerPid(q);
      // Read the counter again once the peer is known gone: it may have
      // reached the target and exited in between (it finished its part of
      // the program's last collective and left), and a gone process can
      // no longer move it. Only a peer gone short of the target is lost.
      if (processGone(pid) && loadCounter(op, which, q) < target) {
        fail(op, peerExited(rankName(q), pid) + ". " + whereEveryRankIs());
      }
    }
  }
}

} // namespace hsdp::shm
