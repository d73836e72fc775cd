#include "backend/ProcessGroupHSDP.hpp"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/Checks.hpp"
#include "backend/EngineTypes.hpp"
#include "backend/Plan.hpp"
#include "backend/WorkHSDP.hpp"
#include "fusion/FlatPack.hpp"
#include "shm/Reduce.hpp"

#include <c10/util/Exception.h>

#include <numeric>

namespace hsdp {

namespace {

using c10d::OpType;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The collective this thread last recorded (recordCollective) and has not
// yet handed to track(): how the Work, or the shared-memory task, finds its
// flight-recorder entry without every op passing it along.
struct PendingEntry {
  const void* group = nullptr;
  uint64_t seq = 0;
  bool onShm = false;                // runShm records its end itself: no future to follow
  std::optional<c10::Device> device; // a CUDA op's, set by route(): it ends on the device
};
thread_local PendingEntry pending;

// "Done" for a flight-recorder entry of an op NCCL runs on `device`: an
// event recorded on the device's current stream, queried only when a dump
// is written. Called right after a synchronous call (NCCL orders the
// caller's stream after the op) or in the Work's future callback, where
// c10's Future makes the current stream wait for the op's events. None
// under graph capture, where an event may not be queried: such an entry
// completes at enqueue.
std::function<bool()> doneOnDevice(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream stream = impl.getStream(device);
  if (impl.isStreamCapturing(stream)) {
    return nullptr;
  }
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(stream);
  return [event] { return event->query(); };
}

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
    case Config::Engine::NcclContract:
      shm.mode = ShmOptions::Mode::Off;
      break;
  }
  shm.slotBytes = static_cast<size_t>(config.slotBytes);
  shm.engine = config.engineConfig(size, groupTimeout);
  shm.hostIdentity = hostIdentity;
  return shm;
}

TraceOptions traceOptionsOf(const Config& config) {
  return {static_cast<size_t>(config.traceEntries), config.traceDir};
}

} // namespace

ProcessGroupHSDP::ProcessGroupHSDP(
    c10d::Store& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout,
    std::unique_ptr<InnerRoute> cpuRoute,
    std::unique_ptr<InnerRoute> cudaRoute,
    const Config& config,
    std::optional<std::string> hostIdentity)
    : Backend(rank, size),
      options_(c10::make_intrusive<Options>("hsdp", timeout)),
      config_(config),
      hostIdentity_(std::move(hostIdentity)),
      cpu_(std::move(cpuRoute)),
      cuda_(std::move(cudaRoute)),
      trace_(std::make_shared<FlightRecorder>(rank, size, traceOptionsOf(config))) {
  TORCH_CHECK(cpu_, "ProcessGroupHSDP needs an inner CPU backend");
  engine_ = connectShm(
      store,
      rank,
      size,
      shmOptionsOf(config, size, timeout, hostIdentity_),
      cpu_->backend(),
      timeout,
      stats_,
      staging_,
      &shmWhyNot_);
  if (engine_) {
    queue_ = std::make_unique<OpQueue>();
  }
  init();
  if (engine_) {
    // Last: a constructor that throws leaves no snapshot of a destroyed engine.
    trace_->setSnapshot([engine = engine_.get()] { return engine->whereEveryRankIs(); });
  }
}

ProcessGroupHSDP::~ProcessGroupHSDP() {
  trace_->detach(); // before the engine its snapshot reads is gone
  leaveShm("left the process group");
}

void ProcessGroupHSDP::setGroupUid(const std::string& pgUid) {
  Backend::setGroupUid(pgUid);
  trace_->setGroup(pgUid);
}

void ProcessGroupHSDP::failShm(const shm::CommError& e, uint64_t seq) {
  trace_->finished(seq, e.what());
  const std::string path = trace_->dumpOnFailure(e.what());
  C10_THROW_ERROR(
      DistBackendError,
      std::string(e.what()) + "\nFlight record of this rank: " + path +
          " (python -m hsdp_backend.trace " + trace_->options().dir +
          " reads every rank's and names the first collective where they diverge)");
}

void ProcessGroupHSDP::leaveShm(const char* why) {
  if (engine_) {
    // Peers that still wait on this rank fail now instead of at their
    // deadline, and so does anything still queued here. A correct program
    // has nothing left to wait for from a rank that finished all its
    // collectives, so this only speeds up failures.
    engine_->abort(why);
  }
  queue_.reset(); // joins the worker once the queue is drained
}

bool ProcessGroupHSDP::onShm(std::initializer_list<const at::Tensor*> tensors) const {
  if (!engine_) {
    return false;
  }
  for (const at::Tensor* t : tensors) {
    if (!t->device().is_cpu() || !shmDtype(t->scalar_type()) || t->is_sparse()) {
      return false;
    }
  }
  return true;
}

bool ProcessGroupHSDP::onShm(const std::vector<at::Tensor>& tensors) const {
  for (const auto& t : tensors) {
    if (!onShm({&t})) {
      return false;
    }
  }
  return engine_ != nullptr;
}

WorkPtr ProcessGroupHSDP::runShm(
    OpType type,
    bool asyncOp,
    std::vector<at::Tensor> outputs,
    std::function<void()> body) {
  if (!queue_) {
    C10_THROW_ERROR(DistBackendError, ctx("shm").prefix() + "the process group was shut down");
  }
  const uint64_t seq = pending.group == this ? pending.seq : 0;
  pending.onShm = true;
  trace_->setRoute(seq, "shm");
  // Numbers the engine's collective as c10d does, for its messages, and
  // records its end (failures: failShm).
  auto labelled = [this, seq, body = std::move(body)] {
    // Every engine collective of the body (a fused call's buckets) is this
    // one c10d collective. Every engine call runs in such a body, so the
    // number is always set before use.
    engine_->setCallerSeq(seq);
    body();
    trace_->finished(seq, "");
  };
  if (!asyncOp) {
    bool ran = false;
    try {
      ran = queue_->runInlineIfIdle(labelled);
    } catch (const shm::CommError& e) {
      failShm(e, seq);
    }
    if (ran) {
      return WorkHSDP::completed(rank_, type, std::move(outputs));
    }
  }
  return WorkHSDP::onQueue(
      *queue_, rank_, type, std::move(outputs), [this, seq, labelled = std::move(labelled)] {
        try {
          labelled();
        } catch (const shm::CommError& e) {
          failShm(e, seq);
        }
      });
}

