#include "backend/ProcessGroupHSDP.hpp"

// The group's overrides that change who its members are, apart from its
// collectives (as torch's ProcessGroupGlooReconfigure.cpp keeps Gloo's):
// the shared-memory route of the current members, split and shrink (a child
// group of some of them), reconfigure (new members for this group). The
// state they keep between calls is the group's Membership.

#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <optional>
#include <string_view>
#include <unordered_set>
#include <variant>

#include "backend/Checks.hpp"
#include "backend/WorkHSDP.hpp"
#include "backend/membership/SplitInner.hpp"

namespace hsdp {

using c10d::OpType;

namespace {

ShmOptions shmOptionsOf(
    const Config& config,
    int size,
    std::chrono::milliseconds groupTimeout,
    const std::optional<std::string>& hostIdentity) {
  ShmOptions shm;
  switch (config.cpuRoute) {
    case Config::CpuRoute::Auto:
      shm.mode = ShmOptions::Mode::Auto;
      break;
    case Config::CpuRoute::Shm:
      shm.mode = ShmOptions::Mode::Required;
      break;
    case Config::CpuRoute::Gloo:
      shm.mode = ShmOptions::Mode::Off;
      break;
  }
  shm.slotBytes = static_cast<size_t>(config.slotBytes);
  shm.engine = shm::engineConfigFor(config, size, groupTimeout);
  shm.hostIdentity = hostIdentity;
  return shm;
}

// The ranks of 0..size-1 not in `exclude`, `rank` among them: what a shrink
// leaves, each excluded rank checked first.
std::vector<int>
ranksThatStay(const OpContext& c, const std::vector<int64_t>& exclude, int size, int rank) {
  std::vector<int> stay;
  for (int r = 0; r < size; ++r) {
    if (std::find(exclude.begin(), exclude.end(), r) == exclude.end()) {
      stay.push_back(r);
    }
  }
  for (size_t i = 0; i < exclude.size(); ++i) {
    const int64_t r = exclude[i];
    HSDP_CHECK_VALUE(r >= 0 && r < size, c, "rank ", r, " to exclude is not in 0..", size - 1);
    // NCCL's shrink counts a rank given twice twice in its child's size.
    HSDP_CHECK_VALUE(
        std::find(exclude.begin(), exclude.begin() + i, r) == exclude.begin() + i,
        c,
        "rank ",
        r,
        " to exclude is given twice");
  }
  HSDP_CHECK_VALUE(!stay.empty(), c, "every rank would be excluded");
  HSDP_CHECK_VALUE(
      std::find(stay.begin(), stay.end(), rank) != stay.end(),
      c,
      "this rank is among the ranks to exclude: only the ranks that stay shrink a group");
  return stay;
}

} // namespace

void ProcessGroupHSDP::attachShm(c10d::Store& store) {
  auto shm = connectShm(
      store,
      rank_,
      size_,
      shmOptionsOf(membership_.config, size_, options_->timeout, membership_.hostIdentity),
      cpu_->backend(),
      options_->timeout, // the columns' op timeout too: the group's, not a reconfigure's
      stats_,
      staging_,
      &shmWhyNot_);
  if (shm) {
    shm->usePool(
        static_cast<size_t>(membership_.config.poolBytes),
        static_cast<size_t>(membership_.config.poolChunkBytes));
    shm->recordInto(trace_);
    shm->setTimeoutExtension(timeoutExtension_->activeMs());
    // Last: a constructor that throws leaves no snapshot of a destroyed engine.
    trace_->setSnapshot([engine = shm.get()] { return engine->whereEveryRankIs(); });
  }
  shm_ = std::move(shm); // only a route that is whole serves
}

void ProcessGroupHSDP::detachShm(const char* why) {
  trace_->setSnapshot(nullptr); // before the engine its snapshot reads is gone
  if (shm_) {
    shm_->leave(why);
    shm_.reset();
  }
}

bool ProcessGroupHSDP::supportsSplitting() const {
  return cpu_->backend().supportsSplitting() && (!cuda_ || cuda_->backend().supportsSplitting());
}

bool ProcessGroupHSDP::supportsShrinking() const {
  // NCCL shrinks its communicator among the ranks that stay; a split of it
  // would need the excluded ranks too. Gloo's split needs only the members.
  const auto& cpu = cpu_->backend();
  return (cpu.supportsShrinking() || cpu.supportsSplitting()) &&
      (!cuda_ || cuda_->backend().supportsShrinking());
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupHSDP::shrink(
    const std::vector<int64_t>& ranksToExclude,
    int shrinkFlags,
    const c10::intrusive_ptr<Options>& optsOverride) {
  const auto c = ctx("shrink_group");
  checkUsable(c);
  HSDP_CHECK(
      supportsShrinking(),
      c,
      "its inner ",
      cuda_ && !cuda_->backend().supportsShrinking() ? cuda_->name() : cpu_->name(),
      " backend can neither shrink nor split (NCCL shrinks from 2.27)");
  const std::vector<int> stay = ranksThatStay(c, ranksToExclude, size_, rank_);
  for (InnerRoute* route : {cuda_.get(), cpu_.get()}) {
    // ncclCommShrink shrinks a communicator that exists; NCCL makes it at the
    // first collective (or an eager connect: connected() counts both), and
    // the excluded ranks cannot take part in one now.
    HSDP_CHECK(
        !route || !route->backend().supportsShrinking() || route->connected(),
        c,
        "the group's inner ",
        route ? route->name() : "",
        " backend has no communicator yet (it makes one at its first collective): run a "
        "collective on the group before a rank is lost, or create it with device_id=");
  }
  constexpr int kShrinkAbort = 0x01; // torch.distributed.SHRINK_ABORT, NCCL_SHRINK_ABORT
  if (shrinkFlags & kShrinkAbort) {
    // NCCL aborts this group's communicator too: the group is done.
    ended_.store("aborted by shrink_group with SHRINK_ABORT", std::memory_order_release);
    if (shm_) {
      shm_->abort("shrank its process group with SHRINK_ABORT");
    }
  }
  // Keys of this shrink only: its number and who stays, alike on every rank that stays.
  std::string prefix = "hsdp/shrink/" + std::to_string(++membership_.shrinks) + "/";
  for (int r : stay) {
    prefix += std::to_string(r) + ",";
  }
  const auto timeout = optsOverride ? optsOverride->timeout : options_->timeout;
  const StorePtr store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/", membership_.store);
  return childOf(store, stay, timeout, [&](InnerRoute& route, const StorePtr& prefixed) {
    auto& inner = route.backend();
    if (inner.supportsShrinking()) {
      // NCCL's own (ncclCommShrink), SHRINK_ABORT included: it ends what is
      // pending on its communicator. Its child takes the parent's timeout.
      auto child = inner.shrink(ranksToExclude, shrinkFlags, nullptr);
      if (child) {
        child->setTimeout(timeout);
      }
      return child;
    }
    return splitWithOwnOptions(
        inner,
        prefixed,
        stay,
        timeout,
        optsOverride ? &optsOverride->group_name : nullptr,
        optsOverride ? &optsOverride->group_desc : nullptr);
  });
}

#if HSDP_TORCH_HAS_IS_INITIALIZED
bool ProcessGroupHSDP::isInitialized() {
  return compat::isInitialized(cpu_->backend());
}
#endif

c10::intrusive_ptr<c10d::Backend> ProcessGroupHSDP::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  const auto c = ctx("split_group");
  HSDP_CHECK(supportsSplitting(), c, "an inner backend of this group cannot be split");
  for (int r : ranks) {
    checkRank(c, r, "member");
  }
  // A split is collective over the parent's communicator, which NCCL builds
  // at its first collective: without one, NCCL's split would dereference
  // nothing on the ranks that take no part. Gloo's exists from creation.
  HSDP_CHECK(
      compat::isInitialized(cpu_->backend()),
      c,
      "the group's inner ",
      cpu_->backend().getBackendName(),
      " backend has no communicator yet");
  if (cuda_ && !cuda_->connected()) {
    // ProcessGroupNCCL's isInitialized() also counts the communicators of
    // its point-to-point pairs, so hsdp asks its own count of collectives
    // (InnerRoute::connected) and, where the group has none yet (only sends
    // ran on it, or it is bound to the CPU on a machine with GPUs), makes
    // the communicator first, as a barrier would: the ranks agree over the
    // CPU, then every one connects on the device its barrier would use.
    auto call = begin(
        "split_group",
        OpType::UNKNOWN,
        /*asyncOp=*/false,
        opts ? opts->timeout : options_->timeout);
    agreeOnCuda(call, barrierDevice(c10d::BarrierOptions{}), /*required=*/true);
  }
  const auto timeout = opts ? opts->timeout : options_->timeout;
#if !HSDP_TORCH_SPLITS_ONCE_PER_BACKEND
  const std::string groupName = opts ? opts->group_name : std::string();
  if (membership_.lastSplit && membership_.lastSplit->groupName == groupName &&
      membership_.lastSplit->ranks == ranks) {
    if (membership_.lastSplit->none) {
      membership_.lastSplit.reset();
      return nullptr;
    }
    auto child = membership_.lastSplit->child.lock();
    membership_.lastSplit.reset();
    if (child) {
      return child;
    }
  }
  auto remember = [&](const c10::intrusive_ptr<c10d::Backend>& child) {
    membership_.lastSplit = Membership::LastSplit{
        groupName, ranks, c10::weak_intrusive_ptr<c10d::Backend>(child), !child};
    return child;
  };
#else
  auto remember = [](c10::intrusive_ptr<c10d::Backend> child) { return child; };
#endif
  // Every rank of this group comes here (NCCL's split is collective over
  // the parent); a rank outside `ranks` gets no child.
  return remember(childOf(store, ranks, timeout, [&](InnerRoute& route, const StorePtr& prefixed) {
    return splitWithOwnOptions(
        route.backend(),
        prefixed,
        ranks,
        timeout,
        opts ? &opts->group_name : nullptr,
        opts ? &opts->group_desc : nullptr);
  }));
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupHSDP::childOf(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    std::chrono::milliseconds timeout,
    shm::FunctionRef<c10::intrusive_ptr<c10d::Backend>(InnerRoute&, const StorePtr&)> innerChild) {
  // Inner backends get their own prefixes, as at creation.
  auto childRoute = [&](InnerRoute* route, const char* prefix) -> std::unique_ptr<InnerRoute> {
    if (!route) {
      return nullptr;
    }
    const StorePtr prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
    auto child = innerChild(*route, prefixed);
    if (!child) {
      return nullptr;
    }
    auto made = std::make_unique<InnerRoute>(child, route->caps(), child->getRank());
    made->markConnected(); // NCCL's split and shrink make the child's communicator at once
    return made;
  };
  auto cuda = childRoute(cuda_.get(), "hsdp/nccl/");
  auto cpu = childRoute(cpu_.get(), "hsdp/gloo/");
  if (!cpu) {
    return nullptr;
  }
  const int rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  auto child = c10::make_intrusive<ProcessGroupHSDP>(
      store,
      rank,
      static_cast<int>(ranks.size()),
      timeout,
      std::move(cpu),
      std::move(cuda),
      membership_.config,
      membership_.hostIdentity);
  // The members' global ranks, as torch gives a new group's (guessCudaDevice).
  const auto& global = options_->global_ranks_in_group;
  if (global.size() == static_cast<size_t>(size_)) {
    for (int r : ranks) {
      child->options_->global_ranks_in_group.push_back(global[r]);
    }
  }
  return child;
}

#ifdef C10D_BACKEND_HAS_RECONFIGURE
namespace {

constexpr std::string_view kHandleTag = "hsdp:1:";

// The inner backend's handle inside an hsdp handle of group `uid`, or
// nullopt when `handle` is not one (another backend's, or another group's).
std::optional<std::string> innerHandleOf(const std::string& handle, const std::string& uid) {
  if (handle.rfind(kHandleTag, 0) != 0) {
    return std::nullopt;
  }
  const size_t colon = handle.find(':', kHandleTag.size());
  if (colon == std::string::npos) {
    return std::nullopt;
  }
  const std::string length = handle.substr(kHandleTag.size(), colon - kHandleTag.size());
  if (length.empty() || length.find_first_not_of("0123456789") != std::string::npos ||
      length.size() > 6 || std::stoul(length) != uid.size() ||
      handle.compare(colon + 1, uid.size(), uid) != 0) {
    return std::nullopt;
  }
  return handle.substr(colon + 1 + uid.size());
}

// Whether `handle` has the shape of ProcessGroupGloo's handle,
// "<name>:<rank>:<uuid>:<stable rank>:<store address>" (its
// get_reconfigure_handle, torch 2.14's ProcessGroupGlooReconfigure.cpp):
// Gloo parses the numbers with std::stoi, whose failure is no c10::Error.
bool looksLikeGlooHandle(const std::string& handle, const std::string& name) {
  if (handle.rfind(name + ":", 0) != 0) {
    return false;
  }
  size_t at = name.size() + 1;
  for (int field = 0; field < 3; ++field) {
    const size_t colon = handle.find(':', at);
    if (colon == std::string::npos) {
      return false;
    }
    const std::string number = handle.substr(at, colon - at);
    const size_t digits = number.rfind('-', 0) == 0 ? 1 : 0;
    if (number.size() == digits || number.size() > 20 ||
        number.find_first_not_of("0123456789", digits) != std::string::npos) {
      return false;
    }
    at = colon + 1;
  }
  return true;
}

// The inner Gloo's reconfigure options from hsdp's: each handle checked
// (this group's, the inner Gloo's shape, each once, `mine` among them) and
// stripped to the inner Gloo's, in the same order or set.
struct InnerReconfigure {
  c10d::ReconfigureOptions options;
  size_t members = 0;
};
InnerReconfigure innerReconfigureOptions(
    const OpContext& c,
    const c10d::ReconfigureOptions& opts,
    const std::string& uid,
    const std::string& mine,
    const std::string& innerName) {
  bool member = false;
  size_t count = 0;
  std::unordered_set<std::string> seen;
  // Everything is checked before the membership changes: a refused call
  // leaves the group serving its members.
  auto inner = [&](const std::string& handle) {
    auto stripped = innerHandleOf(handle, uid);
    HSDP_CHECK_VALUE(
        stripped,
        c,
        "handle ",
        count,
        " is not a handle of this group (",
        uid,
        "): expected what dist._get_reconfigure_handle(group) returns on each member, got '",
        handle.substr(0, 80),
        "'");
    HSDP_CHECK_VALUE(
        looksLikeGlooHandle(*stripped, innerName),
        c,
        "handle ",
        count,
        " carries no handle of the inner ",
        innerName,
        " backend ('",
        innerName,
        ":<rank>:<uuid>:<rank>:<store>' after the group's uid), got '",
        handle.substr(0, 80),
        "'");
    HSDP_CHECK_VALUE(
        seen.insert(handle).second,
        c,
        "handle ",
        count,
        " is given twice: each member's handle appears once");
    member |= handle == mine;
    ++count;
    return std::move(*stripped);
  };
  c10d::ReconfigureOptions innerOpts;
  innerOpts.uuid = opts.uuid;
  innerOpts.timeout = opts.timeout;
  innerOpts.hints = opts.hints;
  if (const auto* ordered = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    std::vector<c10d::ReconfigureHandle> handles;
    for (const auto& h : *ordered) {
      handles.push_back(inner(h));
    }
    innerOpts.handles = std::move(handles);
  } else {
    // A set: Gloo orders its handles, and the group's uid in front of each
    // is the same, so the order (the new ranks) is the inner Gloo's.
    std::unordered_set<c10d::ReconfigureHandle> handles;
    for (const auto& h : std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles)) {
      handles.insert(inner(h));
    }
    innerOpts.handles = std::move(handles);
  }
  HSDP_CHECK_VALUE(
      member,
      c,
      "this rank's own handle is not among the ",
      count,
      " handles: only a member reconfigures a group, and each member passes every member's "
      "handle, its own included");
  return {std::move(innerOpts), count};
}

} // namespace

bool ProcessGroupHSDP::supportsReconfigure() const {
  return !cuda_ && cpu_->backend().supportsReconfigure();
}

c10d::ReconfigureHandle ProcessGroupHSDP::get_reconfigure_handle() const {
  const std::string& uid = getGroupUid();
  return std::string(kHandleTag) + std::to_string(uid.size()) + ":" + uid +
      cpu_->backend().get_reconfigure_handle();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupHSDP::reconfigure(const c10d::ReconfigureOptions& opts) {
  const auto c = ctx("reconfigure");
  if (const char* ended = ended_.load(std::memory_order_acquire)) {
    C10_THROW_ERROR(
        DistBackendError,
        c.prefix() + "the process group was " + ended + "; create a new process group");
  }
  HSDP_CHECK(
      !cuda_,
      c,
      "this group serves CUDA, and the ProcessGroupNCCL it wraps cannot be reconfigured; "
      "reconfigure a group created without a GPU");
  HSDP_CHECK(
      cpu_->backend().supportsReconfigure(),
      c,
      "its inner ",
      cpu_->name(),
      " backend cannot be reconfigured");
  HSDP_CHECK_VALUE(
      std::find(
          membership_.reconfigureUuids.begin(), membership_.reconfigureUuids.end(), opts.uuid) ==
          membership_.reconfigureUuids.end(),
      c,
      "uuid ",
      opts.uuid,
      " was used before on this group; pass a fresh one for every reconfiguration");
  const auto inner = innerReconfigureOptions(
      c, opts, getGroupUid(), get_reconfigure_handle(), cpu_->backend().getBackendName());
  const size_t count = inner.members;
  // From here the uuid is spent, whatever happens: the inner Gloo claims it
  // in the store before it connects.
  membership_.reconfigureUuids.push_back(opts.uuid);
  // The old membership ends here, on this rank: its segment is unmapped, and
  // a peer still writing to it (a lost rank's late write) reaches no member.
  // leave() first ends this rank's pending shared-memory waits, then drains
  // the queue.
  detachShm("reconfigured its process group");
  membership_.awaitingMembers.store(true, std::memory_order_release);
  try {
    cpu_->backend().reconfigure(inner.options)->wait();
    rank_ = cpu_->backend().getRank();
    size_ = cpu_->backend().getSize();
    cpu_->setRank(rank_);
    trace_->setMembership(rank_, size_);
    // Keys of this membership only: an earlier one's never answer, and the
    // rendezvous' incarnation counter starts at 0 for a new size
    // (csrc/shm/epoch.pml: SHARED_COUNTER).
    auto epoch = c10::make_intrusive<c10d::PrefixStore>(
        "hsdp/reconfigure/" + std::to_string(opts.uuid) + "/", membership_.store);
    attachShm(*epoch);
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    C10_THROW_ERROR(
        DistBackendError,
        c.prefix() + "the group could not take its " + std::to_string(count) + " members (uuid " +
            std::to_string(opts.uuid) +
            "): " + (error ? error->what_without_backtrace() : e.what()) +
            "; it has none until a reconfigure succeeds");
  }
  // A new membership starts as a new group does (Gloo resets its sequence
  // number): no failure of the old one is reported as the new one's.
  sequence_.store(0, std::memory_order_relaxed);
  firstError_.store(static_cast<int>(c10d::ErrorType::SUCCESS));
  trace_->forgetFailures();
  membership_.awaitingMembers.store(false, std::memory_order_release);
  return WorkHSDP::completed(rank_, c10d::OpType::UNKNOWN, {});
}
#endif

} // namespace hsdp
