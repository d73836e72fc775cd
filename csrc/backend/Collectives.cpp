// Every c10d op of ProcessGroupHSDP: validate (Checks.hpp), plan for the
// route that serves it (Plan.hpp), issue on that route (routes/Route.hpp).

#include "backend/ProcessGroupHSDP.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include "backend/Checks.hpp"
#include "backend/WorkHSDP.hpp"

#include <iterator>
#include <numeric>

namespace hsdp {

using c10d::OpType;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// How every call goes down: a Call (who, what), the inner route of its
// tensors' device, a plan for the route that serves it, then the route's
// completion, recorded in the flight record and, inside a coalescing
// block, in the block.

Call ProcessGroupHSDP::begin(
    const char* op,
    OpType type,
    bool asyncOp,
    std::chrono::milliseconds timeout) const {
  return Call{.ctx = {rank_, size_, op}, .type = type, .asyncOp = asyncOp, .timeout = timeout};
}

InnerRoute& ProcessGroupHSDP::inner(Call& call, const at::Tensor& t) {
  if (t.device().is_cpu()) {
    if (cpu_->ordersOnStreams()) { // the NCCL-contract double; Gloo has nothing to order after
      cpu_->beforeIssue();
    }
    return *cpu_;
  }
  if (t.device().is_cuda()) {
    HSDP_CHECK(
        cuda_,
        call.ctx,
        "got a tensor on ",
        t.device(),
        " but this process group was created without CUDA (no GPU was "
        "visible to torch when it was created)");
    cuda_->beforeIssue();
    call.device = t.device();
    lastCudaDevice_.store(t.device().index(), std::memory_order_relaxed);
    return *cuda_;
  }
  HSDP_CHECK(
      false,
      call.ctx,
      "tensors on ",
      t.device(),
      " are not supported; hsdp serves cpu and cuda tensors");
}

bool ProcessGroupHSDP::shmServes(const std::vector<at::Tensor>& tensors) const {
  return shm_ && shm_->serves(tensors);
}

bool ProcessGroupHSDP::shmTakes(
    const std::vector<at::Tensor>& tensors,
    std::vector<DtypeGroup>& groups) const {
  return std::all_of(groups.begin(), groups.end(), [&](auto& g) {
    return shm_->takes(g.reduce, tensors[g.members[0]].scalar_type());
  });
}

Route& ProcessGroupHSDP::shmOr(InnerRoute& inner, bool shmServes) {
  return shmServes ? static_cast<Route&>(*shm_) : inner;
}

ProcessGroupHSDP::RoutedReduction ProcessGroupHSDP::routeReduction(
    const Call& call,
    InnerRoute& inner,
    bool shmServesTensors,
    const c10d::ReduceOp& op,
    const at::TensorOptions& options,
    int contributions,
    double divideBy) {
  if (shmServesTensors) {
    auto reduce =
        planReduce(call.ctx, op, options, contributions, divideBy, shm_->scalesNatively());
    if (shm_->takes(reduce, options.dtype().toScalarType())) {
      return {*shm_, std::move(reduce)};
    }
  }
  return {
      inner, planReduce(call.ctx, op, options, contributions, divideBy, inner.scalesNatively())};
}

ProcessGroupHSDP::RoutedGroups ProcessGroupHSDP::routeGroups(
    const Call& call,
    InnerRoute& inner,
    bool shmServesTensors,
    const std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    double divideBy) {
  if (shmServesTensors) {
    auto groups = groupByDtype(call.ctx, tensors, op, size_, divideBy, shm_->scalesNatively());
    if (shmTakes(tensors, groups)) {
      return {*shm_, std::move(groups)};
    }
  }
  return {inner, groupByDtype(call.ctx, tensors, op, size_, divideBy, inner.scalesNatively())};
}

TracedCall
ProcessGroupHSDP::record(Call& call, uint64_t collectives, uint64_t bytes, const Route& route) {
  checkUsable(call.ctx);
  stats_.record(call.ctx.op, collectives, bytes);
  call.seq = sequence_.fetch_add(1, std::memory_order_relaxed) + 1;
  if (timeoutExtension_->any()) {
    // Issued while an extension is active: the call waits that much longer
    // than its timeout (the group's, unless its options set one), on the
    // inner backend too, and the first such call releases it when done.
    const auto issued = timeoutExtension_->issue();
    call.ownedExtension = issued.owned;
    const auto base = call.timeout == c10d::kUnsetTimeout ? options_->timeout : call.timeout;
    call.timeout = base + issued.active;
  }
  trace_->started(call.seq, call.ctx.op, bytes, route.recordedAs());
  return TracedCall(trace_, recorderStreams_, call);
}

WorkPtr ProcessGroupHSDP::issue(Call& call, Route& route, Plan&& plan, uint64_t bytes) {
  auto traced = record(call, plan.collectives.size(), bytes, route);
  Completion done;
  try {
    done = route.issue(traced.call(), std::move(plan));
  } catch (...) {
    releaseExtensionAfter(traced.call(), {});
    throw;
  }
  return handOver(traced, std::move(done));
}

WorkPtr ProcessGroupHSDP::forward(
    Call& call,
    InnerRoute& route,
    uint64_t bytes,
    const std::function<WorkPtr(c10d::Backend&)>& op,
    Plan done) {
  auto traced = record(call, 1, bytes, route);
  WorkPtr work;
  try {
    work = op(route.backend());
  } catch (...) {
    releaseExtensionAfter(traced.call(), {});
    throw;
  }
  return handOver(traced, route.finish(traced.call(), {work}, std::move(done)));
}

void ProcessGroupHSDP::releaseExtensionAfter(const Call& call, const WorkPtr& work) {
  const auto owned = call.ownedExtension;
  if (owned.count() <= 0) {
    return;
  }
  if (work && !work->isCompleted()) {
    try {
      // Not uses_future: that would take the next stream of c10's pool per op
      // and make it wait for the op (ivalue::Future::invokeCallback), for a
      // callback that touches no tensor.
      work->getFuture()->addCallback(
          [extension = timeoutExtension_, owned](c10::ivalue::Future&) {
            extension->release(owned);
          },
          /*uses_future=*/false);
      return;
    } catch (const c10::Error&) {
      // A Work without a future: released now, as a synchronous call's.
    }
  }
  timeoutExtension_->release(owned);
}

WorkPtr ProcessGroupHSDP::handOver(TracedCall& traced, Completion done) {
  bool inBlock = false;
  // Outside a block (most calls) no lock: a block is opened on the thread
  // that issues its calls, which sees its own store.
  if (coalescing_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(coalescingMutex_);
    inBlock = coalescing_.load(std::memory_order_relaxed);
    if (inBlock && done.work) {
      coalescedWorks_.push_back(done.work);
    }
  }
  const Call& call = traced.call();
  auto work = traced.follow(std::move(done), inBlock);
  releaseExtensionAfter(call, work);
  if (!work && !call.asyncOp) {
    return WorkHSDP::ofSynchronousCall(rank_, call.type);
  }
  return work;
}

WorkPtr ProcessGroupHSDP::untraced(const Call& call, Completion done) {
  TracedCall none(trace_, recorderStreams_, call); // seq 0: no entry
  return handOver(none, std::move(done));
}

namespace {

// The plan that finishes an op issued on the inner backend as it is: its
// outputs (the future's value), a post-step, the buffers that outlive it.
Plan issuedAsIs(
    std::vector<at::Tensor> outputs,
    std::function<void()> post = {},
    std::vector<at::Tensor> keepAlive = {}) {
  return Plan{
      .post = std::move(post),
      .outputs =
          Tensors(std::make_move_iterator(outputs.begin()), std::make_move_iterator(outputs.end())),
      .keepAlive = std::move(keepAlive)};
}

// The deferred scale of a reduction on tensors the inner backend reduced
// as they are; empty when there is none.
std::function<void()> scaleAfter(const ReducePlan& plan, std::vector<at::Tensor> tensors) {
  if (plan.post.isNone()) {
    return {};
  }
  return [tensors = std::move(tensors), scale = plan.post] {
    for (const auto& t : tensors) {
      scale.apply(t);
    }
  };
}

} // namespace

WorkPtr
ProcessGroupHSDP::broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
  auto call = begin("broadcast", OpType::BROADCAST, opts.asyncOp, opts.timeout);
  checkNotEmpty(call.ctx, tensors);
  checkRank(call.ctx, opts.rootRank, "root");
  checkRootTensor(call.ctx, opts.rootTensor, tensors);
  auto& r = inner(call, tensors[0]);
  if (!oneDense(tensors)) {
    return forward(
        call,
        r,
        bytesOf(tensors),
        [&](auto& b) { return b.broadcast(tensors, opts); },
        issuedAsIs(tensors, {}, tensors));
  }
  auto plan = planInPlace(Kind::Broadcast, tensors[0], noReduction(), opts.rootRank);
  return issue(call, shmOr(r, shmServes(tensors)), std::move(plan), bytesOf(tensors));
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
  auto call = begin("all_reduce", OpType::ALLREDUCE, opts.asyncOp, opts.timeout);
  checkNotEmpty(call.ctx, tensors);
  for (const auto& t : tensors) {
    checkSameDevice(call.ctx, tensors[0], t, "a tensor");
  }
  auto& r = inner(call, tensors[0]);
  // AVG averages every contribution: all tensors of all ranks.
  const int contributions = size_ * static_cast<int>(tensors.size());
  if (!oneDense(tensors)) {
    auto reduce = planReduce(
        call.ctx, opts.reduceOp, tensors[0].options(), contributions, divideBy, r.scalesNatively());
    c10d::AllreduceOptions innerOpts = opts;
    innerOpts.reduceOp = reduce.innerOp;
    return forward(
        call,
        r,
        bytesOf(tensors),
        [&](auto& b) { return b.allreduce(tensors, innerOpts); },
        issuedAsIs(tensors, scaleAfter(reduce, tensors), tensors));
  }
  auto routed = routeReduction(
      call, r, shmServes(tensors), opts.reduceOp, tensors[0].options(), contributions, divideBy);
  auto plan = planInPlace(Kind::AllReduce, tensors[0], std::move(routed.reduce));
  return issue(call, routed.route, std::move(plan), bytesOf(tensors));
}

