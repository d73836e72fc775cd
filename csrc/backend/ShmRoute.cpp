#include "backend/ShmRoute.hpp"

#include <ATen/ATen.h>

#include "shm/Reduce.hpp"

#include <cstring>
#include <optional>

namespace hsdp {

namespace {

at::ScalarType scalarType(shm::DType d) {
  switch (d) {
    case shm::DType::F32:
      return at::kFloat;
    case shm::DType::F64:
      return at::kDouble;
    case shm::DType::BF16:
      return at::kBFloat16;
    case shm::DType::F16:
      return at::kHalf;
    case shm::DType::I8:
      return at::kChar;
    case shm::DType::U8:
      return at::kByte;
    case shm::DType::I16:
      return at::kShort;
    case shm::DType::I32:
      return at::kInt;
    case shm::DType::I64:
      return at::kLong;
  }
  return at::kByte;
}

c10d::ReduceOp reduceOp(shm::RedOp op) {
  switch (op) {
    case shm::RedOp::Sum:
      return c10d::ReduceOp::SUM;
    case shm::RedOp::Prod:
      return c10d::ReduceOp::PRODUCT;
    case shm::RedOp::Min:
      return c10d::ReduceOp::MIN;
    case shm::RedOp::Max:
      return c10d::ReduceOp::MAX;
    case shm::RedOp::BAnd:
      return c10d::ReduceOp::BAND;
    case shm::RedOp::BOr:
      return c10d::ReduceOp::BOR;
    case shm::RedOp::BXor:
      return c10d::ReduceOp::BXOR;
  }
  return c10d::ReduceOp::SUM;
}

// A 1-D tensor over caller memory (Gloo reads and writes raw memory).
at::Tensor wrap(const void* data, size_t count, at::ScalarType type) {
  return at::from_blob(
      const_cast<void*>(data), {static_cast<int64_t>(count)}, at::TensorOptions().dtype(type));
}

void applyScale(void* data, size_t count, shm::DType dtype, shm::Scale scale) {
  if (scale.kind == shm::Scale::Kind::None || count == 0) {
    return;
  }
  // The engine's kernel with one source: the same widening and single
  // rounding as the flat route's fused scale.
  const void* src = data;
  shm::reduce(data, &src, 1, count, dtype, shm::RedOp::Sum, scale);
}

// A staging buffer from the pool, given back when the phase is over.
class Staged {
 public:
  Staged(StagingPool& pool, size_t bytes)
      : pool_(pool), tensor_(pool.acquire(static_cast<int64_t>(bytes), at::TensorOptions().dtype(at::kByte))) {}
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    pool_.release({tensor_});
  }
  char* data() const {
    return static_cast<char*>(tensor_.data_ptr());
  }

 private:
  StagingPool& pool_;
  at::Tensor tensor_;
};

std::string joined(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) {
    out += (out.empty() ? "" : ",") + std::to_string(r);
  }
  return out;
}

} // namespace

std::vector<int> HostLayout::hostRanks(int h) const {
  return {ranks.begin() + static_cast<ptrdiff_t>(h) * perHost,
          ranks.begin() + static_cast<ptrdiff_t>(h + 1) * perHost};
}

std::vector<int> HostLayout::columnRanks(int l) const {
  std::vector<int> out;
  for (int h = 0; h < hosts; ++h) {
    out.push_back(rankOf(h, l));
  }
  return out;
}

std::string HostLayout::describe(const std::vector<std::string>& hostnames) const {
  std::string out;
  for (int h = 0; h < hosts; ++h) {
    out += (h ? "; ranks " : "ranks ") + joined(hostRanks(h)) + " on host " + hostnames[h];
  }
  return out;
}

ShmRoute::ShmRoute(
    std::unique_ptr<shm::Engine> local,
    HostLayout layout,
    c10::intrusive_ptr<c10d::Backend> column,
    int rank,
    int size,
    CommStats& stats,
    std::shared_ptr<StagingPool> staging)
    : local_(std::move(local)),
      layout_(std::move(layout)),
      column_(std::move(column)),
      rank_(rank),
      size_(size),
      stats_(stats),
      staging_(std::move(staging)) {}

std::string ShmRoute::prefix(const char* op) const {
  return "[rank " + std::to_string(rank_) + "/" + std::to_string(size_) + "] " + op + ": ";
}

