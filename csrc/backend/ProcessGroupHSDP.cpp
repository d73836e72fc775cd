#include "backend/ProcessGroupHSDP.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <optional>
#include <string_view>
#include <unordered_set>
#include <variant>

#include "backend/Checks.hpp"
#include "backend/WorkHSDP.hpp"
#include "backend/routes/SplitInner.hpp"

namespace hsdp {

using c10d::OpType;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

namespace {

ShmOptions shmOptionsOf(
    const Config& config,
    int size,
    std::chrono::milliseconds groupTimeout,
    const std::optional<std::string>& hostIdentity) {
  ShmOptions shm;
  switch (config.engine) {
    case Config::Engine::Auto:
      shm.mode = ShmOptions::Mode::Auto;
      break;
    case Config::Engine::Shm:
      shm.mode = ShmOptions::Mode::Required;
      break;
    case Config::Engine::Gloo:
      shm.mode = ShmOptions::Mode::Off;
      break;
  }
  shm.slotBytes = static_cast<size_t>(config.slotBytes);
  shm.engine = shm::engineConfigFor(config, size, groupTimeout);
  shm.hostIdentity = hostIdentity;
  return shm;
}

TraceOptions traceOptionsOf(const Config& config) {
  return {static_cast<size_t>(config.traceEntries), config.traceDir};
}

} // namespace

ProcessGroupHSDP::ProcessGroupHSDP(
    c10::intrusive_ptr<c10d::Store> store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    std::unique_ptr<InnerRoute> cpuRoute,
    std::unique_ptr<InnerRoute> cudaRoute,
    const Config& config,
    std::optional<std::string> hostIdentity,
    bool awaitReconfigure)
    : Backend(rank, size),
      options_(c10::make_intrusive<Options>("hsdp", timeout)),
      config_(config),
      hostIdentity_(std::move(hostIdentity)),
      cpu_(std::move(cpuRoute)),
      cuda_(std::move(cudaRoute)),
      trace_(std::make_shared<FlightRecorder>(rank, size, traceOptionsOf(config))),
      store_(std::move(store)),
      awaitingMembers_(awaitReconfigure) {
  TORCH_CHECK(cpu_, "ProcessGroupHSDP needs an inner CPU backend");
  TORCH_CHECK(store_, "ProcessGroupHSDP needs the group's store");
  if (awaitReconfigure) {
    shmWhyNot_ = "the group awaits its members (created with enable_reconfigure=True)";
    init();
    return;
  }
  attachShm(*store_);
  init();
}

void ProcessGroupHSDP::attachShm(c10d::Store& store) {
  auto shm = connectShm(
      store,
      rank_,
      size_,
      shmOptionsOf(config_, size_, options_->timeout, hostIdentity_),
      cpu_->backend(),
      options_->timeout, // the columns' op timeout too: the group's, not a reconfigure's
      stats_,
      staging_,
      &shmWhyNot_);
  if (shm) {
    shm->usePool(
        static_cast<size_t>(config_.poolBytes), static_cast<size_t>(config_.poolChunkBytes));
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

ProcessGroupHSDP::~ProcessGroupHSDP() {
  trace_->detach(); // before the engine its snapshot reads is gone
  if (shm_) {
    shm_->leave("left the process group");
  }
}

void ProcessGroupHSDP::setGroupUid(const std::string& pgUid) {
  Backend::setGroupUid(pgUid);
  trace_->setGroup(pgUid);
}

void ProcessGroupHSDP::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  cpu_->backend().setTimeout(timeout);
  if (cuda_) {
    cuda_->backend().setTimeout(timeout);
  }
}

#if HSDP_TORCH_HAS_VIRTUAL_SET_BOUND_DEVICE
void ProcessGroupHSDP::setBoundDeviceId(std::optional<at::Device> device) {
  Backend::setBoundDeviceId(device);
  if (cuda_ && device && device->is_cuda()) {
    cuda_->backend().setBoundDeviceId(device); // NCCL's split and eager init use it
  }
}
#endif

void ProcessGroupHSDP::eagerConnectSingleDevice(at::Device device) {
  if (cuda_ && device.is_cuda()) {
    cuda_->backend().eagerConnectSingleDevice(device);
    cuda_->markConnected();
  }
}

// Communication buffers come from the route their collectives take: the
// shared-memory pool, else the inner backend of the device (NCCL's memory
// pool on CUDA, as on a plain nccl group; Gloo has none).
// c10d hands over the device's index only: -1 is the CPU, and also a CUDA
// device named without an index (torch.device("cuda")), which allocateTensor
// then serves from NCCL's pool. So -1 is true only where both would serve: a
// false costs the caller its own allocation, a wrong true a failed one.
bool ProcessGroupHSDP::supportsTensorAlloc(c10::DeviceIndex index) {
  if (index >= 0) {
    return cuda_ && cuda_->backend().supportsTensorAlloc(index);
  }
  const bool cpu = shm_ ? shm_->allocates() : cpu_->backend().supportsTensorAlloc(index);
  if (!cpu || !cuda_) {
    return cpu;
  }
  // NCCL answers for a device index of its own (ProcessGroupNCCL asks the
  // driver about it, and -1 is none): the current device's, which is what
  // allocateTensor on a CUDA device without an index allocates on. No device
  // to ask: false.
  try {
    c10::impl::VirtualGuardImpl cuda(at::kCUDA);
    return cuda.deviceCount() > 0 && cuda_->backend().supportsTensorAlloc(cuda.getDevice().index());
  } catch (const c10::Error&) {
    return false;
  }
}

at::Tensor ProcessGroupHSDP::allocateTensor(long size, at::TensorOptions options) {
  const OpContext c = ctx("allocate_tensor");
  HSDP_CHECK_VALUE(options.has_device(), c, "the tensor options name no device: pass device=");
  HSDP_CHECK_VALUE(size >= 0, c, "expected a size >= 0, got ", size);
  const at::Device device = options.device();
  if (device.is_cuda()) {
    HSDP_CHECK(
        cuda_,
        c,
        "got a request on ",
        device,
        " but this process group was created without CUDA (no GPU was visible to torch when it "
        "was created)");
    return cuda_->backend().allocateTensor(size, options);
  }
  HSDP_CHECK(
      device.is_cpu(),
      c,
      "tensors on ",
      device,
      " are not supported; hsdp allocates cpu and cuda tensors");
  if (shm_ && shm_->allocates()) {
    return shm_->allocate(size, options);
  }
  HSDP_CHECK(
      cpu_->backend().supportsTensorAlloc(-1),
      c,
      "this group has no communication buffers on cpu (",
      shm_ ? "its ranks cannot map each other's memory, or HSDP_SHM_POOL_BYTES is 0"
           : "its CPU collectives run on " + cpuEngine() +
              (shmWhyNot_.empty() ? "" : ": " + shmWhyNot_),
      "); supports_tensor_alloc(cpu) is false, so FSDP2 allocates its own");
  return cpu_->backend().allocateTensor(size, options);
}

std::shared_ptr<c10::Allocator> ProcessGroupHSDP::getMemAllocator() {
  if (cuda_) {
    return cuda_->backend().getMemAllocator();
  }
  if (shm_ && shm_->allocates()) {
    return shm_->allocator();
  }
  return cpu_->backend().getMemAllocator();
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
  std::vector<int> stay;
  for (int r = 0; r < size_; ++r) {
    if (std::find(ranksToExclude.begin(), ranksToExclude.end(), r) == ranksToExclude.end()) {
      stay.push_back(r);
    }
  }
  for (size_t i = 0; i < ranksToExclude.size(); ++i) {
    const int64_t r = ranksToExclude[i];
    HSDP_CHECK_VALUE(r >= 0 && r < size_, c, "rank ", r, " to exclude is not in 0..", size_ - 1);
    // NCCL's shrink counts a rank given twice twice in its child's size.
    HSDP_CHECK_VALUE(
        std::find(ranksToExclude.begin(), ranksToExclude.begin() + i, r) ==
            ranksToExclude.begin() + i,
        c,
        "rank ",
        r,
        " to exclude is given twice");
  }
  HSDP_CHECK_VALUE(!stay.empty(), c, "every rank would be excluded");
  HSDP_CHECK_VALUE(
      std::find(stay.begin(), stay.end(), rank_) != stay.end(),
      c,
      "this rank is among the ranks to exclude: only the ranks that stay shrink a group");
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
  std::string prefix = "hsdp/shrink/" + std::to_string(++shrinks_) + "/";
  for (int r : stay) {
    prefix += std::to_string(r) + ",";
  }
  const auto timeout = optsOverride ? optsOverride->timeout : options_->timeout;
  const StorePtr store = c10::make_intrusive<c10d::PrefixStore>(prefix + "/", store_);
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

#if HSDP_TORCH_HAS_TIME_ESTIMATE
bool ProcessGroupHSDP::supportsTimeEstimation() const {
  return cuda_ && cuda_->backend().supportsTimeEstimation();
}

void ProcessGroupHSDP::startTimeEstimate() {
  HSDP_CHECK(
      supportsTimeEstimation(),
      ctx("startTimeEstimate"),
      "time estimation needs an inner CUDA backend that has it (NCCL)");
  cuda_->backend().startTimeEstimate();
}

float ProcessGroupHSDP::endTimeEstimate() {
  HSDP_CHECK(
      supportsTimeEstimation(),
      ctx("endTimeEstimate"),
      "time estimation needs an inner CUDA backend that has it (NCCL)");
  return cuda_->backend().endTimeEstimate();
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
  if (lastSplit_ && lastSplit_->groupName == groupName && lastSplit_->ranks == ranks) {
    if (lastSplit_->none) {
      lastSplit_.reset();
      return nullptr;
    }
    auto child = lastSplit_->child.lock();
    lastSplit_.reset();
    if (child) {
      return child;
    }
  }
  auto remember = [&](const c10::intrusive_ptr<c10d::Backend>& child) {
    lastSplit_ = LastSplit{groupName, ranks, c10::weak_intrusive_ptr<c10d::Backend>(child), !child};
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
      config_,
      hostIdentity_);
  // The members' global ranks, as torch gives a new group's (guessCudaDevice).
  const auto& global = options_->global_ranks_in_group;
  if (global.size() == static_cast<size_t>(size_)) {
    for (int r : ranks) {
      child->options_->global_ranks_in_group.push_back(global[r]);
    }
  }
  return child;
}

#if HSDP_TORCH_HAS_EPHEMERAL_TIMEOUT
void ProcessGroupHSDP::addEphemeralTimeout(const std::chrono::milliseconds& timeout) {
  HSDP_CHECK_VALUE(
      timeout.count() >= 0,
      ctx("add_ephemeral_timeout"),
      "expected an extension of at least 0 ms, got ",
      timeout.count(),
      " ms");
  timeoutExtension_->add(timeout);
  if (cuda_) {
    // NCCL's own works and watchdog take it as they take it on a plain
    // nccl group; hsdp's waits on top of them take it here.
    cuda_->backend().addEphemeralTimeout(timeout);
  }
}
#endif

void ProcessGroupHSDP::setSequenceNumberForGroup() {
  sequence_.store(0); // every rank starts at 0, as gloo's
}

uint64_t ProcessGroupHSDP::getSequenceNumberForGroup() {
  return sequence_.load(std::memory_order_relaxed);
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
      std::find(reconfigureUuids_.begin(), reconfigureUuids_.end(), opts.uuid) ==
          reconfigureUuids_.end(),
      c,
      "uuid ",
      opts.uuid,
      " was used before on this group; pass a fresh one for every reconfiguration");
  const std::string uid = getGroupUid();
  const std::string mine = get_reconfigure_handle();
  const std::string innerName = cpu_->backend().getBackendName();
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
  // From here the uuid is spent, whatever happens: the inner Gloo claims it
  // in the store before it connects.
  reconfigureUuids_.push_back(opts.uuid);
  // The old membership ends here, on this rank: its segment is unmapped, and
  // a peer still writing to it (a lost rank's late write) reaches no member.
  // leave() first ends this rank's pending shared-memory waits, then drains
  // the queue.
  detachShm("reconfigured its process group");
  awaitingMembers_.store(true, std::memory_order_release);
  try {
    cpu_->backend().reconfigure(innerOpts)->wait();
    rank_ = cpu_->backend().getRank();
    size_ = cpu_->backend().getSize();
    cpu_->setRank(rank_);
    trace_->setMembership(rank_, size_);
    // Keys of this membership only: an earlier one's never answer, and the
    // rendezvous' incarnation counter starts at 0 for a new size
    // (csrc/shm/epoch.pml: SHARED_COUNTER).
    auto epoch = c10::make_intrusive<c10d::PrefixStore>(
        "hsdp/reconfigure/" + std::to_string(opts.uuid) + "/", store_);
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
  awaitingMembers_.store(false, std::memory_order_release);
  return WorkHSDP::completed(rank_, c10d::OpType::UNKNOWN, {});
}
#endif

void ProcessGroupHSDP::checkUsable(const OpContext& c) const {
  if (const char* ended = ended_.load(std::memory_order_acquire)) {
    C10_THROW_ERROR(
        DistBackendError,
        c.prefix() + "the process group was " + ended + "; create a new process group");
  }
  if (awaitingMembers_.load(std::memory_order_acquire)) {
    C10_THROW_ERROR(
        DistBackendError,
        c.prefix() +
            "the process group has no members yet: it was created with enable_reconfigure=True, "
            "or its last reconfigure failed; call torch.distributed._reconfigure(uuid, handles) "
            "first");
  }
}

#if HSDP_TORCH_HAS_ABORT_HOOKS
void ProcessGroupHSDP::registerAbortHook(int64_t hookId, c10d::AbortHook hook) {
  TORCH_CHECK_VALUE(
      trace_->abortHooks().add(hookId, std::move(hook)),
      ctx("register_abort_hook").prefix(),
      "hook id ",
      hookId,
      " is already registered on this group (unregister it first)");
}

void ProcessGroupHSDP::unregisterAbortHook(int64_t hookId) {
  trace_->abortHooks().remove(hookId);
}
#endif

namespace {

// An inner backend's own answer; SUCCESS where it gives none (c10d's
// default refuses before torch 2.14, and Gloo overrides it from 2.14 only).
c10d::ErrorType errorOf(c10d::Backend& backend) {
  try {
    return backend.getError();
  } catch (const c10::Error&) {
    return c10d::ErrorType::SUCCESS;
  }
}

} // namespace

c10d::ErrorType ProcessGroupHSDP::getError() {
  if (const int first = firstError_.load(); first != static_cast<int>(c10d::ErrorType::SUCCESS)) {
    return static_cast<c10d::ErrorType>(first);
  }
  auto error = c10d::ErrorType::SUCCESS;
  if (shm_) {
    switch (shm_->failure()) {
      case shm::Engine::Failure::Timeout:
        error = c10d::ErrorType::TIMEOUT;
        break;
      case shm::Engine::Failure::Local:
        error = c10d::ErrorType::COMM_ERROR;
        break;
      case shm::Engine::Failure::Remote:
        error = c10d::ErrorType::REMOTE_ERROR;
        break;
      case shm::Engine::Failure::None:
        break;
    }
  }
  for (auto* r : {cuda_.get(), cpu_.get()}) {
    if (r && error == c10d::ErrorType::SUCCESS) {
      error = errorOf(r->backend());
    }
  }
  if (error == c10d::ErrorType::SUCCESS && trace_->anyFailed()) {
    error = c10d::ErrorType::COMM_ERROR;
  }
  if (error != c10d::ErrorType::SUCCESS) {
    int none = static_cast<int>(c10d::ErrorType::SUCCESS);
    firstError_.compare_exchange_strong(none, static_cast<int>(error));
    return static_cast<c10d::ErrorType>(firstError_.load());
  }
  return error;
}

#if HSDP_TORCH_HAS_SUSPEND
namespace {
c10d::Backend& innerNccl(const std::unique_ptr<InnerRoute>& cuda, const OpContext& c) {
  HSDP_CHECK(
      cuda,
      c,
      "this process group was created without CUDA (no GPU was visible to torch when it was "
      "created): it holds no device memory of NCCL's to suspend, resume or report");
  return cuda->backend();
}
} // namespace

void ProcessGroupHSDP::suspend() {
  innerNccl(cuda_, ctx("suspend")).suspend();
}

void ProcessGroupHSDP::resume() {
  innerNccl(cuda_, ctx("resume")).resume();
}

std::unordered_map<std::string, uint64_t> ProcessGroupHSDP::getMemoryStats() {
  return innerNccl(cuda_, ctx("get_memory_stats")).getMemoryStats();
}
#endif

void ProcessGroupHSDP::registerOnCompletionHook(
    std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& /*hook*/) {
  HSDP_CHECK(
      false,
      ctx("register_on_completion_hook"),
      "not supported: hsdp records each collective's start and end in its flight recorder "
      "(hsdp_backend.dump_trace(), read by python -m hsdp_backend.trace; ProcessGroupNCCL "
      "deprecates this hook in favour of its own), and one op's completion is its Work's "
      "(work.get_future().then(...))");
}

void ProcessGroupHSDP::waitForPendingWorks() {
  HSDP_CHECK(
      false,
      ctx("wait_for_pending_works"),
      "not supported: wait() on the Works of the ops to wait for, or call dist.barrier() for "
      "every op issued before it on every rank");
}

void ProcessGroupHSDP::enableCollectivesTiming() {
  HSDP_CHECK(
      false,
      ctx("enable_collectives_timing"),
      "not supported: each collective's start and end are in hsdp's flight recorder "
      "(hsdp_backend.dump_trace(), read by python -m hsdp_backend.trace)");
}

void ProcessGroupHSDP::abort() {
  // Before the group goes: a hook may still read it.
  trace_->runAbortHooks();
  ended_.store("aborted", std::memory_order_release);
  if (shm_) {
    shm_->abort("aborted its process group");
  }
  cpu_->backend().abort();
  if (cuda_) {
    cuda_->backend().abort();
  }
}

void ProcessGroupHSDP::shutdown() {
  ended_.store("shut down", std::memory_order_release);
  // A hook that holds its group (a bound method of it) would keep it alive:
  // Python's collector cannot see the cycle through C++.
  trace_->abortHooks().clear();
  if (shm_) {
    shm_->leave("shut down its process group");
  }
  cpu_->backend().shutdown();
  if (cuda_) {
    cuda_->backend().shutdown();
  }
}

void ProcessGroupHSDP::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalescingMutex_);
  TORCH_CHECK(!coalescing_.load(), ctx("start_coalescing").prefix(), "already coalescing");
  coalescing_.store(true, std::memory_order_release);
  coalescedWorks_.clear();
  for (auto* r : {cpu_.get(), cuda_.get()}) {
    if (r && r->caps().nativeCoalescing) {
      r->startCoalescing();
    }
  }
}

WorkPtr ProcessGroupHSDP::endCoalescing() {
  std::vector<WorkPtr> works;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    TORCH_CHECK(
        coalescing_.load(),
        ctx("end_coalescing").prefix(),
        "end_coalescing without start_coalescing");
    coalescing_.store(false, std::memory_order_release);
    works.swap(coalescedWorks_);
  }
  WorkPtr cudaWork;
  for (auto* r : {cpu_.get(), cuda_.get()}) {
    if (r && r->caps().nativeCoalescing) {
      if (auto w = r->endCoalescing()) {
        works.push_back(w);
        if (r == cuda_.get()) {
          cudaWork = w;
        }
      }
    }
  }
  if (works.empty()) {
    return WorkHSDP::completed(rank_, OpType::COALESCED, {});
  }
  if (works.size() == 1) {
    return works.front();
  }
  if (cudaWork) {
    // CPU and CUDA tensors in one block: the CPU part is waited for here (a
    // host wait), the CUDA part's Work orders the caller's stream.
    for (const auto& w : works) {
      if (w != cudaWork) {
        w->wait();
      }
    }
    return cudaWork;
  }
  // Works of several CPU routes in one block (bool tensors beside
  // shm-served ones, say): joined on the CPU route's completion thread.
  return cpu_->workFor(OpType::COALESCED, /*asyncOp=*/true, std::move(works), {}, [] {});
}

} // namespace hsdp