WorkPtr ProcessGroupHSDP::allreduceBucketed(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int64_t bucketBytes,
    bool asyncOp,
    double divideBy) {
  auto call = begin("all_reduce_coalesced", OpType::ALLREDUCE_COALESCED, asyncOp);
  if (tensors.empty()) {
    return WorkHSDP::completed(rank_, call.type, {});
  }
  auto& r = inner(call, tensors[0]);
  for (const auto& t : tensors) {
    // Gloo and NCCL refuse sparse tensors too; say what does serve them.
    HSDP_CHECK_VALUE(
        !t.is_sparse(),
        call.ctx,
        "sparse tensors are not supported here; all_reduce serves them, one tensor per call");
    checkSameDevice(call.ctx, tensors[0], t, "a tensor");
  }
  auto routed = routeGroups(call, r, shmServes(tensors), tensors, op, divideBy);
  auto plan = planAllReduceBuckets(tensors, routed.groups, bucketBytes, routed.route, staging_);
  return issue(call, routed.route, std::move(plan), bytesOf(tensors));
}

WorkPtr ProcessGroupHSDP::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return allreduceBucketed(tensors, opts.reduceOp, /*bucketBytes=*/0, opts.asyncOp);
}

WorkPtr
ProcessGroupHSDP::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  auto call = begin("reduce", OpType::REDUCE, opts.asyncOp, opts.timeout);
  checkOne(call.ctx, tensors);
  checkRank(call.ctx, opts.rootRank, "root");
  checkRootTensor(call.ctx, opts.rootTensor, tensors);
  auto& r = inner(call, tensors[0]);
  auto reduce =
      planReduce(call.ctx, opts.reduceOp, tensors[0].options(), size_, 1.0, r.scalesNatively());
  auto plan = planInPlace(Kind::Reduce, tensors[0], std::move(reduce), opts.rootRank);
  return issue(call, r, std::move(plan), bytesOf(tensors));
}

