#include "backend/FlightRecorder.hpp"

#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

namespace hsdp {

namespace {

int64_t nowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The recorders alive in this process: what dumpAll() and SIGUSR1 write.
std::mutex registryMutex;
std::set<FlightRecorder*>& registry() {
  static auto* recorders = new std::set<FlightRecorder*>(); // never destroyed: used at exit
  return *recorders;
}

// SIGUSR1: the handler only posts a semaphore (async-signal-safe); a thread
// of its own writes the files. Installed only where SIGUSR1 still has its
// default action (which would kill the process): a handler the program
// installed itself is left alone.
sem_t dumpRequests;
void onSigusr1(int) {
  sem_post(&dumpRequests);
}
void installSignalDumper() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (sigaction(SIGUSR1, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) {
      return;
    }
    sem_init(&dumpRequests, 0, 0);
    std::thread([] {
      while (true) {
        if (sem_wait(&dumpRequests) == 0) {
          FlightRecorder::dumpAll("SIGUSR1");
        }
      }
    }).detach();
    struct sigaction action {};
    action.sa_handler = onSigusr1;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &action, nullptr);
    // A forked child (a DataLoader worker) has the handler but not the
    // thread: give it SIGUSR1's default action back.
    pthread_atfork(nullptr, nullptr, [] { signal(SIGUSR1, SIG_DFL); });
  });
}

const char* stateName(int state) {
  return state == 0 ? "started" : state == 1 ? "completed" : "failed";
}

} // namespace

FlightRecorder::FlightRecorder(int rank, int size, TraceOptions options)
    : rank_(rank), size_(size), options_(std::move(options)), ring_(options_.entries) {
  if (enabled()) {
    std::lock_guard<std::mutex> lock(registryMutex);
    registry().insert(this);
  }
  if (enabled()) {
    installSignalDumper();
  }
}

FlightRecorder::~FlightRecorder() {
  detach();
}

void FlightRecorder::setGroup(const std::string& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  group_ = group.empty() ? "unnamed" : group;
}

void FlightRecorder::setMembership(int rank, int size) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_ = rank;
  size_ = size;
}

void FlightRecorder::setSnapshot(std::function<std::string()> snapshot) {
  std::lock_guard<std::mutex> lock(mutex_);
  snapshot_ = std::move(snapshot);
}

void FlightRecorder::detach() {
  {
    std::lock_guard<std::mutex> lock(registryMutex);
    registry().erase(this);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  snapshot_ = nullptr;
}

FlightRecorder::Entry* FlightRecorder::find(uint64_t seq) {
  Entry& e = ring_[seq % ring_.size()];
  return e.seq == seq ? &e : nullptr;
}

void FlightRecorder::started(uint64_t seq, const char* op, uint64_t bytes, const char* route) {
  if (!enabled()) {
    return;
  }
  const int64_t now = nowUs();
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[seq % ring_.size()];
  e.seq = seq;
  e.op = op;
  e.route = route;
  e.bytes = bytes;
  e.startUs = now;
  e.endUs = 0;
  e.state = State::Started;
  e.error.clear();
  e.marked = false;
}

void FlightRecorder::finished(uint64_t seq, std::string_view error) {
  if (!enabled()) {
    return;
  }
  const int64_t now = nowUs();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* e = find(seq); e != nullptr && e->state == State::Started) {
    e->endUs = now;
    e->state = error.empty() ? State::Completed : State::Failed;
    e->error.assign(error);
    e->marked = false;
  }
}

void FlightRecorder::settle(Entry& e, int64_t now) {
  // A device query may throw (a CUDA error sticks to the context): that is
  // what the dump is for, so the entry says so and the dump goes on.
  try {
    if (!e.mark->reached()) {
      return;
    }
    e.state = State::Completed;
  } catch (const std::exception& error) {
    e.state = State::Failed;
    e.error =
        std::string("the device reported an error when asked whether it ran: ") + error.what();
  }
  e.endUs = now;
  e.marked = false;
}