InnerRoute& ProcessGroupHSDP::route(const OpContext& ctx, const at::Tensor& t) {
  if (t.device().is_cpu()) {
    cpu_->beforeIssue();
    pending.device.reset();
    return *cpu_;
  }
  if (t.device().is_cuda()) {
    HSDP_CHECK(
        cuda_,
        ctx,
        "got a tensor on ",
        t.device(),
        " but this process group was created without CUDA (no GPU was "
        "visible to torch when it was created)");
    cuda_->beforeIssue();
    pending.device = t.device();
    return *cuda_;
  }
  HSDP_CHECK(
      false,
      ctx,
      "tensors on ",
      t.device(),
      " are not supported; hsdp serves cpu and cuda tensors");
}

WorkPtr ProcessGroupHSDP::track(WorkPtr work) {
  bool inBlock;
  {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    inBlock = coalescing_;
    if (inBlock && work) {
      coalescedWorks_.push_back(work);
    }
  }
  // Inside a coalescing block NCCL launches nothing before endCoalescing,
  // and an event recorded now would complete before the op ran: such an
  // entry completes at enqueue, as every CUDA entry did before.
  auto done = [trace = trace_.get(),
               device = inBlock ? std::nullopt : pending.device](uint64_t seq) {
    auto onDevice = device ? doneOnDevice(*device) : nullptr;
    if (onDevice) {
      trace->completesWhen(seq, std::move(onDevice));
    } else {
      trace->finished(seq, "");
    }
  };
  if (pending.group == this && !pending.onShm && !work) {
    // A synchronous call that returns no Work has completed (InnerRoute),
    // or, on CUDA, is ordered on the caller's stream.
    if (trace_->enabled()) {
      done(pending.seq);
    }
  } else if (pending.group == this && !pending.onShm && trace_->enabled()) {
    // The entry completes with the Work's future, on whatever thread
    // completes it (at once if it already has; on CUDA, at enqueue: then
    // on the device, see doneOnDevice).
    try {
      work->getFuture()->addCallback(
          [trace = trace_, seq = pending.seq, done](c10::ivalue::Future& f) {
            if (!f.hasError()) {
              done(seq);
              return;
            }
            const std::string error = f.tryRetrieveErrorMessage();
            trace->finished(seq, error);
            trace->dumpOnFailure(error);
          },
          /*uses_future=*/false);
    } catch (const c10::Error&) {
      // A Work without a future (none of the routes' today): the entry
      // stays "started", which a dump reports as such.
    }
  }
  pending = {};
  return work;
}

void ProcessGroupHSDP::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  cpu_->backend().setTimeout(timeout);
  if (cuda_) {
    cuda_->backend().setTimeout(timeout);
  }
}

#if HSDP_TORCH_AT_LEAST_2_14
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
  }
}

bool ProcessGroupHSDP::supportsSplitting() const {
  return cpu_->backend().supportsSplitting() && (!cuda_ || cuda_->backend().supportsSplitting());
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupHSDP::split(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  const auto c = ctx("split_group");
  HSDP_CHECK(supportsSplitting(), c, "an inner backend of this group cannot be split");
  for (int r : ranks) {
    checkRank(c, r, "member");
  }
  const auto timeout = opts ? opts->timeout : options_->timeout;
#if !HSDP_TORCH_AT_LEAST_2_14
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
  // Inner backends get their own prefixes, as at creation. Every rank of
  // this group comes here (NCCL's split is collective over the parent); a
  // rank outside `ranks` gets no child.
  auto splitInner = [&](InnerRoute* route, const char* prefix) -> std::unique_ptr<InnerRoute> {
    if (!route) {
      return nullptr;
    }
    auto& inner = route->backend();
    // A copy: split implementations fill in what they are given (NCCL sets
    // split_from and the child's ranks), and these are the parent's own.
    auto child = splitWithOwnOptions(
        inner,
        c10::make_intrusive<c10d::PrefixStore>(prefix, store),
        ranks,
        timeout,
        opts ? &opts->group_name : nullptr,
        opts ? &opts->group_desc : nullptr);
    if (!child) {
      return nullptr;
    }
    return std::make_unique<InnerRoute>(child, route->caps(), child->getRank());
  };
  auto cuda = splitInner(cuda_.get(), "hsdp/nccl/");
  auto cpu = splitInner(cpu_.get(), "hsdp/gloo/");
  if (!cpu) {
    return remember(nullptr);
  }
  const int rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
  return remember(c10::make_intrusive<ProcessGroupHSDP>(
      *store,
      rank,
      static_cast<int>(ranks.size()),
      timeout,
      std::move(cpu),
      std::move(cuda),
      config_,
      hostIdentity_));
}

ProcessGroupHSDP::Traced
ProcessGroupHSDP::recordCollective(const OpContext& c, uint64_t collectives, uint64_t bytes) {
  checkUsable(c);
  stats_.record(c.op, collectives, bytes);
  const uint64_t seq = sequence_.fetch_add(1, std::memory_order_relaxed) + 1;
  trace_->started(seq, c.op, bytes);
  pending = {this, seq, false, pending.device}; // route() may have come first
  return Traced(*this, seq);
}

ProcessGroupHSDP::Traced::Traced(ProcessGroupHSDP& group, uint64_t seq)
    : group_(group), seq_(seq), exceptionsAtStart_(std::uncaught_exceptions()) {}

ProcessGroupHSDP::Traced::~Traced() {
  if (pending.group != &group_ || pending.seq != seq_) {
    return; // track() took the entry over
  }
  pending = {};
  if (std::uncaught_exceptions() > exceptionsAtStart_) {
    // The inner backend or a synchronous wait raised: the exception the
    // caller gets says what; the record says where in the sequence.
    group_.trace_->finished(seq_, "raised an exception (the caller got it)");
    group_.trace_->dumpOnFailure("collective #" + std::to_string(seq_) + " raised an exception");
  }
}

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
}

