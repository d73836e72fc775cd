// ProcessGroupHSDP's planning and routing against a fake inner backend: what
// the route is asked to run (which c10d op, with which reduction, on how many
// tensors) and what the caller gets back, for routes that do and do not scale
// or coalesce natively. The fake is one rank of a world of kSize whose ranks
// all hold the same tensors, so every result has an exact reference.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "backend/ProcessGroupHSDP.hpp"
#include "backend/TracedCall.hpp"
#include "backend/WorkHSDP.hpp"
#include "common/TorchCompat.hpp"
#include "testing/NullBackend.hpp"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace hsdp {
namespace {

constexpr int kRank = 1;
constexpr int kSize = 4;

// A Work that is complete when handed back, as an inner backend's is once
// its op ran.
class DoneWork : public hsdp::testing::CompletedWork {
 public:
  explicit DoneWork(std::vector<at::Tensor> outputs)
      : CompletedWork(kRank, c10d::OpType::UNKNOWN, std::move(outputs)) {}
};

// The reduction of kSize equal contributions `t`, in place.
void reduceEqual(const at::Tensor& t, const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      t.mul_(kSize);
      return;
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::MAX:
    case c10d::ReduceOp::MIN:
      return;
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* s = dynamic_cast<hsdp::compat::PreMulSumSupplement*>(op.supplement_.get());
      t.mul_(
          s->tensor_factor.defined() ? s->tensor_factor.item<double>() * kSize
                                     : s->double_factor * kSize);
      return;
    }
    default:
      FAIL() << "the fake has no reduction " << static_cast<int>(op.op_);
  }
}

const char* opName(const c10d::ReduceOp& op) {
  return reduceOpName(op.op_);
}

// Rank kRank of kSize ranks holding the same tensors. Records each call as
// "<c10d op> <reduce op> x<tensors>".
class FakeInner : public c10d::Backend {
 public:
  FakeInner() : Backend(kRank, kSize) {}
  const std::string getBackendName() const override {
    return "fake";
  }

  std::vector<std::string> calls;
  bool sawNonContiguous = false;
  std::vector<at::Tensor> received; // the last call's tensors, as handed over
  std::chrono::milliseconds receivedTimeout{0};
#if HSDP_TORCH_HAS_IS_INITIALIZED
  bool initialized = true; // ProcessGroupNCCL: false until its communicator exists
  bool isInitialized() override {
    return initialized;
  }
#endif

  // Communication buffers, when `allocates` (as the NCCL double on CPU).
  bool allocates = false;
  int allocations = 0;
  bool onDevices = false; // answers for device indices (as NCCL), not only -1 (the CPU)
  bool supportsTensorAlloc(c10::DeviceIndex index) override {
    return allocates && (index == -1 || (onDevices && index >= 0));
  }
  at::Tensor allocateTensor(long size, at::TensorOptions options) override {
    ++allocations;
    return at::empty({size}, options);
  }
  std::shared_ptr<c10::Allocator> getMemAllocator() override {
    return std::shared_ptr<c10::Allocator>(c10::GetCPUAllocator(), [](c10::Allocator*) {});
  }

  // What getError() answers; suspend/resume/getMemoryStats and
  // allreduce_sparse are recorded.
  c10d::ErrorType error = c10d::ErrorType::SUCCESS;
  bool failNext = false;        // the next allreduce raises
  bool refusesGetError = false; // as c10d's default before torch 2.14, Gloo's among them
  c10d::ErrorType getError() override {
    TORCH_CHECK(!refusesGetError, "Backend fake does not support getError");
    return error;
  }
#if HSDP_TORCH_HAS_SUSPEND
  void suspend() override {
    calls.push_back("suspend");
  }
  void resume() override {
    calls.push_back("resume");
  }
  std::unordered_map<std::string, uint64_t> getMemoryStats() override {
    calls.push_back("getMemoryStats");
    return {{"bytes", 42}};
  }
#endif
  c10::intrusive_ptr<c10d::Work>
  allreduce_sparse(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    record("allreduce_sparse", o.reduceOp, ts);
    return c10::make_intrusive<DoneWork>(ts);
  }

  // What the other ranks contribute to a MAX all-reduce (none: the same).
  std::function<void(at::Tensor&)> peersMax;

