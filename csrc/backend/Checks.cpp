#include "backend/Checks.hpp"

namespace hsdp {

void checkOne(const OpContext& ctx, const std::vector<at::Tensor>& ts) {
  HSDP_CHECK_VALUE(ts.size() == 1, ctx, "expected exactly one tensor per rank, got ", ts.size());
}

// One dense tensor per rank: the form every route plans for. Other
// forms (several tensors per rank, as in gloo's and the old multi-GPU
// API, or sparse tensors) go to the inner backend as they are, which
// serves them as gloo does or refuses them with its own error.
bool oneDense(const std::vector<at::Tensor>& ts) {
  return ts.size() == 1 && !ts[0].is_sparse();
}

void checkNotEmpty(const OpContext& ctx, const std::vector<at::Tensor>& ts) {
  HSDP_CHECK_VALUE(!ts.empty(), ctx, "expected a tensor, got an empty list");
}

void checkRank(const OpContext& ctx, int64_t r, const char* what) {
  HSDP_CHECK_VALUE(
      r >= 0 && r < ctx.size,
      ctx,
      "invalid ",
      what,
      " rank ",
      r,
      "; expected a group rank in [0, ",
      ctx.size,
      ")");
}

// The index of the root's tensor that is sent (the list forms of broadcast
// and reduce): within this call's tensors on every rank.
void checkRootTensor(const OpContext& ctx, int64_t index, const std::vector<at::Tensor>& ts) {
  HSDP_CHECK_VALUE(
      index >= 0 && index < static_cast<int64_t>(ts.size()),
      ctx,
      "invalid root tensor ",
      index,
      "; expected an index into this call's ",
      ts.size(),
      " tensor(s)");
}

void checkSameDtype(
    const OpContext& ctx,
    const at::Tensor& expected,
    const at::Tensor& t,
    const char* what) {
  HSDP_CHECK_TYPE(
      t.scalar_type() == expected.scalar_type(),
      ctx,
      what,
      " has dtype ",
      t.scalar_type(),
      " but the input has dtype ",
      expected.scalar_type());
}

void checkSameDevice(
    const OpContext& ctx,
    const at::Tensor& expected,
    const at::Tensor& t,
    const char* what) {
  HSDP_CHECK_VALUE(
      t.device() == expected.device(),
      ctx,
      what,
      " is on ",
      t.device(),
      " but the input is on ",
      expected.device());
}

void checkNumel(const OpContext& ctx, const at::Tensor& t, int64_t expected, const char* what) {
  HSDP_CHECK_VALUE(
      t.numel() == expected, ctx, what, " has ", t.numel(), " elements; expected ", expected);
}

// `lists` must be one list of one tensor per rank, each with `like`'s
// dtype and element count: the per-rank side of all_gather, gather, scatter
// and reduce_scatter.
void checkOneListPerRank(
    const OpContext& ctx,
    const std::vector<std::vector<at::Tensor>>& lists,
    const char* what) {
  HSDP_CHECK_VALUE(
      lists.size() == 1 && lists[0].size() == static_cast<size_t>(ctx.size),
      ctx,
      "expected one list of ",
      ctx.size,
      " ",
      what,
      "s (one per rank), got ",
      lists.empty() ? 0 : lists[0].size());
}

void checkPerRankList(
    const OpContext& ctx,
    const std::vector<std::vector<at::Tensor>>& lists,
    const at::Tensor& like,
    const char* what) {
  checkOneListPerRank(ctx, lists, what);
  for (const auto& t : lists[0]) {
    checkSameDtype(ctx, like, t, what);
    checkSameDevice(ctx, like, t, what);
    checkNumel(ctx, t, like.numel(), what);
  }
}

void checkContiguous(const OpContext& ctx, const at::Tensor& t, const char* what) {
  HSDP_CHECK_VALUE(t.is_contiguous(), ctx, what, " must be contiguous");
}

// The (input, output) pairs of a fused all-gather (`gather`: each output is
// world size x its input) or reduce-scatter (each input is world size x its
// output), all on one device, outputs contiguous.
void checkCoalescedPairs(
    const OpContext& ctx,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    bool gather) {
  HSDP_CHECK_VALUE(
      outputs.size() == inputs.size(),
      ctx,
      "got ",
      inputs.size(),
      " inputs but ",
      outputs.size(),
      " outputs; expected one output per input");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(ctx, inputs[i], outputs[i], "an output");
    checkSameDevice(ctx, inputs[0], inputs[i], "an input");
    checkSameDevice(ctx, inputs[0], outputs[i], "an output");
    if (gather) {
      checkNumel(ctx, outputs[i], inputs[i].numel() * ctx.size, "an output (world size x input)");
    } else {
      checkNumel(ctx, inputs[i], outputs[i].numel() * ctx.size, "an input (world size x output)");
    }
    checkContiguous(ctx, outputs[i], "an output");
  }
}

void checkRooted(
    const OpContext& ctx,
    int64_t root,
    const std::vector<at::Tensor>& mine,
    const std::vector<std::vector<at::Tensor>>& lists,
    const char* what) {
  checkOne(ctx, mine);
  checkRank(ctx, root, "root");
  if (ctx.rank == root) {
    checkPerRankList(ctx, lists, mine[0], what);
  }
}

void checkOutputLists(
    const OpContext& ctx,
    const std::vector<std::vector<at::Tensor>>& lists,
    const std::vector<at::Tensor>& inputs) {
  HSDP_CHECK_VALUE(
      lists.size() == static_cast<size_t>(ctx.size),
      ctx,
      "expected ",
      ctx.size,
      " output lists (one per rank), got ",
      lists.size());
  for (const auto& list : lists) {
    HSDP_CHECK_VALUE(
        list.size() == inputs.size(),
        ctx,
        "an output list has ",
        list.size(),
        " tensors; expected one per input (",
        inputs.size(),
        ")");
    for (size_t i = 0; i < inputs.size(); ++i) {
      checkSameDtype(ctx, inputs[i], list[i], "an output");
      checkSameDevice(ctx, inputs[0], list[i], "an output");
      checkNumel(ctx, list[i], inputs[i].numel(), "an output");
    }
  }
}

void checkSplits(const OpContext& ctx, const std::vector<int64_t>& splits) {
  HSDP_CHECK_VALUE(
      splits.empty() || splits.size() == static_cast<size_t>(ctx.size),
      ctx,
      "split sizes must be empty or have one entry per rank (",
      ctx.size,
      "), got ",
      splits.size());
}

void checkAllToAllLists(
    const OpContext& ctx,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs) {
  const auto size = static_cast<size_t>(ctx.size);
  HSDP_CHECK_VALUE(
      outputs.size() == size && inputs.size() == size,
      ctx,
      "expected ",
      ctx.size,
      " input and output tensors (one per rank), got ",
      inputs.size(),
      " and ",
      outputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSameDtype(ctx, inputs[0], inputs[i], "an input");
    checkSameDtype(ctx, inputs[0], outputs[i], "an output");
    checkSameDevice(ctx, inputs[0], inputs[i], "an input");
    checkSameDevice(ctx, inputs[0], outputs[i], "an output");
  }
}

} // namespace hsdp