void ProcessGroupHSDP::abort() {
  ended_.store("aborted", std::memory_order_release);
  if (engine_) {
    engine_->abort("aborted its process group");
  }
  cpu_->backend().abort();
  if (cuda_) {
    cuda_->backend().abort();
  }
}

void ProcessGroupHSDP::shutdown() {
  ended_.store("shut down", std::memory_order_release);
  leaveShm("shut down its process group");
  cpu_->backend().shutdown();
  if (cuda_) {
    cuda_->backend().shutdown();
  }
}

void ProcessGroupHSDP::startCoalescing() {
  std::lock_guard<std::mutex> lock(coalescingMutex_);
  TORCH_CHECK(!coalescing_, ctx("start_coalescing").prefix(), "already coalescing");
  coalescing_ = true;
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
        coalescing_, ctx("end_coalescing").prefix(), "end_coalescing without start_coalescing");
    coalescing_ = false;
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
  return cpu_->finish(OpType::COALESCED, /*asyncOp=*/true, std::move(works), {}, [] {});
}

WorkPtr
ProcessGroupHSDP::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  const auto c = ctx("broadcast");
  checkNotEmpty(c, tensors);
  checkRank(c, opts.rootRank, "root");
  checkRootTensor(c, opts.rootTensor, tensors);
  const auto traced = recordCollective(c, 1, bytesOf(tensors));
  if (!oneDense(tensors)) {
    auto& r = route(c, tensors[0]);
    auto work = r.backend().broadcast(tensors, opts);
    return track(r.finish(OpType::BROADCAST, opts.asyncOp, {work}, tensors, {}, tensors));
  }
  if (onShm(tensors)) {
    auto t = tensors[0];
    return track(runShm(OpType::BROADCAST, opts.asyncOp, {t}, [this, t, root = opts.rootRank] {
      onContiguous(t, [&](const at::Tensor& c) {
        engine_->broadcast("broadcast", c.data_ptr(), c.nbytes(), static_cast<int>(root));
      });
    }));
  }
  auto& r = route(c, tensors[0]);
  auto arg = FlatArg::of(tensors[0]);
  std::vector<at::Tensor> io{arg.shaped()};
  auto work = r.backend().broadcast(io, opts);
  return track(r.finish(
      OpType::BROADCAST,
      opts.asyncOp,
      {work},
      {arg.user},
      scaleAndCopyBack(DeferredScale::none(), arg),
      {arg.flat}));
}

WorkPtr
ProcessGroupHSDP::allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  return allreduceImpl(tensors, opts, 1.0);
}

WorkPtr ProcessGroupHSDP::allreduceDividedBy(
    at::Tensor& tensor,
    const c10d::ReduceOp& op,
    double divideBy,
    bool asyncOp) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.asyncOp = asyncOp;
  return allreduceImpl(tensors, opts, divideBy);
}

WorkPtr ProcessGroupHSDP::allreduceImpl(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts,
    double divideBy) {
  const auto c = ctx("all_reduce");
  checkNotEmpty(c, tensors);
  auto& r = route(c, tensors[0]);
  // AVG averages every contribution: all tensors of all ranks.
  const int contributions = size_ * static_cast<int>(tensors.size());
  auto plan = planReduce(
      c, opts.reduceOp, tensors[0].scalar_type(), contributions, divideBy, r.caps().nativeScale);
  const auto traced = recordCollective(c, 1, bytesOf(tensors));
  if (!oneDense(tensors)) {
    c10d::AllreduceOptions innerOpts = opts;
    innerOpts.reduceOp = plan.innerOp;
    auto work = r.backend().allreduce(tensors, innerOpts);
    std::function<void()> post;
    if (!plan.post.isNone()) {
      post = [tensors, post = plan.post] {
        for (const auto& t : tensors) {
          post.apply(t);
        }
      };
    }
    return track(
        r.finish(OpType::ALLREDUCE, opts.asyncOp, {work}, tensors, std::move(post), tensors));
  }
  if (auto red = shmReduction(plan, tensors[0].scalar_type()); red && onShm(tensors)) {
    auto t = tensors[0];
    return track(runShm(OpType::ALLREDUCE, opts.asyncOp, {t}, [this, t, red = *red] {
      onContiguous(t, [&](const at::Tensor& c) {
        engine_->allReduce("all_reduce", c.data_ptr(), c.numel(), red.dtype, red.op, red.scale);
      });
    }));
  }
  c10d::AllreduceOptions innerOpts = opts;
  innerOpts.reduceOp = plan.innerOp;
  auto arg = FlatArg::of(tensors[0]);
  std::vector<at::Tensor> io{arg.shaped()};
  auto work = r.backend().allreduce(io, innerOpts);
  return track(r.finish(
      OpType::ALLREDUCE,
      opts.asyncOp,
      {work},
      {arg.user},
      scaleAndCopyBack(plan.post, arg),
      {arg.flat}));
}