void FlightRecorder::completesAtMark(
    uint64_t seq,
    shm::FunctionRef<void(std::unique_ptr<DeviceMark>&)> record) {
  if (!enabled()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* e = find(seq); e != nullptr && e->state == State::Started) {
    record(e->mark);
    e->marked = e->mark != nullptr;
  }
}

std::string FlightRecorder::dump(const std::string& reason) {
  if (!enabled()) {
    return "(no flight record: HSDP_TRACE_ENTRIES=0)";
  }
  // The ring is read under the lock, the file written outside it: ops go on
  // recording while a dump waits on a slow or full disk.
  std::string path;
  std::string partial;
  std::ostringstream out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    path = pathLocked();
    // Written beside, then renamed: a reader never sees half a file. Each
    // dump its own: two threads may dump at once.
    partial = path + ".partial." + std::to_string(getpid()) + "." + std::to_string(++dumps_);
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    out << "{\"format\": \"hsdp-trace-1\", \"group\": " << jsonString(group_)
        << ", \"rank\": " << rank_ << ", \"size\": " << size_ << ", \"pid\": " << getpid()
        << ", \"host\": " << jsonString(host) << ", \"reason\": " << jsonString(reason)
        << ", \"dumped_us\": " << nowUs()
        << ", \"where\": " << jsonString(snapshot_ ? snapshot_() : "") << ",\n \"entries\": [";
    const int64_t now = nowUs();
    std::vector<const Entry*> entries;
    for (Entry& e : ring_) {
      if (e.marked) {
        settle(e, now);
      }
      if (e.seq != 0) {
        entries.push_back(&e);
      }
    }
    std::sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
    const char* sep = "\n  ";
    for (const Entry* e : entries) {
      out << sep << "{\"seq\": " << e->seq << ", \"op\": " << jsonString(e->op)
          << ", \"route\": " << jsonString(e->route) << ", \"bytes\": " << e->bytes
          << ", \"state\": \"" << stateName(static_cast<int>(e->state))
          << "\", \"start_us\": " << e->startUs << ", \"end_us\": " << e->endUs
          << ", \"error\": " << jsonString(e->error) << "}";
      sep = ",\n  ";
    }
    out << "\n ]}\n";
  }
  // Every rank may create the directory at once: EEXIST is success.
  if (mkdir(options_.dir.c_str(), 0777) != 0 && errno != EEXIST) {
    return "(no flight record: cannot create " + options_.dir + ": " + std::strerror(errno) + ")";
  }
  {
    std::ofstream file(partial, std::ios::trunc);
    file << out.str();
    if (!file) {
      return "(no flight record: writing " + partial + " failed)";
    }
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    return "(no flight record: renaming to " + path + " failed: " + std::strerror(errno) + ")";
  }
  return path;
}

std::string FlightRecorder::failed(uint64_t seq, const std::string& reason) {
  std::string path;
  bool first = false;
  bool reported = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Where another thread's failure came first (its dump may still be in
    // progress), that dump is the one, at the path it writes.
    first = !failureDumped_;
    failureDumped_ = true;
    if (!first) {
      path = pathLocked();
    }
    // A synchronous failure reaches here twice (the route, then the call
    // unwinding): its hooks run once.
    reported = seq != 0 && seq == lastFailed_;
    lastFailed_ = seq;
  }
  if (first) {
    path = dump(reason);
  }
  if (!reported) {
    runAbortHooks();
  }
  return path;
}

void FlightRecorder::runAbortHooks() {
  std::string who;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    who = "rank " + std::to_string(rank_) + ", group " + group_;
  }
  abortHooks_.run(who);
}

std::string FlightRecorder::pathLocked() const {
  return options_.dir + "/hsdp-trace." + group_ + ".rank" + std::to_string(rank_) + ".json";
}

std::vector<std::string> FlightRecorder::dumpAll(const std::string& reason) {
  std::lock_guard<std::mutex> lock(registryMutex);
  std::vector<std::string> paths;
  for (FlightRecorder* r : registry()) {
    paths.push_back(r->dump(reason));
  }
  return paths;
}

} // namespace hsdp
