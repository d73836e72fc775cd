#include "testing/NcclContractBackend.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <condition_variable>
#include <thread>

#include "backend/WorkHSDP.hpp"
#include "fusion/ReducePlan.hpp"

namespace hsdp::testing {

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

std::exception_ptr distError(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// NCCL's Work as the double models it: the data lands in the caller's
// tensors on wait(), or on its own a while after the op completes (the GPU
// finishing in the background). Its future completes when the data lands:
// NCCL's future is device-aware (consuming it orders the consumer after the
// data), and on CPU landing is the only way to say that.
class DeferredWork final : public c10d::Work {
 public:
  DeferredWork(
      int rank,
      c10d::OpType type,
      std::vector<WorkPtr> inners,
      std::function<void()> land,
      std::vector<at::Tensor> outputs,
      std::string failure)
      : Work(rank, type),
        inners_(std::move(inners)),
        land_(std::move(land)),
        outputs_(std::move(outputs)),
        failure_(std::move(failure)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return landed_;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return landed_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  void synchronize() override {
    wait();
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!landed_ && !landing_) {
      // This thread lands the data; others wait for it (the lock is not held
      // meanwhile, so isCompleted() and exception() keep answering). A
      // failure, a timeout included, is final, as it is for a WorkNCCL (whose
      // communicator is then aborted).
      landing_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        for (const auto& w : inners_) {
          w->wait(timeout);
        }
        if (land_) {
          land_();
        }
        if (!failure_.empty()) {
          error = distError(failure_);
        }
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      error_ = error;
      landed_ = true;
      landed_cv_.notify_all();
      lock.unlock();
      if (error) { // completing the future runs callbacks: outside the lock
        future_->setError(error);
      } else {
        future_->markCompleted(c10::IValue(outputs_));
      }
      lock.lock();
    } else {
      landed_cv_.wait(lock, [&] { return landed_; });
    }
    if (error_) {
      std::rethrow_exception(error_);
    }
    lock.unlock();
    unregisterInflight(*this); // as WorkNCCL::synchronize does
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable landed_cv_;
  bool landing_ = false; // a thread is landing the data, without the lock
  bool landed_ = false;
  std::vector<WorkPtr> inners_;
  std::function<void()> land_;
  std::vector<at::Tensor> outputs_;
  std::string failure_;
  std::exception_ptr error_; // set once landed_, never changed after
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace

NcclContractBackend::NcclContractBackend(c10::intrusive_ptr<c10d::Backend> gloo, int rank, int size)
    : Backend(rank, size), gloo_(std::move(gloo)) {}

void NcclContractBackend::failNext(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  failNext_ = message;
}

std::vector<std::string> NcclContractBackend::receivedReductions() {
  std::lock_guard<std::mutex> lock(mutex_);
  return received_;
}

c10d::ReduceOp
NcclContractBackend::sumFor(const char* what, const c10d::ReduceOp& op, const at::Tensor& t) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    received_.push_back(std::string(what) + ":" + reduceOpName(op.op_));
  }
  if (op.op_ != c10d::ReduceOp::AVG && op.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return op;
  }
  TORCH_CHECK(
      at::isFloatingType(t.scalar_type()),
      "nccl_contract: ",
      what,
      " got ReduceOp.",
      reduceOpName(op.op_),
      " on ",
      t.scalar_type(),
      "; hsdp sends integer AVG as SUM plus a division");
  if (op.op_ == c10d::ReduceOp::AVG) {
    t.mul_(1.0 / size_);
  } else {
    auto* premul = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(premul, "nccl_contract: PREMUL_SUM without a factor");
    if (premul->tensor_factor.defined()) {
      t.mul_(premul->tensor_factor.to(t.device(), t.scalar_type()));
    } else {
      t.mul_(premul->double_factor);
    }
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

WorkPtr NcclContractBackend::run(
    c10d::OpType type,
    bool asyncOp,
    std::vector<at::Tensor> outputs,
    const std::function<std::vector<WorkPtr>(std::vector<at::Tensor>&)>& issue) {
  std::vector<at::Tensor> privates;
  for (const auto& t : outputs) {
    privates.push_back(t.clone(at::MemoryFormat::Contiguous));
  }
  auto works = issue(privates);
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure.swap(failNext_);
  }
  auto land = [outputs, privates] {
    for (size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].copy_(privates[i]);
    }
  };
  auto work = c10::make_intrusive<DeferredWork>(
      rank_, type, std::move(works), std::move(land), outputs, std::move(failure));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (coalescing_) {
      // As NCCL: the last call's asyncOp decides endCoalescing's Work.
      heldAsync_ = asyncOp;
      held_.push_back(work);
      return {};
    }
  }
  if (!asyncOp) {
    work->wait();
    return {};
  }
  landLater(work);
  return work;
}

void NcclContractBackend::landLater(const WorkPtr& work) {
  const auto at = std::chrono::steady_clock::now() + kLandingDelay;
  // Landing completes the Work's future, which runs its callbacks: that is
  // the queue's completion step, so a callback that issues an op and waits
  // for it has a worker to land that op (see OpQueue.hpp).
  lander_.submit(
      [at] { std::this_thread::sleep_until(at); },
      [work] {
        try {
          work->wait();
        } catch (...) {
          // The failure is the Work's to report, to whoever waits on it.
        }
      });
}

void NcclContractBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!coalescing_, "nccl_contract: already coalescing");
  coalescing_ = true;
  held_.clear();
}