WorkPtr ProcessGroupHSDP::allreduceBucketed(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int64_t bucketBytes,
    bool asyncOp,
    double divideBy) {
  const auto c = ctx("all_reduce_coalesced");
  if (tensors.empty()) {
    return WorkHSDP::completed(rank_, OpType::ALLREDUCE_COALESCED, {});
  }
  auto& r = route(c, tensors[0]);
  for (const auto& t : tensors) {
    // Gloo and NCCL refuse sparse tensors too; say what does serve them.
    HSDP_CHECK_VALUE(
        !t.is_sparse(),
        c,
        "sparse tensors are not supported here; all_reduce serves them, one tensor per call");
    checkSameDevice(c, tensors[0], t, "a tensor");
  }
  if (r.caps().nativeCoalescing) {
    return allreduceNative(r, tensors, op, bucketBytes, asyncOp, divideBy);
  }
  struct Pending {
    Bucket bucket;
    ReducePlan plan;
  };
  auto pending = std::make_shared<std::vector<Pending>>();
  for (const auto& members : groupByDtype(tensors)) {
    auto plan = planReduce(c, op, tensors[members[0]].scalar_type(), size_, divideBy);
    for (auto& bucket : packBuckets(tensors, members, bucketBytes, *staging_)) {
      pending->push_back({std::move(bucket), plan});
    }
  }
  const auto traced = recordCollective(c, pending->size(), bytesOf(tensors));
  bool shmServes = onShm(tensors);
  for (const auto& p : *pending) {
    shmServes = shmServes && shmReduction(p.plan, p.bucket.flat.scalar_type());
  }
  if (shmServes) {
    // One task: every bucket is reduced (scale fused) and unpacked in order.
    return track(runShm(OpType::ALLREDUCE_COALESCED, asyncOp, tensors, [this, pending, tensors] {
      for (const auto& p : *pending) {
        auto red = *shmReduction(p.plan, p.bucket.flat.scalar_type());
        engine_->allReduce(
            "all_reduce_coalesced",
            p.bucket.flat.data_ptr(),
            p.bucket.flat.numel(),
            red.dtype,
            red.op,
            red.scale);
        p.bucket.unpack(tensors);
        staging_->release(p.bucket.staging);
      }
    }));
  }
  std::vector<WorkPtr> works;
  for (auto& p : *pending) {
    c10d::AllreduceOptions innerOpts;
    innerOpts.reduceOp = p.plan.innerOp;
    innerOpts.asyncOp = asyncOp;
    std::vector<at::Tensor> flat{p.bucket.flat};
    works.push_back(r.backend().allreduce(flat, innerOpts));
  }
  return track(r.finish(
      OpType::ALLREDUCE_COALESCED,
      asyncOp,
      std::move(works),
      tensors,
      [pending, tensors, staging = staging_] {
        for (const auto& p : *pending) {
          p.plan.post.apply(p.bucket.flat);
          p.bucket.unpack(tensors);
          staging->release(p.bucket.staging);
        }
      }));
}

WorkPtr ProcessGroupHSDP::allreduceNative(
    InnerRoute& r,
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int64_t bucketBytes,
    bool asyncOp,
    double divideBy) {
  // One inner coalesced all-reduce per bucket, each in one launch (NCCL's
  // group call), on the callers' tensors: nothing is packed.
  const auto c = ctx("all_reduce_coalesced");
  std::vector<WorkPtr> works;
  std::vector<std::function<void()>> posts;
  std::vector<at::Tensor> staged;
  size_t buckets = 0;
  for (const auto& members : groupByDtype(tensors)) {
    auto plan =
        planReduce(c, op, tensors[members[0]].scalar_type(), size_, divideBy, r.caps().nativeScale);
    for (const auto& bucket : planBuckets(tensors, members, bucketBytes)) {
      std::vector<at::Tensor> flats;
      for (size_t i : bucket) {
        auto arg = FlatArg::of(tensors[i]);
        flats.push_back(realView(arg.flat));
        if (arg.staged()) {
          staged.push_back(arg.flat);
        }
        if (auto post = scaleAndCopyBack(plan.post, arg)) {
          posts.push_back(std::move(post));
        }
      }
      c10d::AllreduceCoalescedOptions innerOpts;
      innerOpts.reduceOp = plan.innerOp;
      innerOpts.asyncOp = asyncOp;
      works.push_back(r.backend().allreduce_coalesced(flats, innerOpts));
      ++buckets;
    }
  }
  const auto traced = recordCollective(c, buckets, bytesOf(tensors));
  return track(r.finish(
      OpType::ALLREDUCE_COALESCED,
      asyncOp,
      std::move(works),
      tensors,
      inOrder(std::move(posts)),
      std::move(staged)));
}

WorkPtr ProcessGroupHSDP::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return allreduceBucketed(tensors, opts.reduceOp, /*bucketBytes=*/0, opts.asyncOp);
}

WorkPtr
ProcessGroupHSDP::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const auto c = ctx("reduce");
  checkOne(c, tensors);
  checkRank(c, opts.rootRank, "root");
  checkRootTensor(c, opts.rootTensor, tensors);
  auto& r = route(c, tensors[0]);
  auto plan =
      planReduce(c, opts.reduceOp, tensors[0].scalar_type(), size_, 1.0, r.caps().nativeScale);
  c10d::ReduceOptions innerOpts = opts;
  innerOpts.reduceOp = plan.innerOp;
  const auto traced = recordCollective(c, 1, bytesOf(tensors));
  auto arg = FlatArg::of(tensors[0]);
  std::vector<at::Tensor> io{arg.flat};
  auto work = r.backend().reduce(io, innerOpts);
  // Only the root holds the reduction; the others' buffers are scratch.
  const auto post = rank_ == opts.rootRank ? plan.post : DeferredScale::none();
  return track(r.finish(
      OpType::REDUCE, opts.asyncOp, {work}, {arg.user}, scaleAndCopyBack(post, arg), {arg.flat}));
}

