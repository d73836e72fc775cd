#include "testing/NcclContractBackend.hpp"

#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <thread>
#include <utility>

#include "backend/WorkHSDP.hpp"
#include "backend/routes/Route.hpp"
#include "common/TorchCompat.hpp"
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

// NCCL's Work as the double models it (ProcessGroupNCCL.hpp/.cpp, torch
// 2.14.1, WorkNCCL):
//   * the data lands in the caller's tensors on wait()/synchronize(), or on
//     its own a while after the op completes (the GPU finishing in the
//     background);
//   * its future is device-aware: NCCL marks it completed at enqueue with
//     events recorded on NCCL's stream, so a consumer that waits on it is
//     ordered after the data. On CPU the only way to say that is to complete
//     it when the data lands. It never carries the op's failure: NCCL
//     completed it before the op ran;
//   * a failure is found by the communicator (the watchdog works on a copy of
//     the Work): this Work shows it only once isCompleted() or wait() has
//     looked (WorkNCCL::checkAndSetException), exception() alone does not;
//   * wait(timeout) that expires aborts the communicator and throws NCCL's
//     message ("... ran for N milliseconds before timing out"); the Work
//     has failed for good;
//   * the group's getError() is the first failure any of its Works met, as
//     the watchdog sets it (ProcessGroupNCCL::Watchdog::runLoop: an op past
//     its timeout TIMEOUT, another failure COMM_ERROR). An op of the inner
//     Gloo that fails on its timeout stands for one the watchdog times out.
class DeferredWork final : public c10d::Work {
 public:
  DeferredWork(
      int rank,
      c10d::OpType type,
      std::vector<WorkPtr> inners,
      std::function<void()> land,
      std::vector<at::Tensor> outputs,
      std::string failure,
      std::function<void()> abortComm,
      std::shared_ptr<std::atomic<int>> commError = nullptr)
      : Work(rank, type),
        inners_(std::move(inners)),
        land_(std::move(land)),
        outputs_(std::move(outputs)),
        failure_(std::move(failure)),
        abortComm_(std::move(abortComm)),
        commError_(std::move(commError)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  // A Work whose future is complete at issue and whose wait() orders after
  // nothing: what NCCL returns for an async op inside a coalescing block.
  static c10::intrusive_ptr<DeferredWork>
  orderedAfterNothing(int rank, c10d::OpType type, std::vector<at::Tensor> value) {
    auto w = c10::make_intrusive<DeferredWork>(
        rank, type, std::vector<WorkPtr>{}, nullptr, value, "", nullptr);
    w->landed_ = w->checked_ = true;
    w->future_->markCompleted(c10::IValue(std::move(value)));
    return w;
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    checked_ = landed_;
    return landed_;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return landed_ && !error_;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return checked_ ? error_ : nullptr;
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  void synchronize() override {
    wait();
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    landOrAwait(lock, timeout);
    checked_ = true;
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
  // The GPU finishing on its own: the data lands, nobody looks for errors.
  void landInBackground() {
    std::unique_lock<std::mutex> lock(mutex_);
    landOrAwait(lock, kNoTimeout);
  }

 private:
  void landOrAwait(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout) {
    if (!landed_ && !landing_) {
      // This thread lands the data; others wait for it (the lock is not held
      // meanwhile, so isCompleted() and exception() keep answering).
      landing_ = true;
      lock.unlock();
      std::exception_ptr error;
      auto kind = c10d::ErrorType::COMM_ERROR;
      const auto start = std::chrono::steady_clock::now();
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
      } catch (const std::exception& e) {
        if (timeout == kNoTimeout) {
          error = std::current_exception();
          if (std::string(e.what()).find("Timed out") != std::string::npos) {
            kind = c10d::ErrorType::TIMEOUT;
          }
        } else {
          error = timedOut(start);
          kind = c10d::ErrorType::TIMEOUT;
        }
      } catch (...) {
        error = timeout == kNoTimeout ? std::current_exception() : timedOut(start);
      }
      lock.lock();
      landed(error, kind);
      lock.unlock();
      future_->markCompleted(c10::IValue(outputs_)); // outside the lock: callbacks
      lock.lock();
    } else if (timeout == kNoTimeout) {
      landed_cv_.wait(lock, [&] { return landed_; });
    } else if (!landed_cv_.wait_for(lock, timeout, [&] { return landed_; })) {
      landed(timedOut(std::chrono::steady_clock::now() - timeout), c10d::ErrorType::TIMEOUT);
    }
  }

  // Under the lock. The first outcome is final; the group keeps the first
  // failure of any of its Works.
  void landed(std::exception_ptr error, c10d::ErrorType kind) {
    if (!landed_) {
      if (error && commError_) {
        int none = static_cast<int>(c10d::ErrorType::SUCCESS);
        commError_->compare_exchange_strong(none, static_cast<int>(kind));
      }
      error_ = std::move(error);
      landed_ = true;
      landed_cv_.notify_all();
    }
  }

  // WorkNCCL::wait(timeout) past its deadline: the communicator is aborted
  // and the error names how long the op ran (ProcessGroupNCCL.cpp,
  // WorkNCCL::checkTimeout).
  std::exception_ptr timedOut(std::chrono::steady_clock::time_point start) {
    if (abortComm_) {
      abortComm_();
    }
    const auto ran = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    return distError(
        "[Rank " + std::to_string(rank_) + "] Watchdog caught collective operation timeout: " +
        "WorkNCCL(OpType=" + c10d::opTypeToString(opType_) + ") ran for " +
        std::to_string(ran.count()) + " milliseconds before timing out.");
  }

  mutable std::mutex mutex_;
  std::condition_variable landed_cv_;
  bool landing_ = false; // a thread is landing the data, without the lock
  bool landed_ = false;
  bool checked_ = false; // isCompleted() or wait() has looked for a failure
  std::vector<WorkPtr> inners_;
  std::function<void()> land_;
  std::vector<at::Tensor> outputs_;
  std::string failure_;
  std::function<void()> abortComm_;
  std::shared_ptr<std::atomic<int>> commError_; // the group's getError()
  std::exception_ptr error_;                    // set once landed_, never changed after
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// endCoalescing's Work: waits as the block does (WorkNCCL::synchronizeStream
// on the end event recorded after ncclGroupEnd); its future is complete.
class EndOfBlockWork final : public c10d::Work {
 public:
  EndOfBlockWork(int rank, c10::intrusive_ptr<DeferredWork> block)
      : Work(rank, c10d::OpType::COALESCED),
        block_(std::move(block)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
  }
  bool isCompleted() override {
    return block_->isCompleted();
  }
  bool isSuccess() const override {
    return block_->isSuccess();
  }
  std::exception_ptr exception() const override {
    return block_->exception();
  }
  void synchronize() override {
    block_->synchronize();
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    return block_->wait(timeout);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return future_;
  }

 private:
  c10::intrusive_ptr<DeferredWork> block_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

} // namespace

std::function<void()> NcclContractBackend::abortComm() {
  // The Works may outlive this backend; the inner Gloo group they abort
  // lives as long as they do.
  return [gloo = gloo_] { gloo->abort(); };
}

NcclContractBackend::NcclContractBackend(
    c10::intrusive_ptr<c10d::Backend> gloo,
    int rank,
    int size,
    int release,
    c10::intrusive_ptr<c10d::Store> store)
    : Backend(rank, size), gloo_(std::move(gloo)), release_(release), store_(std::move(store)) {
  TORCH_CHECK_VALUE(
      release >= 11 && release <= 15, "nccl_contract models torch 2.11 to 2.15, not 2.", release);
}

c10::intrusive_ptr<c10d::Backend> NcclContractBackend::shrink(
    const std::vector<int64_t>& ranksToExclude,
    int shrinkFlags,
    const c10::intrusive_ptr<Options>& /*optsOverride: only NCCL's config*/) {
  // ProcessGroupNCCL::shrink's own checks, in its order and words.
  TORCH_CHECK_VALUE(!ranksToExclude.empty(), "ranks_to_exclude cannot be empty");
  TORCH_CHECK_VALUE(
      ranksToExclude.size() < static_cast<size_t>(size_),
      "Cannot exclude all ranks (",
      ranksToExclude.size(),
      " >= ",
      size_,
      ")");
  for (int64_t r : ranksToExclude) {
    TORCH_CHECK_VALUE(r >= 0 && r < size_, "Invalid rank ", r, " for group size ", size_);
  }
  TORCH_CHECK(
      connected_.load(), "Primary NCCL communicator for device 0 (key: 0) is not initialized");
  TORCH_CHECK(store_, "nccl_contract: made without a store, it cannot shrink");
  std::vector<int> stay;
  for (int r = 0; r < size_; ++r) {
    if (std::find(ranksToExclude.begin(), ranksToExclude.end(), r) == ranksToExclude.end()) {
      stay.push_back(r);
    }
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "nccl_contract/shrink/" + std::to_string(++shrinks_) + "/", store_);
  auto child = gloo_->split(store, stay, nullptr);
  TORCH_CHECK(child, "nccl_contract: an excluded rank called ncclCommShrink");
  // new_size = size_ - ranks_to_exclude.size(): a rank given twice counts twice.
  const int size = size_ - static_cast<int>(ranksToExclude.size());
  auto double_ =
      c10::make_intrusive<NcclContractBackend>(child, child->getRank(), size, release_, store);
  double_->connected_ = true; // initializeDeviceStateForComm: the shrunk comm, at once
  double_->shrunkWithFlags_ = shrinkFlags;
  return double_;
}

void NcclContractBackend::failNext(const std::string& message) {
  std::lock_guard<std::mutex> lock(mutex_);
  failNext_ = message;
}

at::Tensor NcclContractBackend::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK_VALUE(options.has_device(), "Tensor options must include device");
  TORCH_CHECK_VALUE(
      options.device().is_cpu(),
      "NCCL tensor allocator expects cuda type but got ",
      options.device());
  // ProcessGroupNCCL registers its memory pool with the communicator, which
  // it refuses to do before there is one (ProcessGroupNCCL::allocateTensor,
  // 2.14.1).
  TORCH_CHECK(
      connected_,
      "NCCL communicator has not been initialized before mem pool creation. You can pass "
      "`device_id` to init_process_group -- one way of eager initialization -- to work around "
      "this issue");
  allocations_.fetch_add(1);
  return at::empty({size}, options);
}

std::shared_ptr<c10::Allocator> NcclContractBackend::getMemAllocator() {
  // The pool's allocator: the CPU allocator the double's buffers come from
  // (not owned: it lives as long as the process).
  return std::shared_ptr<c10::Allocator>(c10::GetCPUAllocator(), [](c10::Allocator*) {});
}

std::vector<std::string> NcclContractBackend::receivedReductions() {
  std::lock_guard<std::mutex> lock(mutex_);
  return received_;
}

namespace {
// `factor` as a scalar of `data`'s dtype (AVG's 1/nRanks: NCCL rounds it
// itself, correctly, hostToDevRedOp in src/enqueue.cc).
at::Tensor inDataType(double factor, const at::Tensor& data) {
  return at::scalar_tensor(factor, at::TensorOptions().dtype(data.scalar_type()));
}

// The bf16 NCCL reads from the 2 bytes at a float's address (little-endian:
// its low half). ncclRedOpCreatePreMulSum copies ncclTypeSize(datatype)
// bytes of a host scalar (NVIDIA/nccl src/enqueue.cc, 2.30.7:
// `std::memcpy(&user->opFull.scalarArg, scalar, size)`); a device scalar is
// loaded as the data's type by the kernel.
at::BFloat16 lowHalfAsBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return at::BFloat16(static_cast<uint16_t>(bits & 0xffff), at::BFloat16::from_bits());
}

// The PREMUL_SUM factor NCCL multiplies `data`'s inputs by, as torch's
// ProcessGroupNCCL builds it: getNcclReduceOp picks unpackPreMulSum<T,
// dataType>, which makes a host factor `T scalar_factor =
// T(double_factor)` (ncclScalarHostImmediate) and reads a tensor factor
// with `tensor_factor.const_data_ptr<T>()` (ncclScalarDevice). T is the
// data's type but for bf16 on 2.11-2.13: `unpackPreMulSum<float,
// ncclBfloat16>` (torch 2.11.0, 2.12.0, 2.13.0 libtorch_cuda.so: the
// ncclBfloat16 branch calls const_data_ptr<float> and cvtsd2ss; 2.14.1:
// const_data_ptr<c10::BFloat16> and a rounded 16-bit store).
at::Tensor preMulFactor(
    const hsdp::compat::PreMulSumSupplement& premul,
    const at::Tensor& data,
    bool bf16AsFloat) {
  const auto dtype = data.scalar_type();
  const auto options = at::TensorOptions().dtype(dtype);
  const auto& tensor = premul.tensor_factor;
  if (dtype == at::kBFloat16 && bf16AsFloat) {
    if (tensor.defined()) {
      (void)tensor.const_data_ptr<float>(); // raises for a factor that is not fp32
      return at::scalar_tensor(static_cast<float>(lowHalfAsBf16(tensor.item<float>())), options);
    }
    return at::scalar_tensor(
        static_cast<float>(lowHalfAsBf16(static_cast<float>(premul.double_factor))), options);
  }
  if (tensor.defined()) {
    switch (dtype) {
      case at::kHalf:
        (void)tensor.const_data_ptr<at::Half>();
        break;
      case at::kBFloat16:
        (void)tensor.const_data_ptr<at::BFloat16>();
        break;
      case at::kFloat:
        (void)tensor.const_data_ptr<float>();
        break;
      default:
        (void)tensor.const_data_ptr<double>();
        break;
    }
    return tensor; // read on the device as the data's type: it is
  }
  switch (dtype) {
    case at::kHalf:
      return at::scalar_tensor(at::Half(static_cast<float>(premul.double_factor)), options);
    case at::kBFloat16:
      return at::scalar_tensor(at::BFloat16(static_cast<float>(premul.double_factor)), options);
    case at::kFloat:
      return at::scalar_tensor(static_cast<float>(premul.double_factor), options);
    default:
      return at::scalar_tensor(premul.double_factor, options);
  }
}

// Set by sumFor while an op is issued on this thread: the op was an integer
// AVG, whose division the data's landing does.
thread_local bool integerAverage = false;
} // namespace

c10d::ReduceOp
NcclContractBackend::sumFor(const char* what, const c10d::ReduceOp& op, const at::Tensor& t) {
  auto* premul = op.op_ == c10d::ReduceOp::PREMUL_SUM
      ? dynamic_cast<hsdp::compat::PreMulSumSupplement*>(op.supplement_.get())
      : nullptr;
  const bool tensorFactor = premul && premul->tensor_factor.defined();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    received_.push_back(
        std::string(what) + ":" + reduceOpName(op.op_) + (tensorFactor ? "[tensor]" : ""));
  }
  if (op.op_ == c10d::ReduceOp::AVG) {
    // ProcessGroupNCCL maps AVG to ncclAvg for every dtype but bool
    // (getNcclReduceOp); NCCL sums integers, then divides with truncation
    // toward zero (ncclDevSumPostDiv), floating point is pre-multiplied by
    // 1/nRanks.
    TORCH_CHECK(t.scalar_type() != at::kBool, "Cannot use ReduceOp.AVG with boolean inputs");
    if (at::isFloatingType(t.scalar_type())) {
      t.mul_(inDataType(1.0 / size_, t));
    } else {
      integerAverage = true;
    }
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) {
    return op;
  }
  TORCH_CHECK(
      at::isFloatingType(t.scalar_type()),
      "nccl_contract: ",
      what,
      " got ReduceOp.PREMUL_SUM on ",
      t.scalar_type(),
      ": PreMulSum Data type must be half, float, bfloat16 or double");
  TORCH_CHECK(premul, "nccl_contract: PREMUL_SUM without a factor");
  t.mul_(preMulFactor(*premul, t, bf16FactorAsFloat()));
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

namespace {

// A tensor nobody is made to keep alive: what NCCL holds of a synchronous
// call's tensors inside a coalescing block, whose kernels launch only at
// endCoalescing (ProcessGroupNCCL::collective stashes a block's tensors in
// coalescedTensors_, handed to endCoalescing's Work, for async calls only).
// Its storage is watched, not its TensorImpl: a view made for the call may
// die while the memory it shows lives on.
class Unowned {
 public:
  explicit Unowned(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) {
      plain_ = t; // nothing to watch (sparse, undefined): kept as it is
      return;
    }
    storage_ = t.storage().getWeakStorageImpl();
    options_ = t.options();
    sizes_ = t.sizes().vec();
    strides_ = t.strides().vec();
    offset_ = t.storage_offset();
  }

