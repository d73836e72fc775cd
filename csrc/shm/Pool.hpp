#pragma once

// One rank's pool of communication buffers, in memory its peers can map.
//
// The pool grows by chunks: anonymous shared memory (memfd_create), never
// named in /dev/shm, so nothing is left behind whatever happens to the
// process (exit, kill -9, abort): a chunk lives as long as a file descriptor
// or a mapping of it. A peer that meets one of this rank's buffers in a
// collective opens the chunk through /proc/<pid>/fd/<fd> (allowed where the
// engine's direct reads are: same user, ptrace access) and maps it read-only
// once; from then on it reads this rank's buffers with plain loads, no
// system call. Chunks are never unmapped or reused while the pool lives, so
// a peer's mapping stays valid for the life of its engine.
//
// Buffers are carved from the newest chunk, 64-byte aligned; a released
// buffer is reused by the next request of the same rounded size (FSDP2
// allocates the same sizes every step). A request that would take the pool
// past its bound gets nothing (the caller falls back to ordinary memory).
// Thread-safe: tensors die on any thread; the engine's worker looks
// buffers up.

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace hsdp::shm {

// Where a pool buffer is, as a peer needs it (published in a signature; a
// peer checks every field against the chunk it opens before using it).
struct PoolRef {
  uint32_t chunk = 0; // 1-based index in the owner's pool; 0: not a pool buffer
  int32_t fd = -1;    // the chunk's descriptor in the owner's process
  uint64_t inode = 0;
  uint64_t chunkBytes = 0;
  uint64_t offset = 0; // of the buffer in its chunk
  explicit operator bool() const {
    return chunk != 0;
  }
};

struct PoolStats {
  uint64_t reservedBytes = 0; // in chunks
  uint64_t liveBytes = 0;     // handed out and not yet released
  uint64_t chunks = 0;
  uint64_t allocations = 0;
  uint64_t refused = 0; // requests past the bound
};

class Pool {
 public:
  // At most `maxBytes` in chunks of at least `chunkBytes` each.
  Pool(size_t maxBytes, size_t chunkBytes);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // `bytes` of pool memory, or null when the bound would be exceeded (or
  // the system refuses a new chunk). Release it with release().
  void* allocate(size_t bytes);
  void release(void* buffer);
  // The pool buffer holding [p, p + bytes), if it is in one of this pool's
  // chunks (a view into a pool buffer counts: FSDP2 gathers in place).
  PoolRef find(const void* p, size_t bytes) const;
  PoolStats stats() const;

  static constexpr size_t kAlignment = 64;
  // A bound on chunk indices a peer accepts (a corrupted index must not
  // make it allocate a table of billions).
  static constexpr uint32_t kMaxChunks = 1 << 16;

 private:
  struct Chunk {
    char* base;
    size_t bytes;
    int fd;
    uint64_t inode;
    size_t used; // bump pointer
  };
  bool grow(size_t atLeast); // under mutex_

  const size_t maxBytes_;
  const size_t chunkBytes_;
  mutable std::mutex mutex_;
  std::vector<Chunk> chunks_;
  std::map<char*, size_t> live_;          // buffer -> rounded size
  std::multimap<size_t, char*> released_; // rounded size -> buffer
  PoolStats stats_;
};

} // namespace hsdp::shm

namespace hsdp::shm {

// A peer's chunk, mapped read-only into this process.
class PeerChunk {
 public:
  PeerChunk() = default;
  // Opens chunk `ref` of process `pid` and maps it; checks the chunk is the
  // one `ref` describes (its inode and size). Throws std::runtime_error
  // with the reason (errno's, or what differed) when it cannot.
  PeerChunk(int32_t pid, const PoolRef& ref);
  PeerChunk(PeerChunk&& other) noexcept;
  PeerChunk& operator=(PeerChunk&& other) noexcept;
  PeerChunk(const PeerChunk&) = delete;
  PeerChunk& operator=(const PeerChunk&) = delete;
  ~PeerChunk();

  const char* base() const {
    return base_;
  }
  size_t bytes() const {
    return bytes_;
  }
  uint64_t inode() const {
    return inode_;
  }

 private:
  const char* base_ = nullptr;
  size_t bytes_ = 0;
  uint64_t inode_ = 0;
};

} // namespace hsdp::shm
