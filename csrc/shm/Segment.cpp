#include "shm/Segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>

namespace hsdp::shm {

namespace {

size_t roundUp(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

std::string sysError(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

char* mapFd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) {
    throw CommError(sysError("mmap of shared-memory segment " + name + " failed"));
  }
  return static_cast<char*>(p);
}

std::string readFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string linkTarget(const char* path) {
  char buf[256];
  ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, n) : std::string();
}

} // namespace

Layout Layout::compute(int nranks, size_t slotBytes) {
  Layout l;
  l.controlOffset = roundUp(sizeof(Header), 4096);
  l.dataOffset = roundUp(l.controlOffset + sizeof(RankControl) * nranks, 4096);
  l.totalBytes = l.dataOffset + static_cast<size_t>(nranks) * kSlots * slotBytes;
  return l;
}

Segment Segment::create(const std::string& name, int nranks, size_t slotBytes) {
  const Layout layout = Layout::compute(nranks, slotBytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    throw CommError(sysError("shm_open(" + name + ", O_CREAT|O_EXCL) failed"));
  }
  if (ftruncate(fd, static_cast<off_t>(layout.totalBytes)) != 0) {
    std::string msg = sysError(
        "ftruncate of " + name + " to " + std::to_string(layout.totalBytes) + " bytes failed");
    ::close(fd);
    shm_unlink(name.c_str());
    throw CommError(msg);
  }
  char* base = mapFd(fd, layout.totalBytes, name);
  // The file is zero-filled: every counter starts at 0 and brokenBy at 0.
  auto* header = new (base) Header();
  for (int r = 0; r < nranks; ++r) {
    new (base + layout.controlOffset + sizeof(RankControl) * r) RankControl();
  }
  header->version = kLayoutVersion;
  header->nranks = static_cast<uint32_t>(nranks);
  header->slotBytes = slotBytes;
  header->totalBytes = layout.totalBytes;
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&header->magic)
      ->store(kMagic, std::memory_order_release);
  return Segment(base, layout, nranks, slotBytes);
}

Segment Segment::open(const std::string& name, int nranks, size_t slotBytes) {
  const Layout layout = Layout::compute(nranks, slotBytes);
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw CommError(sysError("shm_open(" + name + ") failed"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != layout.totalBytes) {
    ::close(fd);
    throw CommError(
        "shared-memory segment " + name + " has " + std::to_string(st.st_size) +
        " bytes; expected " + std::to_string(layout.totalBytes) +
        " (do all ranks use the same HSDP_SHM_SLOT_BYTES?)");
  }
  char* base = mapFd(fd, layout.totalBytes, name);
  const Header& h = *reinterpret_cast<Header*>(base);
  const uint64_t magic =
      reinterpret_cast<const std::atomic<uint64_t>*>(&h.magic)->load(std::memory_order_acquire);
  if (magic != kMagic || h.version != kLayoutVersion || h.nranks != static_cast<uint32_t>(nranks) ||
      h.slotBytes != slotBytes || h.totalBytes != layout.totalBytes) {
    munmap(base, layout.totalBytes);
    throw CommError(
        "shared-memory segment " + name +
        " does not have the layout this rank expects (magic, version, "
        "rank count or slot size differ)");
  }
  return Segment(base, layout, nranks, slotBytes);
}

void Segment::unlink(const std::string& name) {
  shm_unlink(name.c_str());
}

std::string Segment::randomName() {
  unsigned char bytes[16];
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  if (!urandom.read(reinterpret_cast<char*>(bytes), sizeof bytes)) {
    throw CommError("cannot read /dev/urandom to name a shared-memory segment");
  }
  static const char* hex = "0123456789abcdef";
  std::string name = "/hsdp-";
  for (unsigned char b : bytes) {
    name += hex[b >> 4];
    name += hex[b & 15];
  }
  return name;
}

Segment::Segment(Segment&& other) noexcept
    : base_(other.base_),
      layout_(other.layout_),
      nranks_(other.nranks_),
      slotBytes_(other.slotBytes_) {
  other.base_ = nullptr;
}

Segment::~Segment() {
  if (base_) {
    munmap(base_, layout_.totalBytes);
  }
}

std::string hostIdentity() {
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0) {
    return "";
  }
  const std::string parts[] = {
      readFirstLine("/proc/sys/kernel/random/boot_id"),
      linkTarget("/proc/self/ns/mnt"),
      linkTarget("/proc/self/ns/ipc"),
      linkTarget("/proc/self/ns/pid")};
  std::string identity = host;
  for (const auto& part : parts) {
    if (part.empty()) {
      return "";
    }
    identity += "|" + part;
  }
  return identity;
}

} // namespace hsdp::shm