void ShmRoute::withinHost(uint64_t bytes) {
  stats_.record("intra_host", 1, bytes);
}

template <typename Issue>
void ShmRoute::acrossHosts(const char* op, uint64_t bytes, Issue&& issue) {
  stats_.record("inter_host", 1, bytes);
  try {
    auto work = issue(*column_);
    if (work) {
      work->wait();
    }
  } catch (const std::exception& e) {
    const std::string why = "the inter-host phase of " + std::string(op) + " (gloo, with ranks " +
        joined(layout_.columnRanks(layout_.local)) + ") failed: " + e.what();
    // This host's ranks may be waiting for this rank in the next phase:
    // they fail now, naming the cause, not at their deadline.
    local_->abort("rank " + std::to_string(rank_) + ": " + why);
    throw shm::CommError(prefix(op) + why);
  }
}

void ShmRoute::allGather(const char* op, const void* input, void* output, size_t n) {
  if (!hierarchical()) {
    local_->allGather(op, input, output, n);
    return;
  }
  const HostLayout& L = layout_;
  char* out = static_cast<char*>(output);
  auto at = [&](int h, int l) { return out + static_cast<size_t>(L.rankOf(h, l)) * n; };
  if (n > 0) {
    acrossHosts(op, n, [&](c10d::Backend& column) {
      std::vector<at::Tensor> in{wrap(input, n, at::kByte)};
      std::vector<std::vector<at::Tensor>> outs(1);
      for (int h = 0; h < L.hosts; ++h) {
        outs[0].push_back(wrap(at(h, L.local), n, at::kByte));
      }
      return column.allgather(outs, in, {});
    });
  }
  if (L.perHost == 1) {
    return;
  }
  // My column's pieces (now in place) to every rank of my host: one
  // all-gather of H pieces per rank, read in place where the engine can.
  withinHost(static_cast<uint64_t>(L.hosts) * n);
  if (local_->gathersPieces(L.hosts, L.hosts * n)) {
    std::vector<shm::Span> mine;
    std::vector<std::vector<shm::Span>> dests(L.perHost);
    for (int h = 0; h < L.hosts; ++h) {
      mine.push_back({at(h, L.local), n});
      for (int q = 0; q < L.perHost; ++q) {
        dests[q].push_back({at(h, q), n});
      }
    }
    local_->allGatherPieces(op, mine, dests);
    return;
  }
  const size_t column = L.hosts * n;
  Staged packed(*staging_, column);
  Staged gathered(*staging_, column * L.perHost);
  for (int h = 0; h < L.hosts; ++h) {
    std::memcpy(packed.data() + h * n, at(h, L.local), n);
  }
  local_->allGather(op, packed.data(), gathered.data(), column);
  for (int q = 0; q < L.perHost; ++q) {
    for (int h = 0; h < L.hosts; ++h) {
      if (q != L.local) {
        std::memcpy(at(h, q), gathered.data() + q * column + h * n, n);
      }
    }
  }
}

void ShmRoute::reduceScatter(
    const char* op,
    const void* input,
    void* output,
    size_t count,
    shm::DType dtype,
    shm::RedOp redop,
    shm::Scale scale) {
  if (!hierarchical()) {
    local_->reduceScatter(op, input, output, count, dtype, redop, scale);
    return;
  }
  const HostLayout& L = layout_;
  const size_t chunk = count * shm::dtypeSize(dtype);
  const char* in = static_cast<const char*>(input);
  // Column-ordered input: local rank q's piece is the chunks of column q,
  // host by host. Already so when each host holds one rank and the hosts'
  // ranks are in host order.
  const char* columns = in;
  std::optional<Staged> packed;
  std::optional<Staged> partial;
  const char* mine = in; // my column's H chunks, reduced over my host
  if (L.perHost > 1) {
    packed.emplace(*staging_, chunk * size_);
    for (int q = 0; q < L.perHost; ++q) {
      for (int h = 0; h < L.hosts; ++h) {
        std::memcpy(packed->data() + (static_cast<size_t>(q) * L.hosts + h) * chunk,
                    in + static_cast<size_t>(L.rankOf(h, q)) * chunk, chunk);
      }
    }
    columns = packed->data();
    partial.emplace(*staging_, chunk * L.hosts);
    withinHost(chunk * size_);
    local_->reduceScatter(op, columns, partial->data(), count * L.hosts, dtype, redop, {});
    mine = partial->data();
  } else {
    // One rank per host: my column is the whole input, in host order when
    // the group's ranks are.
    bool hostOrder = true;
    for (int h = 0; h < L.hosts; ++h) {
      hostOrder = hostOrder && L.rankOf(h, 0) == h;
    }
    if (!hostOrder) {
      packed.emplace(*staging_, chunk * size_);
      for (int h = 0; h < L.hosts; ++h) {
        std::memcpy(packed->data() + h * chunk, in + static_cast<size_t>(L.rankOf(h, 0)) * chunk, chunk);
      }
      mine = packed->data();
    }
  }
  if (count > 0) {
    acrossHosts(op, chunk * L.hosts, [&](c10d::Backend& column) {
      at::Tensor out = wrap(output, count, scalarType(dtype));
      at::Tensor src = wrap(mine, count * L.hosts, scalarType(dtype));
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = reduceOp(redop);
      return column._reduce_scatter_base(out, src, opts);
    });
  }
  applyScale(output, count, dtype, scale);
}

