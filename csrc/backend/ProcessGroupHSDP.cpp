#include "backend/ProcessGroupHSDP.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <optional>

#include "backend/WorkHSDP.hpp"

namespace hsdp {

using c10d::OpType;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

namespace {

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
      cpu_(std::move(cpuRoute)),
      cuda_(std::move(cudaRoute)),
      trace_(std::make_shared<FlightRecorder>(rank, size, traceOptionsOf(config))),
      membership_(config, std::move(hostIdentity), std::move(store), awaitReconfigure) {
  TORCH_CHECK(cpu_, "ProcessGroupHSDP needs an inner CPU backend");
  TORCH_CHECK(membership_.store, "ProcessGroupHSDP needs the group's store");
  if (awaitReconfigure) {
    shmWhyNot_ = "the group awaits its members (created with enable_reconfigure=True)";
    init();
    return;
  }
  attachShm(*membership_.store);
  init();
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
  if (shm_) {
    shm_->setTimeout(membership_.config.engineTimeout(timeout), timeout);
  }
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
           : "its CPU collectives run on " + cpuRoute() +
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

void ProcessGroupHSDP::checkUsable(const OpContext& c) const {
  if (const char* ended = ended_.load(std::memory_order_acquire)) {
    C10_THROW_ERROR(
        DistBackendError,
        c.prefix() + "the process group was " + ended + "; create a new process group");
  }
  if (membership_.awaitingMembers.load(std::memory_order_acquire)) {
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
