#include "backend/membership/ShmRendezvous.hpp"

#include "backend/membership/SplitInner.hpp"
#include "common/Errors.hpp"
#include "shm/Crossover.hpp"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>

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
  // Keys of a part of the group (one host's ranks), within this incarnation.
  Keys under(const std::string& part) const {
    return Keys(prefix_ + part + "/");
  }
  const std::string& prefix() const {
    return prefix_;
  }

 private:
  explicit Keys(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string prefix_;
};

// The settings that change what a collective does on the wire must be the
// same on every rank: every rank takes rank 0's.
void adoptRankZeroSettings(c10d::Store& store, const Keys& key, int rank, ShmOptions& options) {
  if (rank == 0) {
    std::ostringstream out;
    const shm::EngineConfig& e = options.engine;
    out << e.oneShotBytes << " " << e.directReadBytes << " " << e.measureDirectReadBytes << " "
        << e.pooledReadBytes << " " << e.directAllReduceBytes;
    store.set(key("settings"), out.str());
    return;
  }
  std::istringstream in(store.get_to_str(key("settings")));
  shm::EngineConfig& e = options.engine;
  in >> e.oneShotBytes >> e.directReadBytes >> e.measureDirectReadBytes >> e.pooledReadBytes >>
      e.directAllReduceBytes;
}

// The direct-read threshold the first group of each shape (ranks per host,
// slot size: what the measurement depends on) measured in this process,
// for its later groups of that shape: mostly the CPU's, and measuring every
// group would cost each one about a millisecond, more with more ranks. A
// group's host takes its first rank's: another process may hold another
// value, and each group is still consistent.
class MeasuredCrossovers {
 public:
  using Shape = std::pair<int, size_t>;
  std::optional<size_t> find(Shape shape) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = bytes_.find(shape);
    return it == bytes_.end() ? std::nullopt : std::optional<size_t>(it->second);
  }
  void keep(Shape shape, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_.emplace(shape, bytes);
  }

 private:
  std::mutex mutex_;
  std::map<Shape, size_t> bytes_;
};

// Sets the engine's direct-read threshold to the one its host's ranks
// agree on (shm/Crossover.hpp). Every rank of the host calls it alike.
void adoptMeasuredCrossover(shm::Engine& engine) {
  static MeasuredCrossovers measured;
  const MeasuredCrossovers::Shape shape{engine.size(), engine.slotBytes()};
  const size_t bytes = shm::agreeDirectReadBytes(
      engine, measured.find(shape), [&] { return shm::timeDirectReads(engine); });
  engine.setDirectReadBytes(bytes);
  measured.keep(shape, bytes);
}

// Whether every rank may read every other rank's memory with
// process_vm_readv (ptrace rights: same user, no Yama restriction or
// seccomp filter in the way): empty if so, else why not, from the first rank
// (in rank order) that could not, named as the group numbers it
// (`groupRanks[q]`: local rank q's). Every rank probes every peer; all ranks
// decide alike from the same keys.
std::string probeDirectReads(
    c10d::Store& store,
    const Keys& key,
    int rank,
    const std::vector<int>& groupRanks) {
  static const uint64_t probe = 0x70726f6265ull; // read by peers, never written
  const int size = static_cast<int>(groupRanks.size());
  store.set(
      key("probe", rank),
      std::to_string(getpid()) + ":" + std::to_string(reinterpret_cast<uint64_t>(&probe)));
  std::string why;
  for (int q = 0; q < size && why.empty(); ++q) {
    if (q == rank) {
      continue;
    }
    const std::string where = store.get_to_str(key("probe", q));
    const auto colon = where.find(':');
    uint64_t got = 0;
    why = colon == std::string::npos ? "a malformed probe key"
                                     : shm::whyCannotReadProcess(
                                           std::stoi(where.substr(0, colon)),
                                           std::stoull(where.substr(colon + 1)),
                                           &got,
                                           sizeof got);
    if (why.empty() && got != probe) {
      why = "read a value the peer never wrote";
    }
    if (!why.empty()) {
      why = "rank " + std::to_string(groupRanks[rank]) + " cannot read the memory of rank " +
          std::to_string(groupRanks[q]) + " (" + why + ")";
    }
  }
  store.set(key("direct", rank), why.empty() ? "1" : "0" + why);
  std::string first;
  for (int q = 0; q < size; ++q) {
    const std::string said = store.get_to_str(key("direct", q));
    if (first.empty() && said != "1") {
      first = said.size() > 1
          ? said.substr(1)
          : "rank " + std::to_string(groupRanks[q]) + " cannot read a peer's memory";
    }
  }
  return first;
}

