#include "backend/TracedCall.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <exception>
#include <memory>
#include <utility>

#include "common/TorchCompat.hpp"

namespace hsdp {

namespace {

// A slot's mark on a CUDA (or other) device: a c10::Event, bound to its
// device at its first record.
class EventMark final : public DeviceMark {
 public:
  explicit EventMark(c10::Device device) : device_(device), event_(device.type()) {}

  bool serves(c10::Device device) const {
    return device_ == device;
  }
  void record(const c10::Stream& stream) {
    event_.record(stream);
  }
  bool reached() override {
    compat::ThreadLocalCaptureMode mode; // a dump may run beside another thread's capture
    return event_.query();
  }

 private:
  const c10::Device device_;
  c10::Event event_;
};

} // namespace

// Called right after a synchronous call (NCCL orders the caller's stream
// after the op) or in the Work's future callback, on the recorder's own
// stream, made to wait for the op's events (follow()).
void completeEntry(FlightRecorder& trace, uint64_t seq, std::optional<c10::Device> device) {
  if (!device) {
    trace.finished(seq, "");
    return;
  }
  c10::impl::VirtualGuardImpl impl(device->type());
  const c10::Stream stream = impl.getStream(*device);
  if (compat::isStreamCapturing(stream)) {
    trace.finished(seq, ""); // a captured event may not be queried
    return;
  }
  trace.completesAtMark(seq, [&](std::unique_ptr<DeviceMark>& mark) {
    auto* event = dynamic_cast<EventMark*>(mark.get());
    if (event == nullptr || !event->serves(*device)) {
      mark = std::make_unique<EventMark>(*device);
      event = static_cast<EventMark*>(mark.get());
    }
    event->record(stream);
  });
}

TracedCall::TracedCall(
    const std::shared_ptr<FlightRecorder>& trace,
    const std::shared_ptr<SideStreams>& streams,
    Call call)
    : trace_(trace),
      streams_(streams),
      call_(std::move(call)),
      exceptionsAtStart_(std::uncaught_exceptions()) {}

TracedCall::~TracedCall() {
  if (handedOver_ || call_.seq == 0 || std::uncaught_exceptions() <= exceptionsAtStart_) {
    return;
  }
  // The route or a synchronous wait raised: the exception the caller gets
  // says what; the record says where in the sequence.
  trace_->finished(call_.seq, "raised an exception (the caller got it)");
  trace_->failed(call_.seq, "collective #" + std::to_string(call_.seq) + " raised an exception");
}

c10::intrusive_ptr<c10d::Work> TracedCall::follow(Completion done, bool inBlock) {
  handedOver_ = true;
  if (call_.seq == 0 || done.endRecorded || !trace_->enabled()) {
    return std::move(done.work);
  }
  const auto device = inBlock ? std::nullopt : call_.device;
  if (!done.work) {
    completeEntry(*trace_, call_.seq, device);
    return {};
  }
  if (device && compat::isCapturing(*device)) {
    // The future's events were recorded on a capturing stream: a callback
    // that waits for them would pull a pool stream into the capture, never
    // joined back. The entry completes at enqueue, as a captured
    // synchronous op's does.
    trace_->finished(call_.seq, "");
    return std::move(done.work);
  }
  try {
    done.work->getFuture()->addCallback(
        [trace = trace_, streams = streams_, seq = call_.seq, device](c10::ivalue::Future& f) {
          if (f.hasError()) {
            const std::string error = f.tryRetrieveErrorMessage();
            trace->finished(seq, error);
            trace->failed(seq, error);
            return;
          }
          if (!device) {
            trace->finished(seq, "");
            return;
          }
          // Not uses_future, which would run this on the next stream of
          // c10's pool in turn (ivalue::Future::invokeCallback's
          // getStreamFromGlobalPool) and make it wait for the op: the
          // group's own recorder stream waits (Future::wait on a completed
          // future: synchronizeWithCurrentStreams), and the "done" event
          // follows the op there. That wait also records each output on
          // the recorder stream (c10's Future has no wait without it), so
          // their blocks are reused once that stream reaches the op
          // (gpu.md's limits); Work::synchronize, which would not, releases
          // WorkNCCL's stash of the inputs.
          c10::StreamGuard guard(streams->get(*device));
          f.wait();
          completeEntry(*trace, seq, device);
        },
        /*uses_future=*/false);
  } catch (const c10::Error&) {
    // A Work without a future (none of the routes' today): the entry stays
    // "started", which a dump reports as such.
  }
  return std::move(done.work);
}

} // namespace hsdp
