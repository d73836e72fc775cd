// The all-reduce's three algorithms and the rule that picks one. The rule is
// a pure function of the message size and the group's settings, which are
// rank 0's on every rank: every rank picks the same algorithm.

#include "shm/Detail.hpp"
#include "shm/Engine.hpp"
#include "shm/Reduce.hpp"

#include <algorithm>

namespace hsdp::shm {

using namespace detail;

namespace {

// The two-round algorithms' layout: an n-element message cut into
// slot-sized steps, each step cut into one part per rank, of whole cache
// lines (rank q reduces part q).
class Parts {
 public:
  Parts(size_t n, size_t elementSize, size_t slotBytes, int ranks)
      : n_(n),
        piece_(slotBytes / elementSize),
        unit_(std::max<size_t>(1, kCacheLine / elementSize)),
        ranks_(ranks) {}
  size_t steps() const {
    return ceilDiv(n_, piece_);
  }
  size_t offset(size_t step) const {
    return step * piece_;
  }
  size_t length(size_t step) const {
    return std::min(piece_, n_ - offset(step));
  }
  // Where rank q's part of `step` begins; q == ranks: the step's end.
  size_t begin(size_t step, int q) const {
    const size_t len = length(step);
    return std::min(len, ceilDiv(len, unit_) * q / ranks_ * unit_);
  }

