#include "backend/Plan.hpp"

#include <ATen/ATen.h>

#include <algorithm>

#include "fusion/FlatPack.hpp"

namespace hsdp {

namespace {

// What the routes get for a caller's tensor: they read and write raw
// memory, so a contiguous tensor: the caller's when it is contiguous (no
// view is made: the engine needs none, and a view costs about a
// microsecond a call), else a 1-D staging buffer, copied in when the route
// starts the call (after what is queued before it) and back when it is
// done. Routing never depends on a tensor's layout (that can differ between
// ranks, which would split them between routes): staging absorbs it.
struct FlatArg {
  at::Tensor user;
  at::Tensor flat;

  static FlatArg of(const at::Tensor& t) {
    return {t, t.is_contiguous() ? t : at::empty({t.numel()}, t.options())};
  }
  // Not staged, the caller's own tensor goes down: an inner Work handed
  // back as it is then completes with the caller's tensor, shape included,
  // as its future's value (DDP hooks such as PowerSGD use that value as the
  // tensor they reduced).
  bool staged() const {
    return !flat.is_alias_of(user);
  }
  void stageIn() const {
    if (staged()) {
      flat.view(user.sizes()).copy_(user);
    }
  }
  void copyBack() const {
    if (staged()) {
      user.copy_(flat.view(user.sizes()));
    }
  }
};

// A contiguous tensor as 1-D: itself when it is 1-D already, as FSDP2's
// flat buffers are (a view is a dispatched op, about a microsecond of host
// time, paid per tensor of a coalesced call).
at::Tensor flat1d(const at::Tensor& t) {
  return t.dim() == 1 ? t : t.view({-1});
}

// What a natively coalescing backend (NCCL) gets for a contiguous tensor:
// 1-D, and as NCCL has no complex types, complex tensors go as their (real,
// imaginary) pairs; sums, averages and real scale factors act on each
// component alike.
at::Tensor realView(const at::Tensor& t) {
  return t.is_complex() ? at::view_as_real(flat1d(t)).view({-1}) : flat1d(t);
}

// Copies staged arguments in before the call and back after it (most
// calls have none: nothing is allocated for them).
void stageAround(Plan& plan, std::vector<FlatArg> args, bool copyIn, bool copyBack) {
  std::erase_if(args, [](const FlatArg& a) { return !a.staged(); });
  if (args.empty()) {
    return;
  }
  for (const auto& a : args) {
    plan.keepAlive.push_back(a.flat);
  }
  if (copyIn) {
    plan.stageIn = [args] {
      for (const auto& a : args) {
        a.stageIn();
      }
    };
  }
  if (copyBack) {
    plan.post = [args] {
      for (const auto& a : args) {
        a.copyBack();
      }
    };
  }
}

std::vector<at::Tensor> pick(const std::vector<at::Tensor>& ts, const std::vector<size_t>& which) {
  std::vector<at::Tensor> picked;
  for (size_t i : which) {
    picked.push_back(ts[i]);
  }
  return picked;
}

} // namespace

std::vector<DtypeGroup> groupByDtype(
    const OpContext& ctx,
    const std::vector<at::Tensor>& tensors,
    const c10d::ReduceOp& op,
    int groupSize,
    double divideBy,
    NativeScale nativeScale) {
  std::vector<DtypeGroup> groups;
  std::vector<at::ScalarType> keys;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto dtype = tensors[i].scalar_type();
    auto it = std::find(keys.begin(), keys.end(), dtype);
    if (it != keys.end()) {
      groups[it - keys.begin()].members.push_back(i);
      continue;
    }
    keys.push_back(dtype);
    groups.push_back(
        {{i}, planReduce(ctx, op, tensors[i].options(), groupSize, divideBy, nativeScale)});
  }
  return groups;
}

