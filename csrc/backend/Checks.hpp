#pragma once

// The argument checks of ProcessGroupHSDP's overrides: each raises the
// error c10d users expect (common/Errors.hpp: ArgumentError, a RuntimeError
// and ValueError; ArgumentTypeError for dtypes) naming the rank, the op and
// what was expected.

#include <ATen/core/Tensor.h>

#include <vector>

#include "common/Errors.hpp"

namespace hsdp {

void checkOne(const OpContext& ctx, const std::vector<at::Tensor>& ts);

// One dense tensor per rank: the form every route plans for. Other
// forms (several tensors per rank, as in gloo's and the old multi-GPU
// API, or sparse tensors) go to the inner backend as they are, which
// serves them as gloo does or refuses them with its own error.
bool oneDense(const std::vector<at::Tensor>& ts);

void checkNotEmpty(const OpContext& ctx, const std::vector<at::Tensor>& ts);

void checkRank(const OpContext& ctx, int64_t r, const char* what);

// The index of the root's tensor that is sent (the list forms of broadcast
// and reduce): within this call's tensors on every rank.
void checkRootTensor(const OpContext& ctx, int64_t index, const std::vector<at::Tensor>& ts);

void checkSameDtype(
    const OpContext& ctx,
    const at::Tensor& expected,
    const at::Tensor& t,
    const char* what);

void checkSameDevice(
    const OpContext& ctx,
    const at::Tensor& expected,
    const at::Tensor& t,
    const char* what);

void checkNumel(const OpContext& ctx, const at::Tensor& t, int64_t expected, const char* what);

// `lists` must be one list of one tensor per rank, each with `like`'s
// dtype and element count: the per-rank side of all_gather, gather, scatter
// and reduce_scatter.
void checkOneListPerRank(
    const OpContext& ctx,
    const std::vector<std::vector<at::Tensor>>& lists,
    const char* what);

void checkPerRankList(
    const OpContext& ctx,
    const std::vector<std::vector<at::Tensor>>& lists,
    const at::Tensor& like,
    const char* what);

void checkContiguous(const OpContext& ctx, const at::Tensor& t, const char* what);

// The (input, output) pairs of a fused all-gather (`gather`: each output is
// world size x its input) or reduce-scatter (each input is world size x its
// output), all on one device, outputs contiguous.
void checkCoalescedPairs(
    const OpContext& ctx,
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    bool gather);

// gather and scatter: one tensor on every rank (`mine`), and at the root
// one like it per rank (`lists`).
void checkRooted(
    const OpContext& ctx,
    int64_t root,
    const std::vector<at::Tensor>& mine,
    const std::vector<std::vector<at::Tensor>>& lists,
    const char* what);

// all_gather_coalesced's outputs: one list per rank, each with one tensor
// per input of its dtype, device and element count.
void checkOutputLists(
    const OpContext& ctx,
    const std::vector<std::vector<at::Tensor>>& lists,
    const std::vector<at::Tensor>& inputs);

// An all-to-all's split sizes: none, or one per rank.
void checkSplits(const OpContext& ctx, const std::vector<int64_t>& splits);

// The list all-to-all's tensors: one input and one output per rank, of one
// dtype and device.
void checkAllToAllLists(
    const OpContext& ctx,
    const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs);

} // namespace hsdp
