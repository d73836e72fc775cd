#include "fusion/FlatPack.hpp"

#include <ATen/ATen.h>

#include <cstring>

namespace hsdp {

std::optional<at::Tensor>
adjacentFlatView(const std::vector<at::Tensor>& tensors, at::ScalarType asType) {
  if (tensors.empty()) {
    return std::nullopt;
  }
  const auto& first = tensors.front();
  int64_t totalBytes = 0;
  const char* expected = static_cast<const char*>(first.data_ptr());
  for (const auto& t : tensors) {
    if (!t.is_contiguous() || t.scalar_type() != asType || t.device() != first.device() ||
        !t.storage().is_alias_of(first.storage()) ||
        static_cast<const char*>(t.data_ptr()) != expected) {
      return std::nullopt;
    }
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    expected += bytes;
    totalBytes += bytes;
  }
  const int64_t elem = static_cast<int64_t>(c10::elementSize(asType));
  const int64_t offsetBytes = first.storage_offset() * static_cast<int64_t>(first.element_size());
  if (offsetBytes % elem != 0) {
    return std::nullopt;
  }
  at::Tensor view = at::empty({0}, first.options().dtype(asType));
  view.set_(first.storage(), offsetBytes / elem, {totalBytes / elem}, {1});
  return view;
}

namespace {

at::Tensor asBytes(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

// Contiguous CPU tensors are copied with memcpy: with hundreds of small
// tensors per call, ATen's per-op dispatch (several per tensor) would cost
// more than the bytes. Other devices take the ATen path.
bool plainCpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous();
}

char* bytePtr(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

} // namespace

AllGatherPack
packAllGather(const std::vector<at::Tensor>& inputs, int rank, int worldSize, StagingPool& pool) {
  AllGatherPack pack;
  pack.offsets.reserve(inputs.size());
  for (const auto& t : inputs) {
    pack.offsets.push_back(pack.rowBytes);
    pack.rowBytes += static_cast<int64_t>(t.nbytes());
  }
  const auto byteOptions = inputs.front().options().dtype(at::kByte);
  pack.output = pool.acquire(worldSize * pack.rowBytes, byteOptions);
  pack.staging.push_back(pack.output);
  if (auto view = adjacentFlatView(inputs, inputs.front().scalar_type())) {
    pack.input = view->view(at::kByte);
    return pack;
  }
  // Pack straight into this rank's row of the output: the all-gather is
  // then in place and copies nothing for this rank's own row.
  pack.input = pack.output.narrow(0, rank * pack.rowBytes, pack.rowBytes);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto bytes = static_cast<int64_t>(inputs[i].nbytes());
    if (plainCpu(inputs[i]) && bytes > 0) {
      std::memcpy(bytePtr(pack.input) + pack.offsets[i], bytePtr(inputs[i]), bytes);
    } else if (bytes > 0) {
      pack.input.narrow(0, pack.offsets[i], bytes).copy_(asBytes(inputs[i].contiguous()));
    }
  }
  return pack;
}

void AllGatherPack::unpack(const std::vector<at::Tensor>& outputs, int worldSize) const {
  const auto rows = output.view({worldSize, rowBytes});
  for (size_t i = 0; i < outputs.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(outputs[i].nbytes()) / worldSize;
    if (bytes == 0) {
      continue;
    }
    if (plainCpu(outputs[i]) && output.device().is_cpu()) {
      for (int r = 0; r < worldSize; ++r) {
        std::memcpy(
            bytePtr(outputs[i]) + r * bytes, bytePtr(output) + r * rowBytes + offsets[i], bytes);
      }
    } else {
      asBytes(outputs[i]).view({worldSize, bytes}).copy_(rows.narrow(1, offsets[i], bytes));
    }
  }
}

ReduceScatterPack packReduceScatter(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& outputs,
    int worldSize,
    StagingPool& pool) {
  ReduceScatterPack pack;
  int64_t rowElems = 0;
  for (const auto& out : outputs) {
    pack.offsets.push_back(rowElems);
    rowElems += out.numel();
  }
  const auto options = inputs.front().options();
  if (inputs.size() == 1 && inputs.front().is_contiguous()) {
    pack.input = inputs.front().view({-1});
  } else {
    pack.input = pool.acquire(worldSize * rowElems, options);
    pack.staging.push_back(pack.input);
    const auto rows = pack.input.view({worldSize, rowElems});
    const int64_t es = static_cast<int64_t>(pack.input.element_size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t n = outputs[i].numel();
      if (n == 0) {
        continue;
      }
      if (plainCpu(inputs[i])) {
        for (int q = 0; q < worldSize; ++q) {
          std::memcpy(
              bytePtr(pack.input) + (q * rowElems + pack.offsets[i]) * es,
              bytePtr(inputs[i]) + q * n * es,
              n * es);
        }
      } else {
        rows.narrow(1, pack.offsets[i], n).copy_(inputs[i].reshape({worldSize, n}));
      }
    }
  }
  if (auto view = adjacentFlatView(outputs, options.dtype().toScalarType())) {
    pack.output = *view;
    pack.outputIsCallers = true;
  } else {
    pack.output = pool.acquire(rowElems, options);
    pack.staging.push_back(pack.output);
  }
  return pack;
}

void ReduceScatterPack::unpack(const std::vector<at::Tensor>& outputs) const {
  if (outputIsCallers) {
    return;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (plainCpu(outputs[i]) && output.device().is_cpu()) {
      std::memcpy(
          bytePtr(outputs[i]),
          bytePtr(output) + offsets[i] * output.element_size(),
          outputs[i].nbytes());
    } else {
      outputs[i].view({-1}).copy_(output.narrow(0, offsets[i], outputs[i].numel()));
    }
  }
}

std::vector<std::vector<size_t>> planBuckets(
    const std::vector<at::Tensor>& tensors,
    const std::vector<size_t>& members,
    int64_t bucketBytes) {
  std::vector<std::vector<size_t>> groups;
  int64_t filled = 0;
  for (size_t idx : members) {
    const auto& t = tensors[idx];
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (groups.empty() || (bucketBytes > 0 && filled + bytes > bucketBytes && filled > 0)) {
      groups.emplace_back();
      filled = 0;
    }
    groups.back().push_back(idx);
    filled += bytes;
  }
  return groups;
}

std::vector<Bucket> packBuckets(
    const std::vector<at::Tensor>& tensors,
    const std::vector<size_t>& members,
    int64_t bucketBytes,
    StagingPool& pool) {
  auto groups = planBuckets(tensors, members, bucketBytes);
  std::vector<Bucket> buckets;
  for (auto& group : groups) {
    Bucket bucket;
    bucket.members = std::move(group);
    std::vector<at::Tensor> ts;
    int64_t total = 0;
    for (size_t idx : bucket.members) {
      ts.push_back(tensors[idx]);
      total += tensors[idx].numel();
    }
    if (auto view = adjacentFlatView(ts, ts.front().scalar_type())) {
      bucket.flat = *view;
      bucket.isCallers = true;
    } else {
      bucket.flat = pool.acquire(total, ts.front().options());
      bucket.staging.push_back(bucket.flat);
      int64_t off = 0;
      for (const auto& t : ts) {
        if (plainCpu(t)) {
          std::memcpy(bytePtr(bucket.flat) + off * t.element_size(), bytePtr(t), t.nbytes());
        } else {
          bucket.flat.narrow(0, off, t.numel()).copy_(t.reshape({-1}));
        }
        off += t.numel();
      }
    }
    buckets.push_back(std::move(bucket));
  }
  return buckets;
}

void Bucket::unpack(const std::vector<at::Tensor>& tensors) const {
  if (isCallers) {
    return;
  }
  int64_t off = 0;
  for (size_t idx : members) {
    const auto& t = tensors[idx];
    if (plainCpu(t) && flat.device().is_cpu()) {
      std::memcpy(bytePtr(t), bytePtr(flat) + off * t.element_size(), t.nbytes());
    } else {
      t.copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
    }
    off += t.numel();
  }
}

} // namespace hsdp
