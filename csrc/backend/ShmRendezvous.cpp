#include "backend/ShmRendezvous.hpp"

#include <c10/util/Exception.h>

#include <unistd.h>

namespace hsdp {

namespace {

const std::string kPrefix = "hsdp/shm/";

std::string rankKey(const char* what, int rank) {
  return kPrefix + what + "/" + std::to_string(rank);
}

// Whether every rank may read rank 0's memory with process_vm_readv (it
// needs ptrace rights over the peer: same user, and no Yama restriction or
// seccomp filter in the way). All ranks decide alike from the same keys.
bool probeDirectReads(c10d::Store& store, int rank, int size) {
  static const uint64_t probe = 0x70726f6265ull; // read by peers, never written
  if (rank == 0) {
    store.set(kPrefix + "probe",
              std::to_string(getpid()) + ":" + std::to_string(reinterpret_cast<uint64_t>(&probe)));
  } else {
    const std::string where = store.get_to_str(kPrefix + "probe");
    const auto colon = where.find(':');
    uint64_t got = 0;
    const bool ok = colon != std::string::npos &&
        shm::canReadProcess(std::stoi(where.substr(0, colon)),
                            std::stoull(where.substr(colon + 1)), &got, sizeof got) &&
        got == probe;
    store.set(rankKey("direct", rank), ok ? "1" : "0");
  }
  for (int q = 1; q < size; ++q) {
    if (store.get_to_str(rankKey("direct", q)) != "1") {
      return false;
    }
  }
  return true;
}

} // namespace

std::unique_ptr<shm::Engine> connectShm(
    c10d::Store& store,
    int rank,
    int size,
    const ShmOptions& options,
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

  const std::string me = shm::hostIdentity();
  store.set(rankKey("host", rank), me);
  for (int q = 0; q < size; ++q) {
    if (store.get_to_str(rankKey("host", q)) != me) {
      return give_up("rank " + std::to_string(q) + " runs on another host or namespace");
    }
  }

  // Rank 0 creates and names the segment; "!" + error when it could not.
  std::optional<shm::Segment> segment;
  std::string error;
  std::string name;
  if (rank == 0) {
    try {
      name = shm::Segment::randomName();
      segment.emplace(shm::Segment::create(name, size, options.slotBytes));
      store.set(kPrefix + "name", name);
    } catch (const std::exception& e) {
      error = e.what();
      store.set(kPrefix + "name", "!" + error);
    }
  } else {
    name = store.get_to_str(kPrefix + "name");
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
  if (segment && store.add(kPrefix + "mapped", 1) == size) {
    shm::Segment::unlink(name);
  }
  store.set(rankKey("ok", rank), error.empty() ? "1" : "0" + error);
  std::string firstError;
  for (int q = 0; q < size; ++q) {
    const std::string ok = store.get_to_str(rankKey("ok", q));
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
  if (options.engine.directReadBytes > 0 && probeDirectReads(store, rank, size)) {
    engine->enableDirectReads();
  }
  return engine;
}

} // namespace hsdp