  // Splits into a fake of its own, when `splits` (as NCCL and Gloo do).
  bool splits = false;
  bool supportsSplitting() const override {
    return splits;
  }
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>&,
      const std::vector<int>& ranks,
      const c10::intrusive_ptr<Options>&) override {
    calls.push_back("split x" + std::to_string(ranks.size()));
    return c10::make_intrusive<FakeInner>();
  }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>("fake");
  }

  // Coalescing as NCCL's: inside a block an op's Work is `blockOpWork()`
  // and endCoalescing hands back a Work only when the block's last call
  // was async (ProcessGroupNCCL::endCoalescing, the last call's asyncOp).
  std::function<c10::intrusive_ptr<c10d::Work>()> blockOpWork;
  bool inBlock = false;
  bool lastAsync = false;
  void startCoalescing() override {
    calls.push_back("startCoalescing");
    inBlock = true;
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    calls.push_back("endCoalescing");
    inBlock = false;
    return lastAsync ? c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{}) : nullptr;
  }

  c10::intrusive_ptr<c10d::Work>
  allreduce(std::vector<at::Tensor>& ts, const c10d::AllreduceOptions& o) override {
    if (failNext) {
      failNext = false;
      TORCH_CHECK(false, "the fake's all-reduce fails");
    }
    received = ts;
    receivedTimeout = o.timeout;
    auto work = reduceAll("allreduce", ts, o.reduceOp);
    if (peersMax && o.reduceOp.op_ == c10d::ReduceOp::MAX) {
      for (auto& t : ts) {
        peersMax(t);
      }
    }
    if (inBlock) {
      lastAsync = o.asyncOp;
      if (!o.asyncOp) {
        return nullptr;
      }
      if (blockOpWork) {
        return blockOpWork();
      }
    }
    return work;
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    calls.push_back(
        o.device_ids.empty() ? "barrier" : "barrier on " + std::to_string(o.device_ids[0]));
    return c10::make_intrusive<DoneWork>(std::vector<at::Tensor>{});
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& ts,
      const c10d::AllreduceCoalescedOptions& o) override {
    return reduceAll("allreduce_coalesced", ts, o.reduceOp);
  }
  c10::intrusive_ptr<c10d::Work>
  reduce(std::vector<at::Tensor>& ts, const c10d::ReduceOptions& o) override {
    record("reduce", o.reduceOp, ts);
    if (o.rootRank == kRank) {
      reduceEqual(ts[0], o.reduceOp);
    } // elsewhere the buffer is scratch: NCCL and Gloo leave it as it is
    return c10::make_intrusive<DoneWork>(ts);
  }
  c10::intrusive_ptr<c10d::Work>
  _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    received = {out, in};
    receivedTimeout = o.timeout;
    std::vector<at::Tensor> outs{out}, ins{in};
    return gather("_allgather_base", outs, ins);
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outs,
      std::vector<at::Tensor>& ins,
      const c10d::AllgatherOptions&) override {
    return gather("allgather_into_tensor_coalesced", outs, ins);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out,
      at::Tensor& in,
      const c10d::ReduceScatterOptions& o) override {
    received = {out, in};
    receivedTimeout = o.timeout;
    std::vector<at::Tensor> outs{out}, ins{in};
    return reduceScatter("_reduce_scatter_base", outs, ins, o.reduceOp);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outs,
      std::vector<at::Tensor>& ins,
      const c10d::ReduceScatterOptions& o) override {
    return reduceScatter("reduce_scatter_tensor_coalesced", outs, ins, o.reduceOp);
  }

 private:
  void record(const char* name, const c10d::ReduceOp& op, const std::vector<at::Tensor>& ts) {
    calls.push_back(std::string(name) + " " + opName(op) + " x" + std::to_string(ts.size()));
    for (const auto& t : ts) {
      sawNonContiguous = sawNonContiguous || !t.is_contiguous();
    }
  }
  c10::intrusive_ptr<c10d::Work>
  reduceAll(const char* name, std::vector<at::Tensor>& ts, const c10d::ReduceOp& op) {
    record(name, op, ts);
    for (const auto& t : ts) {
      reduceEqual(t, op);
    }
    return c10::make_intrusive<DoneWork>(ts);
  }
  c10::intrusive_ptr<c10d::Work>
  gather(const char* name, std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins) {
    record(name, c10d::ReduceOp::SUM, ins);
    for (size_t i = 0; i < ins.size(); ++i) {
      const int64_t n = ins[i].numel();
      for (int r = 0; r < kSize; ++r) {
        outs[i].view({-1}).narrow(0, r * n, n).copy_(ins[i].view({-1}));
      }
    }
    return c10::make_intrusive<DoneWork>(outs);
  }
  c10::intrusive_ptr<c10d::Work> reduceScatter(
      const char* name,
      std::vector<at::Tensor>& outs,
      std::vector<at::Tensor>& ins,
      const c10d::ReduceOp& op) {
    record(name, op, ins);
    for (size_t i = 0; i < ins.size(); ++i) {
      const int64_t n = outs[i].numel();
      outs[i].view({-1}).copy_(ins[i].view({-1}).narrow(0, kRank * n, n));
      reduceEqual(outs[i], op);
    }
    return c10::make_intrusive<DoneWork>(outs);
  }
};

struct Group {
  c10::intrusive_ptr<FakeInner> fake = c10::make_intrusive<FakeInner>();
  c10::intrusive_ptr<ProcessGroupHSDP> pg;

  explicit Group(InnerCaps caps) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    Config config;
    config.cpuRoute = Config::CpuRoute::Gloo; // no shared memory: the inner route serves
    pg = c10::make_intrusive<ProcessGroupHSDP>(
        store,
        kRank,
        kSize,
        std::chrono::milliseconds(10000),
        std::make_unique<InnerRoute>(fake, caps, kRank),
        nullptr,
        config);
  }
};

const InnerCaps kPacking{"fake"};                            // as Gloo
const InnerCaps kNative{"fake", /*nativeScale=*/true, true}; // as NCCL

void waitFor(const c10::intrusive_ptr<c10d::Work>& work) {
  if (work) {
    work->wait();
  }
}

#if HSDP_TORCH_HAS_TIME_ESTIMATE
// torch 2.15's collective time estimation, as ProcessGroupNCCL offers it.
class EstimatingInner : public FakeInner {
 public:
  bool started = false;
  bool supportsTimeEstimation() const override {
    return true;
  }
  void startTimeEstimate() override {
    started = true;
  }
  float endTimeEstimate() override {
    return 42.5f;
  }
};

TEST(Backend, TimeEstimationIsTheInnerCudaBackendsWhereItHasIt) {
  Group cpuOnly(kNative);
  EXPECT_FALSE(cpuOnly.pg->supportsTimeEstimation());
  EXPECT_ANY_THROW(cpuOnly.pg->startTimeEstimate());

  auto store = c10::make_intrusive<c10d::HashStore>();
  Config config;
  config.cpuRoute = Config::CpuRoute::Gloo;
  auto cuda = c10::make_intrusive<EstimatingInner>();
  auto pg = c10::make_intrusive<ProcessGroupHSDP>(
      store,
      kRank,
      kSize,
      std::chrono::milliseconds(10000),
      std::make_unique<InnerRoute>(c10::make_intrusive<FakeInner>(), kPacking, kRank),
      std::make_unique<InnerRoute>(cuda, kNative, kRank),
      config);
  EXPECT_TRUE(pg->supportsTimeEstimation());
  pg->startTimeEstimate();
  EXPECT_TRUE(cuda->started);
  EXPECT_EQ(pg->endTimeEstimate(), 42.5f);
}
#endif

#if HSDP_TORCH_HAS_IS_INITIALIZED
TEST(Backend, ASplitBeforeTheInnerCommunicatorExistsRaisesNamingIt) {
  Group g(kNative);
  g.fake->splits = true;
  g.fake->initialized = false;
  EXPECT_FALSE(g.pg->isInitialized());
  try {
    g.pg->split(c10::make_intrusive<c10d::HashStore>(), {0, 1}, nullptr);
    FAIL() << "split went ahead without the inner backend's communicator";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("split_group"), std::string::npos) << what;
    EXPECT_NE(what.find("inner fake backend has no communicator yet"), std::string::npos) << what;
  }
  g.fake->initialized = true;
  EXPECT_TRUE(g.pg->isInitialized());
}
#endif

