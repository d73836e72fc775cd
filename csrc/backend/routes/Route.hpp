#pragma once

// The one interface under ProcessGroupHSDP. An override validates its
// arguments and plans the call (Plan: its collectives on flat tensors, the
// staging around them, the post-step that finishes it); a route runs the
// plan and says how it completes. Routes:
//   * ShmRoute: the shared-memory engine (one host) or that engine within
//     hosts and Gloo between them (hierarchical), CPU tensors;
//   * InnerRoute: an inner c10d backend (Gloo for CPU, or one injected in
//     its place; NCCL for CUDA), which also serves every op the other
//     route has no form for, as it is (InnerRoute::workFor).
// What a route serves decides how a call is planned: a route that scales
// natively gets AVG and PREMUL_SUM as they are, one that coalesces
// natively gets lists of the callers' tensors (one launch), the others get
// one packed buffer per collective.

#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/Errors.hpp"
#include "fusion/ReducePlan.hpp"

namespace hsdp {

// Point-to-point ops: complete independently of each other, and make NCCL a
// communicator of the pair's own, not the group's.
inline bool isPointToPoint(c10d::OpType type) {
  return type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
      type == c10d::OpType::RECVANYSOURCE;
}

// One c10d call on its way down: who makes it, what it is, and where it is
// recorded. A value passed from the override to the route.
struct Call {
  OpContext ctx;
  c10d::OpType type;
  bool asyncOp = false;
  std::chrono::milliseconds timeout = c10d::kUnsetTimeout; // the op's own, as its options give it
  uint64_t seq = 0;                  // its flight-record entry (0: none, point-to-point)
  std::optional<c10::Device> device; // a CUDA call's device: its entry completes there
  // The part of the group's ephemeral timeout extension this call releases
  // when it completes (TimeoutExtension.hpp).
  std::chrono::milliseconds ownedExtension{0};
};

// The reduction of a collective that has none.
inline ReducePlan noReduction() {
  return {c10d::ReduceOp::SUM, DeferredScale::none()};
}

// A collective's or a call's tensors: inline room for one, as most calls
// have (a heap allocation is a measurable share of a small call's own cost).
using Tensors = c10::SmallVector<at::Tensor, 1>;

enum class Kind { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, Barrier };

// One collective on contiguous tensors (a route flattens them where its
// transport needs 1-D shapes). `inputs` holds one tensor,
// or a list (`asList`: a route that coalesces natively runs it as one
// launch; the engine gathers it piecewise); `outputs` pairs with it
// (all-gather: world size x input; reduce-scatter: input / world size) and
// is empty for the in-place kinds.
struct Collective {
  Kind kind;
  Tensors inputs;
  Tensors outputs = {};
  bool asList = false;
  // Reductions: what the transport runs and the deferred scale of the
  // result (applied by the route: fused into the engine's kernel, or after
  // the inner op).
  ReducePlan reduce = noReduction();
  int root = 0;

  // The tensors that hold the result.
  const Tensors& results() const {
    return outputs.empty() ? inputs : outputs;
  }
};

// A call as a route runs it: `stageIn`, the collectives in order, the
// deferred scales, then `post` (unpack, copy back, give back the staging:
// a StagingLease it holds, which gives its buffers back when destroyed
// if the call fails before `post` runs).
struct Plan {
  std::function<void()> stageIn;               // empty: nothing to copy in
  c10::SmallVector<Collective, 1> collectives; // inline room, as Tensors
  std::function<void()> post;                  // empty: nothing to do after
  Tensors outputs;                             // the value of the Work's future
  std::vector<at::Tensor> keepAlive;           // buffers the op or `post` still use
};

// How a routed call completes.
struct Completion {
  // null: a synchronous call that is complete (or, on CUDA, ordered on the
  // caller's current stream).
  c10::intrusive_ptr<c10d::Work> work;
  // The route recorded the call's end in the flight record itself (the
  // engine's queue knows when the data landed; a Work's future is followed
  // otherwise).
  bool endRecorded = false;
};

class Route {
 public:
  virtual ~Route() = default;

  virtual const char* name() const = 0;
  // The route a flight-record entry names: hsdp's own routes by name, an
  // inner backend as "inner" (a record tells calls hsdp ran from calls it
  // handed on).
  virtual const char* recordedAs() const {
    return "inner";
  }
  // What of AVG and PREMUL_SUM runs inside the reduction (planReduce).
  virtual NativeScale scalesNatively() const = 0;
  // A collective may hold lists (Collective::inputs), run as one launch.
  virtual bool coalescesNatively() const = 0;
  // An all-gather of `pieces` tensors may stay unpacked, even without
  // native coalescing.
  virtual bool gathersPieces(size_t pieces, size_t totalBytes) const {
    return false;
  }
  // Whether this route runs collectives of these tensors: the backend asks
  // before it plans a call for it.
  virtual bool serves(const std::vector<at::Tensor>& tensors) const {
    return true;
  }
  // `plan` stays the caller's: a route moves out what it keeps (a queued
  // task takes the whole plan), so a call run at once moves nothing.
  virtual Completion issue(const Call& call, Plan&& plan) = 0;
};

} // namespace hsdp
