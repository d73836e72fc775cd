#pragma once

// The zero-cost limit of an inner backend, for benchmarks/layer_cost.py: a
// world of one rank whose collectives are what a world of one computes (an
// all-reduce leaves its tensor as it is, an all-gather and a reduce-scatter
// copy their input), complete when they return. As a group's own backend it
// is the plain contender; as an hsdp group's inner backend, what hsdp adds
// on top of it is hsdp's own cost per call.

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>
#include <vector>

namespace hsdp::testing {

// A Work that is complete when it is handed back, its future holding the
// op's outputs: an inner backend's once its op ran (also the C++ tests').
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(rank, type),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(std::move(outputs)));
    finish();
  }
  bool isCompleted() override {
    return true;
  }
  bool wait(std::chrono::milliseconds) override {
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class NullBackend final : public c10d::Backend {
 public:
  NullBackend(int rank, int size) : Backend(rank, size) {
    TORCH_CHECK_VALUE(size == 1, "NullBackend serves a world of one rank, got ", size);
  }
  const std::string getBackendName() const override {
    return "null";
  }

  c10::intrusive_ptr<c10d::Work>
  allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    TORCH_CHECK_VALUE(
        opts.reduceOp != c10d::ReduceOp::PREMUL_SUM, "NullBackend: PREMUL_SUM is not modelled");
    return done(opts.asyncOp, c10d::OpType::ALLREDUCE, tensors);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    output.copy_(input);
    return done(opts.asyncOp, c10d::OpType::_ALLGATHER_BASE, {output});
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK_VALUE(
        opts.reduceOp != c10d::ReduceOp::PREMUL_SUM, "NullBackend: PREMUL_SUM is not modelled");
    output.copy_(input);
    return done(opts.asyncOp, c10d::OpType::_REDUCE_SCATTER_BASE, {output});
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return done(true, c10d::OpType::BARRIER, {});
  }

 private:
  // As NCCL: no Work for a synchronous call (its result is in place), a
  // complete one, whose future holds the outputs, for an async one.
  c10::intrusive_ptr<c10d::Work>
  done(bool asyncOp, c10d::OpType type, const std::vector<at::Tensor>& outputs) {
    if (!asyncOp) {
      return {};
    }
    return c10::make_intrusive<CompletedWork>(getRank(), type, outputs);
  }
};

} // namespace hsdp::testing
