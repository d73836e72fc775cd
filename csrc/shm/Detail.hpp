#pragma once

// Small pieces the engine's units share (Engine.cpp, Wait.cpp and the
// collectives' files); not part of the engine's interface.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>

namespace hsdp::shm::detail {

// Each collective kind a signature carries (Engine::Kind's values, in
// order) and its name in messages; 0 is no kind.
inline constexpr const char* kKindNames[] = {
    "an unknown collective",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather_coalesced",
};
inline const char* kindName(uint32_t kind) {
  return kind < std::size(kKindNames) ? kKindNames[kind] : kKindNames[0];
}

// memcpy for buffers that may be empty: an empty tensor's data pointer may be
// null, and memcpy from or to null is undefined even for 0 bytes.
inline void copyBytes(void* dst, const void* src, size_t n) {
  if (n > 0) {
    std::memcpy(dst, src, n);
  }
}

// The tail of every error about a value in the segment that hsdp never
// writes: a stray writer (a bug elsewhere, or a process that mapped the
// segment) rather than a peer that called something else.
constexpr const char* kCorrupted =
    ": the shared-memory segment holds a value hsdp never writes (was it overwritten?); create "
    "a new process group";

// Makes bytes another process wrote safe to print: messages and flight
// records are text.
inline void makePrintable(char* text) {
  for (char* c = text; *c != '\0'; ++c) {
    if (*c < 32 || *c > 126) {
      *c = '?';
    }
  }
}

inline size_t ceilDiv(size_t a, size_t b) {
  return (a + b - 1) / b;
}

// A pid that no longer runs: gone (ESRCH) or a zombie nobody reaped yet
// (Wait.cpp).
bool processGone(int32_t pid);
// "rank R (pid P) exited before finishing this collective".
std::string peerExited(const std::string& rank, int32_t pid);

} // namespace hsdp::shm::detail