WorkPtr NcclContractBackend::endCoalescing() {
  std::vector<WorkPtr> held;
  bool asyncOp = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(coalescing_, "nccl_contract: endCoalescing without startCoalescing");
    coalescing_ = false;
    held.swap(held_);
    asyncOp = heldAsync_;
  }
  if (held.empty()) {
    return {};
  }
  auto work = c10::make_intrusive<DeferredWork>(
      rank_, c10d::OpType::COALESCED, std::move(held), nullptr, std::vector<at::Tensor>{}, "");
  if (!asyncOp) {
    work->wait();
    return {};
  }
  landLater(work);
  return work;
}

WorkPtr NcclContractBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  return run(c10d::OpType::BROADCAST, opts.asyncOp, tensors, [&](auto& p) {
    return std::vector<WorkPtr>{gloo_->broadcast(p, opts)};
  });
}

WorkPtr NcclContractBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  return run(c10d::OpType::ALLREDUCE, opts.asyncOp, tensors, [&](auto& p) {
    auto o = opts;
    o.reduceOp = sumFor("all_reduce", opts.reduceOp, p[0]);
    return std::vector<WorkPtr>{gloo_->allreduce(p, o)};
  });
}

WorkPtr NcclContractBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  return run(c10d::OpType::ALLREDUCE_COALESCED, opts.asyncOp, tensors, [&](auto& p) {
    std::vector<WorkPtr> works;
    for (auto& t : p) {
      c10d::AllreduceOptions o;
      o.reduceOp = sumFor("all_reduce_coalesced", opts.reduceOp, t);
      std::vector<at::Tensor> one{t};
      works.push_back(gloo_->allreduce(one, o));
    }
    return works;
  });
}

WorkPtr
NcclContractBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return run(c10d::OpType::REDUCE, opts.asyncOp, tensors, [&](auto& p) {
    auto o = opts;
    o.reduceOp = sumFor("reduce", opts.reduceOp, p[0]);
    return std::vector<WorkPtr>{gloo_->reduce(p, o)};
  });
}

WorkPtr NcclContractBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run(c10d::OpType::ALLGATHER, opts.asyncOp, outputs.at(0), [&](auto& p) {
    std::vector<std::vector<at::Tensor>> o{p};
    return std::vector<WorkPtr>{gloo_->allgather(o, inputs, opts)};
  });
}