  // The tensor again, or none when its memory was freed.
  std::optional<at::Tensor> lock() const {
    if (!storage_) {
      return plain_;
    }
    auto storage = storage_->lock();
    if (!storage) {
      return std::nullopt;
    }
    return at::empty({0}, options_)
        .set_(c10::Storage(std::move(storage)), offset_, sizes_, strides_);
  }

 private:
  at::Tensor plain_;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage_; // none: plain_
  at::TensorOptions options_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;
};

[[noreturn]] void freedBeforeTheBlockRan(c10d::OpType type) {
  TORCH_CHECK(
      false,
      "nccl_contract: a tensor of a synchronous ",
      c10d::opTypeToString(type),
      " inside a coalescing block was freed before the block ran on the device: NCCL keeps "
      "only async calls' tensors of a block alive (ProcessGroupNCCL stashes them on "
      "endCoalescing's Work), so it would have read or written freed memory");
}

} // namespace

WorkPtr NcclContractBackend::run(
    c10d::OpType type,
    bool asyncOp,
    std::vector<at::Tensor> outputs,
    const std::function<std::vector<WorkPtr>(std::vector<at::Tensor>&)>& issue,
    const std::vector<at::Tensor>& inputs) {
  // ProcessGroupNCCL builds its communicator at the first collective (a
  // point-to-point op makes one of its own, for the pair).
  if (!isPointToPoint(type)) {
    connected_ = true;
  } else {
    pairConnected_ = true;
  }
  bool inBlock;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inBlock = coalescing_;
  }
  std::vector<at::Tensor> privates;
  for (const auto& t : outputs) {
    privates.push_back(t.clone(at::MemoryFormat::Contiguous));
  }
  integerAverage = false;
  auto works = issue(privates);
  const bool divide = std::exchange(integerAverage, false);
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure.swap(failNext_);
  }
  std::function<void()> land = [outputs, privates, divide, size = size_] {
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (divide) {
        privates[i].div_(size, "trunc");
      }
      outputs[i].copy_(privates[i]);
    }
  };
  auto value = outputs;
  if (inBlock && !asyncOp) {
    // Nothing holds these: the block lands into them only if they live.
    std::vector<Unowned> outs(outputs.begin(), outputs.end());
    std::vector<Unowned> ins(inputs.begin(), inputs.end());
    land = [outs = std::move(outs), ins = std::move(ins), privates, divide, size = size_, type] {
      for (const auto& in : ins) {
        if (!in.lock()) {
          freedBeforeTheBlockRan(type);
        }
      }
      for (size_t i = 0; i < outs.size(); ++i) {
        auto out = outs[i].lock();
        if (!out) {
          freedBeforeTheBlockRan(type);
        }
        if (divide) {
          privates[i].div_(size, "trunc");
        }
        out->copy_(privates[i]);
      }
    };
    value.clear();
  }
  auto work = c10::make_intrusive<DeferredWork>(
      rank_,
      type,
      std::move(works),
      std::move(land),
      value,
      std::move(failure),
      abortComm(),
      commError_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (coalescing_) {
      // As NCCL (ProcessGroupNCCL::collective/pointToPoint inside a
      // block): the last call's asyncOp decides endCoalescing's Work; an
      // async collective gets a Work that orders after nothing (its future
      // is marked completed at enqueue, its events are recorded only
      // outside a block, and the block launches at ncclGroupEnd, in
      // endCoalescing); point-to-point calls get none.
      heldAsync_ = asyncOp;
      held_.push_back(work);
      if (asyncOp) {
        stashed_.insert(stashed_.end(), outputs.begin(), outputs.end());
        stashed_.insert(stashed_.end(), inputs.begin(), inputs.end());
      }
      const bool p2p = isPointToPoint(type);
      if (!asyncOp || p2p) {
        return {};
      }
      return DeferredWork::orderedAfterNothing(rank_, type, outputs);
    }
  }
  if (!asyncOp) {
    work->wait();
    return {};
  }
  landLater([work] { work->landInBackground(); });
  return work;
}