WorkPtr ProcessGroupHSDP::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto call = begin("all_gather", OpType::ALLGATHER, opts.asyncOp, opts.timeout);
  checkNotEmpty(call.ctx, inputs);
  if (!oneDense(inputs)) {
    std::vector<at::Tensor> outs;
    for (const auto& list : outputs) {
      outs.insert(outs.end(), list.begin(), list.end());
    }
    return forward(
        call,
        inner(call, inputs[0]),
        bytesOf(inputs),
        [&](auto& b) { return b.allgather(outputs, inputs, opts); },
        issuedAsIs(outs, {}, inputs));
  }
  checkPerRankList(call.ctx, outputs, inputs[0], "output tensor");
  auto& r = inner(call, inputs[0]);
  const bool shm = shmServes(inputs) && shmServes(outputs[0]);
  return issue(call, shmOr(r, shm), planAllGatherToList(inputs[0], outputs[0]), bytesOf(inputs));
}

WorkPtr ProcessGroupHSDP::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  auto call = begin("all_gather_into_tensor", OpType::_ALLGATHER_BASE, opts.asyncOp, opts.timeout);
  checkSameDtype(call.ctx, input, output, "the output");
  checkSameDevice(call.ctx, input, output, "the output");
  checkNumel(call.ctx, output, input.numel() * size_, "the output (world size x input)");
  checkContiguous(call.ctx, output, "the output");
  auto& r = inner(call, input);
  auto& route = shmOr(r, shmServes({input, output}));
  return issue(call, route, planAllGather(input, output), bytesOf(input));
}