Plan planInPlace(Kind kind, const at::Tensor& t, ReducePlan reduce, int root) {
  const auto arg = FlatArg::of(t);
  Plan plan;
  // Built in place: the one-tensor forms are the small calls, where each
  // temporary's reference counts show.
  auto& c = plan.collectives.emplace_back();
  c.kind = kind;
  c.inputs.push_back(arg.flat);
  c.reduce = std::move(reduce);
  c.root = root;
  plan.outputs.push_back(t);
  if (arg.staged()) {
    stageAround(plan, {arg}, /*copyIn=*/true, /*copyBack=*/true);
  }
  return plan;
}

Plan planAllGather(const at::Tensor& input, const at::Tensor& output) {
  const auto in = FlatArg::of(input);
  Plan plan;
  plan.collectives.push_back({Kind::AllGather, {in.flat}, {output}});
  plan.outputs = {output};
  if (in.staged()) {
    stageAround(plan, {in}, /*copyIn=*/true, /*copyBack=*/false);
  }
  return plan;
}

Plan planAllGatherToList(const at::Tensor& input, const std::vector<at::Tensor>& outputs) {
  const auto in = FlatArg::of(input);
  const int64_t n = input.numel();
  auto gathered = at::empty({static_cast<int64_t>(outputs.size()) * n}, input.options());
  Plan plan;
  plan.collectives.push_back({Kind::AllGather, {in.flat}, {gathered}});
  plan.outputs.assign(outputs.begin(), outputs.end());
  if (in.staged()) {
    stageAround(plan, {in}, /*copyIn=*/true, /*copyBack=*/false);
  }
  plan.keepAlive.push_back(gathered);
  plan.post = [gathered, outputs, n] {
    for (size_t r = 0; r < outputs.size(); ++r) {
      outputs[r].copy_(gathered.narrow(0, r * n, n).view(outputs[r].sizes()));
    }
  };
  return plan;
}

Plan planReduceScatter(const at::Tensor& input, const at::Tensor& output, ReducePlan reduce) {
  const auto out = FlatArg::of(output);
  Plan plan;
  plan.collectives.push_back({Kind::ReduceScatter, {input}, {out.flat}, false, std::move(reduce)});
  plan.outputs = {output};
  plan.keepAlive = {input};
  if (out.staged()) {
    stageAround(plan, {out}, /*copyIn=*/false, /*copyBack=*/true);
  }
  return plan;
}

Plan planReduceScatterFromList(
    const std::vector<at::Tensor>& inputs,
    const at::Tensor& output,
    ReducePlan reduce) {
  const auto out = FlatArg::of(output);
  const int64_t n = output.numel();
  auto flat = at::empty({static_cast<int64_t>(inputs.size()) * n}, output.options());
  Plan plan;
  plan.collectives.push_back({Kind::ReduceScatter, {flat}, {out.flat}, false, std::move(reduce)});
  plan.outputs = {output};
  if (out.staged()) {
    stageAround(plan, {out}, /*copyIn=*/false, /*copyBack=*/true);
  }
  plan.stageIn = [flat, inputs, n] {
    for (size_t q = 0; q < inputs.size(); ++q) {
      flat.narrow(0, q * n, n).copy_(inputs[q].reshape({-1}));
    }
  };
  plan.keepAlive.push_back(flat);
  return plan;
}

Plan planAllGatherCoalesced(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const Route& route,
    int rank,
    int size,
    const std::shared_ptr<StagingPool>& pool) {
  Plan plan;
  plan.outputs.assign(outputs.begin(), outputs.end());
  const bool native = route.coalescesNatively();
  if (native || route.gathersPieces(inputs.size(), bytesOf(inputs))) {
    // The callers' tensors as they are (outputs are contiguous: checked);
    // NCCL's as flat real views.
    Collective c{Kind::AllGather, {}, {}, /*asList=*/true};
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto in = inputs[i].contiguous();
      c.inputs.push_back(native ? realView(in) : in);
      c.outputs.push_back(native ? realView(outputs[i]) : outputs[i]);
    }
    plan.keepAlive.assign(c.inputs.begin(), c.inputs.end());
    plan.collectives.push_back(std::move(c));
    return plan;
  }
  auto pack = std::make_shared<AllGatherPack>(packAllGather(inputs, rank, size, *pool));
  auto lease = std::make_shared<StagingLease>(pool);
  lease->add(pack->staging);
  plan.collectives.push_back({Kind::AllGather, {pack->input}, {pack->output}});
  plan.post = [pack, lease, outputs, size] {
    pack->unpack(outputs, size);
    lease->release();
  };
  return plan;
}