TEST(ReducePlan, DeferredScaleOfBf16AndFp16IsTheFp32ResultRoundedOnce) {
  // The scale runs in place on the reduced dtype (no fp32 copy of the data):
  // bitwise what widening to fp32, scaling and rounding once gives.
  at::manual_seed(0);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    const auto data = (at::randn({4099}) * 100).to(dtype);
    for (double v : {3.0, 6.0, 8.0, 1.0 / 3, 0.125, 1e-3, 1234.5}) {
      const auto factor = at::tensor({v}, at::kDouble);
      for (const auto& scale :
           {DeferredScale::divideBy(v),
            DeferredScale::multiplyBy(v),
            DeferredScale::multiplyBy(factor)}) {
        auto got = data.clone();
        scale.apply(got);
        auto wide = data.to(at::kFloat);
        if (scale.kind() == DeferredScale::Kind::Divide) {
          wide.div_(v);
        } else {
          wide.mul_(static_cast<float>(v));
        }
        EXPECT_TRUE(at::equal(got, wide.to(dtype)))
            << dtype << " " << v << " kind " << static_cast<int>(scale.kind());
      }
    }
  }
}

TEST(ReducePlan, AtOneRankTheFactorIsHsdpsOwnMultiplyEvenOnANativeRoute) {
  // NCCL 2.28.9's one-rank reduce-scatter drops a PREMUL_SUM factor: at one
  // rank hsdp sends a SUM and scales the copy itself.
  const OpContext c{0, 1, "reduce_scatter_tensor"};
  auto plan = planReduce(c, compat::makePreMulSum(0.5), at::kFloat, 1, 1.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::Multiply);
  EXPECT_EQ(plan.post.value(), 0.5);
  plan = planReduce(c, c10d::ReduceOp(c10d::ReduceOp::SUM), at::kFloat, 1, 4.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::Divide);
  // With peers the factor rides inside NCCL's reduction, as before.
  const OpContext c2{0, 2, "reduce_scatter_tensor"};
  plan = planReduce(c2, compat::makePreMulSum(0.5), at::kFloat, 2, 1.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::PREMUL_SUM);
  EXPECT_TRUE(plan.post.isNone());
}

TEST(ReducePlan, ATensorFactorNcclCannotTakeAsItIsIsAMultiplyOnTheDevice) {
  // NCCL takes the caller's factor tensor of the data's dtype as it is; a
  // factor of another dtype, or one divided by divide_by, would be a new
  // tensor freed before NCCL's stream reads it, or read by the host (a
  // device sync): it stays a deferred multiply, where it lives.
  const OpContext c{0, 2, "all_reduce"};
  const auto same = at::full({}, 0.5, at::kFloat);
  auto plan = planReduce(c, compat::makePreMulSum(same), at::kFloat, 2, 1.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::PREMUL_SUM);
  EXPECT_TRUE(plan.post.isNone());
  const auto wider = at::full({}, 0.5, at::kDouble);
  plan = planReduce(c, compat::makePreMulSum(wider), at::kFloat, 2, 1.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::MultiplyTensor);
  plan = planReduce(c, compat::makePreMulSum(same), at::kFloat, 2, 4.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::MultiplyTensor);
  auto t = at::ones({4}, at::kFloat);
  plan.post.apply(t);
  EXPECT_TRUE(at::equal(t, at::full({4}, 0.125, at::kFloat)));
}

TEST(ReducePlan, Bf16ScalesNeverReachATransportThatLosesABf16Factor) {
  // Torch 2.11-2.13's ProcessGroupNCCL hands NCCL a bf16 factor as the low
  // half of a float (TorchCompat.hpp): a division by the group size alone
  // is ncclAvg, any other scale SUM and hsdp's multiply after it.
  const OpContext c{0, 4, "all_reduce"};
  const NativeScale lossy{true, /*bf16PreMulSum=*/false};
  auto plan = planReduce(c, compat::makePreMulSum(0.125), at::kBFloat16, 4, 1.0, lossy);
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::Multiply);
  EXPECT_EQ(plan.post.value(), 0.125);
  plan = planReduce(c, compat::makePreMulSum(0.25), at::kBFloat16, 4, 1.0, lossy);
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::AVG);
  EXPECT_TRUE(plan.post.isNone());
  plan = planReduce(c, c10d::ReduceOp(c10d::ReduceOp::SUM), at::kBFloat16, 4, 4.0, lossy);
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::AVG);
  plan = planReduce(c, c10d::ReduceOp(c10d::ReduceOp::AVG), at::kBFloat16, 4, 2.0, lossy);
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::Divide);
  EXPECT_EQ(plan.post.value(), 8.0);
  const auto factor = at::full({}, 0.5, at::kBFloat16);
  plan = planReduce(c, compat::makePreMulSum(factor), at::kBFloat16, 4, 1.0, lossy);
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::SUM);
  EXPECT_EQ(plan.post.kind(), DeferredScale::Kind::MultiplyTensor);
  // fp16 and fp32 are unaffected; where the factor is kept bf16 rides too.
  plan = planReduce(c, compat::makePreMulSum(0.125), at::kFloat, 4, 1.0, lossy);
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::PREMUL_SUM);
  plan = planReduce(c, compat::makePreMulSum(0.125), at::kBFloat16, 4, 1.0, NativeScale{true});
  EXPECT_EQ(plan.innerOp.op_, c10d::ReduceOp::PREMUL_SUM);
  EXPECT_TRUE(plan.post.isNone());
}

TEST(ReducePlan, TheInnerNcclIsToldWhatThisReleaseDoesWithABf16Factor) {
  // ProcessGroupNCCL keeps a bf16 factor from torch 2.14 (docs/versions.md).
  EXPECT_EQ(InnerCaps{}.bf16PreMulSum, TORCH_VERSION_MINOR >= 14);
}