WorkPtr ProcessGroupHSDP::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto call =
      begin("all_gather_into_tensor_coalesced", OpType::COALESCED, opts.asyncOp, opts.timeout);
  checkCoalescedPairs(call.ctx, inputs, outputs, /*gather=*/true);
  if (inputs.empty()) {
    return WorkHSDP::completed(rank_, call.type, {});
  }
  for (const auto& t : inputs) {
    checkSameDevice(call.ctx, inputs[0], t, "an input");
  }
  auto& r = inner(call, inputs[0]);
  auto& route = shmOr(r, shmServes(inputs) && shmServes(outputs));
  auto plan = planAllGatherCoalesced(inputs, outputs, route, rank_, size_, staging_);
  return issue(call, route, std::move(plan), bytesOf(inputs));
}

WorkPtr ProcessGroupHSDP::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputTensorLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  auto call = begin("all_gather_coalesced", OpType::ALLGATHER_COALESCED, opts.asyncOp);
  checkOutputLists(call.ctx, outputTensorLists, inputs);
  if (inputs.empty()) {
    return WorkHSDP::completed(rank_, call.type, {});
  }
  // The fused all-gather into one flat [W * n_i] buffer per input (one
  // collective on every route, with its own flight-record entry), then
  // each rank's slice copied out.
  std::vector<at::Tensor> gathered;
  for (const auto& in : inputs) {
    gathered.push_back(at::empty({size_ * in.numel()}, in.options()));
  }
  c10d::AllgatherOptions fusedOpts = opts;
  fusedOpts.asyncOp = true;
  auto& r = inner(call, inputs[0]);
  auto work = allgather_into_tensor_coalesced(gathered, inputs, fusedOpts);
  std::vector<at::Tensor> outputs;
  for (const auto& list : outputTensorLists) {
    outputs.insert(outputs.end(), list.begin(), list.end());
  }
  auto copyOut = [gathered, outputTensorLists] {
    for (size_t q = 0; q < outputTensorLists.size(); ++q) {
      for (size_t i = 0; i < gathered.size(); ++i) {
        const auto& out = outputTensorLists[q][i];
        out.copy_(gathered[i].narrow(0, q * out.numel(), out.numel()).view(out.sizes()));
      }
    }
  };
  return untraced(call, r.finish(call, {work}, issuedAsIs(outputs, copyOut, gathered)));
}

WorkPtr ProcessGroupHSDP::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  auto call = begin("gather", OpType::GATHER, opts.asyncOp, opts.timeout);
  checkRooted(call.ctx, opts.rootRank, inputs, outputs, "output tensor");
  return forward(
      call,
      inner(call, inputs[0]),
      bytesOf(inputs),
      [&](auto& b) { return b.gather(outputs, inputs, opts); },
      issuedAsIs(inputs, {}, outputs.empty() ? inputs : outputs[0]));
}