 private:
  size_t n_, piece_, unit_;
  int ranks_;
};

} // namespace

AllReduceAlgorithm
selectAllReduce(size_t bytes, size_t slotBytes, const EngineConfig& config, bool directReads) {
  if (bytes <= std::min(config.oneShotBytes, slotBytes)) {
    return AllReduceAlgorithm::OneShot;
  }
  if (directReads && config.directAllReduceBytes > 0 && bytes >= config.directAllReduceBytes) {
    return AllReduceAlgorithm::Direct;
  }
  return AllReduceAlgorithm::Slots;
}

void Engine::allReduce(
    const char* name,
    void* data,
    size_t n,
    DType dtype,
    RedOp redop,
    Scale scale) {
  auto op = begin(name, Kind::AllReduce, n, dtype, redop, -1);
  auto* buf = static_cast<char*>(data);
  if (const PoolRef mine = pooled(buf, n * dtypeSize(dtype), n * dtypeSize(dtype))) {
    if (allReducePooled(op, mine, buf, n, dtype, redop, scale)) {
      return;
    }
  }
  switch (selectAllReduce(n * dtypeSize(dtype), slotBytes(), config_, directReads_)) {
    case AllReduceAlgorithm::OneShot:
      return allReduceOneShot(op, buf, n, dtype, redop, scale);
    case AllReduceAlgorithm::Direct:
      return allReduceDirect(op, buf, n, dtype, redop, scale);
    case AllReduceAlgorithm::Slots:
      return allReduceSlots(op, buf, n, dtype, redop, scale);
  }
}

bool Engine::allReducePooled(
    OpState& op,
    const PoolRef& mine,
    char* buf,
    size_t n,
    DType dtype,
    RedOp redop,
    Scale scale) {
  const size_t es = dtypeSize(dtype);
  const Parts parts(n, es, n * es, size_); // one step: the whole message
  return pooledStep(
      op, mine, buf, n * es, [&](const std::vector<const char*>& buffers, uint64_t s) {
        // Part q of my buffer is read by rank q alone (and written by me
        // alone, in place, from sources in rank order as every algorithm
        // reduces): nobody else reads it before `reduced`.
        const size_t b = parts.begin(0, rank_), e = parts.begin(0, rank_ + 1);
        std::vector<const void*>& srcs = sources_;
        for (int q = 0; q < size_; ++q) {
          srcs[q] = buffers[q] + b * es;
        }
        reduce(buf + b * es, srcs.data(), size_, e - b, dtype, redop, scale);
        publish(Counter::Reduced, s);
        waitAll(op, Counter::Reduced, s);
        for (int i = 1; i < size_; ++i) {
          const int q = (rank_ + i) % size_;
          const size_t qb = parts.begin(0, q), qe = parts.begin(0, q + 1);
          copyBytes(buf + qb * es, buffers[q] + qb * es, (qe - qb) * es);
        }
      });
}

// One round: every rank reduces all of it from every slot.
void Engine::allReduceOneShot(
    OpState& op,
    char* buf,
    size_t n,
    DType dtype,
    RedOp redop,
    Scale scale) {
  const size_t es = dtypeSize(dtype);
  std::vector<const void*>& srcs = sources_;
  uint64_t s = step_ + 1;
  const int slot = post(op, s, [&](char* dst) { fillSlot(dst, buf, n * es, n * es); });
  for (int r = 0; r < size_; ++r) {
    srcs[r] = segment_.slot(r, slot);
  }
  reduce(buf, srcs.data(), size_, n, dtype, redop, scale);
  publish(Counter::Done, s);
  step_ = s;
}

// Two rounds per step: rank q reduces part q of the step's piece, then
// everyone collects every part. Parts are whole cache lines. Part q of my
// data is read by nobody but me, so it is not copied in; I reduce it in
// place in my own buffer, and peers read the result from there directly.
// The call returns once they have.
void Engine::allReduceDirect(
    OpState& op,
    char* buf,
    size_t n,
    DType dtype,
    RedOp redop,
    Scale scale) {
  const size_t es = dtypeSize(dtype);
  const Parts parts(n, es, slotBytes(), size_);
  std::vector<const void*>& srcs = sources_;
  op.steps = static_cast<uint32_t>(parts.steps());
  uint64_t last = step_;
  for (size_t k = 0; k < parts.steps(); ++k) {
    const size_t len = parts.length(k);
    const size_t a = parts.begin(k, rank_), b = parts.begin(k, rank_ + 1);
    uint64_t s = step_ + 1;
    char* mine = buf + parts.offset(k) * es;
    op.sig.sourceAddress = reinterpret_cast<uint64_t>(mine);
    const int slot = post(op, s, [&](char* dst) {
      const size_t stepBytes = (len - (b - a)) * es;
      fillSlot(dst, mine, a * es, stepBytes);
      fillSlot(dst + b * es, mine + b * es, (len - b) * es, stepBytes);
    });
    for (int r = 0; r < size_; ++r) {
      srcs[r] = r == rank_ ? mine + a * es : segment_.slot(r, slot) + a * es;
    }
    reduce(mine + a * es, srcs.data(), size_, b - a, dtype, redop, scale);
    publish(Counter::Reduced, s);
    waitAll(op, Counter::Reduced, s);
    for (int i = 1; i < size_; ++i) {
      const int q = (rank_ + i) % size_;
      const size_t qa = parts.begin(k, q), qb = parts.begin(k, q + 1);
      readPeer(
          op,
          q,
          segment_.control(q).sig[slot].sourceAddress + qa * es,
          mine + qa * es,
          (qb - qa) * es);
    }
    publish(Counter::Done, s);
    step_ = last = s;
  }
  waitAll(op, Counter::Done, last);
}

// Two rounds per step through the slots: rank q reduces part q of every
// slot into its own slot, then everyone copies every part out.
void Engine::allReduceSlots(
    OpState& op,
    char* buf,
    size_t n,
    DType dtype,
    RedOp redop,
    Scale scale) {
  const size_t es = dtypeSize(dtype);
  const Parts parts(n, es, slotBytes(), size_);
  std::vector<const void*>& srcs = sources_;
  op.steps = static_cast<uint32_t>(parts.steps());
  for (size_t k = 0; k < parts.steps(); ++k) {
    char* data = buf + parts.offset(k) * es;
    uint64_t s = step_ + 1;
    const int slot = post(
        op, s, [&](char* dst) { fillSlot(dst, data, parts.length(k) * es, parts.length(k) * es); });
    const size_t a = parts.begin(k, rank_), b = parts.begin(k, rank_ + 1);
    for (int r = 0; r < size_; ++r) {
      srcs[r] = segment_.slot(r, slot) + a * es;
    }
    reduce(segment_.slot(rank_, slot) + a * es, srcs.data(), size_, b - a, dtype, redop, scale);
    publish(Counter::Reduced, s);
    waitAll(op, Counter::Reduced, s);
    for (int i = 0; i < size_; ++i) {
      const int q = (rank_ + i) % size_;
      const size_t qa = parts.begin(k, q), qb = parts.begin(k, q + 1);
      copyBytes(data + qa * es, segment_.slot(q, slot) + qa * es, (qb - qa) * es);
    }
    publish(Counter::Done, s);
    step_ = s;
  }
}

} // namespace hsdp::shm