WorkPtr ProcessGroupHSDP::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const auto c = ctx("all_gather");
  checkNotEmpty(c, inputs);
  if (!oneDense(inputs)) {
    auto& r = route(c, inputs[0]);
    const auto traced = recordCollective(c, 1, bytesOf(inputs));
    auto work = r.backend().allgather(outputs, inputs, opts);
    std::vector<at::Tensor> outs;
    for (const auto& list : outputs) {
      outs.insert(outs.end(), list.begin(), list.end());
    }
    return track(r.finish(OpType::ALLGATHER, opts.asyncOp, {work}, outs, {}, inputs));
  }
  checkPerRankList(c, outputs, inputs[0], "output tensor");
  auto& r = route(c, inputs[0]);
  const auto traced = recordCollective(c, 1, bytesOf(inputs));
  if (onShm(inputs) && onShm(outputs[0])) {
    auto in = inputs[0];
    auto outs = outputs[0];
    return track(runShm(OpType::ALLGATHER, opts.asyncOp, outs, [this, in, outs] {
      auto flat = at::empty({size_ * in.numel()}, in.options());
      const auto c = in.contiguous();
      engine_->allGather("all_gather", c.data_ptr(), flat.data_ptr(), c.nbytes());
      for (int r = 0; r < size_; ++r) {
        outs[r].copy_(flat.narrow(0, r * in.numel(), in.numel()).view(outs[r].sizes()));
      }
    }));
  }
  std::vector<FlatArg> args;
  std::vector<std::vector<at::Tensor>> flatOutputs(1);
  bool staged = false;
  for (const auto& out : outputs[0]) {
    args.push_back(FlatArg::of(out));
    flatOutputs[0].push_back(args.back().flat);
    staged = staged || args.back().staged();
  }
  std::vector<at::Tensor> flatInput{inputs[0].contiguous().view({-1})};
  auto work = r.backend().allgather(flatOutputs, flatInput, opts);
  std::function<void()> post;
  if (staged) {
    post = [args] {
      for (const auto& a : args) {
        a.copyBack();
      }
    };
  }
  auto keepAlive = flatOutputs[0];
  keepAlive.push_back(flatInput[0]);
  return track(r.finish(
      OpType::ALLGATHER, opts.asyncOp, {work}, outputs[0], std::move(post), std::move(keepAlive)));
}

WorkPtr ProcessGroupHSDP::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  const auto c = ctx("all_gather_into_tensor");
  checkSameDtype(c, input, output, "the output");
  checkSameDevice(c, input, output, "the output");
  checkNumel(c, output, input.numel() * size_, "the output (world size x input)");
  checkContiguous(c, output, "the output");
  auto& r = route(c, input);
  const auto traced = recordCollective(c, 1, bytesOf(input));
  if (onShm({&input, &output})) {
    return track(runShm(OpType::_ALLGATHER_BASE, opts.asyncOp, {output}, [this, input, output] {
      const auto in = input.contiguous(); // output is contiguous (checked)
      engine_->allGather("all_gather_into_tensor", in.data_ptr(), output.data_ptr(), in.nbytes());
    }));
  }
  auto in = input.contiguous().view({-1}); // output is contiguous (checked)
  auto out = output.view({-1});
  auto work = r.backend()._allgather_base(out, in, opts);
  return track(r.finish(OpType::_ALLGATHER_BASE, opts.asyncOp, {work}, {output}, {}, {in}));
}

WorkPtr ProcessGroupHSDP::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const auto c = ctx("all_gather_into_tensor_coalesced");
  checkCoalescedPairs(c, inputs, outputs, /*gather=*/true);
  if (inputs.empty()) {
    return WorkHSDP::completed(rank_, OpType::COALESCED, {});
  }
  for (const auto& t : inputs) {
    checkSameDevice(c, inputs[0], t, "an input");
  }
  auto& r = route(c, inputs[0]);
  const auto inputBytes = bytesOf(inputs);
  const bool shm = onShm(inputs) && onShm(outputs);
  const auto traced = recordCollective(c, 1, inputBytes);
  if (r.caps().nativeCoalescing) {
    // One launch of the callers' tensors (outputs are contiguous: checked).
    std::vector<at::Tensor> ins, outs;
    for (size_t i = 0; i < inputs.size(); ++i) {
      ins.push_back(realView(inputs[i].contiguous().view({-1})));
      outs.push_back(realView(outputs[i].view({-1})));
    }
    auto work = r.backend().allgather_into_tensor_coalesced(outs, ins, opts);
    return track(r.finish(OpType::COALESCED, opts.asyncOp, {work}, outputs, {}, ins));
  }
  if (shm && engine_->gathersPieces(inputs.size(), inputBytes)) {
    // Peers read every input where it is and write it where it goes.
    return track(runShm(OpType::COALESCED, opts.asyncOp, outputs, [this, inputs, outputs] {
      std::vector<shm::Span> mine;
      std::vector<std::vector<shm::Span>> dests(size_);
      std::vector<at::Tensor> staged; // keeps contiguous copies alive
      for (size_t i = 0; i < inputs.size(); ++i) {
        const size_t bytes = inputs[i].nbytes();
        staged.push_back(inputs[i].contiguous());
        mine.push_back({static_cast<char*>(staged.back().data_ptr()), bytes});
        for (int q = 0; q < size_; ++q) {
          dests[q].push_back({static_cast<char*>(outputs[i].data_ptr()) + q * bytes, bytes});
        }
      }
      engine_->allGatherPieces("all_gather_into_tensor_coalesced", mine, dests);
    }));
  }
  auto pack = std::make_shared<AllGatherPack>(packAllGather(inputs, rank_, size_, *staging_));
  if (shm) {
    return track(runShm(OpType::COALESCED, opts.asyncOp, outputs, [this, pack, outputs] {
      engine_->allGather(
          "all_gather_into_tensor_coalesced",
          pack->input.data_ptr(),
          pack->output.data_ptr(),
          pack->input.nbytes());
      pack->unpack(outputs, size_);
      staging_->release(pack->staging);
    }));
  }
  auto work = r.backend()._allgather_base(pack->output, pack->input, opts);
  return track(r.finish(
      OpType::COALESCED,
      opts.asyncOp,
      {work},
      outputs,
      [pack, outputs, size = size_, staging = staging_] {
        pack->unpack(outputs, size);
        staging->release(pack->staging);
      }));
}