#if HSDP_TORCH_HAS_GATHER_SINGLE
WorkPtr ProcessGroupHSDP::gather_single(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::GatherOptions& opts) {
  auto call = begin("gather_single", OpType::GATHER, opts.asyncOp, opts.timeout);
  checkRank(call.ctx, opts.rootRank, "root");
  const bool root = opts.rootRank == rank_;
  if (root) {
    checkSameDtype(call.ctx, input, output, "the output");
    checkSameDevice(call.ctx, input, output, "the output");
    checkNumel(call.ctx, output, input.numel() * size_, "the output (world size x input)");
    checkContiguous(call.ctx, output, "the output");
  }
  auto& r = inner(call, input);
  if (input.is_cuda()) {
    return forward(
        call,
        r,
        bytesOf(input),
        [&](auto& b) { return b.gather_single(output, input, opts); },
        issuedAsIs({output}, {}, {input}));
  }
  if (shmServes({input})) {
    // The engine has no gather of its own: each rank publishes its part
    // once either way, and the root reads them all. Decided by the input
    // alone, as on every rank (the root's output has its dtype and device).
    auto gathered = root ? output : at::empty({input.numel() * size_}, input.options());
    return issue(call, *shm_, planAllGather(input, gathered), bytesOf(input));
  }
  std::vector<std::vector<at::Tensor>> outputs;
  std::vector<at::Tensor> landed;
  if (root) {
    const auto flat = output.view({-1});
    const int64_t n = input.numel();
    auto& parts = outputs.emplace_back();
    for (int q = 0; q < size_; ++q) {
      parts.push_back(flat.narrow(0, q * n, n).view(input.sizes()));
    }
    landed.push_back(output);
  }
  std::vector<at::Tensor> inputs{input};
  return forward(
      call,
      r,
      bytesOf(input),
      [&](auto& b) { return b.gather(outputs, inputs, opts); },
      issuedAsIs(std::move(landed), {}, {input}));
}
#endif

WorkPtr ProcessGroupHSDP::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  auto call = begin("scatter", OpType::SCATTER, opts.asyncOp, opts.timeout);
  checkRooted(call.ctx, opts.rootRank, outputs, inputs, "input tensor");
  return forward(
      call,
      inner(call, outputs[0]),
      bytesOf(outputs),
      [&](auto& b) { return b.scatter(outputs, inputs, opts); },
      issuedAsIs(outputs, {}, inputs.empty() ? outputs : inputs[0]));
}

WorkPtr ProcessGroupHSDP::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto call = begin("reduce_scatter", OpType::REDUCE_SCATTER, opts.asyncOp, opts.timeout);
  checkOne(call.ctx, outputs);
  // Per-rank sizes may differ (rank q's output has inputs[q]'s size); the
  // engine's reduce-scatter has equal pieces, the inner backend has both.
  checkOneListPerRank(call.ctx, inputs, "input tensor");
  const bool even = std::all_of(inputs[0].begin(), inputs[0].end(), [&](const at::Tensor& in) {
    return in.numel() == outputs[0].numel();
  });
  if (even) {
    checkPerRankList(call.ctx, inputs, outputs[0], "input tensor");
  } else {
    checkNumel(call.ctx, inputs[0][rank_], outputs[0].numel(), "this rank's input tensor");
  }
  auto& r = inner(call, outputs[0]);
  auto routed = routeReduction(
      call,
      r,
      even && shmServes(outputs) && shmServes(inputs[0]),
      opts.reduceOp,
      outputs[0].options(),
      size_);
  auto& reduce = routed.reduce;
  if (&routed.route != static_cast<Route*>(&r)) { // the engine's equal pieces
    auto plan = planReduceScatterFromList(inputs[0], outputs[0], std::move(reduce));
    return issue(call, routed.route, std::move(plan), bytesOf(inputs[0]));
  }
  c10d::ReduceScatterOptions innerOpts = opts;
  innerOpts.reduceOp = reduce.innerOp;
  return forward(
      call,
      r,
      bytesOf(inputs[0]),
      [&](auto& b) { return b.reduce_scatter(outputs, inputs, innerOpts); },
      issuedAsIs(outputs, scaleAfter(reduce, {outputs[0]}), inputs[0]));
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
  auto call =
      begin("reduce_scatter_tensor", OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, opts.timeout);
  checkSameDtype(call.ctx, input, output, "the output");
  checkSameDevice(call.ctx, input, output, "the output");
  checkNumel(call.ctx, input, output.numel() * size_, "the input (world size x output)");
  checkContiguous(call.ctx, input, "the input");
  auto& r = inner(call, input);
  auto routed = routeReduction(
      call, r, shmServes({input, output}), opts.reduceOp, input.options(), size_, divideBy);
  auto plan = planReduceScatter(input, output, std::move(routed.reduce));
  return issue(call, routed.route, std::move(plan), bytesOf(input));
}

