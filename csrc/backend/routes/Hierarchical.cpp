#include "backend/routes/Hierarchical.hpp"

#include <ATen/ATen.h>

#include "common/Errors.hpp"
#include "shm/Reduce.hpp"

#include <cstring>
#include <exception>

namespace hsdp {

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Bytes of caller memory as a 1-D tensor (Gloo reads and writes raw memory).
at::Tensor wrap(const void* data, size_t bytes) {
  return at::from_blob(
      const_cast<void*>(data), {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
}

// A staging buffer from the pool, given back when the phase is over.
class Staged {
 public:
  Staged(StagingPool& pool, size_t bytes)
      : pool_(pool),
        tensor_(pool.acquire(static_cast<int64_t>(bytes), at::TensorOptions().dtype(at::kByte))) {}
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
  return {
      ranks.begin() + static_cast<ptrdiff_t>(h) * perHost,
      ranks.begin() + static_cast<ptrdiff_t>(h + 1) * perHost};
}

std::vector<int> HostLayout::columnRanks(int l) const {
  std::vector<int> out;
  for (int h = 0; h < hosts; ++h) {
    out.push_back(rankOf(h, l));
  }
  return out;
}

Hierarchical::Hierarchical(
    shm::Engine& local,
    HostLayout layout,
    Column column,
    int rank,
    int size,
    CommStats& stats,
    std::shared_ptr<StagingPool> staging)
    : local_(local),
      layout_(std::move(layout)),
      column_(std::move(column)),
      rank_(rank),
      size_(size),
      stats_(stats),
      staging_(std::move(staging)) {
  hostMajor_ = true;
  for (int h = 0; h < layout_.hosts; ++h) {
    for (int l = 0; l < layout_.perHost; ++l) {
      hostMajor_ = hostMajor_ && layout_.rankOf(h, l) == h * layout_.perHost + l;
    }
  }
}

void Hierarchical::setTimeout(std::chrono::milliseconds timeout) {
  columnTimeoutMs_.store(timeout.count(), std::memory_order_relaxed);
  column_.group->setTimeout(timeout); // Gloo's collectives read it when issued
}

std::string Hierarchical::prefix(const char* op) const {
  return OpContext{rank_, size_, op}.prefix();
}

// Every algorithm's preamble: refuses work after a failure (as the engine
// does; with one rank per host the engine is never called, and the
// column's tags would no longer agree), and marks the route failed when the
// algorithm is left by an exception (the engine's failures included).
class Hierarchical::Phase {
 public:
  Phase(Hierarchical& route, const char* op)
      : route_(route), exceptions_(std::uncaught_exceptions()) {
    if (!route_.failure_.empty()) {
      throw shm::CommError(
          route_.prefix(op) + "the group is unusable after " + route_.failure_ +
          "; create a new process group");
    }
  }
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;
  ~Phase() {
    if (std::uncaught_exceptions() > exceptions_ && route_.failure_.empty()) {
      route_.failure_ = "a failure in an earlier collective of this rank";
    }
  }

 private:
  Hierarchical& route_;
  const int exceptions_;
};

void Hierarchical::withinHost(uint64_t bytes) {
  stats_.record("intra_host", 1, bytes);
}

void Hierarchical::allGatherPieces(
    const char* op,
    const std::vector<shm::Span>& inputs,
    const std::vector<std::vector<shm::Span>>& outputs) {
  TORCH_INTERNAL_ASSERT(false, prefix(op), "hierarchical groups gather pieces packed");
}

template <typename Issue>
void Hierarchical::acrossHosts(
    const char* op,
    uint64_t bytes,
    Issue&& issue,
    bool count,
    std::chrono::milliseconds limit) {
  if (count) {
    stats_.record("inter_host", 1, bytes);
  }
  try {
    for (auto& work : issue(*column_.group)) {
      if (work) {
        work->wait(limit);
      }
    }
  } catch (const std::exception& e) {
    const std::string why = "the inter-host phase of " + std::string(op) + " (gloo, with ranks " +
        joined(layout_.columnRanks(layout_.local)) + ") failed: " + e.what();
    failure_ = why;
    // This host's ranks may be waiting for this rank in the next phase:
    // they fail now, naming the cause, not at their deadline.
    local_.abort("rank " + std::to_string(rank_) + ": " + why);
    throw shm::CommError(prefix(op) + why);
  }
}

// Sends and receives posted on my column for one inter-host phase. wait()
// completes them (a failure: CommError naming the op, and this host's
// ranks fail too); leaving the phase by an exception instead still waits
// for whatever is posted, failures ignored, because Gloo reads and writes
// the buffers until then (bounded by the group's timeout).
class Hierarchical::Transfers {
 public:
  Transfers(Hierarchical& route, const char* op)
      : route_(route), op_(op), tag_(static_cast<int>(route.exchanges_++ % (1u << 30))) {}
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;
  ~Transfers() {
    for (auto& work : works_) {
      try {
        work->wait(route_.columnTimeout());
      } catch (const std::exception&) {
      }
    }
  }

  void send(const void* data, size_t bytes, int host) {
    post(data, bytes, host, true);
  }
  void recv(void* data, size_t bytes, int host) {
    post(data, bytes, host, false);
  }
  void wait() {
    // A copy: on failure the destructor still waits for every one.
    route_.acrossHosts(
        op_, bytes_, [&](c10d::Backend&) { return works_; }, true, route_.columnTimeout());
    works_.clear();
    bytes_ = 0;
  }

 private:
  void post(const void* data, size_t bytes, int host, bool isSend) {
    if (bytes == 0) {
      return;
    }
    route_.acrossHosts(
        op_,
        0,
        [&](c10d::Backend& column) {
          // Every rank of a column runs the same collectives in the same
          // order, so the counter names each phase alike on all of them.
          std::vector<at::Tensor> t{wrap(data, bytes)};
          works_.push_back(isSend ? column.send(t, host, tag_) : column.recv(t, host, tag_));
          return std::vector<WorkPtr>{};
        },
        /*count=*/false);
    bytes_ += isSend ? bytes : 0;
  }

  Hierarchical& route_;
  const char* op_;
  const int tag_;
  std::vector<WorkPtr> works_;
  uint64_t bytes_ = 0;
};

void Hierarchical::allGather(const char* op, const void* input, void* output, size_t n) {
  const Phase phase(*this, op);
  const HostLayout& L = layout_;
  char* out = static_cast<char*>(output);
  auto at = [&](int h, int l) { return out + static_cast<size_t>(L.rankOf(h, l)) * n; };
  if (n > 0) {
    // My piece to every other host's rank of my column, theirs straight
    // into their places in the output.
    char* mine = at(L.host, L.local);
    if (mine != input) {
      std::memcpy(mine, input, n);
    }
    Transfers column(*this, op);
    for (int h = 0; h < L.hosts; ++h) {
      if (h != L.host) {
        column.recv(at(h, L.local), n, h);
        column.send(mine, n, h);
      }
    }
    column.wait();
  }
  if (L.perHost == 1) {
    return;
  }
  // My column's pieces (now in place) to every rank of my host: one
  // all-gather of H pieces per rank, read in place where the engine can.
  withinHost(static_cast<uint64_t>(L.hosts) * n);
  if (local_.gathersPieces(L.hosts, L.hosts * n)) {
    std::vector<shm::Span> mine;
    std::vector<std::vector<shm::Span>> dests(L.perHost);
    for (int h = 0; h < L.hosts; ++h) {
      mine.push_back({at(h, L.local), n});
      for (int q = 0; q < L.perHost; ++q) {
        dests[q].push_back({at(h, q), n});
      }
    }
    local_.allGatherPieces(op, mine, dests);
    return;
  }
  const size_t column = L.hosts * n;
  Staged packed(*staging_, column);
  Staged gathered(*staging_, column * L.perHost);
  for (int h = 0; h < L.hosts; ++h) {
    std::memcpy(packed.data() + h * n, at(h, L.local), n);
  }
  local_.allGather(op, packed.data(), gathered.data(), column);
  for (int q = 0; q < L.perHost; ++q) {
    for (int h = 0; h < L.hosts; ++h) {
      if (q != L.local) {
        std::memcpy(at(h, q), gathered.data() + q * column + h * n, n);
      }
    }
  }
}

namespace {

// `in` (rank r's chunk at r) reordered column by column: local rank q's
// piece is the chunks of column q, host by host.
void packByColumn(char* packed, const char* in, const HostLayout& L, size_t chunk) {
  for (int q = 0; q < L.perHost; ++q) {
    for (int h = 0; h < L.hosts; ++h) {
      std::memcpy(
          packed + (static_cast<size_t>(q) * L.hosts + h) * chunk,
          in + static_cast<size_t>(L.rankOf(h, q)) * chunk,
          chunk);
    }
  }
}

} // namespace

void Hierarchical::reduceScatter(
    const char* op,
    const void* input,
    void* output,
    size_t count,
    shm::DType dtype,
    shm::RedOp redop,
    shm::Scale scale) {
  const Phase phase(*this, op);
  const HostLayout& L = layout_;
  const size_t chunk = count * shm::dtypeSize(dtype);
  const char* in = static_cast<const char*>(input);
  // My column's H partial sums (its chunks reduced over my host), in host
  // order; chunk h goes to host h's rank of my column as soon as it is
  // reduced, so the intra-host phase of the next block overlaps its way.
  Staged partial(*staging_, chunk * L.hosts);
  Staged received(*staging_, chunk * L.hosts);
  std::vector<const char*> block(L.hosts); // my column's partial sum for host h
  for (int h = 0; h < L.hosts; ++h) {
    // One rank per host: the input itself.
    block[h] = L.perHost == 1 ? in + static_cast<size_t>(L.rankOf(h, 0)) * chunk
                              : partial.data() + h * chunk;
  }
  Transfers column(*this, op);
  auto ship = [&](int h) {
    if (h != L.host) {
      column.send(block[h], chunk, h);
    }
  };
  if (L.perHost == 1) {
    for (int h = 0; h < L.hosts; ++h) {
      ship(h);
    }
  } else if (hostMajor_ && chunk * size_ >= kBlockwiseBytes) {
    // Host h's ranks' chunks are one contiguous block of the input: one
    // reduce-scatter per block, other hosts' blocks first.
    withinHost(chunk * size_);
    for (int k = 1; k <= L.hosts; ++k) {
      const int h = (L.host + k) % L.hosts;
      local_.reduceScatter(
          op,
          in + static_cast<size_t>(h) * L.perHost * chunk,
          partial.data() + h * chunk,
          count,
          dtype,
          redop,
          {});
      ship(h);
    }
  } else {
    // Column-ordered input, one reduce-scatter.
    Staged packed(*staging_, chunk * size_);
    packByColumn(packed.data(), in, L, chunk);
    withinHost(chunk * size_);
    local_.reduceScatter(op, packed.data(), partial.data(), count * L.hosts, dtype, redop, {});
    for (int h = 0; h < L.hosts; ++h) {
      ship(h);
    }
  }
  if (count == 0) {
    return;
  }
  // Every other host's partial sum of my chunk, then one reduction in host
  // order (the scale folded in: one rounding).
  std::vector<const void*> sources(L.hosts);
  for (int h = 0; h < L.hosts; ++h) {
    if (h == L.host) {
      sources[h] = block[h];
    } else {
      column.recv(received.data() + h * chunk, chunk, h);
      sources[h] = received.data() + h * chunk;
    }
  }
  column.wait();
  shm::reduce(output, sources.data(), L.hosts, count, dtype, redop, scale);
}

void Hierarchical::allReduce(
    const char* op,
    void* data,
    size_t count,
    shm::DType dtype,
    shm::RedOp redop,
    shm::Scale scale) {
  const Phase phase(*this, op);
  const HostLayout& L = layout_;
  const size_t es = shm::dtypeSize(dtype);
  const size_t slice = count / L.perHost;
  if (L.perHost > 1 && count * es >= kSlicedAllReduceBytes && count % L.perHost == 0) {
    char* mine = static_cast<char*>(data) + L.local * slice * es;
    Staged part(*staging_, slice * es);
    withinHost(count * es);
    local_.reduceScatter(op, data, part.data(), slice, dtype, redop, {});
    std::memcpy(mine, part.data(), slice * es);
    allReduceColumn(op, mine, slice, dtype, redop, scale);
    withinHost(slice * es);
    local_.allGather(op, mine, data, slice * es);
    return;
  }
  if (L.perHost > 1) {
    withinHost(count * es);
    local_.allReduce(op, data, count, dtype, redop, {});
  }
  allReduceColumn(op, data, count, dtype, redop, scale);
}

void Hierarchical::allReduceColumn(
    const char* op,
    void* data,
    size_t count,
    shm::DType dtype,
    shm::RedOp redop,
    shm::Scale scale) {
  const HostLayout& L = layout_;
  if (count == 0) {
    return;
  }
  // Part h of the data is reduced by host h's rank of my column alone (the
  // H copies in host order, the scale folded in), then sent to the others:
  // every rank ends with the same bits, and each part crosses the network
  // twice in all, as in a ring, but every pair at once.
  const size_t es = shm::dtypeSize(dtype);
  char* bytes = static_cast<char*>(data);
  auto begin = [&](int h) { return count * h / L.hosts * es; };
  auto size = [&](int h) { return begin(h + 1) - begin(h); };
  Staged received(*staging_, size(L.host) * L.hosts);
  {
    Transfers column(*this, op);
    std::vector<const void*> sources(L.hosts);
    for (int h = 0; h < L.hosts; ++h) {
      if (h == L.host) {
        sources[h] = bytes + begin(h);
        continue;
      }
      column.recv(received.data() + h * size(L.host), size(L.host), h);
      column.send(bytes + begin(h), size(h), h);
      sources[h] = received.data() + h * size(L.host);
    }
    column.wait();
    shm::reduce(
        bytes + begin(L.host), sources.data(), L.hosts, size(L.host) / es, dtype, redop, scale);
  }
  Transfers column(*this, op);
  for (int h = 0; h < L.hosts; ++h) {
    if (h != L.host) {
      column.recv(bytes + begin(h), size(h), h);
      column.send(bytes + begin(L.host), size(L.host), h);
    }
  }
  column.wait();
}

void Hierarchical::broadcast(const char* op, void* data, size_t bytes, int root) {
  const Phase phase(*this, op);
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
      std::vector<at::Tensor> t{wrap(data, bytes)};
      c10d::BroadcastOptions opts;
      opts.rootRank = rootHost;
      return std::vector<WorkPtr>{column.broadcast(t, opts)};
    });
  }
  if (L.perHost > 1) {
    withinHost(bytes);
    local_.broadcast(op, data, bytes, rootLocal);
  }
}

void Hierarchical::barrier(const char* op) {
  const Phase phase(*this, op);
  // Leaving the inter-host barrier means every column's rank passed its
  // host's barrier, so every rank of every host arrived.
  if (layout_.perHost > 1) {
    withinHost(0);
    local_.barrier(op);
  }
  acrossHosts(
      op, 0, [&](c10d::Backend& column) { return std::vector<WorkPtr>{column.barrier({})}; });
}

} // namespace hsdp