WorkPtr ProcessGroupHSDP::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const auto c = ctx("all_gather_coalesced");
  HSDP_CHECK_VALUE(
      outputTensorLists.size() == static_cast<size_t>(size_),
      c,
      "expected ",
      size_,
      " output lists (one per rank), got ",
      outputTensorLists.size());
  for (const auto& list : outputTensorLists) {
    HSDP_CHECK_VALUE(
        list.size() == inputs.size(),
        c,
        "an output list has ",
        list.size(),
        " tensors; expected one per input (",
        inputs.size(),
        ")");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkSameDtype(c, inputs[i], list[i], "an output");
      checkSameDevice(c, inputs[0], list[i], "an output");
      checkNumel(c, list[i], inputs[i].numel(), "an output");
    }
  }
  if (inputs.empty()) {
    return WorkHSDP::completed(rank_, OpType::ALLGATHER_COALESCED, {});
  }
  // The fused all-gather into one flat [W * n_i] buffer per input (one
  // collective on every route), then each rank's slice copied out.
  std::vector<at::Tensor> gathered;
  for (const auto& in : inputs) {
    gathered.push_back(at::empty({size_ * in.numel()}, in.options()));
  }
  c10d::AllgatherOptions fusedOpts = opts;
  fusedOpts.asyncOp = true;
  auto& r = route(c, inputs[0]);
  auto work = allgather_into_tensor_coalesced(gathered, inputs, fusedOpts);
  std::vector<at::Tensor> outputs;
  for (const auto& list : outputTensorLists) {
    outputs.insert(outputs.end(), list.begin(), list.end());
  }
  return track(r.finish(
      OpType::ALLGATHER_COALESCED,
      opts.asyncOp,
      {work},
      outputs,
      [gathered, outputTensorLists] {
        for (size_t q = 0; q < outputTensorLists.size(); ++q) {
          for (size_t i = 0; i < gathered.size(); ++i) {
            const auto& out = outputTensorLists[q][i];
            out.copy_(gathered[i].narrow(0, q * out.numel(), out.numel()).view(out.sizes()));
          }
        }
      },
      gathered));
}

WorkPtr ProcessGroupHSDP::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const auto c = ctx("gather");
  checkOne(c, inputs);
  checkRank(c, opts.rootRank, "root");
  if (rank_ == opts.rootRank) {
    checkPerRankList(c, outputs, inputs[0], "output tensor");
  }
  auto& r = route(c, inputs[0]);
  const auto traced = recordCollective(c, 1, bytesOf(inputs));
  auto work = r.backend().gather(outputs, inputs, opts);
  return track(r.finish(
      OpType::GATHER, opts.asyncOp, {work}, inputs, {}, outputs.empty() ? inputs : outputs[0]));
}

WorkPtr ProcessGroupHSDP::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const auto c = ctx("scatter");
  checkOne(c, outputs);
  checkRank(c, opts.rootRank, "root");
  if (rank_ == opts.rootRank) {
    checkPerRankList(c, inputs, outputs[0], "input tensor");
  }
  auto& r = route(c, outputs[0]);
  const auto traced = recordCollective(c, 1, bytesOf(outputs));
  auto work = r.backend().scatter(outputs, inputs, opts);
  return track(r.finish(
      OpType::SCATTER, opts.asyncOp, {work}, outputs, {}, inputs.empty() ? outputs : inputs[0]));
}

WorkPtr ProcessGroupHSDP::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const auto c = ctx("reduce_scatter");
  checkOne(c, outputs);
  // Per-rank sizes may differ (rank q's output has inputs[q]'s size); the
  // engine's reduce-scatter has equal pieces, the inner backend has both.
  checkOneListPerRank(c, inputs, "input tensor");
  const bool even = std::all_of(inputs[0].begin(), inputs[0].end(), [&](const at::Tensor& in) {
    return in.numel() == outputs[0].numel();
  });
  if (even) {
    checkPerRankList(c, inputs, outputs[0], "input tensor");
  } else {
    checkNumel(c, inputs[0][rank_], outputs[0].numel(), "this rank's input tensor");
  }
  auto& r = route(c, outputs[0]);
  auto plan =
      planReduce(c, opts.reduceOp, outputs[0].scalar_type(), size_, 1.0, r.caps().nativeScale);
  const auto traced = recordCollective(c, 1, bytesOf(inputs[0]));
  if (auto red = shmReduction(plan, outputs[0].scalar_type());
      red && even && onShm(outputs) && onShm(inputs[0])) {
    auto out = outputs[0];
    auto ins = inputs[0];
    return track(runShm(OpType::REDUCE_SCATTER, opts.asyncOp, {out}, [this, out, ins, red = *red] {
      auto flat = at::cat(ins);
      onContiguous(out, [&](const at::Tensor& o) {
        engine_->reduceScatter(
            "reduce_scatter",
            flat.data_ptr(),
            o.data_ptr(),
            o.numel(),
            red.dtype,
            red.op,
            red.scale);
      });
    }));
  }
  c10d::ReduceScatterOptions innerOpts = opts;
  innerOpts.reduceOp = plan.innerOp;
  auto work = r.backend().reduce_scatter(outputs, inputs, innerOpts);
  std::function<void()> post;
  if (!plan.post.isNone()) {
    post = [t = outputs[0], post = plan.post] { post.apply(t); };
  }
  return track(
      r.finish(OpType::REDUCE_SCATTER, opts.asyncOp, {work}, outputs, std::move(post), inputs[0]));
}

WorkPtr ProcessGroupHSDP::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return reduceScatterImpl(output, input, opts, 1.0);
}

