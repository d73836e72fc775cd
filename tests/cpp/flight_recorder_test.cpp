// The flight recorder's bookkeeping of ops a device finishes later
// (FlightRecorder::completesAtMark): read back from the file a dump writes;
// and what a failure runs (FlightRecorder::failed: one dump, the abort hooks).

#include "backend/FlightRecorder.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// A mark whose answer the test gives; counts the marks made.
class TestMark final : public hsdp::DeviceMark {
 public:
  explicit TestMark(std::function<bool()> reached) : reached_(std::move(reached)) {}
  bool reached() override {
    return reached_();
  }

 private:
  std::function<bool()> reached_;
};

// completesAtMark, with the slot's mark made (once) to answer `reached`.
void completesWhen(hsdp::FlightRecorder& r, uint64_t seq, std::function<bool()> reached) {
  r.completesAtMark(seq, [&](std::unique_ptr<hsdp::DeviceMark>& mark) {
    mark = std::make_unique<TestMark>(std::move(reached));
  });
}

class FlightRecorderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/hsdp-fr-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    std::system(("rm -rf " + dir_).c_str());
  }
  // The dump's text for one entry ("{"seq": N, ...}"), or "" if absent.
  static std::string entry(const std::string& path, int seq) {
    std::ifstream in(path);
    std::stringstream all;
    all << in.rdbuf();
    const std::string text = all.str();
    const auto at = text.find("{\"seq\": " + std::to_string(seq) + ",");
    return at == std::string::npos ? "" : text.substr(at, text.find('}', at) - at + 1);
  }
  std::string dir_;
};

TEST_F(FlightRecorderTest, AnOpOnADeviceIsStartedUntilADumpFindsItDone) {
  hsdp::FlightRecorder r(0, 1, {8, dir_});
  r.started(1, "all_reduce", 64, "inner");
  bool ran = false;
  int asked = 0;
  completesWhen(r, 1, [&] {
    ++asked;
    return ran;
  });
  EXPECT_EQ(asked, 0) << "asked before any dump: the event is never polled";
  EXPECT_NE(entry(r.dump("t"), 1).find("\"state\": \"started\""), std::string::npos);
  ran = true;
  const std::string done = entry(r.dump("t"), 1);
  EXPECT_NE(done.find("\"state\": \"completed\""), std::string::npos) << done;
  EXPECT_EQ(done.find("\"end_us\": 0,"), std::string::npos) << done;
  r.dump("t");
  EXPECT_EQ(asked, 2) << "once seen done, the event is let go";
}

TEST_F(FlightRecorderTest, AFailureIsKeptAndTheEventNotAsked) {
  hsdp::FlightRecorder r(0, 1, {8, dir_});
  r.started(1, "all_reduce", 64, "inner");
  int asked = 0;
  completesWhen(r, 1, [&] { return ++asked > 0; });
  r.finished(1, "NCCL error");
  const std::string e = entry(r.dump("t"), 1);
  EXPECT_NE(e.find("\"state\": \"failed\""), std::string::npos) << e;
  EXPECT_EQ(asked, 0);
}

TEST_F(FlightRecorderTest, OpsRecordWhileADumpWaitsOnItsFile) {
  // The dump's partial file is a FIFO here: writing it blocks until a reader
  // comes, as a slow or full disk would. The ops of the group must go on
  // recording meanwhile (the ring is read under the lock, the file written
  // outside it); before, they waited for the write.
  hsdp::FlightRecorder r(0, 1, {8, dir_});
  r.setGroup("g");
  const std::string path = dir_ + "/hsdp-trace.g.rank0.json";
  const std::string fifo = path + ".partial." + std::to_string(getpid()) + ".1";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  r.started(1, "all_reduce", 64, "inner");
  // The snapshot is taken while the dump reads the ring: from then on the
  // dump is under way, and its write is what blocks.
  std::promise<void> reading;
  r.setSnapshot([&] {
    reading.set_value();
    return std::string("here");
  });
  auto dumped = std::async(std::launch::async, [&] { return r.dump("t"); });
  const bool dumpReading =
      reading.get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  auto recorded = std::async(std::launch::async, [&] {
    r.finished(1, "");
    r.started(2, "broadcast", 8, "inner");
  });
  const bool inTime = recorded.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  // Let the dump finish either way, so that no thread is left blocked: a
  // reader (O_RDWR never blocks on a FIFO) lets its open go on, and the pipe
  // holds the whole dump.
  const int fd = open(fifo.c_str(), O_RDWR | O_NONBLOCK);
  ASSERT_GE(fd, 0);
  const bool finished = dumped.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  close(fd);
  EXPECT_TRUE(dumpReading) << "the dump opened its file before it read the ring";
  EXPECT_TRUE(inTime) << "recording waited for a dump's write";
  ASSERT_TRUE(finished) << "the dump did not finish once its file could be written";
  recorded.wait();
  EXPECT_EQ(dumped.get(), path);
}

TEST_F(FlightRecorderTest, AReusedSlotDropsTheEarlierOpsEvent) {
  hsdp::FlightRecorder r(0, 1, {2, dir_});
  r.started(1, "all_reduce", 64, "inner");
  int asked = 0;
  completesWhen(r, 1, [&] { return ++asked > 0; });
  r.started(3, "broadcast", 8, "inner"); // same slot of a ring of 2
  const std::string path = r.dump("t");
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(entry(path, 1), "");
  EXPECT_NE(entry(path, 3).find("\"state\": \"started\""), std::string::npos);
}