TEST(ReducePlan, ADivisorThatIsNotFinitePositiveIsRefused) {
  const OpContext c{0, 2, "all_reduce"};
  for (double bad : {0.0, -2.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    EXPECT_THROW(
        planReduce(c, c10d::ReduceOp(c10d::ReduceOp::SUM), at::kFloat, 2, bad, NativeScale{true}),
        c10::ValueError)
        << bad;
  }
}

TEST(ReducePlan, AFactorTensorOnAnotherDeviceThanTheDataIsRefusedNamingBoth) {
  const OpContext c{1, 2, "all_reduce"};
  const auto factor = at::full({}, 0.5, at::TensorOptions().device(at::kMeta));
  try {
    planReduce(c, compat::makePreMulSum(factor), at::kFloat, 2, 1.0, NativeScale{true});
    FAIL() << "a factor on another device than the data was taken";
  } catch (const c10::ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[rank 1/2] all_reduce: "), std::string::npos) << what;
    EXPECT_NE(what.find("factor tensor is on meta but the data is on cpu"), std::string::npos)
        << what;
  }
}

// A group that serves CUDA through a fake inner NCCL whose communicator
// this rank may or may not have; the peers' answers to the barrier's
// agreement come through the CPU fake's MAX all-reduce (no GPU needed: the
// barrier names no device, so none is touched unless the ranks must connect).
struct CudaGroup {
  c10::intrusive_ptr<FakeInner> cpu = c10::make_intrusive<FakeInner>();
  c10::intrusive_ptr<FakeInner> cuda = c10::make_intrusive<FakeInner>();
  InnerRoute* cudaRoute = nullptr;
  c10::intrusive_ptr<ProcessGroupHSDP> pg;

  CudaGroup() {
    auto store = c10::make_intrusive<c10d::HashStore>();
    Config config;
    config.cpuRoute = Config::CpuRoute::Gloo;
    auto route = std::make_unique<InnerRoute>(cuda, kNative, kRank);
    cudaRoute = route.get();
    pg = c10::make_intrusive<ProcessGroupHSDP>(
        store,
        kRank,
        kSize,
        std::chrono::milliseconds(10000),
        std::make_unique<InnerRoute>(cpu, InnerCaps{"fake"}, kRank),
        std::move(route),
        config);
  }
  // The peers answer [wants a communicator, has one, has none] as given.
  void peersAnswer(int wants, int has, int hasNot) {
    cpu->peersMax = [=](at::Tensor& t) {
      t.copy_(at::maximum(t, at::tensor({wants, has, hasNot}, at::kInt)));
    };
  }
  void barrier() {
    waitFor(pg->barrier(c10d::BarrierOptions{}));
  }
};

TEST(Barrier, UntilTheRanksAgreeOnTheNcclCommunicatorEveryBarrierIsTheAgreement) {
  // No rank has used a GPU (a CPU job on a machine with GPUs): no
  // communicator is made, and every barrier is one small CPU all-reduce,
  // not an agreement on top of a barrier.
  CudaGroup g;
  g.barrier();
  g.barrier();
  EXPECT_EQ(g.cpu->calls, (std::vector<std::string>{"allreduce MAX x1", "allreduce MAX x1"}));
  EXPECT_TRUE(g.cuda->calls.empty());
  EXPECT_FALSE(g.cudaRoute->connected());
}

TEST(Barrier, OnceEveryRankHasTheCommunicatorBarriersOnlyMeet) {
  CudaGroup g;
  g.cudaRoute->markConnected(); // every rank ran a CUDA collective
  g.barrier();
  g.barrier();
  EXPECT_EQ(g.cpu->calls, (std::vector<std::string>{"allreduce MAX x1", "barrier"}));
  EXPECT_TRUE(g.cuda->calls.empty());
}

TEST(Barrier, OnceAgreedABarrierOnADeviceIsNcclsOwnThenTheCpuMeeting) {
  // NCCL's barrier (an all-reduce on NCCL's stream, then a host wait for the
  // current stream) covers this group's NCCL work never waited for; a CPU
  // meeting alone would not.
  CudaGroup g;
  g.cudaRoute->markConnected();
  g.barrier(); // the agreement, on no device
  c10d::BarrierOptions onDevice;
  onDevice.device_ids = {1};
  waitFor(g.pg->barrier(onDevice));
  EXPECT_EQ(g.cuda->calls, (std::vector<std::string>{"barrier on 1"}));
  EXPECT_EQ(g.cpu->calls, (std::vector<std::string>{"allreduce MAX x1", "barrier on 1"}));
}

TEST(Barrier, RanksThatDisagreeOnTheCommunicatorAreToldSoOnEveryRank) {
  // A CUDA collective that ran on some ranks only: the ones with a
  // communicator would skip making it, the others would wait in a device
  // all-reduce nobody else joins. Both sides raise instead, at once.
  for (const bool connectedHere : {true, false}) {
    CudaGroup g;
    if (connectedHere) {
      g.cudaRoute->markConnected();
      g.peersAnswer(0, 0, 1);
    } else {
      g.peersAnswer(0, 1, 0);
    }
    try {
      g.barrier();
      FAIL() << "a barrier over ranks that disagree went on (connected here: " << connectedHere
             << ")";
    } catch (const c10::DistBackendError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("[rank 1/4] barrier: the ranks disagree"), std::string::npos) << what;
    }
    EXPECT_TRUE(g.cuda->calls.empty());
  }
}

TEST(Split, ACommunicatorOfPointToPointPairsIsNotTheGroupsOwn) {
  // Only sends ran on the group's CUDA side: ProcessGroupNCCL's
  // isInitialized() is true (it counts the pairs' communicators), yet the
  // group has no communicator to split from. hsdp agrees over the CPU
  // first and connects, as a barrier would; NCCL's split is never reached
  // without it. This CPU build has no device to connect on, so the split
  // stops there, naming why.
  CudaGroup g;
  g.cpu->splits = g.cuda->splits = true;
  try {
    g.pg->split(c10::make_intrusive<c10d::HashStore>(), {0, 1, 2, 3}, nullptr);
    FAIL() << "split went ahead without the group's NCCL communicator";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find("[rank 1/4] split_group: no CUDA device to make the NCCL communicator on"),
        std::string::npos)
        << what;
  }
  EXPECT_EQ(g.cpu->calls, (std::vector<std::string>{"allreduce MAX x1"}));
  EXPECT_TRUE(g.cuda->calls.empty());
}

#if HSDP_TORCH_HAS_IS_INITIALIZED
TEST(Split, EveryRankAnswersIsInitializedAlikeWhateverNcclCounts) {
  // torch 2.15's split_group asks isInitialized() on each rank first.
  // ProcessGroupNCCL::isInitialized() is true once devNCCLCommMap_ holds any
  // communicator, a send's pair included (ProcessGroupNCCL.cpp, 2.15): a
  // rank that sent says true, its peers false. hsdp's own split makes the
  // group's communicator (agreeing first), so its answer is NCCL's on none.
  for (bool ncclSays : {false, true}) {
    CudaGroup g;
    g.cuda->initialized = ncclSays;
    EXPECT_TRUE(g.pg->isInitialized()) << "NCCL says " << ncclSays;
  }
}
#endif

