#pragma once

// Flat layouts for fused collectives: many tensors, one buffer, one
// collective. Device-agnostic (ATen ops only), so the CPU route through Gloo
// and the CUDA route through NCCL run exactly this code.
//
// Layouts, for W ranks and tensors with n_i elements (bytes for all-gather):
//   all-gather      packed input  [N]          N = sum n_i, tensor i at off_i
//                   packed output [W, N]       rank r's copy of i at r*N+off_i
//   reduce-scatter  packed input  [W, N]       row r = every tensor's chunk r
//                   packed output [N]          tensor i's result at off_i
//   all-reduce      one bucket    [N]          tensor i at off_i
// Packing is skipped when the caller's tensors already are that flat buffer
// (adjacent views of one storage, as FSDP2's flat parameters are).

#include <ATen/core/Tensor.h>

#include "fusion/StagingPool.hpp"

#include <optional>
#include <vector>

namespace hsdp {

// A 1-D view of dtype `asType` that covers `tensors` back to back, when they
// are contiguous, adjacent and in one storage; nullopt otherwise.
std::optional<at::Tensor>
adjacentFlatView(const std::vector<at::Tensor>& tensors, at::ScalarType asType);

struct AllGatherPack {
  std::vector<at::Tensor> staging; // buffers to give back to the pool
  at::Tensor input;                // uint8 [N], this rank's row of `output` when packed
  at::Tensor output;               // uint8 [W * N]
  std::vector<int64_t> offsets;    // byte offset of tensor i in a row
  int64_t rowBytes = 0;            // N

  // Copies rank r's bytes of tensor i into outputs[i].narrow(r).
  void unpack(const std::vector<at::Tensor>& outputs, int worldSize) const;
};

// The packed input is this rank's row of the packed output (an in-place
// all-gather), unless the inputs already are one flat buffer.
AllGatherPack
packAllGather(const std::vector<at::Tensor>& inputs, int rank, int worldSize, StagingPool& pool);

struct ReduceScatterPack {
  std::vector<at::Tensor> staging; // buffers to give back to the pool
  at::Tensor input;                // [W * N], all one dtype
  at::Tensor output;               // [N]; a view of the callers' outputs when adjacent
  std::vector<int64_t> offsets;    // element offset of tensor i in the output
  bool outputIsCallers = false;

  void unpack(const std::vector<at::Tensor>& outputs) const;
};

// `inputs[i]` holds W * outputs[i].numel() elements; every tensor one dtype.
ReduceScatterPack packReduceScatter(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    int worldSize,
    StagingPool& pool);

struct Bucket {
  std::vector<at::Tensor> staging; // buffers to give back to the pool
  std::vector<size_t> members;     // indices into the caller's tensor list
  at::Tensor flat;                 // one dtype, [sum numel]
  bool isCallers = false;          // flat aliases the caller's tensors: no copy-back

  void unpack(const std::vector<at::Tensor>& tensors) const;
};

// Splits `members` (indices into `tensors`, one dtype) into runs of at most
// `bucketBytes` (a tensor larger than that gets a run of its own);
// bucketBytes <= 0: one run.
std::vector<std::vector<size_t>> planBuckets(
    const std::vector<at::Tensor>& tensors,
    const std::vector<size_t>& members,
    int64_t bucketBytes);

// Packs tensors of one dtype into buckets of at most `bucketBytes` (a tensor
// larger than that gets a bucket of its own). bucketBytes <= 0: one bucket.
std::vector<Bucket> packBuckets(
    const std::vector<at::Tensor>& tensors,
    const std::vector<size_t>& members,
    int64_t bucketBytes,
    StagingPool& pool);

} // namespace hsdp
