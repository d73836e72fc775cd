#include "shm/Pool.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hsdp::shm {

namespace {

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

// Chunks are whole huge-page-sized multiples: a large request gets a chunk
// of its own, rounded so that its tail is not wasted on tiny remainders.
constexpr size_t kChunkRounding = 2 << 20;

} // namespace

Pool::Pool(size_t maxBytes, size_t chunkBytes)
    : maxBytes_(maxBytes), chunkBytes_(std::max(chunkBytes, kChunkRounding)) {}

Pool::~Pool() {
  for (const Chunk& c : chunks_) {
    munmap(c.base, c.bytes);
    ::close(c.fd);
  }
}

bool Pool::grow(size_t atLeast) {
  // A chunk of chunkBytes_, or of what is left under the bound, or of the
  // request if it is larger.
  const size_t left = maxBytes_ - std::min(maxBytes_, stats_.reservedBytes);
  const size_t bytes = roundUp(std::max(atLeast, std::min(chunkBytes_, left)), kChunkRounding);
  if (stats_.reservedBytes + bytes > maxBytes_ || chunks_.size() >= kMaxChunks) {
    return false;
  }
  const int fd = memfd_create("hsdp-pool", MFD_CLOEXEC);
  if (fd < 0) {
    return false;
  }
  struct stat st {};
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0 || fstat(fd, &st) != 0) {
    ::close(fd);
    return false;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    ::close(fd);
    return false;
  }
  chunks_.push_back(Chunk{static_cast<char*>(p), bytes, fd, static_cast<uint64_t>(st.st_ino), 0});
  stats_.reservedBytes += bytes;
  stats_.chunks = chunks_.size();
  return true;
}

void* Pool::allocate(size_t bytes) {
  const size_t rounded = roundUp(std::max<size_t>(bytes, 1), kAlignment);
  std::lock_guard<std::mutex> lock(mutex_);
  char* buffer = nullptr;
  if (auto it = released_.find(rounded); it != released_.end()) {
    buffer = it->second;
    released_.erase(it);
  } else {
    if (chunks_.empty() || chunks_.back().bytes - chunks_.back().used < rounded) {
      if (!grow(rounded)) {
        // Past the bound: a larger released buffer still serves it.
        auto larger = released_.lower_bound(rounded);
        if (larger == released_.end()) {
          ++stats_.refused;
          return nullptr;
        }
        buffer = larger->second;
        stats_.liveBytes += larger->first;
        live_[buffer] = larger->first;
        released_.erase(larger);
        ++stats_.allocations;
        return buffer;
      }
    }
    Chunk& c = chunks_.back();
    buffer = c.base + c.used;
    c.used += rounded;
  }
  live_[buffer] = rounded;
  stats_.liveBytes += rounded;
  ++stats_.allocations;
  return buffer;
}

void Pool::release(void* buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(static_cast<char*>(buffer));
  if (it == live_.end()) {
    return; // not ours: never happens through the allocator's deleter
  }
  stats_.liveBytes -= it->second;
  released_.emplace(it->second, it->first);
  live_.erase(it);
}

PoolRef Pool::find(const void* p, size_t bytes) const {
  const auto* at = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (at >= c.base && at <= c.base + c.bytes &&
        bytes <= static_cast<size_t>(c.base + c.bytes - at)) {
      return PoolRef{
          static_cast<uint32_t>(i + 1), c.fd, c.inode, c.bytes, static_cast<uint64_t>(at - c.base)};
    }
  }
  return {};
}

PoolStats Pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

PeerChunk::PeerChunk(int32_t pid, const PoolRef& ref) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(ref.fd);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot stat " + path + ": " + std::strerror(err));
  }
  // The descriptor must still be the chunk the peer described: a chunk is
  // never closed while its pool lives, so anything else is a stale or
  // corrupted reference.
  if (static_cast<uint64_t>(st.st_ino) != ref.inode ||
      static_cast<uint64_t>(st.st_size) != ref.chunkBytes) {
    ::close(fd);
    throw std::runtime_error(
        path + " is not the pool chunk its owner published (inode " + std::to_string(st.st_ino) +
        ", " + std::to_string(st.st_size) + " bytes; published inode " + std::to_string(ref.inode) +
        ", " + std::to_string(ref.chunkBytes) + " bytes)");
  }
  void* p = mmap(nullptr, ref.chunkBytes, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    throw std::runtime_error("cannot map " + path + ": " + std::strerror(err));
  }
  base_ = static_cast<const char*>(p);
  bytes_ = ref.chunkBytes;
  inode_ = ref.inode;
}

PeerChunk::PeerChunk(PeerChunk&& other) noexcept
    : base_(other.base_), bytes_(other.bytes_), inode_(other.inode_) {
  other.base_ = nullptr;
}

PeerChunk& PeerChunk::operator=(PeerChunk&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) {
      munmap(const_cast<char*>(base_), bytes_);
    }
    base_ = other.base_;
    bytes_ = other.bytes_;
    inode_ = other.inode_;
    other.base_ = nullptr;
  }
  return *this;
}

PeerChunk::~PeerChunk() {
  if (base_ != nullptr) {
    munmap(const_cast<char*>(base_), bytes_);
  }
}

} // namespace hsdp::shm
