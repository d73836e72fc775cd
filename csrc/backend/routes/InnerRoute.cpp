#include "backend/routes/InnerRoute.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "backend/WorkHSDP.hpp"
#include "backend/WorkOnStream.hpp"

namespace hsdp {

namespace {

// The device the op's tensors live on (CPU when it has none, as a barrier).
c10::Device
deviceOf(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& keepAlive) {
  for (const auto* list : {&outputs, &keepAlive}) {
    for (const auto& t : *list) {
      if (t.defined()) {
        return t.device();
      }
    }
  }
  return c10::Device(c10::kCPU);
}

// Orders the current stream after `w`'s result without a host wait.
void waitOnCurrentStream(c10d::Work& w) {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = w.getFuture();
  } catch (const c10::Error&) {
    w.wait(); // a Work without a future: its own wait is all there is
    return;
  }
  future->wait();
  if (!future->devices().empty() && future->storages().empty()) {
    // A device future whose value holds no storage recorded no event
    // (ivalue::Future::markCompleted records one per device of the value's
    // storages), so its wait ordered nothing: the Work's own synchronize()
    // does (WorkNCCL's: the current stream waits for its end event).
    w.synchronize();
  }
}

} // namespace

std::function<void()> inOrder(std::vector<std::function<void()>> steps) {
  if (steps.empty()) {
    return {};
  }
  return [steps = std::move(steps)] {
    for (const auto& step : steps) {
      step();
    }
  };
}

InnerRoute::InnerRoute(c10::intrusive_ptr<c10d::Backend> backend, InnerCaps caps, int rank)
    : backend_(std::move(backend)), caps_(caps), rank_(rank) {
  TORCH_CHECK(backend_, "hsdp: an inner route needs a backend");
}

std::vector<InnerRoute::WorkPtr> InnerRoute::Inner::all() const {
  auto works = ops;
  if (blockEnd) {
    works.push_back(blockEnd);
  }
  works.insert(works.end(), companions.begin(), companions.end());
  return works;
}