WorkPtr ProcessGroupHSDP::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  auto call =
      begin("reduce_scatter_tensor_coalesced", OpType::COALESCED, opts.asyncOp, opts.timeout);
  checkCoalescedPairs(call.ctx, inputs, outputs, /*gather=*/false);
  if (inputs.empty()) {
    return WorkHSDP::completed(rank_, call.type, {});
  }
  for (const auto& t : inputs) {
    checkSameDevice(call.ctx, inputs[0], t, "an input");
  }
  auto& r = inner(call, inputs[0]);
  auto routed = routeGroups(
      call, r, shmServes(inputs) && shmServes(outputs), inputs, opts.reduceOp, /*divideBy=*/1.0);
  auto plan =
      planReduceScatterCoalesced(inputs, outputs, routed.groups, routed.route, size_, staging_);
  return issue(call, routed.route, std::move(plan), bytesOf(inputs));
}

WorkPtr ProcessGroupHSDP::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  auto call = begin("all_to_all_single", OpType::ALLTOALL_BASE, opts.asyncOp, opts.timeout);
  checkSameDtype(call.ctx, input, output, "the output");
  checkSameDevice(call.ctx, input, output, "the output");
  for (auto* splits : {&outputSplitSizes, &inputSplitSizes}) {
    checkSplits(call.ctx, *splits);
  }
  return forward(
      call,
      inner(call, input),
      bytesOf(input),
      [&](auto& b) {
        return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts);
      },
      issuedAsIs({output}, {}, {input}));
}

WorkPtr ProcessGroupHSDP::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  auto call = begin("all_to_all", OpType::ALLTOALL, opts.asyncOp, opts.timeout);
  checkAllToAllLists(call.ctx, outputs, inputs);
  auto& r = inner(call, inputs[0]);
  // Gloo's list all-to-all needs equal sizes; sending one flat buffer with
  // per-peer splits serves any sizes with a single inner collective.
  std::vector<int64_t> inSplits, outSplits;
  std::vector<at::Tensor> flatInputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    inSplits.push_back(inputs[i].numel());
    outSplits.push_back(outputs[i].numel());
    flatInputs.push_back(inputs[i].reshape({-1}));
  }
  auto input = at::cat(flatInputs);
  auto output =
      at::empty({std::accumulate(outSplits.begin(), outSplits.end(), int64_t{0})}, input.options());
  auto copyOut = [output, outputs, outSplits] {
    int64_t off = 0;
    for (size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].copy_(output.narrow(0, off, outSplits[i]).view(outputs[i].sizes()));
      off += outSplits[i];
    }
  };
  // The inner backend may move from the split vectors it is given.
  auto innerOutSplits = outSplits;
  return forward(
      call,
      r,
      bytesOf(inputs),
      [&](auto& b) { return b.alltoall_base(output, input, innerOutSplits, inSplits, opts); },
      issuedAsIs(outputs, copyOut, {input, output}));
}

// Point-to-point calls are counted in comm_stats but are not collectives:
// they leave the sequence number alone, as on gloo.
WorkPtr ProcessGroupHSDP::pointToPoint(
    Call& call,
    std::vector<at::Tensor>& tensors,
    const std::function<WorkPtr(c10d::Backend&)>& op) {
  auto& r = inner(call, tensors[0]);
  stats_.record(call.ctx.op, 1, bytesOf(tensors));
  return untraced(call, r.finish(call, {op(r.backend())}, issuedAsIs(tensors)));
}

