#pragma once

// How a rank writes a large step into its slot: through the cache or around
// it (non-temporal stores), chosen from its own fills' timings.
//
// Which is faster depends on where the peers run, which can change while a
// job runs: a VM's vCPUs sit on cores that share a cache for seconds, then on
// cores that do not. A cached fill first takes each line of the slot back
// from the peers that read it last step: where their cores share a cache
// with this one that is cheap, and the data then stays in that cache for
// them; where they do not, it costs a round trip through the machine per
// line, and the fill takes 5-15 times as long as a streaming one (measured
// on a 2-vCPU AMD EPYC VM, docs/results/slot-stores-cpu-2026-12-08.md),
// while with a shared cache it took 0.3-2 times as long. So a rank streams
// while its cached fills run more than kSlower times slower per byte than its
// streaming ones, and tries the other kind every kProbeEvery fills to see
// whether that changed. A rank's own choice: the bytes written are the same
// either way, so ranks need not agree.
//
// Pure bookkeeping, no clock: the engine times each fill and records it
// (Engine::fillSlot), so the tests drive it with made-up timings.

#include <cstdint>

namespace hsdp::shm {

class FillChoice {
 public:
  // Cached fills this many times slower per byte than streaming ones: stream.
  static constexpr double kSlower = 3.0;
  // Every this many fills, the kind not chosen, to refresh its timing.
  static constexpr uint32_t kProbeEvery = 64;

  // Whether the next fill streams. Until both kinds have a timing, it tries
  // the cached one first, then the streaming one.
  bool streamNext() {
    if (cachedNsPerByte_ == 0) {
      return false;
    }
    if (streamNsPerByte_ == 0) {
      return true;
    }
    const bool preferred = prefersStreaming();
    return ++fills_ % kProbeEvery == 0 ? !preferred : preferred;
  }

  // A fill of `bytes` took `ns` (streaming or not). The last one of a kind
  // counts: the peers' placement changes at once, and a fill that lost its
  // core misleads the choice for kProbeEvery fills at most.
  void record(bool streaming, double ns, double bytes) {
    if (bytes > 0) {
      (streaming ? streamNsPerByte_ : cachedNsPerByte_) = ns > 0 ? ns / bytes : 1e-9;
    }
  }

  // Whether the recorded timings prefer streaming (the probes aside).
  bool prefersStreaming() const {
    return cachedNsPerByte_ > 0 && streamNsPerByte_ > 0 &&
        cachedNsPerByte_ > kSlower * streamNsPerByte_;
  }

 private:
  double cachedNsPerByte_ = 0;
  double streamNsPerByte_ = 0;
  uint32_t fills_ = 0;
};

} // namespace hsdp::shm