InnerRoute::WorkPtr InnerRoute::run(const Call& call, const Collective& c) {
  auto& b = *backend_;
  const auto timeout = call.timeout;
  const bool async = call.asyncOp;
  const auto op = c.reduce.innerOp;
  // c10d's signatures take vectors.
  std::vector<at::Tensor> ins(c.inputs.begin(), c.inputs.end());
  std::vector<at::Tensor> outs(c.outputs.begin(), c.outputs.end());
  const bool list = c.asList;
  // Gloo's *_base ops insist on 1-D shapes (a fatal check otherwise).
  auto flat = [](const at::Tensor& t) { return t.dim() == 1 ? t : t.view({-1}); };
  switch (c.kind) {
    case Kind::AllReduce:
      if (list) {
        c10d::AllreduceCoalescedOptions o;
        o.reduceOp = op, o.timeout = timeout, o.asyncOp = async;
        return b.allreduce_coalesced(ins, o);
      } else {
        c10d::AllreduceOptions o;
        o.reduceOp = op, o.timeout = timeout, o.asyncOp = async;
        return b.allreduce(ins, o);
      }
    case Kind::Broadcast: {
      c10d::BroadcastOptions o;
      o.rootRank = c.root, o.timeout = timeout, o.asyncOp = async;
      return b.broadcast(ins, o);
    }
    case Kind::Reduce: {
      c10d::ReduceOptions o;
      o.reduceOp = op, o.rootRank = c.root, o.timeout = timeout, o.asyncOp = async;
      std::vector<at::Tensor> io{flat(ins[0])};
      return b.reduce(io, o);
    }
    case Kind::AllGather: {
      c10d::AllgatherOptions o;
      o.timeout = timeout, o.asyncOp = async;
      if (list) {
        return b.allgather_into_tensor_coalesced(outs, ins, o);
      }
      auto in = flat(ins[0]), out = flat(outs[0]);
      return b._allgather_base(out, in, o);
    }
    case Kind::ReduceScatter: {
      c10d::ReduceScatterOptions o;
      o.reduceOp = op, o.timeout = timeout, o.asyncOp = async;
      if (list) {
        return b.reduce_scatter_tensor_coalesced(outs, ins, o);
      }
      auto in = flat(ins[0]), out = flat(outs[0]);
      return b._reduce_scatter_base(out, in, o);
    }
    case Kind::Barrier: {
      c10d::BarrierOptions o;
      o.timeout = timeout, o.asyncOp = async;
      return b.barrier(o);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown collective kind");
}

Completion InnerRoute::issue(const Call& call, Plan&& plan) {
  if (plan.stageIn) {
    plan.stageIn();
  }
  std::vector<WorkPtr> works;
  std::vector<std::function<void()>> scales;
  for (const auto& c : plan.collectives) {
    works.push_back(run(call, c));
    // Only the root holds a reduce's result; the others' buffers are scratch.
    if (!c.reduce.post.isNone() && (c.kind != Kind::Reduce || c.root == rank_)) {
      scales.push_back([results = c.results(), scale = c.reduce.post] {
        for (const auto& t : results) {
          scale.apply(t);
        }
      });
    }
  }
  if (!scales.empty()) {
    if (plan.post) {
      scales.push_back(std::move(plan.post));
    }
    plan.post = inOrder(std::move(scales));
  }
  return complete(call, std::move(works), std::move(plan));
}

Completion InnerRoute::complete(const Call& call, std::vector<WorkPtr> works, Plan plan) {
  if (!isPointToPoint(call.type)) {
    markConnected();
  }
  return {finish(
      call.type,
      call.asyncOp,
      std::move(works),
      std::vector<at::Tensor>(
          std::make_move_iterator(plan.outputs.begin()),
          std::make_move_iterator(plan.outputs.end())),
      std::move(plan.post),
      std::move(plan.keepAlive))};
}

InnerRoute::WorkPtr InnerRoute::finish(
    c10d::OpType type,
    bool asyncOp,
    std::vector<WorkPtr> works,
    std::vector<at::Tensor> outputs,
    std::function<void()> post,
    std::vector<at::Tensor> keepAlive) {
  std::erase_if(works, [](const WorkPtr& w) { return !w; });
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (coalescing_) {
      // Nothing has been launched yet: the post-step waits for endCoalescing.
      auto& h = held_;
      h.works.insert(h.works.end(), works.begin(), works.end());
      h.outputs.insert(h.outputs.end(), outputs.begin(), outputs.end());
      h.keepAlive.insert(h.keepAlive.end(), keepAlive.begin(), keepAlive.end());
      if (post) {
        h.posts.push_back(std::move(post));
      }
      return {};
    }
  }
  return finishInner(
      type,
      asyncOp,
      Inner{std::move(works), {}, {}},
      std::move(outputs),
      std::move(post),
      std::move(keepAlive));
}

InnerRoute::WorkPtr InnerRoute::finishInner(
    c10d::OpType type,
    bool asyncOp,
    Inner inner,
    std::vector<at::Tensor> outputs,
    std::function<void()> post,
    std::vector<at::Tensor> keepAlive) {
  const size_t ordering = inner.ops.size() + (inner.blockEnd ? 1 : 0);
  if (!post && ordering == 0) {
    return asyncOp ? WorkHSDP::completed(rank_, type, std::move(outputs)) : WorkPtr();
  }
  const auto device = deviceOf(outputs, keepAlive);
  // Point-to-point Works complete independently of each other: waiting for
  // them one after another on a queue would make a receive's wait depend on
  // an earlier send's, so they stay the inner backend's own.
  const bool p2p = isPointToPoint(type);
  // NCCL keeps a block's tensors alive only for its async calls (stashed on
  // the end Work): buffers of hsdp's own (staged copies) made for its
  // synchronous calls must outlive the block, which a bare end Work does not
  // see to.
  const bool blockNeedsBuffers = inner.blockEnd && !keepAlive.empty();
  if (!post && ordering == 1 && !blockNeedsBuffers &&
      !(asyncOp && caps_.fixedCompletionPool && !p2p)) {
    // The inner Work already is the whole op (a block's end Work waits for
    // every op of the block). NCCL returns none for a synchronous call (it
    // ran on the caller's stream), so this is Gloo's, or an async op's.
    return inner.blockEnd ? inner.blockEnd : inner.ops.front();
  }
  if (!asyncOp) {
    // The caller waits for the result right after this returns, so ordering
    // the post-step here costs it nothing: on CPU wait() returns once the
    // data is in place, on CUDA it makes the current stream wait for NCCL's,
    // and the post-step is then enqueued behind it on that same stream.
    for (const auto& w : inner.all()) {
      w->wait();
    }
    if (post) {
      post();
    }
    return {};
  }
  if (device.is_cpu() && !caps_.hostStreams) {
    // Also with nothing to run after the inner op when the inner backend
    // completes futures on a fixed pool (caps_.fixedCompletionPool).
    return finishOnThread(type, inner.all(), std::move(outputs), std::move(post));
  }
  return finishOnStream(
      type, device, std::move(inner), std::move(outputs), std::move(post), std::move(keepAlive));
}

OpQueue& InnerRoute::completions() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!completions_) {
    completions_ = std::make_unique<OpQueue>();
  }
  return *completions_;
}

InnerRoute::WorkPtr InnerRoute::finishOnThread(
    c10d::OpType type,
    std::vector<WorkPtr> works,
    std::vector<at::Tensor> outputs,
    std::function<void()> post) {
  return WorkHSDP::onQueue(
      completions(),
      rank_,
      type,
      std::move(outputs),
      [works = std::move(works), post = std::move(post)] {
        // Blocking here is this thread's purpose: the inner ops were all
        // issued already, so each completes without anything further from
        // this process.
        for (const auto& w : works) {
          w->wait();
        }
        if (post) {
          post();
        }
      });
}

