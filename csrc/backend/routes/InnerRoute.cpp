#include "backend/routes/InnerRoute.hpp"

#include <c10/util/Exception.h>

#include "backend/WorkHSDP.hpp"

namespace hsdp {

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
    : backend_(std::move(backend)), caps_(std::move(caps)), rank_(rank) {
  TORCH_CHECK(backend_, "hsdp: an inner route needs a backend");
  if (caps_.streams) {
    auto ordered = std::make_unique<StreamOrdered>(caps_.streams->another());
    streamOrdered_ = ordered.get();
    postSteps_ = std::move(ordered);
  } else {
    postSteps_ = std::make_unique<HostWorkers>(caps_.fixedCompletionPool);
  }
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
  return finish(call, std::move(works), std::move(plan));
}

Completion InnerRoute::finish(const Call& call, std::vector<WorkPtr> works, Plan plan) {
  if (!isPointToPoint(call.type)) {
    markConnected();
  }
  return {workFor(
      call.type,
      call.asyncOp,
      std::move(works),
      std::vector<at::Tensor>(
          std::make_move_iterator(plan.outputs.begin()),
          std::make_move_iterator(plan.outputs.end())),
      std::move(plan.post),
      std::move(plan.keepAlive))};
}

InnerRoute::WorkPtr InnerRoute::workFor(
    c10d::OpType type,
    bool asyncOp,
    std::vector<WorkPtr> works,
    std::vector<at::Tensor> outputs,
    std::function<void()> post,
    std::vector<at::Tensor> keepAlive) {
  std::erase_if(works, [](const WorkPtr& w) { return !w; });
  // Outside a block (most calls) no lock: a block is opened and filled on
  // the thread that issues its calls, which sees its own store.
  if (coalescing_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (coalescing_.load(std::memory_order_relaxed)) {
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
  return workForInner(
      type,
      asyncOp,
      Inner{std::move(works), {}, {}},
      std::move(outputs),
      std::move(post),
      std::move(keepAlive));
}

InnerRoute::WorkPtr InnerRoute::workForInner(
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
  // NCCL keeps a block's tensors alive only for its async calls (stashed on
  // the end Work): buffers of hsdp's own (staged copies) made for its
  // synchronous calls must outlive the block, which a bare end Work does not
  // see to.
  const bool blockNeedsBuffers = inner.blockEnd && !keepAlive.empty();
  if (!post && ordering == 1 && !blockNeedsBuffers &&
      (!asyncOp || postSteps_->handsBackInnerWork(type))) {
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
  return postSteps_->workAfter(
      rank_, type, std::move(inner), std::move(outputs), std::move(post), std::move(keepAlive));
}

void InnerRoute::startCoalescing() {
  TORCH_INTERNAL_ASSERT(caps_.nativeCoalescing);
  backend_->startCoalescing();
  std::lock_guard<std::mutex> lock(mutex_);
  coalescing_.store(true, std::memory_order_release);
  held_ = Held{};
}

InnerRoute::WorkPtr InnerRoute::endCoalescing() {
  Held held;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    coalescing_.store(false, std::memory_order_release);
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
  return workForInner(
      c10d::OpType::COALESCED,
      /*asyncOp=*/inner.blockEnd != nullptr,
      std::move(inner),
      std::move(held.outputs),
      inOrder(std::move(held.posts)),
      std::move(held.keepAlive));
}

} // namespace hsdp