TEST_F(FlightRecorderTest, ADeviceErrorWhileAskingFailsTheEntryNotTheDump) {
  hsdp::FlightRecorder r(0, 1, {8, dir_});
  r.started(1, "all_reduce", 64, "inner");
  completesWhen(
      r, 1, []() -> bool { throw std::runtime_error("CUDA error: an illegal memory access"); });
  const std::string e = entry(r.dump("t"), 1);
  EXPECT_NE(e.find("\"state\": \"failed\""), std::string::npos) << e;
  EXPECT_NE(e.find("illegal memory access"), std::string::npos) << e;
}

TEST_F(FlightRecorderTest, ASlotKeepsItsMarkForTheOpsItHoldsLater) {
  hsdp::FlightRecorder r(0, 1, {2, dir_});
  int made = 0;
  int recorded = 0;
  bool reached = false;
  for (uint64_t seq = 1; seq <= 10; ++seq) {
    r.started(seq, "all_reduce", 64, "inner");
    r.completesAtMark(seq, [&](std::unique_ptr<hsdp::DeviceMark>& mark) {
      if (!mark) {
        ++made;
        mark = std::make_unique<TestMark>([&] { return reached; });
      }
      ++recorded;
    });
  }
  EXPECT_EQ(made, 2) << "one mark a slot of a ring of 2, not one an op";
  EXPECT_EQ(recorded, 10);
  EXPECT_NE(entry(r.dump("t"), 10).find("\"state\": \"started\""), std::string::npos);
  reached = true;
  const std::string path = r.dump("t");
  EXPECT_NE(entry(path, 9).find("\"state\": \"completed\""), std::string::npos);
  EXPECT_NE(entry(path, 10).find("\"state\": \"completed\""), std::string::npos);
}

TEST_F(FlightRecorderTest, AGoneEntryOrAnOffRecorderRecordsNoMark) {
  hsdp::FlightRecorder off(0, 1, {0, dir_});
  int asked = 0;
  off.completesAtMark(1, [&](std::unique_ptr<hsdp::DeviceMark>&) { ++asked; });
  hsdp::FlightRecorder r(0, 1, {2, dir_});
  r.started(1, "all_reduce", 64, "inner");
  r.started(3, "all_reduce", 64, "inner"); // slot of 1 reused
  r.completesAtMark(1, [&](std::unique_ptr<hsdp::DeviceMark>&) { ++asked; });
  r.finished(3, "");
  r.completesAtMark(3, [&](std::unique_ptr<hsdp::DeviceMark>&) { ++asked; });
  EXPECT_EQ(asked, 0);
}

TEST_F(FlightRecorderTest, EveryFailedOpRunsTheAbortHooksTheFirstDumps) {
  hsdp::FlightRecorder r(0, 1, {8, dir_}), off(0, 1, {0, dir_});
  std::vector<std::string> calls;
  ASSERT_TRUE(r.abortHooks().add(2, [&] {
    calls.push_back("raises");
    throw std::runtime_error("a hook that fails");
  }));
  ASSERT_TRUE(r.abortHooks().add(1, [&] { calls.push_back("one"); }));
  ASSERT_TRUE(r.abortHooks().add(3, [&] { calls.push_back("three"); }));
  EXPECT_FALSE(r.abortHooks().add(1, [&] { calls.push_back("replaced"); })) << "an id in use";
  r.started(1, "all_reduce", 64, "shm");
  const std::string first = r.failed(1, "peer lost");
  EXPECT_EQ(calls, (std::vector<std::string>{"one", "raises", "three"}))
      << "in id order, past a throw";
  r.failed(1, "the same op, seen again as the call unwinds");
  EXPECT_EQ(calls.size(), 3u) << "one op's failure runs the hooks once";
  std::remove(first.c_str());
  EXPECT_EQ(r.failed(2, "and again"), first) << "the path of the first failure's dump";
  EXPECT_FALSE(std::ifstream(first).good()) << "a later failure writes no dump";
  EXPECT_EQ(calls.size(), 6u) << "every failed op runs the hooks";
  r.abortHooks().remove(2);
  r.abortHooks().remove(2); // unknown: nothing
  r.runAbortHooks();
  EXPECT_EQ(calls.size(), 8u);
  r.abortHooks().clear();
  r.runAbortHooks();
  EXPECT_EQ(calls.size(), 8u) << "cleared";
  ASSERT_TRUE(off.abortHooks().add(1, [&] { calls.push_back("off"); }));
  off.failed(1, "x");
  EXPECT_EQ(calls.back(), "off") << "an off recorder runs its hooks too";
}

TEST_F(FlightRecorderTest, HooksThatFailTheirOwnOrEachOthersGroupRunOnce) {
  hsdp::FlightRecorder a(0, 1, {8, dir_}), b(0, 1, {8, dir_});
  int runsA = 0, runsB = 0;
  ASSERT_TRUE(a.abortHooks().add(1, [&] {
    ++runsA;
    a.failed(7, "its own group, from a hook");
    b.failed(7, "another group, from a hook");
  }));
  ASSERT_TRUE(b.abortHooks().add(1, [&] {
    ++runsB;
    a.failed(8, "back to the first group");
  }));
  a.failed(1, "first");
  EXPECT_EQ(runsA, 1);
  EXPECT_EQ(runsB, 1);
}

} // namespace