void NcclContractBackend::landLater(std::function<void()> land) {
  const auto at = std::chrono::steady_clock::now() + kLandingDelay;
  // Landing completes the Work's future, which runs its callbacks: that is
  // the queue's completion step, so a callback that issues an op and waits
  // for it has a worker to land that op (see OpQueue.hpp).
  lander_.submit([at] { std::this_thread::sleep_until(at); }, std::move(land));
}

void NcclContractBackend::startCoalescing() {
  std::lock_guard<std::mutex> lock(mutex_);
  // ProcessGroupNCCL 2.14.1 does not refuse it: a second startCoalescing
  // drops the tensors stashed so far and opens a nested NCCL group whose end
  // Work orders after nothing launched. Refused here, so that a test sees
  // hsdp never nests.
  TORCH_CHECK(!coalescing_, "nccl_contract: startCoalescing inside a coalescing block");
  coalescing_ = true;
  held_.clear();
  stashed_.clear();
}

WorkPtr NcclContractBackend::endCoalescing() {
  std::vector<WorkPtr> held;
  std::vector<at::Tensor> stashed;
  bool asyncOp = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(coalescing_, "nccl_contract: endCoalescing without startCoalescing");
    coalescing_ = false;
    held.swap(held_);
    stashed.swap(stashed_);
    asyncOp = heldAsync_;
  }
  if (held.empty()) {
    return {};
  }
  // Its wait()/synchronize() orders after the whole block; its future
  // completes at once with an empty list, so it carries no event
  // (ProcessGroupNCCL::endCoalescing; ivalue::Future::markCompleted records
  // events only on the devices of the value's storages).
  // The end Work keeps the async calls' tensors alive for as long as it
  // lives (WorkNCCL::stashed_for_allocator_safety_).
  auto block = c10::make_intrusive<DeferredWork>(
      rank_,
      c10d::OpType::COALESCED,
      std::move(held),
      [stashed = std::move(stashed)] {},
      std::vector<at::Tensor>{},
      "",
      abortComm(),
      commError_);
  if (!asyncOp) {
    block->wait();
    return {};
  }
  landLater([block] { block->landInBackground(); });
  return c10::make_intrusive<EndOfBlockWork>(rank_, block);
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
  return run(
      c10d::OpType::_ALLGATHER_BASE,
      opts.asyncOp,
      {output},
      [&](auto& p) {
        // Gloo gets a copy: its Work would keep the caller's input alive,
        // which NCCL does not (see run()).
        auto in = input.clone();
        return std::vector<WorkPtr>{gloo_->_allgather_base(p[0], in, opts)};
      },
      {input});
}

