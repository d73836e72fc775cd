#include "backend/ShmRendezvous.hpp"

#include <c10/util/Exception.h>

namespace hsdp {

namespace {

const std::string kPrefix = "hsdp/shm/";

std::string rankKey(const char* what, int rank) {
  return kPrefix + what + "/" + std::to_string(rank);
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
  return std::make_unique<shm::Engine>(std::move(*segment), rank, options.engine);
}

} // namespace hsdp