WorkPtr ProcessGroupHSDP::reduceScatterDividedBy(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceOp& op,
    double divideBy,
    bool asyncOp) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  opts.asyncOp = asyncOp;
  return reduceScatterImpl(output, input, opts, divideBy);
}

WorkPtr ProcessGroupHSDP::reduceScatterImpl(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts,
    double divideBy) {
  const auto c = ctx("reduce_scatter_tensor");
  checkSameDtype(c, input, output, "the output");
  checkSameDevice(c, input, output, "the output");
  checkNumel(c, input, output.numel() * size_, "the input (world size x output)");
  checkContiguous(c, input, "the input");
  auto& r = route(c, input);
  auto plan =
      planReduce(c, opts.reduceOp, input.scalar_type(), size_, divideBy, r.caps().nativeScale);
  const auto traced = recordCollective(c, 1, bytesOf(input));
  if (auto red = shmReduction(plan, input.scalar_type()); red && onShm({&input, &output})) {
    return track(runShm(
        OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, {output}, [this, input, output, red = *red] {
          onContiguous(output, [&](const at::Tensor& o) { // input is contiguous (checked)
            engine_->reduceScatter(
                "reduce_scatter_tensor",
                input.data_ptr(),
                o.data_ptr(),
                o.numel(),
                red.dtype,
                red.op,
                red.scale);
          });
        }));
  }
  c10d::ReduceScatterOptions innerOpts = opts;
  innerOpts.reduceOp = plan.innerOp;
  auto in = input.view({-1}); // contiguous (checked)
  auto arg = FlatArg::of(output);
  auto work = r.backend()._reduce_scatter_base(arg.flat, in, innerOpts);
  return track(r.finish(
      OpType::_REDUCE_SCATTER_BASE,
      opts.asyncOp,
      {work},
      {arg.user},
      scaleAndCopyBack(plan.post, arg),
      {arg.flat, in}));
}

WorkPtr ProcessGroupHSDP::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const auto c = ctx("reduce_scatter_tensor_coalesced");
  checkCoalescedPairs(c, inputs, outputs, /*gather=*/false);
  if (inputs.empty()) {
    return WorkHSDP::completed(rank_, OpType::COALESCED, {});
  }
  for (const auto& t : inputs) {
    checkSameDevice(c, inputs[0], t, "an input");
  }
  auto& r = route(c, inputs[0]);
  if (r.caps().nativeCoalescing) {
    // One inner coalesced call per dtype (a PREMUL_SUM factor is typed), on
    // the callers' tensors (outputs are contiguous: checked).
    std::vector<WorkPtr> works;
    std::vector<at::Tensor> ins;
    std::vector<std::function<void()>> posts;
    for (const auto& members : groupByDtype(inputs)) {
      auto plan = planReduce(
          c, opts.reduceOp, inputs[members[0]].scalar_type(), size_, 1.0, r.caps().nativeScale);
      std::vector<at::Tensor> groupIns, groupOuts;
      for (size_t i : members) {
        groupIns.push_back(realView(inputs[i].contiguous().view({-1})));
        groupOuts.push_back(realView(outputs[i].view({-1})));
      }
      ins.insert(ins.end(), groupIns.begin(), groupIns.end());
      if (!plan.post.isNone()) {
        posts.push_back([groupOuts, post = plan.post] {
          for (const auto& o : groupOuts) {
            post.apply(o);
          }
        });
      }
      c10d::ReduceScatterOptions innerOpts = opts;
      innerOpts.reduceOp = plan.innerOp;
      works.push_back(r.backend().reduce_scatter_tensor_coalesced(groupOuts, groupIns, innerOpts));
    }
    const auto traced = recordCollective(c, works.size(), bytesOf(inputs));
    return track(r.finish(
        OpType::COALESCED,
        opts.asyncOp,
        std::move(works),
        outputs,
        inOrder(std::move(posts)),
        std::move(ins)));
  }
  struct Pending {
    ReduceScatterPack pack;
    std::vector<at::Tensor> outputs;
    ReducePlan plan;
  };
  auto pending = std::make_shared<std::vector<Pending>>();
  bool shmServes = onShm(inputs) && onShm(outputs);
  for (const auto& members : groupByDtype(inputs)) {
    const auto dtype = inputs[members[0]].scalar_type();
    auto plan = planReduce(c, opts.reduceOp, dtype, size_);
    shmServes = shmServes && shmReduction(plan, dtype);
    std::vector<at::Tensor> ins, outs;
    for (size_t i : members) {
      ins.push_back(inputs[i]);
      outs.push_back(outputs[i]);
    }
    pending->push_back({packReduceScatter(ins, outs, size_, *staging_), std::move(outs), plan});
  }
  const auto traced = recordCollective(c, pending->size(), bytesOf(inputs));
  if (shmServes) {
    return track(runShm(OpType::COALESCED, opts.asyncOp, outputs, [this, pending] {
      for (const auto& p : *pending) {
        auto red = *shmReduction(p.plan, p.pack.input.scalar_type());
        engine_->reduceScatter(
            "reduce_scatter_tensor_coalesced",
            p.pack.input.data_ptr(),
            p.pack.output.data_ptr(),
            p.pack.output.numel(),
            red.dtype,
            red.op,
            red.scale);
        p.pack.unpack(p.outputs);
        staging_->release(p.pack.staging);
      }
    }));
  }
  std::vector<WorkPtr> works;
  for (auto& p : *pending) {
    c10d::ReduceScatterOptions innerOpts = opts;
    innerOpts.reduceOp = p.plan.innerOp;
    works.push_back(r.backend()._reduce_scatter_base(p.pack.output, p.pack.input, innerOpts));
  }
  return track(r.finish(
      OpType::COALESCED, opts.asyncOp, std::move(works), outputs, [pending, staging = staging_] {
        for (const auto& p : *pending) {
          p.plan.post.apply(p.pack.output);
          p.pack.unpack(p.outputs);
          staging->release(p.pack.staging);
        }
      }));
}