WorkPtr NcclContractBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return run(
      c10d::OpType::COALESCED,
      opts.asyncOp,
      outputs,
      [&](auto& p) {
        std::vector<WorkPtr> works;
        for (size_t i = 0; i < p.size(); ++i) {
          auto in = inputs.at(i).clone(); // as in _allgather_base
          works.push_back(gloo_->_allgather_base(p[i], in, opts));
        }
        return works;
      },
      inputs);
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
  return run(
      c10d::OpType::_REDUCE_SCATTER_BASE,
      opts.asyncOp,
      {output},
      [&](auto& p) {
        auto in = input.clone();
        auto o = opts;
        o.reduceOp = sumFor("reduce_scatter_tensor", opts.reduceOp, in);
        return std::vector<WorkPtr>{gloo_->_reduce_scatter_base(p[0], in, o)};
      },
      {input});
}

WorkPtr NcclContractBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return run(
      c10d::OpType::COALESCED,
      opts.asyncOp,
      outputs,
      [&](auto& p) {
        std::vector<WorkPtr> works;
        for (size_t i = 0; i < p.size(); ++i) {
          auto in = inputs.at(i).clone();
          auto o = opts;
          o.reduceOp = sumFor("reduce_scatter_tensor_coalesced", opts.reduceOp, in);
          works.push_back(gloo_->_reduce_scatter_base(p[i], in, o));
        }
        return works;
      },
      inputs);
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
//
// NCCL runs a pair's point-to-point ops in order on one stream, and a send
// larger than what NCCL buffers completes only once the peer's receive runs.
// So an unbatched symmetric exchange of large messages deadlocks: each
// rank's send waits for a receive queued behind the peer's own send. Inside
// a coalescing block (batch_isend_irecv on a backend that reports
// supportsCoalescing) ncclGroupStart/End runs them together and they
// complete. Modelled on the host: outside a block, a send over
// kP2PBufferBytes first waits for the peer's receive to announce itself,
// which that receive does only when it is issued.
bool NcclContractBackend::pairedWithReceive(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(mutex_);
  return !coalescing_ && t.nbytes() > kP2PBufferBytes;
}

