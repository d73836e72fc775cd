#pragma once

// A group of W engines over one segment, its ranks run as threads of this
// process: the fixture of every engine test.

#include "shm/Engine.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace hsdp::shm {

// A small slot, so that "several slots" stays cheap under the sanitizers.
constexpr size_t kSlotBytes = 4096;

inline EngineConfig testConfig(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  EngineConfig c;
  c.timeout = timeout;
  c.spin = std::chrono::nanoseconds(0);     // more ranks than cores: no spinning, as hsdp does
  c.yield = std::chrono::microseconds(100); // every wait takes the yield path, then the futex
  c.oneShotBytes = 256;
  c.directReadBytes = 512;
  c.pooledReadBytes = 512;
  c.directAllReduceBytes = 512;
  // Reduce-scatters from 256 bytes a rank write around the cache: the bitwise
  // checks cover both stores (all-reduces always write through the cache).
  c.streamStoreBytes = 256;
  // Slot steps of 256 bytes up to 2 KiB are written around the cache, larger
  // ones (up to the 4 KiB slot) through it: both fills in every test.
  c.streamSlotBytes = 256;
  c.streamSlotTimedBytes = 2048;
  return c;
}

inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

class Group {
 public:
  // W engines over one fresh segment (its name is unlinked at once), and one
  // more mapping of it that belongs to no rank: the view a stray writer has.
  Group(int size, EngineConfig config, bool directReads, size_t slotBytes = kSlotBytes) {
    const std::string name = Segment::randomName();
    std::vector<Segment> segments;
    segments.reserve(size);
    segments.push_back(Segment::create(name, size, slotBytes));
    for (int r = 1; r < size; ++r) {
      segments.push_back(Segment::open(name, size, slotBytes));
    }
    view_ = std::make_unique<Segment>(Segment::open(name, size, slotBytes));
    Segment::unlink(name);
    for (int r = 0; r < size; ++r) {
      engines_.push_back(std::make_unique<Engine>(std::move(segments[r]), r, config));
      if (directReads) {
        engines_.back()->enableDirectReads();
      }
    }
  }

  Engine& engine(int rank) {
    return *engines_[rank];
  }
  int size() const {
    return static_cast<int>(engines_.size());
  }
  Segment& view() {
    return *view_;
  }

  // Runs body(engine) on every rank at once; returns each rank's error ("" if none).
  std::vector<std::string> run(const std::function<void(Engine&)>& body) {
    return runFrom(-1, body, nullptr);
  }

  // Runs body(engine) on rank `first` alone until it has posted its next
  // step, calls between(step) (nothing else touches the segment then: the
  // other ranks start after it returns), then runs the other ranks. Returns
  // each rank's error: "threw: <message>" for a CommError, "threw (not a
  // CommError): <message>" for anything else.
  std::vector<std::string> runFrom(
      int first,
      const std::function<void(Engine&)>& body,
      const std::function<void(uint64_t)>& between) {
    std::vector<std::string> errors(engines_.size());
    auto rank = [&](size_t r) {
      try {
        body(*engines_[r]);
      } catch (const CommError& e) {
        errors[r] = std::string("threw: ") + e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("threw (not a CommError): ") + e.what();
      }
    };
    std::vector<std::thread> threads;
    if (first >= 0) {
      const auto& posted = view_->control(first).posted;
      const uint64_t before = posted.load(std::memory_order_acquire);
      threads.emplace_back(rank, static_cast<size_t>(first));
      const auto giveUp = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      uint64_t step = before;
      while ((step = posted.load(std::memory_order_acquire)) == before &&
             std::chrono::steady_clock::now() < giveUp) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      EXPECT_NE(step, before) << "rank " << first << " never posted";
      between(step);
    }
    for (size_t r = 0; r < engines_.size(); ++r) {
      if (static_cast<int>(r) != first) {
        threads.emplace_back(rank, r);
      }
    }
    for (auto& t : threads) {
      t.join();
    }
    return errors;
  }

 private:
  std::vector<std::unique_ptr<Engine>> engines_;
  std::unique_ptr<Segment> view_;
};

inline void expectNoErrors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
  }
}

} // namespace hsdp::shm