// Hosts in the order their first rank appears, each host's ranks in rank
// order; `identities` are the ranks' host identities.
struct Hosts {
  std::vector<std::string> names; // hostnames, for messages
  std::vector<std::vector<int>> members;

  explicit Hosts(const std::vector<std::string>& identities) {
    std::vector<std::string> seen;
    for (int q = 0; q < static_cast<int>(identities.size()); ++q) {
      const auto at = std::find(seen.begin(), seen.end(), identities[q]);
      if (at == seen.end()) {
        seen.push_back(identities[q]);
        names.push_back(identities[q].substr(0, identities[q].find('|')));
        members.push_back({q});
      } else {
        members[at - seen.begin()].push_back(q);
      }
    }
  }
  bool even() const {
    for (const auto& m : members) {
      if (m.size() != members[0].size()) {
        return false;
      }
    }
    return true;
  }
  std::string describe() const {
    std::string out;
    for (size_t h = 0; h < members.size(); ++h) {
      out += h ? "; ranks " : "ranks ";
      for (size_t i = 0; i < members[h].size(); ++i) {
        out += (i ? "," : "") + std::to_string(members[h][i]);
      }
      out += " on host " + names[h];
    }
    return out;
  }
  HostLayout layout(int rank) const {
    HostLayout l;
    l.hosts = static_cast<int>(members.size());
    l.perHost = static_cast<int>(members[0].size());
    for (int h = 0; h < l.hosts; ++h) {
      for (int i = 0; i < l.perHost; ++i) {
        l.ranks.push_back(members[h][i]);
        if (members[h][i] == rank) {
          l.host = h;
          l.local = i;
        }
      }
    }
    return l;
  }
};