WorkPtr NcclContractBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  if (pairedWithReceive(tensors.at(0))) {
    std::vector<at::Tensor> token{at::empty({1}, at::kByte)};
    gloo_->recv(token, dstRank, tag + kReceivePostedTag)->wait();
  }
  return run(c10d::OpType::SEND, true, {}, [&](auto&) {
    return std::vector<WorkPtr>{gloo_->send(tensors, dstRank, tag)};
  });
}

WorkPtr NcclContractBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  if (pairedWithReceive(tensors.at(0))) {
    std::vector<at::Tensor> token{at::zeros({1}, at::kByte)};
    gloo_->send(token, srcRank, tag + kReceivePostedTag)->wait();
  }
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

void NcclContractBackend::joinSplit(int64_t color, int newSize) {
  std::vector<at::Tensor> mine{at::full({1}, color, at::kLong)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < getSize(); ++r) {
    all[0].push_back(at::empty({1}, at::kLong));
  }
  // Gloo's wait is bounded by the group's timeout: a rank that never joins
  // makes its peers fail here, as NCCL's blocking split would hang them.
  try {
    gloo_->allgather(all, mine, c10d::AllgatherOptions())->wait();
  } catch (const std::exception& e) {
    C10_THROW_ERROR(
        DistBackendError,
        c10::str(
            "[Rank ",
            getRank(),
            "] split: not every rank of the parent joined (color ",
            color,
            "): ",
            e.what()));
  }
  if (color == kNoColor) {
    return;
  }
  int joined = 0;
  for (const auto& t : all[0]) {
    joined += t.item<int64_t>() == color ? 1 : 0;
  }
  if (joined != newSize) {
    C10_THROW_ERROR(
        DistBackendError,
        c10::str(
            "[Rank ",
            getRank(),
            "] split: ",
            joined,
            " ranks of the parent gave color ",
            color,
            ", the new communicator has ",
            newSize));
  }
}

} // namespace hsdp::testing