WorkPtr ProcessGroupHSDP::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  const auto c = ctx("all_to_all_single");
  checkSameDtype(c, input, output, "the output");
  checkSameDevice(c, input, output, "the output");
  for (auto* splits : {&outputSplitSizes, &inputSplitSizes}) {
    HSDP_CHECK_VALUE(
        splits->empty() || splits->size() == static_cast<size_t>(size_),
        c,
        "split sizes must be empty or have one entry per rank (",
        size_,
        "), got ",
        splits->size());
  }
  auto& r = route(c, input);
  const auto traced = recordCollective(c, 1, bytesOf(input));
  auto work = r.backend().alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
  return track(r.finish(OpType::ALLTOALL_BASE, opts.asyncOp, {work}, {output}, {}, {input}));
}

WorkPtr ProcessGroupHSDP::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  const auto c = ctx("all_to_all");
  HSDP_CHECK_VALUE(
      outputs.size() == static_cast<size_t>(size_) && inputs.size() == static_cast<size_t>(size_),
      c,
      "expected ",
      size_,
      " input and output tensors (one per rank), got ",
      inputs.size(),
      " and ",
      outputs.size());
  std::vector<int64_t> inSplits, outSplits;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(c, inputs[0], inputs[i], "an input");
    checkSameDtype(c, inputs[0], outputs[i], "an output");
    checkSameDevice(c, inputs[0], inputs[i], "an input");
    checkSameDevice(c, inputs[0], outputs[i], "an output");
    inSplits.push_back(inputs[i].numel());
    outSplits.push_back(outputs[i].numel());
  }
  auto& r = route(c, inputs[0]);
  const auto traced = recordCollective(c, 1, bytesOf(inputs));
  // Gloo's list all-to-all needs equal sizes; sending one flat buffer with
  // per-peer splits serves any sizes with a single inner collective.
  std::vector<at::Tensor> flatInputs;
  for (const auto& t : inputs) {
    flatInputs.push_back(t.reshape({-1}));
  }
  auto input = at::cat(flatInputs);
  auto output =
      at::empty({std::accumulate(outSplits.begin(), outSplits.end(), int64_t{0})}, input.options());
  // The inner backend may move from the split vectors it is given.
  auto innerOutSplits = outSplits;
  auto work = r.backend().alltoall_base(output, input, innerOutSplits, inSplits, opts);
  return track(r.finish(
      OpType::ALLTOALL,
      opts.asyncOp,
      {work},
      outputs,
      [output, outputs, outSplits] {
        int64_t off = 0;
        for (size_t i = 0; i < outputs.size(); ++i) {
          outputs[i].copy_(output.narrow(0, off, outSplits[i]).view(outputs[i].sizes()));
          off += outSplits[i];
        }
      },
      {input, output}));
}

// Point-to-point calls are counted in comm_stats but are not collectives:
// they leave the sequence number alone, as on gloo.
WorkPtr ProcessGroupHSDP::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const auto c = ctx("send");
  checkUsable(c);
  checkOne(c, tensors);
  checkRank(c, dstRank, "destination");
  auto& r = route(c, tensors[0]);
  stats_.record(c.op, 1, bytesOf(tensors));
  return track(r.finish(OpType::SEND, true, {r.backend().send(tensors, dstRank, tag)}, tensors));
}

WorkPtr ProcessGroupHSDP::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const auto c = ctx("recv");
  checkUsable(c);
  checkOne(c, tensors);
  checkRank(c, srcRank, "source");
  auto& r = route(c, tensors[0]);
  stats_.record(c.op, 1, bytesOf(tensors));
  return track(r.finish(OpType::RECV, true, {r.backend().recv(tensors, srcRank, tag)}, tensors));
}

WorkPtr ProcessGroupHSDP::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const auto c = ctx("recv");
  checkUsable(c);
  checkOne(c, tensors);
  auto& r = route(c, tensors[0]);
  stats_.record(c.op, 1, bytesOf(tensors));
  return track(
      r.finish(OpType::RECVANYSOURCE, true, {r.backend().recvAnysource(tensors, tag)}, tensors));
}

WorkPtr ProcessGroupHSDP::barrier(const c10d::BarrierOptions& opts) {
  pending.device.reset(); // it picks no route: no device of an earlier call's
  const auto traced = recordCollective(ctx("barrier"), 1, 0);
  // NCCL's barrier is an all-reduce on the device followed by a host wait
  // for the current stream (ProcessGroupNCCL::barrier): when it returns,
  // every rank's GPU work issued before it has run. On a group that serves
  // CUDA the same holds here: this rank's current stream is waited for,
  // then the processes meet on the CPU engine, which serves every barrier.
  if (auto device = barrierDevice(opts); device && cuda_) {
    c10::impl::VirtualGuardImpl impl(device->type());
    impl.getStream(*device).synchronize();
  }
  if (engine_) {
    return track(
        runShm(OpType::BARRIER, opts.asyncOp, {}, [this] { engine_->barrier("barrier"); }));
  }
  return track(cpu_->finish(OpType::BARRIER, opts.asyncOp, {cpu_->backend().barrier(opts)}, {}));
}

std::optional<at::Device> ProcessGroupHSDP::barrierDevice(const c10d::BarrierOptions& opts) const {
  // The device NCCL would pick (dist.barrier's order): the one named by
  // device_ids, else the group's bound device, else the call's.
  if (!opts.device_ids.empty()) {
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(opts.device_ids.front()));
  }
  if (auto bound = getBoundDeviceId(); bound && bound->is_cuda()) {
    return bound;
  }
  if (opts.device && opts.device->is_cuda()) {
    return opts.device;
  }
  return std::nullopt;
}

void ProcessGroupHSDP::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  stats_.record("monitored_barrier", 1, 0);
  cpu_->backend().monitoredBarrier(opts, waitAllRanks);
}

} // namespace hsdp