// Rank `local` of `size` ranks (one host's) creates or maps a segment over
// `key`'s part of the store. Returns the error, or "" with `segment` set.
std::string mapSegment(
    c10d::Store& store,
    const Keys& key,
    int local,
    int size,
    size_t slotBytes,
    std::optional<shm::Segment>& segment,
    std::string& name) {
  std::string error;
  // The host's first rank creates and names the segment; "!" + error when
  // it could not.
  if (local == 0) {
    try {
      name = shm::Segment::randomName();
      segment.emplace(shm::Segment::create(name, size, slotBytes));
      store.set(key("name"), name);
    } catch (const std::exception& e) {
      error = e.what();
      store.set(key("name"), "!" + error);
    }
  } else {
    name = store.get_to_str(key("name"));
    if (!name.empty() && name[0] == '!') {
      error = "the host's first rank could not create the segment: " + name.substr(1);
    } else {
      try {
        segment.emplace(shm::Segment::open(name, size, slotBytes));
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
  return error;
}

// Every rank's host identity, through the store ("?": a rank that could
// not read its own, never equal to a real one).
std::vector<std::string>
hostIdentities(c10d::Store& store, const Keys& key, int rank, int size, const ShmOptions& options) {
  const std::string me = options.hostIdentity.value_or(shm::hostIdentity());
  store.set(key("host", rank), me.empty() ? "?" : me);
  std::vector<std::string> identities;
  for (int q = 0; q < size; ++q) {
    identities.push_back(store.get_to_str(key("host", q)));
  }
  return identities;
}

// The first rank's failure to map its host's segment (`error`: this
// rank's, empty if none), or empty: every rank of the group gets the same
// answer, so all fall back to gloo together if any host failed.
std::string
firstFailure(c10d::Store& store, const Keys& key, int rank, int size, const std::string& error) {
  store.set(key("ok", rank), error.empty() ? "1" : "0" + error);
  std::string first;
  for (int q = 0; q < size; ++q) { // every rank's answer: none leaves before all have mapped
    const std::string ok = store.get_to_str(key("ok", q));
    if (ok != "1" && first.empty()) {
      first = "rank " + std::to_string(q) + ": " + ok.substr(1);
    }
  }
  return first;
}

// Why shared memory cannot serve a group across these hosts (within each,
// Gloo between them), or empty if it can or the group is on one host.
// HSDP_CPU_ROUTE=shm across hosts is refused: it cannot reach across them.
std::string whyNotAcrossHosts(
    const Hosts& hosts,
    const ShmOptions& options,
    c10d::Backend& cpuInner,
    const OpContext& c) {
  if (hosts.members.size() <= 1) {
    return {};
  }
  TORCH_CHECK(
      options.mode != ShmOptions::Mode::Required,
      c.prefix(),
      "HSDP_CPU_ROUTE=shm, but the group spans ",
      hosts.members.size(),
      " hosts (",
      hosts.describe(),
      ") and shared memory cannot reach across hosts; HSDP_CPU_ROUTE=auto uses it within each "
      "host and gloo between hosts");
  if (!hosts.even()) {
    return "its hosts hold different numbers of its ranks (" + hosts.describe() +
        "); shared memory within hosts needs the same number on every host";
  }
  if (!cpuInner.supportsSplitting()) {
    return "the inner CPU backend cannot be split into inter-host groups";
  }
  return {};
}

// The ranks with my local index, one per host, as a group of the inner
// Gloo's: its split builds a new context among them (only they take part).
Column columnOf(
    c10d::Store& store,
    const Keys& key,
    const HostLayout& layout,
    c10d::Backend& cpuInner,
    std::chrono::milliseconds timeout,
    const OpContext& c) {
  auto group = splitWithOwnOptions(
      cpuInner,
      c10::make_intrusive<c10d::PrefixStore>(
          key.prefix() + "column" + std::to_string(layout.local) + "/",
          c10::intrusive_ptr<c10d::Store>::unsafe_reclaim_from_nonowning(&store)),
      layout.columnRanks(layout.local),
      timeout);
  TORCH_CHECK(group, c.prefix(), "the inner CPU backend returned no inter-host group");
  return Column{std::move(group), timeout};
}

} // namespace

std::unique_ptr<ShmRoute> connectShm(
    c10d::Store& store,
    int rank,
    int size,
    ShmOptions options,
    c10d::Backend& cpuInner,
    std::chrono::milliseconds timeout,
    CommStats& stats,
    std::shared_ptr<StagingPool> staging,
    std::string* whyNot) {
  if (options.mode == ShmOptions::Mode::Off) {
    *whyNot = "disabled by HSDP_CPU_ROUTE=gloo";
    return nullptr;
  }
  auto give_up = [&](const std::string& why) -> std::unique_ptr<ShmRoute> {
    TORCH_CHECK(
        options.mode != ShmOptions::Mode::Required,
        OpContext{rank, size, "init"}.prefix(),
        "HSDP_CPU_ROUTE=shm, but the group cannot use shared memory: ",
        why);
    *whyNot = why;
    return nullptr;
  };
  const Keys key(store, size);

  const auto identities = hostIdentities(store, key, rank, size, options);
  for (int q = 0; q < size; ++q) {
    if (identities[q] == "?") {
      return give_up(
          "rank " + std::to_string(q) +
          " could not read its host identity (hostname, boot id, namespaces), so "
          "no rank may assume it shares memory with it");
    }
  }
  const Hosts hosts(identities);
  if (const auto why = whyNotAcrossHosts(hosts, options, cpuInner, OpContext{rank, size, "init"});
      !why.empty()) {
    return give_up(why);
  }
  const HostLayout layout = hosts.layout(rank);
  adoptRankZeroSettings(store, key, rank, options);

  const Keys hostKey = key.under("host" + std::to_string(layout.host));
  std::optional<shm::Segment> segment;
  std::string name;
  const std::string error =
      mapSegment(store, hostKey, layout.local, layout.perHost, options.slotBytes, segment, name);
  if (const auto firstError = firstFailure(store, key, rank, size, error); !firstError.empty()) {
    if (layout.local == 0 && segment) {
      shm::Segment::unlink(name); // not every rank of the host mapped it
    }
    return give_up(firstError);
  }
  shm::EngineConfig config = options.engine;
  std::optional<Column> column;
  if (layout.hosts > 1) {
    config.groupRanks = layout.hostRanks(layout.host);
    config.groupSize = size;
    column = columnOf(store, key, layout, cpuInner, timeout, OpContext{rank, size, "init"});
  }
  auto engine = std::make_unique<shm::Engine>(std::move(*segment), layout.local, config);
  if (options.engine.wantsDirectReads()) {
    if (std::string why =
            probeDirectReads(store, hostKey, layout.local, layout.hostRanks(layout.host));
        !why.empty()) {
      engine->refuseDirectReads(std::move(why));
    } else {
      engine->enableDirectReads();
      if (config.measureDirectReadBytes && layout.perHost > 1) {
        adoptMeasuredCrossover(*engine);
      }
    }
  }
  return std::make_unique<ShmRoute>(
      std::move(engine), layout, std::move(column), rank, size, stats, std::move(staging));
}

} // namespace hsdp