TEST(Split, OnceEveryRankHasTheCommunicatorEachInnerBackendIsSplit) {
  CudaGroup g;
  g.cpu->splits = g.cuda->splits = true;
  g.cudaRoute->markConnected(); // a CUDA collective ran on every rank
  g.pg->getBackendOptions()->global_ranks_in_group = {10, 11, 12, 13};
  auto child = g.pg->split(c10::make_intrusive<c10d::HashStore>(), {0, 1}, nullptr);
  ASSERT_TRUE(child);
  EXPECT_EQ(child->getSize(), 2);
  EXPECT_EQ(child->getRank(), 1);
  // The members' global ranks, read by the barrier's guess of a rank's GPU.
  EXPECT_EQ(child->getBackendOptions()->global_ranks_in_group, (std::vector<uint64_t>{10, 11}));
  EXPECT_EQ(g.cpu->calls, (std::vector<std::string>{"split x2"}));
  EXPECT_EQ(g.cuda->calls, (std::vector<std::string>{"split x2"}));
}

TEST(Split, RanksThatDisagreeOnTheCommunicatorAreToldSo) {
  CudaGroup g;
  g.cpu->splits = g.cuda->splits = true;
  g.peersAnswer(0, 1, 0); // the others ran a CUDA collective this rank did not
  try {
    g.pg->split(c10::make_intrusive<c10d::HashStore>(), {0, 1}, nullptr);
    FAIL() << "a split over ranks that disagree went on";
  } catch (const c10::DistBackendError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("[rank 1/4] split_group: the ranks disagree"), std::string::npos) << what;
  }
  EXPECT_TRUE(g.cuda->calls.empty());
}

// The Work NCCL returns for an async call inside a block: it orders after
// nothing, and here its wait() takes a while, so that a post-step ordered
// only by it would still be pending when endCoalescing returns.
class SlowWork : public DoneWork {
 public:
  SlowWork() : DoneWork({}) {}
  bool wait(std::chrono::milliseconds) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return true;
  }
};

TEST(Coalescing, ABlockEndingInASynchronousCallFinishesItsPostStepsAtOnce) {
  // The block's last call is synchronous, so NCCL returns no end Work: the
  // block ran on the caller's stream. The copy-back of the strided
  // argument (a held post-step) must run there before endCoalescing
  // returns, not on a side stream ordered after nothing.
  Group g(kNative);
  g.fake->blockOpWork = [] { return c10::make_intrusive<SlowWork>(); };
  auto strided = at::ones({8, 2}).select(1, 0);
  auto last = at::ones({4});
  g.pg->startCoalescing();
  std::vector<at::Tensor> a{strided}, b{last};
  c10d::AllreduceOptions async;
  async.asyncOp = true;
  c10d::AllreduceOptions sync;
  sync.asyncOp = false;
  g.pg->allreduce(a, async);
  g.pg->allreduce(b, sync);
  auto work = g.pg->endCoalescing();
  EXPECT_TRUE(strided.eq(kSize).all().item<bool>()) << strided;
  EXPECT_TRUE(last.eq(kSize).all().item<bool>()) << last;
  EXPECT_TRUE(!work || work->isCompleted());
}

TEST(Coalescing, ABlockEndingInAnAsyncCallFinishesThroughItsEndWork) {
  Group g(kNative);
  auto strided = at::ones({8, 2}).select(1, 0);
  g.pg->startCoalescing();
  std::vector<at::Tensor> a{strided};
  c10d::AllreduceOptions async;
  async.asyncOp = true;
  g.pg->allreduce(a, async);
  auto work = g.pg->endCoalescing();
  ASSERT_TRUE(work);
  work->wait();
  EXPECT_TRUE(strided.eq(kSize).all().item<bool>()) << strided;
  EXPECT_EQ(
      g.fake->calls,
      (std::vector<std::string>{"startCoalescing", "allreduce SUM x1", "endCoalescing"}));
}

TEST(Backend, AvgWithoutNativeScaleIsSumThenOneDivision) {
  Group g(kPacking);
  auto t = at::arange(8, at::kFloat);
  auto reference = t.clone();
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  waitFor(g.pg->allreduce(ts, o));
  EXPECT_EQ(g.fake->calls, std::vector<std::string>{"allreduce SUM x1"});
  EXPECT_TRUE(at::equal(t, reference));
}

TEST(Backend, AvgOnANativeRouteGoesThroughUnchanged) {
  Group g(kNative);
  auto t = at::arange(8, at::kFloat);
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  waitFor(g.pg->allreduce(ts, o));
  EXPECT_EQ(g.fake->calls, std::vector<std::string>{"allreduce AVG x1"});
}