namespace {

// Orders the current stream after the inner Works' results, without a host
// wait on CUDA (on host streams the current stream is this thread).
void orderAfter(const std::vector<c10::intrusive_ptr<c10d::Work>>& ops, c10d::Work* blockEnd) {
  for (const auto& w : ops) {
    // Through the Work's device-aware future, not wait(): WorkNCCL::wait()
    // also hands back the tensors NCCL holds for the allocator, whose blocks
    // the caller's stream (which has not waited) could then reuse while
    // NCCL still runs. Failures surface through the returned Work.
    waitOnCurrentStream(*w);
  }
  if (blockEnd) {
    // Its future carries no event: synchronize() makes the current stream
    // wait for NCCL's end-of-block event. The tensors it hands back to the
    // allocator are kept alive by the returned Work, recorded on this stream.
    blockEnd->synchronize();
  }
}

} // namespace

InnerRoute::WorkPtr InnerRoute::finishOnStream(
    c10d::OpType type,
    c10::Device device,
    Inner inner,
    std::vector<at::Tensor> outputs,
    std::function<void()> post,
    std::vector<at::Tensor> keepAlive) {
  const bool hasPost = post != nullptr;
  if (device.is_cpu()) {
    // Host streams (caps_.hostStreams): the side stream is a completion
    // worker, which has nothing to wait for from the caller (its tensors
    // are written before this call returns).
    // The buffers stay alive until the inner ops ran (what recording them
    // on the side stream does on CUDA).
    auto done = WorkHSDP::onQueue(
        completions(),
        rank_,
        type,
        outputs,
        [ops = inner.ops,
         end = inner.blockEnd,
         post = std::move(post),
         keepAlive = std::move(keepAlive)] {
          orderAfter(ops, end.get());
          if (post) {
            post();
          }
        });
    return pending(
        hasPost,
        c10::make_intrusive<WorkOnStream>(
            rank_, type, done->getFuture(), done->released(), inner.all(), std::move(outputs)));
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream current = impl.getStream(device);
  const c10::Stream side = sideStreams_.get(device);
  // The post-step reads what the caller enqueued before this call (a
  // staged copy, the op's inputs): the side stream starts after it.
  c10::Event issued(device.type());
  issued.record(current);
  issued.block(side);
  c10::StreamGuard guard(side);
  orderAfter(inner.ops, inner.blockEnd.get());
  if (hasPost) {
    post();
  }
  return pending(
      hasPost,
      c10::make_intrusive<WorkOnStream>(
          rank_, type, side, inner.all(), std::move(outputs), std::move(keepAlive)));
}

c10::intrusive_ptr<WorkOnStream>
InnerRoute::pending(bool hasPost, c10::intrusive_ptr<WorkOnStream> work) {
  // A post-step captured in a CUDA graph runs at each replay, in the graph's
  // own order: later eager ops have nothing of it to wait for.
  if (hasPost && !work->mark()->captured()) {
    std::lock_guard<std::mutex> lock(mutex_);
    lastPostStep_ = work->mark();
    hasPostStep_.store(true, std::memory_order_release);
  }
  return work;
}

void InnerRoute::beforeIssue() {
  if (!hasPostStep_.load(std::memory_order_acquire)) {
    return;
  }
  std::shared_ptr<const PostStepMark> last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last = lastPostStep_;
  }
  if (!last) {
    return;
  }
  // Under CUDA graph capture an event query is not allowed (in torch's
  // default, global capture mode it invalidates the capture), nor a wait on
  // an event recorded outside it; torch.cuda.graph synchronizes the device
  // before it captures, so the captured op needs no wait. The post-step is
  // kept for the eager ops after the capture (a bare capture_begin does not
  // synchronize).
  if (last->capturingNow()) {
    return;
  }
  if (last->done()) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (lastPostStep_ == last) {
      lastPostStep_.reset();
      hasPostStep_.store(false, std::memory_order_release);
    }
    return;
  }
  last->orderCurrentStreamAfter();
}

void InnerRoute::startCoalescing() {
  TORCH_INTERNAL_ASSERT(caps_.nativeCoalescing);
  backend_->startCoalescing();
  std::lock_guard<std::mutex> lock(mutex_);
  coalescing_ = true;
  held_ = Held{};
}

InnerRoute::WorkPtr InnerRoute::endCoalescing() {
  Held held;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    coalescing_ = false;
    std::swap(held, held_);
  }
  Inner inner{{}, backend_->endCoalescing(), std::move(held.works)};
  if (!inner.blockEnd && held.posts.empty()) {
    return {};
  }
  // NCCL hands back no end Work when the block's last call was synchronous
  // (ProcessGroupNCCL::endCoalescing: `coalescedAsync_ ? work : nullptr`,
  // the last call's asyncOp): the block ran on the caller's stream, and the
  // async calls' Works order after nothing. The post-steps then run as a
  // synchronous call's do, on that stream, at once; on a side stream they
  // would wait for nothing and read the outputs before NCCL wrote them.
  // Otherwise the caller of endCoalescing waits on the Work when it wants to.
  return finishInner(
      c10d::OpType::COALESCED,
      /*asyncOp=*/inner.blockEnd != nullptr,
      std::move(inner),
      std::move(held.outputs),
      inOrder(std::move(held.posts)),
      std::move(held.keepAlive));
}

} // namespace hsdp
