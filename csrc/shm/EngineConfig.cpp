// The engine's settings from hsdp's one configuration table: the only file
// of the engine that knows the table (common/ knows nothing of the engine).
// Built with common/Config.cpp wherever that is, not into hsdp_shm, which
// stays free of the table.

#include "common/Config.hpp"
#include "shm/Engine.hpp"

namespace hsdp::shm {

EngineConfig
engineConfigFor(const Config& config, int groupSize, std::chrono::milliseconds groupTimeout) {
  EngineConfig e;
  e.timeout = config.engineTimeout(groupTimeout);
  e.spin = config.spin(groupSize);
  e.yield = std::chrono::microseconds(config.yieldUs);
  e.oneShotBytes = static_cast<size_t>(config.oneShotBytes);
  // Set, one threshold serves both paths (0 turns both off); auto, the pool's
  // is fixed and the ordinary buffers' provisional until the group measures
  // its own.
  e.pooledReadBytes = config.pooledReadBytes();
  e.directReadBytes = e.pooledReadBytes;
  e.measureDirectReadBytes = !config.directReadBytes.has_value();
  e.directAllReduceBytes = static_cast<size_t>(config.directAllReduceBytes);
  e.streamStoreBytes = config.streamStoreBytesFor(groupSize);
  e.streamSlotBytes = static_cast<size_t>(config.streamSlotBytes);
  e.streamSlotTimedBytes = static_cast<size_t>(config.streamSlotTimedBytes);
  return e;
}

} // namespace hsdp::shm