bool sameTensor(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

TEST(Plan, ACallTheInnerBackendTakesAsItIsGetsTheCallersTensorsAndTimeout) {
  // Nothing for hsdp to do before or after: the caller's tensor objects
  // (a contiguous 2-D one too: no flat view for a reduction) and timeout
  // reach the inner backend as they are.
  Group g(kNative);
  auto t = at::ones({2, 4});
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  o.timeout = std::chrono::milliseconds(1234);
  waitFor(g.pg->allreduce(ts, o));
  ASSERT_EQ(g.fake->received.size(), 1u);
  EXPECT_TRUE(sameTensor(g.fake->received[0], t));
  EXPECT_EQ(g.fake->receivedTimeout, o.timeout);

  auto in = at::ones({8}), out = at::empty({2});
  c10d::ReduceScatterOptions rs;
  rs.timeout = std::chrono::milliseconds(4321);
  waitFor(g.pg->_reduce_scatter_base(out, in, rs));
  EXPECT_TRUE(sameTensor(g.fake->received.at(0), out) && sameTensor(g.fake->received.at(1), in));
  EXPECT_EQ(g.fake->receivedTimeout, rs.timeout);
  EXPECT_TRUE(out.eq(kSize).all().item<bool>()) << out;

  auto gathered = at::empty({8});
  auto mine = at::full({2}, 3.0);
  waitFor(g.pg->_allgather_base(gathered, mine, c10d::AllgatherOptions{}));
  EXPECT_TRUE(
      sameTensor(g.fake->received.at(0), gathered) && sameTensor(g.fake->received.at(1), mine));
  EXPECT_TRUE(gathered.eq(3.0).all().item<bool>()) << gathered;
}

TEST(Plan, WhatTheInnerBackendCannotTakeAsItIsIsChangedAndUndone) {
  // A scale the transport does not run (packing route: AVG is SUM, then a
  // division), a strided tensor (staged), a 2-D all-gather on Gloo's *_base
  // form (flattened): each reaches the inner backend as hsdp made it.
  Group g(kPacking);
  auto t = at::ones({8});
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions avg;
  avg.reduceOp = c10d::ReduceOp::AVG;
  waitFor(g.pg->allreduce(ts, avg));
  EXPECT_EQ(g.fake->calls.back(), "allreduce SUM x1");
  EXPECT_TRUE(t.eq(1.0).all().item<bool>()) << t;

  auto strided = at::ones({8, 2}).select(1, 0);
  std::vector<at::Tensor> ss{strided};
  waitFor(g.pg->allreduce(ss, c10d::AllreduceOptions{}));
  EXPECT_FALSE(sameTensor(g.fake->received.at(0), strided));
  EXPECT_TRUE(g.fake->received.at(0).is_contiguous());
  EXPECT_TRUE(strided.eq(kSize).all().item<bool>()) << strided;

  auto gathered = at::empty({4, 2});
  auto mine = at::ones({1, 2});
  waitFor(g.pg->_allgather_base(gathered, mine, c10d::AllgatherOptions{}));
  EXPECT_EQ(g.fake->received.at(0).dim(), 1);
  EXPECT_EQ(g.fake->received.at(1).dim(), 1);
  EXPECT_TRUE(gathered.eq(1.0).all().item<bool>()) << gathered;
}

TEST(Backend, DivideByOnANativeRouteIsOnePreMulSumFactor) {
  Group g(kNative);
  auto t = at::full({6}, 8.0, at::kFloat);
  waitFor(g.pg->allreduceDividedBy(t, c10d::ReduceOp::SUM, 2.0, /*asyncOp=*/false));
  EXPECT_EQ(g.fake->calls, std::vector<std::string>{"allreduce PREMUL_SUM x1"});
  EXPECT_TRUE(at::equal(t, at::full({6}, 8.0 * kSize / 2, at::kFloat)));
}

TEST(Backend, NonContiguousTensorIsStagedAndCopiedBack) {
  Group g(kPacking);
  auto base = at::arange(12, at::kFloat).view({3, 4});
  auto t = base.t(); // a transposed view: not contiguous
  auto reference = t.clone() * kSize;
  std::vector<at::Tensor> ts{t};
  waitFor(g.pg->allreduce(ts, c10d::AllreduceOptions{}));
  EXPECT_FALSE(g.fake->sawNonContiguous);
  EXPECT_TRUE(at::equal(t, reference));
}

TEST(Backend, ReduceScalesOnlyAtTheRoot) {
  Group g(kPacking);
  auto t = at::full({4}, 3.0, at::kFloat);
  std::vector<at::Tensor> ts{t};
  c10d::ReduceOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  o.rootRank = 0; // not this rank: its buffer is scratch, left as the backend left it
  waitFor(g.pg->reduce(ts, o));
  EXPECT_EQ(g.fake->calls, std::vector<std::string>{"reduce SUM x1"});
  EXPECT_TRUE(at::equal(t, at::full({4}, 3.0, at::kFloat)));
}

// Two float tensors and one double: one collective per dtype.
struct ScatterCase {
  std::vector<at::Tensor> inputs{
      at::arange(kSize * 3, at::kFloat),
      at::arange(kSize * 5, at::kDouble),
      at::arange(kSize * 2, at::kFloat) + 100};
  std::vector<at::Tensor> outputs{
      at::zeros({3}, at::kFloat),
      at::zeros({5}, at::kDouble),
      at::zeros({2}, at::kFloat)};

  void expectAverages() const {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t n = outputs[i].numel();
      EXPECT_TRUE(at::allclose(outputs[i], inputs[i].narrow(0, kRank * n, n))) << "tensor " << i;
    }
  }
};

TEST(Backend, CoalescedReduceScatterPacksOneCollectivePerDtype) {
  Group g(kPacking);
  ScatterCase c;
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  waitFor(g.pg->reduce_scatter_tensor_coalesced(c.outputs, c.inputs, o));
  EXPECT_EQ(
      g.fake->calls,
      (std::vector<std::string>{"_reduce_scatter_base SUM x1", "_reduce_scatter_base SUM x1"}));
  c.expectAverages();
}

TEST(Backend, CoalescedReduceScatterOnANativeRouteHandsOverTheCallersTensors) {
  Group g(kNative);
  ScatterCase c;
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  waitFor(g.pg->reduce_scatter_tensor_coalesced(c.outputs, c.inputs, o));
  EXPECT_EQ(
      g.fake->calls,
      (std::vector<std::string>{
          "reduce_scatter_tensor_coalesced AVG x2", "reduce_scatter_tensor_coalesced AVG x1"}));
  c.expectAverages();
}

TEST(Backend, CoalescedAllGatherIsOneCollective) {
  for (const auto& caps : {kPacking, kNative}) {
    Group g(caps);
    std::vector<at::Tensor> inputs{at::arange(3, at::kFloat), at::arange(2, at::kLong)};
    std::vector<at::Tensor> outputs{
        at::zeros({kSize * 3}, at::kFloat), at::zeros({kSize * 2}, at::kLong)};
    waitFor(g.pg->allgather_into_tensor_coalesced(outputs, inputs, c10d::AllgatherOptions{}));
    const std::string expected =
        caps.nativeCoalescing ? "allgather_into_tensor_coalesced SUM x2" : "_allgather_base SUM x1";
    EXPECT_EQ(g.fake->calls, std::vector<std::string>{expected});
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_TRUE(at::equal(outputs[i], inputs[i].repeat({kSize}))) << caps.name << " " << i;
    }
  }
}

TEST(Backend, BucketedAllReduceRunsOneCollectivePerBucket) {
  for (const auto& caps : {kPacking, kNative}) {
    Group g(caps);
    std::vector<at::Tensor> ts{
        at::full({100}, 1.0, at::kFloat),
        at::full({100}, 2.0, at::kFloat),
        at::full({100}, 3.0, at::kFloat)};
    // 400 bytes each, buckets of at most 800: [0, 1], [2].
    waitFor(g.pg->allreduceBucketed(ts, c10d::ReduceOp::SUM, 800, /*asyncOp=*/true));
    const std::vector<std::string> expected = caps.nativeCoalescing
        ? std::vector<std::string>{"allreduce_coalesced SUM x2", "allreduce_coalesced SUM x1"}
        : std::vector<std::string>{"allreduce SUM x1", "allreduce SUM x1"};
    EXPECT_EQ(g.fake->calls, expected);
    for (size_t i = 0; i < ts.size(); ++i) {
      EXPECT_TRUE(at::equal(ts[i], at::full({100}, (i + 1.0) * kSize, at::kFloat)));
    }
  }
}

TEST(Backend, AWaitPastItsDeadlineNamesTheRankAndTheOp) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  WorkHSDP work(kRank, c10d::OpType::ALLREDUCE, future); // never completed
  try {
    work.wait(std::chrono::milliseconds(5));
    FAIL() << "the wait outlived its deadline";
  } catch (const c10::DistBackendError& e) {
    EXPECT_EQ(
        std::string(e.what_without_backtrace())
            .rfind("[rank 1] ALLREDUCE: Work::wait timed out", 0),
        0u)
        << e.what_without_backtrace();
  }
  future->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
}