Plan planReduceScatterCoalesced(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    const std::vector<DtypeGroup>& groups,
    const Route& route,
    int size,
    const std::shared_ptr<StagingPool>& pool) {
  Plan plan;
  plan.outputs.assign(outputs.begin(), outputs.end());
  if (route.coalescesNatively()) {
    // One launch per dtype (a PREMUL_SUM factor is typed), of the callers'
    // tensors (outputs are contiguous: checked).
    for (const auto& g : groups) {
      Collective c{Kind::ReduceScatter, {}, {}, /*asList=*/true, g.reduce};
      for (size_t i : g.members) {
        c.inputs.push_back(realView(inputs[i].contiguous()));
        c.outputs.push_back(realView(outputs[i]));
      }
      plan.keepAlive.insert(plan.keepAlive.end(), c.inputs.begin(), c.inputs.end());
      plan.collectives.push_back(std::move(c));
    }
    return plan;
  }
  struct Packed {
    ReduceScatterPack pack;
    std::vector<at::Tensor> outputs;
  };
  auto packs = std::make_shared<std::vector<Packed>>();
  auto lease = std::make_shared<StagingLease>(pool);
  for (const auto& g : groups) {
    auto outs = pick(outputs, g.members);
    auto pack = packReduceScatter(pick(inputs, g.members), outs, size, *pool);
    lease->add(pack.staging);
    plan.collectives.push_back({Kind::ReduceScatter, {pack.input}, {pack.output}, false, g.reduce});
    packs->push_back({std::move(pack), std::move(outs)});
  }
  plan.post = [packs, lease] {
    for (const auto& p : *packs) {
      p.pack.unpack(p.outputs);
    }
    lease->release();
  };
  return plan;
}

Plan planAllReduceBuckets(
    const std::vector<at::Tensor>& tensors,
    const std::vector<DtypeGroup>& groups,
    int64_t bucketBytes,
    const Route& route,
    const std::shared_ptr<StagingPool>& pool) {
  Plan plan;
  plan.outputs.assign(tensors.begin(), tensors.end());
  if (route.coalescesNatively()) {
    // One launch per bucket, of the callers' tensors: nothing is packed.
    std::vector<FlatArg> args;
    for (const auto& g : groups) {
      for (const auto& bucket : planBuckets(tensors, g.members, bucketBytes)) {
        Collective c{Kind::AllReduce, {}, {}, /*asList=*/true, g.reduce};
        for (size_t i : bucket) {
          args.push_back(FlatArg::of(tensors[i]));
          c.inputs.push_back(realView(args.back().flat));
        }
        plan.collectives.push_back(std::move(c));
      }
    }
    stageAround(plan, std::move(args), /*copyIn=*/true, /*copyBack=*/true);
    return plan;
  }
  auto buckets = std::make_shared<std::vector<Bucket>>();
  auto lease = std::make_shared<StagingLease>(pool);
  for (const auto& g : groups) {
    for (auto& bucket : packBuckets(tensors, g.members, bucketBytes, *pool)) {
      lease->add(bucket.staging);
      plan.collectives.push_back({Kind::AllReduce, {bucket.flat}, {}, false, g.reduce});
      buckets->push_back(std::move(bucket));
    }
  }
  plan.post = [buckets, lease, tensors] {
    for (const auto& b : *buckets) {
      b.unpack(tensors);
    }
    lease->release();
  };
  return plan;
}

} // namespace hsdp