void ShmRoute::allReduce(
    const char* op,
    void* data,
    size_t count,
    shm::DType dtype,
    shm::RedOp redop,
    shm::Scale scale) {
  if (!hierarchical()) {
    local_->allReduce(op, data, count, dtype, redop, scale);
    return;
  }
  const HostLayout& L = layout_;
  const size_t es = shm::dtypeSize(dtype);
  auto across = [&](void* part, size_t n) {
    acrossHosts(op, n * es, [&](c10d::Backend& column) {
      std::vector<at::Tensor> t{wrap(part, n, scalarType(dtype))};
      c10d::AllreduceOptions opts;
      opts.reduceOp = reduceOp(redop);
      return column.allreduce(t, opts);
    });
  };
  const size_t slice = count / L.perHost;
  if (L.perHost > 1 && count * es >= kSlicedAllReduceBytes && count % L.perHost == 0) {
    Staged part(*staging_, slice * es);
    withinHost(count * es);
    local_->reduceScatter(op, data, part.data(), slice, dtype, redop, {});
    across(part.data(), slice);
    applyScale(part.data(), slice, dtype, scale);
    char* mine = static_cast<char*>(data) + L.local * slice * es;
    std::memcpy(mine, part.data(), slice * es);
    withinHost(slice * es);
    local_->allGather(op, mine, data, slice * es);
    return;
  }
  if (L.perHost > 1) {
    withinHost(count * es);
    local_->allReduce(op, data, count, dtype, redop, {});
  }
  if (count > 0) {
    across(data, count);
  }
  applyScale(data, count, dtype, scale);
}

void ShmRoute::broadcast(const char* op, void* data, size_t bytes, int root) {
  if (!hierarchical()) {
    local_->broadcast(op, data, bytes, root);
    return;
  }
  const HostLayout& L = layout_;
  int rootHost = 0;
  int rootLocal = 0;
  for (int h = 0; h < L.hosts; ++h) {
    for (int l = 0; l < L.perHost; ++l) {
      if (L.rankOf(h, l) == root) {
        rootHost = h;
        rootLocal = l;
      }
    }
  }
  if (L.local == rootLocal && bytes > 0) {
    acrossHosts(op, bytes, [&](c10d::Backend& column) {
      std::vector<at::Tensor> t{wrap(data, bytes, at::kByte)};
      c10d::BroadcastOptions opts;
      opts.rootRank = rootHost;
      return column.broadcast(t, opts);
    });
  }
  if (L.perHost > 1) {
    withinHost(bytes);
    local_->broadcast(op, data, bytes, rootLocal);
  }
}

void ShmRoute::barrier(const char* op) {
  if (!hierarchical()) {
    local_->barrier(op);
    return;
  }
  // Leaving the inter-host barrier means every column's rank passed its
  // host's barrier, so every rank of every host arrived.
  if (layout_.perHost > 1) {
    withinHost(0);
    local_->barrier(op);
  }
  acrossHosts(op, 0, [&](c10d::Backend& column) { return column.barrier({}); });
}

} // namespace hsdp