TEST(Backend, ErrorsNameTheRankAndTheOp) {
  Group g(kPacking);
  std::vector<at::Tensor> ts{at::ones({2}, at::kBool)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::AVG;
  try {
    g.pg->allreduce(ts, o);
    FAIL() << "AVG of bool tensors was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[rank 1/4] all_reduce: "), std::string::npos) << e.what();
  }
  EXPECT_TRUE(g.fake->calls.empty());
}

TEST(Backend, EachCollectiveCountsOnceInTheSequence) {
  Group g(kPacking);
  ScatterCase c;
  g.pg->setSequenceNumberForGroup();
  waitFor(g.pg->reduce_scatter_tensor_coalesced(c.outputs, c.inputs, c10d::ReduceScatterOptions{}));
  std::vector<at::Tensor> ts{at::ones({3})};
  waitFor(g.pg->allreduce(ts, c10d::AllreduceOptions{}));
  // Two inner collectives for the first call (two dtypes): still one c10d collective.
  EXPECT_EQ(g.fake->calls.size(), 3u);
  EXPECT_EQ(g.pg->getSequenceNumberForGroup(), 2u);
}

// Communication buffers come from the route their collectives take: with
// no shared memory, the inner backend's (NCCL's pool on a GPU), else none.
TEST(Buffers, WithoutAPoolAllocationIsTheInnerBackends) {
  Group g(kNative);
  g.fake->allocates = true;
  EXPECT_TRUE(g.pg->supportsTensorAlloc(-1));
  EXPECT_FALSE(g.pg->supportsTensorAlloc(0)); // no CUDA route
  const at::Tensor t =
      g.pg->allocateTensor(8, at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  EXPECT_EQ(t.numel(), 8);
  EXPECT_EQ(t.scalar_type(), at::kFloat);
  EXPECT_EQ(g.fake->allocations, 1);
  EXPECT_EQ(g.pg->getMemAllocator().get(), c10::GetCPUAllocator());
}

// Index -1 is the CPU and also a CUDA device named without an index, whose
// allocation NCCL's pool serves on the current device: true only where both
// routes would allocate, NCCL asked about the current device (it has no
// answer for -1), false where there is no device to ask. Never raises.
TEST(Buffers, ADeviceWithoutAnIndexIsServedOnlyWhereCpuAndCudaBothAllocate) {
  CudaGroup g;
  g.cuda->onDevices = true;
  g.cpu->allocates = true;
  EXPECT_FALSE(g.pg->supportsTensorAlloc(-1)); // the inner NCCL has no pool
  g.cuda->allocates = true;
  bool aDevice = false;
  try {
    aDevice = c10::impl::VirtualGuardImpl(at::kCUDA).deviceCount() > 0;
  } catch (const c10::Error&) {
  }
  EXPECT_EQ(g.pg->supportsTensorAlloc(-1), aDevice);
  g.cpu->allocates = false;
  EXPECT_FALSE(g.pg->supportsTensorAlloc(-1));
}

// getError: an inner backend's error (NCCL's own) first, then hsdp's record
// of a failed op (Gloo's getError always says SUCCESS).
TEST(Backend, GetErrorIsTheInnerBackendsElseWhetherAnOpFailedHere) {
  CudaGroup g;
  EXPECT_EQ(g.pg->getError(), c10d::ErrorType::SUCCESS);
  g.cuda->error = c10d::ErrorType::TIMEOUT;
  EXPECT_EQ(g.pg->getError(), c10d::ErrorType::TIMEOUT);
  // The first failure sticks, as the watchdog keeps ProcessGroupNCCL's.
  g.cuda->error = c10d::ErrorType::SUCCESS;
  g.cpu->error = c10d::ErrorType::REMOTE_ERROR;
  EXPECT_EQ(g.pg->getError(), c10d::ErrorType::TIMEOUT);

  CudaGroup other;
  other.cpu->error = c10d::ErrorType::REMOTE_ERROR;
  EXPECT_EQ(other.pg->getError(), c10d::ErrorType::REMOTE_ERROR);

  // An inner backend that has no answer (torch 2.11-2.13's Gloo) is SUCCESS.
  CudaGroup older;
  older.cpu->refusesGetError = older.cuda->refusesGetError = true;
  EXPECT_EQ(older.pg->getError(), c10d::ErrorType::SUCCESS);

  Group failing(kPacking);
  failing.fake->failNext = true; // the inner all-reduce raises
  at::Tensor t = at::ones({4});
  std::vector<at::Tensor> ts{t};
  EXPECT_ANY_THROW(waitFor(failing.pg->allreduce(ts, c10d::AllreduceOptions{})));
  EXPECT_EQ(failing.pg->getError(), c10d::ErrorType::COMM_ERROR);
}

// A sparse CUDA all-reduce (the only kind c10d sends to allreduce_sparse)
// goes to the inner backend of the tensors' device, as it is.
TEST(Backend, AllreduceSparseGoesToTheInnerBackendOfTheDevice) {
  CudaGroup g;
  at::Tensor t = at::ones({4}).to_sparse();
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions o;
  waitFor(g.pg->allreduce_sparse(ts, o));
  EXPECT_EQ(g.cpu->calls, (std::vector<std::string>{"allreduce_sparse SUM x1"}));
  EXPECT_TRUE(g.cuda->calls.empty());
}

#if HSDP_TORCH_HAS_SUSPEND
// suspend / resume / getMemoryStats are the inner NCCL's; a group without
// CUDA refuses them, naming the rank, the op and why.
TEST(Backend, SuspendResumeAndMemoryStatsAreTheInnerNcclsOrRefused) {
  CudaGroup g;
  g.pg->suspend();
  g.pg->resume();
  EXPECT_EQ(g.pg->getMemoryStats().at("bytes"), 42u);
  EXPECT_EQ(g.cuda->calls, (std::vector<std::string>{"suspend", "resume", "getMemoryStats"}));
  EXPECT_TRUE(g.cpu->calls.empty());

  Group cpuOnly(kNative);
  try {
    cpuOnly.pg->suspend();
    FAIL() << "a group without CUDA suspended";
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find("[rank 1/4] suspend: this process group was created without CUDA"),
        std::string::npos)
        << what;
    EXPECT_NE(what.find("no device memory of NCCL's"), std::string::npos) << what;
  }
  EXPECT_ANY_THROW(cpuOnly.pg->getMemoryStats());
}
#endif