WorkPtr ProcessGroupHSDP::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  auto call = begin("send", OpType::SEND, /*asyncOp=*/true);
  checkUsable(call.ctx);
  checkOne(call.ctx, tensors);
  checkRank(call.ctx, dstRank, "destination");
  return pointToPoint(call, tensors, [&](auto& b) { return b.send(tensors, dstRank, tag); });
}

WorkPtr ProcessGroupHSDP::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  auto call = begin("recv", OpType::RECV, /*asyncOp=*/true);
  checkUsable(call.ctx);
  checkOne(call.ctx, tensors);
  checkRank(call.ctx, srcRank, "source");
  return pointToPoint(call, tensors, [&](auto& b) { return b.recv(tensors, srcRank, tag); });
}

WorkPtr ProcessGroupHSDP::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  auto call = begin("recv", OpType::RECVANYSOURCE, /*asyncOp=*/true);
  checkUsable(call.ctx);
  checkOne(call.ctx, tensors);
  return pointToPoint(call, tensors, [&](auto& b) { return b.recvAnysource(tensors, tag); });
}

WorkPtr ProcessGroupHSDP::barrier(const c10d::BarrierOptions& opts) {
  auto call = begin("barrier", OpType::BARRIER, opts.asyncOp, opts.timeout);
  // NCCL's barrier is an all-reduce on the device followed by a host wait
  // for the current stream (ProcessGroupNCCL::barrier, WorkNCCL's
  // isBarrierOp_): when it returns, every rank's GPU work issued before it
  // on the current stream has run, and this group's NCCL work too, waited
  // for or not (NCCL's stream orders the all-reduce after it). Once the
  // ranks agree that the communicator exists, the inner NCCL's own barrier
  // gives exactly that; then the processes meet on the CPU for the ops of
  // the CPU route.
  checkUsable(call.ctx);
  if (cuda_) {
    const auto device = barrierDevice(opts);
    if (device) {
      cuda_->beforeIssue(); // a pending post-step on a side stream is GPU work before it too
    }
    if (!cudaAgreed_) {
      const bool connectedBefore = cuda_->connected();
      if (device) {
        c10::impl::VirtualGuardImpl(device->type()).getStream(*device).synchronize();
      }
      agreeOnCuda(call, device);
      if (!connectedBefore || !cudaAgreed_ || !device) {
        // The agreement was the meeting; a communicator made by it has no
        // NCCL work before its own all-reduce.
        return WorkHSDP::completed(rank_, call.type, {});
      }
    }
    if (device) {
      c10d::BarrierOptions o = opts;
      o.device_ids = {device->index()};
      o.timeout = call.timeout;
      o.asyncOp = false;
      if (auto w = cuda_->backend().barrier(o)) {
        w->wait(call.timeout);
      }
    }
  }
  if (shm_) {
    return issue(call, *shm_, Plan{.collectives = {{Kind::Barrier, {}}}}, 0);
  }
  return forward(call, *cpu_, 0, [&](auto& b) { return b.barrier(opts); });
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
  if (opts.device && !opts.device->is_cpu()) {
    return opts.device; // CUDA where NCCL serves it; any device with streams is waited alike
  }
  if (!cuda_) {
    return std::nullopt;
  }
  // dist.barrier hands a group that also serves cpu a cpu device. NCCL's
  // falls back to the device its ops used, else a guess; hsdp's to the one
  // its CUDA ops used, else the current device, if this process has used it
  // at all (a CPU job on a machine with GPUs gets no CUDA context from a
  // barrier).
  if (const auto used = lastCudaDevice_.load(std::memory_order_relaxed); used >= 0) {
    return at::Device(at::kCUDA, used);
  }
  if (!c10::impl::hasDeviceGuardImpl(at::kCUDA)) {
    return std::nullopt;
  }
  c10::impl::VirtualGuardImpl cuda(at::kCUDA);
  if (cuda.deviceCount() == 0) {
    return std::nullopt;
  }
  const auto current = cuda.getDevice();
  if (at::detail::getCUDAHooks().hasPrimaryContext(current.index())) {
    return current;
  }
  return std::nullopt;
}

