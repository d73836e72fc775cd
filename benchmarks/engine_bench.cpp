// The shared-memory engine alone (csrc/shm: no torch, no Python), W processes
// over one segment: how many microseconds one collective costs the engine
// itself, for profiling (perf, callgrind) and for choosing its thresholds.
//
//   bash scripts/engine_bench.sh OP BYTES [RANKS] [ITERS] [key=value ...]
//
// OP: all_gather, all_gather_inplace, reduce_scatter, all_reduce (fp32 SUM),
// broadcast, barrier; BYTES per rank. Keys set EngineConfig fields:
// spin_us, yield_us, one_shot_bytes, direct_read_bytes, pooled_read_bytes,
// direct_all_reduce_bytes, stream_store_bytes, stream_slot_bytes,
// stream_slot_timed_bytes, slot_bytes (defaults: hsdp::Config's, the
// package's only copy of them, for a group of RANKS on this machine; without
// direct_read_bytes the ranks measure it as a group does, and rank 0 prints
// the timings and the threshold chosen); two
// keys shape the caller: page_offset (where every buffer starts in its page;
// default 0: torch's tensors start at multiples of 64 bytes, and the direct
// all-reduce is a third slower there than 16 bytes into a line) and gap_us
// (the caller's own work between calls, busy; torch.distributed's path costs
// about 4 us), and pool (1: every buffer comes from the engine's pool, as
// allocate_tensor hands them out, so calls take the pooled path; default
// 0: ordinary memory). Prints rank 0's median (and range) of 9 timed loops of ITERS
// calls, each loop after a barrier.

#include "common/Config.hpp"
#include "shm/Crossover.hpp"
#include "shm/Engine.hpp"
#include "shm/Pool.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

using namespace hsdp::shm;

