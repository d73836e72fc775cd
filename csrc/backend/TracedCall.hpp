#pragma once

// A call's flight-record entry, from the start of the call to its
// completion: follow() hands the entry to what completes the call; if the
// call raises first, the entry is closed as failed and the record dumped.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <optional>

#include "backend/FlightRecorder.hpp"
#include "backend/WorkOnStream.hpp"
#include "backend/routes/Route.hpp"

namespace hsdp {

class TracedCall {
 public:
  // `call.seq` names the entry, already started; 0: the call has none
  // (point-to-point ops are not collectives).
  // `trace`: the group's own, which outlives the call (no reference count
  // is taken per call; a Work's callback takes one).
  // `streams`: the group's recorder streams, where an async CUDA entry's
  // "done" event is recorded after the op (both outlive the call).
  TracedCall(
      const std::shared_ptr<FlightRecorder>& trace,
      const std::shared_ptr<SideStreams>& streams,
      Call call);
  TracedCall(const TracedCall&) = delete;
  TracedCall& operator=(const TracedCall&) = delete;
  ~TracedCall();

  const Call& call() const {
    return call_;
  }

  // The entry completes now (a synchronous call: on CUDA, when the caller's
  // stream gets there), with the Work's future (on whatever thread completes
  // it), or as the route recorded it. Inside a coalescing block
  // (`inBlock`) NCCL launches nothing before endCoalescing, so a CUDA entry
  // then completes at enqueue. Returns the completion's Work.
  c10::intrusive_ptr<c10d::Work> follow(Completion done, bool inBlock);

 private:
  const std::shared_ptr<FlightRecorder>& trace_;
  const std::shared_ptr<SideStreams>& streams_;
  const Call call_;
  const int exceptionsAtStart_;
  bool handedOver_ = false;
};

// Entry `seq` of `trace` completes when `device`'s current stream gets here
// (the slot's mark is recorded on it); now where `device` is empty or its
// stream is being captured (a captured event may not be queried).
void completeEntry(FlightRecorder& trace, uint64_t seq, std::optional<c10::Device> device);

} // namespace hsdp
