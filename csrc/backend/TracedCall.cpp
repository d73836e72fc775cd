#include "backend/TracedCall.hpp"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common/TorchCompat.hpp"

namespace hsdp {

namespace {

struct DeviceLess {
  bool operator()(const c10::Device& a, const c10::Device& b) const {
    return std::make_pair(a.type(), a.index()) < std::make_pair(b.type(), b.index());
  }
};

// The events of entries that are gone, for the next ones: creating and
// destroying a CUDA event per collective costs microseconds of host time on
// every call (ProcessGroupNCCL keeps such a cache too, its CUDAEventCache).
// An event is bound to its device at its first record, so one list a device.
// Never destroyed: entries of the flight recorder may outlive any static.
class EventPool {
 public:
  static EventPool& get() {
    static auto* pool = new EventPool();
    return *pool;
  }

  std::shared_ptr<c10::Event> take(c10::Device device) {
    std::unique_ptr<c10::Event> event;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[device];
      if (!free.empty()) {
        event = std::move(free.back());
        free.pop_back();
      }
    }
    if (!event) {
      event = std::make_unique<c10::Event>(device.type());
    }
    return std::shared_ptr<c10::Event>(
        event.release(), [this, device](c10::Event* e) { give(device, e); });
  }

 private:
  // Enough for the flight recorder's default ring and then some; beyond it
  // events are destroyed, so a burst does not hold them forever.
  static constexpr size_t kKeptPerDevice = 4096;

  void give(c10::Device device, c10::Event* e) {
    std::unique_ptr<c10::Event> event(e);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& free = free_[device];
    if (free.size() < kKeptPerDevice) {
      free.push_back(std::move(event));
    }
  }

  std::mutex mutex_;
  std::map<c10::Device, std::vector<std::unique_ptr<c10::Event>>, DeviceLess> free_;
};

// "Done" for an entry of an op NCCL runs on `device`: an event recorded on
// the device's current stream, queried only when a dump is written. Called
// right after a synchronous call (NCCL orders the caller's stream after the
// op) or in the Work's future callback, on the recorder's own stream, made
// to wait for the op's events (followOnDevice).
// None under graph capture, where an event may not be queried: such an
// entry completes at enqueue.
std::function<bool()> doneOnDevice(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  const c10::Stream stream = impl.getStream(device);
  if (compat::isStreamCapturing(stream)) {
    return nullptr;
  }
  auto event = EventPool::get().take(device);
  event->record(stream);
  return [event] {
    compat::ThreadLocalCaptureMode mode; // a dump may run beside another thread's capture
    return event->query();
  };
}

void completeEntry(FlightRecorder& trace, uint64_t seq, std::optional<c10::Device> device) {
  auto onDevice = device ? doneOnDevice(*device) : nullptr;
  if (onDevice) {
    trace.completesWhen(seq, std::move(onDevice));
  } else {
    trace.finished(seq, "");
  }
}

} // namespace

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
  trace_->dumpOnFailure("collective #" + std::to_string(call_.seq) + " raised an exception");
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
            trace->dumpOnFailure(error);
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
          // follows the op there.
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