namespace {

struct Args {
  std::string op;
  size_t bytes = 0;
  int ranks = 2;
  int iters = 1000;
  std::map<std::string, size_t> keys;
};

size_t key(const Args& a, const std::string& name, size_t fallback) {
  const auto it = a.keys.find(name);
  return it == a.keys.end() ? fallback : it->second;
}

void runRank(const Args& a, const std::string& name, size_t slotBytes, int r) {
  EngineConfig c = engineConfigFor(hsdp::Config(), a.ranks, std::chrono::seconds(60));
  auto micros = [&](const char* name, std::chrono::nanoseconds& field) {
    if (a.keys.count(name) != 0) {
      field = std::chrono::microseconds(a.keys.at(name));
    }
  };
  micros("spin_us", c.spin);
  micros("yield_us", c.yield);
  c.oneShotBytes = key(a, "one_shot_bytes", c.oneShotBytes);
  c.directReadBytes = key(a, "direct_read_bytes", c.directReadBytes);
  c.pooledReadBytes = key(a, "pooled_read_bytes", c.pooledReadBytes);
  c.directAllReduceBytes = key(a, "direct_all_reduce_bytes", c.directAllReduceBytes);
  c.streamStoreBytes = key(a, "stream_store_bytes", c.streamStoreBytes);
  c.streamSlotBytes = key(a, "stream_slot_bytes", c.streamSlotBytes);
  c.streamSlotTimedBytes = key(a, "stream_slot_timed_bytes", c.streamSlotTimedBytes);
  Engine e(Segment::open(name, a.ranks, slotBytes), r, c);
  e.barrier("start");
  e.enableDirectReads(); // every rank of one machine may read every other (same user)
  if (a.keys.count("direct_read_bytes") == 0 && c.measureDirectReadBytes) {
    std::vector<ReadSample> samples;
    const size_t from = agreeDirectReadBytes(e, std::nullopt, [&] {
      samples = timeDirectReads(e);
      return samples;
    });
    e.setDirectReadBytes(from);
    if (r == 0) {
      for (const ReadSample& s : samples) {
        std::printf(
            "direct-read probe %zu B: direct %.2f us, slots %.2f us\n",
            s.bytes,
            s.direct.count() / 1e3,
            s.slots.count() / 1e3);
      }
      std::printf("direct reads from %zu B (0: never)\n", from);
    }
  }
  const size_t n = a.bytes;
  // Every buffer starts `page_offset` bytes into a page: the cost of some
  // paths depends on it, and torch's tensors start at multiples of 64.
  const size_t pageOffset = key(a, "page_offset", 0);
  std::shared_ptr<Pool> pool;
  if (key(a, "pool", 0) != 0) {
    pool = std::make_shared<Pool>(size_t{1} << 36, size_t{64} << 20);
    e.setPool(pool);
  }
  auto buffer = [&](std::vector<char>& store, size_t bytes) {
    char* base = nullptr;
    if (pool) {
      base = static_cast<char*>(pool->allocate(bytes + 2 * 4096));
      std::memset(base, 0, bytes + 2 * 4096);
    } else {
      store.assign(bytes + 2 * 4096, 0);
      base = store.data();
    }
    return reinterpret_cast<char*>(
        (reinterpret_cast<uintptr_t>(base) + 4095) / 4096 * 4096 + pageOffset % 4096);
  };
  std::vector<char> outStore, inStore, dataStore;
  char* out = buffer(outStore, n * a.ranks);
  char* in = buffer(inStore, n * a.ranks);
  auto* data = reinterpret_cast<float*>(buffer(dataStore, n));
  std::fill(out, out + n * a.ranks, 1);
  std::fill(in, in + n * a.ranks, 2);
  std::fill(data, data + n / sizeof(float), 1.f);
  const auto gap = std::chrono::microseconds(key(a, "gap_us", 0));
  const auto call = [&] {
    for (const auto until = std::chrono::steady_clock::now() + gap;
         std::chrono::steady_clock::now() < until;) {
    }
    if (a.op == "all_gather") {
      e.allGather("all_gather", in, out, n);
    } else if (a.op == "all_gather_inplace") {
      e.allGather("all_gather", out + r * n, out, n);
    } else if (a.op == "reduce_scatter") {
      e.reduceScatter(
          "reduce_scatter", in, out, n / sizeof(float), DType::F32, RedOp::Sum, {});
    } else if (a.op == "all_reduce") {
      e.allReduce("all_reduce", data, n / sizeof(float), DType::F32, RedOp::Sum, {});
    } else if (a.op == "broadcast") {
      e.broadcast("broadcast", out, n, 0);
    } else if (a.op == "barrier") {
      e.barrier("barrier");
    } else {
      throw std::invalid_argument("unknown op " + a.op);
    }
  };
  for (int i = 0; i < 20; ++i) {
    call();
  }
  std::vector<double> us;
  for (int rep = 0; rep < 9; ++rep) {
    e.barrier("loop");
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < a.iters; ++i) {
      call();
    }
    const std::chrono::duration<double, std::micro> dt = std::chrono::steady_clock::now() - t0;
    us.push_back(dt.count() / a.iters);
  }
  std::sort(us.begin(), us.end());
  if (pool && e.pooledCalls() == 0) {
    throw std::runtime_error("pool=1 but no call took the pooled path");
  }
  if (r == 0) {
    std::printf(
        "%s %zu B x %d ranks: median %.2f us per call (%.2f-%.2f over 9 loops of %d)\n",
        a.op.c_str(),
        n,
        a.ranks,
        us[4],
        us[0],
        us[8],
        a.iters);
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: engine_bench OP BYTES [RANKS] [ITERS] [key=value ...]\n");
    return 2;
  }
  Args a;
  a.op = argv[1];
  a.bytes = std::stoul(argv[2]);
  int positional = 0;
  for (int i = 3; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    if (eq != std::string::npos) {
      a.keys[arg.substr(0, eq)] = std::stoul(arg.substr(eq + 1));
    } else if (positional++ == 0) {
      a.ranks = std::stoi(arg);
    } else {
      a.iters = std::stoi(arg);
    }
  }
  const size_t slotBytes = key(a, "slot_bytes", hsdp::Config().slotBytes);
  const std::string name = Segment::randomName();
  // Created (zeroed, laid out) by the parent, mapped by each rank; the
  // parent unlinks the name once every rank has exited.
  { Segment::create(name, a.ranks, slotBytes); }
  std::vector<pid_t> ranks;
  for (int r = 0; r < a.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      int rc = 0;
      try {
        runRank(a, name, slotBytes, r);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "rank %d: %s\n", r, ex.what());
        rc = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(rc); // no atexit handlers of the parent's in a forked child
    }
    ranks.push_back(pid);
  }
  int failed = 0;
  for (const pid_t pid : ranks) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  Segment::unlink(name);
  return failed == 0 ? 0 : 1;
}