WorkPtr NcclContractBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  return run(c10d::OpType::_ALLGATHER_BASE, opts.asyncOp, {output}, [&](auto& p) {
    return std::vector<WorkPtr>{gloo_->_allgather_base(p[0], input, opts)};
  });
}

WorkPtr NcclContractBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run(c10d::OpType::COALESCED, opts.asyncOp, outputs, [&](auto& p) {
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < p.size(); ++i) {
      works.push_back(gloo_->_allgather_base(p[i], inputs.at(i), opts));
    }
    return works;
  });
}

WorkPtr NcclContractBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const bool root = !outputs.empty();
  return run(
      c10d::OpType::GATHER,
      opts.asyncOp,
      root ? outputs[0] : std::vector<at::Tensor>{},
      [&](auto& p) {
        std::vector<std::vector<at::Tensor>> o;
        if (root) {
          o.push_back(p);
        }
        return std::vector<WorkPtr>{gloo_->gather(o, inputs, opts)};
      });
}

WorkPtr NcclContractBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return run(c10d::OpType::SCATTER, opts.asyncOp, outputs, [&](auto& p) {
    return std::vector<WorkPtr>{gloo_->scatter(p, inputs, opts)};
  });
}

WorkPtr NcclContractBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run(c10d::OpType::REDUCE_SCATTER, opts.asyncOp, outputs, [&](auto& p) {
    std::vector<std::vector<at::Tensor>> ins(1);
    auto o = opts;
    for (const auto& t : inputs.at(0)) {
      ins[0].push_back(t.clone());
      o.reduceOp = sumFor("reduce_scatter", opts.reduceOp, ins[0].back());
    }
    return std::vector<WorkPtr>{gloo_->reduce_scatter(p, ins, o)};
  });
}

WorkPtr NcclContractBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  return run(c10d::OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, {output}, [&](auto& p) {
    auto in = input.clone();
    auto o = opts;
    o.reduceOp = sumFor("reduce_scatter_tensor", opts.reduceOp, in);
    return std::vector<WorkPtr>{gloo_->_reduce_scatter_base(p[0], in, o)};
  });
}

WorkPtr NcclContractBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run(c10d::OpType::COALESCED, opts.asyncOp, outputs, [&](auto& p) {
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < p.size(); ++i) {
      auto in = inputs.at(i).clone();
      auto o = opts;
      o.reduceOp = sumFor("reduce_scatter_tensor_coalesced", opts.reduceOp, in);
      works.push_back(gloo_->_reduce_scatter_base(p[i], in, o));
    }
    return works;
  });
}

WorkPtr NcclContractBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  return run(c10d::OpType::ALLTOALL_BASE, opts.asyncOp, {output}, [&](auto& p) {
    return std::vector<WorkPtr>{
        gloo_->alltoall_base(p[0], input, outputSplitSizes, inputSplitSizes, opts)};
  });
}

// Point-to-point calls are always async (NCCL takes no asyncOp for them).
WorkPtr NcclContractBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return run(c10d::OpType::SEND, true, {}, [&](auto&) {
    return std::vector<WorkPtr>{gloo_->send(tensors, dstRank, tag)};
  });
}

WorkPtr NcclContractBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return run(c10d::OpType::RECV, true, tensors, [&](auto& p) {
    return std::vector<WorkPtr>{gloo_->recv(p, srcRank, tag)};
  });
}

WorkPtr NcclContractBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return run(c10d::OpType::RECVANYSOURCE, true, tensors, [&](auto& p) {
    return std::vector<WorkPtr>{gloo_->recvAnysource(p, tag)};
  });
}

WorkPtr NcclContractBackend::barrier(const c10d::BarrierOptions& opts) {
  return run(c10d::OpType::BARRIER, opts.asyncOp, {}, [&](auto&) {
    return std::vector<WorkPtr>{gloo_->barrier(opts)};
  });
}

} // namespace hsdp::testing
