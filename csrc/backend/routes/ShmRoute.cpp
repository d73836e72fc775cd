// How a planned call runs on the shared-memory route: on the engine's
// queue, one collective per Collective, the scale fused into it.

#include "backend/routes/ShmRoute.hpp"

#include <c10/util/Exception.h>

#include "backend/EngineTypes.hpp"
#include "backend/WorkHSDP.hpp"

namespace hsdp {

ShmRoute::ShmRoute(
    std::unique_ptr<shm::Engine> local,
    HostLayout layout,
    std::optional<Column> column,
    int rank,
    int size,
    CommStats& stats,
    std::shared_ptr<StagingPool> staging)
    : local_(std::move(local)), rank_(rank), size_(size) {
  if (column) {
    hierarchical_ = std::make_unique<Hierarchical>(
        *local_, std::move(layout), std::move(*column), rank, size, stats, std::move(staging));
  }
}

void ShmRoute::usePool(size_t maxBytes, size_t chunkBytes) {
  if (maxBytes == 0 || !local_->directReads()) {
    return;
  }
  auto pool = std::make_shared<shm::Pool>(maxBytes, chunkBytes);
  local_->setPool(pool);
  allocator_ = std::make_shared<PoolAllocator>(std::move(pool));
}

ShmRoute::BufferStats ShmRoute::bufferStats() const {
  BufferStats s;
  if (allocator_) {
    s.pool = allocator_->pool().stats();
    s.fallbacks = allocator_->fallbacks();
  }
  s.pooledCalls = local_->pooledCalls();
  return s;
}

bool ShmRoute::serves(const std::vector<at::Tensor>& tensors) const {
  return std::all_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) {
    return t.device().is_cpu() && !t.is_sparse() && shmDtype(t.scalar_type());
  });
}

bool ShmRoute::takes(ReducePlan& plan, at::ScalarType dtype) const {
  plan.onEngine = shmReduction(plan, dtype);
  return plan.onEngine.has_value();
}

void ShmRoute::run(const char* op, const Collective& c) {
  auto reduction = [&] {
    TORCH_INTERNAL_ASSERT(c.reduce.onEngine, "a reduction routed to the engine unmapped");
    return *c.reduce.onEngine;
  };
  switch (c.kind) {
    case Kind::AllReduce: {
      const auto& t = c.inputs[0];
      const auto red = reduction();
      collectives().allReduce(op, t.data_ptr(), t.numel(), red.dtype, red.op, red.scale);
      return;
    }
    case Kind::Broadcast:
      collectives().broadcast(op, c.inputs[0].data_ptr(), c.inputs[0].nbytes(), c.root);
      return;
    case Kind::AllGather: {
      if (!c.asList) {
        collectives().allGather(
            op, c.inputs[0].data_ptr(), c.outputs[0].data_ptr(), c.inputs[0].nbytes());
        return;
      }
      // Peers read every input where it is and write it where it goes.
      std::vector<shm::Span> mine;
      std::vector<std::vector<shm::Span>> dests(size_);
      for (size_t i = 0; i < c.inputs.size(); ++i) {
        const size_t bytes = c.inputs[i].nbytes();
        mine.push_back({static_cast<char*>(c.inputs[i].data_ptr()), bytes});
        for (int q = 0; q < size_; ++q) {
          dests[q].push_back({static_cast<char*>(c.outputs[i].data_ptr()) + q * bytes, bytes});
        }
      }
      collectives().allGatherPieces(op, mine, dests);
      return;
    }
    case Kind::ReduceScatter: {
      const auto& out = c.outputs[0];
      const auto red = reduction();
      collectives().reduceScatter(
          op, c.inputs[0].data_ptr(), out.data_ptr(), out.numel(), red.dtype, red.op, red.scale);
      return;
    }
    case Kind::Barrier:
      collectives().barrier(op);
      return;
    case Kind::Reduce:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "the shared-memory route has no form of this collective");
}

void ShmRoute::fail(const shm::CommError& e, uint64_t seq) {
  trace_->finished(seq, e.what());
  const std::string path = trace_->failed(seq, e.what());
  C10_THROW_ERROR(
      DistBackendError,
      std::string(e.what()) + "\nFlight record of this rank: " + path +
          " (python -m hsdp_backend.trace " + trace_->options().dir +
          " reads every rank's and names the first collective where they diverge)");
}

Completion ShmRoute::issue(const Call& call, Plan&& plan) {
  if (!queue_) {
    C10_THROW_ERROR(DistBackendError, call.ctx.prefix() + "the process group was shut down");
  }
  const uint64_t seq = call.seq;
  auto run = [this, seq, op = call.ctx.op](const Plan& plan) {
    // Every engine collective of the plan (a fused call's buckets) is this
    // one c10d collective: the engine's messages carry its number.
    local_->setCallerSeq(seq);
    try {
      if (plan.stageIn) {
        plan.stageIn();
      }
      for (const auto& c : plan.collectives) {
        this->run(op, c);
      }
      if (plan.post) {
        plan.post();
      }
    } catch (const shm::CommError& e) {
      fail(e, seq);
    }
    trace_->finished(seq, "");
  };
  if (!call.asyncOp && queue_->runInlineIfIdle([&] { run(plan); })) {
    // The result is in place (ProcessGroupHSDP::handOver: no Work).
    return {nullptr, /*endRecorded=*/true};
  }
  std::vector<at::Tensor> outputs(plan.outputs.begin(), plan.outputs.end());
  // The plan moves into the queue's task: it is never copied.
  return {
      WorkHSDP::onQueue(
          *queue_,
          rank_,
          call.type,
          std::move(outputs),
          [run, plan = std::move(plan)] { run(plan); }),
      /*endRecorded=*/true};
}

void ShmRoute::leave(const std::string& why) {
  local_->leave(why);
  queue_.reset(); // joins the worker once the queue is drained
}

} // namespace hsdp
