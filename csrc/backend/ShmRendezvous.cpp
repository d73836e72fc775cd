#include "backend/ShmRendezvous.hpp"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <sstream>

namespace hsdp {

namespace {

// Keys live under a per-incarnation prefix: a store that outlives a group
// (destroy and re-create on the same store) never serves stale answers.
class Keys {
 public:
  Keys(c10d::Store& store, int size) {
    const int64_t ticket = store.add("hsdp/shm/incarnations", 1); // 1-based
    prefix_ = "hsdp/shm/" + std::to_string((ticket - 1) / size) + "/";
  }
  std::string operator()(const char* what) const {
    return prefix_ + what;
  }
  std::string operator()(const char* what, int rank) const {
    return prefix_ + what + "/" + std::to_string(rank);
  }

 private:
  std::string prefix_;
};

// The settings that change what a collective does on the wire must be the
// same on every rank: every rank takes rank 0's.
void adoptRankZeroSettings(c10d::Store& store, const Keys& key, int rank, ShmOptions& options) {
  if (rank == 0) {
    std::ostringstream out;
    out << options.engine.oneShotBytes << " " << options.engine.directReadBytes;
    store.set(key("settings"), out.str());
    return;
  }
  std::istringstream in(store.get_to_str(key("settings")));
  in >> options.engine.oneShotBytes >> options.engine.directReadBytes;
}

// Whether every rank may read every other rank's memory with
// process_vm_readv (ptrace rights: same user, no Yama restriction or
// seccomp filter in the way). Every rank probes every peer; all ranks
// decide alike from the same keys.
bool probeDirectReads(c10d::Store& store, const Keys& key, int rank, int size) {
  static const uint64_t probe = 0x70726f6265ull; // read by peers, never written
  store.set(key("probe", rank),
            std::to_string(getpid()) + ":" + std::to_string(reinterpret_cast<uint64_t>(&probe)));
  bool ok = true;
  for (int q = 0; q < size && ok; ++q) {
    if (q == rank) {
      continue;
    }
    const std::string where = store.get_to_str(key("probe", q));
    const auto colon = where.find(':');
    uint64_t got = 0;
    ok = colon != std::string::npos &&
        shm::canReadProcess(std::stoi(where.substr(0, colon)), std::stoull(where.substr(colon + 1)),
                            &got, sizeof got) &&
        got == probe;
  }
  store.set(key("direct", rank), ok ? "1" : "0");
  bool all = true;
  for (int q = 0; q < size; ++q) {
    all = store.get_to_str(key("direct", q)) == "1" && all;
  }
  return all;
}

} // namespace

std::unique_ptr<shm::Engine> connectShm(
    c10d::Store& store,
    int rank,
    int size,
    ShmOptions options,
    std::string* whyNot) {
  if (options.mode == ShmOptions::Mode::Off) {
    *whyNot = "disabled by HSDP_ENGINE=gloo";
    return nullptr;
  }
  auto give_up = [&](const std::string& why) -> std::unique_ptr<shm::Engine> {
    TORCH_CHECK(
        options.mode != ShmOptions::Mode::Required,
        "[rank ", rank, "/", size, "] init: HSDP_ENGINE=shm, but the group cannot use shared memory: ",
        why);
    *whyNot = why;
    return nullptr;
  };
  const Keys key(store, size);

  const std::string me = shm::hostIdentity();
  store.set(key("host", rank), me);
  for (int q = 0; q < size; ++q) {
    if (store.get_to_str(key("host", q)) != me) {
      return give_up("rank " + std::to_string(q) + " runs on another host or namespace");
    }
  }
  adoptRankZeroSettings(store, key, rank, options);

  // Rank 0 creates and names the segment; "!" + error when it could not.
  std::optional<shm::Segment> segment;
  std::string error;
  std::string name;
  if (rank == 0) {
    try {
      name = shm::Segment::randomName();
      segment.emplace(shm::Segment::create(name, size, options.slotBytes));
      store.set(key("name"), name);
    } catch (const std::exception& e) {
      error = e.what();
      store.set(key("name"), "!" + error);
    }
  } else {
    name = store.get_to_str(key("name"));
    if (!name.empty() && name[0] == '!') {
      error = "rank 0 could not create the segment: " + name.substr(1);
    } else {
      try {
        segment.emplace(shm::Segment::open(name, size, options.slotBytes));
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
  }
  // The last rank to map the segment removes its name: from then on it
  // exists only as long as some rank maps it, and no exit, crash or kill
  // can leave it behind in /dev/shm.
  if (segment && store.add(key("mapped"), 1) == size) {
    shm::Segment::unlink(name);
  }
  store.set(key("ok", rank), error.empty() ? "1" : "0" + error);
  std::string firstError;
  for (int q = 0; q < size; ++q) {
    const std::string ok = store.get_to_str(key("ok", q));
    if (ok != "1" && firstError.empty()) {
      firstError = "rank " + std::to_string(q) + ": " + ok.substr(1);
    }
  }
  if (!firstError.empty()) {
    if (rank == 0 && segment) {
      shm::Segment::unlink(name); // not every rank mapped it
    }
    return give_up(firstError);
  }
  auto engine = std::make_unique<shm::Engine>(std::move(*segment), rank, options.engine);
  if (options.engine.directReadBytes > 0 && probeDirectReads(store, key, rank, size)) {
    engine->enableDirectReads();
  }
  return engine;
}

} // namespace hsdp