// What ProcessGroupNCCL serves through a completion hook and Gloo through
// collective timing, hsdp's flight recorder serves: refused, naming it.
TEST(Backend, CompletionHooksAndTimingAreRefusedNamingTheFlightRecorder) {
  Group g(kNative);
  auto refusal = [](const std::function<void()>& call) -> std::string {
    try {
      call();
    } catch (const c10::Error& e) {
      return e.what();
    }
    return "(served)";
  };
  const auto hook = refusal([&] { g.pg->registerOnCompletionHook([](auto) {}); });
  EXPECT_NE(hook.find("[rank 1/4] register_on_completion_hook: not supported"), std::string::npos)
      << hook;
  EXPECT_NE(hook.find("flight recorder"), std::string::npos) << hook;
  const auto timing = refusal([&] { g.pg->enableCollectivesTiming(); });
  EXPECT_NE(timing.find("[rank 1/4] enable_collectives_timing: not supported"), std::string::npos)
      << timing;
  const auto pending = refusal([&] { g.pg->waitForPendingWorks(); });
  EXPECT_NE(pending.find("dist.barrier()"), std::string::npos) << pending;
}

TEST(Buffers, ARouteWithoutBuffersRefusesNamingTheRankAndTheOp) {
  Group g(kPacking);
  EXPECT_FALSE(g.pg->supportsTensorAlloc(-1));
  auto refusal = [&](const at::TensorOptions& options) -> std::string {
    try {
      g.pg->allocateTensor(8, options);
    } catch (const c10::Error& e) {
      return e.what();
    }
    return "(allocated)";
  };
  const std::string cpu = refusal(at::TensorOptions().dtype(at::kFloat).device(at::kCPU));
  EXPECT_NE(
      cpu.find("[rank 1/4] allocate_tensor: this group has no communication buffers on cpu"),
      std::string::npos)
      << cpu;
  const std::string none = refusal(at::TensorOptions().dtype(at::kFloat));
  EXPECT_NE(
      none.find("[rank 1/4] allocate_tensor: the tensor options name no device"), std::string::npos)
      << none;
  const std::string cuda =
      refusal(at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, 0)));
  EXPECT_NE(cuda.find("created without CUDA"), std::string::npos) << cuda;
  EXPECT_EQ(g.fake->allocations, 0);
}

} // namespace
} // namespace hsdp

namespace hsdp {
namespace {

// A device whose events are counted: what the flight recorder asks of a
// CUDA device (an event made, recorded on the current stream, queried at a
// dump), on PrivateUse1, which nothing else in this binary uses.
struct CountedEvents {
  std::atomic<int> made{0};
  std::atomic<int> recorded{0};
  std::atomic<int> destroyed{0};
  std::atomic<bool> reached{false};
  std::atomic<int64_t> lastStream{-1};
  std::atomic<int> streamsSynchronized{0};
};
CountedEvents counted;

struct CountingGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return c10::DeviceType::PrivateUse1;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    return d;
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::PrivateUse1, 0);
  }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::UNSAFE, d, 7);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    return s;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 2;
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex, const c10::EventFlag)
      const override {
    if (*event == nullptr) {
      *event = new int(0);
      ++counted.made;
    }
    ++counted.recorded;
    counted.lastStream = stream.id();
  }
  bool queryEvent(void*) const override {
    return counted.reached;
  }
  void synchronizeStream(const c10::Stream&) const override {
    ++counted.streamsSynchronized;
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<int*>(event);
    ++counted.destroyed;
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, CountingGuardImpl);

std::string readAll(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Recorder, AnOpOnADeviceRecordsItsSlotsEventNotANewOne) {
  char dir[] = "/tmp/hsdp-recorder-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const c10::Device device(c10::DeviceType::PrivateUse1, 0);
  counted.made = 0;
  counted.recorded = 0;
  counted.destroyed = 0;
  counted.reached = false;
  {
    FlightRecorder trace(kRank, kSize, {4, dir});
    for (uint64_t seq = 1; seq <= 40; ++seq) {
      trace.started(seq, "all_reduce", 64, "inner");
      completeEntry(trace, seq, device);
    }
    EXPECT_EQ(counted.made, 4) << "one event a slot of a ring of 4, reused by later ops";
    EXPECT_EQ(counted.recorded, 40);
    EXPECT_EQ(counted.lastStream, 7) << "recorded on the device's current stream";
    EXPECT_EQ(counted.destroyed, 0);
    const std::string before = readAll(trace.dump("t"));
    EXPECT_EQ(before.find("\"completed\""), std::string::npos) << before;
    counted.reached = true;
    const std::string after = readAll(trace.dump("t"));
    EXPECT_EQ(after.find("\"started\""), std::string::npos) << after;

    // Another device: the slot's event (bound to device 0) is replaced.
    trace.started(41, "all_reduce", 64, "inner");
    completeEntry(trace, 41, c10::Device(c10::DeviceType::PrivateUse1, 1));
    EXPECT_EQ(counted.made, 5);
    EXPECT_EQ(counted.destroyed, 1);

    // A host op: no event.
    trace.started(42, "all_reduce", 64, "inner");
    completeEntry(trace, 42, std::nullopt);
    EXPECT_EQ(counted.made, 5);
  }
  EXPECT_EQ(counted.destroyed, 5) << "the slots' events go with the recorder";
  std::system((std::string("rm -rf ") + dir).c_str());
}

TEST(Barrier, OnADeviceItWaitsForTheCurrentStreamUntilAgreedThenNcclsBarrierDoes) {
  // Until the ranks agree on the communicator, the barrier waits for the
  // device's current stream itself (GPU work issued before it), then meets;
  // once agreed, the inner NCCL's barrier waits for it (WorkNCCL's wait on a
  // barrier synchronizes the current stream), so hsdp adds no second wait.
  counted.streamsSynchronized = 0;
  CudaGroup g;
  g.cudaRoute->markConnected();
  c10d::BarrierOptions onDevice;
  onDevice.device = c10::Device(c10::DeviceType::PrivateUse1, 0);
  waitFor(g.pg->barrier(onDevice));
  EXPECT_EQ(counted.streamsSynchronized, 1);
  waitFor(g.pg->barrier(onDevice));
  EXPECT_EQ(counted.streamsSynchronized, 1);
  EXPECT_EQ(g.cuda->calls, (std::vector<std::string>{"barrier on 0", "barrier on 0"}));
}

} // namespace
} // namespace hsdp