at::Device ProcessGroupHSDP::guessCudaDevice(const OpContext& c) const {
  // ProcessGroupNCCL::guessDeviceForRank: the global rank modulo the local
  // device count (ranks that never called set_device spread over the GPUs,
  // rather than all landing on the current one, GPU 0).
  const auto& global = options_->global_ranks_in_group;
  const uint64_t globalRank =
      global.size() > static_cast<size_t>(rank_) ? global[rank_] : static_cast<uint64_t>(rank_);
  const auto count = c10::impl::hasDeviceGuardImpl(at::kCUDA)
      ? c10::impl::VirtualGuardImpl(at::kCUDA).deviceCount()
      : 0;
  HSDP_CHECK(count > 0, c, "no CUDA device to make the NCCL communicator on");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(globalRank % count));
}

void ProcessGroupHSDP::agreeOnCuda(Call& call, std::optional<at::Device> device, bool required) {
  // NCCL's barrier is a one-element all-reduce on the device, which makes
  // the communicator when there is none yet: FSDP2 calls a barrier for that
  // before it asks for symmetric memory. Whether this rank has a device for
  // it, and whether its communicator exists, are its own answers: until the
  // group has agreed, every barrier is a CPU all-reduce (MAX) of them, the
  // meeting itself, so every rank decides alike. Ranks that disagree on the
  // communicator (a CUDA collective that ran on some only) are told so,
  // rather than left to wait in a device all-reduce the others never join.
  const bool connected = cuda_->connected();
  auto flags = at::tensor(
      {(device || required) && !connected ? 1 : 0, connected ? 1 : 0, connected ? 0 : 1}, at::kInt);
  std::vector<at::Tensor> tensors{flags};
  auto routed =
      routeReduction(call, *cpu_, shmServes(tensors), c10d::ReduceOp::MAX, flags.options(), size_);
  auto plan = planInPlace(Kind::AllReduce, flags, std::move(routed.reduce));
  if (auto work = issue(call, routed.route, std::move(plan), 0)) {
    work->wait();
  }
  const bool someWant = flags[0].item<int>() != 0;
  const bool someConnected = flags[1].item<int>() != 0;
  const bool someNot = flags[2].item<int>() != 0;
  TORCH_CHECK_WITH(
      DistBackendError,
      !(someConnected && someNot),
      call.ctx.prefix(),
      "the ranks disagree on whether this group's NCCL communicator exists (this rank: ",
      connected ? "it does" : "it does not",
      "); a CUDA collective ran on some ranks only (one that raised on some, or was skipped)");
  if (!someNot) {
    cudaAgreed_ = true; // every rank has it: later barriers only meet
    return;
  }
  if (!someWant) {
    return; // no rank has used a GPU: a CPU job on a machine with GPUs stays one
  }
  const at::Device d = device ? *device : guessCudaDevice(call.ctx);
  std::vector<at::Tensor> one{at::zeros({1}, at::TensorOptions().device(d))};
  c10d::AllreduceOptions o;
  o.timeout = call.timeout;
  if (auto w = cuda_->backend().allreduce(one, o)) {
    w->wait();
  }
  cuda_->markConnected();
  cudaAgreed_ = true;
  if (d.is_cuda()) {
    c10::impl::VirtualGuardImpl(d.type()).getStream(d).synchronize();
  }
}

WorkPtr ProcessGroupHSDP::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  auto call = begin("all_reduce_sparse", OpType::_ALLREDUCE_SPARSE, opts.asyncOp, opts.timeout);
  checkNotEmpty(call.ctx, tensors);
  auto& r = inner(call, tensors[0]);
  return forward(
      call,
      r,
      bytesOf(tensors),
      [&](auto& b) { return b.allreduce_sparse(tensors, opts); },
      issuedAsIs(tensors));
}

void ProcessGroupHSDP::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  stats_.record("monitored_barrier", 1, 0);
  cpu_->backend().monitoredBarrier(opts, waitAllRanks);
}

} // namespace hsdp
