// The flight recorder's bookkeeping of ops a device finishes later
// (FlightRecorder::completesWhen): read back from the file a dump writes.

#include "backend/FlightRecorder.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace {

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
  r.completesWhen(1, [&] {
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
  r.completesWhen(1, [&] { return ++asked > 0; });
  r.finished(1, "NCCL error");
  const std::string e = entry(r.dump("t"), 1);
  EXPECT_NE(e.find("\"state\": \"failed\""), std::string::npos) << e;
  EXPECT_EQ(asked, 0);
}

TEST_F(FlightRecorderTest, AReusedSlotDropsTheEarlierOpsEvent) {
  hsdp::FlightRecorder r(0, 1, {2, dir_});
  r.started(1, "all_reduce", 64, "inner");
  int asked = 0;
  r.completesWhen(1, [&] { return ++asked > 0; });
  r.started(3, "broadcast", 8, "inner"); // same slot of a ring of 2
  const std::string path = r.dump("t");
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(entry(path, 1), "");
  EXPECT_NE(entry(path, 3).find("\"state\": \"started\""), std::string::npos);
}

TEST_F(FlightRecorderTest, ADeviceErrorWhileAskingFailsTheEntryNotTheDump) {
  hsdp::FlightRecorder r(0, 1, {8, dir_});
  r.started(1, "all_reduce", 64, "inner");
  r.completesWhen(
      1, []() -> bool { throw std::runtime_error("CUDA error: an illegal memory access"); });
  const std::string e = entry(r.dump("t"), 1);
  EXPECT_NE(e.find("\"state\": \"failed\""), std::string::npos) << e;
  EXPECT_NE(e.find("illegal memory access"), std::string::npos) << e;
}

} // namespace
